"""A stand-in for the Hugging Face Hub on loopback: the edge of the system the tests replace (the internet).

It answers the calls psyswarm makes through huggingface_hub: ``GET /api/whoami-v2`` for known tokens,
``HEAD``/``GET /<repo>/resolve/<revision>/<file>`` for files, and the uploads of ``create_branch`` and
``create_commit`` (``POST /api/models/<repo>/branch|preupload|commit/<revision>``, every file uploaded
inline, as the Hub does for small files).
"""

from __future__ import annotations

import base64
import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import BinaryIO

CHUNK = 64 * 1024


def write_counted(out: BinaryIO, body: bytes) -> int:
    """Send ``body`` in chunks until the reader hangs up: how many bytes the connection took (a client that cuts
    a host off early leaves most of a long body unsent)."""
    sent = 0
    try:
        for start in range(0, len(body), CHUNK):
            out.write(body[start:start + CHUNK])
            sent += min(CHUNK, len(body) - start)
    except (BrokenPipeError, ConnectionResetError):
        pass
    return sent


class FakeHub(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.users: dict[str, str] = {}  # token -> user name
        self.files: dict[tuple[str, str, str], bytes] = {}  # (repo, revision, filename) -> content
        self.whoami_calls = 0
        self.branches: set[tuple[str, str]] = set()  # (repo, branch) created through the API
        self.sent: dict[str, int] = {}  # filename -> bytes of its body the client's connection took, last GET

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def publish(self, repo: str, filename: str, content: bytes, revision: str = "main") -> None:
        self.files[(repo, revision, filename)] = content

    def start(self) -> FakeHub:
        threading.Thread(target=self.serve_forever, daemon=True).start()
        return self


class _Handler(BaseHTTPRequestHandler):
    server: FakeHub
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:  # noqa: N802
        if self.path == "/api/whoami-v2":
            self.server.whoami_calls += 1
            token = self.headers.get("Authorization", "").removeprefix("Bearer ")
            name = self.server.users.get(token)
            if name is None:
                self._reply(401, json.dumps({"error": "Invalid credentials in Authorization header"}).encode())
            else:
                self._reply(200, json.dumps({"type": "user", "name": name}).encode())
            return
        self._file(body=True)

    def do_POST(self) -> None:  # noqa: N802
        """Repo and branch creation and commits: the calls ``HfApi.create_repo``, ``create_branch`` and
        ``create_commit`` make."""
        body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        if self.path == "/api/validate-yaml":  # a model card's metadata, checked before a commit that adds one
            self._reply(200, b"{}")
            return
        if self.path == "/api/repos/create":
            name = json.loads(body)
            self._reply(200, json.dumps({"url": f"{self.server.url}/{name.get('organization')}/{name['name']}"}
                                        ).encode())
            return
        repo, _, rest = self.path.removeprefix("/api/models/").partition("/")
        # repo ids have a slash: org/name/<verb>/<revision>
        name, _, rest = rest.partition("/")
        repo = f"{repo}/{name}"
        verb, _, revision = rest.partition("/")
        if verb == "branch":
            self.server.branches.add((repo, revision))
            self._reply(200, b"{}")
        elif verb == "preupload":
            files = json.loads(body)["files"]
            modes = [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in files]
            self._reply(200, json.dumps({"files": modes}).encode())
        elif verb == "commit":
            for line in body.decode().splitlines():
                item = json.loads(line)
                if item["key"] == "file":
                    value = item["value"]
                    self.server.files[(repo, revision, value["path"])] = base64.b64decode(value["content"])
            oid = hashlib.sha1(body).hexdigest()
            self._reply(200, json.dumps({"commitUrl": f"{self.server.url}/{repo}/commit/{oid}", "commitOid": oid,
                                         "pullRequestUrl": None}).encode())
        else:
            self._reply(404, b"{}")

    def do_HEAD(self) -> None:  # noqa: N802
        self._file(body=False)

    def _file(self, *, body: bool) -> None:
        repo, _, rest = self.path.lstrip("/").partition("/resolve/")
        revision, _, filename = rest.partition("/")
        content = self.server.files.get((repo, revision, filename))
        if content is None:
            self._reply(404, b"", {"X-Error-Code": "EntryNotFound"}, body=body)
            return
        headers = {"X-Repo-Commit": hashlib.sha1(repo.encode() + revision.encode()).hexdigest(),
                   "ETag": f'"{hashlib.sha256(content).hexdigest()}"'}
        sent = self._reply(200, content, headers, body=body)
        if body:
            self.server.sent[filename] = sent

    def _reply(self, status: int, content: bytes, headers: dict[str, str] | None = None, *,
               body: bool = True) -> int:
        self.send_response(status)
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(content)))
        self.end_headers()
        return write_counted(self.wfile, content) if body else 0

    def log_message(self, *args: object) -> None:
        pass
