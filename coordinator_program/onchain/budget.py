"""The compute units a client asks for with each coordinator instruction.

Solana gives an instruction 200,000 units unless its transaction asks for more (ComputeBudget's
SetComputeUnitLimit, up to 1,400,000). Every coordinator instruction stays within the default but a tick: the tick
that starts a round (or a warmup, or drops clients in one) elects its witnesses, a sha256 of every client's key
(``derived.election``), on top of crediting the ending round's last chunk; about 360,000 units at 1,024 clients
(``python -m tests.benchmarks.program_compute_units``). No other instruction ticks where a round could start
(``instructions.ticks_after``), so a tick alone carries a request.
"""

from __future__ import annotations

from coordinator_program.spec.instructions import Instruction, Tick

DEFAULT_UNITS = 200_000
"""What an instruction gets without a request."""

TICK_UNITS = 600_000
"""What a tick asks for: the costliest tick at 1,024 clients with a margin, well within Solana's 1,400,000."""


def requested_units(kind: type[Instruction]) -> int | None:
    """The compute-unit limit a transaction of ``kind`` asks for, or None where the default suffices."""
    return TICK_UNITS if kind is Tick else None
