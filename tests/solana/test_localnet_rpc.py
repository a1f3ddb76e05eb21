"""``psyswarm localnet`` as Solana clients see it: JSON-RPC over HTTP and account subscriptions over websocket,
read and written by solana-py and by hand, with malformed input of every kind answered and survived."""

from __future__ import annotations

import asyncio
import base64
import json
import socket
import struct
import time
from typing import Any

import httpx
import pytest
from solana.rpc.async_api import AsyncClient
from solana.rpc.core import RPCException
from solana.rpc.types import TxOpts
from solders.hash import Hash
from solders.keypair import Keypair
from solders.message import Message
from solders.rpc.errors import SendTransactionPreflightFailureMessage
from solders.system_program import TransferParams, transfer
from solders.sysvar import CLOCK
from solders.transaction import VersionedTransaction
from solders.transaction_status import TransactionErrorFieldless, TransactionErrorInstructionError
from websockets.asyncio.client import connect

from coordinator_program.onchain.program_id import PROGRAM_ID
from tests.solana.conftest import Localnet

SOL = 10**9


def post(localnet: Localnet, body: bytes) -> httpx.Response:
    return httpx.post(localnet.url, content=body, headers={"Content-Type": "application/json"}, timeout=10)


def raw_http(localnet: Localnet, request: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", localnet.port), timeout=10) as sock:
        sock.sendall(request)
        return sock.recv(4096)


def transfer_tx(sender: Keypair, to: Keypair, lamports: int, blockhash: Hash) -> VersionedTransaction:
    ix = transfer(TransferParams(from_pubkey=sender.pubkey(), to_pubkey=to.pubkey(), lamports=lamports))
    return VersionedTransaction(Message.new_with_blockhash([ix], sender.pubkey(), blockhash), [sender])


def request(method: str, params: Any, request_id: Any = 1) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": request_id, "method": method, "params": params}


@pytest.mark.parametrize("body, code", [
    (b"{not json", -32700),
    (b"\xff\xfe", -32700),
    (b"[" * 60_000, -32700),
    (b'"a string"', -32600),
    (b"[]", -32600),
    (json.dumps({"jsonrpc": "1.0", "id": 1, "method": "getSlot"}).encode(), -32600),
    (json.dumps({"jsonrpc": "2.0", "id": [1], "method": "getSlot"}).encode(), -32600),
    (json.dumps({"jsonrpc": "2.0", "id": 1, "method": 7}).encode(), -32600),
    (json.dumps(request("noSuchMethod", [])).encode(), -32601),
    (json.dumps(request("getBalance", ["not-a-key"])).encode(), -32602),
    (json.dumps(request("getBalance", {"pubkey": "x"})).encode(), -32602),
    (json.dumps(request("getBalance", [])).encode(), -32602),
    (json.dumps(request("getSlot", [{}, {}, {}])).encode(), -32602),
    (json.dumps(request("getAccountInfo", [str(CLOCK), {"commitment": "sometimes"}])).encode(), -32602),
    (json.dumps(request("getAccountInfo", [str(CLOCK), {"encoding": "yaml"}])).encode(), -32602),
    (json.dumps(request("getMinimumBalanceForRentExemption", ["10"])).encode(), -32602),
    (json.dumps(request("getMultipleAccounts", [[str(CLOCK)] * 101])).encode(), -32602),
    (json.dumps(request("getSignatureStatuses", [["nope"]])).encode(), -32602),
    (json.dumps(request("requestAirdrop", [str(CLOCK), -5])).encode(), -32602),
    (json.dumps(request("sendTransaction", ["!!!", {"encoding": "base64"}])).encode(), -32602),
    (json.dumps(request("sendTransaction", [base64.b64encode(bytes(300)).decode(), {"encoding": "base64"}])).encode(),
     -32602),
    (json.dumps(request("sendTransaction", ["AAAA", {"encoding": "hex"}])).encode(), -32602),
    (json.dumps(request("simulateTransaction", ["AAAA", {"encoding": "base64", "sigVerify": "yes"}])).encode(), -32602),
])
def test_malformed_requests_get_jsonrpc_errors(localnet: Localnet, body: bytes, code: int) -> None:
    response = post(localnet, body)
    assert response.status_code == 200
    reply = response.json()
    assert reply["jsonrpc"] == "2.0" and "result" not in reply
    assert reply["error"]["code"] == code, reply
    assert localnet.rpc("getHealth")["result"] == "ok"


def test_batches_and_notifications(localnet: Localnet) -> None:
    batch = [request("getSlot", [], "a"), request("nope", [], 2), {"jsonrpc": "2.0", "method": "getSlot"}]
    replies = post(localnet, json.dumps(batch).encode()).json()
    assert [r["id"] for r in replies] == ["a", 2]  # the notification (no id) gets no reply
    assert isinstance(replies[0]["result"], int) and replies[1]["error"]["code"] == -32601
    assert post(localnet, json.dumps({"jsonrpc": "2.0", "method": "getSlot"}).encode()).content == b""


@pytest.mark.parametrize("raw, status", [
    (b"GARBAGE\r\n\r\n", b"400"),
    (b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n" + b"{" * 70000, b"413"),
    (b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: nine\r\n\r\n", b"400"),
    (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", b"405"),
    (b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n", b"200"),
])
def test_bad_http_gets_an_http_error_and_the_server_survives(localnet: Localnet, raw: bytes, status: bytes) -> None:
    assert raw_http(localnet, raw).split(b" ")[1] == status
    assert localnet.rpc("getHealth")["result"] == "ok"


def test_reads_in_the_shapes_solana_py_parses(localnet: Localnet) -> None:
    async def main() -> None:
        async with AsyncClient(localnet.url) as client:
            assert (await client.get_balance(localnet.funded.pubkey())).value == 1_000 * SOL  # from --fund
            assert (await client.get_account_info(Keypair().pubkey())).value is None
            clock, missing = (await client.get_multiple_accounts([CLOCK, Keypair().pubkey()])).value
            assert clock is not None and len(clock.data) == 40 and missing is None
            assert (await client.get_minimum_balance_for_rent_exemption(1000)).value == (128 + 1000) * 3480 * 2
            slot = (await client.get_slot()).value
            assert (await client.get_block_height()).value == slot
            latest = (await client.get_latest_blockhash()).value
            assert latest.last_valid_block_height >= slot + 150
            assert localnet.rpc("isBlockhashValid", [str(latest.blockhash)])["result"]["value"] is True
            assert localnet.rpc("isBlockhashValid", [str(Hash.new_unique())])["result"]["value"] is False
            assert (await client.get_version()).value.solana_core

    asyncio.run(main())


def test_account_encodings(localnet: Localnet) -> None:
    key = str(localnet.funded.pubkey())
    assert localnet.rpc("getAccountInfo", [key])["result"]["value"]["data"] == ""  # legacy default: base58 text
    assert localnet.rpc("getAccountInfo", [key, {"encoding": "base58"}])["result"]["value"]["data"] == ["", "base58"]
    clock = localnet.rpc("getAccountInfo", [str(CLOCK), {"encoding": "base64", "dataSlice": {"offset": 0,
                                                                                           "length": 8}}])
    assert len(base64.b64decode(clock["result"]["value"]["data"][0])) == 8
    program = localnet.rpc("getAccountInfo", [str(PROGRAM_ID), {"encoding": "base58"}])  # too big for base58
    assert program["error"]["code"] == -32600 and "Base64" in program["error"]["message"]


def test_transactions_statuses_and_their_failures(localnet: Localnet) -> None:
    async def main() -> None:
        sender, receiver = Keypair(), Keypair()
        await localnet.fund(sender)
        async with AsyncClient(localnet.url) as client:
            first = (await client.get_latest_blockhash()).value.blockhash
            tx = transfer_tx(sender, receiver, SOL, first)
            signature = (await client.send_transaction(tx)).value
            [status] = (await client.get_signature_statuses([signature])).value
            assert status is not None and status.err is None and status.confirmation_status is not None
            assert (await client.get_balance(receiver.pubkey())).value == SOL

            with pytest.raises(RPCException) as duplicate:  # the same signed bytes again
                await client.send_transaction(tx)
            assert preflight_error(duplicate.value) == TransactionErrorFieldless.AlreadyProcessed

            # a blockhash from a few blocks ago is still accepted, an invented one is not
            await client.send_transaction(transfer_tx(sender, receiver, 2, first))
            with pytest.raises(RPCException) as unknown:
                await client.send_transaction(transfer_tx(sender, receiver, 3, Hash.new_unique()))
            assert preflight_error(unknown.value) == TransactionErrorFieldless.BlockhashNotFound

            latest = (await client.get_latest_blockhash()).value.blockhash
            too_much = transfer_tx(sender, receiver, 1_000 * SOL, latest)
            with pytest.raises(RPCException) as failed:  # preflight: rejected, nothing committed
                await client.send_transaction(too_much)
            assert isinstance(preflight_error(failed.value), TransactionErrorInstructionError)
            assert (await client.get_signature_statuses([too_much.signatures[0]])).value == [None]
            # without preflight it lands with its error, as on a cluster
            await client.send_transaction(too_much, TxOpts(skip_preflight=True))
            [landed] = (await client.get_signature_statuses([too_much.signatures[0]])).value
            assert landed is not None and isinstance(landed.err, TransactionErrorInstructionError)

            forged = VersionedTransaction.populate(tx.message, [receiver.sign_message(bytes(tx.message))])
            reply = localnet.rpc("sendTransaction", [base64.b64encode(bytes(forged)).decode(), {"encoding": "base64"}])
            assert reply["error"]["code"] == -32003

            simulated = (await client.simulate_transaction(transfer_tx(sender, receiver, 5, latest))).value
            assert simulated.err is None and simulated.units_consumed and simulated.logs

    asyncio.run(main())


def preflight_error(exc: RPCException) -> object:
    message = exc.args[0]
    assert isinstance(message, SendTransactionPreflightFailureMessage), message
    return message.data.err


def test_clock_follows_wall_time(localnet: Localnet) -> None:
    asyncio.run(localnet.fund(Keypair()))  # a new block
    data = base64.b64decode(localnet.rpc("getAccountInfo", [str(CLOCK), {"encoding": "base64"}])
                            ["result"]["value"]["data"][0])
    slot, _, _, _, unix_timestamp = struct.unpack("<QqQQq", data)
    assert slot == localnet.rpc("getSlot")["result"]
    assert abs(unix_timestamp - time.time()) <= 2


def test_account_subscription(localnet: Localnet) -> None:
    watched = Keypair()

    async def main() -> None:
        async with connect(localnet.ws_url) as ws:
            await ws.send(json.dumps(request("accountSubscribe", [str(watched.pubkey()), {"encoding": "base64"}])))
            subscription = json.loads(await ws.recv())["result"]
            await localnet.fund(watched)
            notification = json.loads(await asyncio.wait_for(ws.recv(), 5))
            assert notification["method"] == "accountNotification"
            assert notification["params"]["subscription"] == subscription
            assert notification["params"]["result"]["value"]["lamports"] > 0

            for bad, code in [("{", -32700), (json.dumps(request("accountSubscribe", ["x"])), -32602),
                              (json.dumps(request("accountSubscribe", [str(CLOCK), {"encoding": "base58"}])), -32602),
                              (json.dumps(request("getSlot", [])), -32601),
                              (json.dumps(request("accountUnsubscribe", [subscription + 1000])), -32602)]:
                await ws.send(bad)
                assert json.loads(await ws.recv())["error"]["code"] == code
            await ws.send(json.dumps(request("accountUnsubscribe", [subscription])))
            assert json.loads(await ws.recv())["result"] is True
            await localnet.fund(watched)
            with pytest.raises(TimeoutError):  # unsubscribed: no further notification
                await asyncio.wait_for(ws.recv(), 0.5)

    asyncio.run(main())
