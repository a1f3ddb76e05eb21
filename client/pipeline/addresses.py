"""Where peers reach a client, which need not be where it listens.

A machine behind a router listens on its private address and is reached at its public one, through ports the
router forwards to it; a machine listening on every interface (``0.0.0.0``) names none of them. Its worker's record
and its DHT node must then tell peers the address they can reach (``--public-host``): an IP address or a DNS name.
The ports stay those the client listens on, so a router must forward each port unchanged.
"""

from __future__ import annotations

import ipaddress
import re
import socket

MAX_NAME = 240
"""The longest DNS name taken: its worker's address (``name:port``) must fit a record's 255 characters."""
_LABEL = r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)"
_DNS_NAME = re.compile(rf"{_LABEL}(\.{_LABEL})*\.?")


def public_host(public: str | None) -> str | None:
    """``--public-host`` checked and in canonical form (None: not given). ValueError, naming the fix, for an address
    peers cannot reach: one that names every interface, a multicast group or an interface's scope, or neither an
    IP address nor a DNS name."""
    if public is None:
        return None
    try:
        address = ipaddress.ip_address(public)
    except ValueError:
        if len(public) > MAX_NAME:
            raise ValueError(f"--public-host is {len(public)} characters long: give a name of at most {MAX_NAME}, "
                             "or the IP address other machines reach this one at") from None
        if not _is_dns_name(public):
            raise ValueError(f"--public-host {public!r} is neither an IP address nor a DNS name: give the address "
                             "other machines reach this one at, such as 203.0.113.7 or node.example.org") from None
        return public
    if address.is_unspecified or address.is_multicast:
        raise ValueError(f"--public-host {public} names no single machine: give the address other machines reach "
                         "this one at, such as 203.0.113.7")
    if getattr(address, "scope_id", None):
        raise ValueError(f"--public-host {public} names an interface of this machine, which means nothing to "
                         "others: drop the %scope")
    return str(getattr(address, "ipv4_mapped", None) or address)


def worker_host(listen_host: str, public: str | None) -> str:
    """The host a worker's record names for trainers: ``public`` (checked) when given, else ``listen_host``. A
    record holds one address, so a worker listening on every interface must name one (a DHT node need not:
    libp2p announces each interface's)."""
    public = public_host(public)
    if public is not None:
        return public
    if _unspecified(listen_host):
        raise ValueError(f"--host {listen_host} listens on every interface but names none for trainers to reach: "
                         "give --public-host, the address other machines reach this one at (its IP or DNS name)")
    return listen_host


def _unspecified(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False


def _is_dns_name(name: str) -> bool:
    """A DNS name (RFC 1123 labels) whose last label is not all digits, which only a mistyped IP address
    (``10.0.0.256``) would have."""
    return bool(_DNS_NAME.fullmatch(name)) and not name.rstrip(".").rsplit(".", 1)[-1].isdigit()


def endpoint(host: str, port: int) -> str:
    """``host:port`` as gRPC dials it (an IPv6 address in brackets)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def multiaddr(host: str, port: int) -> str:
    """The libp2p multiaddr of TCP ``host:port`` (``/ip4``, ``/ip6`` or ``/dns``), as a DHT node announces it."""
    try:
        version = ipaddress.ip_address(host).version
    except ValueError:
        return f"/dns/{host.rstrip('.')}/tcp/{port}"
    return f"/ip{version}/{host}/tcp/{port}"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now, for a listener that must be announced before it binds (a port another
    process takes meanwhile makes that listener fail to start, loudly)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def announced_dht(host: str, port: int, public: str | None) -> tuple[int, list[str]]:
    """The port a DHT node listening on ``host:port`` binds, and the multiaddrs it announces so that peers reach
    it at ``public``: none when that is not given (libp2p announces where it listens); with port 0, one picked
    now, as the announcement names it before the node binds."""
    if public is None or public == host:
        return port, []
    port = port or free_port(host)
    return port, [multiaddr(public, port)]
