"""The Solana JSON-RPC methods of the local chain, with a validator's parameters, result shapes and errors.

These are the methods solana-py's ``AsyncClient`` and anchorpy call to send transactions and read accounts,
so the same client code runs against this chain and against a cluster. Results follow the validator's JSON:
``{"context": {"slot"}, "value"}`` wrappers, accounts as ``{"data": [text, encoding], ...}``, transaction
errors in their serde form (``{"InstructionError": [0, {"Custom": 6001}]}``), and the same error codes
(-32002 for a failed preflight, with the simulation as data; -32003 for bad signatures).
"""

from __future__ import annotations

import base64
import binascii
import json
from typing import Any

import based58
from solders.account import Account
from solders.hash import Hash
from solders.pubkey import Pubkey
from solders.signature import Signature
from solders.system_program import ID as SYSTEM_PROGRAM_ID
from solders.transaction import VersionedTransaction
from solders.transaction_status import (
    InstructionErrorCustom,
    TransactionErrorInstructionError,
    TransactionErrorType,
    TransactionStatus,
)

from coordinator_program.localnet.chain import LocalChain, Outcome, PreflightError, SignatureError
from coordinator_program.localnet.jsonrpc import INVALID_REQUEST, Method, RpcError, invalid_params
from coordinator_program.spec.limits import SOLANA_TX_LIMIT

SEND_TRANSACTION_PREFLIGHT_FAILURE = -32002
TRANSACTION_SIGNATURE_VERIFICATION_FAILURE = -32003
MAX_MULTIPLE_ACCOUNTS = 100
MAX_SIGNATURE_STATUSES = 256
MAX_BASE58_BYTES = 128
"""A validator refuses to base58-encode more account data than this (the encoding is quadratic)."""
MAX_ACCOUNT_SIZE = 10 * 1024 * 1024
MAX_ENCODED_TX = 1683
"""A validator's limit on an encoded transaction: 1,232 bytes in base58 (base64 needs fewer characters)."""
COMMITMENTS = ("processed", "confirmed", "finalized")
"""Every block is final at once on this chain, so all three read the same state."""
SOLANA_CORE_VERSION = "2.2.0"
"""The Agave release whose runtime LiteSVM (solders 0.26) embeds."""

# --- parameters -----------------------------------------------------------------------------------------

def positional(params: list[Any], required: int, optional: int = 1) -> list[Any]:
    """``params`` padded with None to ``required + optional`` entries, or -32602 when the count is wrong."""
    if not required <= len(params) <= required + optional:
        expected = f"{required}" if not optional else f"{required} to {required + optional}"
        raise invalid_params(f"expected {expected} parameters, got {len(params)}")
    return params + [None] * (required + optional - len(params))


def config_param(value: Any) -> dict[str, Any]:
    """The trailing configuration object, with its commitment checked (every level reads the same state)."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise invalid_params("the configuration must be an object")
    commitment = value.get("commitment")
    if commitment is not None and commitment not in COMMITMENTS:
        raise invalid_params(f"unknown commitment {commitment!r}; use one of {', '.join(COMMITMENTS)}")
    return value


def _flag(config: dict[str, Any], name: str) -> bool:
    value = config.get(name, False)
    if not isinstance(value, bool):
        raise invalid_params(f"{name} must be true or false")
    return value


def integer_param(value: Any, what: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise invalid_params(f"{what} must be an integer from {low} to {high}")
    return value


def pubkey_param(value: Any) -> Pubkey:
    try:
        return Pubkey.from_string(value)
    except (TypeError, ValueError):
        raise invalid_params(f"{value!r:.60} is not a base58 public key") from None


def _signature(value: Any) -> Signature:
    try:
        return Signature.from_string(value)
    except (TypeError, ValueError):
        raise invalid_params(f"{value!r:.100} is not a base58 signature") from None


def _blockhash(value: Any) -> Hash:
    if not isinstance(value, str):
        raise invalid_params(f"{value!r:.60} is not a base58 blockhash")
    try:
        return Hash.from_string(value)
    except Exception:  # solders raises ParseHashError, which is not a ValueError
        raise invalid_params(f"{value!r:.60} is not a base58 blockhash") from None


def _list(value: Any, what: str, limit: int) -> list[Any]:
    if not isinstance(value, list):
        raise invalid_params(f"{what} must be an array")
    if len(value) > limit:
        raise invalid_params(f"too many {what} provided; max {limit}")
    return value


def _transaction(text: Any, encoding: Any) -> VersionedTransaction:
    """Decode a wire transaction the way sendTransaction/simulateTransaction receive it (base58 by default)."""
    if not isinstance(text, str):
        raise invalid_params("the transaction must be an encoded string")
    if len(text) > MAX_ENCODED_TX:  # before decoding: base58 decoding time grows with the square of the length
        raise invalid_params(f"transaction too large: {len(text)} encoded characters (max {MAX_ENCODED_TX})")
    try:
        if encoding == "base58":
            raw = based58.b58decode(text.encode())
        elif encoding == "base64":
            raw = base64.b64decode(text, validate=True)
        else:
            raise invalid_params(f"unsupported encoding: {encoding!r}; supported encodings: base58, base64")
    except (ValueError, binascii.Error) as exc:
        raise invalid_params(f"invalid {encoding} encoding: {exc}") from None
    if len(raw) > SOLANA_TX_LIMIT:
        raise invalid_params(f"transaction too large: {len(raw)} bytes (max {SOLANA_TX_LIMIT})")
    try:
        tx = VersionedTransaction.from_bytes(raw)
        tx.sanitize()
    except Exception as exc:  # solders raises ValueError or its own SanitizeError
        raise invalid_params(f"invalid transaction: {exc}") from None
    if not tx.signatures:
        raise invalid_params("invalid transaction: it carries no signature")
    return tx


# --- results --------------------------------------------------------------------------------------------

def error_json(err: TransactionErrorType | None) -> Any:
    """A transaction error in the validator's JSON form (serialised by solders, which parses it back)."""
    return None if err is None else json.loads(TransactionStatus(0, err=err).to_json())["err"]


def describe_error(err: TransactionErrorType) -> str:
    if isinstance(err, TransactionErrorInstructionError) and isinstance(err.err, InstructionErrorCustom):
        return f"Error processing Instruction {err.index}: custom program error: {err.err.code:#x}"
    return json.dumps(error_json(err))


def encode_account(account: Account | None, config: dict[str, Any]) -> dict[str, Any] | None:
    """An account as getAccountInfo returns it; ``config`` may set ``encoding`` and ``dataSlice``."""
    if account is None:
        return None
    data = bytes(account.data)
    data_slice = config.get("dataSlice")
    if data_slice is not None:
        if not isinstance(data_slice, dict):
            raise invalid_params("dataSlice must be an object with offset and length")
        offset = integer_param(data_slice.get("offset"), "dataSlice.offset", 0, MAX_ACCOUNT_SIZE)
        length = integer_param(data_slice.get("length"), "dataSlice.length", 0, MAX_ACCOUNT_SIZE)
        data = data[offset:offset + length]
    encoding = config.get("encoding", "binary")
    if encoding in ("base64", "jsonParsed"):  # a validator falls back to base64 for data it cannot parse
        encoded: Any = [base64.b64encode(data).decode(), "base64"]
    elif encoding in ("base58", "binary"):
        if len(data) > MAX_BASE58_BYTES:
            raise RpcError(INVALID_REQUEST, f"Encoded binary (base 58) data should be less than "
                                            f"{MAX_BASE58_BYTES} bytes, please use Base64 encoding.")
        text = based58.b58encode(data).decode()
        encoded = text if encoding == "binary" else [text, "base58"]
    else:
        raise invalid_params(f"unsupported account encoding {encoding!r}; use base64 or base58")
    return {"data": encoded, "executable": account.executable, "lamports": account.lamports,
            "owner": str(account.owner), "rentEpoch": account.rent_epoch, "space": len(account.data)}


DELETED_ACCOUNT = Account(0, b"", SYSTEM_PROGRAM_ID)
"""How a validator reports, in a notification, an account that has ceased to exist."""


def _simulation(outcome: Outcome) -> dict[str, Any]:
    return {"err": error_json(outcome.err), "logs": outcome.logs, "accounts": None,
            "unitsConsumed": outcome.units, "returnData": None, "innerInstructions": None}


def _signature_failure(exc: SignatureError) -> RpcError:
    return RpcError(TRANSACTION_SIGNATURE_VERIFICATION_FAILURE, str(exc).capitalize())


def _status(outcome: Outcome) -> dict[str, Any]:
    err = error_json(outcome.err)
    return {"slot": outcome.slot, "confirmations": None, "err": err,
            "status": {"Ok": None} if err is None else {"Err": err}, "confirmationStatus": "finalized"}


class ChainMethods:
    """The HTTP methods, bound to one chain."""

    def __init__(self, chain: LocalChain) -> None:
        self.chain = chain

    def table(self) -> dict[str, Method]:
        return {
            "getAccountInfo": self.get_account_info,
            "getBalance": self.get_balance,
            "getBlockHeight": self.get_slot,
            "getHealth": lambda params: "ok",
            "getLatestBlockhash": self.get_latest_blockhash,
            "getMinimumBalanceForRentExemption": self.get_minimum_balance_for_rent_exemption,
            "getMultipleAccounts": self.get_multiple_accounts,
            "getSignatureStatuses": self.get_signature_statuses,
            "getSlot": self.get_slot,
            "getVersion": lambda params: {"solana-core": SOLANA_CORE_VERSION, "feature-set": 0},
            "isBlockhashValid": self.is_blockhash_valid,
            "requestAirdrop": self.request_airdrop,
            "sendTransaction": self.send_transaction,
            "simulateTransaction": self.simulate_transaction,
        }

    def _with_context(self, value: Any) -> dict[str, Any]:
        return {"context": {"slot": self.chain.slot}, "value": value}

    def get_account_info(self, params: list[Any]) -> Any:
        address, config = positional(params, 1)
        address, config = pubkey_param(address), config_param(config)
        return self._with_context(encode_account(self.chain.account(address), config))

    def get_multiple_accounts(self, params: list[Any]) -> Any:
        addresses, config = positional(params, 1)
        keys = [pubkey_param(a) for a in _list(addresses, "accounts", MAX_MULTIPLE_ACCOUNTS)]
        config = config_param(config)
        return self._with_context([encode_account(self.chain.account(key), config) for key in keys])

    def get_balance(self, params: list[Any]) -> Any:
        address, config = positional(params, 1)
        address, _ = pubkey_param(address), config_param(config)
        account = self.chain.account(address)
        return self._with_context(0 if account is None else account.lamports)

    def get_slot(self, params: list[Any]) -> int:
        (config,) = positional(params, 0)
        config_param(config)
        return self.chain.slot

    def get_latest_blockhash(self, params: list[Any]) -> Any:
        (config,) = positional(params, 0)
        config_param(config)
        blockhash, last_valid = self.chain.latest_blockhash
        return self._with_context({"blockhash": str(blockhash), "lastValidBlockHeight": last_valid})

    def is_blockhash_valid(self, params: list[Any]) -> Any:
        blockhash, config = positional(params, 1)
        blockhash, _ = _blockhash(blockhash), config_param(config)
        return self._with_context(self.chain.last_valid_block_height(blockhash) is not None)

    def get_minimum_balance_for_rent_exemption(self, params: list[Any]) -> int:
        size, config = positional(params, 1)
        config_param(config)
        return self.chain.rent_exempt_minimum(integer_param(size, "the account size", 0, MAX_ACCOUNT_SIZE))

    def get_signature_statuses(self, params: list[Any]) -> Any:
        signatures, config = positional(params, 1)
        signatures = [_signature(s) for s in _list(signatures, "signatures", MAX_SIGNATURE_STATUSES)]
        _flag(config_param(config), "searchTransactionHistory")
        outcomes = [self.chain.status(signature) for signature in signatures]
        return self._with_context([None if outcome is None else _status(outcome) for outcome in outcomes])

    def request_airdrop(self, params: list[Any]) -> str:
        address, lamports, config = positional(params, 2)
        address, _ = pubkey_param(address), config_param(config)
        outcome = self.chain.airdrop(address, integer_param(lamports, "lamports", 1, 2**64 - 1))
        if outcome.err is not None:
            raise RpcError(INVALID_REQUEST, f"airdrop request failed: {describe_error(outcome.err)}")
        return str(outcome.signature)

    def send_transaction(self, params: list[Any]) -> str:
        text, config = positional(params, 1)
        config = config_param(config)
        tx = _transaction(text, config.get("encoding", "base58"))
        try:
            self.chain.send(tx, preflight=not _flag(config, "skipPreflight"))
        except SignatureError as exc:
            raise _signature_failure(exc) from None
        except PreflightError as exc:
            assert exc.outcome.err is not None
            raise RpcError(SEND_TRANSACTION_PREFLIGHT_FAILURE,
                           f"Transaction simulation failed: {describe_error(exc.outcome.err)}",
                           _simulation(exc.outcome)) from None
        return str(tx.signatures[0])

    def simulate_transaction(self, params: list[Any]) -> Any:
        text, config = positional(params, 1)
        config = config_param(config)
        verify, replace = _flag(config, "sigVerify"), _flag(config, "replaceRecentBlockhash")
        if verify and replace:
            raise invalid_params("sigVerify may not be used with replaceRecentBlockhash")
        if config.get("accounts") is not None:
            raise invalid_params("returning accounts from a simulation is not supported by the local chain")
        tx = _transaction(text, config.get("encoding", "base58"))
        try:
            value = _simulation(self.chain.simulate(tx, verify_signatures=verify, replace_blockhash=replace))
        except SignatureError as exc:
            raise _signature_failure(exc) from None
        if replace:
            blockhash, last_valid = self.chain.latest_blockhash
            value["replacementBlockhash"] = {"blockhash": str(blockhash), "lastValidBlockHeight": last_valid}
        return self._with_context(value)
