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

/* selection.elect_witnesses' rank: a late client (a joiner, in an epoch's first two elections) after every other. */
static bool ranks_below(bool late_a, const uint8_t *a, bool late_b, const uint8_t *b) {
  return late_a != late_b ? late_b : ticket_below(a, b);
}

/* derived.election: the current clients' lowest witness tickets (selection.witness_ticket), lowest first, written to
 * the round's witnesses in slot order with zeros past them; at height 0 (an epoch's warmup and round 0) the veterans
 * rank first. One sha256 a client; a ticket beats the last elected one only rarely, so keeping the elected sorted
 * costs little. */
void psy_elect(uint8_t *s) {
  uint8_t *round = psy_current_round(s);
  uint64_t n = psy_list_count(s, &PSY_CLIENTS);
  uint64_t k = PSY_ACCOUNT_CONFIG_WITNESS_NODES_GET(s);
  k = k < n ? k : n;
  uint8_t prefix[sizeof(PSY_WITNESS_DOMAIN) - 1 + 8]; /* domain ‖ seed: the part every ticket shares */
  sol_memcpy_(prefix, PSY_WITNESS_DOMAIN, sizeof(PSY_WITNESS_DOMAIN) - 1);
  psy_store_u64(prefix + sizeof(PSY_WITNESS_DOMAIN) - 1, PSY_ROUND_SEED_GET(round));
  uint8_t (*tickets)[32] = psy_alloc(PSY_MAX_WITNESSES * 32); /* the elected's tickets, 1 KiB of the heap */
  uint16_t elected[PSY_MAX_WITNESSES];
  uint64_t count = 0;
  bool late[PSY_MAX_WITNESSES]; /* the elected's lateness, beside their tickets */
  bool first_two = PSY_ROUND_HEIGHT_GET(round) == 0;
  psy_bytes_t pieces[2] = {{prefix, sizeof prefix}, {0, PSY_PUBKEY_BYTES}};
  for (uint64_t i = 0; i < n && k > 0; i++) {
    const uint8_t *client = psy_list_entry(s, &PSY_CLIENTS, i);
    pieces[1].addr = client;
    uint8_t ticket[32];
    sol_sha256(pieces, 2, ticket);
    bool is_late = first_two && !PSY_CLIENT_VETERAN_GET(client);
    if (count == k && !ranks_below(is_late, ticket, late[k - 1], tickets[k - 1])) {
      continue;
    }
    uint64_t at = count < k ? count++ : k - 1; /* the last place, taken from the highest rank when full */
    while (at > 0 && ranks_below(is_late, ticket, late[at - 1], tickets[at - 1])) {
      sol_memcpy_(tickets[at], tickets[at - 1], 32);
      late[at] = late[at - 1];
      elected[at] = elected[at - 1];
      at--;
    }
    sol_memcpy_(tickets[at], ticket, 32);
    late[at] = is_late;
    elected[at] = (uint16_t)i;
  }
  uint8_t *slots = round + PSY_ROUND_WITNESSES_OFFSET;
  sol_memset_(slots, 0, PSY_ROUND_WITNESSES_SIZE);
  for (uint64_t position = 0; position < count; position++) {
    psy_store_u16(slots + position * sizeof(uint16_t), elected[position]);
  }
}

void psy_data_order(uint64_t seed, uint64_t n, uint16_t *order) {
  words_t w;
  start_words(&w, PSY_DATA_DOMAIN, sizeof(PSY_DATA_DOMAIN) - 1, seed);
  shuffled_prefix(&w, n, n, order);
}
