"""Conformance of the election's beacon (``coordinator_program/spec/beacon.py``): the C program against the
specification, every operation replayed on both with byte-identical accounts demanded after each.

A round's witnesses commit to secrets while it trains, reveal them once a quorum of them has committed or training
has ended, and the next round's seed hashes their XOR; a witness that committed and did not reveal leaves at the
round's end. The attacks: a witness
that reveals another secret than it committed to, commits again, or copies an honest witness's commitment to cancel
its secret; a late joiner, or a ticker, that tries to move the next round's seed. Once the commitments are in, the
only choice left is each committer's reveal or withholding, and withholding costs the committer its place. And once
the secrets are revealed the next seed is known: a client that then leaves (or is removed) before the next round
starts must not re-roll who else the next round elects, as a draw over client indices would.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib

from coordinator_chain import ProgramChain, Replay, Swarm, key, program_instruction, training_swarm
from solders.keypair import Keypair
from solders.transaction_metadata import FailedTransactionMetadata

from coordinator_program.onchain.budget import DEFAULT_UNITS, TICK_UNITS, requested_units
from coordinator_program.spec import derived, errors, limits
from coordinator_program.spec.beacon import join_commitment, mix_reveal, seed_commitment
from coordinator_program.spec.config import Checkpoint
from coordinator_program.spec.instructions import (
    CommitSeed,
    JoinRun,
    RevealSeed,
    SetPaused,
    Tick,
    Update,
    WarmupWitness,
    Withdraw,
)
from coordinator_program.spec.selection import elect_witnesses, next_seed, witness_ticket
from coordinator_program.spec.state import Client, Health, Phase, Role
from tests.program.test_conformance import full_config
from tests.spec.scenario import MODEL, SMALL
from tests.spec.test_properties import join_secret

CONFIG = dataclasses.replace(SMALL, min_clients=5, max_clients=10, witness_nodes=3, witness_quorum=2, total_steps=20,
                             rounds_per_epoch=3)
"""Eight clients (two workers a stage and two trainers, so that any one may leave), three witnesses, a quorum of
two."""


def secret(swarm: Swarm, witness: bytes, salt: bytes = b"") -> bytes:
    return hashlib.sha256(b"secret" + salt + witness + swarm.state.round.seed.to_bytes(8, "little")).digest()


def commit(swarm: Swarm, witness: bytes, hidden: bytes) -> int | None:
    state = swarm.state
    commitment = seed_commitment(witness, state.round.seed, hidden)
    return swarm.replay.apply(CommitSeed(state.round.height, commitment), swarm.of(witness))


def reveal(swarm: Swarm, witness: bytes, hidden: bytes) -> int | None:
    return swarm.replay.apply(RevealSeed(swarm.state.round.height, hidden), swarm.of(witness))


def to_round_witness(swarm: Swarm, authority: Keypair) -> None:
    """Every witness proves everyone present: the quorum ends RoundTrain, so the commitments close."""
    assert set(swarm.prove(swarm.clients())) == {None}
    if swarm.state.phase == Phase.RoundTrain:
        assert swarm.replay.apply(Tick(), authority, advance=CONFIG.max_round_train_time) is None
    assert swarm.state.phase == Phase.RoundWitness


def end_round(swarm: Swarm, authority: Keypair, advance: int = CONFIG.round_witness_time) -> None:
    assert swarm.replay.apply(Tick(), authority, advance=advance) is None
    assert swarm.state.phase == Phase.RoundTrain


def started() -> tuple[Swarm, Keypair, list[bytes]]:
    swarm, authority = training_swarm(CONFIG, MODEL, workers=6, trainers=2)
    return swarm, authority, derived.witnesses(swarm.state)


def test_the_next_seed_hashes_every_revealed_secret() -> None:
    swarm, authority, elected = started()
    secrets = [secret(swarm, w) for w in elected]
    assert commit(swarm, elected[0], secrets[0]) is None
    assert reveal(swarm, elected[0], secrets[0]) == errors.WrongPhase.code  # not while a commitment may come
    assert commit(swarm, elected[1], secrets[1]) is None  # a quorum committed: the commitments close
    assert commit(swarm, elected[2], secrets[2]) == errors.WrongPhase.code  # it could now choose after a reveal
    assert reveal(swarm, elected[0], secrets[0]) is None  # the rest of the round to reveal
    seed = swarm.state.round.seed
    to_round_witness(swarm, authority)
    assert reveal(swarm, elected[1], secrets[1]) is None
    clients = swarm.clients()
    end_round(swarm, authority)
    assert swarm.state.round.seed == next_seed(seed, 0, mix_reveal(secrets[0], secrets[1]))
    assert swarm.state.round.seed != next_seed(seed, 0), "the seed a round ahead could foresee"
    assert swarm.clients() == clients, "every committed witness revealed: no one leaves"


def test_a_witness_that_withholds_its_reveal_leaves_at_the_round_end() -> None:
    swarm, authority, elected = started()
    withholder, honest, _ = elected
    secrets = {w: secret(swarm, w) for w in (withholder, honest)}
    for w in (withholder, honest):
        assert commit(swarm, w, secrets[w]) is None
    seed = swarm.state.round.seed
    to_round_witness(swarm, authority)
    assert reveal(swarm, honest, secrets[honest]) is None
    end_round(swarm, authority)
    assert withholder not in swarm.clients(), "withholding a reveal costs the witness its place"
    assert honest in swarm.clients()
    assert swarm.state.round.seed == next_seed(seed, 0, secrets[honest])


def test_a_witness_that_never_committed_is_not_punished_and_cannot_reveal() -> None:
    swarm, authority, elected = started()
    silent, *others = elected
    assert commit(swarm, others[0], secret(swarm, others[0])) is None
    assert reveal(swarm, others[0], secret(swarm, others[0])) == errors.WrongPhase.code  # the others could commit
    assert commit(swarm, others[1], secret(swarm, others[1])) is None
    to_round_witness(swarm, authority)
    assert reveal(swarm, silent, secret(swarm, silent)) == errors.NoCommitment.code
    for w in others:
        assert reveal(swarm, w, secret(swarm, w)) is None
    end_round(swarm, authority)
    assert silent in swarm.clients()


def test_a_committed_witness_can_open_nothing_but_its_own_secret() -> None:
    """Once committed, a witness can neither change its commitment nor reveal another secret, nor open an honest
    witness's commitment it copied (which in the XOR would cancel the honest secret); each attempt is refused and
    leaves the account as it was."""
    swarm, authority, elected = started()
    honest, liar, late = elected
    hidden = {w: secret(swarm, w) for w in elected}
    assert commit(swarm, honest, hidden[honest]) is None
    assert commit(swarm, honest, secret(swarm, honest, b"second")) == errors.AlreadyCommitted.code
    outsider = next(c for c in swarm.clients() if c not in elected)
    assert swarm.replay.apply(CommitSeed(0, bytes(32)), swarm.of(outsider)) == errors.NotAWitness.code
    copied = swarm.state.round.commitments[elected.index(honest)]
    assert swarm.replay.apply(CommitSeed(0, copied), swarm.of(liar)) is None  # the honest witness's commitment
    assert commit(swarm, late, hidden[late]) == errors.WrongPhase.code  # a quorum committed: closed
    to_round_witness(swarm, authority)
    assert reveal(swarm, honest, secret(swarm, honest, b"second")) == errors.BadReveal.code
    assert swarm.replay.apply(RevealSeed(1, hidden[honest]), swarm.of(honest)) == errors.StaleRound.code
    assert reveal(swarm, honest, hidden[honest]) is None
    assert reveal(swarm, honest, hidden[honest]) == errors.AlreadyRevealed.code
    assert reveal(swarm, liar, hidden[honest]) == errors.BadReveal.code  # bound to the committer's key
    assert reveal(swarm, late, hidden[late]) == errors.NoCommitment.code
    seed = swarm.state.round.seed
    end_round(swarm, authority)
    assert swarm.state.round.seed == next_seed(seed, 0, hidden[honest]), "the honest secret was not cancelled"
    assert liar not in swarm.clients(), "the copier could open nothing, so it withheld and left"


def committed_round(joiner: bool, tick_late: bool) -> int:
    """Round 0 with a quorum of its witnesses committed and revealed; a key joins after the commitments when
    ``joiner`` (and tries to commit), and the ticker ends the round late when ``tick_late``. Returns round 1's seed."""
    swarm, authority, elected = started()
    elected = elected[:CONFIG.witness_quorum]  # a quorum commits, which closes the commitments
    secrets = [secret(swarm, w) for w in elected]
    for w, hidden in zip(elected, secrets, strict=True):
        assert commit(swarm, w, hidden) is None
    if joiner:
        late, = swarm.new_members(1)
        assert swarm.replay.apply(JoinRun(swarm.state.run_id, Role.Worker), late) is None
        assert swarm.replay.apply(CommitSeed(0, bytes(32)), late) == errors.NotAClient.code
    to_round_witness(swarm, authority)
    if joiner:
        assert swarm.replay.apply(RevealSeed(0, bytes(32)), late) == errors.NotAClient.code
    for w, hidden in zip(elected, secrets, strict=True):
        assert reveal(swarm, w, hidden) is None
    end_round(swarm, authority, CONFIG.round_witness_time + (50 if tick_late else 0))
    assert all(c.health == Health.Healthy for c in swarm.state.clients)
    return swarm.state.round.seed


def test_no_joiner_nor_ticker_changes_the_seed_once_committed() -> None:
    """The same commitments and reveals give the same next seed whether or not a key joined meanwhile and whenever
    the round's end is ticked: the reveals are the seed's only input left, each fixed by its commitment."""
    assert committed_round(False, False) == committed_round(True, False) == committed_round(False, True)


def commit_and_reveal(swarm, authority, elected: list[bytes]) -> None:
    """The ``elected`` commit to their secrets while the round trains, the round reaches RoundWitness, and they
    reveal: the next round's seed is then known to all."""
    secrets = [secret(swarm, w) for w in elected]
    for w, hidden in zip(elected, secrets, strict=True):
        assert commit(swarm, w, hidden) is None
    to_round_witness(swarm, authority)
    for w, hidden in zip(elected, secrets, strict=True):
        assert reveal(swarm, w, hidden) is None


def test_the_epochs_last_reveals_seed_the_next_warmup() -> None:
    swarm, authority, _ = started()
    for _ in range(CONFIG.rounds_per_epoch):
        commit_and_reveal(swarm, authority, derived.witnesses(swarm.state)[:CONFIG.witness_quorum])
        seed, reveals = swarm.state.round.seed, swarm.state.round.reveals
        assert swarm.replay.apply(Tick(), authority, advance=CONFIG.round_witness_time) is None
    assert swarm.state.phase == Phase.Cooldown
    assert swarm.replay.apply(Tick(), authority, advance=CONFIG.cooldown_time) is None
    assert swarm.replay.apply(Tick(), authority) is None and swarm.state.phase == Phase.Warmup
    assert swarm.state.round.seed == next_seed(seed, 0, reveals)


RANKED = dataclasses.replace(CONFIG, min_clients=8, max_clients=64, witness_nodes=8, witness_quorum=5)
"""Forty clients (ten workers a stage and ten trainers), eight witnesses, a quorum of five."""


def test_leaving_once_the_next_seed_is_known_re_rolls_no_one_elses_seat() -> None:
    """The attack: round 0's witnesses have revealed, so round 1's seed is known to all, and any client may still
    withdraw before round 1 starts, which moves every later client down an index. Replayed on the program from the
    same state, with no one leaving and with each client in turn leaving: round 1 must elect the same witnesses, in
    the same order, less the leaver, and only when the leaver held a seat one more behind them (the next in line).
    So colluders choosing who of them leaves choose among no other elections."""
    swarm, authority = training_swarm(RANKED, MODEL, workers=30, trainers=10)
    commit_and_reveal(swarm, authority, derived.witnesses(swarm.state)[:RANKED.witness_quorum])
    known = copy.deepcopy(swarm.state)

    def next_election(leaver: bytes | None) -> list[bytes]:
        swarm.replay.load(copy.deepcopy(known))
        if leaver is not None:
            assert swarm.replay.apply(Withdraw(), swarm.of(leaver)) is None
        end_round(swarm, authority)
        assert swarm.state.round.seed == next_seed(known.round.seed, 0, known.round.reveals)
        return derived.witnesses(swarm.state)

    staying = next_election(None)
    assert len(staying) == RANKED.witness_nodes
    for leaver in [c.id for c in known.clients]:
        after = next_election(leaver)
        kept = [w for w in staying if w != leaver]
        assert after[:len(kept)] == kept, "a withdrawal moved another client's seat"
        assert len(after) == len(kept) + (leaver in staying)


def test_a_tick_that_elects_among_1024_clients_asks_for_what_it_needs() -> None:
    """At 1,024 clients the tick that starts round 0 ranks every client's ticket (a sha256 each): more than the
    default 200,000 units an instruction gets, so a tick sent without a request fails and changes nothing, and within
    what a tick asks for (``onchain.budget``, as the Solana backend sends it), where the program's election equals
    the specification's."""
    authority = Keypair()
    replay = Replay(ProgramChain(), authority, "elect-1024")
    state = copy.deepcopy(replay.state)
    state.config, state.model = full_config(limits.MAX_CLIENTS), MODEL
    state.phase, state.phase_start, state.pause_requested = Phase.Warmup, replay.now, False
    state.clients = [Client(hashlib.sha256(b"client %d" % i).digest(), Role.Trainer if i % 8 == 7 else Role.Worker,
                            limits.NO_STAGE if i % 8 == 7 else i % 4) for i in range(limits.MAX_CLIENTS)]
    state.round.seed = 12345
    state.round.witnesses = derived.election(state)
    replay.load(state)
    replay.chain.set_clock(replay.now + state.config.warmup_time)
    tick = program_instruction(replay.chain.program_id, Tick, replay.accounts(authority, None), Tick().encode())
    before = replay.snapshot()
    unasked = replay.chain.send([tick], [authority])
    assert isinstance(unasked, FailedTransactionMetadata)
    assert unasked.meta().compute_units_consumed() == DEFAULT_UNITS, "the default budget ran out"
    assert replay.snapshot() == before
    assert requested_units(Tick) == TICK_UNITS
    assert replay.apply(Tick(), authority) is None  # asks as the clients do; the bytes must match the specification
    assert replay.state.phase == Phase.RoundTrain
    assert DEFAULT_UNITS < replay.units <= TICK_UNITS
    assert len(derived.witnesses(replay.state)) == limits.MAX_WITNESSES


GROUND = dataclasses.replace(CONFIG, max_clients=16)
"""Eight clients and room for joiners."""


def ground_keys(swarm: Swarm, seeds: list[int], n: int, beating: list[bytes]) -> list[Keypair]:
    """``n`` funded keypairs whose tickets under every one of ``seeds`` beat every ticket of ``beating``: what a
    joiner grinds offline, a keypair and two sha256 a try."""
    best = {seed: min(witness_ticket(seed, other) for other in beating) for seed in seeds}
    found, tries = [], 0
    while len(found) < n:
        keypair = Keypair.from_seed(hashlib.sha256(b"ground %d" % tries).digest())
        tries += 1
        if all(witness_ticket(seed, key(keypair)) < best[seed] for seed in seeds):
            found.append(keypair)
    swarm.replay.chain.fund(*found)
    swarm.members.update({key(kp): kp for kp in found})
    return found


def test_keys_ground_for_an_epoch_s_first_seeds_win_none_of_its_first_seats() -> None:
    """The attack: once an epoch's last round has revealed, the next epoch's warmup seed, and round 0's (chained from
    it: the warmup has no reveals), are known while joins are still open. A joiner grinds keypairs until each one's
    tickets beat every client's under both seeds, and joins with them: by rank alone they would win every seat of
    both elections and, as round 0's only committers, choose round 1's seed. Veterans, the clients of that last
    round, rank first in an epoch's first two elections: no ground key is elected in either, and the program agrees
    byte for byte."""
    swarm, authority = training_swarm(GROUND, MODEL, workers=6, trainers=2)
    for _ in range(GROUND.rounds_per_epoch - 1):
        commit_and_reveal(swarm, authority, derived.witnesses(swarm.state)[:GROUND.witness_quorum])
        end_round(swarm, authority)
    commit_and_reveal(swarm, authority, derived.witnesses(swarm.state)[:GROUND.witness_quorum])  # the epoch's last
    warmup = next_seed(swarm.state.round.seed, 0, swarm.state.round.reveals)
    veterans = swarm.clients()
    ground = {key(kp) for kp in ground_keys(swarm, [warmup, next_seed(warmup, 0)], GROUND.witness_nodes, veterans)}
    for joiner in ground:
        assert swarm.replay.apply(JoinRun("swarm", Role.Trainer), swarm.of(joiner)) is None
    assert swarm.replay.apply(Tick(), authority, advance=GROUND.round_witness_time) is None
    assert swarm.state.phase == Phase.Cooldown
    assert swarm.replay.apply(Tick(), authority, advance=GROUND.cooldown_time) is None
    assert [p.veteran for p in swarm.state.pending] == [True] * len(veterans) + [False] * len(ground)
    assert swarm.replay.apply(Tick(), authority) is None and swarm.state.phase == Phase.Warmup
    assert swarm.state.round.seed == warmup
    for phase in (Phase.Warmup, Phase.RoundTrain):
        everyone = swarm.clients()
        by_ticket = {everyone[i] for i in elect_witnesses(swarm.state.round.seed, everyone, GROUND.witness_nodes)}
        assert by_ticket == ground, "the ground keys hold the lowest tickets: by rank alone they win every seat"
        elected = derived.witnesses(swarm.state)
        assert len(elected) == GROUND.witness_nodes and set(elected) <= set(veterans)
        if phase == Phase.Warmup:
            assert swarm.replay.apply(Tick(), authority, advance=GROUND.warmup_time) is None
            assert swarm.state.phase == Phase.RoundTrain and swarm.state.round.height == 0
    commit_and_reveal(swarm, authority, derived.witnesses(swarm.state)[:GROUND.witness_quorum])
    end_round(swarm, authority)  # round 1: every client ranks by ticket alone, under a seed no one foresaw
    assert swarm.state.round.height == 1
    everyone = swarm.clients()
    assert derived.witnesses(swarm.state) == [everyone[i] for i in elect_witnesses(swarm.state.round.seed, everyone,
                                                                                    GROUND.witness_nodes)]



def test_keys_ground_for_the_run_s_first_seeds_win_nothing_once_its_joiners_reveal() -> None:
    """The attack on a run's first epoch, which has no veterans: its warmup's seed, and round 0's chained from it, are
    known from the run's creation, so a joiner grinds keypairs whose tickets beat every other joiner's under both
    and joins with them; by rank alone they would win every seat of both elections. But the honest joiners commit to
    secrets when they join: the admitting tick elects no one, the warmup takes reveals (refusing a wrong secret, a
    second reveal, a reveal without a commitment and any proof), and the warmup's witnesses are elected under a seed
    that hashes the secrets, which no key could be ground against. A joiner that keeps its secret leaves at half the
    warmup. The program agrees byte for byte throughout."""
    authority = Keypair()
    swarm = Swarm(Replay(ProgramChain(), authority, "first"))
    apply = swarm.replay.apply
    assert apply(Update(GROUND, MODEL, Checkpoint()), authority) is None
    assert apply(SetPaused(False), authority) is None
    assert apply(Tick(), authority) is None and swarm.state.phase == Phase.WaitingForMembers
    honest = [key(kp) for kp in swarm.new_members(8)]
    for i, member in enumerate(honest):
        commitment = join_commitment(member, join_secret(member))
        assert apply(JoinRun("first", Role.Worker if i < 6 else Role.Trainer, commitment=commitment),
                     swarm.of(member)) is None
    foreseen = next_seed(swarm.state.round.seed, 0, swarm.state.round.reveals)
    ground = {key(kp) for kp in ground_keys(swarm, [foreseen, next_seed(foreseen, 0)], GROUND.witness_nodes, honest)}
    for joiner in ground:
        assert apply(JoinRun("first", Role.Trainer), swarm.of(joiner)) is None
    assert apply(Tick(), authority) is None and swarm.state.phase == Phase.Warmup
    assert swarm.state.round.seed == foreseen and derived.revealing(swarm.state)
    everyone = swarm.clients()
    assert {everyone[i] for i in elect_witnesses(foreseen, everyone, GROUND.witness_nodes)} == ground
    assert derived.witnesses(swarm.state) == [], "no one is elected while the joiners reveal"

    attacker, withholder, liar = next(iter(ground)), honest[0], honest[1]
    assert swarm.replay.apply(WarmupWitness(bytes(GROUND.bloom_bytes), bytes(GROUND.bloom_bytes)),
                              swarm.of(attacker)) == errors.NotAWitness.code
    assert apply(RevealSeed(0, join_secret(attacker)), swarm.of(attacker)) == errors.NoCommitment.code
    assert apply(RevealSeed(0, join_secret(withholder)), swarm.of(liar)) == errors.BadReveal.code
    assert apply(RevealSeed(1, join_secret(liar)), swarm.of(liar)) == errors.StaleRound.code
    revealed = bytes(32)
    for member in honest[1:]:
        assert apply(RevealSeed(0, join_secret(member)), swarm.of(member)) is None
        revealed = mix_reveal(revealed, join_secret(member))
    assert apply(RevealSeed(0, join_secret(liar)), swarm.of(liar)) == errors.NoCommitment.code, "spent"
    assert apply(Tick(), authority, advance=GROUND.warmup_time - 1) == errors.NothingToTick.code
    assert apply(Tick(), authority, advance=1) is None, "the warmup's end: the reveals close, round 0 starts"
    assert swarm.state.phase == Phase.RoundTrain and swarm.state.round.height == 0
    assert withholder not in swarm.clients(), "a joiner that kept its secret leaves"
    assert swarm.state.round.seed == next_seed(next_seed(foreseen, 0, revealed), 0)
    assert apply(RevealSeed(0, join_secret(withholder)), swarm.of(withholder)) == errors.NotAClient.code
    everyone = swarm.clients()
    elected = derived.witnesses(swarm.state)
    assert elected == [everyone[i] for i in elect_witnesses(swarm.state.round.seed, everyone, GROUND.witness_nodes)]
    assert all(c.commitment == bytes(32) for c in swarm.state.clients)
    # How often the ground keys still win every seat, over many honest secrets: tests/spec/test_beacon.py.


def test_joiners_that_all_reveal_are_elected_at_once_and_a_run_without_commitments_elects_on_admission() -> None:
    """Reveals close as soon as every committed joiner still healthy has revealed (one that withdrew is not waited
    for, and leaves with the close), and the warmup's witnesses are elected then; a run whose joiners commit to
    nothing elects its warmup's witnesses when it admits them, as before."""
    swarm, authority = training_swarm(CONFIG, MODEL, workers=6, trainers=2)  # joins without commitments
    assert swarm.state.round.witnesses[0] != limits.UNELECTED
    replay = Replay(ProgramChain(), authority, "all")
    swarm = Swarm(replay)
    assert replay.apply(Update(CONFIG, MODEL, Checkpoint()), authority) is None
    assert replay.apply(SetPaused(False), authority) is None
    assert replay.apply(Tick(), authority) is None
    members = [key(kp) for kp in swarm.new_members(6)]
    for i, member in enumerate(members):
        join = JoinRun("all", Role.Trainer if i == 4 else Role.Worker,
                       commitment=join_commitment(member, join_secret(member)) if i % 2 else bytes(32))
        assert replay.apply(join, swarm.of(member)) is None
    assert replay.apply(Tick(), authority) is None and derived.revealing(swarm.state)
    assert replay.apply(Tick(), authority) == errors.NothingToTick.code
    quitter = members[5]
    assert replay.apply(Withdraw(), swarm.of(quitter)) is None
    for member in members[1:5:2]:
        assert replay.apply(RevealSeed(0, join_secret(member)), swarm.of(member)) is None
    assert replay.apply(Tick(), authority) is None, "every commitment still held opened: the reveals close at once"
    assert swarm.state.phase == Phase.Warmup and not derived.revealing(swarm.state)
    assert swarm.clients() == members[:5], "the joiner that withdrew leaves with the close"
    assert len(derived.witnesses(swarm.state)) == CONFIG.witness_nodes
