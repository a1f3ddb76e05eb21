"""The instance account: the small PDA that names a run's coordinator account on chain.

The coordinator account is too large to be created by the program (an account created through CPI grows
at most 10 KiB), so the run's creator pre-creates it and ``init_coordinator`` records its address in this
PDA, at seeds ``["coordinator", run_id]``. Anyone who knows a run id finds the run's coordinator account
through it, and the program checks the link on every instruction that passes the instance. The
authorities live in the coordinator account itself (the rules check them there), so they are not
repeated here.
"""

from __future__ import annotations

import dataclasses
import hashlib

from solders.pubkey import Pubkey

from coordinator_program.spec import limits
from coordinator_program.spec.layout import PUBKEY, U8, Field, FixedStr, LayoutError, Struct


@dataclasses.dataclass(frozen=True)
class CoordinatorInstance:
    """What the instance PDA holds: its run, the coordinator account's address and the PDA's bump."""

    run_id: str
    coordinator_account: bytes
    bump: int


INSTANCE_NAME = CoordinatorInstance.__name__
INSTANCE_DISCRIMINATOR = hashlib.sha256(f"account:{INSTANCE_NAME}".encode()).digest()[:8]
INSTANCE_SEED = b"coordinator"
"""The PDA's first seed; the second is the run id's bytes (without padding)."""

INSTANCE_LAYOUT = Struct(CoordinatorInstance, [
    Field("run_id", FixedStr(limits.RUN_ID_BYTES)),
    Field("coordinator_account", PUBKEY),
    Field("bump", U8),
], doc="PDA [\"coordinator\", run_id]: the address of the run's coordinator account.")

INSTANCE_SIZE = 8 + (INSTANCE_LAYOUT.size or 0)
"""Bytes of the instance account: Anchor's discriminator, then the fixed layout."""


def instance_address(program_id: Pubkey, run_id: str) -> tuple[Pubkey, int]:
    """The instance PDA of ``run_id`` under ``program_id``, and its bump."""
    return Pubkey.find_program_address([INSTANCE_SEED, run_id.encode()], program_id)


def encode_instance(instance: CoordinatorInstance) -> bytes:
    """The instance account's bytes, discriminator included."""
    return INSTANCE_DISCRIMINATOR + INSTANCE_LAYOUT.pack(instance)


def decode_instance(data: bytes) -> CoordinatorInstance:
    """Parse instance account bytes; anything else raises ``LayoutError``."""
    if data[:8] != INSTANCE_DISCRIMINATOR:
        raise LayoutError("not a coordinator instance account (wrong discriminator)")
    return INSTANCE_LAYOUT.unpack(data[8:])
