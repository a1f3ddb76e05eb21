"""Where a run's data lives, as one string (``Model.dataset`` on chain), and opening it on this machine.

- ``stdlib``: the embedded corpus as bytes; a local file or a directory without ``dataset.json``: bytes too;
- a local directory with ``dataset.json``: token files (``~`` allowed);
- ``http://`` / ``https://`` base URL: ``<url>/dataset.json`` and the files it lists beside it, each
  downloaded once into a cache named by its sha256 (``~/.cache/psyswarm/tokens`` unless told), through a
  ``.part`` file that a later attempt resumes and that only becomes the cached file once its digest matches;
- ``hf:org/name[@revision][/subdir]``: the same files in a Hub dataset repo, at the URLs ``huggingface_hub``
  gives, downloaded the same way (``download``).

Everything downloaded is untrusted. The run pins ``dataset.json`` by the sha256 of its bytes
(``Model.dataset_sha256``; all zero for ``stdlib`` and text read as bytes, which have none), so a data host
cannot change what the run trains on nor declare files the run did not; a client refuses a sidecar whose
digest differs, and one whose files add up to more than it agreed to store (``max_bytes``), before it fetches
any token file. No download may exceed the size the sidecar states, and every file's size, digest and ids are
checked against it before use (a cached copy too).
"""

from __future__ import annotations

import hashlib
import re
import sys
from collections.abc import Callable
from pathlib import Path

from client.data.corpus import STDLIB_SOURCE, ByteDataset, open_byte_dataset
from client.data.download import download, get_bounded
from client.data.sidecar import (
    BYTES_TOKENIZER_NAME,
    MAX_SIDECAR_BYTES,
    SIDECAR_NAME,
    DatasetError,
    DatasetMissing,
    DatasetUnreachable,
    Sidecar,
    TokenizerMismatch,
    parse_sidecar,
)
from client.data.tokens import TokenDataset, read_sidecar_bytes
from client.data.windows import SampleDataset

HF_PREFIX = "hf:"
DEFAULT_CACHE = Path("~/.cache/psyswarm/tokens")
DEFAULT_MAX_DATASET_BYTES = 256 << 30
"""The most a client stores of one dataset's token files unless told otherwise (``--max-dataset-gib``)."""
NO_DIGEST = bytes(32)
_HF_LOCATION = re.compile(r"hf:([A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*)(?:@([A-Za-z0-9._-]+))?"
                          r"(/[A-Za-z0-9._/-]+)?")


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


def _file_urls(location: str, hf_endpoint: str | None) -> Callable[[str], str]:
    """A remote dataset's file name → its URL: beside ``dataset.json`` for HTTP(S), the Hub's resolve URL for
    ``hf:`` (built lazily, so that a dataset already cached opens with the Hub out of reach)."""
    if not location.startswith(HF_PREFIX):
        base = location.rstrip("/") + "/"
        return lambda name: base + name
    repo, revision, subdir = parse_hf_location(location)

    def url(name: str) -> str:
        from huggingface_hub import constants, hf_hub_url

        if constants.HF_HUB_OFFLINE:
            raise DatasetUnreachable(f"cannot download {name} from {location}: HF_HUB_OFFLINE is set")
        return hf_hub_url(repo, f"{subdir}/{name}" if subdir else name, repo_type="dataset", revision=revision,
                          endpoint=hf_endpoint)
    return url


def _hub_headers(location: str, token: str | None) -> dict[str, str]:
    if not location.startswith(HF_PREFIX):
        return {}
    from huggingface_hub.utils import build_hf_headers

    return build_hf_headers(token=token)


def _fetch_sidecar(location: str, hf_endpoint: str | None, hf_token: str | None) -> bytes:
    """A remote ``dataset.json``'s bytes, no more than ``MAX_SIDECAR_BYTES`` of them read."""
    try:
        return get_bounded(_file_urls(location, hf_endpoint)(SIDECAR_NAME), MAX_SIDECAR_BYTES,
                           _hub_headers(location, hf_token))
    except DatasetMissing:
        if not location.startswith(HF_PREFIX):
            raise
        raise DatasetMissing(f"{location} has no {SIDECAR_NAME} on the Hub: no such dataset, revision or file (a "
                             "private dataset needs HF_TOKEN)") from None


def location_sidecar_bytes(location: str, *, hf_endpoint: str | None = None, hf_token: str | None = None) -> bytes:
    """The ``dataset.json`` of a token dataset as its host serves it (what the run pins by digest)."""
    if is_remote(location):
        return _fetch_sidecar(location, hf_endpoint, hf_token)
    return read_sidecar_bytes(Path(location).expanduser())


def dataset_sha256(location: str, *, hf_endpoint: str | None = None, hf_token: str | None = None) -> bytes:
    """What a run pins its dataset by: the sha256 of a token dataset's ``dataset.json``; all zero for the
    embedded corpus and text read as bytes, which have no sidecar (and change no one's samples but their own)."""
    if location == STDLIB_SOURCE or not is_token_location(location):
        return NO_DIGEST
    return hashlib.sha256(location_sidecar_bytes(location, hf_endpoint=hf_endpoint, hf_token=hf_token)).digest()


def check_pinned_sidecar(location: str, raw: bytes, expected: bytes | None) -> None:
    """Refuse a ``dataset.json`` that is not the one the run pinned (``expected`` None: no pin to check)."""
    if expected is None:
        return
    if expected == NO_DIGEST:
        raise DatasetError(f"dataset {location} is token files, but the run pins no {SIDECAR_NAME} "
                           "(dataset_sha256 is zero); create the run again so that its dataset is pinned")
    found = hashlib.sha256(raw).digest()
    if found != expected:
        raise DatasetError(f"dataset {location}: {SIDECAR_NAME} has sha256 {found.hex()}, but the run pins "
                           f"{expected.hex()}; the data changed after the run was created, refusing it")


def _pinned_sidecar(location: str, raw: bytes, dataset_digest: bytes | None,
                    tokenizer_digest: bytes | None) -> Sidecar:
    check_pinned_sidecar(location, raw, dataset_digest)
    sidecar = parse_sidecar(raw)
    check_tokenizer(location, sidecar.tokenizer_name, bytes.fromhex(sidecar.tokenizer_sha256), tokenizer_digest)
    return sidecar


def check_tokenizer(location: str, name: str, digest: bytes, expected: bytes | None) -> None:
    """Refuse data tokenized otherwise than the model expects (``expected`` None: no expectation)."""
    if expected is not None and digest != expected:
        raise TokenizerMismatch(f"dataset {location} was tokenized with {name!r} (tokenizer sha256 "
                                f"{digest.hex()[:16]}...), but the model's tokenizer has sha256 "
                                f"{expected.hex()[:16]}...; tokenize the data with the model's tokenizer "
                                "(psyswarm tokenize)")


def _cached_sidecar(cache: Path, digest: bytes | None) -> bytes | None:
    """A pinned ``dataset.json`` kept from an earlier open, if it is still the pinned one."""
    if digest is None or digest == NO_DIGEST:
        return None
    path = cache / f"{digest.hex()}.json"
    try:
        raw = path.read_bytes()[:MAX_SIDECAR_BYTES + 1]
    except OSError:
        return None
    return raw if hashlib.sha256(raw).digest() == digest else None


def _keep_sidecar(cache: Path, raw: bytes, digest: bytes | None) -> None:
    if digest is not None and digest != NO_DIGEST:
        part = cache / f"{digest.hex()}.json.part"
        part.write_bytes(raw)
        part.replace(cache / f"{digest.hex()}.json")


def open_remote(location: str, seq_len: int, *, cache_dir: Path | None = None, show_progress: bool | None = None,
                tokenizer_sha256: bytes | None = None, dataset_sha256: bytes | None = None,
                max_bytes: int = DEFAULT_MAX_DATASET_BYTES, hf_endpoint: str | None = None,
                hf_token: str | None = None) -> TokenDataset:
    """An HTTP(S) or Hub dataset: its sidecar checked against the run's pins and ``max_bytes`` before any token
    file is fetched, then each file downloaded (or found in the cache) and verified."""
    cache = (cache_dir or DEFAULT_CACHE).expanduser()
    cache.mkdir(parents=True, exist_ok=True)
    raw = _cached_sidecar(cache, dataset_sha256)
    if raw is None:
        raw = _fetch_sidecar(location, hf_endpoint, hf_token)
    sidecar = _pinned_sidecar(location, raw, dataset_sha256, tokenizer_sha256)
    if sidecar.total_bytes > max_bytes:
        raise DatasetError(f"dataset {location}: {SIDECAR_NAME} declares {sidecar.total_bytes:,} bytes in "
                           f"{len(sidecar.files)} token files, more than this client stores of a dataset "
                           f"({max_bytes:,} bytes); raise --max-dataset-gib if it is meant to be that large")
    _keep_sidecar(cache, raw, dataset_sha256)
    url, headers = _file_urls(location, hf_endpoint), _hub_headers(location, hf_token)
    with _progress(sys.stderr.isatty() if show_progress is None else show_progress) as progress:
        paths = [download(url(entry.path), sidecar, entry, cache, progress, headers) for entry in sidecar.files]
    return TokenDataset(sidecar, paths, seq_len, name=location, verified=True)


def read_location_sidecar(location: str, *, hf_endpoint: str | None = None, hf_token: str | None = None) -> Sidecar:
    """Only the sidecar of a token dataset (what ``validate-config`` needs): no token file is fetched."""
    return parse_sidecar(location_sidecar_bytes(location, hf_endpoint=hf_endpoint, hf_token=hf_token))


def check_dataset_tokenizer(location: str, expected: bytes, *, hf_endpoint: str | None = None,
                            hf_token: str | None = None) -> None:
    """Refuse (``TokenizerMismatch``) a dataset made with another tokenizer than ``expected``, reading only a
    token dataset's sidecar; ``DatasetUnreachable`` when that sidecar cannot be fetched from here."""
    if location == STDLIB_SOURCE or not is_token_location(location):
        check_tokenizer(location, BYTES_TOKENIZER_NAME, ByteDataset.tokenizer_sha256, expected)
    else:
        sidecar = read_location_sidecar(location, hf_endpoint=hf_endpoint, hf_token=hf_token)
        check_tokenizer(location, sidecar.tokenizer_name, bytes.fromhex(sidecar.tokenizer_sha256), expected)


def open_dataset(location: str, seq_len: int, *, tokenizer_sha256: bytes | None = None,
                 dataset_sha256: bytes | None = None, max_bytes: int = DEFAULT_MAX_DATASET_BYTES,
                 cache_dir: Path | None = None, hf_endpoint: str | None = None, hf_token: str | None = None,
                 show_progress: bool | None = None) -> SampleDataset:
    """The dataset a run names (``Model.dataset``), opened so that sample ``i`` means the same tokens on every
    machine. With ``tokenizer_sha256`` (the model's; all zeros for byte-level) data tokenized otherwise is
    refused, and with ``dataset_sha256`` (the run's pin of ``dataset.json``) any other sidecar is, both before
    anything is downloaded; so is a remote sidecar declaring more than ``max_bytes``. ``DatasetError`` (a
    ``ValueError``) says why it cannot be opened."""
    if location == STDLIB_SOURCE or not is_token_location(location):
        if dataset_sha256 not in (None, NO_DIGEST):
            raise DatasetError(f"dataset {location} is text read as bytes, which has no {SIDECAR_NAME}, but the run "
                               "pins one (dataset_sha256 is not zero); is the token directory missing here?")
        check_tokenizer(location, BYTES_TOKENIZER_NAME, ByteDataset.tokenizer_sha256, tokenizer_sha256)
        return open_byte_dataset([location], seq_len)
    if is_remote(location):
        return open_remote(location, seq_len, cache_dir=cache_dir, show_progress=show_progress,
                           tokenizer_sha256=tokenizer_sha256, dataset_sha256=dataset_sha256, max_bytes=max_bytes,
                           hf_endpoint=hf_endpoint, hf_token=hf_token)
    directory = Path(location).expanduser()
    sidecar = _pinned_sidecar(location, read_sidecar_bytes(directory), dataset_sha256, tokenizer_sha256)
    return TokenDataset(sidecar, [directory / f.path for f in sidecar.files], seq_len, name=location)
