/* init.c: init_coordinator. The client pre-creates the coordinator account (zeroed, owned by this program,
 * exactly the layout's size) in the same transaction, because an account created through CPI grows at most
 * 10 KiB; this instruction creates the small instance PDA ["coordinator", run_id] itself (tolerating lamports
 * sent to its address beforehand), records the link between the two, and writes the state
 * rules.init_coordinator produces at the Clock sysvar's time. */
#include "coordinator.h"

/* Every byte is zero, compared a heap block of zeros at a time (the heap starts zeroed). */
static bool all_zero(const uint8_t *data, uint64_t len) {
  enum { BLOCK = 4096 };
  const uint8_t *zeros = psy_alloc(BLOCK);
  for (uint64_t at = 0; at < len; at += BLOCK) {
    uint64_t n = len - at < BLOCK ? len - at : BLOCK;
    if (psy_memcmp(data + at, zeros, n) != 0) {
      return false;
    }
  }
  return true;
}

/* config.valid_run_id: 1-32 bytes of [A-Za-z0-9._-]. */
static bool valid_run_id(const uint8_t *run_id, uint64_t len) {
  if (len == 0) {
    return false;
  }
  for (uint64_t i = 0; i < len; i++) {
    uint8_t c = run_id[i];
    bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' || c == '_' ||
              c == '-';
    if (!ok) {
      return false;
    }
  }
  return true;
}

/* Creates the instance PDA, rent exempt and owned by this program. Anyone may send lamports to its address
 * before the run exists, and CreateAccount fails on an address that holds any, which would block the run
 * id for ever; so the account is made the way that tolerates them: transfer what rent exemption still
 * lacks, then allocate and assign it, signing for the PDA with its seeds. */
static uint64_t create_instance(const psy_input_t *in, const uint8_t *run_id, uint64_t run_id_len,
                                const psy_pubkey_t *found, uint8_t bump) {
  psy_account_t *instance = &in->accounts[1];
  if (!psy_pubkey_eq(found, instance->key)) {
    return PSY_ERROR_INVALID_SEEDS;
  }
  uint64_t rent = 0;
  uint64_t err = psy_rent_exempt_minimum(PSY_INSTANCE_SIZE, &rent);
  if (err != PSY_SUCCESS) {
    return err;
  }
  if (*instance->lamports < rent) {
    psy_transfer_t fund = {&in->accounts[0], instance, rent - *instance->lamports, NULL, 0};
    err = psy_system_transfer(&fund);
    if (err != PSY_SUCCESS) {
      return err;
    }
  }
  psy_bytes_t seeds[3] = {
      {(const uint8_t *)PSY_INSTANCE_SEED, sizeof(PSY_INSTANCE_SEED) - 1}, {run_id, run_id_len}, {&bump, 1}};
  psy_signer_seeds_t signer = {seeds, 3};
  err = psy_system_allocate(instance, PSY_INSTANCE_SIZE, &signer, 1);
  if (err != PSY_SUCCESS) {
    return err;
  }
  return psy_system_assign(instance, in->program_id, &signer, 1);
}

uint64_t psy_init_coordinator(const psy_input_t *in) {
  const uint8_t *run_id = in->data + PSY_IX_INIT_COORDINATOR_RUN_ID_OFFSET;
  if (in->data_len != PSY_IX_INIT_COORDINATOR_DATA_SIZE || !psy_text_valid(run_id, PSY_RUN_ID_BYTES)) {
    return PSY_ERR_MALFORMED_INSTRUCTION;
  }
  /* [payer, instance PDA, coordinator account, system program] */
  if (in->total_accounts < 4) {
    return PSY_ERROR_NOT_ENOUGH_ACCOUNT_KEYS;
  }
  psy_account_t *payer = &in->accounts[0];
  psy_account_t *coordinator = &in->accounts[2];
  if (!payer->is_signer) {
    return PSY_ERROR_MISSING_REQUIRED_SIGNATURES;
  }
  if (!payer->is_writable || !in->accounts[1].is_writable) {
    return PSY_ERROR_IMMUTABLE;
  }
  if (!psy_key_is_zero(in->accounts[3].key->bytes)) {
    return PSY_ERROR_INCORRECT_PROGRAM_ID;
  }
  uint64_t err = psy_check_coordinator_account(coordinator, in->program_id);
  if (err != PSY_SUCCESS) {
    return err;
  }
  if (!all_zero(coordinator->data, PSY_ACCOUNT_SIZE)) {
    return PSY_ERROR_ACCOUNT_ALREADY_INITIALIZED;
  }
  uint64_t run_id_len = psy_text_len(run_id, PSY_RUN_ID_BYTES);
  if (!valid_run_id(run_id, run_id_len)) {
    return PSY_ERR_INVALID_RUN_ID;
  }
  psy_bytes_t seeds[2] = {{(const uint8_t *)PSY_INSTANCE_SEED, sizeof(PSY_INSTANCE_SEED) - 1}, {run_id, run_id_len}};
  psy_pubkey_t found;
  uint8_t bump = 0;
  err = sol_try_find_program_address(seeds, 2, in->program_id, &found, &bump);
  if (err == PSY_SUCCESS) {
    err = create_instance(in, run_id, run_id_len, &found, bump);
  }
  if (err != PSY_SUCCESS) {
    return err;
  }
  uint8_t *instance = in->accounts[1].data;
  psy_store_u64(instance, PSY_INSTANCE_DISCRIMINATOR);
  sol_memcpy_(instance + PSY_INSTANCE_RUN_ID_OFFSET, run_id, PSY_RUN_ID_BYTES);
  sol_memcpy_(instance + PSY_INSTANCE_COORDINATOR_ACCOUNT_OFFSET, coordinator->key->bytes, PSY_PUBKEY_BYTES);
  PSY_INSTANCE_BUMP_SET(instance, bump);
  /* rules.init_coordinator: everything zero (the account already is) but these. */
  uint8_t *s = coordinator->data;
  const uint8_t *data = in->data;
  psy_store_u64(s, PSY_ACCOUNT_DISCRIMINATOR);
  sol_memcpy_(s + PSY_ACCOUNT_RUN_ID_OFFSET, run_id, PSY_RUN_ID_BYTES);
  sol_memcpy_(s + PSY_ACCOUNT_MAIN_AUTHORITY_OFFSET, data + PSY_IX_INIT_COORDINATOR_MAIN_AUTHORITY_OFFSET,
              PSY_PUBKEY_BYTES);
  sol_memcpy_(s + PSY_ACCOUNT_JOIN_AUTHORITY_OFFSET, data + PSY_IX_INIT_COORDINATOR_JOIN_AUTHORITY_OFFSET,
              PSY_PUBKEY_BYTES);
  PSY_ACCOUNT_PAUSE_REQUESTED_SET(s, 1);
  psy_clock_t clock; /* the creation time comes from the Clock sysvar, never the caller */
  sol_get_clock_sysvar(&clock);
  PSY_ACCOUNT_CREATED_AT_SET(s, clock.unix_timestamp);
  return PSY_SUCCESS;
}
