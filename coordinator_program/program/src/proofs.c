/* proofs.c: what witnesses prove, part by part, and what health checks judge by (rules.witness and its tally_part,
 * warmup_witness, _record_part, missed_by_quorum, health_check). */
#include "coordinator.h"

static bool training(const uint8_t *s) {
  uint64_t phase = PSY_ACCOUNT_PHASE_GET(s);
  return phase == PSY_PHASE_ROUND_TRAIN || phase == PSY_PHASE_ROUND_WITNESS;
}

bool psy_revealing(uint8_t *s) {
  return PSY_ACCOUNT_PHASE_GET(s) == PSY_PHASE_WARMUP &&
         psy_load_u16(psy_current_round(s) + PSY_ROUND_WITNESSES_OFFSET) == PSY_UNELECTED;
}

uint64_t psy_elected_count(uint8_t *s) {
  if (psy_revealing(s)) {
    return 0;
  }
  uint64_t k = PSY_ACCOUNT_CONFIG_WITNESS_NODES_GET(s);
  uint64_t n = psy_list_count(s, &PSY_CLIENTS);
  return k < n ? k : n;
}

uint64_t psy_elected_client(uint8_t *s, uint64_t position) {
  return psy_load_u16(psy_current_round(s) + PSY_ROUND_WITNESSES_OFFSET + position * sizeof(uint16_t));
}

uint64_t psy_witness_position(uint8_t *s, uint64_t index, uint64_t *position) {
  uint64_t elected = psy_elected_count(s);
  uint64_t at = 0;
  while (at < elected && psy_elected_client(s, at) != index) {
    at++;
  }
  if (at == elected) {
    return PSY_ERR_NOT_A_WITNESS;
  }
  *position = at;
  return PSY_SUCCESS;
}

/* rules._record_part, for a signer already known to be the healthy client at `index`. */
static uint64_t record_part(const psy_op_t *op, uint64_t index) {
  uint8_t *s = op->state;
  uint8_t *round = psy_current_round(s);
  uint64_t clients = psy_list_count(s, &PSY_CLIENTS);
  uint64_t position;
  uint64_t err = psy_witness_position(s, index, &position);
  if (err != PSY_SUCCESS) {
    return err;
  }
  uint32_t witnessed = PSY_ROUND_WITNESSED_GET(round);
  if ((witnessed >> position) & 1) {
    return PSY_ERR_DUPLICATE_WITNESS;
  }
  uint64_t parts = psy_part_count(clients);
  if (op->proof.part >= parts) {
    return PSY_ERR_BAD_FILTER;
  }
  uint8_t *received = round + PSY_ROUND_PARTS_OFFSET + position * sizeof(uint32_t);
  uint32_t mask = psy_load_u32(received);
  if ((mask >> op->proof.part) & 1) {
    return PSY_ERR_DUPLICATE_WITNESS;
  }
  uint64_t size = psy_bloom_bytes(s + PSY_ACCOUNT_CONFIG_OFFSET);
  if (op->proof.participant_len != size || op->proof.batch_len != size) {
    return PSY_ERR_BAD_FILTER;
  }
  mask |= 1u << op->proof.part;
  psy_store_u32(received, mask);
  if (mask == (uint32_t)((1ull << parts) - 1)) { /* the whole proof is in: the witness counts, once */
    PSY_ROUND_WITNESSED_SET(round, witnessed | (1u << position));
  }
  psy_bump_nonce(s);
  return PSY_SUCCESS;
}

uint64_t psy_witness(const psy_op_t *op) {
  uint8_t *s = op->state;
  if (!training(s) || PSY_ROUND_CREDITED_GET(psy_current_round(s)) > 0) { /* rules._check_open_round */
    return PSY_ERR_WRONG_PHASE;
  }
  uint64_t index;
  uint64_t err = psy_healthy_client(s, op->signer, &index);
  if (err != PSY_SUCCESS) {
    return err;
  }
  if (psy_load_u32(op->data + PSY_IX_WITNESS_ROUND_HEIGHT_OFFSET) != PSY_ROUND_HEIGHT_GET(psy_current_round(s))) {
    return PSY_ERR_STALE_ROUND;
  }
  err = record_part(op, index);
  if (err == PSY_SUCCESS) {
    psy_tally_part(s, op->proof.part, op->proof.participant);
  }
  return err;
}

uint64_t psy_warmup_witness(const psy_op_t *op) {
  uint8_t *s = op->state;
  if (PSY_ACCOUNT_PHASE_GET(s) != PSY_PHASE_WARMUP) {
    return PSY_ERR_WRONG_PHASE;
  }
  uint64_t index;
  uint64_t err = psy_healthy_client(s, op->signer, &index);
  if (err != PSY_SUCCESS) {
    return err;
  }
  return record_part(op, index);
}

uint64_t psy_health_check(const psy_op_t *op) {
  uint8_t *s = op->state;
  if (!training(s)) {
    return PSY_ERR_WRONG_PHASE;
  }
  uint64_t signer_index;
  uint64_t err = psy_healthy_client(s, op->signer, &signer_index);
  if (err != PSY_SUCCESS) {
    return err;
  }
  if (PSY_ROUND_HEIGHT_GET(psy_current_round(s)) == 0) {
    return PSY_ERR_NO_PREVIOUS_ROUND;
  }
  const uint8_t *target = op->data + PSY_IX_HEALTH_CHECK_TARGET_OFFSET;
  int64_t index = psy_list_find(s, &PSY_CLIENTS, target);
  if (index < 0) {
    return PSY_ERR_UNKNOWN_CLIENT;
  }
  uint8_t *client = psy_list_entry(s, &PSY_CLIENTS, (uint64_t)index);
  if (PSY_CLIENT_HEALTH_GET(client) != PSY_HEALTH_HEALTHY) {
    return PSY_ERR_ALREADY_MARKED;
  }
  /* rules.missed_by_quorum: unhealthy only when a quorum of the previous round's proofs of its part left it out
   * (counted as that round ended); a proof never sent leaves no one out. */
  if (s[PSY_ACCOUNT_LEFT_OUT_OFFSET + (uint64_t)index] < psy_quorum(s)) {
    return PSY_ERR_CLIENT_HEALTHY;
  }
  PSY_CLIENT_HEALTH_SET(client, PSY_HEALTH_UNHEALTHY);
  psy_bump_nonce(s);
  return PSY_SUCCESS;
}
