/* selection.c: the round seed, the witness election and the trainers' data order of selection.py and derived.py, on
 * the sol_sha256 syscall. */
#include "coordinator.h"

uint64_t psy_next_seed(uint64_t previous, const uint8_t *reveals) {
  uint8_t packed[16]; /* struct.pack("<QQ", previous, 0): the program adds no entropy (see selection.py) */
  psy_store_u64(packed, previous);
  psy_store_u64(packed + 8, 0);
  psy_bytes_t pieces[3] = {{(const uint8_t *)PSY_SEED_DOMAIN, sizeof(PSY_SEED_DOMAIN) - 1},
                           {packed, sizeof packed},
                           {reveals, PSY_ROUND_REVEALS_SIZE}};
  uint8_t digest[32];
  sol_sha256(pieces, 3, digest);
  return psy_load_u64(digest);
}

/* Tickets compare as bytes (memcmp's order): by their first 8 bytes read big-endian, then by the rest. */
static bool ticket_below(const uint8_t *a, const uint8_t *b) {
  uint64_t x = __builtin_bswap64(psy_load_u64(a)), y = __builtin_bswap64(psy_load_u64(b));
  return x != y ? x < y : psy_memcmp(a + 8, b + 8, 24) < 0;
}

/* Which clients a pass of the election ranks (selection.elect_witnesses' `first`). */
typedef enum { EVERY_CLIENT, VETERANS, JOINERS } ranked_t;

/* The election so far: the `count` elected of at most `k`, sorted by rank, with their tickets. */
typedef struct {
  uint64_t k;
  uint64_t count;
  uint8_t (*tickets)[32];
  uint16_t elected[PSY_MAX_WITNESSES];
} election_t;

/* One pass of derived.election: the lowest witness tickets (selection.witness_ticket) among the clients `ranked`
 * names, inserted into the election so far (kept sorted, lowest first) after those already there, up to its `k`.
 * One sha256 a client; a ticket beats the last elected one only rarely, so keeping the elected sorted costs little. */
static void rank_tickets(uint8_t *s, ranked_t ranked, election_t *e) {
  uint64_t n = psy_list_count(s, &PSY_CLIENTS), k = e->k;
  uint8_t (*tickets)[32] = e->tickets;
  uint16_t *elected = e->elected;
  uint64_t floor = e->count; /* an earlier pass's elected rank before every client of this one */
  uint8_t prefix[sizeof(PSY_WITNESS_DOMAIN) - 1 + 8]; /* domain ‖ seed: the part every ticket shares */
  sol_memcpy_(prefix, PSY_WITNESS_DOMAIN, sizeof(PSY_WITNESS_DOMAIN) - 1);
  psy_store_u64(prefix + sizeof(PSY_WITNESS_DOMAIN) - 1, PSY_ROUND_SEED_GET(psy_current_round(s)));
  psy_bytes_t pieces[2] = {{prefix, sizeof prefix}, {0, PSY_PUBKEY_BYTES}};
  uint64_t filled = e->count;
  for (uint64_t i = 0; i < n && k > floor; i++) {
    const uint8_t *client = psy_list_entry(s, &PSY_CLIENTS, i);
    if (ranked != EVERY_CLIENT && (PSY_CLIENT_VETERAN_GET(client) != 0) != (ranked == VETERANS)) {
      continue;
    }
    pieces[1].addr = client;
    uint8_t ticket[32];
    sol_sha256(pieces, 2, ticket);
    if (filled == k && !ticket_below(ticket, tickets[k - 1])) {
      continue;
    }
    uint64_t at = filled < k ? filled++ : k - 1; /* the last place, taken from the highest ticket when full */
    while (at > floor && ticket_below(ticket, tickets[at - 1])) {
      sol_memcpy_(tickets[at], tickets[at - 1], 32);
      elected[at] = elected[at - 1];
      at--;
    }
    sol_memcpy_(tickets[at], ticket, 32);
    elected[at] = (uint16_t)i;
  }
  e->count = filled;
}

/* derived.election: the current clients' lowest witness tickets, lowest first, written to the round's witnesses in
 * slot order with zeros past them; at height 0 (an epoch's warmup and round 0) the veterans rank first, the joiners
 * filling the seats left. */
void psy_elect(uint8_t *s) {
  uint8_t *round = psy_current_round(s);
  uint64_t n = psy_list_count(s, &PSY_CLIENTS);
  uint64_t k = PSY_ACCOUNT_CONFIG_WITNESS_NODES_GET(s);
  k = k < n ? k : n;
  election_t e = {.k = k, .count = 0, .tickets = psy_alloc(PSY_MAX_WITNESSES * 32)}; /* 1 KiB of the heap */
  if (PSY_ROUND_HEIGHT_GET(round) == 0) {
    rank_tickets(s, VETERANS, &e);
    rank_tickets(s, JOINERS, &e);
  } else {
    rank_tickets(s, EVERY_CLIENT, &e);
  }
  uint8_t *slots = round + PSY_ROUND_WITNESSES_OFFSET;
  sol_memset_(slots, 0, PSY_ROUND_WITNESSES_SIZE);
  for (uint64_t position = 0; position < e.count; position++) {
    psy_store_u16(slots + position * sizeof(uint16_t), e.elected[position]);
  }
}

/* The round's data order: the trainers' data tickets (selection.data_ticket), each kept as its first 8 bytes read
 * big-endian, so that they compare as the tickets do; two trainers whose first 8 bytes agree (never, short of some
 * 2^32 trainers) are ordered by their whole tickets. */
typedef struct {
  uint8_t *s;
  uint64_t *heads;                                 /* by trainer: the current clients that train, in client order */
  uint8_t prefix[sizeof(PSY_DATA_DOMAIN) - 1 + 8]; /* domain ‖ seed: the part every ticket shares */
  psy_bytes_t pieces[2];
} data_order_t;

static void data_ticket(data_order_t *o, const uint8_t *client, uint8_t ticket[32]) {
  o->pieces[1].addr = client;
  sol_sha256(o->pieces, 2, ticket);
}

/* The whole ticket of trainer `t`, found again by its place among the trainers. */
static void trainer_ticket(data_order_t *o, uint64_t t, uint8_t ticket[32]) {
  for (uint64_t i = 0;; i++) {
    const uint8_t *client = psy_list_entry(o->s, &PSY_CLIENTS, i);
    if (PSY_CLIENT_ROLE_GET(client) == PSY_ROLE_TRAINER && t-- == 0) {
      data_ticket(o, client, ticket);
      return;
    }
  }
}

static bool data_before(data_order_t *o, uint16_t a, uint16_t b) {
  if (o->heads[a] != o->heads[b]) {
    return o->heads[a] < o->heads[b];
  }
  uint8_t x[32], y[32];
  trainer_ticket(o, a, x);
  trainer_ticket(o, b, y);
  return psy_memcmp(x, y, 32) < 0;
}

/* Restores the heap below `at` in `heap` (of `count` trainers): each trainer comes later in the data order than
 * those below it, so the root is the latest. */
static void sift_down(data_order_t *o, uint16_t *heap, uint64_t count, uint64_t at) {
  for (;;) {
    uint64_t latest = at, left = 2 * at + 1, right = left + 1;
    if (left < count && data_before(o, heap[latest], heap[left])) {
      latest = left;
    }
    if (right < count && data_before(o, heap[latest], heap[right])) {
      latest = right;
    }
    if (latest == at) {
      return;
    }
    uint16_t swap = heap[at];
    heap[at] = heap[latest];
    heap[latest] = swap;
    at = latest;
  }
}

void psy_larger_shares(uint8_t *s, uint64_t trainers, uint64_t extra, uint32_t *samples) {
  data_order_t o = {.s = s, .heads = psy_alloc(trainers * sizeof(uint64_t))}; /* 8 KiB of the heap at 1,024 */
  sol_memcpy_(o.prefix, PSY_DATA_DOMAIN, sizeof(PSY_DATA_DOMAIN) - 1);
  psy_store_u64(o.prefix + sizeof(PSY_DATA_DOMAIN) - 1, PSY_ROUND_SEED_GET(psy_current_round(s)));
  o.pieces[0] = (psy_bytes_t){o.prefix, sizeof o.prefix};
  o.pieces[1] = (psy_bytes_t){0, PSY_PUBKEY_BYTES};
  uint64_t n = psy_list_count(s, &PSY_CLIENTS), t = 0;
  for (uint64_t i = 0; i < n; i++) {
    const uint8_t *client = psy_list_entry(s, &PSY_CLIENTS, i);
    if (PSY_CLIENT_ROLE_GET(client) == PSY_ROLE_TRAINER) {
      uint8_t ticket[32];
      data_ticket(&o, client, ticket);
      o.heads[t++] = __builtin_bswap64(psy_load_u64(ticket));
    }
  }
  /* Tickets are uniform, so one count of the trainers by their tickets' first byte finds the byte the `extra`-th
   * earliest has: every trainer with a lower first byte is among the earliest, and only those with that first
   * byte (about trainers / 256) need comparing. */
  uint16_t *by_byte = psy_alloc(256 * sizeof(uint16_t)); /* by first byte: how many tickets start with it */
  sol_memset_(by_byte, 0, 256 * sizeof(uint16_t));
  for (t = 0; t < trainers; t++) {
    by_byte[o.heads[t] >> 56]++;
  }
  uint64_t byte = 0, earlier = 0;
  while (earlier + by_byte[byte] < extra) {
    earlier += by_byte[byte++];
  }
  uint16_t *same_byte = psy_alloc(by_byte[byte] * sizeof(uint16_t)); /* the trainers whose first byte is `byte` */
  uint64_t count = 0;
  for (t = 0; t < trainers; t++) {
    uint64_t first = o.heads[t] >> 56;
    if (first < byte) {
      samples[t]++;
    } else if (first == byte) {
      same_byte[count++] = (uint16_t)t;
    }
  }
  /* The `wanted` earliest of those: a heap of the first `wanted`, each later one that comes before its root
   * replacing it; some 2 · count · log2(wanted) comparisons at most, however the tickets fall. */
  uint64_t wanted = extra - earlier;
  for (uint64_t at = wanted / 2; at-- > 0;) {
    sift_down(&o, same_byte, wanted, at);
  }
  for (uint64_t i = wanted; i < count; i++) {
    if (data_before(&o, same_byte[i], same_byte[0])) {
      same_byte[0] = same_byte[i];
      sift_down(&o, same_byte, wanted, 0);
    }
  }
  for (uint64_t i = 0; i < wanted; i++) {
    samples[same_byte[i]]++;
  }
}
