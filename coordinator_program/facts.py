"""What a run's config and state mean for the people running it: figures and words, not rules.

``psyswarm validate-config`` prints the figures (what a run costs on chain and how reliable its witness filters
are), so a run's creator sees before launch whether a witness proof fits in one Solana transaction; the server
and the CLI describe a run's admission in words.

May import: coordinator_program.spec.
"""

from __future__ import annotations

import dataclasses

import based58
from solders.hash import Hash
from solders.instruction import AccountMeta, Instruction
from solders.message import Message
from solders.pubkey import Pubkey
from solders.transaction import Transaction

from coordinator_program.spec import limits
from coordinator_program.spec.bloom import part_count
from coordinator_program.spec.config import Config, predicted_false_positive_rate
from coordinator_program.spec.filter_sizing import filter_capacity
from coordinator_program.spec.instructions import Witness
from coordinator_program.spec.rules import NO_AUTHORITY
from coordinator_program.spec.state import ACCOUNT_SIZE


@dataclasses.dataclass(frozen=True)
class ConfigFacts:
    account_bytes: int
    bloom_bytes: int
    witness_data_bytes: int
    witness_transaction_bytes: int
    witness_parts: int
    false_positive_rate_at_capacity: float


def witness_transaction_size(config: Config) -> tuple[int, int]:
    """(instruction data bytes, whole signed transaction bytes) of one part of a witness proof at this config.

    Built as a real transaction (one signer paying, the coordinator account, the program), since that is
    what must fit in 1,232 bytes."""
    size = config.bloom_bytes
    data = Witness(0, bytes(size), bytes(size)).encode()
    signer, account, program = Pubkey.new_unique(), Pubkey.new_unique(), Pubkey.new_unique()
    ix = Instruction(program, data, [AccountMeta(signer, True, False), AccountMeta(account, False, True)])
    message = Message.new_with_blockhash([ix], signer, Hash.default())
    tx = Transaction.new_unsigned(message)
    return len(data), len(bytes(tx))


def config_facts(config: Config) -> ConfigFacts:
    data_bytes, tx_bytes = witness_transaction_size(config)
    return ConfigFacts(
        account_bytes=ACCOUNT_SIZE,
        bloom_bytes=config.bloom_bytes,
        witness_data_bytes=data_bytes,
        witness_transaction_bytes=tx_bytes,
        witness_parts=part_count(config.max_clients),
        false_positive_rate_at_capacity=predicted_false_positive_rate(config, filter_capacity(config.max_clients)),
    )


def fits_in_transaction(facts: ConfigFacts) -> bool:
    return facts.witness_transaction_bytes <= limits.SOLANA_TX_LIMIT


def admission(join_authority: bytes) -> str:
    """How a run with this join authority admits joiners, in words: "permissioned by <its base58 key>" (each
    join needs that key's countersignature) or "permissionless" (anyone may join)."""
    if join_authority == NO_AUTHORITY:
        return "permissionless"
    return f"permissioned by {based58.b58encode(join_authority).decode()}"
