/* config.c: config.validate_config, validate_model and validate_checkpoint, over Borsh bytes.
 * Every config or model rule fails with InvalidConfig and every checkpoint rule with InvalidCheckpoint,
 * so only the order between the three functions matters, and update calls them in the specification's
 * order. */
#include "coordinator.h"

#define INVALID_CONFIG PSY_ERR_INVALID_CONFIG

uint64_t psy_bloom_bytes(const uint8_t *config) {
  return ((uint64_t)PSY_CONFIG_BLOOM_SLICES_GET(config) * PSY_CONFIG_BLOOM_BITS_PER_SLICE_GET(config) + 7) / 8;
}

uint64_t psy_validate_config(const uint8_t *c) {
  uint64_t num_stages = PSY_CONFIG_NUM_STAGES_GET(c);
  uint64_t max_clients = PSY_CONFIG_MAX_CLIENTS_GET(c);
  uint64_t min_clients = PSY_CONFIG_MIN_CLIENTS_GET(c);
  uint64_t witness_nodes = PSY_CONFIG_WITNESS_NODES_GET(c);
  uint64_t witness_quorum = PSY_CONFIG_WITNESS_QUORUM_GET(c);
  uint64_t slices = PSY_CONFIG_BLOOM_SLICES_GET(c);
  uint64_t bits = PSY_CONFIG_BLOOM_BITS_PER_SLICE_GET(c);
  bool ok = num_stages >= 2 && num_stages <= PSY_MAX_STAGES &&
            max_clients >= 1 && max_clients <= PSY_MAX_CLIENTS &&
            min_clients >= num_stages + 1 && min_clients <= max_clients &&
            witness_nodes >= 1 && witness_nodes <= PSY_MAX_WITNESSES && witness_nodes <= min_clients &&
            witness_quorum >= witness_nodes / 2 + 1 && witness_quorum <= witness_nodes && /* a strict majority */
            PSY_CONFIG_WARMUP_TIME_GET(c) >= 1 && PSY_CONFIG_MAX_ROUND_TRAIN_TIME_GET(c) >= 1 &&
            PSY_CONFIG_ROUND_WITNESS_TIME_GET(c) >= 1 && PSY_CONFIG_COOLDOWN_TIME_GET(c) >= 1 &&
            PSY_CONFIG_ROUNDS_PER_EPOCH_GET(c) >= 1 && PSY_CONFIG_TOTAL_STEPS_GET(c) >= 1 &&
            PSY_CONFIG_GLOBAL_BATCH_SIZE_GET(c) >= 1 &&
            slices >= PSY_BLOOM_MIN_SLICES && slices <= PSY_BLOOM_MAX_SLICES &&
            bits >= 1 && bits <= PSY_BLOOM_MAX_BITS_PER_SLICE &&
            psy_bloom_bytes(c) <= PSY_MAX_BLOOM_BYTES;
  return ok ? PSY_SUCCESS : INVALID_CONFIG;
}

static bool is_digest_zero(const uint8_t *digest) { return psy_key_is_zero(digest); }

static bool is_lower_alnum(uint8_t ch) { return (ch >= 'a' && ch <= 'z') || (ch >= '0' && ch <= '9'); }

static bool is_alnum(uint8_t ch) { return is_lower_alnum(ch) || (ch >= 'A' && ch <= 'Z'); }

/* config._architecture_name: non-empty, [a-z0-9_] only. */
static bool architecture_name(const uint8_t *text, uint64_t size) {
  uint64_t n = psy_text_len(text, size);
  for (uint64_t i = 0; i < n; i++) {
    if (!is_lower_alnum(text[i]) && text[i] != '_') {
      return false;
    }
  }
  return n > 0;
}

static bool starts_with(const uint8_t *text, uint64_t n, const char *prefix, uint64_t prefix_len) {
  return n >= prefix_len && psy_memcmp(text, prefix, prefix_len) == 0;
}

/* config.valid_source: a local directory (/, ./, ../ or ~ then printable ASCII) or a Hub repo id org/name
 * (exactly one '/', both parts non-empty [A-Za-z0-9._-]). */
static bool valid_source(const uint8_t *text, uint64_t size) {
  uint64_t n = psy_text_len(text, size);
  if (starts_with(text, n, "/", 1) || starts_with(text, n, "./", 2) || starts_with(text, n, "../", 3) ||
      starts_with(text, n, "~", 1)) {
    return psy_text_printable(text, size);
  }
  uint64_t slashes = 0, part = 0;
  for (uint64_t i = 0; i < n; i++) {
    uint8_t ch = text[i];
    if (ch == '/') {
      if (part == 0) {
        return false;
      }
      slashes++;
      part = 0;
    } else if (is_alnum(ch) || ch == '.' || ch == '_' || ch == '-') {
      part++;
    } else {
      return false;
    }
  }
  return slashes == 1 && part > 0;
}

/* config.validate_model_source */
static bool valid_model_source(const uint8_t *m) {
  const uint8_t *architecture = m + PSY_MODEL_ARCHITECTURE_OFFSET;
  const uint8_t *source = m + PSY_MODEL_SOURCE_OFFSET;
  const uint8_t *revision = m + PSY_MODEL_SOURCE_REVISION_OFFSET;
  if (!architecture_name(architecture, PSY_MODEL_ARCHITECTURE_SIZE)) {
    return false;
  }
  bool embedded = psy_text_len(architecture, PSY_MODEL_ARCHITECTURE_SIZE) == sizeof(PSY_PSYSWARM_ARCHITECTURE) - 1 &&
                  psy_memcmp(architecture, PSY_PSYSWARM_ARCHITECTURE, sizeof(PSY_PSYSWARM_ARCHITECTURE) - 1) == 0;
  bool source_ok = embedded ? source[0] == 0 && revision[0] == 0 && is_digest_zero(m + PSY_MODEL_CONFIG_SHA256_OFFSET) &&
                                  PSY_MODEL_TOKENIZER_GET(m) == PSY_TOKENIZER_BYTES
                            : valid_source(source, PSY_MODEL_SOURCE_SIZE) &&
                                  psy_text_printable(revision, PSY_MODEL_SOURCE_REVISION_SIZE) &&
                                  !is_digest_zero(m + PSY_MODEL_CONFIG_SHA256_OFFSET);
  bool bytes_tokenizer = PSY_MODEL_TOKENIZER_GET(m) == PSY_TOKENIZER_BYTES;
  return source_ok && bytes_tokenizer == is_digest_zero(m + PSY_MODEL_TOKENIZER_SHA256_OFFSET);
}

/* config.validate_dataset_pin: stdlib pins nothing, a downloaded dataset (http://, https://, hf:) pins its
 * dataset.json by a non-zero digest, a local path may do either. */
static bool valid_dataset_pin(const uint8_t *m) {
  const uint8_t *dataset = m + PSY_MODEL_DATASET_OFFSET;
  uint64_t n = psy_text_len(dataset, PSY_MODEL_DATASET_SIZE);
  bool pinned = !is_digest_zero(m + PSY_MODEL_DATASET_SHA256_OFFSET);
  if (n == 6 && psy_memcmp(dataset, "stdlib", 6) == 0) {
    return !pinned;
  }
  if (starts_with(dataset, n, "http://", 7) || starts_with(dataset, n, "https://", 8) ||
      starts_with(dataset, n, "hf:", 3)) {
    return pinned;
  }
  return true;
}

/* config.validate_schedule */
static bool valid_schedule(const uint8_t *m, uint64_t total_steps) {
  uint64_t schedule = PSY_MODEL_LR_SCHEDULE_GET(m);
  uint64_t warmup = PSY_MODEL_WARMUP_STEPS_GET(m);
  uint64_t floor = PSY_MODEL_LR_FLOOR_MICROS_GET(m);
  if (schedule == PSY_SCHEDULE_CONSTANT) {
    return warmup == 0 && floor == 0;
  }
  if (schedule == PSY_SCHEDULE_LINEAR_WARMUP) {
    return warmup >= 1 && warmup <= total_steps && floor == 0;
  }
  /* warmup <= total_steps - 1 in the specification's integers, where total_steps may be 0 */
  return warmup + 1 <= total_steps && floor <= PSY_MODEL_LEARNING_RATE_MICROS_GET(m);
}

/* config.validate_powersgd */
static bool valid_powersgd(const uint8_t *m) {
  uint64_t rank = PSY_MODEL_POWERSGD_RANK_GET(m);
  if (PSY_MODEL_GRAD_AVERAGING_GET(m) == PSY_GRAD_AVERAGING_POWER_SGD) {
    return rank >= 1 && rank <= PSY_MAX_POWERSGD_RANK;
  }
  return rank == 0;
}

/* config.validate_demo: a topk below the chunk, a decay below 1 */
static bool valid_demo(const uint8_t *m) {
  uint64_t chunk = PSY_MODEL_DEMO_CHUNK_GET(m);
  uint64_t topk = PSY_MODEL_DEMO_TOPK_GET(m);
  uint64_t beta = PSY_MODEL_DEMO_BETA_PERMILLE_GET(m);
  if (PSY_MODEL_GRAD_AVERAGING_GET(m) == PSY_GRAD_AVERAGING_DE_MO) {
    return chunk >= 2 && chunk <= PSY_MAX_DEMO_CHUNK && topk >= 1 && topk < chunk &&
           beta <= PSY_MAX_DEMO_BETA_PERMILLE;
  }
  return chunk == 0 && topk == 0 && beta == 0;
}

/* config.validate_grad_values: int4 carries SPARTA's slices only */
static bool valid_grad_values(const uint8_t *m) {
  return PSY_MODEL_GRAD_VALUES_GET(m) != PSY_GRAD_VALUES_INT4 ||
         PSY_MODEL_GRAD_AVERAGING_GET(m) == PSY_GRAD_AVERAGING_OFF;
}

/* config.validate_whole_batch_moment: with gradient averaging off only */
static bool valid_whole_batch_moment(const uint8_t *m) {
  return !PSY_MODEL_WHOLE_BATCH_MOMENT_GET(m) || PSY_MODEL_GRAD_AVERAGING_GET(m) == PSY_GRAD_AVERAGING_OFF;
}

/* config.validate_gossip: a rank up to PowerSGD's most, and only with gradient averaging off and not in int4 */
static bool valid_gossip(const uint8_t *m) {
  uint64_t rank = PSY_MODEL_GOSSIP_RANK_GET(m);
  return rank <= PSY_MAX_POWERSGD_RANK &&
         (rank == 0 || (PSY_MODEL_GRAD_AVERAGING_GET(m) == PSY_GRAD_AVERAGING_OFF &&
                        PSY_MODEL_GRAD_VALUES_GET(m) != PSY_GRAD_VALUES_INT4));
}

/* config.validate_grad_averaging: each compressed mode's settings in range with it, 0 without it; the codec
   suits what it carries */
static bool valid_grad_averaging(const uint8_t *m) {
  return valid_powersgd(m) && valid_demo(m) && valid_grad_values(m) && valid_whole_batch_moment(m) &&
         valid_gossip(m);
}

uint64_t psy_validate_model(const uint8_t *m, const uint8_t *c) {
  uint64_t n_heads = PSY_MODEL_N_HEADS_GET(m);
  uint64_t d_model = PSY_MODEL_D_MODEL_GET(m);
  const uint8_t *dataset = m + PSY_MODEL_DATASET_OFFSET;
  bool ok = PSY_MODEL_N_LAYERS_GET(m) >= PSY_CONFIG_NUM_STAGES_GET(c) &&
            n_heads >= 1 && d_model >= 1 && d_model % n_heads == 0 && /* n_heads >= 1: no division by 0 */
            PSY_MODEL_SEQ_LEN_GET(m) >= 2 &&
            PSY_MODEL_MICROBATCH_SIZE_GET(m) >= 1 && PSY_MODEL_LEARNING_RATE_MICROS_GET(m) >= 1 &&
            PSY_MODEL_SPARTA_EVERY_GET(m) >= 1 && PSY_MODEL_SPARTA_PARTITIONS_GET(m) >= 1 &&
            dataset[0] != 0 && psy_text_printable(dataset, PSY_MODEL_DATASET_SIZE) && valid_dataset_pin(m) &&
            valid_model_source(m) &&
            valid_schedule(m, PSY_CONFIG_TOTAL_STEPS_GET(c)) && valid_grad_averaging(m) &&
            PSY_MODEL_AUDIT_PERMILLE_GET(m) <= PSY_MAX_AUDIT_PERMILLE;
  return ok ? PSY_SUCCESS : INVALID_CONFIG;
}

uint64_t psy_validate_checkpoint(const uint8_t *cp) {
  const uint8_t *repo = cp + PSY_CHECKPOINT_REPO_OFFSET;
  const uint8_t *revision = cp + PSY_CHECKPOINT_REVISION_OFFSET;
  uint64_t kind = PSY_CHECKPOINT_KIND_GET(cp);
  bool ok;
  if (kind == PSY_CHECKPOINT_KIND_FRESH) {
    ok = repo[0] == 0 && revision[0] == 0;
  } else if (kind == PSY_CHECKPOINT_KIND_HUB || kind == PSY_CHECKPOINT_KIND_LOCAL) {
    ok = repo[0] != 0 && psy_text_printable(repo, PSY_CHECKPOINT_REPO_SIZE) &&
         psy_text_printable(revision, PSY_CHECKPOINT_REVISION_SIZE);
  } else {
    ok = false; /* a run cannot start from a P2P checkpoint */
  }
  return ok ? PSY_SUCCESS : PSY_ERR_INVALID_CHECKPOINT;
}
