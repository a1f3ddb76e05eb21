"""A contributor that misbehaves on purpose, for the swarm-level adversarial tests.

``python tests/adversarial/hostile.py trainer|wrong-data|idle|worker|liar|overclaimer|false-reducer join-run ARGS...``
patches the
real client in this process, then runs ``psyswarm join-run ARGS...``: everything it does goes through the real code
paths and the real wire.

A hostile trainer
- poisons every Backward it sends (``grad_output`` × 1e30, signed by its own key, so only the worker's gradient
  bound stands in the way);
- claims another trainer's work: it commits its own share with loss 0.001 and the receipts another trainer
  published for the round;
- tries to hide the other trainers' commitments: it stores junk under their subkeys, with a one-day expiry,
  from a DHT node that validates nothing.

A lying worker computes wrong but well formed: a share ``LIE_SHARE`` of its stage's outputs scaled by 1.01 (its
input gradients with them), each answer signed as its own (a trainer refuses unsigned ones); checked results catch
it where replicas are identical. It never withdraws, though its state departs from its stage's: an attacker leaves only
when the run removes it (and a liar that withdrew itself would end the test's run, which needs every client).

A lying trainer sends plausible data that is not the run's: real text, each sample index answered with the next
sample's tokens (``OtherText``); everything else it does honestly, a presence each round included.

An idle trainer publishes its presence each round and trains nothing.

A false reducer returns, as the reducer of its shard of every all-reduce, the robust mean of its groupmates' parts
plus ``FALSE_SHIFT``, and signs that: well within any bound a sender checks, so only an audit can tell.

An overclaiming worker attacks its stage's gradient averaging: it sends −60 × its gradient and seals, in every
round, a weight of twice the round's global batch, more than any worker can have processed; it never withdraws,
though its state departs from its stage's; and it runs a stranger beside it (a DHT node and key of its own, on no
roster) that joins each of its rounds with that gradient times 1e3.

A hostile worker computes honestly (the lying worker above computes wrong), but
- tries to hijack its same-stage peers: it announces its own address under their uids;
- publishes a malformed report of the round under its own subkey;
- when elected witness, proves every round with empty filters and health-checks every other client.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time

log = logging.getLogger("psyswarm.hostile")

JUNK_LIFETIME = 86_400.0
LIE_SHARE = 0.5
FALSE_SHIFT = 0.01


def plain_dht(context):
    """A DHT node of the run's swarm that validates nothing: an attacker's own node (one per client context)."""
    import hivemind

    from client.helper_processes import forking_helpers

    if getattr(context, "_plain_dht", None) is None:
        peers = [str(a) for a in context.dht.get_visible_maddrs()]
        with forking_helpers():  # it dies with this process, like the client's own node
            context._plain_dht = hivemind.DHT(initial_peers=peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                                              start=True)
    return context._plain_dht


def store_junk(context, key: str, subkeys: list[str]) -> None:
    from hivemind.utils import get_dht_time

    dht = plain_dht(context)
    for subkey in subkeys:
        stored = dht.store(key, {"junk": True}, get_dht_time() + JUNK_LIFETIME, subkey=subkey)
        log.info("junk under %s/%s: %s", key, subkey[:8], stored)


def hostile_trainer() -> None:
    from client.contributor.trainer import TrainerRole
    from client.pipeline.trainer import PipelineTrainer
    from client.witness.records import Commitment
    from coordinator_program.spec import derived
    from coordinator_program.spec.state import Role

    call = PipelineTrainer._call

    def poisoned_call(self, stage, micro, backward, tensors, **options):
        if backward and "grad_output" in tensors:
            tensors = {**tensors, "grad_output": tensors["grad_output"] * 1e30}
        return call(self, stage, micro, backward, tensors, **options)

    PipelineTrainer._call = poisoned_call
    train = TrainerRole.train

    async def claim_others_work(self, state) -> None:
        await train(self, state)  # every poisoned Backward is refused: no commitment of its own
        context = self.context
        share = next((a for a in derived.data_assignment(state) if a.client == context.me and a.size), None)
        if share is None or context.board is None:
            return
        others = [c.id.hex() for c in state.clients if c.role == Role.Trainer and c.id != context.me]
        for victim in others:  # under the key each victim files its commitment under
            key = context.board.key(Commitment, state.epoch, state.round.height, context.board.shard_of(victim))
            await asyncio.to_thread(store_junk, context, key, [victim])
        deadline = time.monotonic() + state.config.max_round_train_time
        while time.monotonic() < deadline:
            found = await asyncio.to_thread(context.board.fetch, Commitment, state.epoch, state.round.height)
            honest = [c for author, c in found.items() if author != context.me.hex()]
            if honest:
                copied = Commitment.create(context.keypair, run_id=state.run_id, epoch=state.epoch,
                                           round=state.round.height, start=share.start, end=share.end, loss=0.001,
                                           tokens=share.size * state.model.seq_len, receipts=honest[0].receipts)
                published = await asyncio.to_thread(context.board.publish, copied, context.keypair)
                log.info("round %d.%d: committed another trainer's receipts: %s", state.epoch,
                         state.round.height, published)
                return
            await asyncio.sleep(0.5)

    TrainerRole.train = claim_others_work


def hostile_worker() -> None:
    import client.contributor.witnessing
    from client.contributor.rounds import RoundKey
    from client.contributor.worker import WorkerRole
    from client.witness.judge import Evidence
    from client.witness.records import Report
    from coordinator_program.spec.bloom import build_filter
    from coordinator_program.spec.state import Role

    Evidence.filters = lambda self, state: [(build_filter(state.config, []), build_filter(state.config, []))]
    client.contributor.witnessing.unhealthy_clients = lambda state: [c.id for c in state.clients]
    publish = WorkerRole.publish_receipts

    attacked: set[RoundKey] = set()

    async def publish_and_attack(self, round_: RoundKey) -> None:
        from hivemind.utils import get_dht_time

        await publish(self, round_)
        context = self.context
        if self.worker is None or context.board is None or round_ in attacked:
            return
        attacked.add(round_)
        key = context.board.key(Report, round_.epoch, round_.height, context.board.shard_of(context.me.hex()))
        malformed = {"receipts": 7, "uid": [[{}, "u", {}]]}
        # Off the event loop, starting its own DHT node included: a loop that blocks stops answering the server's
        # pings, and the server then withdraws this worker, which is not the attack under test.
        await asyncio.to_thread(lambda: plain_dht(context).store(key, malformed, get_dht_time() + 600,
                                                                 subkey=context.me.hex()))
        state = context.state
        peers = [c.id.hex() for c in state.clients if c.role == Role.Worker and c.stage == self.stage
                 and c.id != context.me]
        await asyncio.to_thread(hijack, self, peers)

    WorkerRole.publish_receipts = publish_and_attack


def never_withdraw() -> None:
    """A departed state (``client.contributor.agreement``) never makes this worker withdraw: it stays until removed."""
    from client.contributor.agreement import Agreement, Outcome

    check = Agreement.check

    def stay(self, epoch, step):
        outcome = check(self, epoch, step)
        return Outcome.DEPARTED if outcome == Outcome.WITHDRAW else outcome

    Agreement.check = stay


def lying_worker() -> None:
    import random

    import client.pipeline.compute as compute

    build = compute.build_stage
    rng = random.Random()

    def falsifying(config, stage):
        module = build(config, stage)
        forward = module.forward

        def lie(*args, **kwargs):
            out = forward(*args, **kwargs)
            return out * 1.01 if rng.random() < LIE_SHARE else out

        module.forward = lie
        return module

    compute.build_stage = falsifying
    never_withdraw()


def hijack(role, victims: list[str]) -> None:
    """Announce this worker's address under each victim's uid: its own sealed record naming the victim's uid,
    and junk under the victim's own subkey from a node that validates nothing."""
    from dataclasses import asdict, replace

    from hivemind.utils import get_dht_time

    from client.pipeline.discovery import stage_key
    from client.sealed import store_sealed
    from client.stages import default_index, worker_uid

    worker, context = role.worker, role.context
    expires = get_dht_time() + 60
    key = stage_key(worker.run_id, worker.stage)  # the run instance its honest peers announce under
    for victim in victims:
        uid = worker_uid(worker.stage, default_index(bytes.fromhex(victim)))
        claim = replace(worker._record(expires), uid=uid).signed_by(context.keypair)
        store_sealed(context.dht, context.keypair, key, asdict(claim), expires)
        store_junk(context, key, [victim])


class OtherText:
    """A lying trainer's data: real text, but each sample index answered with the next sample's tokens."""

    def __init__(self, dataset) -> None:
        self.inner = dataset
        self.name, self.fingerprint, self.seq_len = dataset.name, dataset.fingerprint, dataset.seq_len
        self.num_samples, self.vocab_size = dataset.num_samples, dataset.vocab_size
        self.tokenizer_sha256 = dataset.tokenizer_sha256

    def sample(self, index: int):
        return self.inner.sample(index + 1)

    def batch(self, indices):
        import torch

        return torch.stack([self.sample(i) for i in indices])


def lying_trainer() -> None:
    from client.pipeline.trainer import PipelineTrainer

    init = PipelineTrainer.__init__

    def with_other_text(self, config, dataset, *args, **options) -> None:
        init(self, config, OtherText(dataset), *args, **options)

    PipelineTrainer.__init__ = with_other_text


def overclaiming_worker() -> None:
    from client.averaging.gradients import GradientAverager

    load = GradientAverager._load

    def overclaim(self, grads, index, weight, work=()):
        declared = load(self, [grad * -60 for grad in grads], index, weight, work)
        return {**declared, "weight": 2 * self.settings.max_weight}

    for_worker = GradientAverager.for_worker.__func__

    def with_a_stranger(cls, worker, dht, *, seed, settings, roster):
        """The member's averager, and beside it a stranger's: a DHT node and key of its own, off the roster, that
        joins every round the member does, with the member's poisoned gradient times 1e3."""
        import threading

        from solders.keypair import Keypair

        from client.averaging.membership import Membership
        from client.pipeline.discovery import start_dht

        member = for_worker(cls, worker, dht, seed=seed, settings=settings, roster=roster)
        node = start_dht([str(address) for address in dht.get_visible_maddrs()])  # a helper: it dies with this process
        named = [(n, p.detach().clone()) for n, p in worker.compute.module.named_parameters() if p.requires_grad]
        stranger = cls(named, node, run_id=worker.run_id, stage=worker.stage, seed=seed, settings=settings,
                       membership=Membership(Keypair(), roster))
        average = member.average

        def joined_by_the_stranger(grads, samples, index, weight, **options):
            poison = [grad.detach().cpu() * 1e3 for grad in grads]
            threading.Thread(target=stranger.average, args=(poison, samples, index, settings.max_weight),
                             daemon=True).start()
            return average(grads, samples, index, weight, **options)

        member.average = joined_by_the_stranger
        return member

    GradientAverager._load = overclaim
    GradientAverager.for_worker = classmethod(with_a_stranger)
    never_withdraw()  # its state departs from the stage's (it steps alone): it stays all the same


def false_reducer() -> None:
    from client.averaging.runner import RobustReducer, RobustRunner
    from client.averaging.stage_averager import StageAverager

    class Shifted(RobustReducer):
        async def accumulate_part(self, *args, **kwargs):
            return (await super().accumulate_part(*args, **kwargs)) + FALSE_SHIFT

    StageAverager.runner_class = type("ShiftingRunner", (RobustRunner,), {"reducer_class": Shifted})


def idle_trainer() -> None:
    from client.contributor.trainer import TrainerRole

    async def presence_only(self, state) -> None:
        await self._publish_presence(state)

    TrainerRole.train = presence_only


def main() -> None:
    role, *argv = sys.argv[1:]
    {"trainer": hostile_trainer, "worker": hostile_worker, "liar": lying_worker, "wrong-data": lying_trainer,
     "idle": idle_trainer, "overclaimer": overclaiming_worker, "false-reducer": false_reducer}[role]()
    from client.cli import main as psyswarm

    sys.argv = ["psyswarm", *argv]
    psyswarm()


if __name__ == "__main__":
    main()
