"""Who may act: the checks an operation makes of the client that signed it, shared by every rule a client sends."""

from __future__ import annotations

from coordinator_program.spec.derived import elected
from coordinator_program.spec.errors import NotAClient, NotAWitness, NotHealthy
from coordinator_program.spec.state import CoordinatorState, Health


def healthy_client(state: CoordinatorState, signer: bytes) -> int:
    """The index of ``signer`` among the epoch's clients; refused unless it is one and not leaving."""
    index = state.client_index(signer)
    if index is None:
        raise NotAClient("the signer is not a client of the current epoch")
    if state.clients[index].health != Health.Healthy:
        raise NotHealthy("the signer is leaving the epoch and may not act in it")
    return index


def elected_position(state: CoordinatorState, index: int) -> int:
    """Where client ``index`` stands in the current round's election (its witness slot); ``NotAWitness`` if nowhere."""
    slots = elected(state)
    if index not in slots:
        raise NotAWitness("the signer was not elected to witness this round")
    return slots.index(index)
