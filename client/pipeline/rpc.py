"""gRPC transport for stage workers: raw-bytes methods through a generic handler, no generated code.

Requests and responses are ``messages``-encoded, so the service needs no ``.proto`` file: each method
takes bytes and returns bytes. A handler reports a bad request by raising ``RequestRejected``, which becomes
a gRPC status with the reason as details; anything unexpected becomes INTERNAL and is logged, and the server
keeps serving either way.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent import futures

import grpc

log = logging.getLogger(__name__)

SERVICE = "psyswarm.pipeline.Stage"
METHODS = ("Forward", "Backward", "Info")

Handler = Callable[[bytes], bytes]


class RequestRejected(Exception):
    """A request the worker refuses, with the gRPC status to answer and a reason for the caller."""

    code = grpc.StatusCode.INTERNAL

    def __init__(self, reason: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(reason)
        if code is not None:
            self.code = code


class InvalidRequest(RequestRejected):
    """Malformed, oversized or inconsistent input: INVALID_ARGUMENT, never worth retrying unchanged."""

    code = grpc.StatusCode.INVALID_ARGUMENT


def channel_options(max_message_bytes: int) -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
    ]


def _wrap(name: str, handler: Handler) -> Callable[[bytes, grpc.ServicerContext], bytes]:
    def call(request: bytes, context: grpc.ServicerContext) -> bytes:
        try:
            return handler(request)
        except RequestRejected as exc:
            context.abort(exc.code, str(exc))
        except Exception as exc:  # a bug must not take the server down; the caller learns it failed
            log.exception("%s failed", name)
            context.abort(grpc.StatusCode.INTERNAL, f"{name} failed: {type(exc).__name__}: {exc}")
        raise AssertionError("unreachable: context.abort raises")

    return call


def start_server(
    handlers: dict[str, Handler], address: str, *, max_message_bytes: int, threads: int
) -> tuple[grpc.Server, int]:
    """Serve ``handlers`` (one per name in ``METHODS``) on ``address``; returns the server and bound port."""
    missing = set(METHODS) - set(handlers)
    if missing:
        raise ValueError(f"handlers missing for {sorted(missing)}")
    method_handlers = {name: grpc.unary_unary_rpc_method_handler(_wrap(name, handlers[name])) for name in METHODS}
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="stage-rpc"),
        handlers=[grpc.method_handlers_generic_handler(SERVICE, method_handlers)],
        options=channel_options(max_message_bytes),
    )
    port = server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"cannot bind the gRPC server to {address}")
    server.start()
    return server, port


class StageClient:
    """Calls one worker's methods; raises ``grpc.RpcError`` as gRPC does, for the caller to classify."""

    def __init__(self, address: str, *, max_message_bytes: int) -> None:
        self.address = address
        self._channel = grpc.insecure_channel(address, options=channel_options(max_message_bytes))
        self._methods = {name: self._channel.unary_unary(f"/{SERVICE}/{name}") for name in METHODS}

    def call(self, method: str, request: bytes, *, timeout: float) -> bytes:
        return self._methods[method](request, timeout=timeout)

    def close(self) -> None:
        self._channel.close()
