"""Replicas agree on their state (client.witness.digests, client.contributor.agreement): signed digests published
after each step on the real DHT, the stage's majority, a departing replica resynchronised or withdrawn, and a joiner
that loads only a state the majority vouched for, against real StageReplicas, averagers and hivemind DHTs."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from solders.keypair import Keypair

from client.averaging.gradients import GradientResult
from client.averaging.sparta import AveragingStatus
from client.contributor.agreement import MAX_RESYNCS, Agreement, Outcome
from client.join.stage_replica import StageReplica
from client.join.state_download import StateDownloadError, download_from_peers, stage_identity
from client.witness.digests import StageDigests, majority
from client.witness.records import Board, RecordError, StateDigest
from coordinator_program.spec.derived import run_instance
from coordinator_program.spec.state import CoordinatorState
from tests.averagers import at_once
from tests.averaging.test_gradients_replica import (  # noqa: F401 (make_replica: a fixture)
    accumulate,
    make_replica,
    parameters,
    recording,
    run_state,
    serving,
    step_together,
)
from tests.join.test_state_download import wait_until_listed

STAGE = 1  # the replicas serve body1 of the small run's three stages


def key(replica: StageReplica) -> str:
    return bytes(replica.worker.keypair.pubkey()).hex()


def agreements(state: CoordinatorState, replicas: list[StageReplica], *, enforced: bool = True) -> list[Agreement]:
    """Each replica's check against the stage's digests, read on its own DHT node; the roster is ``replicas``."""
    roster = lambda: {key(r) for r in replicas}  # noqa: E731
    return [Agreement(r, StageDigests(Board(r.worker.dht, state), STAGE, roster), r.worker.keypair,
                      enforced=enforced, wait=20.0) for r in replicas]


def check_together(checks: list[Agreement], epoch: int, step: int) -> list[Outcome]:
    """Every replica publishes and checks at once, as workers do when they leave a round."""
    return at_once([lambda c=c: c.check(epoch, step) for c in checks], timeout=180, what="a check")


def same(a: StageReplica, b: StageReplica) -> bool:
    return all(torch.equal(x, y) for x, y in zip(parameters(a), parameters(b), strict=True))


def perturb(replica: StageReplica) -> None:
    """A liar's (or a cut-short round's) parameters: one weight moved by a little."""
    with torch.no_grad():
        next(replica.worker.compute.module.parameters()).view(-1)[0] += 1e-3


def test_the_majority_is_a_strict_majority_of_those_that_published_and_at_least_two() -> None:
    assert majority({}) is None
    assert majority({"a": "x"}) is None  # a lone worker's word vouches for nothing
    assert majority({"a": "x", "b": "y"}) is None  # a tie
    assert majority({"a": "x", "b": "x"}) == "x"
    assert majority({"a": "x", "b": "x", "c": "y"}) == "x"
    assert majority({"a": "x", "b": "x", "c": "y", "d": "y"}) is None
    assert majority({"a": "x", "b": "x", "c": "y", "d": "z", "e": "w"}) is None  # 2 of 5 is no majority


def test_a_digest_record_is_bound_to_its_signer_and_fields() -> None:
    keypair = Keypair()
    record = StateDigest.create(keypair, run_id="run", epoch=0, instance="run.i", step=3, stage=1, digest="ab" * 32)
    record.admit(bytes(keypair.pubkey()).hex(), "run", 0, 3)
    forged = StateDigest.from_value({**record.to_value(), "digest": "cd" * 32})  # well formed, signature stale
    assert not forged.verifies()
    with pytest.raises(ValueError, match="sha256"):
        StateDigest.from_value({**record.to_value(), "digest": "not hex"})


FIELD_VALUES = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=80),
                         st.lists(st.integers(), max_size=3), st.just("ab" * 32), st.just("cd" * 64))


@settings(deadline=None)  # a loaded machine's pauses are not the parser's
@given(st.dictionaries(st.sampled_from(["author", "signature", "run_id", "epoch", "instance", "step", "stage",
                                        "digest", "extra"]), FIELD_VALUES))
def test_any_value_read_as_a_digest_record_parses_or_is_refused_with_the_reason(value: dict) -> None:
    try:
        record = StateDigest.from_value(value)
    except RecordError:
        return
    assert isinstance(record.step, int) and 0 <= record.stage < 256 and len(record.digest) == 64


def test_honest_replicas_stepping_together_publish_equal_digests_and_nobody_resyncs(make_replica,  # noqa: F811
                                                                                     run_id: str) -> None:
    state = run_state(run_id, grad_averaging="full")
    replicas = serving([make_replica(state) for _ in range(3)])
    rounds = [recording(r) for r in replicas]
    checks = agreements(state, replicas)
    outcomes = check_together(checks, 0, 0)  # the seed: every replica holds it
    assert outcomes == [Outcome.AGREED] * 3
    agreed = 0
    for step in range(2):
        for i, replica in enumerate(replicas):
            accumulate(replica, seed=10 * step + i, samples=2 + i, first=8 * step)
        step_together(replicas, step)
        if not all(r[-1].complete for r in rounds):  # a loaded machine cut the round short: replicas differ
            continue
        before = [parameters(r) for r in replicas]
        assert check_together(checks, 0, step + 1) == [Outcome.AGREED] * 3
        assert all(torch.equal(a, b) for r, params in zip(replicas, before, strict=True)
                   for a, b in zip(parameters(r), params, strict=True))  # nobody's state was replaced
        published = checks[0].digests.published(0, step + 1)
        assert len(published) == 3 and len(set(published.values())) == 1
        assert all(r.averager.sharing for r in replicas)  # all of them donate
        agreed += 1
    assert agreed, f"no round completed: {rounds}"


def test_a_departing_replica_is_resynchronised_to_the_stage_and_withdrawn_if_it_departs_again(
        make_replica, run_id: str) -> None:  # noqa: F811
    """A liar moves one of its weights after a step: its digest departs from the two honest replicas', so it stops
    donating and downloads the stage's state from an honest donor, bit-identical; it steps with the others and
    agrees again. Moved again, a second departure since it resynchronised withdraws it."""
    state = run_state(run_id, grad_averaging="full")
    honest_a, honest_b, liar = replicas = serving([make_replica(state) for _ in range(3)])
    checks = agreements(state, replicas)
    assert check_together(checks, 0, 0) == [Outcome.AGREED] * 3
    perturb(liar)
    assert not same(liar, honest_a)
    assert check_together(checks, 0, 0) == [Outcome.AGREED, Outcome.AGREED, Outcome.RESYNCED]
    assert same(liar, honest_a) and same(liar, honest_b) and liar.digest() == honest_a.digest()
    assert liar.local_step == 0  # the step of the digest its new state hashes to

    rounds = [recording(r) for r in replicas]
    for i, replica in enumerate(replicas):
        accumulate(replica, seed=i, samples=4)
    step_together(replicas, 0)
    if all(r[-1].complete for r in rounds):
        assert check_together(checks, 0, 1) == [Outcome.AGREED] * 3  # the same moments: in step again
        perturb(liar)
        assert check_together(checks, 0, 1)[2] == Outcome.RESYNCED  # it agreed since: one more chance
    perturb(liar)
    assert check_together(checks, 0, 1)[2] == Outcome.WITHDRAW
    assert not liar.averager.sharing  # nobody downloads its state meanwhile


def test_a_replica_whose_rounds_were_cut_short_resynchronises_again_up_to_the_cap(
        make_replica, run_id: str) -> None:  # noqa: F811
    """A replica on a loaded machine departs right after it resynchronised, each time after a gradient round that did
    not bring every part back for it, and it knows so (``Agreement.doubt``): it resynchronises again rather than
    withdraw (CI saw an honest tail withdrawn so, which left a run needing it waiting for members), ``MAX_RESYNCS``
    times in a row; the next departure withdraws it. (A departure with no round cut short withdraws it at once:
    the test above.)"""
    state = run_state(run_id, grad_averaging="full")
    honest, _, unlucky = replicas = serving([make_replica(state) for _ in range(3)])
    checks = agreements(state, replicas)
    assert check_together(checks, 0, 0) == [Outcome.AGREED] * 3
    cut_short = GradientResult(round=0, status=AveragingStatus.AVERAGED, reason="some peer's parts did not arrive",
                               weight=4.0, samples=4, group_size=3, refused=0, complete=False, seconds=0.1,
                               consecutive_failures=0)
    outcomes = []
    for _ in range(MAX_RESYNCS + 1):
        unlucky.gradients.last = cut_short
        checks[2].doubt(-1)  # its round before step 0's check was cut short
        assert unlucky.worker.unsure  # it serves no batch until the check
        perturb(unlucky)
        outcomes.append(check_together(checks, 0, 0)[2])
        assert unlucky.worker.unsure is None
        assert same(unlucky, honest) == (outcomes[-1] == Outcome.RESYNCED)  # brought back bit for bit, or left
    assert outcomes == [Outcome.RESYNCED] * MAX_RESYNCS + [Outcome.WITHDRAW]
    assert not unlucky.averager.sharing  # nobody downloads its state meanwhile


def test_a_joiner_refuses_a_hostile_donor_s_state_and_loads_the_one_the_majority_vouched_for(
        make_replica, run_id: str, caplog) -> None:  # noqa: F811
    """Three members hold the run's seed at step 0, and two of them publish its digest; the third serves −3.0
    everywhere at the highest priority (tried first) and publishes its own digest. Without the vouched digests the
    joiner loads the hostile state (the attack); with them it refuses it and loads an honest donor's, at step 0."""
    state = run_state(run_id)
    honest_a, honest_b, hostile, joiner = replicas = [make_replica(state) for _ in range(4)]
    with torch.no_grad():
        for param in hostile.worker.compute.module.parameters():
            param.fill_(-3.0)
    roster = lambda: {key(r) for r in replicas}  # noqa: E731
    for replica in (honest_a, honest_b, hostile):
        assert StageDigests(Board(replica.worker.dht, state), STAGE, roster).publish(
            replica.worker.keypair, 0, 0, replica.digest())
        replica.local_step = 0
        replica.agree(True)  # active and agreeing: it serves its state
    hostile.averager.set_sharing_priority(1e15)
    honest_a.averager.sharing = False  # one honest donor suffices; fewer processes compete for the cores
    digests = StageDigests(Board(joiner.worker.dht, state), STAGE, roster)
    vouched = digests.vouched(0, (0,))
    assert vouched == {0: honest_b.digest()}
    identity = stage_identity(joiner.worker.run_id, joiner.stage, joiner.worker.config.fingerprint())
    module = joiner.worker.compute.module

    wait_until_listed(joiner, 2)  # both donors seen: the hostile one, at the highest priority, is tried first
    believed = download_from_peers(joiner.averager, module, identity, timeout=60, progress=False)
    assert torch.equal(next(iter(believed.tensors.values())), torch.full_like(next(iter(believed.tensors.values())),
                                                                              -3.0))  # the attack, unchecked
    assert believed.optimizer is None  # its moments are never handed on: nobody vouched for them
    with caplog.at_level(logging.WARNING, logger="psyswarm.state"):
        checked = download_from_peers(joiner.averager, module, identity, timeout=60, progress=False, vouched=vouched)
    assert checked.step == 0 and checked.source.startswith("peers (its digest")
    assert all(torch.equal(checked.tensors[k], v) for k, v in module.state_dict().items())  # the seed, honest_b's
    trainable = {name for name, param in module.named_parameters() if param.requires_grad}
    assert isinstance(checked.optimizer, dict) and set(checked.optimizer) == trainable  # a vouched state's moments
    assert any("hashes to no digest" in r.getMessage() for r in caplog.records)

    honest_b.averager.sharing = False  # only the hostile donor is left: nothing is loaded
    with pytest.raises(StateDownloadError, match="hashes to no digest"):
        download_from_peers(joiner.averager, module, identity, timeout=10, progress=False, vouched=vouched)


def test_strangers_digests_cannot_make_an_honest_worker_the_minority(own_dht, run_id: str) -> None:
    """Three roster members publish one digest; five strangers who know the run publish another, validly signed,
    under the same key: the stage's digest is the members', and a member that agrees is told it agrees."""
    state = run_state(run_id)
    dht = own_dht()
    members = [Keypair() for _ in range(3)]
    roster: Callable[[], set[str]] = lambda: {bytes(k.pubkey()).hex() for k in members}  # noqa: E731
    digests = StageDigests(Board(dht, state), STAGE, roster)
    honest, other = "11" * 32, "22" * 32
    for stranger in (Keypair() for _ in range(5)):
        assert StageDigests(Board(dht, state), STAGE, lambda: set()).publish(stranger, 0, 4, other)
    for member in members:
        assert digests.publish(member, 0, 4, honest)
    assert digests.majority(0, 4) == honest
    assert digests.settle(0, 4, honest, timeout=0)[0].value == "agrees"
    assert len(Board(dht, state).fetch(StateDigest, 0, 4)) == 8  # the strangers' records are there, and ignored
    assert run_instance(state) == digests.board.instance


def test_where_replicas_are_not_identical_a_departure_only_stops_donating(make_replica, run_id: str) -> None:  # noqa: F811
    """SPARTA alone (grad_averaging off): replicas may differ, so nothing is enforced. A replica outvoted by the
    other two keeps its parameters and stops donating, without resyncing or withdrawing; with no majority (one
    against one) everyone donates."""
    state = run_state(run_id)
    replicas = [make_replica(state) for _ in range(3)]
    perturb(replicas[2])
    checks = agreements(state, replicas, enforced=False)
    for check in checks:
        check.agreed = True  # even one that agreed before
    before = parameters(replicas[2])
    assert check_together(checks, 0, 0) == [Outcome.AGREED, Outcome.AGREED, Outcome.DEPARTED]
    assert all(torch.equal(a, b) for a, b in zip(parameters(replicas[2]), before, strict=True))
    assert not replicas[2].averager.sharing and replicas[0].averager.sharing
    pair = agreements(state, replicas[1:], enforced=False)
    assert check_together(pair, 0, 1) == [Outcome.UNKNOWN] * 2
    assert replicas[2].averager.sharing


def test_a_replica_whose_moments_departed_is_resynchronised_with_them_and_steps_with_the_stage_again(
        make_replica, run_id: str) -> None:  # noqa: F811
    """A round cut short for one replica leaves its own gradient in its Adam moments as well as in its parameters:
    the digest covers the moments (``replica_tensors``), so the replica departs, and its resynchronisation brings
    them from the donor with the parameters, after which it takes the very steps the stage takes."""
    state = run_state(run_id, grad_averaging="full")
    replicas = serving([make_replica(state) for _ in range(3)])
    rounds = [recording(r) for r in replicas]
    checks = agreements(state, replicas)
    steps = 0

    def step() -> bool:
        nonlocal steps
        for i, replica in enumerate(replicas):
            accumulate(replica, seed=10 * steps + i, samples=2 + i, first=8 * steps)
        step_together(replicas, steps)
        steps += 1
        return all(r[-1].complete for r in rounds)

    assert step(), f"the first round did not complete: {rounds}"  # the moments exist and are the stage's
    assert check_together(checks, 0, 1) == [Outcome.AGREED] * 3
    odd = replicas[2].worker.compute
    with torch.no_grad():  # what its own gradient left in its first moment, its parameters untouched
        odd.optimizer.optimizer.state[next(odd.module.parameters())]["exp_avg"].view(-1)[0] += 1e-3
    assert same(replicas[2], replicas[0])
    assert check_together(checks, 0, 1)[2] == Outcome.RESYNCED
    if step():
        assert check_together(checks, 0, 2) == [Outcome.AGREED] * 3
        assert same(replicas[2], replicas[0])


def test_a_replica_whose_round_was_cut_short_serves_no_batch_until_its_state_is_checked(
        make_replica, run_id: str) -> None:  # noqa: F811
    """Its answers may honestly differ from its stage's until its digest is checked, and a checked answer would then
    accuse it of lying: a worker whose gradient round did not bring every part back refuses batches from its step
    to the end of that step's check, whatever the check finds; one whose round completed is never held back."""
    state = run_state(run_id, grad_averaging="full")
    replicas = serving([make_replica(state) for _ in range(3)])
    rounds = [recording(r) for r in replicas]
    checks = agreements(state, replicas)
    for i, replica in enumerate(replicas):
        accumulate(replica, seed=i, samples=2 + i)
    step_together(replicas, 0)
    for check, replica in zip(checks, replicas, strict=True):
        check.doubt(0)
        assert (replica.worker.unsure is None) == rounds[replicas.index(replica)][-1].complete
    cut = replicas[2].gradients
    assert cut is not None and cut.last is not None
    cut.last = dataclasses.replace(cut.last, complete=False, reason="a reducer went silent")  # as a loaded machine
    checks[2].doubt(0)
    assert replicas[2].worker.unsure == "its gradient round of step 0 did not complete (a reducer went silent)"
    check_together(checks, 0, 1)
    assert all(r.worker.unsure is None for r in replicas)  # the check ended every doubt


def test_a_complete_or_lonely_round_is_shared_and_any_other_is_not() -> None:
    """``GradientResult.shared``: whether the stage's replicas that took part stepped on the very same gradient."""
    done = GradientResult(round=3, status=AveragingStatus.AVERAGED, reason="", weight=4.0, samples=8, group_size=2,
                          refused=0, complete=True, seconds=0.1, consecutive_failures=0)
    assert done.shared
    assert dataclasses.replace(done, status=AveragingStatus.SKIPPED, group_size=0, complete=False).shared  # alone
    assert not dataclasses.replace(done, complete=False, reason="some peer's parts did not arrive").shared
    assert not dataclasses.replace(done, status=AveragingStatus.FAILED, complete=False, reason="no group").shared
    assert not dataclasses.replace(done, status=AveragingStatus.SKIPPED, group_size=0, complete=False,
                                   reason="no groupmate was admitted").shared
