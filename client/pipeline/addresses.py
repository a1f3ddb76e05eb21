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
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, wait

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
    return _is_ip(host) and ipaddress.ip_address(host).is_unspecified


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


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


LOOPBACK, PRIVATE, GLOBAL = "loopback", "private", "global"
"""The scopes of a dialable address: this machine; a private network (RFC 1918, unique-local, shared and
documentation ranges: whatever is neither this machine nor the internet); the internet."""
_PLACES = {LOOPBACK: "this machine", PRIVATE: "a private network", GLOBAL: "the internet"}
RESOLVED_FOR = 60.0
"""Seconds a DNS name's resolution is kept before it is looked up again."""
RETRY_AFTER = 10.0
"""Seconds a name that did not resolve is left unresolved before it is looked up again."""
RESOLVE_WAIT = 0.2
"""Seconds a caller waits for a lookup it starts: a name a fast resolver answers is dialled at once, and one whose
resolver is slow (a member's choice) delays a directory refresh by no more, once a lookup."""


class Resolving(ValueError):
    """A name whose lookup has not answered yet: its record is left out until it has, without a warning."""


def split_endpoint(address: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port``) as a worker's record names it, split; ValueError unless the host is an IP address
    or DNS name that names one machine and the port is 1 to 65535 (a gRPC target such as ``unix:/path`` or
    ``dns:///name`` is no endpoint)."""
    host, colon, port = address.rpartition(":")
    bracketed = host.startswith("[") and host.endswith("]")
    host = host[1:-1] if bracketed else host
    if not colon or not re.fullmatch(r"[1-9][0-9]{0,4}", port) or int(port) > 65535:
        raise ValueError(f"{address!r} is not host:port with a port from 1 to 65535")
    try:
        named = public_host(host)
    except ValueError:
        named = None
    if named != host or bracketed != (":" in host) or host.endswith("."):
        raise ValueError(f"{address!r} does not name one machine by its IP address or DNS name")
    return host, int(port)


def scope(host: str) -> str | None:
    """Where IP address ``host`` is (``LOOPBACK``, ``PRIVATE``, ``GLOBAL``), or None for an address no worker is
    dialled at: link-local, multicast, reserved or unspecified."""
    address = ipaddress.ip_address(host)
    if address.is_loopback:
        return LOOPBACK
    if address.is_link_local or address.is_multicast or address.is_reserved or address.is_unspecified:
        return None
    return GLOBAL if address.is_global else PRIVATE


def reach_of(own_hosts: list[str]) -> frozenset[str]:
    """The scopes a client whose DHT node is reached at ``own_hosts`` dials workers in: every scope in a run on this
    machine alone (its node on loopback only); private and global on a private network; global on the internet. A
    record naming this machine or a private network in a run across the internet is a member pointing trainers
    at services of theirs, never a worker: one an honest worker's --public-host would not make."""
    scopes = {GLOBAL if _is_dns_name(h) else scope(h) if _is_ip(h) else None for h in own_hosts}
    if scopes == {LOOPBACK}:
        return frozenset({LOOPBACK, PRIVATE, GLOBAL})
    return frozenset({PRIVATE, GLOBAL}) if PRIVATE in scopes else frozenset({GLOBAL})


class Dialing:
    """Which worker addresses a client dials, and at what IP address (``reach_of``). A DNS name is resolved here,
    and dialled at the address checked, so that a name resolving elsewhere a moment later (DNS rebinding) cannot
    redirect the call. Lookups run on threads of their own: a caller waits ``RESOLVE_WAIT`` at most for one, and
    meanwhile dials a name at the address its last lookup checked, or not at all (``Resolving``)."""

    def __init__(self, reach: frozenset[str], resolve: Callable[..., list] = socket.getaddrinfo,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.reach = reach
        self._resolve = resolve
        self._clock = clock
        self._resolved: dict[str, tuple[float, str | None, str]] = {}  # name -> (until, IP, or why none)
        self._pending: dict[str, Future[str]] = {}
        self._lock = threading.Lock()

    def target(self, address: str) -> str:
        """The endpoint to dial for a record's ``address``; ValueError saying why it is not dialled (``Resolving``
        while its name's first lookup has not answered)."""
        host, port = split_endpoint(address)
        ip = self._ip(host) if _is_dns_name(host) else host
        where = scope(ip)
        if where not in self.reach:
            named = address if host == ip else f"{address} ({ip})"
            place = "link-local, multicast or reserved" if where is None else f"on {_PLACES[where]}"
            raise ValueError(f"its address {named} is {place}, and this client dials workers only on "
                             f"{' or '.join(_PLACES[s] for s in _PLACES if s in self.reach)}")
        return endpoint(ip, port)

    def _ip(self, name: str) -> str:
        with self._lock:
            kept = self._resolved.get(name)
            pending = self._pending.get(name)
            started = pending is None and (kept is None or kept[0] < self._clock())
            if started:
                pending = self._pending[name] = self._look_up(name)
        if pending is not None:
            wait([pending], timeout=RESOLVE_WAIT if started else 0)
            if pending.done():
                kept = self._settle(name, pending)
        if kept is None:
            raise Resolving(f"its address's name {name} is being looked up")
        if kept[1] is None:
            raise ValueError(kept[2])
        return kept[1]

    def _look_up(self, name: str) -> Future[str]:
        """Resolve ``name`` on a daemon thread of its own (a resolver that never answers holds up neither this
        client's refreshes nor its exit); its first IP address, or the error, in the future returned."""
        found: Future[str] = Future()

        def run() -> None:
            try:
                answers = self._resolve(name, None, type=socket.SOCK_STREAM)
                found.set_result(str(ipaddress.ip_address(answers[0][4][0].partition("%")[0])))
            except BaseException as exc:  # a resolver's failure, of whatever kind, is this name's, not the caller's
                found.set_exception(exc)

        threading.Thread(target=run, name="psyswarm-dns", daemon=True).start()
        return found

    def _settle(self, name: str, lookup: Future[str]) -> tuple[float, str | None, str]:
        """Keep what a finished lookup found: the address for ``RESOLVED_FOR``, or why none for ``RETRY_AFTER``."""
        try:
            kept: tuple[float, str | None, str] = (self._clock() + RESOLVED_FOR, lookup.result(), "")
        except Exception as exc:  # OSError, or a malformed answer: either way the name does not resolve
            kept = (self._clock() + RETRY_AFTER, None, f"its address's name {name} does not resolve ({exc})")
        with self._lock:
            if self._pending.get(name) is lookup:
                del self._pending[name]
                self._resolved[name] = kept
            return self._resolved.get(name, kept)
