"""The program's bloom membership against pybloom-live's own, through the real health_check code path.

A coordinator account is written with a previous round whose one witness proof is a pybloom-live filter,
and every other client is health-checked: the program answers ClientHealthy exactly when its raw-bit test
(bloom.c) finds the client's key in the filter, which must be exactly when pybloom-live's ``in`` does.
Filters are filled well past capacity, so non-members test positive too and false positives are compared,
not only true members.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
from coordinator_chain import ProgramChain, instruction_error
from solders.instruction import AccountMeta
from solders.instruction import Instruction as SolanaInstruction
from solders.keypair import Keypair
from solders.pubkey import Pubkey
from solders.transaction_metadata import TransactionMetadata
from solders.transaction_status import InstructionErrorCustom

from coordinator_program.spec import errors, limits, rules
from coordinator_program.spec.bloom import filter_bytes, filter_from_bytes, participant_key
from coordinator_program.spec.config import Config
from coordinator_program.spec.instructions import HealthCheck
from coordinator_program.spec.state import Client, Phase, Role, Round, encode_state

# (slices, bits per slice, keys inserted per bit of a slice): from the smallest filters to the largest the
# account holds (slices × bits <= 3,840), at fills from about half to nearly full.
FILTERS = [(11, 7, 1.0), (11, 349, 0.7), (12, 320, 1.5), (13, 295, 2.0), (14, 274, 2.5), (15, 256, 1.2),
           (16, 240, 3.0), (16, 11, 2.0)]
TOTALS = {"positive": 0, "negative": 0, "false positive": 0}


def judged_state(config: Config, checker: bytes, others: list[bytes], proof: bytes) -> rules.CoordinatorState:
    """Round 1 of an epoch whose round 0 received one proof, ``proof``, from witness position 0."""
    state = rules.init_coordinator("bloom", bytes(32), bytes(32), now=0)
    state.config = config
    state.phase = Phase.RoundTrain
    state.clients = [Client(checker, Role.Trainer, limits.NO_STAGE)] + [Client(o, Role.Worker, 0) for o in others]
    state.rounds[0] = Round(height=0, witnessed=1)
    state.rounds[0].participant_blooms[0] = proof.ljust(limits.MAX_BLOOM_BYTES, b"\0")
    state.rounds[1] = Round(height=1)
    state.current_round = 1
    return state


@pytest.mark.parametrize("slices,bits,load", FILTERS, ids=[f"{s}x{b}" for s, b, _ in FILTERS])
def test_program_membership_is_pybloom_lives(slices: int, bits: int, load: float) -> None:
    rng = random.Random(slices * 100_000 + bits)
    config = Config(max_clients=limits.MAX_CLIENTS, witness_nodes=1, witness_quorum=1, bloom_slices=slices,
                    bloom_bits_per_slice=bits)
    chain = ProgramChain()
    checker = Keypair.from_seed(rng.randbytes(32))
    chain.fund(checker)
    others = [rng.randbytes(32) for _ in range(limits.MAX_CLIENTS - 1)]
    # pybloom-live refuses keys past its capacity (max_clients); the same bits with a larger capacity
    # overfill it, so that non-members test positive too.
    bloom = filter_from_bytes(dataclasses.replace(config, max_clients=10**6), bytes(config.bloom_bytes))
    members = [bytes(checker.pubkey())] + others[::2] + [rng.randbytes(32) for _ in range(int(load * bits))]
    for member in members:
        bloom.add(participant_key(member), skip_check=True)
    coordinator = Pubkey.new_unique()
    chain.set_data(coordinator, encode_state(judged_state(config, bytes(checker.pubkey()), others,
                                                          filter_bytes(bloom))))
    accounts = [AccountMeta(checker.pubkey(), True, False), AccountMeta(coordinator, False, True)]
    for i, target in enumerate(others):
        result = chain.send([SolanaInstruction(chain.program_id, HealthCheck(target).encode(), accounts)], [checker])
        expected = participant_key(target) in bloom
        if expected:
            assert instruction_error(result) == InstructionErrorCustom(errors.ClientHealthy.code), target.hex()
        else:
            assert isinstance(result, TransactionMetadata), f"{target.hex()} is not in pybloom-live's filter"
        TOTALS["positive" if expected else "negative"] += 1
        TOTALS["false positive"] += expected and i % 2 == 1


def test_membership_cases_cover_thousands_of_keys_and_false_positives() -> None:
    """Guard for the test above: both answers, and false positives, were compared."""
    if not TOTALS["positive"]:
        for params in FILTERS:
            test_program_membership_is_pybloom_lives(*params)
    assert TOTALS["positive"] + TOTALS["negative"] >= 2000
    assert TOTALS["negative"] >= 200 and TOTALS["false positive"] >= 200
