"""Token datasets written on the spot, and a loopback HTTP server (with ranges) that serves them."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest

from client.data.sidecar import DTYPES, SIDECAR_NAME, Sidecar
from client.data.tokens import TokenWriter
from tests.fake_hub import write_counted

TOKENIZER_DIGEST = "ab" * 32


def write_token_dir(directory: Path, tokens: np.ndarray, *, shard_tokens: int, dtype: str = "uint16",
                    vocab_size: int = 1000, tokenizer_sha256: str = TOKENIZER_DIGEST,
                    name: str = "test-bpe") -> Sidecar:
    """``tokens`` as token files of ``shard_tokens`` each and their sidecar: what ``psyswarm tokenize`` writes."""
    directory.mkdir(parents=True, exist_ok=True)
    writer = TokenWriter(directory, DTYPES[dtype], shard_tokens)
    writer.add(tokens)
    sidecar = Sidecar(dtype, name, tokenizer_sha256, vocab_size, tuple(writer.close()))
    (directory / SIDECAR_NAME).write_bytes(sidecar.render())
    return sidecar


@pytest.fixture
def corpus() -> np.ndarray:
    """10,007 ids below 1000 (a prime count, so no window lines up with a file boundary by accident)."""
    return np.random.default_rng(7).integers(0, 1000, size=10_007).astype(np.uint16)


@pytest.fixture
def token_dir(tmp_path: Path, corpus: np.ndarray) -> Path:
    write_token_dir(tmp_path / "tokens", corpus, shard_tokens=3_000)
    return tmp_path / "tokens"


class FileServer(ThreadingHTTPServer):
    """Serves the files of one directory on loopback, honouring ``Range: bytes=N-``; records every request and
    lets a test rewrite what goes out (``tamper``) to play a hostile or broken server."""

    daemon_threads = True

    def __init__(self, root: Path) -> None:
        super().__init__(("127.0.0.1", 0), _FileHandler)
        self.root = root
        self.requests: list[tuple[str, str | None]] = []  # (path, Range header)
        self.tamper: Callable[[str, bytes], bytes] = lambda path, body: body
        self.honour_ranges = True
        self.sent: dict[str, int] = {}  # file name -> bytes of its body the client's connection took, last GET

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/tokens"


class _FileHandler(BaseHTTPRequestHandler):
    server: FileServer
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:  # noqa: N802
        name = self.path.removeprefix("/tokens/")
        self.server.requests.append((name, self.headers.get("Range")))
        path = self.server.root / name
        if "/" in name or not path.is_file():
            self._send(404, b"")
            return
        body = self.server.tamper(name, path.read_bytes())
        wanted = self.headers.get("Range", "")
        if wanted.startswith("bytes=") and self.server.honour_ranges:
            start = int(wanted.removeprefix("bytes=").rstrip("-"))
            self.server.sent[name] = self._send(
                206, body[start:], {"Content-Range": f"bytes {start}-{len(body) - 1}/{len(body)}"})
        else:
            self.server.sent[name] = self._send(200, body)

    def _send(self, status: int, body: bytes, headers: dict[str, str] | None = None) -> int:
        self.send_response(status)
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        return write_counted(self.wfile, body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def file_server(token_dir: Path) -> Iterator[FileServer]:
    server = FileServer(token_dir)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()
    server.server_close()
