"""update's validation on chain against config.validate_config, validate_model and validate_checkpoint.

Every field is drawn from the values around its rule's bounds (and each integer's extremes), so each
integer rule is met and broken; the program must accept exactly the updates the specification accepts
and reject the others with the same error (InvalidConfig or InvalidCheckpoint).
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
from coordinator_chain import ProgramChain, Replay
from hypothesis import given, settings
from hypothesis import strategies as st
from solders.keypair import Keypair

from coordinator_program.spec import errors, limits
from coordinator_program.spec.config import (
    Checkpoint,
    CheckpointKind,
    Config,
    GradAveraging,
    GradValues,
    Model,
    Schedule,
    Tokenizer,
    WireCodec,
    validate_model,
)
from coordinator_program.spec.instructions import Update
from tests.spec.scenario import MODEL, SMALL

U8 = st.sampled_from([0, 1, 2, 3, 4, 10, 11, 15, 16, 17, 31, 32, 33, 255])
U16 = st.sampled_from([0, 1, 2, 3, 4, 5, 17, 31, 32, 33, 240, 255, 256, 257, 349, 350, 32767, 32768, 65535])
U32 = st.sampled_from([0, 1, 2, 60, 2**31, 2**32 - 1])
TEXT = st.sampled_from(["", "stdlib", "org/model", "hf:org/x y", "donnée", "tab\there", "\x7f",
                        "~" * limits.REVISION_BYTES])
OUTCOMES: Counter[int | None] = Counter()


@st.composite
def configs(draw: st.DrawFn) -> Config:
    """A valid config with up to three fields replaced by boundary values."""
    fields = {"min_clients": U16, "max_clients": U16, "witness_nodes": U8, "witness_quorum": U8, "num_stages": U8,
              "bloom_slices": U8, "bloom_bits_per_slice": U16, "warmup_time": U32, "max_round_train_time": U32,
              "round_witness_time": U32, "cooldown_time": U32, "rounds_per_epoch": U32, "total_steps": U32,
              "global_batch_size": U32}
    chosen = draw(st.lists(st.sampled_from(sorted(fields)), max_size=3, unique=True))
    base = Config(min_clients=32, max_clients=256, witness_nodes=32, witness_quorum=17, num_stages=4,
                  bloom_slices=16, bloom_bits_per_slice=240)  # quorum 16 (half) and min_clients 31 are refused
    return Config(**{**base.__dict__, **{name: draw(fields[name]) for name in chosen}})


ARCHITECTURES = st.sampled_from(["psyswarm", "llama", "qwen2", "", "Llama", "gpt_neox", "a-b", "x" * 24])
SOURCES = st.sampled_from(["", "org/name", "./dir", "../up", "~/m", "/abs", "name", "org/na me", "a/b/c", "/caf\u00e9",
                           "org/", "/org", "~"])
REVISIONS = st.sampled_from(["", "main", "tab\there", "v 1", "donn\u00e9e", "~" * limits.SOURCE_REVISION_BYTES])
DIGESTS = st.sampled_from([bytes(32), bytes(range(32)), b"\xff" * 32])
DATASETS = st.sampled_from(["stdlib", "stdlibx", "stdli", "hf:org/data", "hf:", "hf", "http://h/d", "https://h/d",
                            "http:/h", "./tokens", "/data/text.txt"])
HF_BASE = Model(n_layers=4, n_heads=2, d_model=16, seq_len=8, architecture="llama", source="org/model",
                source_revision="main", config_sha256=bytes(range(32)), tokenizer=Tokenizer.Model,
                tokenizer_sha256=b"\xff" * 32)


CHUNKS = st.sampled_from([0, 1, 2, 3, 64, 127, limits.MAX_DEMO_CHUNK, limits.MAX_DEMO_CHUNK + 1, 255])
BETAS = st.sampled_from([0, 1, 900, limits.MAX_DEMO_BETA_PERMILLE, limits.MAX_DEMO_BETA_PERMILLE + 1, 65535])
AVERAGING = st.sampled_from([
    {}, {"grad_averaging": GradAveraging.Full},
    {"grad_averaging": GradAveraging.PowerSGD, "powersgd_rank": 1},
    {"grad_averaging": GradAveraging.PowerSGD, "powersgd_rank": limits.MAX_POWERSGD_RANK},
    {"grad_averaging": GradAveraging.DeMo, "demo_chunk": 2, "demo_topk": 1, "demo_beta_permille": 0},
    {"grad_averaging": GradAveraging.DeMo, "demo_chunk": 3, "demo_topk": 2, "demo_beta_permille": 1},
    {"grad_averaging": GradAveraging.DeMo, "demo_chunk": 64, "demo_topk": 4, "demo_beta_permille": 900},
    {"grad_averaging": GradAveraging.DeMo, "demo_chunk": limits.MAX_DEMO_CHUNK, "demo_topk": limits.MAX_DEMO_CHUNK - 1,
     "demo_beta_permille": limits.MAX_DEMO_BETA_PERMILLE},
    {"grad_averaging": GradAveraging.Full, "grad_values": GradValues.Float16},
    {"grad_averaging": GradAveraging.PowerSGD, "powersgd_rank": 4, "grad_values": GradValues.Int8},
    {"grad_averaging": GradAveraging.DeMo, "demo_chunk": 64, "demo_topk": 4, "demo_beta_permille": 900,
     "grad_values": GradValues.Int8}])
"""A gradient averaging mode with valid settings: one field replaced at random would seldom make DeMo's three
agree, so a valid DeMo model is the base that the boundary values then break, one setting or the mode at a time."""
DEMO_OUTCOMES: Counter[int | None] = Counter()


@st.composite
def models(draw: st.DrawFn) -> Model:
    """A psyswarm or an HF model description, averaging gradients in any mode, with up to three fields replaced
    by boundary values."""
    fields = {"n_layers": U8, "n_heads": U8, "d_model": U16, "seq_len": U16, "microbatch_size": U16,
              "learning_rate_micros": U32, "sparta_every": U16, "sparta_partitions": U16,
              "dataset": st.one_of(TEXT, DATASETS), "dataset_sha256": DIGESTS,
              "architecture": ARCHITECTURES, "source": SOURCES, "source_revision": REVISIONS, "config_sha256": DIGESTS,
              "tokenizer": st.sampled_from(list(Tokenizer)), "tokenizer_sha256": DIGESTS,
              "lr_schedule": st.sampled_from(list(Schedule)), "warmup_steps": U32, "lr_floor_micros": U32,
              "grad_averaging": st.sampled_from(list(GradAveraging)), "powersgd_rank": U8,
              "demo_chunk": CHUNKS, "demo_topk": CHUNKS, "demo_beta_permille": BETAS,
              "grad_values": st.sampled_from(list(GradValues)), "wire_codec": st.sampled_from(list(WireCodec))}
    chosen = draw(st.lists(st.sampled_from(sorted(fields)), max_size=3, unique=True))
    base = draw(st.sampled_from([Model(n_layers=4, n_heads=2, d_model=16, seq_len=8), HF_BASE]))
    base = dataclasses.replace(base, dataset=draw(st.sampled_from(["stdlib", "./tokens"])))  # local: any pin
    base = dataclasses.replace(base, **draw(AVERAGING))
    return Model(**{**base.__dict__, **{name: draw(fields[name]) for name in chosen}})


checkpoints = st.one_of(
    st.just(Checkpoint()), st.just(Checkpoint(CheckpointKind.Hub, "org/model", "main")),
    st.builds(Checkpoint, st.sampled_from(list(CheckpointKind)), TEXT, TEXT))


@pytest.fixture(scope="module")
def replay() -> Replay:
    authority = Keypair()
    run = Replay(ProgramChain(), authority, "config")
    assert run.apply(Update(SMALL, MODEL, Checkpoint()), authority) is None
    return run


@settings(max_examples=600, deadline=None, derandomize=True)
@given(configs(), models(), checkpoints)
def test_update_validation_matches_the_specification(replay: Replay, config: Config, model: Model,
                                                     checkpoint: Checkpoint) -> None:
    outcome = replay.apply(Update(config, model, checkpoint), replay.authority)
    OUTCOMES[outcome] += 1
    if model.grad_averaging == GradAveraging.DeMo:
        DEMO_OUTCOMES[outcome] += 1


def test_update_validation_cases_reach_every_outcome(replay: Replay) -> None:
    """Guard for the test above: accepted, InvalidConfig and InvalidCheckpoint updates were all compared."""
    if not OUTCOMES:
        test_update_validation_matches_the_specification(replay)
    assert OUTCOMES[None] >= 20
    assert OUTCOMES[errors.InvalidConfig.code] >= 100 and OUTCOMES[errors.InvalidCheckpoint.code] >= 20
    assert DEMO_OUTCOMES[None] >= 10 and DEMO_OUTCOMES[errors.InvalidConfig.code] >= 20  # DeMo compared both ways
    assert limits.MAX_BLOOM_BYTES * 8 == 16 * 240  # the base config's filter fills the largest slot exactly


@pytest.mark.parametrize(("dataset", "pinned", "accepted"), [
    ("stdlib", False, True), ("stdlib", True, False), ("hf:org/data", False, False), ("hf:org/data", True, True),
    ("https://host/data", False, False), ("http://host/data", True, True), ("./tokens", False, True),
    ("./tokens", True, True)])
def test_a_downloaded_dataset_is_pinned_and_the_embedded_one_is_not(replay: Replay, dataset: str, pinned: bool,
                                                                     accepted: bool) -> None:
    """A run whose clients download their data pins its dataset.json (else a host could change or inflate it);
    stdlib has nothing to pin; a local path may be token files (pinned) or text (not). Program and spec alike."""
    model = dataclasses.replace(MODEL, dataset=dataset, dataset_sha256=bytes(range(32)) if pinned else bytes(32))
    outcome = replay.apply(Update(SMALL, model, Checkpoint()), replay.authority)
    assert outcome == (None if accepted else errors.InvalidConfig.code)


MODES = {GradAveraging.Off: {}, GradAveraging.Full: {},
         GradAveraging.PowerSGD: {"powersgd_rank": 4},
         GradAveraging.DeMo: {"demo_chunk": 64, "demo_topk": 4, "demo_beta_permille": 900}}


@pytest.mark.parametrize("values", list(GradValues), ids=lambda v: v.name)
@pytest.mark.parametrize("mode", list(MODES), ids=lambda m: m.name)
def test_grad_values_are_accepted_or_refused_alike(replay: Replay, mode: GradAveraging, values: GradValues) -> None:
    """Any encoding with any averaging mode (with it off, SPARTA's parameter changes travel in it), except int4
    with gradient averaging (int4 carries SPARTA's slices only): program and spec alike."""
    model = dataclasses.replace(MODEL, grad_averaging=mode, **MODES[mode], grad_values=values)
    refused = values == GradValues.Int4 and mode != GradAveraging.Off
    if refused:
        with pytest.raises(errors.InvalidConfig, match="int4 carries SPARTA's slices only"):
            validate_model(model, SMALL)
    else:
        validate_model(model, SMALL)
    outcome = replay.apply(Update(SMALL, model, Checkpoint()), replay.authority)
    assert outcome == (errors.InvalidConfig.code if refused else None)


@pytest.mark.parametrize(("mode", "byte"), [(GradAveraging.Full, 2), (GradAveraging.Off, 3),
                                            (GradAveraging.Full, 4), (GradAveraging.DeMo, 4), (GradAveraging.Off, 4),
                                            (GradAveraging.PowerSGD, 255)])
def test_a_grad_values_byte_past_the_enum_is_malformed(replay: Replay, mode: GradAveraging, byte: int) -> None:
    """Raw update data whose grad_values byte names no encoding: the program refuses it as the decoding does."""
    update = Update(SMALL, dataclasses.replace(MODEL, grad_averaging=mode, **MODES[mode]), Checkpoint())
    offset, size = Update.LAYOUT.offsets(base=8)["model.grad_values"]
    data = bytearray(update.encode())
    data[offset:offset + size] = bytes([byte])
    outcome = replay.apply_data(bytes(data), Update, replay.authority)
    assert outcome == (None if byte < len(GradValues) else errors.MalformedInstruction.code)
