/* beacon.c: the next round's seed by commit-reveal among the round's witnesses, and the warmup's by the joiners'
 * reveals (beacon.py; reveals.py: commit_seed, reveal_seed, reveal_join, join_reveals_over, close_join_reveals,
 * withholders_leave). */
#include "coordinator.h"

#define HASH_SIZE 32

_Static_assert(PSY_ROUND_REVEALS_SIZE == HASH_SIZE && PSY_IX_REVEAL_SEED_SECRET_SIZE == HASH_SIZE &&
                   PSY_IX_COMMIT_SEED_COMMITMENT_SIZE == HASH_SIZE && PSY_CLIENT_COMMITMENT_SIZE == HASH_SIZE &&
                   PSY_IX_JOIN_RUN_COMMITMENT_SIZE == HASH_SIZE,
               "commitments, secrets and the reveals are 32 bytes");

static bool commitments_closed_in_training(uint8_t *s);

static uint8_t *commitment_at(uint8_t *round, uint64_t position) {
  return round + PSY_ROUND_COMMITMENTS_OFFSET + position * HASH_SIZE;
}

/* The checks commit_seed and reveal_seed share, after their phase: a healthy client, the current round, elected. */
static uint64_t witness_of_round(const psy_op_t *op, uint64_t height_offset, uint64_t *position) {
  uint8_t *s = op->state;
  uint64_t index;
  uint64_t err = psy_healthy_client(s, op->signer, &index);
  if (err != PSY_SUCCESS) {
    return err;
  }
  if (psy_load_u32(op->data + height_offset) != PSY_ROUND_HEIGHT_GET(psy_current_round(s))) {
    return PSY_ERR_STALE_ROUND;
  }
  return psy_witness_position(s, index, position);
}

uint64_t psy_commit_seed(const psy_op_t *op) {
  uint8_t *s = op->state;
  if (PSY_ACCOUNT_PHASE_GET(s) != PSY_PHASE_ROUND_TRAIN) {
    return PSY_ERR_WRONG_PHASE;
  }
  uint64_t position;
  uint64_t err = witness_of_round(op, PSY_IX_COMMIT_SEED_ROUND_HEIGHT_OFFSET, &position);
  if (err != PSY_SUCCESS) {
    return err;
  }
  uint8_t *round = psy_current_round(s);
  uint32_t committed = PSY_ROUND_COMMITTED_GET(round);
  if ((committed >> position) & 1) {
    return PSY_ERR_ALREADY_COMMITTED;
  }
  if (commitments_closed_in_training(s)) {
    return PSY_ERR_WRONG_PHASE; /* secrets may be shown now: a commitment chosen after them would steer the seed */
  }
  sol_memcpy_(commitment_at(round, position), op->data + PSY_IX_COMMIT_SEED_COMMITMENT_OFFSET, HASH_SIZE);
  PSY_ROUND_COMMITTED_SET(round, committed | (1u << position));
  psy_bump_nonce(s);
  return PSY_SUCCESS;
}

/* beacon.seed_commitment: sha256(domain ‖ client key ‖ seed_le64 ‖ secret). */
static void seed_commitment(const uint8_t *client, uint64_t seed, const uint8_t *secret, uint8_t digest[HASH_SIZE]) {
  uint8_t packed[8];
  psy_store_u64(packed, seed);
  psy_bytes_t pieces[4] = {{(const uint8_t *)PSY_COMMIT_DOMAIN, sizeof(PSY_COMMIT_DOMAIN) - 1},
                           {client, 32},
                           {packed, sizeof packed},
                           {secret, HASH_SIZE}};
  sol_sha256(pieces, 4, digest);
}

/* rules.commitments_closed, in RoundTrain: a quorum of the witnesses, or every one still healthy, has committed. */
static bool commitments_closed_in_training(uint8_t *s) {
  uint32_t committed = PSY_ROUND_COMMITTED_GET(psy_current_round(s));
  uint64_t count = 0;
  for (uint32_t bits = committed; bits != 0; bits &= bits - 1) {
    count++;
  }
  if (count >= psy_quorum(s)) {
    return true;
  }
  uint64_t elected = psy_elected_count(s);
  for (uint64_t position = 0; position < elected; position++) {
    const uint8_t *client = psy_list_entry(s, &PSY_CLIENTS, psy_elected_client(s, position));
    if (!((committed >> position) & 1) && PSY_CLIENT_HEALTH_GET(client) == PSY_HEALTH_HEALTHY) {
      return false;
    }
  }
  return true;
}

static bool same_hash(const uint8_t *a, const uint8_t *b) {
  uint8_t differ = 0;
  for (uint64_t i = 0; i < HASH_SIZE; i++) {
    differ |= a[i] ^ b[i];
  }
  return differ == 0;
}

static void mix_reveal(uint8_t *round, const uint8_t *secret) {
  uint8_t *reveals = round + PSY_ROUND_REVEALS_OFFSET;
  for (uint64_t i = 0; i < HASH_SIZE; i++) {
    reveals[i] ^= secret[i];
  }
}

/* beacon.join_commitment: sha256(domain ‖ client key ‖ secret). */
static void join_commitment(const uint8_t *client, const uint8_t *secret, uint8_t digest[HASH_SIZE]) {
  psy_bytes_t pieces[3] = {{(const uint8_t *)PSY_JOIN_DOMAIN, sizeof(PSY_JOIN_DOMAIN) - 1},
                           {client, 32},
                           {secret, HASH_SIZE}};
  sol_sha256(pieces, 3, digest);
}

/* reveals.reveal_join: an admitted joiner opens the commitment it joined with while the warmup is revealing. */
static uint64_t reveal_join(const psy_op_t *op) {
  uint8_t *s = op->state;
  uint64_t index;
  uint64_t err = psy_healthy_client(s, op->signer, &index);
  if (err != PSY_SUCCESS) {
    return err;
  }
  uint8_t *round = psy_current_round(s);
  if (psy_load_u32(op->data + PSY_IX_REVEAL_SEED_ROUND_HEIGHT_OFFSET) != PSY_ROUND_HEIGHT_GET(round)) {
    return PSY_ERR_STALE_ROUND;
  }
  if (!psy_revealing(s)) {
    return PSY_ERR_WRONG_PHASE;
  }
  uint8_t *commitment = psy_list_entry(s, &PSY_CLIENTS, index) + PSY_CLIENT_COMMITMENT_OFFSET;
  if (psy_key_is_zero(commitment)) {
    return PSY_ERR_NO_COMMITMENT;
  }
  const uint8_t *secret = op->data + PSY_IX_REVEAL_SEED_SECRET_OFFSET;
  uint8_t digest[HASH_SIZE];
  join_commitment(op->signer, secret, digest);
  if (!same_hash(digest, commitment)) {
    return PSY_ERR_BAD_REVEAL;
  }
  mix_reveal(round, secret);
  sol_memset_(commitment, 0, HASH_SIZE);
  psy_bump_nonce(s);
  return PSY_SUCCESS;
}

bool psy_any_join_commitment(uint8_t *s) {
  for (uint64_t i = 0; i < psy_list_count(s, &PSY_CLIENTS); i++) {
    if (!psy_key_is_zero(psy_list_entry(s, &PSY_CLIENTS, i) + PSY_CLIENT_COMMITMENT_OFFSET)) {
      return true;
    }
  }
  return false;
}

bool psy_join_reveals_over(uint8_t *s, int64_t now) {
  int64_t start = (int64_t)PSY_ACCOUNT_PHASE_START_GET(s);
  uint64_t warmup = PSY_ACCOUNT_CONFIG_WARMUP_TIME_GET(s);
  if (start <= INT64_MAX - (int64_t)warmup && now >= start + (int64_t)warmup) {
    return true; /* the warmup has ended */
  }
  for (uint64_t i = 0; i < psy_list_count(s, &PSY_CLIENTS); i++) {
    const uint8_t *client = psy_list_entry(s, &PSY_CLIENTS, i);
    if (!psy_key_is_zero(client + PSY_CLIENT_COMMITMENT_OFFSET) &&
        PSY_CLIENT_HEALTH_GET(client) == PSY_HEALTH_HEALTHY) {
      return false;
    }
  }
  return true;
}

void psy_close_join_reveals(uint8_t *s) {
  for (uint64_t i = 0; i < psy_list_count(s, &PSY_CLIENTS); i++) {
    uint8_t *client = psy_list_entry(s, &PSY_CLIENTS, i);
    uint8_t *commitment = client + PSY_CLIENT_COMMITMENT_OFFSET;
    if (!psy_key_is_zero(commitment)) {
      sol_memset_(commitment, 0, HASH_SIZE);
      if (PSY_CLIENT_HEALTH_GET(client) == PSY_HEALTH_HEALTHY) {
        PSY_CLIENT_HEALTH_SET(client, PSY_HEALTH_UNHEALTHY);
      }
    }
  }
  uint8_t *round = psy_current_round(s);
  PSY_ROUND_SEED_SET(round, psy_next_seed(PSY_ROUND_SEED_GET(round), round + PSY_ROUND_REVEALS_OFFSET));
  sol_memset_(round + PSY_ROUND_REVEALS_OFFSET, 0, HASH_SIZE);
}

void psy_unelect(uint8_t *s) {
  uint8_t *slots = psy_current_round(s) + PSY_ROUND_WITNESSES_OFFSET;
  for (uint64_t position = 0; position < PSY_MAX_WITNESSES; position++) {
    psy_store_u16(slots + position * sizeof(uint16_t), PSY_UNELECTED);
  }
}

uint64_t psy_reveal_seed(const psy_op_t *op) {
  uint8_t *s = op->state;
  uint8_t *round = psy_current_round(s);
  uint64_t phase = PSY_ACCOUNT_PHASE_GET(s);
  if (phase == PSY_PHASE_WARMUP) {
    return reveal_join(op);
  }
  if ((phase != PSY_PHASE_ROUND_TRAIN && phase != PSY_PHASE_ROUND_WITNESS) || PSY_ROUND_CREDITED_GET(round) > 0) {
    return PSY_ERR_WRONG_PHASE; /* rules.closing: the round's end has begun */
  }
  uint64_t position;
  uint64_t err = witness_of_round(op, PSY_IX_REVEAL_SEED_ROUND_HEIGHT_OFFSET, &position);
  if (err != PSY_SUCCESS) {
    return err;
  }
  if (phase == PSY_PHASE_ROUND_TRAIN && !commitments_closed_in_training(s)) {
    return PSY_ERR_WRONG_PHASE; /* a commitment may still come: no secret is shown yet */
  }
  if (!((PSY_ROUND_COMMITTED_GET(round) >> position) & 1)) {
    return PSY_ERR_NO_COMMITMENT;
  }
  uint32_t revealed = PSY_ROUND_REVEALED_GET(round);
  if ((revealed >> position) & 1) {
    return PSY_ERR_ALREADY_REVEALED;
  }
  const uint8_t *secret = op->data + PSY_IX_REVEAL_SEED_SECRET_OFFSET;
  uint8_t digest[HASH_SIZE];
  seed_commitment(op->signer, PSY_ROUND_SEED_GET(round), secret, digest);
  if (!same_hash(digest, commitment_at(round, position))) {
    return PSY_ERR_BAD_REVEAL;
  }
  mix_reveal(round, secret);
  PSY_ROUND_REVEALED_SET(round, revealed | (1u << position));
  psy_bump_nonce(s);
  return PSY_SUCCESS;
}

void psy_withholders_leave(uint8_t *s) {
  uint8_t *round = psy_current_round(s);
  uint32_t missing = PSY_ROUND_COMMITTED_GET(round) & ~PSY_ROUND_REVEALED_GET(round);
  if (missing == 0) {
    return; /* the common case reads no election */
  }
  uint64_t elected = psy_elected_count(s);
  for (uint64_t position = 0; position < elected; position++) {
    uint8_t *client = psy_list_entry(s, &PSY_CLIENTS, psy_elected_client(s, position));
    if (((missing >> position) & 1) && PSY_CLIENT_HEALTH_GET(client) == PSY_HEALTH_HEALTHY) {
      PSY_CLIENT_HEALTH_SET(client, PSY_HEALTH_UNHEALTHY);
    }
  }
}
