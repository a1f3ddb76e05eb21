/* rules.c: the administrative and membership operations of rules.py (update, set_paused, close_run, join,
 * withdraw, release_slot, checkpoint), each checking in the specification's order before it writes anything. */
#include "coordinator.h"

static uint64_t phase_of(const uint8_t *s) { return PSY_ACCOUNT_PHASE_GET(s); }

uint64_t psy_update(const psy_op_t *op) {
  uint8_t *s = op->state;
  if (!psy_key_eq(op->signer, s + PSY_ACCOUNT_MAIN_AUTHORITY_OFFSET)) {
    return PSY_ERR_NOT_AUTHORIZED;
  }
  uint64_t phase = phase_of(s);
  if (phase != PSY_PHASE_UNINITIALIZED && phase != PSY_PHASE_PAUSED) {
    return PSY_ERR_NOT_HALTED;
  }
  const uint8_t *config = op->data + PSY_IX_UPDATE_CONFIG_OFFSET;
  const uint8_t *model = op->data + PSY_IX_UPDATE_MODEL_OFFSET;
  const uint8_t *checkpoint = op->data + PSY_IX_UPDATE_CHECKPOINT_OFFSET;
  uint64_t err = psy_validate_config(config);
  if (err == PSY_SUCCESS) {
    err = psy_validate_model(model, config);
  }
  if (err == PSY_SUCCESS) {
    err = psy_validate_checkpoint(checkpoint);
  }
  if (err != PSY_SUCCESS) {
    return err;
  }
  uint64_t pending = psy_list_count(s, &PSY_PENDING);
  if (pending > PSY_CONFIG_MAX_CLIENTS_GET(config)) {
    return PSY_ERR_INVALID_CONFIG; /* more joiners already pending than the new config admits */
  }
  for (uint64_t i = 0; i < pending; i++) {
    uint8_t stage = PSY_PENDING_STAGE_GET(psy_list_entry(s, &PSY_PENDING, i));
    if (stage != PSY_NO_STAGE && stage >= PSY_CONFIG_NUM_STAGES_GET(config)) {
      return PSY_ERR_INVALID_CONFIG; /* a pending worker holds a stage the new config drops */
    }
  }
  sol_memcpy_(s + PSY_ACCOUNT_CONFIG_OFFSET, config, PSY_CONFIG_SIZE);
  sol_memcpy_(s + PSY_ACCOUNT_MODEL_OFFSET, model, PSY_MODEL_SIZE);
  uint8_t *places = s + PSY_ACCOUNT_CHECKPOINTS_OFFSET; /* the starting place of every stage, fresh beyond them */
  sol_memset_(places, 0, PSY_ACCOUNT_CHECKPOINTS_SIZE);
  for (uint64_t stage = 0; stage < PSY_CONFIG_NUM_STAGES_GET(config); stage++) {
    sol_memcpy_(places + stage * PSY_CHECKPOINT_SIZE, checkpoint, PSY_CHECKPOINT_SIZE);
  }
  if (phase == PSY_PHASE_UNINITIALIZED) {
    PSY_ACCOUNT_PHASE_SET(s, PSY_PHASE_PAUSED);
  }
  psy_bump_nonce(s);
  return PSY_SUCCESS;
}

uint64_t psy_set_paused(const psy_op_t *op) {
  uint8_t *s = op->state;
  if (!psy_key_eq(op->signer, s + PSY_ACCOUNT_MAIN_AUTHORITY_OFFSET)) {
    return PSY_ERR_NOT_AUTHORIZED;
  }
  if (phase_of(s) == PSY_PHASE_UNINITIALIZED) {
    return PSY_ERR_NOT_INITIALIZED;
  }
  if (phase_of(s) == PSY_PHASE_FINISHED) {
    return PSY_ERR_RUN_FINISHED;
  }
  PSY_ACCOUNT_PAUSE_REQUESTED_SET(s, op->data[PSY_IX_SET_PAUSED_PAUSED_OFFSET]);
  psy_bump_nonce(s);
  return PSY_SUCCESS;
}

/* Gives `account`'s lamports to `to` and leaves it as an account that never existed: no lamports, no data,
 * owned by the system program. A validator purges an account with no lamports when the transaction ends,
 * but a VM that keeps it (LiteSVM) would otherwise still show it owned by this program, and the system
 * program would refuse to create the instance PDA of the same run id again. The data is zeroed before it
 * is shrunk, so nothing later in the transaction reads it as a run either way. Writing the serialized
 * length (the u64 just before the data) is how a program resizes an account; the runtime accepts the
 * new owner because the account is this program's, writable and now empty. */
static void close_account(psy_account_t *account, psy_account_t *to) {
  uint64_t lamports = *account->lamports;
  sol_memset_(account->data, 0, account->data_len);
  psy_store_u64(account->data - sizeof(uint64_t), 0);
  account->data_len = 0;
  *account->owner = (psy_pubkey_t){{0}};
  *account->lamports = 0;
  *to->lamports += lamports; /* read before the zeroing, so an authority closing itself keeps them */
}

uint64_t psy_close_run(const psy_op_t *op) {
  uint8_t *s = op->state;
  if (!psy_key_eq(op->signer, s + PSY_ACCOUNT_MAIN_AUTHORITY_OFFSET)) {
    return PSY_ERR_NOT_AUTHORIZED;
  }
  uint64_t phase = phase_of(s);
  if (phase != PSY_PHASE_UNINITIALIZED && phase != PSY_PHASE_PAUSED && phase != PSY_PHASE_FINISHED) {
    return PSY_ERR_NOT_HALTED;
  }
  /* [authority, instance, coordinator account], checked by psy_bind_accounts */
  close_account(&op->accounts[1], &op->accounts[0]);
  close_account(&op->accounts[2], &op->accounts[0]);
  return PSY_SUCCESS;
}

/* rules.slot_holder: whether a joiner, or a healthy client, holds `slot`. */
static bool slot_held(uint8_t *s, uint16_t slot) {
  uint64_t pending = psy_list_count(s, &PSY_PENDING);
  for (uint64_t i = 0; i < pending; i++) {
    if (PSY_PENDING_SLOT_GET(psy_list_entry(s, &PSY_PENDING, i)) == slot) {
      return true;
    }
  }
  uint64_t clients = psy_list_count(s, &PSY_CLIENTS);
  for (uint64_t i = 0; i < clients; i++) {
    const uint8_t *client = psy_list_entry(s, &PSY_CLIENTS, i);
    if (PSY_CLIENT_SLOT_GET(client) == slot && PSY_CLIENT_HEALTH_GET(client) == PSY_HEALTH_HEALTHY) {
      return true;
    }
  }
  return false;
}

uint64_t psy_join(const psy_op_t *op) {
  uint8_t *s = op->state;
  if (psy_memcmp(op->data + PSY_IX_JOIN_RUN_RUN_ID_OFFSET, s + PSY_ACCOUNT_RUN_ID_OFFSET, PSY_RUN_ID_BYTES) != 0) {
    return PSY_ERR_WRONG_RUN_ID; /* both are valid FixedStr bytes, so equal bytes mean equal strings */
  }
  if (phase_of(s) == PSY_PHASE_UNINITIALIZED) {
    return PSY_ERR_NOT_INITIALIZED;
  }
  if (phase_of(s) == PSY_PHASE_FINISHED) {
    return PSY_ERR_RUN_FINISHED;
  }
  const uint8_t *join_authority = s + PSY_ACCOUNT_JOIN_AUTHORITY_OFFSET;
  if (!psy_key_is_zero(join_authority) && !psy_key_eq(op->authorizer, join_authority)) {
    return PSY_ERR_NOT_AUTHORIZED;
  }
  if (op->now > (int64_t)psy_load_u64(op->data + PSY_IX_JOIN_RUN_VALID_UNTIL_OFFSET)) {
    return PSY_ERR_JOIN_EXPIRED;
  }
  uint8_t role = op->data[PSY_IX_JOIN_RUN_ROLE_OFFSET];
  uint8_t stage = op->data[PSY_IX_JOIN_RUN_STAGE_OFFSET];
  uint16_t slot = psy_load_u16(op->data + PSY_IX_JOIN_RUN_SLOT_OFFSET);
  if (role == PSY_ROLE_WORKER ? stage != PSY_NO_STAGE && stage >= PSY_ACCOUNT_CONFIG_NUM_STAGES_GET(s)
                              : stage != PSY_NO_STAGE) {
    return PSY_ERR_INVALID_JOIN;
  }
  if (psy_list_find(s, &PSY_CLIENTS, op->signer) >= 0 || psy_list_find(s, &PSY_PENDING, op->signer) >= 0) {
    return PSY_ERR_ALREADY_JOINED;
  }
  if (slot != PSY_NO_SLOT && slot_held(s, slot)) {
    return PSY_ERR_SLOT_TAKEN;
  }
  uint64_t pending = psy_list_count(s, &PSY_PENDING);
  if (psy_list_count(s, &PSY_CLIENTS) + pending >= PSY_ACCOUNT_CONFIG_MAX_CLIENTS_GET(s)) {
    return PSY_ERR_RUN_FULL;
  }
  uint8_t *entry = psy_list_entry(s, &PSY_PENDING, pending);
  sol_memcpy_(entry, op->signer, PSY_PUBKEY_BYTES);
  PSY_PENDING_ROLE_SET(entry, role);
  PSY_PENDING_STAGE_SET(entry, stage);
  PSY_PENDING_SLOT_SET(entry, slot);
  PSY_PENDING_VETERAN_SET(entry, 0);
  sol_memcpy_(entry + PSY_PENDING_COMMITMENT_OFFSET, op->data + PSY_IX_JOIN_RUN_COMMITMENT_OFFSET,
              PSY_PENDING_COMMITMENT_SIZE);
  psy_store_u16(s + PSY_ACCOUNT_NUM_PENDING_OFFSET, (uint16_t)(pending + 1));
  psy_bump_nonce(s);
  return PSY_SUCCESS;
}

/* rules.withdraw: `key` leaves, a joiner at once, a client when the round ends. */
static uint64_t withdraw_key(uint8_t *s, const uint8_t *key) {
  int64_t index = psy_list_find(s, &PSY_PENDING, key);
  if (index >= 0) {
    psy_list_remove(s, &PSY_PENDING, (uint64_t)index);
    psy_bump_nonce(s);
    return PSY_SUCCESS;
  }
  index = psy_list_find(s, &PSY_CLIENTS, key);
  if (index < 0) {
    return PSY_ERR_NOT_JOINED;
  }
  uint8_t *client = psy_list_entry(s, &PSY_CLIENTS, (uint64_t)index);
  if (PSY_CLIENT_HEALTH_GET(client) == PSY_HEALTH_WITHDRAWN) {
    return PSY_ERR_NOT_HEALTHY;
  }
  PSY_CLIENT_HEALTH_SET(client, PSY_HEALTH_WITHDRAWN);
  psy_bump_nonce(s);
  return PSY_SUCCESS;
}

uint64_t psy_withdraw(const psy_op_t *op) { return withdraw_key(op->state, op->signer); }

uint64_t psy_release_slot(const psy_op_t *op) {
  const uint8_t *join_authority = op->state + PSY_ACCOUNT_JOIN_AUTHORITY_OFFSET;
  if (psy_key_is_zero(join_authority) || !psy_key_eq(op->signer, join_authority)) {
    return PSY_ERR_NOT_AUTHORIZED;
  }
  return withdraw_key(op->state, op->data + PSY_IX_RELEASE_SLOT_KEY_OFFSET);
}

uint64_t psy_healthy_client(uint8_t *s, const uint8_t *signer, uint64_t *index) {
  int64_t found = psy_list_find(s, &PSY_CLIENTS, signer);
  if (found < 0) {
    return PSY_ERR_NOT_A_CLIENT;
  }
  if (PSY_CLIENT_HEALTH_GET(psy_list_entry(s, &PSY_CLIENTS, (uint64_t)found)) != PSY_HEALTH_HEALTHY) {
    return PSY_ERR_NOT_HEALTHY;
  }
  *index = (uint64_t)found;
  return PSY_SUCCESS;
}

uint64_t psy_checkpoint(const psy_op_t *op) {
  uint8_t *s = op->state;
  if (phase_of(s) != PSY_PHASE_COOLDOWN) {
    return PSY_ERR_WRONG_PHASE;
  }
  uint64_t index;
  uint64_t err = psy_healthy_client(s, op->signer, &index);
  if (err != PSY_SUCCESS) {
    return err;
  }
  const uint8_t *client = psy_list_entry(s, &PSY_CLIENTS, index);
  if (PSY_CLIENT_ROLE_GET(client) != PSY_ROLE_WORKER) {
    return PSY_ERR_NOT_A_WORKER;
  }
  uint8_t kind = op->data[PSY_IX_CHECKPOINT_KIND_OFFSET];
  const uint8_t *repo = op->data + PSY_IX_CHECKPOINT_REPO_OFFSET;
  const uint8_t *revision = op->data + PSY_IX_CHECKPOINT_REVISION_OFFSET;
  if ((kind != PSY_CHECKPOINT_KIND_HUB && kind != PSY_CHECKPOINT_KIND_LOCAL) || repo[0] == 0) {
    return PSY_ERR_INVALID_CHECKPOINT;
  }
  if (!psy_text_printable(repo, PSY_REPO_BYTES) || !psy_text_printable(revision, PSY_REVISION_BYTES)) {
    return PSY_ERR_INVALID_CHECKPOINT;
  }
  /* Only the reporter's own stage; Cooldown began with every stage P2P, so a saved place is this epoch's first. */
  uint8_t *place = s + PSY_ACCOUNT_CHECKPOINTS_OFFSET + PSY_CLIENT_STAGE_GET(client) * PSY_CHECKPOINT_SIZE;
  uint8_t recorded = PSY_CHECKPOINT_KIND_GET(place);
  bool saved = recorded == PSY_CHECKPOINT_KIND_HUB || recorded == PSY_CHECKPOINT_KIND_LOCAL;
  bool same_place = recorded == kind && psy_memcmp(place + PSY_CHECKPOINT_REPO_OFFSET, repo, PSY_REPO_BYTES) == 0 &&
                    psy_memcmp(place + PSY_CHECKPOINT_REVISION_OFFSET, revision, PSY_REVISION_BYTES) == 0;
  if (saved && !same_place) {
    return PSY_ERR_CHECKPOINT_TAKEN;
  }
  PSY_CHECKPOINT_KIND_SET(place, kind);
  sol_memcpy_(place + PSY_CHECKPOINT_REPO_OFFSET, repo, PSY_REPO_BYTES);
  sol_memcpy_(place + PSY_CHECKPOINT_REVISION_OFFSET, revision, PSY_REVISION_BYTES);
  psy_bump_nonce(s);
  return PSY_SUCCESS;
}
