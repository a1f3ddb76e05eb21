"""The rounds' randomness beacon: the next round's seed comes from secrets the current round's witnesses committed to
before any of them was shown, so no one can foresee the next election and no single party can choose it.

The scheme (commit-reveal, as RANDAO): while round r trains (RoundTrain), each elected witness of r may commit to a
32-byte secret, ``seed_commitment(its key, seed of r, secret)``. The commitments close once a quorum of the
elected witnesses (a strict majority, so one of them honest) or every one still healthy has committed, or at the
latest when RoundTrain ends (``rules.commitments_closed``); from then until
the round's end begins, each committed witness reveals its secret, which must open its commitment, and the secrets
are XORed into the round's ``reveals``. The tick that starts the next round (or the next epoch's warmup) takes
``selection.next_seed(seed of r, entropy, reveals)``. A witness that committed and did not reveal by the round's end
leaves the epoch then, as unhealthy (``withholders``).

Why each part:
- The commitment binds the committer's key and the round's seed: a witness that copied another's commitment could
  otherwise reveal that one's secret after it and cancel it in the XOR; bound to its key, a copied commitment opens
  for no one else, and bound to the seed, an old commitment cannot be replayed.
- XOR is the same in every order, so the order in which reveals land chooses nothing.
- A secret chosen after others were shown could steer the seed at will: no secret is shown while a commitment can
  still be taken. A joiner, pending until the next epoch, takes no part in either.

An epoch's joiners take part the same way, once (``reveals.reveal_join``). Each join carries a commitment to a fresh
secret, ``join_commitment(its key, secret)``; the tick that admits the joiners elects no one yet
(``derived.revealing``), each admitted joiner reveals in the warmup, and once every one has revealed, or the warmup
has ended, a tick folds the secrets into the warmup's seed, removes the joiners that did not reveal and elects the
warmup's witnesses, or round 0's at the warmup's end (``reveals.close_join_reveals``). Without it the warmup's and
round 0's seeds would be known while joins are still open, and a joiner could grind keypairs until one held the
lowest tickets under them; a key is fixed when it joins, before any joiner's secret is shown, so one honest joiner's
secret makes both seeds unforeseeable to every key. A commitment binds the joiner's key, so a copied one opens for
no one else; the seed is not bound, as joiners commit before the seed they will steer is set. A join without a
commitment (all zeros) simply takes no part.

What remains: withholding. Once every other secret is shown, a committed witness still chooses between the seed with
its secret and the seed without it, two outcomes, and pays for that choice with its place in the epoch; m colluding
committers choose among 2^m. The honest reveal at once, so who waits to reveal last is a liar's choice. With no
honest committer in a round (every committed witness colluding), the colluders choose the next seed outright; the
threat model's honest majority of witnesses rules that out.
"""

from __future__ import annotations

import hashlib
import struct

SECRET_BYTES = 32
"""A witness's secret: as many bytes as the seed's hash, so that guessing it is no easier than the hash."""

COMMIT_DOMAIN = b"psyswarm:commit"
JOIN_DOMAIN = b"psyswarm:join"

NO_COMMITMENT = bytes(32)
"""A join's commitment when it commits to nothing (a veteran queued again at its epoch's end, or a joiner opting out),
and a joiner's once it has revealed: there is nothing left to open."""


def seed_commitment(client: bytes, seed: int, secret: bytes) -> bytes:
    """sha256(domain ‖ client key ‖ round seed as a little-endian u64 ‖ secret): what a witness commits to."""
    return hashlib.sha256(COMMIT_DOMAIN + client + struct.pack("<Q", seed) + secret).digest()


def join_commitment(client: bytes, secret: bytes) -> bytes:
    """sha256(domain ‖ client key ‖ secret): what a joiner commits to when it joins, and reveals in the warmup."""
    return hashlib.sha256(JOIN_DOMAIN + client + secret).digest()


def mix_reveal(reveals: bytes, secret: bytes) -> bytes:
    """The round's reveals with one more secret XORed in."""
    return bytes(a ^ b for a, b in zip(reveals, secret, strict=True))


def withholders(committed: int, revealed: int) -> list[int]:
    """Election positions of the witnesses that committed and have not revealed."""
    missing = committed & ~revealed
    return [position for position in range(missing.bit_length()) if missing >> position & 1]
