/* points.c: the votes of rules.py (tally_part, _close_round_votes) and the points ledger of points.py
 * (round_points, award, credit_chunk).
 *
 * Each proof part adds its votes as it arrives: for every client the part covers, whether the part's participant
 * filter holds the client's participant key and its compute key. The ticks that end the round then only compare the
 * counts with the quorum and write the ledger, CREDIT_CLIENTS clients a tick, which stays sorted by id so that
 * finding an entry is a binary search. */
#include "coordinator.h"

#define POINTS_MAX 0xffffffffULL

static uint8_t *presence_votes(uint8_t *s) { return s + PSY_ACCOUNT_PRESENCE_VOTES_OFFSET; }
static uint8_t *compute_votes(uint8_t *s) { return s + PSY_ACCOUNT_COMPUTE_VOTES_OFFSET; }

void psy_tally_part(uint8_t *s, uint64_t part, const uint8_t *participant_bloom) {
  uint64_t slices = PSY_ACCOUNT_CONFIG_BLOOM_SLICES_GET(s);
  uint64_t bits = PSY_ACCOUNT_CONFIG_BLOOM_BITS_PER_SLICE_GET(s);
  uint64_t n = psy_list_count(s, &PSY_CLIENTS);
  uint64_t end = (part + 1) * PSY_PART_CLIENTS < n ? (part + 1) * PSY_PART_CLIENTS : n;
  for (uint64_t i = part * PSY_PART_CLIENTS; i < end; i++) {
    uint8_t participant[32], compute[32];
    psy_client_digests(psy_list_entry(s, &PSY_CLIENTS, i), participant, compute);
    /* A vote count never exceeds MAX_WITNESSES (32): each witness sends each part once. */
    presence_votes(s)[i] += psy_bloom_contains(participant_bloom, participant, slices, bits);
    compute_votes(s)[i] += psy_bloom_contains(participant_bloom, compute, slices, bits);
  }
}

static uint8_t *ledger_entry(uint8_t *s, uint64_t i) {
  return s + PSY_ACCOUNT_LEDGER_OFFSET + i * PSY_LEDGER_ENTRY_SIZE;
}

static uint64_t total_points(const uint8_t *entry) {
  return (uint64_t)PSY_LEDGER_ENTRY_PRESENCE_GET(entry) + PSY_LEDGER_ENTRY_COMPUTE_GET(entry);
}

static uint64_t saturated(uint64_t points) { return points < POINTS_MAX ? points : POINTS_MAX; }

/* points.fewest_points: the fewest total points, the first on ties. */
static uint64_t fewest_points(uint8_t *s, uint64_t n) {
  uint64_t best = 0;
  for (uint64_t i = 1; i < n; i++) {
    if (total_points(ledger_entry(s, i)) < total_points(ledger_entry(s, best))) {
      best = i;
    }
  }
  return best;
}

/* The first entry whose id is not below `id` (the ledger is sorted by id, compared as bytes). */
static uint64_t lower_bound(uint8_t *s, uint64_t n, const uint8_t *id) {
  uint64_t lo = 0, hi = n;
  while (lo < hi) {
    uint64_t mid = (lo + hi) / 2;
    if (psy_memcmp(ledger_entry(s, mid), id, PSY_PUBKEY_BYTES) < 0) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo;
}

/* points.award: whether it evicted an entry from a full ledger. */
static bool award(uint8_t *s, const uint8_t *id, uint64_t presence, uint64_t compute) {
  uint64_t n = PSY_ACCOUNT_NUM_LEDGER_GET(s);
  uint64_t position = lower_bound(s, n, id);
  if (position < n && psy_key_eq(ledger_entry(s, position), id)) {
    uint8_t *entry = ledger_entry(s, position);
    PSY_LEDGER_ENTRY_PRESENCE_SET(entry, saturated(PSY_LEDGER_ENTRY_PRESENCE_GET(entry) + presence));
    PSY_LEDGER_ENTRY_COMPUTE_SET(entry, saturated(PSY_LEDGER_ENTRY_COMPUTE_GET(entry) + compute));
    return false;
  }
  bool evicts = n == PSY_MAX_CLIENTS;
  if (evicts) { /* a new earner takes the place of the entry with the fewest points */
    uint64_t evicted = fewest_points(s, n);
    sol_memmove_(ledger_entry(s, evicted), ledger_entry(s, evicted + 1), (n - evicted - 1) * PSY_LEDGER_ENTRY_SIZE);
    n--;
    if (evicted < position) {
      position--;
    }
  }
  sol_memmove_(ledger_entry(s, position + 1), ledger_entry(s, position), (n - position) * PSY_LEDGER_ENTRY_SIZE);
  uint8_t *entry = ledger_entry(s, position);
  sol_memcpy_(entry, id, PSY_PUBKEY_BYTES);
  PSY_LEDGER_ENTRY_PRESENCE_SET(entry, presence);
  PSY_LEDGER_ENTRY_COMPUTE_SET(entry, compute);
  PSY_ACCOUNT_NUM_LEDGER_SET(s, n + 1);
  return evicts;
}

/* points.trainer_samples: the samples of the round's data assignment each trainer (in client order) took:
 * global_batch_size / trainers each, one more for the first global_batch_size % trainers in the round's data order
 * (the lowest data tickets: psy_larger_shares). */
static void trainer_samples(uint8_t *s, uint64_t trainers, uint32_t *samples) {
  uint64_t batch = PSY_ACCOUNT_CONFIG_GLOBAL_BATCH_SIZE_GET(s);
  uint64_t base = batch / trainers, extra = batch % trainers;
  for (uint64_t t = 0; t < trainers; t++) {
    samples[t] = (uint32_t)base;
  }
  if (extra == 0) { /* every share is the same size, whatever the order */
    return;
  }
  psy_larger_shares(s, trainers, extra, samples);
}

void psy_credit_chunk(uint8_t *s) {
  uint8_t *round = psy_current_round(s);
  uint64_t n = psy_list_count(s, &PSY_CLIENTS);
  uint64_t start = PSY_ROUND_CREDITED_GET(round);
  uint64_t quorum = psy_quorum(s);
  uint64_t batch = PSY_ACCOUNT_CONFIG_GLOBAL_BATCH_SIZE_GET(s);
  /* points.worker_samples: each stage's batch is shared among its counted workers, the remainder going to the
   * first of them in client order; and each trainer's place among the trainers, for its share of the data. */
  uint16_t sharers[PSY_MAX_STAGES] = {0};
  uint16_t first[PSY_MAX_STAGES];
  uint64_t trainers = 0, trainers_before = 0;
  for (uint64_t i = 0; i < n; i++) {
    const uint8_t *client = psy_list_entry(s, &PSY_CLIENTS, i);
    if (PSY_CLIENT_ROLE_GET(client) == PSY_ROLE_TRAINER) {
      trainers++;
      trainers_before += i < start;
    } else if (compute_votes(s)[i] >= quorum) {
      uint8_t stage = PSY_CLIENT_STAGE_GET(client); /* an admitted worker's stage is < num_stages <= 16 */
      if (sharers[stage]++ == 0) {
        first[stage] = (uint16_t)i;
      }
    }
  }
  uint32_t *samples = trainers > 0 ? psy_alloc(trainers * sizeof(uint32_t)) : NULL;
  if (trainers > 0) {
    trainer_samples(s, trainers, samples);
  }
  uint64_t end = start + PSY_CREDIT_CLIENTS < n ? start + PSY_CREDIT_CLIENTS : n;
  uint64_t trainer = trainers_before, evictions = 0, i = start;
  for (; i < end && evictions < PSY_CREDIT_EVICTIONS; i++) {
    const uint8_t *client = psy_list_entry(s, &PSY_CLIENTS, i);
    bool counted = compute_votes(s)[i] >= quorum;
    uint64_t compute = 0;
    if (PSY_CLIENT_ROLE_GET(client) == PSY_ROLE_TRAINER) {
      compute = counted ? samples[trainer] : 0;
      trainer++;
    } else if (counted) {
      uint8_t stage = PSY_CLIENT_STAGE_GET(client);
      compute = batch / sharers[stage] + (first[stage] == i ? batch % sharers[stage] : 0);
    }
    uint64_t presence = presence_votes(s)[i] >= quorum ? 1 : 0;
    if (presence != 0 || compute != 0) {
      evictions += award(s, client, presence, compute);
    }
  }
  PSY_ROUND_CREDITED_SET(round, i);
}

void psy_close_round_votes(uint8_t *s) {
  const uint8_t *round = psy_current_round(s);
  uint64_t n = psy_list_count(s, &PSY_CLIENTS);
  uint8_t *left_out = s + PSY_ACCOUNT_LEFT_OUT_OFFSET;
  /* rules.left_out_counts: the parts each part's witnesses sent, less the client's presence votes. */
  uint8_t sent[PSY_MAX_PARTS] = {0};
  for (uint64_t position = 0; position < PSY_MAX_WITNESSES; position++) {
    uint32_t mask = psy_load_u32(round + PSY_ROUND_PARTS_OFFSET + position * sizeof(uint32_t));
    for (uint64_t part = 0; part < PSY_MAX_PARTS; part++) {
      sent[part] += (mask >> part) & 1;
    }
  }
  for (uint64_t i = 0; i < n; i++) {
    left_out[i] = sent[i / PSY_PART_CLIENTS] - presence_votes(s)[i];
  }
  if (psy_witness_count(round) == 0) {
    psy_list_set_count(s, &PSY_CLIENTS, 0); /* derived.unproven: nobody can tell who is alive, so all leave */
    sol_memset_(left_out, 0, PSY_ACCOUNT_LEFT_OUT_SIZE);
  } else {
    psy_keep_healthy_clients(s);
  }
  sol_memset_(presence_votes(s), 0, PSY_ACCOUNT_PRESENCE_VOTES_SIZE);
  sol_memset_(compute_votes(s), 0, PSY_ACCOUNT_COMPUTE_VOTES_SIZE);
}
