"""DHT values sealed by their owner: how psyswarm stores records in hivemind's DHT, and the record validator
that every DHT node psyswarm starts enforces.

A DHT is writable by anyone, and for each (key, subkey) hivemind keeps whichever value expires last. Left
alone, a peer could hide another client's record by storing junk under its subkey with a long expiry, or
re-store the owner's own older record with a later one. So, as hivemind's ``RSASignatureValidator`` does with
RSA keys, a psyswarm subkey is its owner's ed25519 public key (64 lowercase hex characters) and the stored
value is ``{"value": <record>, "seal": <signature>}``, the owner's signature over the DHT key, the subkey,
the record and the expiration together. Every node refuses anything else under such a subkey: nobody but the
owner can write there, a record cannot be moved to another key (another run, round or stage), and its
expiration is the one its owner chose, which nobody can stretch.

The rules are deliberately independent of the clock. hivemind validates a peer's answer as one dictionary,
every subkey at once, so a clock-based rule ("expires within two hours from now") would let one record stored
at the edge of the bound make every reader whose clock runs a little slower drop the whole key, honest
records included. Lifetimes are bounded where the clock is safe: by owners (they sign their expiration) and
by readers record by record (``within_lifetime``).

hivemind's own records (averaging matchmaking, keyed by peer-id bytes) are left to hivemind. Plain values
without a subkey are refused: psyswarm stores none, and one that expires later replaces a whole dictionary.

May import: client.identity.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any

from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils import MSGPackSerializer, get_dht_time
from solders.keypair import Keypair

from client.identity import verify

log = logging.getLogger("psyswarm.sealed")

MAX_LIFETIME = 2 * 3600.0
"""The longest a reader keeps trusting a record: longer than any record psyswarm stores lives."""

_OWNER = re.compile(r"[0-9a-f]{64}")


def owner_of(keypair: Keypair) -> str:
    """The subkey under which ``keypair``'s records live: its public key in hex."""
    return bytes(keypair.pubkey()).hex()


def _seal_message(key_id: bytes, owner: str, expiration: float, value: Any) -> bytes:
    """What an owner signs: the DHT key's id, the subkey, the expiration and the record, as canonical JSON."""
    placed = ["psyswarm.sealed", key_id.hex(), owner, float(expiration), value]
    return json.dumps(placed, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def store_sealed(dht, keypair: Keypair, key: str, value: Any, expiration: float) -> bool:
    """Store ``value`` under ``key`` in ``keypair``'s own subkey, sealed; whether the DHT accepted it."""
    owner = owner_of(keypair)
    message = _seal_message(DHTID.generate(source=key).to_bytes(), owner, expiration, value)
    sealed = {"value": value, "seal": bytes(keypair.sign_message(message)).hex()}
    return bool(dht.store(key, sealed, expiration_time=expiration, subkey=owner))


def within_lifetime(expiration: float) -> bool:
    """Whether a record read from the DHT expires no later than any record psyswarm stores would."""
    return expiration <= get_dht_time() + MAX_LIFETIME


class SealValidator(RecordValidatorBase):
    """Refuses plain values and any value under an owner's subkey that its owner did not seal there."""

    def validate(self, record: DHTRecord) -> bool:
        try:
            problem = self.problem(record)
        except Exception as exc:  # noqa: BLE001 - whatever a peer sends, the answer is "refused", never a crash
            problem = f"unreadable ({type(exc).__name__})"
        if problem:
            log.debug("refused a DHT record: %s", problem)
        return not problem

    def problem(self, record: DHTRecord) -> str:
        """Why ``record`` may not be stored or read, or "" if it may."""
        subkey = MSGPackSerializer.loads(record.subkey)
        if subkey is None:
            return "a plain value (psyswarm stores every value under a subkey)"
        if not isinstance(subkey, str):
            return ""  # hivemind's own record (averaging keys its entries by peer-id bytes)
        if not _OWNER.fullmatch(subkey):
            return "a text subkey that is not an ed25519 public key"
        sealed = MSGPackSerializer.loads(record.value)
        if not isinstance(sealed, dict) or set(sealed) != {"value", "seal"} or not isinstance(sealed["seal"], str):
            return "a value that is not sealed"
        message = _seal_message(record.key, subkey, record.expiration_time, sealed["value"])
        if not verify(bytes.fromhex(subkey), message, bytes.fromhex(sealed["seal"])):
            return "a seal its subkey's owner did not make for this key and expiration"
        return ""

    def strip_value(self, record: DHTRecord) -> bytes:
        """Hand the application the record inside the seal (only called on records that validated)."""
        if not isinstance(MSGPackSerializer.loads(record.subkey), str):
            return record.value
        return MSGPackSerializer.dumps(MSGPackSerializer.loads(record.value)["value"])

    @property
    def priority(self) -> int:
        return 10  # like RSASignatureValidator: checked before any validator that reads the value

    def merge_with(self, other: RecordValidatorBase) -> bool:
        return isinstance(other, SealValidator)
