"""Witness election and data assignment: deterministic from the seed, unbiased over many seeds; and an election that
no client's leaving can re-roll for the others."""

from __future__ import annotations

import hashlib
import struct
from collections import Counter

from hypothesis import given
from hypothesis import strategies as st

from coordinator_program.spec.selection import (
    assign_data,
    data_ticket,
    elect_witnesses,
    next_seed,
    strict_majority,
    witness_ticket,
)

# Chi-square critical values at p = 0.001 (so a correct implementation fails about once in a thousand runs,
# and the seeds below are fixed, so these tests are deterministic).
CHI2_CRIT_0001 = {9: 27.877, 15: 37.697}


def chi_square(observed: list[int], expected: float) -> float:
    return sum((o - expected) ** 2 / expected for o in observed)


def test_next_seed_hashes_the_previous_seed_the_entropy_and_the_reveals() -> None:
    reveals = bytes(range(32))
    digest = hashlib.sha256(b"psyswarm:seed" + struct.pack("<QQ", 2**64 - 1, 42) + reveals).digest()
    assert next_seed(2**64 - 1, 42, reveals) == int.from_bytes(digest[:8], "little")
    assert next_seed(2**64 - 1, 42) == next_seed(2**64 - 1, 42, bytes(32))  # no reveals: 32 zero bytes
    assert next_seed(2**64 - 1, 42) != next_seed(2**64 - 1, 42, reveals)
    assert next_seed(2**64 - 1, 43) != next_seed(2**64 - 1, 42) != next_seed(7, 42)


def test_strict_majority_outnumbers_the_rest() -> None:
    assert [strict_majority(n) for n in (1, 2, 3, 4, 5, 32)] == [1, 2, 2, 3, 3, 17]
    assert all(2 * strict_majority(n) > n >= 2 * (strict_majority(n) - 1) for n in range(1, 33))


def keys(n: int) -> list[bytes]:
    return [hashlib.sha256(b"client %d" % i).digest() for i in range(n)]


def test_election_is_deterministic_distinct_and_bounded() -> None:
    a = elect_witnesses(123, keys(50), 7)
    assert a == elect_witnesses(123, keys(50), 7)
    assert len(a) == len(set(a)) == 7 and all(0 <= i < 50 for i in a)
    assert elect_witnesses(124, keys(50), 7) != a
    assert sorted(elect_witnesses(5, keys(3), 32)) == [0, 1, 2]
    assert elect_witnesses(5, [], 4) == []


def test_the_elected_hold_the_lowest_tickets_lowest_first() -> None:
    clients = keys(40)
    elected = elect_witnesses(9, clients, 5)
    tickets = [witness_ticket(9, clients[i]) for i in elected]
    assert tickets == sorted(tickets)
    assert max(tickets) < min(witness_ticket(9, c) for i, c in enumerate(clients) if i not in elected)
    expected = hashlib.sha256(b"psyswarm:witness" + struct.pack("<Q", 9) + clients[0]).digest()
    assert witness_ticket(9, clients[0]) == expected


@given(seed=st.integers(0, 2**64 - 1), first=st.lists(st.booleans(), min_size=1, max_size=60),
       witness_nodes=st.integers(1, 32))
def test_the_clients_ranked_first_take_the_seats_before_any_other(seed: int, first: list[bool],
                                                                  witness_nodes: int) -> None:
    """An epoch's first elections rank its veterans first (``derived.election``): each is elected before any other
    client, by its ticket, and the others fill only the seats left, by theirs."""
    clients = keys(len(first))
    elected = elect_witnesses(seed, clients, witness_nodes, first)
    ranked = sorted((i for i in range(len(clients)) if first[i]), key=lambda i: witness_ticket(seed, clients[i]))
    ranked += sorted((i for i in range(len(clients)) if not first[i]), key=lambda i: witness_ticket(seed, clients[i]))
    assert elected == ranked[:witness_nodes]


@given(seed=st.integers(0, 2**64 - 1), n=st.integers(1, 80), witness_nodes=st.integers(1, 32), data=st.data())
def test_a_client_leaving_re_rolls_no_one_elses_election(seed: int, n: int, witness_nodes: int,
                                                         data: st.DataObject) -> None:
    """The attack: with the next round's seed known (its witnesses have revealed), a colluder withdraws, or is
    removed, before the round starts, so every client after it moves down an index. Each other client must keep
    its standing: the elected stay elected, in the same order; the only newcomer is the next in line, and only
    when the leaver held a seat. So c colluders choosing whether to leave choose among no other elections."""
    clients = keys(n)
    leaver = data.draw(st.integers(0, n - 1))
    before = [clients[i] for i in elect_witnesses(seed, clients, witness_nodes)]
    rest = clients[:leaver] + clients[leaver + 1:]
    after = [rest[i] for i in elect_witnesses(seed, rest, witness_nodes)]
    kept = [c for c in before if c != clients[leaver]]
    assert after[:len(kept)] == kept
    newcomers = after[len(kept):]
    if clients[leaver] in before:
        ranked = sorted(rest, key=lambda c: witness_ticket(seed, c))
        assert newcomers == ranked[len(kept):len(kept) + 1]
    else:
        assert newcomers == []


def test_election_is_unbiased_over_seeds() -> None:
    n, w, trials = 10, 3, 6000
    counts = Counter()
    first = Counter()
    for seed in range(trials):
        elected = elect_witnesses(seed, keys(n), w)
        counts.update(elected)
        first[elected[0]] += 1
    assert chi_square([counts[i] for i in range(n)], trials * w / n) < CHI2_CRIT_0001[9]
    assert chi_square([first[i] for i in range(n)], trials / n) < CHI2_CRIT_0001[9]


def test_trainers_take_their_ranges_in_the_order_of_their_data_tickets() -> None:
    trainers = keys(9)
    out = assign_data(5, trainers, 0, 40)
    tickets = [data_ticket(5, a.client) for a in out]
    assert tickets == sorted(tickets)
    assert data_ticket(5, trainers[0]) == hashlib.sha256(b"psyswarm:data" + struct.pack("<Q", 5) + trainers[0]).digest()
    assert data_ticket(5, trainers[0]) != witness_ticket(5, trainers[0])  # a domain of its own


@given(seed=st.integers(0, 2**64 - 1), n=st.integers(2, 80), batch=st.integers(0, 500), data=st.data())
def test_a_trainer_leaving_re_rolls_no_one_elses_data_order(seed: int, n: int, batch: int,
                                                             data: st.DataObject) -> None:
    """The attack: with the next round's seed known, a colluding trainer withdraws, or is removed, before the round
    starts, so every trainer after it moves down an index. The others must keep their order (a shuffle of indices
    re-rolls it), so m colluders choosing whether to leave choose among no other orders."""
    trainers = keys(n)
    leaver = data.draw(st.integers(0, n - 1))
    before = [a.client for a in assign_data(seed, trainers, 0, batch)]
    rest = trainers[:leaver] + trainers[leaver + 1:]
    after = [a.client for a in assign_data(seed, rest, 0, batch)]
    assert after == [c for c in before if c != trainers[leaver]]


def test_assignment_covers_the_batch_contiguously() -> None:
    trainers = [bytes([i]) * 32 for i in range(7)]
    out = assign_data(77, trainers, 1000, 45)
    assert sorted(a.client for a in out) == sorted(trainers)
    assert out[0].start == 1000 and out[-1].end == 1045
    assert all(x.end == y.start for x, y in zip(out, out[1:], strict=False))
    sizes = [a.size for a in out]
    assert sizes == sorted(sizes, reverse=True) and max(sizes) - min(sizes) <= 1 and sum(sizes) == 45
    assert assign_data(77, trainers, 1000, 45) == out
    assert assign_data(77, [], 0, 10) == []


def test_assignment_is_unbiased_over_seeds() -> None:
    trainers = [bytes([i]) * 32 for i in range(16)]
    trials = 4000
    first = Counter(assign_data(seed, trainers, 0, 100)[0].client for seed in range(trials))
    assert chi_square([first[t] for t in trainers], trials / 16) < CHI2_CRIT_0001[15]
