"""A sealed averaging declaration that no honest worker makes convicts its sealer, with evidence anyone can check
(issue 20: a peer caught lying is excluded with evidence; it earns nothing, and the health check removes it).

A worker's declaration is sealed by its key over the averager's prefix (run, stage, kind), the epoch, its libp2p
peer id and what it declares (``client.averaging.membership``). Groupmates already drop a member that declares a
weight above what a worker can have, or evidence of work forged or copied from a groupmate; now the ones that
refuse it keep the declaration (``StageAverager.drain_lies``), its worker publishes it in an ``Accusation``, and a
witness that finds it proves a lie with the run's settings alone (``accusing.declaration_lie``) leaves the sealer
out of the round's proof. Here:

- the attack against real hivemind averagers: a member declares an honest groupmate's evidence; the honest
  averagers hand on its declaration, and it convicts the copier and no one else; a member and a stranger that
  both seal a weight above a replica's: only the member's lie is kept (a stranger has no place to lose);
- each lie convicts its sealer, and nothing an honest worker can declare does, nor an accusation that changed,
  re-addressed or re-attributed a declaration, whoever files it;
- the witness's proof leaves the liar out, and everyone else in.
"""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any

import pytest
from solders.keypair import Keypair

from client.averaging.membership import Membership, Roster, seal
from client.averaging.sparta import averager_prefix
from client.averaging.work import evidence
from client.contributor import accusing
from client.contributor.accusing import FALSE_DECLARATION, declaration_lie, false_declarers
from client.witness.data_accusations import convict
from client.witness.judge import judge_round
from client.witness.records import Accusation
from coordinator_program.spec.derived import run_instance
from coordinator_program.spec.state import CoordinatorState, Role
from tests.averagers import average_together, signed_backwards
from tests.averaging.test_attacks import TRIO, reverser_round, tensors
from tests.averaging.test_weights_follow_work import ADMITTED, _Claimant, honest_work
from tests.spec.scenario import SMALL
from tests.witness.rounds import STAGES, honest_round, run_with_keys

PEER = bytes.fromhex("0024080112203f") + bytes(32)  # a peer id's bytes, as the seal covers them


def workers_of(state: CoordinatorState, stage: int | None = None) -> list[bytes]:
    return [c.id for c in state.clients if c.role == Role.Worker and (stage is None or c.stage == stage)]


def piece(keypair: Keypair, state: CoordinatorState, body: dict[str, Any], *, stage: str | None = None,
          kind: str = "grad", epoch: int | None = None, peer: bytes = PEER) -> dict[str, Any]:
    """An accusation's item: ``body`` sealed by ``keypair`` under the averager prefix of ``stage`` (its own) and
    ``kind``, for ``peer``."""
    me = bytes(keypair.pubkey())
    stage = stage or STAGES[next(c.stage for c in state.clients if c.id == me)]
    prefix = averager_prefix(run_instance(state), stage, kind)
    epoch = state.epoch if epoch is None else epoch
    membership = Membership(keypair, lambda: Roster(epoch, frozenset({me})))
    return {"prefix": prefix, "peer": peer.hex(), "declaration": seal(membership, prefix, peer, epoch, body)}


def grad(weight: float, work: list[Any]) -> dict[str, Any]:
    return {"round": 3, "weight": weight, "norm": 1.5, "q": 0, "work": work}


@pytest.fixture
def run() -> tuple[CoordinatorState, dict[bytes, Keypair]]:
    """A run in RoundTrain with three workers and a round's batch of 16 (``test_weights_follow_work``'s)."""
    return run_with_keys(workers=3, trainers=1, run_id=f"test-{uuid.uuid4().hex[:8]}",
                         config=dataclasses.replace(SMALL, global_batch_size=16))


@pytest.fixture
def run_id(run: tuple[CoordinatorState, dict[bytes, Keypair]]) -> str:
    """The averagers' run id: the run's instance, as a worker's (``StageReplica.create``)."""
    return run_instance(run[0])


def test_a_copier_s_own_declaration_convicts_it_and_no_one_else(make_grad_averager, run, run_id: str) -> None:
    """Real averagers: the reverser declares the first honest worker's evidence (dropped, as
    ``test_weights_follow_work`` shows); what the honest averagers keep of it convicts the reverser. (Groups of
    three: the reverser meets an honest worker, as a leader or a follower, whichever forms the group.)"""
    state, keys = run
    for client in state.clients:  # the three workers share the averagers' stage
        if client.role == Role.Worker:
            client.stage = STAGES.index("body1")
    workers = [keys[w] for w in workers_of(state)]
    made = []

    def making(*args: Any, **kwargs: Any) -> Any:
        made.append(make_grad_averager(*args, **kwargs))
        return made[-1]

    making.trainer = make_grad_averager.trainer  # type: ignore[attr-defined]
    work = honest_work(making, run_id, workers)
    copier = type("GradientAverager", (_Claimant,), {"claim": evidence(work[0])})
    reverser_round(making, ADMITTED, 16.0, attacker=copier, keys=workers, work=[*work, []])  # groups of three
    lies = made[0].process.drain_lies() + made[1].process.drain_lies()
    assert lies, "no honest averager kept the copier's declaration"
    assert {declaration_lie(item, state) for item in lies} == {bytes(workers[2].pubkey())}
    assert made[0].process.drain_lies() == []  # drained


def test_only_a_member_s_lie_is_kept(make_averager) -> None:
    """SPARTA replicas weigh at most 1; a member, then a stranger (its own roster lists it), each seal 5 in a round
    with the two honest replicas (groups of three: each liar meets them)."""
    honest = [make_averager(tensors(i), settings=TRIO, max_weight=1.0) for i in range(2)]
    liar, key = Keypair(), Keypair()
    member = make_averager(tensors(2), keypair=liar, settings=TRIO, max_weight=10.0)
    members = make_averager.members  # type: ignore[attr-defined]
    stranger = make_averager(tensors(3), keypair=key, enrol=False, settings=TRIO, max_weight=10.0,
                             roster=lambda: Roster(0, frozenset(members) | {bytes(key.pubkey())}))

    def kept_after(index: int, attacker: Any) -> list[dict[str, Any]]:
        average_together([*honest, attacker], index, [1.0, 1.0, 5.0])
        return honest[0].averager.drain_lies() + honest[1].averager.drain_lies()

    kept = kept_after(0, member)
    assert kept and {item["declaration"]["member"] for item in kept} == {bytes(liar.pubkey()).hex()}
    assert kept_after(1, stranger) == []


def test_each_lie_convicts_its_sealer() -> None:
    state, keys = run_with_keys(workers=7, trainers=1)
    trainer = keys[next(c.id for c in state.clients if c.role == Role.Trainer)]
    liar, honest = workers_of(state, 1)[:2]
    stage = STAGES[1]
    copied = evidence(signed_backwards(trainer, run_instance(state), stage, 0, 4, worker=keys[honest]))
    lies = {
        "weight above the round's batch": grad(state.config.global_batch_size + 1, []),
        "weight below 0": grad(-1.0, []),
        "weight that is no number": grad("10", []),  # type: ignore[arg-type]
        "evidence copied from a groupmate": grad(4.0, copied),
        "evidence for another stage": grad(4.0, evidence(signed_backwards(trainer, run_instance(state), "tail", 0, 4,
                                                                          worker=keys[liar]))),
        "malformed evidence": grad(4.0, [["not", "a", "header"]]),
    }
    for why, body in lies.items():
        assert declaration_lie(piece(keys[liar], state, body), state) == liar, why
    sparta = piece(keys[liar], state, {"round": 3, "weight": 2.0}, kind="sparta")
    assert declaration_lie(sparta, state) == liar, "a SPARTA weight above a replica's"
    gossip = piece(keys[liar], state, {"round": 3, "weight": 2.0, "norm": 1.0}, kind="gossip")
    assert declaration_lie(gossip, state) == liar, "a PowerGossip weight above a pair member's"


def test_nothing_an_honest_worker_declares_convicts_it() -> None:
    state, keys = run_with_keys(workers=7, trainers=1)
    trainer = keys[next(c.id for c in state.clients if c.role == Role.Trainer)]
    worker = workers_of(state, 1)[0]
    stage, batch = STAGES[1], state.config.global_batch_size

    def own(start: int, end: int, signer: Keypair = trainer) -> list[Any]:
        return evidence(signed_backwards(signer, run_instance(state), stage, start, end, worker=keys[worker]))

    honest = {
        "its samples, proven": grad(4.0, own(0, 4)),
        "syncing: weight 0, no evidence": grad(0.0, []),
        "a step spanning a round's end: more Backwards than the batch": grad(float(batch), own(0, batch + 2)),
        "Backwards of the next round, run while its step was taken": grad(4.0, own(batch, batch + 4)),
        "a trainer the epoch dropped": grad(4.0, own(0, 4, signer=Keypair())),
        "the whole batch": grad(float(batch), own(0, batch)),
    }
    for why, body in honest.items():
        assert declaration_lie(piece(keys[worker], state, body), state) is None, why
    assert declaration_lie(piece(keys[worker], state, {"round": 3, "weight": 1.0}, kind="sparta"), state) is None
    assert declaration_lie(piece(keys[worker], state, {"round": 3, "weight": 1.0, "norm": 1.0}, kind="gossip"),
                           state) is None


def test_an_accusation_proves_only_what_its_sealer_sealed() -> None:
    """A lie moved anywhere its seal does not cover, or sealed by anyone but a worker of that stage this epoch,
    convicts no one; malformed items are skipped, never raised."""
    state, keys = run_with_keys(workers=7, trainers=1)
    liar, other = workers_of(state, 1)[:2]
    trainer = next(c.id for c in state.clients if c.role == Role.Trainer)
    lie = grad(state.config.global_batch_size + 1, [])
    genuine = piece(keys[liar], state, lie)
    assert declaration_lie(genuine, state) == liar
    declaration = genuine["declaration"]
    stranger = Keypair()
    moved = {
        "another peer id": {**genuine, "peer": (bytes(38)).hex()},
        "another stage's prefix": {**genuine, "prefix": averager_prefix(run_instance(state), "tail", "grad")},
        "another run's prefix": {**genuine, "prefix": averager_prefix(state.run_id, STAGES[1], "grad")},
        "altered after sealing": {**genuine, "declaration": {**declaration, "weight": 99.0}},
        "re-attributed to another worker": {**genuine, "declaration": {**declaration, "member": other.hex()}},
        "sealed in another epoch": piece(keys[liar], state, lie, epoch=state.epoch + 1),
        "sealed under another stage": piece(keys[liar], state, lie, stage="tail"),
        "sealed by a trainer": piece(keys[trainer], state, lie, stage=STAGES[1]),
        "an extra field": {**genuine, "note": "x"},
        "a peer id that is not hex": {**genuine, "peer": "zz"},
    }
    for why, item in moved.items():
        assert declaration_lie(item, state) is None, why
    flood = grad(4.0, [["not", "a", "header"]] * (state.config.global_batch_size + 1))
    assert declaration_lie(piece(keys[liar], state, flood), state) is None  # refused unread: proves nothing
    state.clients.append(dataclasses.replace(state.clients[0], id=bytes(stranger.pubkey())))  # not a worker of 1
    for junk in (None, 7, "x", [], {}, {"prefix": 1, "peer": 2, "declaration": 3},
                 {"prefix": genuine["prefix"], "peer": PEER.hex(), "declaration": {"member": "ab", "seal": 5}}):
        assert declaration_lie(junk, state) is None


@pytest.mark.parametrize("author_role", [Role.Worker, Role.Trainer])
def test_the_witness_leaves_the_liar_out_and_everyone_else_in(author_role: Role) -> None:
    state, keys = run_with_keys(workers=7, trainers=1)
    commitments, reports = honest_round(state, keys)
    liar, accuser = workers_of(state, 1)[:2]
    author = accuser if author_role == Role.Worker else next(c.id for c in state.clients if c.role == Role.Trainer)
    lie = piece(keys[liar], state, grad(state.config.global_batch_size + 1, []))
    record = Accusation.create(keys[author], run_id=state.run_id, epoch=state.epoch, round=state.round.height,
                               accusations=(lie,))
    accusations = {author.hex(): record}
    evidence = judge_round(state, commitments, reports, {}, accusations)  # the judge skips what is not its kind
    assert evidence.participants == {c.id for c in state.clients}
    convict(evidence, false_declarers(state, accusations), FALSE_DECLARATION)
    assert liar not in evidence.participants and liar not in evidence.computed
    assert evidence.participants == {c.id for c in state.clients} - {liar}
    assert evidence.why_missing[liar] == FALSE_DECLARATION
    stale = Accusation.create(keys[author], run_id=state.run_id, epoch=state.epoch, round=state.round.height + 1,
                              accusations=(lie,))
    assert false_declarers(state, {author.hex(): stale}) == set()  # filed for another round: not admitted


def test_a_witness_checks_each_item_once_however_often_it_polls(monkeypatch: pytest.MonkeyPatch) -> None:
    """An item may carry a round's batch of signed headers: a witness polling the round checks it once."""
    state, keys = run_with_keys(workers=7, trainers=1)
    liar, accuser = workers_of(state, 1)[:2]
    lie = piece(keys[liar], state, grad(state.config.global_batch_size + 1, []))
    records = {accuser.hex(): Accusation.create(keys[accuser], run_id=state.run_id, epoch=state.epoch,
                                                round=state.round.height, accusations=(lie,))}
    checked: list[object] = []
    check = accusing.declaration_lie
    monkeypatch.setattr(accusing, "declaration_lie", lambda item, state_: checked.append(item) or check(item, state_))
    verdicts: dict[tuple[int, str, int], bytes | None] = {}
    assert [false_declarers(state, records, verdicts) for _ in range(3)] == [{liar}] * 3
    assert len(checked) == 1
