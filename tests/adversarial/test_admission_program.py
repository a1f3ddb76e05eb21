"""Blocking a run id before its run exists, attacked on the real program in LiteSVM: anyone can send lamports to
the instance PDA ["coordinator", run_id] of a run not yet created, and a CreateAccount there would then fail for
ever. init_coordinator must create the run all the same, with the instance rent exempt, the program's, and
the same bytes the specification gives."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from solders.keypair import Keypair
from solders.system_program import TransferParams, transfer
from solders.transaction_metadata import TransactionMetadata

from coordinator_program.onchain.instance import INSTANCE_SIZE, CoordinatorInstance, encode_instance, instance_address
from coordinator_program.spec import rules
from coordinator_program.spec.instructions import InitCoordinator
from coordinator_program.spec.state import encode_state
from tests.program.coordinator_chain import LAMPORTS_PER_SIGNATURE, ProgramChain, init_instructions, key, logs

RUN_ID = "blocked.run"
AMOUNTS: dict[str, Callable[[ProgramChain], int]] = {
    "1-lamport": lambda chain: 1,
    "an-empty-accounts-rent": lambda chain: chain.svm.minimum_balance_for_rent_exemption(0),  # a lasting block
    "more-than-the-instance-needs": lambda chain: 10**9,
}


@pytest.mark.parametrize("amount", list(AMOUNTS))
def test_init_creates_the_run_on_an_instance_address_someone_funded_first(amount: str) -> None:
    chain = ProgramChain()
    sent = AMOUNTS[amount](chain)
    attacker, creator, coordinator = Keypair(), Keypair(), Keypair()
    chain.fund(attacker, creator)
    instance, bump = instance_address(chain.program_id, RUN_ID)
    sent_first = chain.send([transfer(TransferParams(from_pubkey=attacker.pubkey(), to_pubkey=instance,
                                                     lamports=sent))], [attacker])
    assert isinstance(sent_first, TransactionMetadata) and chain.lamports(instance) == sent

    rent = chain.svm.minimum_balance_for_rent_exemption(INSTANCE_SIZE)
    instructions, run = init_instructions(chain.program_id, chain.account_rent(), creator, coordinator,
                                          InitCoordinator(RUN_ID, key(creator), bytes(32)))
    before = chain.lamports(creator.pubkey())
    created = chain.send(instructions, [creator, coordinator])
    assert isinstance(created, TransactionMetadata), logs(created)

    state = rules.init_coordinator(RUN_ID, key(creator), bytes(32), chain.svm.get_clock().unix_timestamp)
    assert chain.data(run.coordinator) == encode_state(state)
    account = chain.svm.get_account(instance)
    assert account is not None and account.owner == chain.program_id
    assert bytes(account.data) == encode_instance(CoordinatorInstance(RUN_ID, bytes(run.coordinator), bump))
    assert account.lamports == max(rent, sent)  # topped up to rent exemption, and no further
    paid = before - chain.lamports(creator.pubkey()) - chain.account_rent() - 2 * LAMPORTS_PER_SIGNATURE
    assert paid == max(0, rent - sent)  # the creator pays only what the instance still lacked
