"""Conformance of the points ledger and of the model's description: the C program against the specification.

Rounds whose witnesses name clients present and working (compute keys), in several rounds over two epochs and
from a full ledger, must leave byte-identical accounts; model descriptions of every kind must be accepted or
refused alike.
"""

from __future__ import annotations

import dataclasses

import pytest
from coordinator_chain import ProgramChain, Replay, Swarm, training_swarm
from solders.keypair import Keypair

from coordinator_program.spec import derived, errors, limits
from coordinator_program.spec.config import (
    Checkpoint,
    GradAveraging,
    GradValues,
    Model,
    Schedule,
    Tokenizer,
    WireCodec,
    bloom_params,
    filter_capacity,
)
from coordinator_program.spec.instructions import Tick, Update
from coordinator_program.spec.state import LedgerEntry, Phase, Role
from tests.spec.scenario import MODEL, SMALL

CONFIG = dataclasses.replace(SMALL, rounds_per_epoch=3, total_steps=20, global_batch_size=11)
"""Three trainers share 11 samples 4/4/3, so the seed's order decides who takes the larger shares."""


def run_round(swarm: Swarm, authority: Keypair, present: list[bytes], worked: list[bytes],
              witnesses: list[bytes] | None = None) -> None:
    """The round's witnesses prove, then ticks carry the run past the round's end."""
    outcomes = swarm.prove(present, witnesses, worked)
    assert set(outcomes) == {None}
    apply = swarm.replay.apply
    if swarm.state.phase == Phase.RoundTrain:
        assert apply(Tick(), authority, advance=CONFIG.max_round_train_time) is None
    assert apply(Tick(), authority, advance=CONFIG.round_witness_time) is None
    while swarm.state.phase == Phase.RoundWitness:  # a full ledger: 4 displaced entries a tick
        assert apply(Tick(), authority) is None


def synthetic_ledger() -> list[LedgerEntry]:
    """A full ledger of earners not in the run, sorted by id, with points from 1 to 40 (so some tie)."""
    return [LedgerEntry(i.to_bytes(2, "big") + b"\x07" * 30, 1 + i % 40, (i * 37) % 11)
            for i in range(limits.MAX_CLIENTS)]


@pytest.mark.parametrize("full", [False, True], ids=["empty ledger", "full ledger"])
def test_points_over_rounds_and_epochs_match_the_specification(full: bool) -> None:
    swarm, authority = training_swarm(CONFIG, MODEL, workers=4, trainers=3)
    if full:
        state = dataclasses.replace(swarm.state)
        state.ledger = synthetic_ledger()
        swarm.replay.load(state)
    apply = swarm.replay.apply
    everyone = swarm.clients()
    trainers = [c.id for c in swarm.state.clients if c.role == Role.Trainer]

    run_round(swarm, authority, everyone, everyone)  # everyone present and counted
    run_round(swarm, authority, everyone, everyone[::2])  # half counted: shares split differently
    liar, *honest = derived.witnesses(swarm.state)
    run_round(swarm, authority, everyone[1:], everyone[1:], honest)  # the first client left out by all but one
    assert swarm.state.phase == Phase.Cooldown and swarm.state.epoch == 0
    earned = {e.id: (e.presence, e.compute) for e in swarm.state.ledger}
    assert all(earned[c][0] >= 2 for c in everyone) and all(earned[t][1] > 0 for t in trainers)

    assert apply(Tick(), authority, advance=CONFIG.cooldown_time) is None  # the epoch ends: points stay
    assert swarm.state.phase == Phase.WaitingForMembers
    assert {e.id: (e.presence, e.compute) for e in swarm.state.ledger} == earned
    assert apply(Tick(), authority) is None and apply(Tick(), authority, advance=CONFIG.warmup_time) is None
    assert swarm.state.phase == Phase.RoundTrain and swarm.state.epoch == 1
    everyone = swarm.clients()
    run_round(swarm, authority, everyone, everyone[1:])
    run_round(swarm, authority, everyone, [])
    assert len(swarm.state.ledger) == (limits.MAX_CLIENTS if full else len(everyone))
    if full:  # the run's clients evicted the synthetic entries with the fewest points, the first on ties
        assert {c for c in everyone} <= {e.id for e in swarm.state.ledger}
        kept = {e.id for e in swarm.state.ledger}
        evicted = [e for e in synthetic_ledger() if e.id not in kept]
        assert len(evicted) == len(everyone) and max(e.total for e in evicted) <= min(
            e.total for e in synthetic_ledger() if e.id in kept)


LLAMA = Model(n_layers=4, n_heads=2, d_model=16, seq_len=8, architecture="llama", source="org/tiny-llama",
              source_revision="v1", config_sha256=bytes(range(32)), tokenizer=Tokenizer.Model,
              tokenizer_sha256=bytes(range(1, 33)), lr_schedule=Schedule.WarmupCosine, warmup_steps=3,
              lr_floor_micros=100, grad_averaging=GradAveraging.PowerSGD, powersgd_rank=8,
              wire_codec=WireCodec.BFloat16)

DEMO = dataclasses.replace(LLAMA, grad_averaging=GradAveraging.DeMo, powersgd_rank=0, demo_chunk=64, demo_topk=4,
                           demo_beta_permille=900)


@pytest.mark.parametrize(("model", "error"), [
    (LLAMA, None),
    (dataclasses.replace(LLAMA, source="./local/dir", tokenizer=Tokenizer.Bytes, tokenizer_sha256=bytes(32)), None),
    (dataclasses.replace(MODEL, lr_schedule=Schedule.LinearWarmup, warmup_steps=CONFIG.total_steps), None),
    (dataclasses.replace(LLAMA, lr_schedule=Schedule.LinearWarmup), errors.InvalidConfig),  # keeps a floor
    (dataclasses.replace(LLAMA, warmup_steps=CONFIG.total_steps), errors.InvalidConfig),  # no decay left
    (dataclasses.replace(LLAMA, lr_floor_micros=1001), errors.InvalidConfig),  # floor above the rate
    (dataclasses.replace(MODEL, warmup_steps=1), errors.InvalidConfig),  # constant with a warmup
    (dataclasses.replace(LLAMA, architecture="Llama"), errors.InvalidConfig),
    (dataclasses.replace(LLAMA, architecture=""), errors.InvalidConfig),
    (dataclasses.replace(LLAMA, source="no-slash"), errors.InvalidConfig),
    (dataclasses.replace(LLAMA, config_sha256=bytes(32)), errors.InvalidConfig),  # an HF model unpinned
    (dataclasses.replace(LLAMA, tokenizer_sha256=bytes(32)), errors.InvalidConfig),
    (dataclasses.replace(MODEL, config_sha256=bytes(range(32))), errors.InvalidConfig),  # psyswarm pins nothing
    (dataclasses.replace(MODEL, source="org/x"), errors.InvalidConfig),
    (dataclasses.replace(LLAMA, powersgd_rank=0), errors.InvalidConfig),
    (dataclasses.replace(LLAMA, grad_averaging=GradAveraging.Off), errors.InvalidConfig),  # a rank without it
    (DEMO, None),
    (dataclasses.replace(DEMO, demo_chunk=129), errors.InvalidConfig),
    (dataclasses.replace(DEMO, demo_topk=64), errors.InvalidConfig),  # as many as the chunk holds
    (dataclasses.replace(DEMO, demo_beta_permille=1000), errors.InvalidConfig),
    (dataclasses.replace(DEMO, grad_averaging=GradAveraging.Full), errors.InvalidConfig),  # settings without it
    (dataclasses.replace(LLAMA, demo_beta_permille=900), errors.InvalidConfig),  # a β with powersgd
    (dataclasses.replace(LLAMA, grad_values=GradValues.Int8), None),
    (dataclasses.replace(DEMO, grad_values=GradValues.Float16), None),
    (dataclasses.replace(MODEL, grad_values=GradValues.Int8), None),  # without grad averaging: SPARTA's codec
    (dataclasses.replace(MODEL, grad_values=GradValues.Int4), None),
    (dataclasses.replace(LLAMA, grad_values=GradValues.Int4), errors.InvalidConfig),  # int4: SPARTA's slices only
    (dataclasses.replace(MODEL, whole_batch_moment=True, grad_values=GradValues.Int4), None),
    (dataclasses.replace(LLAMA, whole_batch_moment=True), errors.InvalidConfig),  # with gradient averaging
    (dataclasses.replace(DEMO, whole_batch_moment=True), errors.InvalidConfig),
    (dataclasses.replace(MODEL, gossip_rank=4, grad_values=GradValues.Int8), None),
    (dataclasses.replace(MODEL, gossip_rank=64), None),
    (dataclasses.replace(MODEL, gossip_rank=65), errors.InvalidConfig),
    (dataclasses.replace(MODEL, gossip_rank=255), errors.InvalidConfig),
    (dataclasses.replace(MODEL, gossip_rank=4, grad_values=GradValues.Int4), errors.InvalidConfig),
    (dataclasses.replace(LLAMA, gossip_rank=4), errors.InvalidConfig),  # with gradient averaging
    (dataclasses.replace(MODEL, audit_permille=0), None),
    (dataclasses.replace(MODEL, audit_permille=1000), None),
    (dataclasses.replace(MODEL, audit_permille=1001), errors.InvalidConfig),
    (dataclasses.replace(MODEL, audit_permille=65535), errors.InvalidConfig),
], ids=lambda v: "" if not isinstance(v, Model) else f"{v.architecture}-{v.lr_schedule.name}")
def test_model_descriptions_are_accepted_or_refused_alike(model: Model, error: type | None) -> None:
    authority = Keypair()
    replay = Replay(ProgramChain(), authority, "models")
    assert replay.apply(Update(CONFIG, model, Checkpoint()), authority) == (None if error is None else error.code)
    if error is None:
        assert replay.state.model == model


def test_many_trainers_take_the_larger_shares_by_data_ticket_as_the_specification() -> None:
    """300 trainers share 1,000 samples, so the first 100 of the data order take 4 and the rest 3: the program
    finds those 100, through the count of tickets by first byte and a heap among those sharing the 100th's, as the
    specification ranks them; over two rounds, two seeds, the second leaving a trainer out of its proofs."""
    slices, bits = bloom_params(filter_capacity(320), 0.0009)
    config = dataclasses.replace(CONFIG, max_clients=320, bloom_slices=slices, bloom_bits_per_slice=bits,
                                 global_batch_size=1000)
    swarm, authority = training_swarm(config, MODEL, workers=4, trainers=300)
    everyone = swarm.clients()
    run_round(swarm, authority, everyone, everyone)
    absent = next(c for c in swarm.state.clients if c.role == Role.Trainer).id
    others = [c for c in everyone if c != absent]
    run_round(swarm, authority, others, others)
    earned = {e.id: e.compute for e in swarm.state.ledger}
    assert all(earned[c.id] > 0 for c in swarm.state.clients if c.role == Role.Trainer)  # each took a share
