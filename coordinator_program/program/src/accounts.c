/* accounts.c: the checks only the chain needs, on every account an instruction takes. The specification
 * authenticates its callers through the backend; here each account's owner, size, discriminator, signer
 * and writable flags, and the instance's link to the coordinator account, are verified first, and a
 * failure is a builtin program error that changes nothing. */
#include "coordinator.h"

uint64_t psy_check_coordinator_account(const psy_account_t *a, const psy_pubkey_t *program_id) {
  if (!psy_pubkey_eq(a->owner, program_id)) {
    return PSY_ERROR_INVALID_ACCOUNT_OWNER;
  }
  if (!a->is_writable) {
    return PSY_ERROR_IMMUTABLE;
  }
  return a->data_len == PSY_ACCOUNT_SIZE ? PSY_SUCCESS : PSY_ERROR_INVALID_ACCOUNT_DATA;
}

/* The instance PDA: this program's, an instance, naming this coordinator account, and at the address
 * its own run id and bump derive. */
static uint64_t check_instance(const psy_account_t *instance, const psy_account_t *coordinator,
                               const psy_pubkey_t *program_id) {
  const uint8_t *data = instance->data;
  if (!psy_pubkey_eq(instance->owner, program_id)) {
    return PSY_ERROR_INVALID_ACCOUNT_OWNER;
  }
  if (instance->data_len != PSY_INSTANCE_SIZE || psy_load_u64(data) != PSY_INSTANCE_DISCRIMINATOR ||
      !psy_key_eq(data + PSY_INSTANCE_COORDINATOR_ACCOUNT_OFFSET, coordinator->key->bytes)) {
    return PSY_ERROR_INVALID_ACCOUNT_DATA;
  }
  const uint8_t *run_id = data + PSY_INSTANCE_RUN_ID_OFFSET;
  psy_bytes_t seeds[3] = {
      {(const uint8_t *)PSY_INSTANCE_SEED, sizeof(PSY_INSTANCE_SEED) - 1},
      {run_id, psy_text_len(run_id, PSY_INSTANCE_RUN_ID_SIZE)},
      {data + PSY_INSTANCE_BUMP_OFFSET, PSY_INSTANCE_BUMP_SIZE},
  };
  psy_pubkey_t derived;
  if (sol_create_program_address(seeds, 3, program_id, &derived) != PSY_SUCCESS ||
      !psy_pubkey_eq(&derived, instance->key)) {
    return PSY_ERROR_INVALID_SEEDS;
  }
  return PSY_SUCCESS;
}

uint64_t psy_bind_accounts(const psy_input_t *in, psy_op_t *op) {
  /* [signer, authorizer (join_run), instance (update, set_paused, join_run, close_run), coordinator account] */
  uint64_t signers = op->kind == PSY_OP_JOIN_RUN ? 2 : 1;
  bool closing = op->kind == PSY_OP_CLOSE_RUN;
  bool with_instance =
      op->kind == PSY_OP_UPDATE || op->kind == PSY_OP_SET_PAUSED || op->kind == PSY_OP_JOIN_RUN || closing;
  uint64_t needed = signers + (with_instance ? 1 : 0) + 1;
  if (in->total_accounts < needed) {
    return PSY_ERROR_NOT_ENOUGH_ACCOUNT_KEYS;
  }
  for (uint64_t i = 0; i < signers; i++) {
    if (!in->accounts[i].is_signer) {
      return PSY_ERROR_MISSING_REQUIRED_SIGNATURES;
    }
  }
  if (closing && (!in->accounts[0].is_writable || !in->accounts[1].is_writable)) {
    return PSY_ERROR_IMMUTABLE; /* the authority receives the lamports the instance gives up */
  }
  const psy_account_t *coordinator = &in->accounts[needed - 1];
  uint64_t err = psy_check_coordinator_account(coordinator, in->program_id);
  if (err != PSY_SUCCESS) {
    return err;
  }
  if (psy_load_u64(coordinator->data) != PSY_ACCOUNT_DISCRIMINATOR) {
    return PSY_ERROR_INVALID_ACCOUNT_DATA;
  }
  if (with_instance) {
    err = check_instance(&in->accounts[signers], coordinator, in->program_id);
    if (err != PSY_SUCCESS) {
      return err;
    }
  }
  op->state = coordinator->data;
  op->accounts = in->accounts;
  op->signer = in->accounts[0].key->bytes;
  op->authorizer = in->accounts[signers - 1].key->bytes;
  return PSY_SUCCESS;
}
