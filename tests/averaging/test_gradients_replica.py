"""Gradient averaging wired into a run's workers (client.join.stage_replica): a run that asks for it averages
the same-stage workers' gradients before every optimizer step, so replicas that saw different samples step to
bit-identical parameters (what checked results and state digests compare); a syncing worker (weight 0) steps
with its peer's gradient and adds nothing to it. Each worker's weight is what its trainer-signed Backwards of the
round prove (``client.averaging.work``), so ``accumulate`` keeps their signed headers as a worker's Backwards do."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import pytest
import torch
from solders.keypair import Keypair

from client.averaging.gradients import GradAveraging, GradientResult, GradientSettings
from client.averaging.membership import Roster
from client.averaging.values import GradValues
from client.contributor.run_model import model_config
from client.join.stage_replica import REPLICA_WEIGHT, StageReplica, gradient_settings
from client.join.sync import SyncPhase
from client.pipeline.worker import StepStats
from coordinator_program.spec.config import parse_run_spec
from coordinator_program.spec.state import CoordinatorState, Phase
from tests.averagers import signed_backwards
from tests.join.test_stage_replica import SPEC, places  # the same small run

TRAINER = Keypair()  # the epoch's one trainer, which signs every Backward here
TRAINERS = frozenset({bytes(TRAINER.pubkey())})


def run_state(run_id: str, **model: object) -> CoordinatorState:
    spec = parse_run_spec({**SPEC, "run_id": run_id, "model": {**SPEC["model"], **model}})
    return CoordinatorState(run_id=run_id, main_authority=bytes(32), join_authority=bytes(32),
                            phase=Phase.Warmup, step=0, config=spec.config, model=spec.model,
                            checkpoints=places(spec.checkpoint))


@pytest.fixture
def make_replica(own_dht) -> Iterator[Callable[[CoordinatorState], StageReplica]]:
    made: list[StageReplica] = []
    members: set[bytes] = set()  # the stage's roster: every replica made here

    def make(state: CoordinatorState) -> StageReplica:
        keypair = Keypair()
        members.add(bytes(keypair.pubkey()))
        replica = StageReplica.create(state, "body1", model_config(state), dht=own_dht(), keypair=keypair,
                                      host="127.0.0.1", trainer_allowed=lambda pubkey: False,
                                      roster=lambda: Roster(0, frozenset(members), TRAINERS),
                                      say=lambda line: None)
        made.append(replica)
        return replica

    yield make
    for replica in made:
        replica.stop()


def accumulate(replica: StageReplica, seed: int, samples: int, first: int = 0) -> list[torch.Tensor]:
    """Put a gradient sum over ``samples`` samples from sample ``first`` in the worker's ``.grad``, with the signed
    headers of their Backwards (two samples each), as its backward passes would."""
    generator = torch.Generator().manual_seed(seed)
    compute = replica.worker.compute
    sums = []
    for param in compute.optimizer.params:
        param.grad = torch.randn(param.shape, generator=generator) * samples
        sums.append(param.grad.clone())
    compute.samples_accumulated = samples
    compute.work = signed_backwards(TRAINER, replica.worker.run_id, replica.stage, first, first + samples, per=2,
                                    worker=replica.worker.keypair)
    return sums


def serving(replicas: list[StageReplica]) -> list[StageReplica]:
    """Start the workers and wait until each sees the others in the DHT (a round skips a stage of one)."""
    for replica in replicas:
        replica.start()
    deadline = time.monotonic() + 30
    while any(r.peers() < len(replicas) - 1 for r in replicas):
        assert time.monotonic() < deadline, "the workers did not see each other"
        time.sleep(0.1)
    return replicas


def step_together(replicas: list[StageReplica], swarm_step: int) -> list[StepStats]:
    stats: list[StepStats | None] = [None] * len(replicas)

    def run(i: int) -> None:
        stats[i] = replicas[i].step(swarm_step)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(replicas))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert all(s is not None for s in stats), "a step did not return"
    return stats  # type: ignore[return-value]


def parameters(replica: StageReplica) -> list[torch.Tensor]:
    return [p.detach().clone() for p in replica.worker.compute.optimizer.params]


@pytest.mark.parametrize(("model", "expected", "values"), [
    ({"grad_averaging": "off"}, None, None),
    ({"grad_averaging": "full"}, (GradAveraging.FULL, 0, 0, 0), GradValues.FLOAT32),
    ({"grad_averaging": "powersgd", "powersgd_rank": 4}, (GradAveraging.POWERSGD, 4, 0, 0), GradValues.FLOAT32),
    ({"grad_averaging": "demo", "demo_chunk": 64, "demo_topk": 4, "demo_beta": 0.999},
     (GradAveraging.DEMO, 0, 64, 4, 0.999), GradValues.FLOAT32),
    ({"grad_averaging": "demo", "demo_chunk": 128, "demo_topk": 127}, (GradAveraging.DEMO, 0, 128, 127, 0.9),
     GradValues.FLOAT32),
    ({"grad_averaging": "full", "grad_values": "float16"}, (GradAveraging.FULL, 0, 0, 0), GradValues.FLOAT16),
    ({"grad_averaging": "demo", "demo_chunk": 64, "demo_topk": 2, "grad_values": "int8"},
     (GradAveraging.DEMO, 0, 64, 2, 0.9), GradValues.INT8),
])
def test_gradient_settings_are_the_runs_model(model: dict, expected: tuple | None, values: GradValues | None) -> None:
    """The on-chain description's mode and its settings become the client's (DeMo's β from thousandths, the
    values' codec float32 unless the run names another), with a round's global batch as the most samples any peer
    may claim."""
    settings = gradient_settings(run_state("settings", **model))
    if expected is None:
        assert settings is None
        return
    assert isinstance(settings, GradientSettings)
    assert (settings.mode, settings.rank, settings.chunk, settings.topk, settings.values) == (*expected[:4], values)
    if settings.mode == GradAveraging.DEMO:
        assert settings.beta == expected[4]
    assert settings.max_weight == settings.round_samples == 8


MODES = {"full": {}, "powersgd": {"powersgd_rank": 2}, "demo": {"demo_chunk": 32, "demo_topk": 4},
         "demo in int8": {"demo_chunk": 32, "demo_topk": 4, "grad_values": "int8"}}
"""Each mode a run can choose, with its settings in ``state.toml`` (and one in another codec)."""


@pytest.mark.parametrize("setting", sorted(MODES))
def test_replicas_that_saw_different_samples_step_to_the_same_parameters(make_replica, run_id: str,
                                                                           setting: str) -> None:
    mode = setting.split()[0]
    state = run_state(run_id, grad_averaging=mode, **MODES[setting])
    replicas = serving([make_replica(state) for _ in range(2)])
    assert replicas[0].gradients is not None and replicas[0].gradients.settings.mode == GradAveraging(mode)
    assert replicas[0].gradients.settings.max_weight == 8  # no peer may claim more than a round's batch
    assert replicas[0].averager.max_weight == REPLICA_WEIGHT  # SPARTA weighs replicas alike
    rounds = [recording(replica) for replica in replicas]
    start = parameters(replicas[0])
    assert all(torch.equal(a, b) for a, b in zip(start, parameters(replicas[1]), strict=True))  # the seed
    identical = 0
    for step in range(2):
        accumulate(replicas[0], seed=2 * step, samples=6, first=8 * step)  # the round's 8 samples, split
        accumulate(replicas[1], seed=2 * step + 1, samples=2, first=8 * step + 6)
        stats = step_together(replicas, step)
        assert [s.samples for s in stats] == [6, 2] and all(s.applied for s in stats)
        if all(r[-1].complete for r in rounds):  # a round a loaded machine cut short leaves a shard local
            assert [r[-1].samples for r in rounds] == [8, 8]  # the 6 and 2 samples their Backwards prove
            for a, b in zip(parameters(replicas[0]), parameters(replicas[1]), strict=True):
                assert torch.equal(a, b), f"step {step}: replicas {float((a - b).abs().max()):.3g} apart"
            identical += 1
    assert identical, f"no round completed: {rounds}"
    assert any(not torch.equal(a, b) for a, b in zip(start, parameters(replicas[0]), strict=True))


def recording(replica: StageReplica) -> list[GradientResult]:
    """The replica's gradient rounds from now on, as their averager reported them."""
    averager = replica.gradients
    assert averager is not None
    results: list[GradientResult] = []
    average = averager.average

    def recorded(*args: object, **kwargs: object) -> GradientResult:
        results.append(average(*args, **kwargs))
        return results[-1]

    averager.average = recorded  # type: ignore[method-assign]
    return results


def test_a_syncing_worker_steps_with_its_peers_gradient_and_adds_nothing(make_replica, run_id: str) -> None:
    state = run_state(run_id, grad_averaging="full")
    active, syncing, alone = make_replica(state), make_replica(state), make_replica(state)
    alone.stop()  # the reference: the active worker's gradient stepped by one process
    serving([active, syncing])
    syncing.tracker.phase = SyncPhase.OPTIMIZER  # phase 2: routed to, averaging weight 0
    accumulate(syncing, seed=99, samples=4)  # far from the active one's: it must not count
    for replica in (active, alone):
        accumulate(replica, seed=1, samples=4)
    alone.worker.compute.optimizer.gradient_exchange = None
    alone.worker.step()
    step_together([active, syncing], 0)
    for a, b, c in zip(parameters(active), parameters(syncing), parameters(alone), strict=True):
        torch.testing.assert_close(a, c, rtol=0, atol=1e-6)
        torch.testing.assert_close(b, c, rtol=0, atol=1e-6)


def test_a_run_without_gradient_averaging_builds_no_averager(make_replica, run_id: str) -> None:
    assert make_replica(run_state(run_id)).gradients is None


def test_a_checked_microbatch_both_replicas_accumulated_still_averages(make_replica, run_id: str) -> None:
    """A checked microbatch's Backward runs on two replicas and both accumulate it (``client.pipeline.checks``):
    their evidence overlaps, each header naming its own replica, so each is credited every sample it summed, the
    round stands for the 10 Backward samples accumulated (6 + 4, the checked 2 on both), and the replicas step to
    the same parameters. (Crediting neither, the first rule tried, skipped nearly every gradient round of a run
    checking every microbatch; crediting each half of a shared sample, the rule while headers named no worker,
    stood for the distinct 8.)"""
    state = run_state(run_id, grad_averaging="full")
    replicas = serving([make_replica(state) for _ in range(2)])
    rounds = [recording(replica) for replica in replicas]
    accumulate(replicas[0], seed=1, samples=6, first=0)  # samples 4-6 are the checked microbatch
    accumulate(replicas[1], seed=2, samples=4, first=4)
    step_together(replicas, 0)
    assert [r[-1].status.value for r in rounds] == ["averaged"] * 2, rounds
    assert [r[-1].samples for r in rounds] == [10, 10]
    if all(r[-1].complete for r in rounds):
        assert all(torch.equal(a, b) for a, b in zip(parameters(replicas[0]), parameters(replicas[1]), strict=True))


@pytest.mark.parametrize(("model", "anchors"), [({}, False), ({"grad_values": "int8"}, True),
                                                ({"grad_values": "int4"}, True),
                                                ({"grad_averaging": "full", "grad_values": "float16"}, True)])
def test_the_runs_grad_values_is_the_codec_of_its_sparta_slices(make_replica, run_id: str, model: dict,
                                                                  anchors: bool) -> None:
    """With grad averaging off or on, SPARTA's slices travel in the run's codec: as changes since their anchor
    unless it is float32 (``client.averaging.anchored``)."""
    averager = make_replica(run_state(run_id, **model)).averager.averager
    assert averager.anchors == anchors
