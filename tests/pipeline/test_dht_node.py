"""Commands reach hivemind's helper processes whole (``client.helper_processes.receive_whole``, ``DHTNode``)."""

from __future__ import annotations

import concurrent.futures
import multiprocessing as mp
import os
import pickle
import struct
import threading
import time

import pytest
from hivemind.utils import get_dht_time
from solders.keypair import Keypair

from client.helper_processes import receive_whole
from client.sealed import owner_of, store_sealed


def _body_later(pipe_writer, message: object, delay: float) -> threading.Thread:
    """Write ``message`` as ``Connection.send`` would, its length now and its body ``delay`` seconds later: the
    moment a helper polling the pipe can wake between."""
    body = pickle.dumps(message)
    os.write(pipe_writer.fileno(), struct.pack("!i", len(body)))

    def rest() -> None:
        time.sleep(delay)
        os.write(pipe_writer.fileno(), body)

    thread = threading.Thread(target=rest)
    thread.start()
    return thread


def test_a_command_whose_body_comes_after_its_length_is_received_whole() -> None:
    message = ("_store", [], {"value": "x" * 30_000})  # more than one write of Connection.send, less than the pipe
    plain_reader, plain_writer = mp.Pipe(duplex=False)
    os.set_blocking(plain_reader.fileno(), False)  # as libuv leaves a descriptor it polls
    late = _body_later(plain_writer, message, 0.2)
    with pytest.raises(BlockingIOError):  # hivemind's reading: the command is lost
        plain_reader.recv()
    late.join()

    reader, writer = mp.Pipe(duplex=False)
    os.set_blocking(reader.fileno(), False)
    receive_whole(reader)
    late = _body_later(writer, message, 0.2)
    assert reader.recv() == message
    late.join()
    assert not os.get_blocking(reader.fileno()), "the event loop's descriptor is left as it was"


def test_large_stores_through_a_dht_node_all_return(new_dht) -> None:
    """Before: about one store of a 40 KB value in three never returned, and the node's process ended."""
    node, reader = new_dht(), new_dht()
    owner = Keypair()
    pool = concurrent.futures.ThreadPoolExecutor(1)
    for i in range(10):
        value = {"n": i, "blob": "x" * 40_000}
        stored = pool.submit(store_sealed, node, owner, f"big-{i}", value, get_dht_time() + 60)
        assert stored.result(timeout=20), f"store {i} of a 40 KB value did not succeed"
    assert node.is_alive()
    found = reader.get("big-9", latest=True)
    assert found is not None and owner_of(owner) in found.value, "the last store reached another node"
