"""Account subscriptions over websocket (``accountSubscribe``), as a validator's pubsub port serves them.

After every block the chain announces, each subscribed account is read again and, if it changed, its new
contents are queued to the subscriber as an ``accountNotification``. Replies and notifications share one
queue per connection, so a subscriber always gets its subscription id before the first notification, and
notifications in block order. A subscriber that lets ``MAX_QUEUED`` messages pile up is disconnected
rather than allowed to grow the server's memory; it can resubscribe and read the account again.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import itertools
import json
import logging
from typing import Any

from solders.account import Account
from solders.pubkey import Pubkey
from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed

from coordinator_program.localnet.chain import LocalChain
from coordinator_program.localnet.jsonrpc import INVALID_PARAMS, Dispatcher, RpcError, invalid_params
from coordinator_program.localnet.methods import (
    DELETED_ACCOUNT,
    config_param,
    encode_account,
    integer_param,
    positional,
    pubkey_param,
)

log = logging.getLogger("psyswarm.localnet")

MAX_QUEUED = 256
SUBSCRIPTION_ENCODINGS = ("base64", "jsonParsed")
"""Account data may outgrow base58's 128-byte limit after subscribing, so notifications use base64."""


@dataclasses.dataclass(eq=False)
class _Subscriber:
    """One websocket client: what it has subscribed to, and the messages waiting for it, in order."""

    connection: ServerConnection
    outbox: asyncio.Queue[str] = dataclasses.field(default_factory=asyncio.Queue)
    owned: set[int] = dataclasses.field(default_factory=set)
    closing: asyncio.Task[None] | None = None

    def push(self, message: str) -> None:
        """Queue a message; a subscriber that stopped reading is disconnected instead of queueing forever."""
        if self.closing is not None:
            return
        if self.outbox.qsize() >= MAX_QUEUED:
            log.warning("a subscriber fell %d messages behind; disconnecting it", self.outbox.qsize())
            self.closing = asyncio.get_running_loop().create_task(
                self.connection.close(1008, "too slow: resubscribe and read the account again"))
            return
        self.outbox.put_nowait(message)

    async def write(self) -> None:
        with contextlib.suppress(ConnectionClosed):
            while True:
                await self.connection.send(await self.outbox.get())


@dataclasses.dataclass(eq=False)
class _Subscription:
    address: Pubkey
    config: dict[str, Any]
    subscriber: _Subscriber
    last: Account | None


class AccountSubscriptions:
    """Every websocket client's account subscriptions on one chain."""

    def __init__(self, chain: LocalChain) -> None:
        self.chain = chain
        self._subscriptions: dict[int, _Subscription] = {}
        self._ids = itertools.count()
        chain.listeners.append(self._on_block)

    async def serve(self, connection: ServerConnection) -> None:
        """One websocket client: answer its requests, forward its notifications, forget it when it leaves."""
        subscriber = _Subscriber(connection)
        dispatcher = Dispatcher({
            "accountSubscribe": functools.partial(self._subscribe, subscriber),
            "accountUnsubscribe": functools.partial(self._unsubscribe, subscriber),
        })
        writer = asyncio.create_task(subscriber.write())
        try:
            async for message in connection:
                reply = dispatcher.handle(message)
                if reply is not None:
                    subscriber.push(reply)
        except ConnectionClosed:
            pass
        finally:
            for subscription in subscriber.owned:
                del self._subscriptions[subscription]
            writer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await writer

    def _subscribe(self, subscriber: _Subscriber, params: list[Any]) -> int:
        address, config = positional(params, 1)
        address, config = pubkey_param(address), config_param(config)
        if config.get("encoding", "base64") not in SUBSCRIPTION_ENCODINGS:
            raise invalid_params("accountSubscribe sends base64 here; account data may outgrow base58")
        subscription = next(self._ids)
        self._subscriptions[subscription] = _Subscription(
            address, {**config, "encoding": "base64"}, subscriber, self.chain.account(address))
        subscriber.owned.add(subscription)
        return subscription

    def _unsubscribe(self, subscriber: _Subscriber, params: list[Any]) -> bool:
        (subscription,) = positional(params, 1, 0)
        subscription = integer_param(subscription, "the subscription id", 0, 2**64 - 1)
        if subscription not in subscriber.owned:
            raise RpcError(INVALID_PARAMS, "Invalid Request: Subscription id does not exist")
        subscriber.owned.discard(subscription)
        del self._subscriptions[subscription]
        return True

    def _on_block(self, slot: int) -> None:
        for subscription_id, subscription in self._subscriptions.items():
            account = self.chain.account(subscription.address)
            if account == subscription.last:
                continue
            subscription.last = account
            value = encode_account(account or DELETED_ACCOUNT, subscription.config)
            subscription.subscriber.push(json.dumps({
                "jsonrpc": "2.0", "method": "accountNotification",
                "params": {"result": {"context": {"slot": slot}, "value": value}, "subscription": subscription_id},
            }))
