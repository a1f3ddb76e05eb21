"""Where a run's data lives, as one string (``Model.dataset`` on chain), and opening it on this machine.

- ``stdlib``: the embedded corpus as bytes; a local file or a directory without ``dataset.json``: bytes too;
- a local directory with ``dataset.json``: token files (``~`` allowed);
- ``http://`` / ``https://`` base URL: ``<url>/dataset.json`` and the files it lists beside it, each
  downloaded once into a cache named by its sha256 (``~/.cache/psyswarm/tokens`` unless told), through a
  ``.part`` file that a later attempt resumes and that only becomes the cached file once its digest matches;
- ``hf:org/name[@revision][/subdir]``: the same files in a Hub dataset repo, through ``huggingface_hub``.

Everything downloaded is untrusted: the sidecar is parsed strictly, no download may exceed the size the
sidecar states, and every file's size, digest and ids are checked against it before use (a cached copy too).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from client.data.corpus import STDLIB_SOURCE, ByteDataset, open_byte_dataset
from client.data.sidecar import (
    BYTES_TOKENIZER_NAME,
    MAX_SIDECAR_BYTES,
    SIDECAR_NAME,
    DatasetError,
    DatasetMissing,
    DatasetUnreachable,
    Sidecar,
    TokenFile,
    TokenizerMismatch,
    parse_sidecar,
)
from client.data.tokens import TokenDataset, read_sidecar, verify_token_file
from client.data.windows import SampleDataset

HF_PREFIX = "hf:"
DEFAULT_CACHE = Path("~/.cache/psyswarm/tokens")
HTTP_TIMEOUT = 30.0
_HF_LOCATION = re.compile(r"hf:([A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*)(?:@([A-Za-z0-9._-]+))?"
                          r"(/[A-Za-z0-9._/-]+)?")
_BLOCK = 1 << 20


def is_remote(location: str) -> bool:
    return location.startswith(("http://", "https://", HF_PREFIX))


def is_token_location(location: str) -> bool:
    """Whether ``location`` names token files (else it is text read as bytes)."""
    return is_remote(location) or (Path(location).expanduser() / SIDECAR_NAME).is_file()


def parse_hf_location(location: str) -> tuple[str, str | None, str]:
    """``hf:org/name@revision/subdir`` → (repo id, revision or None, subdir without slashes at its ends)."""
    match = _HF_LOCATION.fullmatch(location)
    subdir = (match.group(3) or "").strip("/") if match else ""
    if match is None or any(part in ("", ".", "..") for part in subdir.split("/") if subdir):
        raise DatasetError(f"dataset location {location!r} is not hf:org/name[@revision][/subdir]")
    return match.group(1), match.group(2), subdir


def _progress(show: bool):
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

    return Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                    disable=not show, transient=False)


def _http_error(url: str, exc: Exception) -> DatasetError:
    if getattr(exc, "code", None) in (404, 410):
        return DatasetMissing(f"{url} does not exist (HTTP {exc.code})")  # type: ignore[attr-defined]
    reason = getattr(exc, "reason", None) or exc
    return DatasetUnreachable(f"cannot download {url}: {reason}")


def _get_bounded(url: str, limit: int) -> bytes:
    """A small file (a sidecar), refused if it is longer than ``limit``."""
    try:
        with urllib.request.urlopen(url, timeout=HTTP_TIMEOUT) as response:
            data = response.read(limit + 1)
    except (OSError, ValueError) as exc:
        raise _http_error(url, exc) from None
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


def _fetch_part(url: str, part: Path, expected: int, progress) -> None:
    """Fill ``part`` up to ``expected`` bytes, resuming from what it holds when the server allows a range."""
    have = part.stat().st_size if part.exists() else 0
    if have == expected:
        return  # complete but not yet verified (an earlier attempt stopped there): the caller checks it
    if have > expected:
        part.unlink()
        have = 0
    request = urllib.request.Request(url, headers={"Range": f"bytes={have}-"} if have else {})
    try:
        with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT) as response:
            if have and response.status != 206:
                have = 0  # the server sends the whole file: start again
            task = progress.add_task(url.rsplit("/", 1)[-1], total=expected, completed=have)
            with part.open("r+b" if have else "wb") as out:
                out.seek(have)
                out.truncate()
                while block := response.read(min(_BLOCK, expected - have + 1)):
                    have += len(block)
                    if have > expected:
                        raise DatasetError(f"{url} is longer than the {expected} bytes {SIDECAR_NAME} states")
                    out.write(block)
                    progress.update(task, completed=have)
    except DatasetError:
        raise
    except (OSError, ValueError) as exc:  # URLError, HTTPError, timeouts, a malformed URL
        raise _http_error(url, exc) from None


def _download(url: str, sidecar: Sidecar, entry: TokenFile, cache: Path, progress) -> Path:
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
        _fetch_part(url, part, expected, progress)
        if part.stat().st_size != expected:
            raise DatasetError(f"{url} ended after {part.stat().st_size} of {expected} bytes; run again to resume")
        try:
            verify_token_file(part, sidecar, entry)
        except DatasetError as exc:
            part.unlink()
            raise DatasetError(f"{url} does not match {SIDECAR_NAME}: {exc}") from None
        os.replace(part, target)
    return target


def check_tokenizer(location: str, name: str, digest: bytes, expected: bytes | None) -> None:
    """Refuse data tokenized otherwise than the model expects (``expected`` None: no expectation)."""
    if expected is not None and digest != expected:
        raise TokenizerMismatch(f"dataset {location} was tokenized with {name!r} (tokenizer sha256 "
                                f"{digest.hex()[:16]}...), but the model's tokenizer has sha256 "
                                f"{expected.hex()[:16]}...; tokenize the data with the model's tokenizer "
                                "(psyswarm tokenize)")


def _check_sidecar(location: str, sidecar: Sidecar, expected: bytes | None) -> None:
    check_tokenizer(location, sidecar.tokenizer_name, bytes.fromhex(sidecar.tokenizer_sha256), expected)


def open_http(base_url: str, seq_len: int, *, cache_dir: Path | None = None, show_progress: bool | None = None,
              tokenizer_sha256: bytes | None = None) -> TokenDataset:
    base = base_url.rstrip("/") + "/"
    sidecar = parse_sidecar(_get_bounded(base + SIDECAR_NAME, MAX_SIDECAR_BYTES))
    _check_sidecar(base_url, sidecar, tokenizer_sha256)
    cache = (cache_dir or DEFAULT_CACHE).expanduser()
    cache.mkdir(parents=True, exist_ok=True)
    with _progress(sys.stderr.isatty() if show_progress is None else show_progress) as progress:
        paths = [_download(base + entry.path, sidecar, entry, cache, progress) for entry in sidecar.files]
    return TokenDataset(sidecar, paths, seq_len, name=base_url, verified=True)


def _hub_file(location: str, filename: str, *, endpoint: str | None, token: str | None,
              cache_dir: Path | None) -> Path:
    from httpx import HTTPError
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError

    repo, revision, subdir = parse_hf_location(location)
    try:
        return Path(hf_hub_download(repo, f"{subdir}/{filename}" if subdir else filename, repo_type="dataset",
                                    revision=revision, endpoint=endpoint, token=token,
                                    cache_dir=str(cache_dir) if cache_dir else None))
    except (RepositoryNotFoundError, RevisionNotFoundError, EntryNotFoundError):
        raise DatasetMissing(f"{location} has no {filename} on the Hub: no such dataset, revision or file (a "
                             "private dataset needs HF_TOKEN)") from None
    except (OSError, ValueError, HTTPError) as exc:
        raise DatasetUnreachable(f"cannot download {filename} from {location}: "
                                 f"{str(exc).splitlines()[0][:200]}") from None


def read_location_sidecar(location: str, *, hf_endpoint: str | None = None, hf_token: str | None = None,
                          cache_dir: Path | None = None) -> Sidecar:
    """Only the sidecar of a token dataset (what ``validate-config`` needs): no token file is fetched."""
    if location.startswith(HF_PREFIX):
        path = _hub_file(location, SIDECAR_NAME, endpoint=hf_endpoint, token=hf_token, cache_dir=cache_dir)
        return read_sidecar(path.parent)
    if is_remote(location):
        return parse_sidecar(_get_bounded(location.rstrip("/") + "/" + SIDECAR_NAME, MAX_SIDECAR_BYTES))
    return read_sidecar(Path(location).expanduser())


def check_dataset_tokenizer(location: str, expected: bytes, *, hf_endpoint: str | None = None,
                            hf_token: str | None = None) -> None:
    """Refuse (``TokenizerMismatch``) a dataset made with another tokenizer than ``expected``, reading only a
    token dataset's sidecar; ``DatasetUnreachable`` when that sidecar cannot be fetched from here."""
    if location == STDLIB_SOURCE or not is_token_location(location):
        check_tokenizer(location, BYTES_TOKENIZER_NAME, ByteDataset.tokenizer_sha256, expected)
    else:
        sidecar = read_location_sidecar(location, hf_endpoint=hf_endpoint, hf_token=hf_token)
        _check_sidecar(location, sidecar, expected)


def open_hub(location: str, seq_len: int, *, endpoint: str | None = None, token: str | None = None,
             cache_dir: Path | None = None, tokenizer_sha256: bytes | None = None) -> TokenDataset:
    def fetch(name: str) -> Path:
        return _hub_file(location, name, endpoint=endpoint, token=token, cache_dir=cache_dir)

    sidecar_path = fetch(SIDECAR_NAME)
    sidecar = read_sidecar(sidecar_path.parent)
    _check_sidecar(location, sidecar, tokenizer_sha256)
    return TokenDataset(sidecar, [fetch(entry.path) for entry in sidecar.files], seq_len, name=location)


def open_dataset(location: str, seq_len: int, *, tokenizer_sha256: bytes | None = None,
                 cache_dir: Path | None = None, hf_endpoint: str | None = None, hf_token: str | None = None,
                 show_progress: bool | None = None) -> SampleDataset:
    """The dataset a run names (``Model.dataset``), opened so that sample ``i`` means the same tokens on every
    machine. With ``tokenizer_sha256`` (the model's; all zeros for byte-level) data tokenized otherwise is
    refused before anything is downloaded. ``DatasetError`` (a ``ValueError``) says why it cannot be opened."""
    if location == STDLIB_SOURCE or not is_token_location(location):
        check_tokenizer(location, BYTES_TOKENIZER_NAME, ByteDataset.tokenizer_sha256, tokenizer_sha256)
        return open_byte_dataset([location], seq_len)
    if location.startswith(HF_PREFIX):
        return open_hub(location, seq_len, endpoint=hf_endpoint, token=hf_token, cache_dir=cache_dir,
                        tokenizer_sha256=tokenizer_sha256)
    if is_remote(location):
        return open_http(location, seq_len, cache_dir=cache_dir, show_progress=show_progress,
                         tokenizer_sha256=tokenizer_sha256)
    directory = Path(location).expanduser()
    sidecar = read_sidecar(directory)
    _check_sidecar(location, sidecar, tokenizer_sha256)
    return TokenDataset(sidecar, [directory / f.path for f in sidecar.files], seq_len, name=location)
