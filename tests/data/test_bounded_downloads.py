"""Every byte a data host sends is counted against what the run pinned: a host that sends more than
``dataset.json`` states is cut off (over HTTP and from the Hub alike), a ``dataset.json`` other than the one the
run pins is refused, and so is one declaring more than a client stores, before any token file is fetched."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import pytest
import torch

from client.data import DatasetError, open_dataset
from client.data.download import BLOCK
from client.data.sidecar import MAX_SIDECAR_BYTES, SIDECAR_NAME
from tests.data.conftest import FileServer
from tests.fake_hub import FakeHub

SEQ = 16
JUNK = 64 << 20  # what a hostile host appends to a token file: far more than any kernel buffers between us
KERNEL_SLACK = 8 << 20  # what the sockets on both ends can hold beyond what the client read


def _publish(fake_hub: FakeHub, token_dir: Path, tamper=lambda name, body: body) -> str:
    for path in token_dir.iterdir():
        fake_hub.publish("datasets/org/corpus", path.name, tamper(path.name, path.read_bytes()))
    return "hf:org/corpus"


def _pin(token_dir: Path) -> bytes:
    return hashlib.sha256((token_dir / SIDECAR_NAME).read_bytes()).digest()


def _wait_for(sent: dict[str, int], name: str) -> int:
    """What the host managed to send of ``name`` once its connection ended."""
    deadline = time.monotonic() + 30
    while name not in sent and time.monotonic() < deadline:
        time.sleep(0.05)
    return sent[name]


@pytest.mark.parametrize("host", ["http", "hub"])
def test_a_host_that_sends_more_than_declared_is_cut_off_at_the_declared_size(
        tmp_path: Path, token_dir: Path, file_server: FileServer, fake_hub: FakeHub, host: str) -> None:
    """Before: the Hub's hf_hub_download took the whole 64 MiB file into its cache and only then was it checked."""
    def tamper(name: str, body: bytes) -> bytes:
        return body + b"\0" * JUNK if name == "00000.tokens" else body

    if host == "http":
        file_server.tamper, location, sent = tamper, file_server.url, file_server.sent
    else:
        location, sent = _publish(fake_hub, token_dir, tamper), fake_hub.sent
    declared = (token_dir / "00000.tokens").stat().st_size
    with pytest.raises(DatasetError, match=f"00000.tokens is longer than the {declared} bytes dataset.json states"):
        open_dataset(location, SEQ, dataset_sha256=_pin(token_dir), cache_dir=tmp_path / "cache",
                     hf_endpoint=fake_hub.url, show_progress=False)
    assert _wait_for(sent, "00000.tokens") <= declared + BLOCK + KERNEL_SLACK < JUNK
    assert not list((tmp_path / "cache").glob("*.tokens"))  # nothing cached as complete
    assert all(path.stat().st_size <= declared for path in (tmp_path / "cache").iterdir())


def test_an_endless_dataset_json_is_read_no_further_than_its_cap(tmp_path: Path, file_server: FileServer) -> None:
    """Before: up to 8 MiB was read, and trailing spaces made 2 MiB of it a valid sidecar."""
    file_server.tamper = lambda name, body: body + b" " * (2 << 20) if name == SIDECAR_NAME else body
    with pytest.raises(DatasetError, match=f"dataset.json is longer than {MAX_SIDECAR_BYTES} bytes"):
        open_dataset(file_server.url, SEQ, cache_dir=tmp_path / "cache", show_progress=False)
    assert [name for name, _ in file_server.requests] == [SIDECAR_NAME]


@pytest.mark.parametrize("host", ["local", "http", "hub"])
def test_a_dataset_json_other_than_the_runs_is_refused(tmp_path: Path, token_dir: Path, file_server: FileServer,
                                                       fake_hub: FakeHub, host: str) -> None:
    """The host (or whoever can write the directory) swaps in another sidecar after the run pinned its own: the
    client names both digests and fetches no token file."""
    pinned = _pin(token_dir)
    sidecar = json.loads((token_dir / SIDECAR_NAME).read_bytes())
    sidecar["files"] = sidecar["files"][:2]  # another dataset, still valid
    (token_dir / SIDECAR_NAME).write_text(json.dumps(sidecar))
    location = {"local": str(token_dir), "http": file_server.url, "hub": _publish(fake_hub, token_dir)}[host]
    with pytest.raises(DatasetError) as err:
        open_dataset(location, SEQ, dataset_sha256=pinned, cache_dir=tmp_path / "cache", hf_endpoint=fake_hub.url,
                     show_progress=False)
    assert f"dataset.json has sha256 {_pin(token_dir).hex()}, but the run pins {pinned.hex()}" in str(err.value)
    assert "\n" not in str(err.value)
    assert not [name for name, _ in file_server.requests if name.endswith(".tokens")]
    assert not [name for name in fake_hub.sent if name.endswith(".tokens")]
    with pytest.raises(DatasetError, match="the run pins no dataset.json"):  # a token dataset the run left unpinned
        open_dataset(location, SEQ, dataset_sha256=bytes(32), cache_dir=tmp_path / "cache",
                     hf_endpoint=fake_hub.url, show_progress=False)


@pytest.mark.parametrize("host", ["http", "hub"])
def test_a_dataset_json_declaring_thousands_of_huge_files_is_refused_before_any_download(
        tmp_path: Path, token_dir: Path, file_server: FileServer, fake_hub: FakeHub, host: str) -> None:
    """3,000 files of 2^40 tokens each: within the sidecar's format, far beyond what a client stores. Pinned by
    the run or not, no token file is requested. Before: the first file's download began."""
    sidecar = json.loads((token_dir / SIDECAR_NAME).read_bytes())
    entry = sidecar["files"][0]
    sidecar["files"] = [{"path": f"{i:05d}.tokens", "tokens": 1 << 40, "sha256": entry["sha256"]}
                        for i in range(3000)]
    (token_dir / SIDECAR_NAME).write_text(json.dumps(sidecar))
    location = file_server.url if host == "http" else _publish(fake_hub, token_dir)
    with pytest.raises(DatasetError, match=r"dataset.json declares 6,597,069,766,656,000 bytes in 3000 token files, "
                                           r"more than this client stores of a dataset \(274,877,906,944 bytes\)"):
        open_dataset(location, SEQ, dataset_sha256=_pin(token_dir), cache_dir=tmp_path / "cache",
                     hf_endpoint=fake_hub.url, show_progress=False)
    assert not [name for name, _ in file_server.requests if name.endswith(".tokens")]
    assert not [name for name in fake_hub.sent if name.endswith(".tokens")]
    assert not list((tmp_path / "cache").glob("*.tokens"))


def test_an_honest_pinned_dataset_opens_from_either_host_and_again_from_the_cache_alone(
        tmp_path: Path, token_dir: Path, file_server: FileServer, fake_hub: FakeHub) -> None:
    local = open_dataset(str(token_dir), SEQ, dataset_sha256=_pin(token_dir))
    indices = list(range(0, 600, 7))
    for location in (file_server.url, _publish(fake_hub, token_dir)):
        cache = tmp_path / location.replace("/", "_")
        remote = open_dataset(location, SEQ, dataset_sha256=_pin(token_dir), cache_dir=cache,
                              hf_endpoint=fake_hub.url, show_progress=False)
        assert remote.fingerprint == local.fingerprint and torch.equal(remote.batch(indices), local.batch(indices))
    file_server.shutdown()
    file_server.server_close()
    again = open_dataset(file_server.url, SEQ, dataset_sha256=_pin(token_dir),
                         cache_dir=tmp_path / file_server.url.replace("/", "_"), show_progress=False)
    assert torch.equal(again.batch(indices), local.batch(indices))  # the pinned sidecar and files, from the cache
    assert open_dataset(str(token_dir), SEQ, max_bytes=1).num_samples == local.num_samples  # a local one: no bound
    with pytest.raises(DatasetError, match="more than this client stores"):
        open_dataset(_publish(fake_hub, token_dir), SEQ, max_bytes=20_000, cache_dir=tmp_path / "small",
                     hf_endpoint=fake_hub.url)
