"""Everything a round's seed decides, the witnesses and the data each trainer trains on, and how seeds chain.

Both follow from the seed alone through SHA-256, so every client and the on-chain program (which has the
``sol_sha256`` syscall but no floating point) compute the same answer.

Witnesses are elected by rank, not drawn by index: each client holds a ticket, sha256(domain ‖ seed ‖ its key),
and the lowest tickets win. A ticket depends on its own client's key alone, so who else is in the run moves no
one's ticket. A draw over client indices would not do: the next round's seed is known once its witnesses have
revealed, and removing one client (a withdrawal, a health check, a withheld reveal) before that round starts shifts
every later index, so c colluders choosing whether to leave could pick among 2^c elections. By rank, a client
leaving only changes whether it is elected (and, if it was, lets in the next ticket in line). A ticket is as
unforeseeable as its seed only to a client whose key was fixed first: an epoch's first two seeds are known while its
joins are open, so its first two elections rank the clients that held their keys before (``derived.election``).
The data order ranks the same way, by a ticket of its own domain (``data_ticket``): the lowest tickets take the
first ranges and the remainder's extra samples, so a trainer leaving before a round starts moves no other trainer's
place in it either.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

WITNESS_DOMAIN = b"psyswarm:witness"
DATA_DOMAIN = b"psyswarm:data"
SEED_DOMAIN = b"psyswarm:seed"
PROGRAM_ENTROPY = 0
"""What the on-chain program mixes into each seed (``next_seed``): nothing any transaction chooses."""


NO_REVEALS = bytes(32)
"""The reveals of a round nobody opened a commitment in (``beacon``): the XOR of no secrets."""


def next_seed(previous: int, entropy: int, reveals: bytes = NO_REVEALS) -> int:
    """The seed of the round a tick starts: the first 8 bytes of sha256(domain ‖ previous ‖ entropy ‖ reveals), with
    ``previous`` and ``entropy`` as little-endian u64s and the seed read as one, where ``previous`` is the seed of the
    round before (0 before a run's first) and ``reveals`` the XOR of the secrets that round's witnesses revealed
    (``beacon``: each committed to its secret while the round trained, before anyone revealed).

    Nothing a ticker controls goes in (Psyche hashes the tick's clock and slot, which lets a ticker wait for a slot
    whose seed elects it). ``entropy`` is what the backend adds: the TCP server, the run's one trusted host, adds
    random bits; the program adds 0, because anything a transaction could offer (its clock, its slot, its accounts)
    is chosen by whoever sends it. On chain the reveals are what make the next election unforeseeable: one honest
    witness's secret, fixed by its commitment before any secret was shown, makes the seed uniform to everyone else.
    The round's proofs are deliberately not mixed in: the last witness to prove could then try filter after filter
    until one elected whom it wanted.
    """
    digest = hashlib.sha256(SEED_DOMAIN + struct.pack("<QQ", previous, entropy) + reveals).digest()
    return int.from_bytes(digest[:8], "little")


def witness_ticket(seed: int, client: bytes) -> bytes:
    """A client's standing in the round's election: sha256(domain ‖ seed as a little-endian u64 ‖ key), the lower
    the better. Keys are distinct, so tickets are (a SHA-256 collision aside) and the order has no ties."""
    return hashlib.sha256(WITNESS_DOMAIN + struct.pack("<Q", seed) + client).digest()


def elect_witnesses(seed: int, clients: Sequence[bytes], witness_nodes: int,
                    first: Sequence[bool] | None = None) -> list[int]:
    """Indices into ``clients`` of the round's witnesses: the ``witness_nodes`` lowest tickets, lowest first (a
    witness's slot is its position); where ``first`` is given, the clients it marks rank before all others
    (``derived.election``: an epoch's veterans, in its first two elections)."""
    def rank(i: int) -> tuple[bool, bytes]:
        return (first is not None and not first[i], witness_ticket(seed, clients[i]))

    return sorted(range(len(clients)), key=rank)[:witness_nodes]


def effective_quorum(witness_quorum: int, elected: int) -> int:
    """Proofs needed to settle a round: the configured quorum, capped by how many witnesses exist."""
    return min(witness_quorum, elected)


def strict_majority(witnesses: int) -> int:
    """The fewest of ``witnesses`` that outnumber the rest: the least a quorum may be, so that the honest
    majority the coordinator relies on always holds more proofs than the others together."""
    return witnesses // 2 + 1


@dataclass(frozen=True)
class Assignment:
    """A trainer's share of a round's global batch: sample indices [start, end)."""

    client: bytes
    start: int
    end: int

    @property
    def size(self) -> int:
        return self.end - self.start


def data_ticket(seed: int, client: bytes) -> bytes:
    """A trainer's place in the round's data order: sha256(domain ‖ seed as a little-endian u64 ‖ key), the lower
    the earlier. Like ``witness_ticket`` it depends on its own key alone, so who else trains moves no one's ticket;
    its own domain keeps the data order independent of the election."""
    return hashlib.sha256(DATA_DOMAIN + struct.pack("<Q", seed) + client).digest()


def assign_data(seed: int, trainers: Sequence[bytes], data_index: int, global_batch_size: int) -> list[Assignment]:
    """Split the round's samples [data_index, data_index + global_batch_size) among the trainers.

    The trainers take contiguous ranges in the order of their data tickets, lowest first; the first
    ``global_batch_size % len(trainers)`` of them take one sample more. Who gets the larger share, and which part
    of the data, thus rotates fairly from round to round. A trainer that leaves before the round starts is only taken
    out of the order, the others keeping theirs (a shuffle of trainer indices would move every later index, so m
    colluders choosing whether to leave would pick among 2^m orders).
    """
    if not trainers:
        return []
    order = sorted(trainers, key=lambda client: data_ticket(seed, client))
    base, extra = divmod(global_batch_size, len(trainers))
    out = []
    start = data_index
    for rank, client in enumerate(order):
        size = base + (1 if rank < extra else 0)
        out.append(Assignment(client, start, start + size))
        start += size
    return out
