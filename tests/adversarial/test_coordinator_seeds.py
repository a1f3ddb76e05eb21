"""A ticker choosing the election on chain (issue 11, item 6), on the C program and the specification at once.

Anyone may send the tick that starts a round, and before the fix the program seeded that round with
sha256(timestamp ‖ slot) of the tick: over the next 20 slots a client could compute which seeds elect it and
tick in one of those. Here, at each transition that draws a seed (admission into warmup, warmup into round 0,
round 0 into round 1), the attacker simulates its tick on the real program at 20 moments (later seconds,
later slots), and every one must leave the same seed and witnesses, which the specification (``Replay``
checks it byte for byte after the real tick) also computes.
"""

from __future__ import annotations

from pathlib import Path

from solders.keypair import Keypair
from solders.message import Message
from solders.transaction import VersionedTransaction
from solders.transaction_metadata import SimulatedTransactionInfo

from coordinator_program.spec import derived
from coordinator_program.spec.config import Checkpoint, load_run_spec
from coordinator_program.spec.instructions import JoinRun, SetPaused, Tick, Update
from coordinator_program.spec.state import Phase, Role, decode_state
from tests.program.coordinator_chain import ProgramChain, Replay, Swarm, program_instruction

EXAMPLE = load_run_spec(Path(__file__).resolve().parents[2] / "examples" / "state.toml")
CONFIG = EXAMPLE.config
MOMENTS = [(seconds, slots) for seconds in range(0, 10, 2) for slots in (1, 2, 7, 20)]
"""(seconds, slots) past the moment the tick falls due at which the attacker tries it: 20 choices."""


def elections_on_offer(swarm: Swarm, ticker: Keypair) -> set[tuple[int, tuple[bytes, ...]]]:
    """(seed, witnesses) of the round the tick would start, simulated on the program at every moment."""
    chain, replay = swarm.replay.chain, swarm.replay
    now, slot = chain.now, chain.slot
    offered = set()
    for seconds, slots in MOMENTS:
        chain.slot = slot + slots - 1  # set_clock moves one slot on
        chain.set_clock(now + seconds)
        ix = program_instruction(chain.program_id, Tick, replay.accounts(ticker, None), Tick().encode())
        message = Message.new_with_blockhash([ix], ticker.pubkey(), chain.svm.latest_blockhash())
        result = chain.svm.simulate_transaction(VersionedTransaction(message, [ticker]))
        assert isinstance(result, SimulatedTransactionInfo), result
        data = next(bytes(account.data) for address, account in result.post_accounts()
                    if address == replay.run.coordinator)
        after = decode_state(data)
        offered.add((after.round.seed, tuple(derived.witnesses(after))))
    chain.slot = slot
    chain.set_clock(now)
    return offered


def test_no_moment_or_slot_of_the_tick_changes_who_is_elected() -> None:
    ticker = Keypair()  # any client may tick; the attacker need not even be one
    swarm = Swarm(Replay(ProgramChain(), Keypair(), EXAMPLE.run_id))
    authority = swarm.replay.authority
    swarm.replay.chain.fund(ticker)
    apply = swarm.replay.apply
    assert apply(Update(CONFIG, EXAMPLE.model, Checkpoint()), authority) is None
    assert apply(SetPaused(False), authority) is None
    assert apply(Tick(), authority) is None
    for i, member in enumerate(swarm.new_members(6)):
        assert apply(JoinRun(EXAMPLE.run_id, Role.Trainer if i == 5 else Role.Worker), member) is None

    due = {Phase.WaitingForMembers: 0, Phase.Warmup: CONFIG.warmup_time, Phase.RoundWitness: CONFIG.round_witness_time}
    for expected in (Phase.Warmup, Phase.RoundTrain, Phase.RoundTrain):
        if swarm.state.phase == Phase.RoundTrain:  # round 0: its witnesses prove, so a tick will start round 1
            assert swarm.prove(swarm.clients()).count(None) >= CONFIG.witness_quorum
        swarm.replay.chain.set_clock(swarm.replay.now + due[swarm.state.phase])
        offered = elections_on_offer(swarm, ticker)
        assert len(offered) == 1, f"a ticker could choose among {len(offered)} elections"
        assert swarm.replay.apply(Tick(), ticker) is None and swarm.state.phase == expected
        assert offered == {(swarm.state.round.seed, tuple(derived.witnesses(swarm.state)))}
