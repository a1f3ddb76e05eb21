"""One lying witness against the points ledger (issue 14), on the specification and the C program at once.

Every operation goes through ``Replay``: a real transaction to the program in LiteSVM and the same operation on the
specification, whose account bytes must stay identical. The run has three witnesses and a quorum of two; the
attacker is one of them. Its filter names a client the other two left out, present and working (compute key): that
client must earn nothing. Its filter leaves out a client the other two saw: that client must earn in full.
"""

from __future__ import annotations

import dataclasses

from coordinator_program.spec import derived
from coordinator_program.spec.instructions import Tick
from tests.program.coordinator_chain import training_swarm
from tests.spec.scenario import MODEL, SMALL

CONFIG = dataclasses.replace(SMALL, rounds_per_epoch=3, total_steps=20, global_batch_size=11)


def test_one_witness_of_three_awards_nothing_on_chain() -> None:
    """Quorum 2 of 3, on the program and the specification: the one witness naming a client the other two left
    out (present and working) gives it no points, and its proof leaving an honest client out takes none away."""
    swarm, authority = training_swarm(CONFIG, MODEL, workers=4, trainers=3)
    liar, *honest = derived.witnesses(swarm.state)
    favourite = next(c for c in swarm.clients() if c not in (liar, *honest))
    victim = next(c for c in swarm.clients() if c not in (liar, favourite))
    others = [c for c in swarm.clients() if c != favourite]
    assert swarm.prove(swarm.clients(), [liar], swarm.clients()) == [None]
    assert swarm.prove(others, honest, others) == [None, None]
    assert swarm.state.presence_votes[swarm.state.client_index(favourite)] == 1
    assert swarm.state.compute_votes[swarm.state.client_index(favourite)] == 1
    assert swarm.replay.apply(Tick(), authority, advance=CONFIG.round_witness_time) is None
    assert swarm.state.points(favourite) is None
    before = dataclasses.replace(swarm.state.points(victim))  # a copy: the ledger's entries change in place
    assert before.presence == 1 and before.compute > 0

    liar, *honest = derived.witnesses(swarm.state)
    without_victim = [c for c in swarm.clients() if c != victim]
    assert swarm.prove(without_victim, [liar], without_victim) == [None]
    assert swarm.prove(swarm.clients(), honest, swarm.clients()) == [None, None]
    assert swarm.replay.apply(Tick(), authority, advance=CONFIG.round_witness_time) is None
    after = swarm.state.points(victim)
    assert after is not None and after.presence == 2 and after.compute > before.compute
