"""A dataset opened from HTTP or a Hub dataset repo is the local one, sample for sample; a server that lies or
breaks off leaves nothing in the cache that a later open would trust; a dataset made with another tokenizer
than the model's is refused before any token file is fetched."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from client.data import DatasetError, DatasetMissing, DatasetUnreachable, TokenizerMismatch, open_dataset
from client.data.locations import parse_hf_location
from client.data.sidecar import SIDECAR_NAME
from tests.data.conftest import TOKENIZER_DIGEST, FileServer
from tests.fake_hub import FakeHub

SEQ = 16
INDICES = list(range(0, 620, 5))


def _token_requests(server: FileServer) -> list[tuple[str, str | None]]:
    return [r for r in server.requests if r[0].endswith(".tokens")]


def test_http_dataset_is_the_local_one_and_downloads_each_file_once(
        tmp_path: Path, token_dir: Path, file_server: FileServer) -> None:
    local = open_dataset(str(token_dir), SEQ)
    remote = open_dataset(file_server.url, SEQ, cache_dir=tmp_path / "cache", show_progress=False)
    assert remote.fingerprint == local.fingerprint and remote.num_samples == local.num_samples
    assert torch.equal(remote.batch(INDICES), local.batch(INDICES))
    assert len(_token_requests(file_server)) == 4
    again = open_dataset(file_server.url, SEQ, cache_dir=tmp_path / "cache", show_progress=False)
    assert torch.equal(again.batch(INDICES), local.batch(INDICES))
    assert len(_token_requests(file_server)) == 4  # served from the cache


def test_corrupted_download_is_refused_and_not_cached(tmp_path: Path, file_server: FileServer) -> None:
    file_server.tamper = lambda name, body: body[:-1] + bytes([body[-1] ^ 1]) if name == "00002.tokens" else body
    with pytest.raises(DatasetError, match=r"00002.tokens does not match dataset.json: .* has sha256"):
        open_dataset(file_server.url, SEQ, cache_dir=tmp_path / "cache", show_progress=False)
    assert not list((tmp_path / "cache").glob("*.part"))
    file_server.tamper = lambda name, body: body  # the server is fixed: the next open succeeds
    assert open_dataset(file_server.url, SEQ, cache_dir=tmp_path / "cache", show_progress=False).num_samples > 0


def test_endless_download_is_cut_at_the_stated_size(tmp_path: Path, file_server: FileServer) -> None:
    file_server.tamper = lambda name, body: body + b"\0" * 100_000 if name.endswith(".tokens") else body
    with pytest.raises(DatasetError, match="is longer than the 6000 bytes dataset.json states"):
        open_dataset(file_server.url, SEQ, cache_dir=tmp_path / "cache", show_progress=False)
    assert all(p.stat().st_size <= 6000 for p in (tmp_path / "cache").iterdir())


def test_interrupted_download_resumes_from_its_part_file(
        tmp_path: Path, token_dir: Path, file_server: FileServer) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    entry = open_dataset(str(token_dir), SEQ).sidecar.files[0]
    (cache / f"{entry.sha256}.part").write_bytes((token_dir / entry.path).read_bytes()[:2500])
    remote = open_dataset(file_server.url, SEQ, cache_dir=cache, show_progress=False)
    assert ("00000.tokens", "bytes=2500-") in file_server.requests
    assert torch.equal(remote.batch(INDICES), open_dataset(str(token_dir), SEQ).batch(INDICES))


def test_resume_that_the_server_ignores_starts_again(
        tmp_path: Path, token_dir: Path, file_server: FileServer) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    entry = open_dataset(str(token_dir), SEQ).sidecar.files[0]
    (cache / f"{entry.sha256}.part").write_bytes(b"\xff" * 2500)  # garbage from an earlier attempt
    file_server.honour_ranges = False
    remote = open_dataset(file_server.url, SEQ, cache_dir=cache, show_progress=False)
    assert torch.equal(remote.batch(INDICES), open_dataset(str(token_dir), SEQ).batch(INDICES))


def test_tokenizer_mismatch_is_refused_before_any_download(tmp_path: Path, file_server: FileServer) -> None:
    with pytest.raises(TokenizerMismatch, match="tokenized with 'test-bpe'.*tokenize the data with the model's"):
        open_dataset(file_server.url, SEQ, tokenizer_sha256=bytes(32), cache_dir=tmp_path / "c", show_progress=False)
    assert _token_requests(file_server) == []
    matching = open_dataset(file_server.url, SEQ, tokenizer_sha256=bytes.fromhex(TOKENIZER_DIGEST),
                            cache_dir=tmp_path / "c", show_progress=False)
    assert matching.num_samples > 0


def test_byte_corpus_is_refused_for_a_model_tokenizer(token_dir: Path) -> None:
    with pytest.raises(TokenizerMismatch, match="dataset stdlib was tokenized with 'bytes'"):
        open_dataset("stdlib", SEQ, tokenizer_sha256=bytes.fromhex(TOKENIZER_DIGEST))
    with pytest.raises(TokenizerMismatch):
        open_dataset(str(token_dir), SEQ, tokenizer_sha256=bytes(32))


def test_unreachable_server_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(DatasetUnreachable, match=r"cannot download http://127.0.0.1:9/tokens/dataset.json") as err:
        open_dataset("http://127.0.0.1:9/tokens", SEQ, cache_dir=tmp_path)
    assert "\n" not in str(err.value)


def test_hub_dataset_is_the_local_one(tmp_path: Path, token_dir: Path, fake_hub: FakeHub) -> None:
    for path in token_dir.iterdir():
        fake_hub.publish("datasets/org/corpus", f"tok/{path.name}", path.read_bytes(), revision="v1")
    location = "hf:org/corpus@v1/tok"
    remote = open_dataset(location, SEQ, hf_endpoint=fake_hub.url, cache_dir=tmp_path / "hub")
    local = open_dataset(str(token_dir), SEQ)
    assert remote.fingerprint == local.fingerprint
    assert torch.equal(remote.batch(INDICES), local.batch(INDICES))
    with pytest.raises(DatasetMissing, match="hf:org/corpus@v2/tok has no dataset.json on the Hub"):
        open_dataset("hf:org/corpus@v2/tok", SEQ, hf_endpoint=fake_hub.url, cache_dir=tmp_path / "hub")


def test_hub_file_that_differs_from_its_sidecar_is_refused(tmp_path: Path, token_dir: Path, fake_hub: FakeHub) -> None:
    for path in token_dir.iterdir():
        content = path.read_bytes()
        fake_hub.publish("datasets/org/corpus", path.name, content[:-2] if path.name == "00001.tokens" else content)
    with pytest.raises(DatasetError, match="00001.tokens ended after 5998 of 6000 bytes"):
        open_dataset("hf:org/corpus", SEQ, hf_endpoint=fake_hub.url, cache_dir=tmp_path / "hub")
    assert SIDECAR_NAME in {name for _, _, name in fake_hub.files}


@pytest.mark.parametrize("location", ["hf:", "hf:org", "hf:org/name@", "hf:org/name/../x", "hf:org/na me",
                                      "hf:org/name@a/b/../c"])
def test_bad_hub_locations(location: str) -> None:
    with pytest.raises(DatasetError, match="is not hf:org/name"):
        parse_hf_location(location)


def test_hub_location_parts() -> None:
    assert parse_hf_location("hf:org/name") == ("org/name", None, "")
    assert parse_hf_location("hf:org/name@main/a/b") == ("org/name", "main", "a/b")


def test_complete_part_file_is_verified_not_fetched_again(
        tmp_path: Path, token_dir: Path, file_server: FileServer) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    entries = open_dataset(str(token_dir), SEQ).sidecar.files
    (cache / f"{entries[0].sha256}.part").write_bytes((token_dir / entries[0].path).read_bytes())
    wrong = bytearray((token_dir / entries[1].path).read_bytes())
    wrong[0] ^= 1
    (cache / f"{entries[1].sha256}.part").write_bytes(bytes(wrong))  # full length, wrong bytes
    with pytest.raises(DatasetError, match="00001.tokens does not match dataset.json"):
        open_dataset(file_server.url, SEQ, cache_dir=cache, show_progress=False)
    assert [name for name, _ in _token_requests(file_server)] == []
    remote = open_dataset(file_server.url, SEQ, cache_dir=cache, show_progress=False)  # starts that file again
    assert torch.equal(remote.batch(INDICES), open_dataset(str(token_dir), SEQ).batch(INDICES))
    assert "00000.tokens" not in [name for name, _ in _token_requests(file_server)]


def test_cached_file_that_went_bad_is_fetched_again(tmp_path: Path, token_dir: Path, file_server: FileServer) -> None:
    cache = tmp_path / "cache"
    open_dataset(file_server.url, SEQ, cache_dir=cache, show_progress=False)
    cached = next(cache.glob("*.tokens"))
    data = bytearray(cached.read_bytes())
    data[10] ^= 1
    cached.write_bytes(bytes(data))
    before = len(_token_requests(file_server))
    remote = open_dataset(file_server.url, SEQ, cache_dir=cache, show_progress=False)
    assert len(_token_requests(file_server)) == before + 1
    assert torch.equal(remote.batch(INDICES), open_dataset(str(token_dir), SEQ).batch(INDICES))
