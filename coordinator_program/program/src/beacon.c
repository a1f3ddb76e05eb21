/* beacon.c: the next round's seed by commit-reveal among the round's witnesses (beacon.py; rules.commit_seed,
 * rules.reveal_seed, rules._withholders_leave). */
#include "coordinator.h"

#define HASH_SIZE 32

_Static_assert(PSY_ROUND_REVEALS_SIZE == HASH_SIZE && PSY_IX_REVEAL_SEED_SECRET_SIZE == HASH_SIZE &&
                   PSY_IX_COMMIT_SEED_COMMITMENT_SIZE == HASH_SIZE,
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

uint64_t psy_reveal_seed(const psy_op_t *op) {
  uint8_t *s = op->state;
  uint8_t *round = psy_current_round(s);
  uint64_t phase = PSY_ACCOUNT_PHASE_GET(s);
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
  const uint8_t *commitment = commitment_at(round, position);
  uint8_t differ = 0;
  for (uint64_t i = 0; i < HASH_SIZE; i++) {
    differ |= digest[i] ^ commitment[i];
  }
  if (differ != 0) {
    return PSY_ERR_BAD_REVEAL;
  }
  uint8_t *reveals = round + PSY_ROUND_REVEALS_OFFSET;
  for (uint64_t i = 0; i < HASH_SIZE; i++) {
    reveals[i] ^= secret[i];
  }
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
