"""``join-run --port`` and ``--dht-port``: a worker serves its stage, and its DHT node listens, on the ports given,
so that a firewall can open them; with ``--public-host`` it tells peers that address instead. A real ``join-run``
worker admitted to a run on the real TCP server; the run's other members are process-less clients joined through
the coordinator's protocol."""

from __future__ import annotations

import socket

import pytest

from client.swarm.launcher import free_port
from coordinator_program.spec import limits
from coordinator_program.spec.state import Role
from tests.adversarial.test_process_exit import members, start, swarm, wait_for  # noqa: F401 - fixtures
from tests.integration.test_swarm import tiny


def listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
        return True
    except OSError:
        return False


@pytest.mark.slow
def test_a_worker_listens_on_its_ports_and_is_announced_at_its_public_host(swarm, members) -> None:  # noqa: F811
    start(swarm, tiny())
    grpc_port, dht_port = free_port(), free_port()
    swarm.start_client("worker", "worker", "head", extra=("--port", str(grpc_port), "--dht-port", str(dht_port),
                                                          "--public-host", "127.0.0.2"))
    wait_for(swarm, "worker", "waiting to be admitted")  # its DHT node is up: it joins after starting it
    assert listening(dht_port)
    members((Role.Worker, 1), (Role.Worker, 2), (Role.Trainer, limits.NO_STAGE))
    wait_for(swarm, "worker", f"serving stage head as \\S+ at 127.0.0.2:{grpc_port} ")
    assert listening(grpc_port)
