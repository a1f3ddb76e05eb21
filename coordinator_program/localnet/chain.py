"""The ledger behind ``psyswarm localnet``: LiteSVM with the coordinator program, run like a tiny validator.

LiteSVM executes transactions but keeps none of a node's bookkeeping, so this class adds it:

- every transaction lands in a block of its own: the slot advances and a new blockhash is issued, and the
  Clock sysvar is set to wall time first, so the coordinator's timeouts and seeds follow real time;
- a blockhash stays valid for ``RECENT_BLOCKHASHES`` blocks, as on a cluster (LiteSVM alone accepts only
  the latest one, which would fail every client that fetched a blockhash just before another's transaction);
- signatures are verified here rather than inside LiteSVM, so that ``simulateTransaction`` can skip them
  when asked, as a validator's does;
- the status of each processed signature is kept for ``getSignatureStatuses``;
- listeners hear of every new block, which is how account subscriptions learn of changes.

The VM is built with the features that let the upgradeable loader deploy SBPFv0 programs, so a program can
also be deployed through loader-v3 transactions, as ``solana program deploy`` does against a cluster.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable

from solders.account import Account
from solders.clock import Clock
from solders.hash import Hash
from solders.litesvm import FeatureSet, LiteSVM
from solders.pubkey import Pubkey
from solders.signature import Signature
from solders.transaction import VersionedTransaction
from solders.transaction_metadata import FailedTransactionMetadata, TransactionMetadata
from solders.transaction_status import TransactionErrorFieldless, TransactionErrorType

from coordinator_program.onchain.program_id import PROGRAM_ID
from coordinator_program.program.build import DEFAULT_OUTPUT

RECENT_BLOCKHASHES = 150
"""Blocks a blockhash stays usable for, as on Solana clusters (the MAX_RECENT_BLOCKHASHES window)."""
MAX_STATUSES = 100_000
"""Signature statuses kept; the oldest are forgotten first, as a node's status cache forgets old slots."""
FAUCET_LAMPORTS = 10**18
"""What ``requestAirdrop`` can give away in total (a billion SOL)."""
LOADER_V3_DEPLOY_BLOCKERS = frozenset({
    Pubkey.from_string("8Cb77yHjPWe9wuWUfXeh6iszFGCDGNCoFk3tprViYHNm"),
    Pubkey.from_string("EmhbpdVtZ2hWRGFWBDjn2i3SJD8Z36z4mpMcZJEnebnP"),
})
"""Features that, when active, stop loader-v3 from deploying SBPFv0 programs (see notes/sbf-toolchain.md)."""


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What executing (or simulating) one transaction did."""

    signature: Signature
    slot: int
    err: TransactionErrorType | None
    logs: list[str]
    units: int


class SignatureError(ValueError):
    """A transaction whose signatures do not verify: a node refuses it before anything else."""


class PreflightError(Exception):
    """Simulating the transaction before sending it failed; nothing was committed."""

    def __init__(self, outcome: Outcome) -> None:
        super().__init__(f"transaction simulation failed: {outcome.err}")
        self.outcome = outcome


def _features() -> FeatureSet:
    every = FeatureSet.all_enabled()
    active = {k: v for k, v in every.active.items() if k not in LOADER_V3_DEPLOY_BLOCKERS}
    return FeatureSet(active, set(every.inactive) | LOADER_V3_DEPLOY_BLOCKERS)


def _outcome(result: TransactionMetadata | FailedTransactionMetadata, slot: int) -> Outcome:
    if isinstance(result, FailedTransactionMetadata):
        meta, err = result.meta(), result.err()
    else:
        meta, err = result, None
    return Outcome(meta.signature(), slot, err, list(meta.logs()), meta.compute_units_consumed())


class LocalChain:
    """One development chain with the committed coordinator program at the project's program id, driven from
    a single thread (the RPC server's event loop). ``clock`` gives the wall time (tests replace it)."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self.program_id = PROGRAM_ID
        self.svm = (LiteSVM.default().with_builtins(_features()).with_lamports(FAUCET_LAMPORTS).with_sysvars()
                    .with_precompiles().with_sigverify(False).with_blockhash_check(False))
        self.svm.add_program(PROGRAM_ID, DEFAULT_OUTPUT.read_bytes())
        self.genesis_time = self._now()
        self.slot = 0
        self._unix_time = self.genesis_time
        self._blockhashes: collections.OrderedDict[Hash, int] = collections.OrderedDict()
        self._statuses: collections.OrderedDict[Signature, Outcome] = collections.OrderedDict()
        self.listeners: list[Callable[[int], None]] = []
        self._set_clock(self.slot)
        self._remember_blockhash()

    # --- time and blocks ------------------------------------------------------------------------------

    def _now(self) -> int:
        return int(self.clock())

    def _set_clock(self, slot: int) -> None:
        """The Clock sysvar at ``slot`` and the current wall time (never earlier than a previous block's)."""
        self._unix_time = max(self._unix_time, self._now())
        self.svm.set_clock(Clock(slot, self.genesis_time, 0, 0, self._unix_time))

    def _remember_blockhash(self) -> None:
        self._blockhashes[self.svm.latest_blockhash()] = self.slot
        while len(self._blockhashes) > RECENT_BLOCKHASHES:
            self._blockhashes.popitem(last=False)

    def _close_block(self, outcome: Outcome) -> None:
        """After a committed transaction: remember its status, issue the next blockhash, tell the listeners."""
        self._statuses[outcome.signature] = outcome
        while len(self._statuses) > MAX_STATUSES:
            self._statuses.popitem(last=False)
        self.svm.expire_blockhash()
        self._remember_blockhash()
        for listener in self.listeners:
            listener(self.slot)

    @property
    def latest_blockhash(self) -> tuple[Hash, int]:
        """The newest blockhash and the last block height at which it is still accepted."""
        blockhash = self.svm.latest_blockhash()
        return blockhash, self.last_valid_block_height(blockhash) or 0

    def last_valid_block_height(self, blockhash: Hash) -> int | None:
        """None when ``blockhash`` is unknown or too old to be used."""
        slot = self._blockhashes.get(blockhash)
        return None if slot is None else slot + RECENT_BLOCKHASHES

    # --- transactions ---------------------------------------------------------------------------------

    def _refusal(self, tx: VersionedTransaction) -> TransactionErrorType | None:
        """Why a node refuses ``tx`` before running it: already processed, or its blockhash is unknown or old."""
        if tx.signatures[0] in self._statuses:
            return TransactionErrorFieldless.AlreadyProcessed
        if self.last_valid_block_height(tx.message.recent_blockhash) is None:
            return TransactionErrorFieldless.BlockhashNotFound
        return None

    def simulate(self, tx: VersionedTransaction, *, verify_signatures: bool = False,
                 replace_blockhash: bool = False) -> Outcome:
        """Run ``tx`` against the current state as the next block would, committing nothing. With
        ``replace_blockhash``, the transaction's blockhash (and so its identity) does not matter."""
        if verify_signatures and not all(tx.verify_with_results()):
            raise SignatureError("transaction signature verification failure")
        refusal = None if replace_blockhash else self._refusal(tx)
        if refusal is not None:
            return Outcome(tx.signatures[0], self.slot, refusal, [], 0)
        self._set_clock(self.slot + 1)
        result = self.svm.simulate_transaction(tx)  # a failure comes as FailedTransactionMetadata
        return _outcome(result if isinstance(result, FailedTransactionMetadata) else result.meta(), self.slot + 1)

    def send(self, tx: VersionedTransaction, *, preflight: bool = True) -> Outcome | None:
        """Process ``tx`` in a new block, as a validator does with sendTransaction.

        Bad signatures raise ``SignatureError``; with ``preflight``, a transaction that would fail (or that
        a node would refuse) raises ``PreflightError`` and leaves no trace. Without it, a failing transaction
        is committed with its error (and its fee), and a refused one is dropped: None.
        """
        if not all(tx.verify_with_results()):
            raise SignatureError("transaction signature verification failure")
        if preflight:
            simulated = self.simulate(tx)
            if simulated.err is not None:
                raise PreflightError(simulated)
        elif self._refusal(tx) is not None:
            return None
        self.slot += 1
        self._set_clock(self.slot)
        outcome = _outcome(self.svm.send_transaction(tx), self.slot)
        self._close_block(outcome)
        return outcome

    def airdrop(self, to: Pubkey, lamports: int) -> Outcome:
        """A transfer from the faucet, in a block of its own."""
        self.slot += 1
        self._set_clock(self.slot)
        outcome = _outcome(self.svm.airdrop(to, lamports), self.slot)
        self._close_block(outcome)
        return outcome

    def status(self, signature: Signature) -> Outcome | None:
        return self._statuses.get(signature)

    # --- accounts -------------------------------------------------------------------------------------

    def account(self, address: Pubkey) -> Account | None:
        """The account, or None when it does not exist (LiteSVM also reports emptied accounts as None)."""
        account = self.svm.get_account(address)
        return None if account is None or (account.lamports == 0 and not account.data) else account

    def rent_exempt_minimum(self, size: int) -> int:
        return self.svm.minimum_balance_for_rent_exemption(size)
