"""Which joins the run's join authority countersigns: a TCP ``join_authorization``, or a Solana join_run
transaction message checked to hold that one instruction and nothing else. Whether the join is the requester's
own, in the role and stage its slot was granted, is the rules' part (``rules``)."""

from __future__ import annotations

import re
from http import HTTPStatus

from solders.message import Message
from solders.pubkey import Pubkey

from coordinator_program.onchain.instance import instance_address
from coordinator_program.spec import limits
from coordinator_program.spec.errors import MalformedInstruction
from coordinator_program.spec.instructions import JoinRun, decode_instruction
from local_backend import protocol
from local_backend.auth.failures import AuthFailure, bad_request
from local_backend.auth.slots import Slot

MAX_COUNTERSIGNED_BYTES = 1232  # a Solana transaction's limit; a TCP join authorization is far smaller


def refused_join(message: str) -> AuthFailure:
    return AuthFailure(HTTPStatus.FORBIDDEN, "not_countersigned", message)


def message_bytes(text: str) -> bytes:
    """A countersign request's message: 1..``MAX_COUNTERSIGNED_BYTES`` bytes as lowercase hex."""
    if not re.fullmatch(f"(?:[0-9a-f]{{2}}){{1,{MAX_COUNTERSIGNED_BYTES}}}", text):
        raise bad_request(f"message must be 1..{MAX_COUNTERSIGNED_BYTES} bytes as lowercase hex")
    return bytes.fromhex(text)


def join_to_countersign(message: bytes, authority: Pubkey, program_id: Pubkey, run_id: str) -> tuple[bytes, JoinRun]:
    """The joiner's key and the join a message to countersign carries: a TCP ``join_authorization``, or a Solana
    join_run transaction message (``solana_join``); ``AuthFailure`` for anything else."""
    carried = protocol.split_join_authorization(message)
    joiner, instruction = carried if carried is not None else solana_join(message, authority, program_id, run_id)
    try:
        join = decode_instruction(instruction)
    except MalformedInstruction as exc:
        raise refused_join(f"the message carries no well-formed instruction: {exc.detail}") from None
    if not isinstance(join, JoinRun):
        raise refused_join(f"the join authority countersigns join_run only, not {join.NAME}")
    return joiner, join


def solana_join(message: bytes, authority: Pubkey, program_id: Pubkey, run_id: str) -> tuple[bytes, bytes]:
    """The joiner and the instruction data of a Solana join_run transaction message, checked to be nothing else.

    On Solana the authority co-signs the transaction: the client sends the message it will submit, and adds the
    returned signature with a ``Presigner``. The program already requires the authorizer to sign join_run, so it
    needs no change; the other way, an ed25519-program instruction checked through the instructions sysvar,
    would add a message format, a sysvar parser and compute units to the program for the same guarantee.
    Signing a whole transaction is what needs care: it must hold this one join_run instruction of the coordinator
    program and nothing else (no transfer from, or other use of, the authority's key), the joiner must be its
    fee payer and its only other signer, the authority read-only, and the instance the run's own PDA (the program
    checks the run id against it, and the coordinator account against the instance).
    """
    try:
        parsed = Message.from_bytes(message)
    except ValueError:
        parsed = None
    if parsed is None or bytes(parsed) != message:
        raise refused_join("the message is neither a TCP join authorization nor a Solana transaction message")
    keys, header = parsed.account_keys, parsed.header
    if len(parsed.instructions) != 1:
        raise refused_join("a countersigned transaction holds the join_run instruction and nothing else")
    (compiled,) = parsed.instructions
    indexes = [compiled.program_id_index, *compiled.accounts]
    if max(indexes) >= len(keys) or parsed.has_duplicates():
        raise refused_join("the transaction message is malformed")
    if keys[compiled.program_id_index] != program_id:
        raise refused_join(f"the instruction is not for the coordinator program {program_id}")
    accounts = [keys[i] for i in compiled.accounts]
    instance, _ = instance_address(program_id, run_id)
    if len(accounts) != 4 or accounts[1:3] != [authority, instance]:
        raise refused_join(f"join_run takes [joiner, authorizer, instance, coordinator], the authorizer being this "
                           f"join authority {authority} and the instance run {run_id}'s, {instance}")
    joiner = accounts[0]
    if keys[:header.num_required_signatures] != [joiner, authority]:
        raise refused_join("the joiner must pay for its join and be its only signer besides the join authority")
    if header.num_readonly_signed_accounts < 1:
        raise refused_join("the join authority must be a read-only account of the transaction")
    return bytes(joiner), bytes(compiled.data)


def check_join(slot: Slot, joiner: bytes, join: JoinRun, run_id: str, now: float, furthest: float) -> None:
    """A join may be countersigned for the key, run, role, stage and slot its slot was granted, with a deadline in
    the next ``furthest`` seconds, and only those; ``AuthFailure`` says which one it is not."""
    if joiner.hex() != slot.peer:
        raise refused_join(f"the join is for key {joiner.hex()[:8]}…, but this slot belongs to {slot.peer[:8]}…: "
                           "a slot admits only the key it was granted to")
    if join.run_id != run_id:
        raise refused_join(f"the join is for run {join.run_id!r}; this service admits to run {run_id!r}")
    if join.role.name.lower() != slot.role:
        raise refused_join(f"the join is as a {join.role.name.lower()}; the slot was granted for a {slot.role}")
    stage = slot.stage if slot.role == "worker" else limits.NO_STAGE
    if join.stage != stage:
        raise refused_join(f"the join asks for stage {join.stage}; the slot was granted stage {slot.stage}")
    if join.slot != slot.index:
        raise refused_join(f"the join names slot {join.slot}; this peer holds slot {slot.index}")
    if not now < join.valid_until <= now + furthest:
        raise refused_join(f"the join's deadline must lie within the next {furthest:.0f} s (now {now:.0f}, the join "
                           f"says {join.valid_until})")
