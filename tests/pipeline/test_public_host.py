"""A client behind a router: it listens on its private address, and peers reach it at its public one through ports
the router forwards unchanged (``client.pipeline.addresses``, ``--public-host``). Here the private address is
127.0.0.1 and the router is a relay per port on 127.0.0.2, another loopback address: whoever reaches the worker or
its DHT node at the public address goes through the relay, which counts the bytes."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from client.pipeline.addresses import announced_dht, endpoint, free_port, multiaddr, public_host, worker_host
from client.pipeline.discovery import start_dht
from tests.benchmarks.link_emulator import Link, Relay
from tests.pipeline.test_pipeline import make_trainer, wait_for_stages  # noqa: F401 - make_trainer is a fixture

PRIVATE, PUBLIC = "127.0.0.1", "127.0.0.2"
FAST_LINK = Link(1e9, 0.0)


def forwarded(port: int) -> Relay:
    """The router's forwarding of ``port``: PUBLIC:port to PRIVATE:port."""
    return Relay(f"{PRIVATE}:{port}", FAST_LINK, listen=f"{PUBLIC}:{port}").start()


def test_a_worker_behind_a_router_is_reached_at_its_public_host(dht, start_worker, directory,
                                                                make_trainer) -> None:  # noqa: F811
    dht_port, grpc_port = free_port(), free_port()
    router = [forwarded(dht_port), forwarded(grpc_port)]
    hidden = start_dht([str(a) for a in dht.get_visible_maddrs()], PRIVATE, dht_port, PUBLIC)
    try:
        announced = [str(a) for a in hidden.get_visible_maddrs()]
        assert announced and all(a.startswith(f"/ip4/{PUBLIC}/tcp/{dht_port}/") for a in announced), announced
        carried = router[0].busiest_direction_bytes
        start_dht(announced).shutdown()  # a peer that knows only the announced address comes in through the router
        assert router[0].busiest_direction_bytes > carried

        start_worker("head"), start_worker("tail")
        behind = start_worker("body1", dht=hidden, port=grpc_port, public_host=PUBLIC)
        wait_for_stages(directory, {"head": 1, "body1": 1, "tail": 1})
        assert [r.address for r in directory.workers("body1")] == [f"{PUBLIC}:{grpc_port}"]
        result = make_trainer().train(range(8), microbatch_size=2)
        assert {m.workers["body1"] for m in result.microbatches} == {behind.uid}
        assert router[1].busiest_direction_bytes > 0  # every Forward and Backward of body1 came through the router
    finally:
        hidden.shutdown()
        for relay in router:
            relay.stop()


@pytest.mark.parametrize(("listen", "public", "reached"), [
    ("127.0.0.1", None, "127.0.0.1"),
    ("0.0.0.0", "203.0.113.7", "203.0.113.7"),
    ("10.0.0.5", "node-1.example.org", "node-1.example.org"),
    ("0.0.0.0", "2001:db8::7", "2001:db8::7"),
    ("::", "2001:DB8:0::7", "2001:db8::7"),
    ("0.0.0.0", "::ffff:203.0.113.7", "203.0.113.7"),
])
def test_a_worker_is_announced_at_the_public_host_given_else_where_it_listens(listen, public, reached) -> None:
    assert worker_host(listen, public) == reached


@pytest.mark.parametrize("listen", ["0.0.0.0", "::"])
def test_a_worker_listening_on_every_interface_must_name_one(listen: str) -> None:
    """Its record holds one address, which trainers on other machines dial; a DHT node need not name one."""
    with pytest.raises(ValueError, match=f"--host {re.escape(listen)} listens on every interface but names none "
                                         "for trainers to reach: give --public-host"):
        worker_host(listen, None)
    assert public_host(None) is None and announced_dht(listen, 7071, None) == (7071, [])


@pytest.mark.parametrize(("public", "named"), [
    ("0.0.0.0", "names no single machine"),
    ("224.0.0.1", "names no single machine"),
    ("fe80::1%eth0", "drop the %scope"),
    ("10.0.0.256", "neither an IP address nor a DNS name"),
    ("my host", "neither an IP address nor a DNS name"),
    ("http://node.example.org", "neither an IP address nor a DNS name"),
    ("-node.example.org", "neither an IP address nor a DNS name"),
    ("", "neither an IP address nor a DNS name"),
    ("a" * 64 + ".org", "neither an IP address nor a DNS name"),
    (".".join(["a" * 60] * 4), "is 243 characters long: give a name of at most 240"),
    ("node.example.org:7000", "neither an IP address nor a DNS name"),
])
def test_an_address_peers_cannot_reach_is_refused_naming_the_fix(public: str, named: str) -> None:
    for check in (public_host, lambda p: worker_host("127.0.0.1", p)):
        with pytest.raises(ValueError, match="--public-host") as refused:
            check(public)
        assert named in str(refused.value)


@given(st.text(max_size=300) | st.ip_addresses().map(str)
       | st.from_regex(r"[0-9a-fA-F:.%a-z]{1,60}", fullmatch=True))
def test_any_public_host_is_refused_with_a_value_error_or_makes_well_formed_addresses(text: str) -> None:
    try:
        host = public_host(text)
    except ValueError as exc:
        assert "--public-host" in str(exc)
        return
    assert host is not None and host.isascii() and host.strip() == host and "/" not in host
    assert 0 < len(endpoint(host, 65535)) <= 255 and "%" not in host  # fits a worker record's address
    assert endpoint(host, 7000).endswith(":7000") and multiaddr(host, 7000).endswith("/tcp/7000")


def test_announced_addresses_name_the_public_host_and_the_listening_port() -> None:
    assert announced_dht("127.0.0.1", 7071, "127.0.0.1") == (7071, [])  # reached where it listens: nothing to add
    assert announced_dht("0.0.0.0", 7071, "node.example.org") == (7071, ["/dns/node.example.org/tcp/7071"])
    assert announced_dht("0.0.0.0", 7071, "2001:db8::7") == (7071, ["/ip6/2001:db8::7/tcp/7071"])
    port, [announced] = announced_dht("127.0.0.1", 0, "203.0.113.7")
    assert port > 0 and announced == f"/ip4/203.0.113.7/tcp/{port}"  # a port picked before the node binds
    assert endpoint("2001:db8::7", 7000) == "[2001:db8::7]:7000" and endpoint("10.0.0.5", 7000) == "10.0.0.5:7000"
