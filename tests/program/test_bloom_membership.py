"""The program's bloom membership against pybloom-live's own, through the real witness code path.

A coordinator account is written in round 0 of an epoch of 1,024 clients with one elected witness, which sends
every part of its proof carrying the same pybloom-live filter; the program tallies each part's clients (bloom.c),
so a client's presence (compute) vote must be 1 exactly when pybloom-live's ``in`` finds its participant (compute)
key. Filters are filled well past capacity, so non-members test positive too and false positives are compared,
not only true members; and a vote landing on any client outside the part sent would break the comparison.
"""

from __future__ import annotations

import io
import random
import struct

import pytest
from coordinator_chain import ProgramChain
from pybloom_live import BloomFilter
from solders.instruction import AccountMeta
from solders.instruction import Instruction as SolanaInstruction
from solders.keypair import Keypair
from solders.pubkey import Pubkey
from solders.transaction_metadata import TransactionMetadata

from coordinator_program.spec import derived, limits, rules
from coordinator_program.spec.bloom import compute_key, filter_bytes, participant_key
from coordinator_program.spec.config import Config
from coordinator_program.spec.instructions import Witness
from coordinator_program.spec.state import Client, Phase, Role, Round, decode_state, encode_state

# (slices, bits per slice, keys inserted per bit of a slice): from the smallest filters to the largest a part
# holds (slices × bits <= 3,840), at fills from about half to nearly full.
FILTERS = [(11, 7, 1.0), (11, 349, 0.7), (12, 320, 1.5), (13, 295, 2.0), (14, 274, 2.5), (15, 256, 1.2),
           (16, 240, 3.0), (16, 11, 2.0)]
TOTALS = {"positive": 0, "negative": 0, "false positive": 0}
SEED = 7


def training_state(config: Config, witness: bytes, others: list[bytes]) -> rules.CoordinatorState:
    """Round 0 of an epoch whose one elected witness is ``witness``, among ``others``: the round's stored election
    (``Round.witnesses``, which the program reads rather than ranks again) names it."""
    state = rules.init_coordinator("bloom", bytes(32), bytes(32), now=0)
    state.config = config
    state.phase = Phase.RoundTrain
    state.clients = [Client(witness, Role.Trainer, limits.NO_STAGE)] + [Client(o, Role.Worker, 0) for o in others]
    state.round = Round(height=0, seed=SEED, witnesses=[0] * limits.MAX_WITNESSES)
    assert derived.witnesses(state) == [witness]
    return state


@pytest.mark.parametrize("slices,bits,load", FILTERS, ids=[f"{s}x{b}" for s, b, _ in FILTERS])
def test_program_membership_is_pybloom_lives(slices: int, bits: int, load: float) -> None:
    rng = random.Random(slices * 100_000 + bits)
    config = Config(max_clients=limits.MAX_CLIENTS, min_clients=1, witness_nodes=1, witness_quorum=1,
                    bloom_slices=slices, bloom_bits_per_slice=bits)
    chain = ProgramChain()
    witness = Keypair.from_seed(rng.randbytes(32))
    chain.fund(witness)
    others = [rng.randbytes(32) for _ in range(limits.MAX_CLIENTS - 1)]
    # pybloom-live refuses keys past its capacity; the same bits with a larger capacity overfill it, so that
    # non-members test positive too.
    header = struct.pack(BloomFilter.FILE_FMT, 2.0 ** -slices, slices, bits, 10**6, 0)
    bloom = BloomFilter.fromfile(io.BytesIO(header + bytes(config.bloom_bytes)))
    members = [bytes(witness.pubkey())] + others[::2] + [rng.randbytes(32) for _ in range(int(load * bits))]
    for member in members:
        bloom.add(participant_key(member), skip_check=True)
    for member in others[1::4]:
        bloom.add(compute_key(member), skip_check=True)
    raw = filter_bytes(bloom)
    state = training_state(config, bytes(witness.pubkey()), others)
    coordinator = Pubkey.new_unique()
    chain.set_data(coordinator, encode_state(state))
    accounts = [AccountMeta(witness.pubkey(), True, False), AccountMeta(coordinator, False, True)]
    for part in range(limits.MAX_PARTS):
        ix = SolanaInstruction(chain.program_id, Witness(0, raw, raw, part).encode(), accounts)
        assert isinstance(chain.send([ix], [witness]), TransactionMetadata)
    after = decode_state(chain.data(coordinator))
    assert after.round.witnessed == 1, "the last part completes the proof"
    for i, client in enumerate(state.clients):
        expected = participant_key(client.id) in bloom
        assert after.presence_votes[i] == expected, client.id.hex()
        assert after.compute_votes[i] == (compute_key(client.id) in bloom), client.id.hex()
        TOTALS["positive" if expected else "negative"] += 1
        TOTALS["false positive"] += expected and client.id in others[1::2]


def test_membership_cases_cover_thousands_of_keys_and_false_positives() -> None:
    """Guard for the test above: both answers, and false positives, were compared."""
    if not TOTALS["positive"]:
        for params in FILTERS:
            test_program_membership_is_pybloom_lives(*params)
    assert TOTALS["positive"] + TOTALS["negative"] >= 2000
    assert TOTALS["negative"] >= 200 and TOTALS["false positive"] >= 200
