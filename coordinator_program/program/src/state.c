/* state.c: the coordinator account's lists and derived facts (derived.quorum, derived.pipeline_formed and
 * derived.pipeline_complete), read and written in place in the account data. */
#include "coordinator.h"

_Static_assert(PSY_PENDING_SIZE == PSY_CLIENT_HEALTH_OFFSET, "a pending entry is a client entry up to its health");

int64_t psy_list_find(uint8_t *s, const psy_list_t *list, const uint8_t *id) {
  uint64_t n = psy_list_count(s, list);
  for (uint64_t i = 0; i < n; i++) {
    if (psy_key_eq(psy_list_entry(s, list, i), id)) {
      return (int64_t)i;
    }
  }
  return -1;
}

void psy_list_set_count(uint8_t *s, const psy_list_t *list, uint64_t count) {
  uint64_t old = psy_list_count(s, list);
  if (count < old) {
    sol_memset_(psy_list_entry(s, list, count), 0, (old - count) * list->stride);
  }
  psy_store_u16(s + list->count_offset, (uint16_t)count);
}

void psy_list_remove(uint8_t *s, const psy_list_t *list, uint64_t i) {
  uint64_t n = psy_list_count(s, list);
  if (i + 1 < n) {
    sol_memmove_(psy_list_entry(s, list, i), psy_list_entry(s, list, i + 1), (n - i - 1) * list->stride);
  }
  psy_list_set_count(s, list, n - 1);
}

uint64_t psy_witness_count(const uint8_t *round) {
  uint64_t mask = PSY_ROUND_WITNESSED_GET(round);
  uint64_t count = 0;
  while (mask != 0) {
    mask &= mask - 1;
    count++;
  }
  return count;
}

static uint64_t min_u64(uint64_t a, uint64_t b) { return a < b ? a : b; }

uint64_t psy_quorum(const uint8_t *s) {
  uint64_t elected = min_u64(PSY_ACCOUNT_CONFIG_WITNESS_NODES_GET(s), psy_load_u16(s + PSY_ACCOUNT_NUM_CLIENTS_OFFSET));
  return min_u64(PSY_ACCOUNT_CONFIG_WITNESS_QUORUM_GET(s), elected);
}

uint64_t psy_data_index(const uint8_t *s) {
  /* u32 × u32 always fits the u64 field, as it does in the specification's unbounded integers. */
  return (uint64_t)PSY_ACCOUNT_STEP_GET(s) * PSY_ACCOUNT_CONFIG_GLOBAL_BATCH_SIZE_GET(s);
}

void psy_census(uint8_t *s, const psy_list_t *list, psy_census_t *out) {
  uint64_t num_stages = PSY_ACCOUNT_CONFIG_NUM_STAGES_GET(s);
  uint64_t n = psy_list_count(s, list);
  for (uint64_t stage = 0; stage < PSY_MAX_STAGES; stage++) {
    out->workers[stage] = 0;
  }
  bool clients = list->entries_offset == PSY_CLIENTS.entries_offset; /* joiners have no health */
  out->members = 0;
  out->has_trainer = false;
  for (uint64_t i = 0; i < n; i++) {
    const uint8_t *entry = psy_list_entry(s, list, i);
    if (clients && entry[PSY_CLIENT_HEALTH_OFFSET] != PSY_HEALTH_HEALTHY) {
      continue; /* a withdrawn or unhealthy client leaves at the round's end: it holds nothing up */
    }
    out->members++;
    uint8_t stage = entry[PSY_CLIENT_STAGE_OFFSET];
    if (entry[PSY_CLIENT_ROLE_OFFSET] == PSY_ROLE_TRAINER) {
      out->has_trainer = true;
    } else if (stage < num_stages) { /* a worker still waiting for a stage is not counted */
      out->workers[stage]++;
    }
  }
}

bool psy_pipeline_formed(const uint8_t *s, const psy_census_t *census) {
  uint64_t num_stages = PSY_ACCOUNT_CONFIG_NUM_STAGES_GET(s);
  if (!census->has_trainer) {
    return false;
  }
  for (uint64_t stage = 0; stage < num_stages; stage++) {
    if (census->workers[stage] == 0) {
      return false;
    }
  }
  return true;
}

bool psy_pipeline_complete(const uint8_t *s, const psy_census_t *census) {
  return census->members >= PSY_ACCOUNT_CONFIG_MIN_CLIENTS_GET(s) && psy_pipeline_formed(s, census);
}

void psy_keep_healthy_clients(uint8_t *s) {
  uint64_t n = psy_list_count(s, &PSY_CLIENTS);
  uint8_t *left_out = s + PSY_ACCOUNT_LEFT_OUT_OFFSET;
  uint64_t kept = 0;
  for (uint64_t i = 0; i < n; i++) {
    uint8_t *client = psy_list_entry(s, &PSY_CLIENTS, i);
    if (PSY_CLIENT_HEALTH_GET(client) != PSY_HEALTH_HEALTHY) {
      continue;
    }
    if (kept != i) {
      sol_memcpy_(psy_list_entry(s, &PSY_CLIENTS, kept), client, PSY_CLIENT_SIZE);
      left_out[kept] = left_out[i];
    }
    kept++;
  }
  sol_memset_(left_out + kept, 0, n - kept);
  psy_list_set_count(s, &PSY_CLIENTS, kept);
}

uint64_t psy_requeue_clients(uint8_t *s) {
  uint64_t clients = psy_list_count(s, &PSY_CLIENTS);
  uint64_t pending = psy_list_count(s, &PSY_PENDING);
  /* join and update keep clients + pending <= max_clients <= MAX_CLIENTS, so this always fits; the check
   * only keeps a corrupted account from being written past its end. */
  if (clients + pending > PSY_MAX_CLIENTS) {
    return PSY_ERROR_INVALID_ACCOUNT_DATA;
  }
  if (pending > 0) {
    sol_memmove_(psy_list_entry(s, &PSY_PENDING, clients), psy_list_entry(s, &PSY_PENDING, 0),
                 pending * PSY_PENDING_SIZE);
  }
  for (uint64_t i = 0; i < clients; i++) {
    /* A pending entry is a client entry without its health byte. */
    sol_memcpy_(psy_list_entry(s, &PSY_PENDING, i), psy_list_entry(s, &PSY_CLIENTS, i), PSY_PENDING_SIZE);
  }
  psy_store_u16(s + PSY_ACCOUNT_NUM_PENDING_OFFSET, (uint16_t)(clients + pending));
  psy_list_set_count(s, &PSY_CLIENTS, 0);
  return PSY_SUCCESS;
}
