"""Bounded downloads of a remote dataset: every byte a host sends is counted against the size the run fixed.

The run pins ``dataset.json`` by digest, and ``dataset.json`` states every token file's size and digest, so a
host can send nothing the run did not already name. A download streams into a ``.part`` file in a cache named
by the file's sha256, counting as it goes, and stops the moment the host sends more than the stated size (never
a whole file first and a check after); only a copy whose size and digest match becomes the cached file, by an
atomic rename. ``dataset.json`` itself is read into memory against a small fixed cap.

Hub files travel the same way: ``huggingface_hub`` gives their URL and request headers, and the bytes are read
here, because ``hf_hub_download`` writes a whole file before anyone can count it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from client.data.sidecar import SIDECAR_NAME, DatasetError, DatasetMissing, DatasetUnreachable, Sidecar, TokenFile
from client.data.tokens import verify_token_file

HTTP_TIMEOUT = 30.0
BLOCK = 1 << 20  # what one read asks for: a host can be one block past the stated size when it is cut off


class _AuthStaysHome(urllib.request.HTTPRedirectHandler):
    """Follows redirects, but sends a Hub token only to the host it was meant for (a Hub's file redirects to a
    CDN whose signed URL needs no token, and no other host should see it)."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # noqa: ANN001, ANN201 (urllib's signature)
        new = super().redirect_request(req, fp, code, msg, headers, newurl)
        if new is not None and urllib.parse.urlsplit(newurl).netloc != urllib.parse.urlsplit(req.full_url).netloc:
            new.remove_header("Authorization")
        return new


_OPENER = urllib.request.build_opener(_AuthStaysHome)


def http_error(url: str, exc: Exception) -> DatasetError:
    if getattr(exc, "code", None) in (401, 403, 404, 410):
        return DatasetMissing(f"{url} does not exist or is not ours to read (HTTP {exc.code})")  # type: ignore[attr-defined]
    reason = getattr(exc, "reason", None) or exc
    return DatasetUnreachable(f"cannot download {url}: {reason}")


def get_bounded(url: str, limit: int, headers: dict[str, str] | None = None) -> bytes:
    """A small file (a sidecar) read into memory, refused once the host sends more than ``limit`` bytes."""
    try:
        with _OPENER.open(urllib.request.Request(url, headers=headers or {}), timeout=HTTP_TIMEOUT) as response:
            data = response.read(limit + 1)
    except (OSError, ValueError) as exc:
        raise http_error(url, exc) from None
    if len(data) > limit:
        raise DatasetError(f"{url} is longer than {limit} bytes")
    return data


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """One download of a file at a time on this machine (two trainers may share a cache)."""
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _fetch_part(url: str, part: Path, expected: int, progress, headers: dict[str, str]) -> None:
    """Fill ``part`` up to ``expected`` bytes, resuming from what it holds when the server allows a range, and
    refuse the host the moment it sends more."""
    have = part.stat().st_size if part.exists() else 0
    if have == expected:
        return  # complete but not yet verified (an earlier attempt stopped there): the caller checks it
    if have > expected:
        part.unlink()
        have = 0
    request = urllib.request.Request(url, headers={**headers, **({"Range": f"bytes={have}-"} if have else {})})
    try:
        with _OPENER.open(request, timeout=HTTP_TIMEOUT) as response:
            if have and response.status != 206:
                have = 0  # the server sends the whole file: start again
            task = progress.add_task(url.rsplit("/", 1)[-1], total=expected, completed=have)
            with part.open("r+b" if have else "wb") as out:
                out.seek(have)
                out.truncate()
                while block := response.read(min(BLOCK, expected - have + 1)):
                    have += len(block)
                    if have > expected:
                        raise DatasetError(f"{url} is longer than the {expected} bytes {SIDECAR_NAME} states")
                    out.write(block)
                    progress.update(task, completed=have)
    except DatasetError:
        raise
    except (OSError, ValueError) as exc:  # URLError, HTTPError, timeouts, a malformed URL
        raise http_error(url, exc) from None


def download(url: str, sidecar: Sidecar, entry: TokenFile, cache: Path, progress,
             headers: dict[str, str] | None = None) -> Path:
    """The cached copy of one token file, verified against the sidecar: downloaded if it is not there yet, or
    again if the copy there no longer verifies."""
    target = cache / f"{entry.sha256}.tokens"
    expected = sidecar.file_bytes(entry)
    with _locked(cache / f"{entry.sha256}.lock"):
        if target.is_file():
            try:
                verify_token_file(target, sidecar, entry)
                return target
            except DatasetError:
                target.unlink()
        part = cache / f"{entry.sha256}.part"
        _fetch_part(url, part, expected, progress, headers or {})
        if part.stat().st_size != expected:
            raise DatasetError(f"{url} ended after {part.stat().st_size} of {expected} bytes; run again to resume")
        try:
            verify_token_file(part, sidecar, entry)
        except DatasetError as exc:
            part.unlink()
            raise DatasetError(f"{url} does not match {SIDECAR_NAME}: {exc}") from None
        os.replace(part, target)
    return target
