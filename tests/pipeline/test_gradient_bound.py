"""The gradient bound's rule (``admission.GradientBound``), on contributions of exactly chosen per-sample norms:
honest ones (early training's large moves, loss spikes, one or two trainers) are never refused, hostile ones
(non-finite, 10¹⁸–3·10³⁸, a sustained 10⁶-fold) always are, whatever is accepted weighs at most
``max(factor × reference, clip)`` per sample, and one trainer cannot move the reference for the others.

The same behaviour through a real worker over gRPC: ``tests/adversarial/test_worker_integrity.py``."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from client.pipeline.admission import GradientBound, GradientRefused

CLIP = 1 / math.sqrt(3)  # a body stage's clip threshold in a 3-stage run
SAMPLES = 4
norms = st.floats(min_value=1e-6, max_value=1e3)
trainers = st.sampled_from(["a", "b", "c", "d"])


def contribution(per_sample: float, samples: int = SAMPLES) -> list[torch.Tensor]:
    """A parameter gradient (float64, so that huge values stay finite) whose per-sample norm is ``per_sample``."""
    return [torch.tensor([per_sample * samples], dtype=torch.float64)]


def admit(bound: GradientBound, trainer: str, per_sample: float) -> float:
    """The per-sample norm the stage accumulates of it."""
    verdict = bound.admit(trainer, contribution(per_sample), SAMPLES)
    assert verdict.per_sample == pytest.approx(per_sample)
    return per_sample * verdict.scale


def history(bound: GradientBound, events: list[tuple[str, float, bool]]) -> None:
    """Contributions (trainer, per-sample norm, then an optimizer step?) whatever their verdicts."""
    for trainer, norm, step in events:
        try:
            admit(bound, trainer, norm)
        except GradientRefused:
            pass
        if step:
            bound.end_step()


events = st.lists(st.tuples(trainers, norms, st.booleans()), max_size=40)


@settings(max_examples=200, deadline=None)
@given(events=events, trainer=trainers, norm=st.floats(min_value=0.0, max_value=1000 * CLIP))
def test_a_contribution_within_the_fresh_bound_is_never_refused(events, trainer, norm) -> None:
    """Whatever came before (early training's large moves, a reference pulled down by another trainer's tiny
    gradients), a per-sample norm up to 1000 × clip is accepted."""
    bound = GradientBound(CLIP)
    history(bound, events)
    admit(bound, trainer, norm)


@settings(max_examples=200, deadline=None)
@given(events=events, trainer=trainers, norm=st.floats(min_value=0.0, max_value=1e12))
def test_what_is_accumulated_weighs_at_most_the_weight_limit_per_sample(events, trainer, norm) -> None:
    """An accepted contribution is accumulated at a per-sample norm of at most max(100 × reference, clip), or
    the fresh bound before any reference; one above the refusal limit is refused and counted."""
    bound = GradientBound(CLIP)
    history(bound, events)
    reference = bound.reference()
    weight = 1000 * CLIP if reference is None else max(100 * reference, CLIP)
    ceiling = 1000 * CLIP if reference is None else max(1e5 * reference, 1000 * CLIP)
    refused = bound.refused
    if norm > ceiling:
        with pytest.raises(GradientRefused, match="exceeds this stage's bound"):
            admit(bound, trainer, norm)
        assert bound.refused == refused + 1
    else:
        assert admit(bound, trainer, norm) <= weight * (1 + 1e-9)


@settings(max_examples=200, deadline=None)
@given(
    honest=st.lists(st.floats(min_value=0.01, max_value=10.0), min_size=2, max_size=3),
    attack=st.lists(st.floats(min_value=0.0, max_value=1e30), min_size=1, max_size=40),
)
def test_one_trainer_cannot_move_the_reference_out_of_the_honest_votes(honest, attack) -> None:
    """With two or three honest trainers (each steady at its own norm) and one that sends anything at all, as
    often as it likes, the reference stays between the honest trainers' smallest and largest norm (with two
    honest trainers and the attacker, the lower median of three)."""
    bound = GradientBound(CLIP)
    for _ in range(8):
        for index, norm in enumerate(honest):
            admit(bound, str(index), norm)
    for norm in attack:
        try:
            admit(bound, "attacker", norm)
        except GradientRefused:
            pass
        reference = bound.reference()
        assert reference is not None and min(honest) <= reference <= max(honest)  # SAMPLES is 4: exact


@settings(max_examples=100, deadline=None)
@given(honest=st.floats(min_value=0.01, max_value=10.0), attack=st.lists(norms, min_size=1, max_size=40))
def test_with_two_trainers_the_other_can_only_lower_the_reference(honest, attack) -> None:
    """Two trainers: the reference is the smaller vote, so the attacker never raises it above the honest
    trainer's norm (and lowering it refuses nothing within the fresh bound: the first test)."""
    bound = GradientBound(CLIP)
    for _ in range(8):
        admit(bound, "honest", honest)
    for norm in attack:
        try:
            admit(bound, "attacker", norm)
        except GradientRefused:
            pass
        assert bound.reference() <= honest


@pytest.mark.parametrize("trainer_count", [1, 2, 4])
def test_honest_loss_spike_and_early_growth_are_accepted(trainer_count: int) -> None:
    """Norms at 0.1, then one trainer's loss spike of 10⁴ × (the largest measured), then every trainer's norms
    200 × higher for good (early training, as the head of bench_pipeline.py moved): nothing is refused, the
    spike is scaled to 100 × the reference, and the reference follows the growth within a window."""
    bound = GradientBound(CLIP)
    names = [str(i) for i in range(trainer_count)]
    for _ in range(4):
        for name in names:
            admit(bound, name, 0.1)
        bound.end_step()
    assert admit(bound, names[0], 1e3) == pytest.approx(100 * 0.1)
    for _ in range(8):
        for name in names:
            admit(bound, name, 20.0)
        bound.end_step()
    assert bound.reference() == pytest.approx(20.0)
    assert bound.refused == 0 and bound.scaled >= 1


@pytest.mark.parametrize("trainer_count", [1, 2, 4])
@pytest.mark.parametrize("scale", [1e6, 1e18, 1e30, 3e38, math.inf, math.nan])
def test_hostile_gradients_are_refused_on_every_try(trainer_count: int, scale: float) -> None:
    """After honest contributions at 0.25 per sample from every trainer, a contribution at ``scale`` × that is
    refused, however often it is sent; it changes neither the reference nor anyone's vote."""
    bound = GradientBound(CLIP)
    names = [str(i) for i in range(trainer_count)]
    for name in names * 3:
        admit(bound, name, 0.25)
    for _ in range(20):
        with pytest.raises(GradientRefused, match="Backward refused"):
            admit(bound, names[-1], 0.25 * scale)
    assert bound.reference() == 0.25 and bound.refused == 20


def test_a_ramp_by_one_of_four_trainers_gets_no_further() -> None:
    """One of four trainers climbs 10-fold per contribution up to 10⁴ × the others: it is accepted scaled to
    100 × the honest reference, and then a sustained 10⁶ × is refused on every try."""
    bound = GradientBound(CLIP)
    for name in "abc" * 3:
        admit(bound, name, 0.25)
    for power in range(5):
        assert admit(bound, "d", 0.25 * 10**power) <= 100 * 0.25 * (1 + 1e-9)
    for _ in range(20):
        with pytest.raises(GradientRefused):
            admit(bound, "d", 0.25e6)
    assert bound.reference() == 0.25


def test_a_fresh_stage_refuses_above_the_fresh_bound_and_forgets_idle_trainers() -> None:
    """No reference yet: above 1000 × clip is refused (a hostile first request cannot become the reference);
    a trainer that contributed nothing for two steps no longer votes."""
    bound = GradientBound(CLIP)
    with pytest.raises(GradientRefused, match="no contribution accepted yet"):
        admit(bound, "a", 1001 * CLIP)
    assert bound.reference() is None
    admit(bound, "a", 0.5)
    admit(bound, "b", 0.1)
    for _ in range(3):
        admit(bound, "b", 0.1)
        bound.end_step()
    assert bound.reference() == 0.1
