/* tick.c: rules.tick, every transition due at `now`, phase by phase. Each phase's step returns
 * PSY_SUCCESS when it changed the state, PSY_ERR_NOTHING_TO_TICK when nothing was due (having written
 * nothing, since the operations that tick after applying keep their own change then). */
#include "coordinator.h"

#define NOTHING PSY_ERR_NOTHING_TO_TICK

/* now >= start + duration in the specification's unbounded integers: a sum past INT64_MAX is never
 * reached by a clock time. */
static bool time_reached(int64_t now, int64_t start, uint64_t duration) {
  if (start > INT64_MAX - (int64_t)duration) {
    return false;
  }
  return now >= start + (int64_t)duration;
}

static bool phase_time_reached(const uint8_t *s, int64_t now, uint64_t duration) {
  return time_reached(now, (int64_t)PSY_ACCOUNT_PHASE_START_GET(s), duration);
}

static void enter(uint8_t *s, uint64_t phase, int64_t now) {
  PSY_ACCOUNT_PHASE_SET(s, phase);
  PSY_ACCOUNT_PHASE_START_SET(s, now);
}

/* derived.quorum_reached: the current round holds a quorum of proofs. */
static bool reached_quorum(uint8_t *s) {
  return psy_witness_count(psy_current_round(s)) >= psy_quorum(s);
}

static bool clients_complete(uint8_t *s) {
  psy_census_t census;
  psy_census(s, &PSY_CLIENTS, &census);
  return psy_pipeline_complete(s, &census);
}

/* The healthy clients still form a pipeline (rules._training_over). */
static bool clients_formed(uint8_t *s) {
  psy_census_t census;
  psy_census(s, &PSY_CLIENTS, &census);
  return psy_pipeline_formed(s, &census);
}

/* rules._start_round: a fresh round of `height`, its seed chained from the current one's and its reveals. */
static void start_round(uint8_t *s, int64_t now, uint64_t height) {
  uint8_t *round = psy_current_round(s);
  uint64_t seed = psy_next_seed(PSY_ROUND_SEED_GET(round), round + PSY_ROUND_REVEALS_OFFSET);
  sol_memset_(round, 0, PSY_ROUND_SIZE);
  PSY_ROUND_HEIGHT_SET(round, height);
  PSY_ROUND_SEED_SET(round, seed);
  PSY_ROUND_DATA_INDEX_SET(round, psy_data_index(s));
  psy_elect(s);
  enter(s, PSY_PHASE_ROUND_TRAIN, now);
}

static uint64_t tick_paused(uint8_t *s, int64_t now) {
  if (PSY_ACCOUNT_PAUSE_REQUESTED_GET(s)) {
    return NOTHING;
  }
  enter(s, PSY_PHASE_WAITING_FOR_MEMBERS, now);
  return PSY_SUCCESS;
}

/* The least occupied stage, lowest index on ties (derived.assign_stages). */
static uint8_t least_occupied(const psy_census_t *census, uint64_t num_stages) {
  uint64_t best = 0;
  for (uint64_t stage = 1; stage < num_stages; stage++) {
    if (census->workers[stage] < census->workers[best]) {
      best = stage;
    }
  }
  return (uint8_t)best;
}

static uint64_t tick_waiting(uint8_t *s, int64_t now) {
  if (PSY_ACCOUNT_PAUSE_REQUESTED_GET(s)) {
    enter(s, PSY_PHASE_PAUSED, now);
    return PSY_SUCCESS;
  }
  /* Admit every joiner on paper first: the census of the requested stages, then the stage of each
   * joiner that lets the coordinator choose, one by one. Nothing is written unless the pipeline is
   * complete. */
  uint64_t num_stages = PSY_ACCOUNT_CONFIG_NUM_STAGES_GET(s);
  uint64_t joiners = psy_list_count(s, &PSY_PENDING);
  psy_census_t census;
  psy_census(s, &PSY_PENDING, &census);
  uint8_t *stages = psy_alloc(joiners); /* at most 1 KiB, the instruction's only allocation */
  for (uint64_t i = 0; i < joiners; i++) {
    const uint8_t *joiner = psy_list_entry(s, &PSY_PENDING, i);
    uint8_t stage = PSY_PENDING_STAGE_GET(joiner);
    if (PSY_PENDING_ROLE_GET(joiner) == PSY_ROLE_WORKER && stage == PSY_NO_STAGE) {
      stage = least_occupied(&census, num_stages);
      census.workers[stage]++;
    }
    stages[i] = stage;
  }
  if (!psy_pipeline_complete(s, &census)) {
    return NOTHING;
  }
  for (uint64_t i = 0; i < joiners; i++) {
    uint8_t *client = psy_list_entry(s, &PSY_CLIENTS, i);
    sol_memcpy_(client, psy_list_entry(s, &PSY_PENDING, i), PSY_PENDING_SIZE);
    PSY_CLIENT_STAGE_SET(client, stages[i]);
    PSY_CLIENT_HEALTH_SET(client, PSY_HEALTH_HEALTHY);
  }
  psy_list_set_count(s, &PSY_CLIENTS, joiners);
  psy_list_set_count(s, &PSY_PENDING, 0);
  sol_memset_(s + PSY_ACCOUNT_LEFT_OUT_OFFSET, 0, PSY_ACCOUNT_LEFT_OUT_SIZE);
  /* The epoch's warmup is round 0, its seed chained from the last round's and that round's reveals. */
  uint8_t *warmup = psy_current_round(s);
  uint64_t seed = psy_next_seed(PSY_ROUND_SEED_GET(warmup), warmup + PSY_ROUND_REVEALS_OFFSET);
  sol_memset_(warmup, 0, PSY_ROUND_SIZE);
  PSY_ROUND_SEED_SET(warmup, seed);
  PSY_ROUND_DATA_INDEX_SET(warmup, psy_data_index(s));
  if (psy_any_join_commitment(s)) {
    psy_unelect(s); /* elected once the joiners have revealed */
  } else {
    psy_elect(s);
  }
  enter(s, PSY_PHASE_WARMUP, now);
  return PSY_SUCCESS;
}

static uint64_t tick_warmup(uint8_t *s, int64_t now) {
  bool closed = psy_revealing(s) && psy_join_reveals_over(s, now);
  if (closed) {
    psy_close_join_reveals(s);
  }
  bool changed = closed;
  uint64_t clients = psy_list_count(s, &PSY_CLIENTS);
  psy_keep_healthy_clients(s);
  if (psy_list_count(s, &PSY_CLIENTS) != clients) {
    /* Slots moved (and a leaving witness let the next ticket in): proofs start over. */
    uint8_t *round = psy_current_round(s);
    PSY_ROUND_WITNESSED_SET(round, 0);
    sol_memset_(round + PSY_ROUND_PARTS_OFFSET, 0, PSY_ROUND_PARTS_SIZE);
    changed = true;
    if (!clients_complete(s)) {
      uint64_t err = psy_requeue_clients(s);
      if (err != PSY_SUCCESS) {
        return err;
      }
      enter(s, PSY_PHASE_WAITING_FOR_MEMBERS, now);
      return PSY_SUCCESS;
    }
  }
  if (reached_quorum(s) || phase_time_reached(s, now, PSY_ACCOUNT_CONFIG_WARMUP_TIME_GET(s))) {
    start_round(s, now, 0);
    return PSY_SUCCESS;
  }
  if (closed || (changed && !psy_revealing(s))) {
    psy_elect(s); /* the warmup's election of the clients left (a round starting elects anew) */
  }
  return changed ? PSY_SUCCESS : NOTHING;
}

static uint64_t tick_train(uint8_t *s, int64_t now) {
  if (reached_quorum(s) || phase_time_reached(s, now, PSY_ACCOUNT_CONFIG_MAX_ROUND_TRAIN_TIME_GET(s)) ||
      !clients_formed(s)) {
    enter(s, PSY_PHASE_ROUND_WITNESS, now);
    return PSY_SUCCESS;
  }
  return NOTHING;
}

static uint8_t *stage_checkpoint(uint8_t *s, uint64_t stage) {
  return s + PSY_ACCOUNT_CHECKPOINTS_OFFSET + stage * PSY_CHECKPOINT_SIZE;
}

static uint64_t tick_witness(uint8_t *s, int64_t now) {
  if (!phase_time_reached(s, now, PSY_ACCOUNT_CONFIG_ROUND_WITNESS_TIME_GET(s))) {
    return NOTHING;
  }
  psy_credit_chunk(s);
  if (PSY_ROUND_CREDITED_GET(psy_current_round(s)) < psy_list_count(s, &PSY_CLIENTS)) {
    return PSY_SUCCESS; /* the next tick credits the next clients */
  }
  bool quorum = reached_quorum(s); /* judged with the round's clients, before the unhealthy leave */
  uint32_t step = PSY_ACCOUNT_STEP_GET(s) + 1;
  PSY_ACCOUNT_STEP_SET(s, step);
  psy_withholders_leave(s);
  psy_close_round_votes(s);
  uint64_t next_height = (uint64_t)PSY_ROUND_HEIGHT_GET(psy_current_round(s)) + 1;
  if (next_height >= PSY_ACCOUNT_CONFIG_ROUNDS_PER_EPOCH_GET(s) || step >= PSY_ACCOUNT_CONFIG_TOTAL_STEPS_GET(s) ||
      !quorum || !clients_complete(s)) {
    /* The epoch ends: each stage's joiners fetch it from their peers until one of its workers reports it saved;
     * its place keeps the last repo and revision. */
    for (uint64_t stage = 0; stage < PSY_ACCOUNT_CONFIG_NUM_STAGES_GET(s); stage++) {
      PSY_CHECKPOINT_KIND_SET(stage_checkpoint(s, stage), PSY_CHECKPOINT_KIND_P2P);
    }
    enter(s, PSY_PHASE_COOLDOWN, now);
  } else {
    start_round(s, now, next_height);
  }
  return PSY_SUCCESS;
}

static uint64_t tick_cooldown(uint8_t *s, int64_t now) {
  bool saved = true; /* every stage reported saved this epoch */
  for (uint64_t stage = 0; stage < PSY_ACCOUNT_CONFIG_NUM_STAGES_GET(s); stage++) {
    uint8_t kind = PSY_CHECKPOINT_KIND_GET(stage_checkpoint(s, stage));
    saved = saved && (kind == PSY_CHECKPOINT_KIND_HUB || kind == PSY_CHECKPOINT_KIND_LOCAL);
  }
  if (!saved && !phase_time_reached(s, now, PSY_ACCOUNT_CONFIG_COOLDOWN_TIME_GET(s))) {
    return NOTHING;
  }
  PSY_ACCOUNT_EPOCH_SET(s, PSY_ACCOUNT_EPOCH_GET(s) + 1);
  sol_memset_(s + PSY_ACCOUNT_LEFT_OUT_OFFSET, 0, PSY_ACCOUNT_LEFT_OUT_SIZE); /* no round is left to check */
  if (PSY_ACCOUNT_STEP_GET(s) >= PSY_ACCOUNT_CONFIG_TOTAL_STEPS_GET(s)) {
    psy_list_set_count(s, &PSY_CLIENTS, 0);
    enter(s, PSY_PHASE_FINISHED, now);
    return PSY_SUCCESS;
  }
  psy_keep_healthy_clients(s); /* the healthy stay, at the front of the queue, as veterans */
  for (uint64_t i = 0; i < psy_list_count(s, &PSY_CLIENTS); i++) {
    PSY_CLIENT_VETERAN_SET(psy_list_entry(s, &PSY_CLIENTS, i), 1);
  }
  uint64_t err = psy_requeue_clients(s);
  if (err != PSY_SUCCESS) {
    return err;
  }
  enter(s, PSY_ACCOUNT_PAUSE_REQUESTED_GET(s) ? PSY_PHASE_PAUSED : PSY_PHASE_WAITING_FOR_MEMBERS, now);
  return PSY_SUCCESS;
}

uint64_t psy_tick(uint8_t *s, int64_t now) {
  uint64_t result;
  switch (PSY_ACCOUNT_PHASE_GET(s)) {
    case PSY_PHASE_PAUSED:
      result = tick_paused(s, now);
      break;
    case PSY_PHASE_WAITING_FOR_MEMBERS:
      result = tick_waiting(s, now);
      break;
    case PSY_PHASE_WARMUP:
      result = tick_warmup(s, now);
      break;
    case PSY_PHASE_ROUND_TRAIN:
      result = tick_train(s, now);
      break;
    case PSY_PHASE_ROUND_WITNESS:
      result = tick_witness(s, now);
      break;
    case PSY_PHASE_COOLDOWN:
      result = tick_cooldown(s, now);
      break;
    case PSY_PHASE_UNINITIALIZED:
      return PSY_ERR_NOT_INITIALIZED;
    default:
      return PSY_ERR_RUN_FINISHED;
  }
  if (result == PSY_SUCCESS) {
    psy_bump_nonce(s);
  }
  return result;
}
