"""State download: from a Hub checkpoint (a local stand-in for the Hub) or from same-stage peers (hivemind's
state sharing), checked before use, and never while an averaging round updates the parameters."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable

import pytest
import safetensors.torch
import torch
from solders.keypair import Keypair

from client.averaging.anchored import Anchors
from client.averaging.membership import Roster
from client.averaging.sparta import AveragingStatus, SpartaAverager
from client.averaging.state_transfer import SharedState, StateExpectation
from client.averaging.values import GradValues
from client.join.checkpoints import FileLimits
from client.join.state_download import (
    JoinWindow,
    StageState,
    StateDownloadError,
    download_from_hub,
    download_from_peers,
    load_stage_state,
    replica_tensors,
    stage_identity,
    worker_state_provider,
)
from client.join.sync import SyncPolicy
from client.pipeline.digests import state_digest
from client.pipeline.model import ModelConfig, build_stage
from client.pipeline.worker import StageWorker
from tests.averagers import average_together

DONOR_WAIT = 45.0
"""Seconds a joiner looks for donors: a donor's declaration that is stored before the DHT nodes have found each
other is not seen until hivemind declares again, 30 s later (``declare_state_period``)."""
TINY = ModelConfig(n_layers=3, d_model=32, n_heads=2, seq_len=16, num_stages=3, seed=7)


def saved(state: dict[str, torch.Tensor]) -> bytes:
    return safetensors.torch.save(state)


def perturbed_state(seed: int) -> dict[str, torch.Tensor]:
    module = build_stage(TINY, "body1")
    generator = torch.Generator().manual_seed(seed)
    return {k: v + torch.randn(v.shape, generator=generator) for k, v in module.state_dict().items()}


def limits(stage: str) -> FileLimits:
    return FileLimits.of(build_stage(TINY, stage))


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ----- Hub ---------------------------------------------------------------------------------------------


def test_a_hub_checkpoint_is_downloaded_and_loaded(fake_hub, tmp_path) -> None:
    snapshot = perturbed_state(1)
    fake_hub.publish("swarm/run-1", "body1.safetensors", saved(snapshot), revision="epoch-3")
    fake_hub.publish("swarm/run-1", "body1.json", json.dumps({"step": 40}).encode(), revision="epoch-3")
    state = download_from_hub("swarm/run-1", "body1", limits=limits("body1"), revision="epoch-3",
                              endpoint=fake_hub.url, cache_dir=tmp_path)
    assert state.step == 40 and state.source == "hub:swarm/run-1@epoch-3/body1.safetensors"
    module = build_stage(TINY, "body1")
    load_stage_state(module, state, threading.Lock())
    assert same(module.state_dict(), snapshot)
    policy = SyncPolicy(max_allowed_stale=5, phase1_steps=400, phase2_steps=100)
    assert policy.is_stale(state.step, swarm_step=46) and not policy.is_stale(state.step, swarm_step=45)


def test_a_snapshot_without_its_step_counts_as_stale(fake_hub, tmp_path) -> None:
    fake_hub.publish("swarm/run-1", "head.safetensors", saved(build_stage(TINY, "head").state_dict()))
    state = download_from_hub("swarm/run-1", "head", limits=limits("head"), endpoint=fake_hub.url, cache_dir=tmp_path)
    assert state.step is None
    assert SyncPolicy(5, 400, 100).is_stale(state.step, swarm_step=0)


def test_hub_failures_are_clear_and_change_nothing(fake_hub, tmp_path) -> None:
    with pytest.raises(StateDownloadError, match=r"could not download swarm/run-1@main/tail\.safetensors"):
        download_from_hub("swarm/run-1", "tail", limits=limits("tail"), endpoint=fake_hub.url, cache_dir=tmp_path)
    fake_hub.publish("swarm/run-1", "tail.safetensors", b"not a safetensors file")
    with pytest.raises(StateDownloadError, match="not a readable safetensors file"):
        download_from_hub("swarm/run-1", "tail", limits=limits("tail"), endpoint=fake_hub.url, cache_dir=tmp_path)

    module = build_stage(TINY, "body1")
    before = {k: v.clone() for k, v in module.state_dict().items()}
    wider = build_stage(ModelConfig(n_layers=3, d_model=64, n_heads=2, seq_len=16, num_stages=3), "body1")
    for bad, message in [(StageState(wider.state_dict(), 0, "hub:x"), "this stage needs"),
                         (StageState({k: v.double() for k, v in before.items()}, 0, "hub:x"), "float64"),
                         (StageState({"junk": torch.zeros(1)}, 0, "hub:x"), "does not match this stage"),
                         (StageState({k: v * float("nan") for k, v in before.items()}, 0, "hub:x"), "non-finite")]:
        with pytest.raises(StateDownloadError, match=message):
            load_stage_state(module, bad, threading.Lock())
        assert same(module.state_dict(), before)


# ----- peers -------------------------------------------------------------------------------------------


class Peer:
    """A same-stage worker (not serving gRPC: only its state matters here) with its SPARTA averager."""

    def __init__(self, make_averager, run_id: str, seed: int | None, *, step: int = 0,
                 config: ModelConfig = TINY,
                 corrupt: Callable[[list[torch.Tensor]], list[torch.Tensor]] | None = None,
                 values: GradValues = GradValues.FLOAT32) -> None:
        """``corrupt`` rewrites the tensors this peer serves (a hostile member's state); ``values`` is the run's
        codec, in which slices travel as changes since their anchors unless it is float32."""
        self.worker = StageWorker(config, "body1", run_id=run_id)
        if seed is not None:
            self.worker.compute.module.load_state_dict(perturbed_state(seed))
        self.step = step
        provider = worker_state_provider(self.worker, lambda: self.step)
        if corrupt is not None:
            honest = provider

            def provider() -> SharedState:
                state = honest()
                return SharedState(state.metadata, corrupt(list(state.tensors)))

        self.averager: SpartaAverager = make_averager(
            list(self.worker.compute.module.named_parameters()), lock=self.worker.compute.lock, partitions=2,
            seed=config.seed, state_provider=provider, values=values)

    def state(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.worker.compute.module.state_dict().items()}


def wait_until_listed(joiner: Peer, donors: int) -> None:
    """Wait until the joiner's DHT node sees ``donors`` donor records (whoever stored them), so that it tries
    them by priority (a donor seen late would be tried after the others whatever its priority)."""
    key = joiner.averager.averager.donors_key
    deadline = time.monotonic() + DONOR_WAIT
    while time.monotonic() < deadline:
        found = joiner.averager.averager.dht.get(key, latest=True)
        if found is not None and isinstance(found.value, dict) and len(found.value) >= donors:
            return
        time.sleep(0.5)
    raise AssertionError(f"the joiner did not see {donors} donors in {DONOR_WAIT:.0f} s")


def identity(run_id: str) -> dict[str, str]:
    return stage_identity(run_id, "body1", TINY.fingerprint())


def test_state_comes_from_a_sharing_peer_with_a_full_progress_count(make_averager, run_id: str) -> None:
    donor = Peer(make_averager, run_id, seed=1, step=57)
    silent = Peer(make_averager, run_id, seed=2)  # a syncing worker: shares nothing
    joiner = Peer(make_averager, run_id, seed=None)
    donor.averager.sharing = True
    assert not silent.averager.sharing
    state = download_from_peers(joiner.averager, joiner.worker.compute.module, identity(run_id), timeout=DONOR_WAIT,
                                progress=False)
    assert (state.step, state.source) == (None, "peers")  # the donor's step is only its claim (see below)
    assert same(state.tensors, donor.state())
    compute = donor.worker.compute  # the donor's parameters and its optimizer's moments (``replica_tensors``)
    served = replica_tensors(compute.module, compute.optimizer.optimizer)
    assert len(served) > len(donor.state())
    assert joiner.averager.bytes_received == sum(t.numel() * t.element_size() for t in served.values())
    load_stage_state(joiner.worker.compute.module, state, joiner.worker.compute.lock)
    assert same(joiner.state(), donor.state())


@pytest.mark.slow
def test_a_donor_of_another_model_is_refused_and_the_next_is_used(make_averager, run_id: str) -> None:
    good = Peer(make_averager, run_id, seed=1, step=10)
    liar = Peer(make_averager, run_id, seed=3, step=99)  # fresher, so tried first
    liar.worker.config = ModelConfig(**{**TINY.to_dict(), "seed": 8})  # it claims another model
    joiner = Peer(make_averager, run_id, seed=None)
    for peer in (good, liar):
        peer.averager.sharing = True
        peer.averager.set_sharing_priority(peer.step)
    state = download_from_peers(joiner.averager, joiner.worker.compute.module, identity(run_id), timeout=DONOR_WAIT,
                                progress=False)
    assert state.step is None and same(state.tensors, good.state())

    good.averager.sharing = False
    time.sleep(0.5)  # the averager withdraws its declaration from the DHT in the background
    with pytest.raises(StateDownloadError, match="this node needs"):  # it waits its whole timeout: only the liar
        download_from_peers(joiner.averager, joiner.worker.compute.module, identity(run_id), timeout=10,
                            progress=False)


def test_a_donor_s_claimed_step_is_not_believed_so_its_state_goes_through_the_sync_phases(
        make_averager, run_id: str) -> None:
    """A hostile donor serves -3.0 everywhere and claims step 10^15 with that priority: downloaded first. The
    old joiner took the step, skipped the sync phases and advertised it in turn; now a state from peers has no
    step, so it counts as stale and the sync phases replace it with the stage's average."""
    hostile = Peer(make_averager, run_id, seed=None, step=10**15)
    with torch.no_grad():
        for param in hostile.worker.compute.module.parameters():
            param.fill_(-3.0)
    hostile.averager.sharing = True
    hostile.averager.set_sharing_priority(float(10**15))
    joiner = Peer(make_averager, run_id, seed=None)
    state = download_from_peers(joiner.averager, joiner.worker.compute.module, identity(run_id), timeout=DONOR_WAIT,
                                progress=False)
    assert state.step is None
    assert SyncPolicy(max_allowed_stale=5, phase1_steps=4, phase2_steps=2).is_stale(state.step, swarm_step=10)


CORRUPTIONS = {
    "malformed or not finite": lambda ts: [torch.full_like(ts[0], float("nan")), *ts[1:]],
    "arrives as float64": lambda ts: [ts[0].double(), *ts[1:]],
    "arrives as float32[1, ": lambda ts: [ts[0].reshape(1, -1), *ts[1:]],
    "it sent more than the": lambda ts: [*ts, ts[0]],
}


@pytest.mark.parametrize("refusal", list(CORRUPTIONS))
def test_a_member_s_malformed_state_is_refused_and_the_next_donor_used(make_averager, run_id: str, caplog,
                                                                        refusal: str) -> None:
    """A roster member, tried first (the highest priority), serves a NaN tensor, one of another dtype or shape,
    or one tensor too many: the joiner refuses it as it arrives and downloads the other member's state."""
    good = Peer(make_averager, run_id, seed=1, step=10)
    hostile = Peer(make_averager, run_id, seed=2, step=99, corrupt=CORRUPTIONS[refusal])
    joiner = Peer(make_averager, run_id, seed=None)
    for peer in (good, hostile):
        peer.averager.sharing = True
        peer.averager.set_sharing_priority(peer.step)
    wait_until_listed(joiner, 2)
    with caplog.at_level(logging.WARNING, logger="psyswarm.state"):
        state = download_from_peers(joiner.averager, joiner.worker.compute.module, identity(run_id),
                                    timeout=DONOR_WAIT, progress=False)
    assert same(state.tensors, good.state())
    assert any(refusal in r.getMessage() for r in caplog.records)


def test_a_stranger_cannot_seed_a_joiner(make_averager, run_id: str, caplog) -> None:
    """A peer off the stage's roster (its own roster lists it) serves -3.0 everywhere with the highest priority:
    its donor record is sealed by a key off the joiner's roster, so the joiner never tries it (the old joiner
    tried it first and refused it at its metadata) and downloads the member's state."""
    member = Peer(make_averager, run_id, seed=1, step=10)
    members = make_averager.members  # type: ignore[attr-defined]
    key = Keypair()
    stranger_worker = StageWorker(TINY, "body1", run_id=run_id)
    with torch.no_grad():
        for param in stranger_worker.compute.module.parameters():
            param.fill_(-3.0)
    stranger = make_averager(list(stranger_worker.compute.module.named_parameters()), keypair=key, enrol=False,
                             roster=lambda: Roster(0, frozenset(members) | {bytes(key.pubkey())}),
                             lock=stranger_worker.compute.lock, partitions=2, seed=TINY.seed,
                             state_provider=worker_state_provider(stranger_worker, lambda: 10**15))
    joiner = Peer(make_averager, run_id, seed=None)
    for averager, priority in ((member.averager, 10.0), (stranger, float(10**15))):
        averager.sharing = True
        averager.set_sharing_priority(priority)
    wait_until_listed(joiner, 2)
    with caplog.at_level(logging.WARNING, logger="psyswarm.state"):
        state = download_from_peers(joiner.averager, joiner.worker.compute.module, identity(run_id),
                                    timeout=DONOR_WAIT, progress=False)
    assert same(state.tensors, member.state())
    assert not any(str(stranger.averager.peer_id) in r.getMessage() for r in caplog.records)


def test_fake_donors_at_the_highest_priority_do_not_delay_a_joiner(make_averager, run_id: str) -> None:
    """Three strangers (their own rosters list them) declare themselves donors at priority 10^15 and, asked for
    their state, stall. The old joiner tried them first, waiting out ``chunk_timeout`` (4 s) on each, and did not
    reach the member within its 10 s; now only records sealed by roster members are tried, so the member's
    state arrives in well under one stall."""
    member = Peer(make_averager, run_id, seed=1, step=10)
    members = make_averager.members  # type: ignore[attr-defined]
    release = threading.Event()

    def stall() -> SharedState:
        release.wait(60)
        raise RuntimeError("a stranger's state never comes")

    joiner = Peer(make_averager, run_id, seed=None)
    strangers = []
    for _ in range(3):
        key = Keypair()
        worker = StageWorker(TINY, "body1", run_id=run_id)
        strangers.append(make_averager(list(worker.compute.module.named_parameters()), keypair=key, enrol=False,
                                       roster=lambda key=key: Roster(0, frozenset(members) | {bytes(key.pubkey())}),
                                       partitions=2, seed=TINY.seed, state_provider=stall))
    try:
        for averager, priority in ((member.averager, 10.0), *((s, float(10**15)) for s in strangers)):
            averager.sharing = True
            averager.set_sharing_priority(priority)
        wait_until_listed(joiner, 4)
        started = time.monotonic()
        state = download_from_peers(joiner.averager, joiner.worker.compute.module, identity(run_id), timeout=10,
                                    chunk_timeout=4, progress=False)
        assert time.monotonic() - started < 4
        assert same(state.tensors, member.state())
    finally:
        release.set()


def test_no_donor_is_a_clear_error(make_averager, run_id: str) -> None:
    joiner = Peer(make_averager, run_id, seed=None)
    with pytest.raises(StateDownloadError, match="no same-stage peer shares its state"):
        download_from_peers(joiner.averager, joiner.worker.compute.module, identity(run_id), timeout=2,
                            progress=False)



# ----- a donor's anchors -------------------------------------------------------------------------------


def anchored_stage(make_averager, run_id: str) -> list[Peer]:
    """Two members of an int4 run that have averaged both partitions once, so each holds an anchor for both."""
    members = [Peer(make_averager, run_id, seed=seed, step=2, values=GradValues.INT4) for seed in (1, 2)]
    for index in (0, 1):
        results = average_together([m.averager for m in members], index, [1.0, 1.0])
        assert {r.status for r in results} == {AveragingStatus.AVERAGED}
    return members


def nudge(peers: list[Peer], seed: int) -> None:
    """A few optimizer steps' worth of change, different on each peer."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for peer in peers:
            for param in peer.worker.compute.module.parameters():
                param.add_(torch.randn(param.shape, generator=generator) * 1e-3)


def parameters(peer: Peer) -> list[torch.Tensor]:
    return [p.detach().clone().reshape(-1) for p in peer.worker.compute.module.parameters()]


def test_a_joiner_takes_its_donor_s_anchors_so_its_first_slices_travel_in_the_codec(make_averager,
                                                                                   run_id: str) -> None:
    """Without its donor's anchors a joiner declares none for P rounds, and every group it joins averages those
    slices' values in float32. With them its first round already sends changes in int4; the anchors are no part
    of the state's digest, so a state the stage vouched for is still proven."""
    members = anchored_stage(make_averager, run_id)
    donor = members[0]
    donor.averager.sharing = True
    compute = donor.worker.compute
    vouched = {2: state_digest(replica_tensors(compute.module, compute.optimizer.optimizer))}
    joiner = Peer(make_averager, run_id, seed=None, values=GradValues.INT4)
    assert joiner.averager.averager.declared_anchor(0) == ""
    state = download_from_peers(joiner.averager, joiner.worker.compute.module, identity(run_id), timeout=DONOR_WAIT,
                                progress=False, vouched=vouched)
    assert state.step == 2, "the anchors served after the state leave its digest as the stage vouched for it"
    assert state.anchors is not None and state.anchors.partitions == (0, 1)
    served = sum(t.numel() * t.element_size() for t in replica_tensors(compute.module, compute.optimizer.optimizer)
                 .values()) + 4 * sum(p.numel() for p in compute.module.parameters())
    assert joiner.averager.bytes_received == served
    load_stage_state(joiner.worker.compute.module, state, joiner.worker.compute.lock)
    assert joiner.averager.install_anchors(state.anchors)
    assert [joiner.averager.averager.declared_anchor(i) for i in (0, 1)] == [
        donor.averager.averager.declared_anchor(i) for i in (0, 1)] != ["", ""]

    everyone = [*members, joiner]
    nudge(everyone, 5)
    results = average_together([p.averager for p in everyone], 2, [1.0, 1.0, 1.0])
    assert {r.status for r in results} == {AveragingStatus.AVERAGED}
    assert {r.group_size for r in results} == {3}
    assert {r.payload_values for r in results} == {GradValues.INT4}, "the joiner's first slice went in int4"
    assert len({p.averager.averager.declared_anchor(0) for p in everyone}) == 1


def test_a_donor_s_wrong_anchor_costs_one_float32_round_and_no_accuracy(make_averager, run_id: str) -> None:
    """A member serves its state with one anchor value moved (for partition 0 only). The joiner takes it, declares
    a digest the group does not hold, and that partition's round averages the values in float32: its result is the
    exact mean, and afterwards every anchor agrees. Partition 1's anchor was right, and its round goes in int4."""
    members = anchored_stage(make_averager, run_id)
    donor = members[0]
    honest = donor.averager.averager.served_anchors
    first = donor.averager.masks.indices(0)[0][0]

    def forged() -> Anchors | None:
        anchors = honest()
        assert anchors is not None
        moved = [v.clone() for v in anchors.values]
        moved[0][first] += 0.5
        return Anchors(anchors.partitions, moved)

    donor.averager.averager.served_anchors = forged  # type: ignore[method-assign]
    donor.averager.sharing = True
    joiner = Peer(make_averager, run_id, seed=None, values=GradValues.INT4)
    state = download_from_peers(joiner.averager, joiner.worker.compute.module, identity(run_id), timeout=DONOR_WAIT,
                                progress=False)
    assert state.anchors is not None
    load_stage_state(joiner.worker.compute.module, state, joiner.worker.compute.lock)
    joiner.averager.install_anchors(state.anchors)

    everyone = [*members, joiner]
    nudge(everyone, 6)
    expected = [sum(ts) / 3 for ts in zip(*(parameters(p) for p in everyone), strict=True)]
    results = average_together([p.averager for p in everyone], 2, [1.0, 1.0, 1.0])
    assert {r.status for r in results} == {AveragingStatus.AVERAGED} and {r.group_size for r in results} == {3}
    assert {r.payload_values for r in results} == {GradValues.FLOAT32}
    indices = donor.averager.masks.indices(0)
    assert max(float((got - want)[idx].abs().max()) for p in everyone
               for got, want, idx in zip(parameters(p), expected, indices, strict=True)) < 1e-6
    assert len({p.averager.averager.declared_anchor(0) for p in everyone}) == 1
    results = average_together([p.averager for p in everyone], 3, [1.0, 1.0, 1.0])
    assert {r.payload_values for r in results} == {GradValues.INT4}


def nan_anchor(anchors: Anchors) -> Anchors:
    return Anchors(anchors.partitions, [torch.full_like(anchors.values[0], float("nan")), *anchors.values[1:]])


ANCHOR_CORRUPTIONS = {
    "anchor 0 is malformed or not finite": nan_anchor,
    "anchor 1 arrives as float32[1, ": lambda a: Anchors(a.partitions, [a.values[0], a.values[1].reshape(1, -1),
                                                                         *a.values[2:]]),
    "not distinct partitions in 0..1": lambda a: Anchors((0, 2), a.values),
    "it sent more than the": lambda a: Anchors(a.partitions, [*a.values, a.values[0]]),
}


@pytest.mark.parametrize("refusal", list(ANCHOR_CORRUPTIONS))
def test_a_member_s_malformed_anchors_are_refused_and_the_next_donor_used(make_averager, run_id: str, caplog,
                                                                          refusal: str) -> None:
    """A member tried first serves a NaN anchor, one of another shape, a partition the stage does not have, or one
    anchor too many: the joiner refuses its state as it arrives and downloads the other member's, anchors and all."""
    good, hostile = anchored_stage(make_averager, run_id)
    honest = hostile.averager.averager.served_anchors
    hostile.averager.averager.served_anchors = lambda: ANCHOR_CORRUPTIONS[refusal](honest())  # type: ignore
    for peer, priority in ((good, 10), (hostile, 99)):
        peer.averager.sharing = True
        peer.averager.set_sharing_priority(priority)
    joiner = Peer(make_averager, run_id, seed=None, values=GradValues.INT4)
    wait_until_listed(joiner, 2)
    with caplog.at_level(logging.WARNING, logger="psyswarm.state"):
        state = download_from_peers(joiner.averager, joiner.worker.compute.module, identity(run_id),
                                    timeout=DONOR_WAIT, progress=False)
    assert same(state.tensors, good.state())
    assert state.anchors is not None and state.anchors.partitions == (0, 1)
    assert any(refusal in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(("anchored", "refusal"), [
    ("0", "not a list of integers"), ([True], "not a list of integers"), ([0.0], "not a list of integers"),
    ([0, 0], "not distinct"), ([-1], "not distinct"), ([2], "not distinct"), ([0, 1, 2], "not distinct"),
])
def test_a_donor_s_anchored_partitions_must_be_distinct_partitions_of_the_stage(anchored: object,
                                                                                 refusal: str) -> None:
    expect = StateExpectation.of({}, {"w": torch.zeros(3)}, anchors=(3,), partitions=2)
    assert expect.anchored({}) == () and expect.anchored({"anchored": [1, 0]}) == (1, 0)
    assert len(expect.layout(True)) == 2 and len(expect.layout(False)) == 1
    with pytest.raises(ValueError, match=refusal):
        expect.anchored({"anchored": anchored})
    values_run = StateExpectation.of({}, {"w": torch.zeros(3)})  # a float32 run keeps no anchors
    with pytest.raises(ValueError, match="travel as values"):
        values_run.anchored({"anchored": [0]})


# ----- the join blocking window --------------------------------------------------------------------------


def test_the_window_blocks_the_steps_around_each_averaging_round() -> None:
    window = JoinWindow(every=20, window=1)
    assert [s for s in range(15, 45) if window.blocked(s)] == [19, 20, 21, 39, 40, 41]
    assert [s for s in range(0, 8) if JoinWindow(every=4, window=3).blocked(s)] == [0, 1, 3, 4, 5, 7]
    assert not any(JoinWindow(every=1).blocked(s) for s in range(5))  # no step is free: donors guard instead
    with pytest.raises(StateDownloadError, match="averaging window"):
        JoinWindow(every=20).wait(lambda: 20, poll=0.01, timeout=0.05)
    # Between epochs (no step to report) no averaging round runs: the window is open.
    assert JoinWindow(every=20).wait(lambda: None, poll=0.01, timeout=0.05) is None
    steps = iter([20, 21, None])  # an epoch ends while the joiner waits out an averaging window: it goes
    assert JoinWindow(every=20).wait(lambda: next(steps), poll=0.01, timeout=1) is None


def test_a_state_download_requested_during_averaging_waits_for_the_window(make_averager, run_id: str) -> None:
    """Two active peers average at swarm step 20 (round 1); a joiner asks for state meanwhile. It waits for
    the window, then gets the post-round state. A donor asked directly mid-round also serves only after."""
    peers = [Peer(make_averager, run_id, seed=1, step=20), Peer(make_averager, run_id, seed=2, step=20)]
    peers[0].averager.sharing = True
    joiner = Peer(make_averager, run_id, seed=None)
    swarm_step = [20]
    window = JoinWindow(every=20, window=1)
    events: dict[str, float] = {}
    got: dict[str, StageState] = {}

    def join() -> None:
        window.wait(lambda: swarm_step[0], poll=0.02)
        events["download"] = time.monotonic()
        got["state"] = download_from_peers(joiner.averager, joiner.worker.compute.module, identity(run_id),
                                           timeout=30, progress=False)

    pre_round = peers[0].state()
    results = {}
    averaging = [threading.Thread(target=lambda i=i: results.__setitem__(i, peers[i].averager.average(1, 1.0)))
                 for i in range(2)]
    for thread in averaging:
        thread.start()
    while peers[0].averager.round_stage != "LOOKING_FOR_GROUP":
        time.sleep(0.005)
    joining = threading.Thread(target=join)
    joining.start()
    # The donor itself, asked mid-round, holds the request until its round ends.
    direct = Peer(make_averager, run_id, seed=None)
    mid_round = download_from_peers(direct.averager, direct.worker.compute.module, identity(run_id), timeout=30,
                                    progress=False)
    for thread in averaging:
        thread.join(timeout=30)
    finished = time.monotonic()
    assert [results[i].status for i in (0, 1)] == [AveragingStatus.AVERAGED] * 2
    post_round = peers[0].state()
    assert not same(post_round, pre_round)
    assert same(mid_round.tensors, post_round)

    time.sleep(0.3)
    assert "download" not in events  # still step 20: the joiner waits
    swarm_step[0] = 21
    time.sleep(0.3)
    assert "download" not in events  # the step right after averaging is still in the window
    swarm_step[0] = 22
    joining.join(timeout=30)
    assert events["download"] > finished
    assert same(got["state"].tensors, post_round)
