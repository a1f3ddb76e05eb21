/* instruction_data.c: accepts exactly the instruction data instructions.decode_instruction accepts.
 *
 * Every instruction is its 8-byte discriminator then its Borsh arguments, with nothing after them. Enums
 * must name a variant, a bool is 0 or 1, a FixedStr must decode (text.c) and a bloom is a u32 length of
 * at most MAX_BLOOM_BYTES then its bytes. Whatever fails is MalformedInstruction, whichever rule it
 * breaks, so the order of the checks here does not matter. */
#include "coordinator.h"

#define MALFORMED PSY_ERR_MALFORMED_INSTRUCTION
#define LENGTH_SIZE 4 /* Borsh bytes begin with a u32 length */

/* Two blooms (u32 length, bytes) starting at `at`, and the data ends right after them. */
static bool decode_blooms(const uint8_t *data, uint64_t len, uint64_t at, psy_proof_t *proof) {
  if (len < at + LENGTH_SIZE) {
    return false;
  }
  uint64_t first = psy_load_u32(data + at);
  uint64_t second_at = at + LENGTH_SIZE + first;
  if (first > PSY_MAX_BLOOM_BYTES || len < second_at + LENGTH_SIZE) {
    return false;
  }
  uint64_t second = psy_load_u32(data + second_at);
  if (second > PSY_MAX_BLOOM_BYTES || len != second_at + LENGTH_SIZE + second) {
    return false;
  }
  proof->participant = data + at + LENGTH_SIZE;
  proof->participant_len = first;
  proof->batch_len = second;
  return true;
}

static bool valid_update(const uint8_t *data) {
  const uint8_t *model = data + PSY_IX_UPDATE_MODEL_OFFSET;
  const uint8_t *checkpoint = data + PSY_IX_UPDATE_CHECKPOINT_OFFSET;
  return psy_text_valid(model + PSY_MODEL_DATASET_OFFSET, PSY_MODEL_DATASET_SIZE) &&
         psy_text_valid(model + PSY_MODEL_ARCHITECTURE_OFFSET, PSY_MODEL_ARCHITECTURE_SIZE) &&
         psy_text_valid(model + PSY_MODEL_SOURCE_OFFSET, PSY_MODEL_SOURCE_SIZE) &&
         psy_text_valid(model + PSY_MODEL_SOURCE_REVISION_OFFSET, PSY_MODEL_SOURCE_REVISION_SIZE) &&
         PSY_MODEL_TOKENIZER_GET(model) < PSY_TOKENIZER_COUNT && PSY_MODEL_LR_SCHEDULE_GET(model) < PSY_SCHEDULE_COUNT &&
         PSY_MODEL_GRAD_AVERAGING_GET(model) < PSY_GRAD_AVERAGING_COUNT &&
         PSY_MODEL_GRAD_VALUES_GET(model) < PSY_GRAD_VALUES_COUNT &&
         PSY_MODEL_WIRE_CODEC_GET(model) < PSY_WIRE_CODEC_COUNT && PSY_MODEL_WHOLE_BATCH_MOMENT_GET(model) <= 1 &&
         PSY_CHECKPOINT_KIND_GET(checkpoint) < PSY_CHECKPOINT_KIND_COUNT &&
         psy_text_valid(checkpoint + PSY_CHECKPOINT_REPO_OFFSET, PSY_CHECKPOINT_REPO_SIZE) &&
         psy_text_valid(checkpoint + PSY_CHECKPOINT_REVISION_OFFSET, PSY_CHECKPOINT_REVISION_SIZE);
}

static bool valid_checkpoint(const uint8_t *data) {
  return data[PSY_IX_CHECKPOINT_KIND_OFFSET] < PSY_CHECKPOINT_KIND_COUNT &&
         psy_text_valid(data + PSY_IX_CHECKPOINT_REPO_OFFSET, PSY_REPO_BYTES) &&
         psy_text_valid(data + PSY_IX_CHECKPOINT_REVISION_OFFSET, PSY_REVISION_BYTES);
}

uint64_t psy_decode_instruction(const uint8_t *data, uint64_t len, psy_op_t *op) {
  if (len < PSY_DISCRIMINATOR_SIZE) {
    return MALFORMED;
  }
  op->data = data;
  bool ok;
  switch (psy_load_u64(data)) {
    case PSY_IX_UPDATE_DISCRIMINATOR:
      op->kind = PSY_OP_UPDATE;
      ok = len == PSY_IX_UPDATE_DATA_SIZE && valid_update(data);
      break;
    case PSY_IX_SET_PAUSED_DISCRIMINATOR:
      op->kind = PSY_OP_SET_PAUSED;
      ok = len == PSY_IX_SET_PAUSED_DATA_SIZE && data[PSY_IX_SET_PAUSED_PAUSED_OFFSET] <= 1;
      break;
    case PSY_IX_JOIN_RUN_DISCRIMINATOR:
      op->kind = PSY_OP_JOIN_RUN;
      ok = len == PSY_IX_JOIN_RUN_DATA_SIZE && psy_text_valid(data + PSY_IX_JOIN_RUN_RUN_ID_OFFSET, PSY_RUN_ID_BYTES) &&
           data[PSY_IX_JOIN_RUN_ROLE_OFFSET] < PSY_ROLE_COUNT;
      break;
    case PSY_IX_TICK_DISCRIMINATOR:
      op->kind = PSY_OP_TICK;
      ok = len == PSY_IX_TICK_DATA_SIZE;
      break;
    case PSY_IX_WITNESS_DISCRIMINATOR:
      op->kind = PSY_OP_WITNESS;
      ok = decode_blooms(data, len, PSY_IX_WITNESS_PARTICIPANT_BLOOM_OFFSET, &op->proof);
      op->proof.part = ok ? data[PSY_IX_WITNESS_PART_OFFSET] : 0;
      break;
    case PSY_IX_WARMUP_WITNESS_DISCRIMINATOR:
      op->kind = PSY_OP_WARMUP_WITNESS;
      ok = decode_blooms(data, len, PSY_IX_WARMUP_WITNESS_PARTICIPANT_BLOOM_OFFSET, &op->proof);
      op->proof.part = ok ? data[PSY_IX_WARMUP_WITNESS_PART_OFFSET] : 0;
      break;
    case PSY_IX_HEALTH_CHECK_DISCRIMINATOR:
      op->kind = PSY_OP_HEALTH_CHECK;
      ok = len == PSY_IX_HEALTH_CHECK_DATA_SIZE;
      break;
    case PSY_IX_CHECKPOINT_DISCRIMINATOR:
      op->kind = PSY_OP_CHECKPOINT;
      ok = len == PSY_IX_CHECKPOINT_DATA_SIZE && valid_checkpoint(data);
      break;
    case PSY_IX_WITHDRAW_DISCRIMINATOR:
      op->kind = PSY_OP_WITHDRAW;
      ok = len == PSY_IX_WITHDRAW_DATA_SIZE;
      break;
    case PSY_IX_CLOSE_RUN_DISCRIMINATOR:
      op->kind = PSY_OP_CLOSE_RUN;
      ok = len == PSY_IX_CLOSE_RUN_DATA_SIZE;
      break;
    case PSY_IX_RELEASE_SLOT_DISCRIMINATOR:
      op->kind = PSY_OP_RELEASE_SLOT;
      ok = len == PSY_IX_RELEASE_SLOT_DATA_SIZE;
      break;
    case PSY_IX_COMMIT_SEED_DISCRIMINATOR:
      op->kind = PSY_OP_COMMIT_SEED;
      ok = len == PSY_IX_COMMIT_SEED_DATA_SIZE;
      break;
    case PSY_IX_REVEAL_SEED_DISCRIMINATOR:
      op->kind = PSY_OP_REVEAL_SEED;
      ok = len == PSY_IX_REVEAL_SEED_DATA_SIZE;
      break;
    default:
      ok = false; /* an unknown discriminator (init_coordinator never reaches here) */
  }
  return ok ? PSY_SUCCESS : MALFORMED;
}
