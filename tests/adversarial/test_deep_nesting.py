"""Values nested deeper than Python's ``json`` can walk, from every party that hands a client JSON or msgpack.

hivemind's msgpack reader delivers arrays up to 1,023 levels deep, and a peer's JSON text can nest as deep as its
length allows; ``json`` raises RecursionError past about 1,000 levels, an error no code refusing bad input with
ValueError expected. Each attack here hands a real component such a value and asserts that it is refused the way a
malformed one is (a reason, never an exception that would end a witness's or an averager's round):

- an averaging declaration, from a roster member and from a stranger, as a real averager reads the gathered blob
  (before: RecursionError out of ``_admit``, failing the honest groupmates' round, a stranger's included);
- a stage message's metadata (a hostile worker's answer to a trainer, or a trainer's request to a worker);
- the signed header a head quotes as evidence of wrong data; a record a witness admits;
- what an auth service answers, and the step file of a checkpoint a joiner loads.
"""

from __future__ import annotations

import struct
from pathlib import Path

import msgpack
import pytest
from hivemind.utils.serializer import MSGPackSerializer
from solders.keypair import Keypair

from client.averaging.membership import Roster, check, falsehood
from client.join.auth import AuthError, _json
from client.join.checkpoints import stage_files
from client.join.state_download import saved_step
from client.pipeline.datacheck import WrongData
from client.pipeline.messages import MAGIC, MAX_META_BYTES, MessageError, decode_message
from client.witness.records import Accusation, RecordError
from tests.averaging.test_attacks import tensors

DEEP_MSGPACK = b"\x91" * 1022 + b"\x90"  # the deepest array hivemind's msgpack reader delivers: 1,023 levels
DEEP_JSON = "[" * 100_000 + "]" * 100_000


def deep_json(most: int) -> str:
    """The deepest JSON array that fits in ``most`` characters."""
    return "[" * (most // 2) + "]" * (most // 2)


def declaration(keypair: Keypair) -> bytes:
    """A member's averaging declaration, as msgpack, with a field 1,023 levels deep (its seal is junk: the attack
    is on the reading, which comes before any signature is checked)."""
    fields = {"round": 0, "weight": 1.0, "epoch": 0, "member": bytes(keypair.pubkey()).hex(), "seal": "00" * 64}
    packed = b"".join(msgpack.packb(k) + msgpack.packb(v) for k, v in fields.items())
    return bytes([0x80 | (len(fields) + 1)]) + packed + msgpack.packb("deep") + DEEP_MSGPACK


def test_a_deep_declaration_is_refused_and_proves_nothing() -> None:
    member = Keypair()
    roster = Roster(0, frozenset({bytes(member.pubkey())}))
    sealed = MSGPackSerializer.loads(declaration(member))
    assert check(sealed, "run.stage.sparta", b"peer", roster, 0) == "its declaration is not plain data"
    assert falsehood(sealed, "run.stage.sparta", b"peer", 1.0, None) is None


@pytest.mark.parametrize("on_roster", [True, False], ids=["member", "stranger"])
def test_a_real_averager_drops_a_deep_declaration(make_averager, on_roster: bool) -> None:
    """The averager's own reading of a gathered blob (hivemind's header, then the declaration): a refusal, and no
    lie kept. Its roster and round here are the host's copies (none until a round hands them over), so they are set
    as a round would set them."""
    attacker = Keypair()
    stage = make_averager(tensors(0)).averager
    stage._round.value = 0
    if on_roster:
        stage._roster = Roster(0, frozenset({bytes(attacker.pubkey())}))
    blob = MSGPackSerializer.dumps((None, 0, declaration(attacker)))
    refusal = stage._check(blob, stage.peer_id)
    assert isinstance(refusal, str)
    assert refusal == ("its declaration is not plain data" if on_roster else "its key is not on the stage's roster")
    stage._keep_if_lie(blob, stage.peer_id)
    assert stage.drain_lies() == []


def test_deep_message_metadata_is_refused_with_a_reason() -> None:
    meta = deep_json(MAX_META_BYTES).encode()
    payload = MAGIC + struct.pack("<I", len(meta)) + meta + struct.pack("<B", 0)
    with pytest.raises(MessageError, match="metadata is not valid UTF-8 JSON"):
        decode_message(payload, max_elements=1)


def test_a_deep_quoted_request_is_not_a_header() -> None:
    with pytest.raises(ValueError, match="not JSON"):
        WrongData(deep_json(2048), "00" * 64).header()


def test_a_deep_record_is_refused_as_a_record() -> None:
    author = Keypair()  # no one can sign it (``canonical`` refuses it), so its signature is made up
    record = Accusation(author=bytes(author.pubkey()).hex(), signature="00" * 64, run_id="run", epoch=0, round=0,
                        accusations=({"deep": MSGPackSerializer.loads(DEEP_MSGPACK)},))
    with pytest.raises(RecordError):
        record.admit(bytes(author.pubkey()).hex(), "run", 0, 0)


def test_a_deep_answer_from_an_auth_service_is_a_bad_answer() -> None:
    with pytest.raises(AuthError, match="did not answer with a JSON object"):
        _json(DEEP_JSON.encode())


def test_a_checkpoint_s_deep_step_file_names_no_step(tmp_path: Path) -> None:
    (tmp_path / stage_files("body1")[2]).write_text(deep_json(4096))
    assert saved_step(tmp_path, "body1") is None
