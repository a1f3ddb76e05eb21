/* entrypoint.c: decode, check the accounts, apply the rule, then tick when the instruction is one that
 * ticks after applying (instructions.apply_then_tick). */
#include "coordinator.h"

/* instructions.ticks_after: the instructions after which the program ticks, but never where the tick could start a
 * round (and so elect its witnesses, a tick's own work): not a witness proof part or a health check taken in
 * RoundWitness, nor a warmup proof. */
static bool ticks_after(psy_op_kind_t kind, uint64_t phase_before) {
  if (kind == PSY_OP_WITNESS || kind == PSY_OP_HEALTH_CHECK) {
    return phase_before != PSY_PHASE_ROUND_WITNESS;
  }
  return kind == PSY_OP_CHECKPOINT;
}

static uint64_t apply(const psy_op_t *op) {
  switch (op->kind) {
    case PSY_OP_UPDATE:
      return psy_update(op);
    case PSY_OP_SET_PAUSED:
      return psy_set_paused(op);
    case PSY_OP_JOIN_RUN:
      return psy_join(op);
    case PSY_OP_TICK:
      return psy_tick(op->state, op->now);
    case PSY_OP_WITNESS:
      return psy_witness(op);
    case PSY_OP_WARMUP_WITNESS:
      return psy_warmup_witness(op);
    case PSY_OP_HEALTH_CHECK:
      return psy_health_check(op);
    case PSY_OP_CHECKPOINT:
      return psy_checkpoint(op);
    case PSY_OP_CLOSE_RUN:
      return psy_close_run(op);
    case PSY_OP_RELEASE_SLOT:
      return psy_release_slot(op);
    case PSY_OP_COMMIT_SEED:
      return psy_commit_seed(op);
    case PSY_OP_REVEAL_SEED:
      return psy_reveal_seed(op);
    default:
      return psy_withdraw(op);
  }
}

uint64_t entrypoint(const uint8_t *input) {
  psy_account_t accounts[4]; /* the most any instruction takes; extra accounts are ignored */
  psy_input_t in;
  psy_deserialize(input, &in, accounts, 4);
  if (in.data_len >= PSY_DISCRIMINATOR_SIZE && psy_load_u64(in.data) == PSY_IX_INIT_COORDINATOR_DISCRIMINATOR) {
    return psy_init_coordinator(&in);
  }
  psy_op_t op = {0};
  uint64_t err = psy_decode_instruction(in.data, in.data_len, &op);
  if (err == PSY_SUCCESS) {
    err = psy_bind_accounts(&in, &op);
  }
  if (err != PSY_SUCCESS) {
    return err;
  }
  bool ticks = ticks_after(op.kind, PSY_ACCOUNT_PHASE_GET(op.state));
  if (ticks || op.kind == PSY_OP_TICK || op.kind == PSY_OP_JOIN_RUN) { /* from the Clock sysvar, never the caller */
    psy_clock_t clock;
    sol_get_clock_sysvar(&clock);
    op.now = clock.unix_timestamp;
  }
  err = apply(&op);
  if (err != PSY_SUCCESS || !ticks) {
    return err;
  }
  err = psy_tick(op.state, op.now);
  return err == PSY_ERR_NOTHING_TO_TICK ? PSY_SUCCESS : err; /* nothing due is no error here */
}
