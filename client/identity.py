"""Contributor identity: an ed25519 keypair stored in Solana's keypair-file format.

The same file that signs Solana transactions (``~/.config/solana/id.json``, a JSON list of 64 integers:
secret seed followed by the public key) identifies a client to the TCP server, signs DHT records and
result commitments, so a contributor has exactly one identity whichever backend a run uses.

May import: nothing outside this module.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from solders.keypair import Keypair
from solders.pubkey import Pubkey
from solders.signature import Signature

DEFAULT_KEYPAIR_PATH = Path("~/.config/solana/id.json")


class KeypairError(ValueError):
    """A keypair file is missing or malformed; the message says which file and what to do."""


def load_keypair(path: str | os.PathLike[str] = DEFAULT_KEYPAIR_PATH) -> Keypair:
    """Read a Solana keypair file, checking that its public half matches its secret half."""
    file = Path(path).expanduser()
    try:
        raw = json.loads(file.read_text())
    except FileNotFoundError:
        raise KeypairError(
            f"keypair file {file} does not exist; create one with `psyswarm keygen --outfile {file}`"
        ) from None
    except (OSError, json.JSONDecodeError) as exc:
        raise KeypairError(f"keypair file {file} is not readable JSON: {exc}") from None
    if not (isinstance(raw, list) and len(raw) == 64 and all(isinstance(b, int) and 0 <= b < 256 for b in raw)):
        raise KeypairError(f"keypair file {file} must hold a JSON list of 64 byte values (Solana's format)")
    try:
        keypair = Keypair.from_bytes(bytes(raw))
    except ValueError as exc:
        raise KeypairError(f"keypair file {file}: the public key does not match the secret key ({exc})") from None
    return keypair


def save_keypair(keypair: Keypair, path: str | os.PathLike[str], *, overwrite: bool = False) -> Path:
    """Write a keypair file readable only by its owner, refusing to replace an identity by accident."""
    file = Path(path).expanduser()
    if file.exists() and not overwrite:
        raise KeypairError(f"{file} already exists; pass --force to replace it (its identity would be lost)")
    file.parent.mkdir(parents=True, exist_ok=True)
    tmp = file.with_suffix(file.suffix + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        json.dump(list(bytes(keypair)), out)
    os.replace(tmp, file)
    return file


_HEX = re.compile(r"[0-9a-f]*")


def canonical(fields: Mapping[str, Any]) -> bytes:
    """The bytes a signature covers: ``fields`` as JSON with sorted keys and no spaces, the same on every machine.
    ``ValueError`` where they cannot be (``to_json``)."""
    return to_json(fields, sort_keys=True, separators=(",", ":"))


def to_json(value: Any, **options: Any) -> bytes:
    """``json.dumps(value, **options)`` encoded, for values that may hold what another party sent: ``ValueError``
    for anything JSON cannot hold, nesting deeper than the encoder's stack included. A peer's msgpack arrives
    up to 1,023 levels deep, past which ``json`` raises RecursionError, an error no caller refusing bad input
    expects (it would end a witness's or an averager's round instead of refusing one record)."""
    try:
        return json.dumps(value, **options).encode()
    except RecursionError:
        raise ValueError("it is nested too deeply to be JSON") from None


def from_json(data: str | bytes) -> Any:
    """``json.loads`` for text another party sent: ``ValueError`` for anything that is not JSON, nesting deeper than
    the parser's stack included (``json`` raises RecursionError there: ``to_json``)."""
    try:
        return json.loads(data)
    except RecursionError:
        raise ValueError("its JSON is nested too deeply") from None


def is_hex(value: object, nbytes: int) -> bool:
    """Whether ``value`` is ``nbytes`` bytes in lower-case hex, as keys, digests and signatures travel in records."""
    return isinstance(value, str) and len(value) == 2 * nbytes and _HEX.fullmatch(value) is not None


def verify(pubkey: bytes | Pubkey, message: bytes, signature: bytes) -> bool:
    """Check an ed25519 signature by ``pubkey`` over ``message``; malformed input is simply invalid.

    Lengths are checked here because solders panics (a BaseException) on a wrongly sized key or signature.
    """
    if isinstance(pubkey, Pubkey):
        key = pubkey
    elif len(pubkey) == 32:
        key = Pubkey.from_bytes(bytes(pubkey))
    else:
        return False
    if len(signature) != 64:
        return False
    return Signature.from_bytes(bytes(signature)).verify(key, message)
