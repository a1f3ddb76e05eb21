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

/* selection.random_words: block j is sha256(domain ‖ seed_le64 ‖ j_le32), read as four LE u64 words. */
typedef struct {
  const char *domain;
  uint64_t domain_len;
  uint8_t seed[8];
  uint8_t block[4];
  uint64_t next;     /* index of the next word in the stream */
  uint8_t digest[32];
} words_t;

static uint64_t next_word(words_t *w) {
  uint64_t in_block = w->next & 3;
  if (in_block == 0) {
    psy_store_u32(w->block, (uint32_t)(w->next >> 2));
    psy_bytes_t pieces[3] = {
        {(const uint8_t *)w->domain, w->domain_len},
        {w->seed, sizeof w->seed},
        {w->block, sizeof w->block},
    };
    sol_sha256(pieces, 3, w->digest);
  }
  w->next++;
  return psy_load_u64(w->digest + 8 * in_block);
}

/* selection.uniform_below: words at or above the largest multiple of bound below 2^64 are redrawn. */
static uint64_t uniform_below(words_t *w, uint64_t bound) {
  uint64_t rejected = (0 - bound) % bound; /* 2^64 mod bound: the words past the last multiple */
  for (;;) {
    uint64_t word = next_word(w);
    if (rejected == 0 || word < 0 - rejected) {
      return word % bound;
    }
  }
}

static void start_words(words_t *w, const char *domain, uint64_t domain_len, uint64_t seed) {
  w->domain = domain;
  w->domain_len = domain_len;
  psy_store_u64(w->seed, seed);
  w->next = 0;
}

/* selection.shuffled_prefix: the first min(k, n) positions of a Fisher-Yates shuffle of 0..n-1 drawn from `w`
 * (the whole of `order` is used as scratch). */
static uint64_t shuffled_prefix(words_t *w, uint64_t n, uint64_t k, uint16_t *order) {
  for (uint64_t i = 0; i < n; i++) {
    order[i] = (uint16_t)i;
  }
  uint64_t drawn = k < n ? k : n;
  for (uint64_t i = 0; i < drawn; i++) { /* a partial Fisher-Yates shuffle */
    uint64_t j = i + uniform_below(w, n - i);
    uint16_t swap = order[i];
    order[i] = order[j];
    order[j] = swap;
  }
  return drawn;
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

void psy_data_order(uint64_t seed, uint64_t n, uint16_t *order) {
  words_t w;
  start_words(&w, PSY_DATA_DOMAIN, sizeof(PSY_DATA_DOMAIN) - 1, seed);
  shuffled_prefix(&w, n, n, order);
}
