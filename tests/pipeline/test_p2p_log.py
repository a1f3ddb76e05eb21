"""A clean stop prints no error: p2pd reports its listening socket closing under its accept loop (how hivemind stops
it) as an ``[ERROR]`` line, which every client and DHT bootstrap printed on SIGTERM or Ctrl-C."""

from __future__ import annotations

import json
import logging

from hivemind.p2p.p2p_daemon import P2P

from client.commands.pipeline import quiet_clean_p2p_stop


def golog(message: str, error: str) -> str:
    return json.dumps({"level": "error", "ts": "2026-11-26T21:51:50.496Z", "logger": "p2pd",
                       "caller": "go-libp2p-daemon/daemon.go:198", "msg": message, "error": error})


class Kept(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_the_closed_listener_error_of_a_clean_stop_is_dropped_and_other_errors_kept() -> None:
    logger = logging.getLogger("hivemind.p2p.p2p_daemon")
    kept = Kept()
    logger.addHandler(kept)
    try:
        quiet_clean_p2p_stop()
        quiet_clean_p2p_stop()  # installing twice filters once
        P2P._log_p2pd_message(golog("error accepting connection",
                                    "accept unix /tmp/hivemind-p2pd-X.sock: use of closed network connection"))
        P2P._log_p2pd_message(golog("error opening stream", "protocol not supported"))
    finally:
        logger.removeHandler(kept)
    assert kept.messages == ["error opening stream: protocol not supported"]
