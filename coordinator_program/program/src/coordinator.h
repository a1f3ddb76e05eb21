/*
 * coordinator.h: what the coordinator program's translation units share.
 *
 * The program mirrors coordinator_program/spec/rules.py, the executable specification: every operation checks
 * in the specification's order and returns the same error code (errors.py), and the account bytes it
 * leaves are exactly encode_state() of the specification's state. All account and instruction bytes are
 * read and written at the offsets of the generated psy_coordinator_layout.h; nothing here guesses a
 * struct layout.
 */
#ifndef PSY_COORDINATOR_H
#define PSY_COORDINATOR_H

#include <psy_coordinator_layout.h>

/* ProgramError::Immutable (the runtime's builtin error 25): a writable account was passed read-only. */
#define PSY_ERROR_IMMUTABLE PSY_BUILTIN_ERROR(25)

static inline bool psy_key_eq(const uint8_t *a, const uint8_t *b) {
  return psy_pubkey_eq((const psy_pubkey_t *)a, (const psy_pubkey_t *)b);
}

static inline bool psy_key_is_zero(const uint8_t *k) {
  return (psy_load_u64(k) | psy_load_u64(k + 8) | psy_load_u64(k + 16) | psy_load_u64(k + 24)) == 0;
}

/* ---- instruction data (instruction_data.c) ------------------------------------------------------ */

typedef enum {
  PSY_OP_UPDATE,
  PSY_OP_SET_PAUSED,
  PSY_OP_JOIN_RUN,
  PSY_OP_TICK,
  PSY_OP_WITNESS,
  PSY_OP_WARMUP_WITNESS,
  PSY_OP_HEALTH_CHECK,
  PSY_OP_CHECKPOINT,
  PSY_OP_WITHDRAW,
  PSY_OP_CLOSE_RUN,
  PSY_OP_RELEASE_SLOT,
  PSY_OP_COMMIT_SEED,
  PSY_OP_REVEAL_SEED,
} psy_op_kind_t;

/* The part and the two filters of a witness or warmup witness instruction (pointers into the instruction data). */
typedef struct {
  uint64_t part;
  const uint8_t *participant;
  uint64_t participant_len;
  uint64_t batch_len;
} psy_proof_t;

/* One operation on an existing run: what the rules need, gathered from the instruction and its accounts. */
typedef struct {
  psy_op_kind_t kind;
  const uint8_t *data;       /* the instruction data, validated as decode_instruction would */
  psy_proof_t proof;         /* witness and warmup_witness only */
  uint8_t *state;            /* the coordinator account's data, from its discriminator */
  psy_account_t *accounts;   /* the instruction's accounts in order (close_run moves their lamports) */
  const uint8_t *signer;     /* key of the acting account */
  const uint8_t *authorizer; /* join_run's co-signer */
  int64_t now;               /* Clock.unix_timestamp, for join_run and the operations that tick */
} psy_op_t;

/* Validates the data of every instruction but init_coordinator (init.c checks its own) and sets
 * op->kind, op->data and op->proof; PSY_ERR_MALFORMED_INSTRUCTION when decode_instruction would fail. */
uint64_t psy_decode_instruction(const uint8_t *data, uint64_t len, psy_op_t *op);

/* ---- text (text.c): FixedStr fields ---------------------------------------------------------------- */

/* Bytes of text before the zero padding. */
uint64_t psy_text_len(const uint8_t *field, uint64_t size);
/* FixedStr decodes: zero padding after text that holds no NUL and is strict UTF-8. */
bool psy_text_valid(const uint8_t *field, uint64_t size);
/* Every byte of the text is printable ASCII (0x20-0x7e); true for the empty text. */
bool psy_text_printable(const uint8_t *field, uint64_t size);

/* ---- accounts (accounts.c) and init_coordinator (init.c) ------------------------------------------ */

/* The coordinator account is owned by this program, writable and exactly the layout's size. */
uint64_t psy_check_coordinator_account(const psy_account_t *a, const psy_pubkey_t *program_id);
/* Checks the accounts of op->kind and sets op->state, op->accounts, op->signer and op->authorizer. */
uint64_t psy_bind_accounts(const psy_input_t *in, psy_op_t *op);
/* init_coordinator: checks its data and accounts, creates the instance PDA, writes the initial state. */
uint64_t psy_init_coordinator(const psy_input_t *in);

/* ---- state access (state.c) ------------------------------------------------------------------------ */

/* The clients and pending lists share one shape: a u16 count, then fixed entries that begin with the
 * 32-byte id, the role and the stage. */
typedef struct {
  uint64_t count_offset;
  uint64_t entries_offset;
  uint64_t stride;
} psy_list_t;

static const psy_list_t PSY_CLIENTS = {PSY_ACCOUNT_NUM_CLIENTS_OFFSET, PSY_ACCOUNT_CLIENTS_OFFSET, PSY_CLIENT_SIZE};
static const psy_list_t PSY_PENDING = {PSY_ACCOUNT_NUM_PENDING_OFFSET, PSY_ACCOUNT_PENDING_OFFSET, PSY_PENDING_SIZE};

_Static_assert(PSY_CLIENT_ID_OFFSET == 0 && PSY_PENDING_ID_OFFSET == 0, "both lists start entries with the id");
_Static_assert(PSY_CLIENT_ROLE_OFFSET == PSY_PENDING_ROLE_OFFSET && PSY_CLIENT_STAGE_OFFSET == PSY_PENDING_STAGE_OFFSET &&
                   PSY_CLIENT_SLOT_OFFSET == PSY_PENDING_SLOT_OFFSET &&
                   PSY_CLIENT_VETERAN_OFFSET == PSY_PENDING_VETERAN_OFFSET,
               "both lists keep role, stage, slot and the veteran's flag at the same place");

static inline uint64_t psy_list_count(const uint8_t *s, const psy_list_t *list) {
  return psy_load_u16(s + list->count_offset);
}

static inline uint8_t *psy_list_entry(uint8_t *s, const psy_list_t *list, uint64_t i) {
  return s + list->entries_offset + i * list->stride;
}

/* Index of `id` in the list, or -1. */
int64_t psy_list_find(uint8_t *s, const psy_list_t *list, const uint8_t *id);
/* Sets the count, zeroing the entries past it (the layout encodes unused entries as zeros). */
void psy_list_set_count(uint8_t *s, const psy_list_t *list, uint64_t count);
/* Deletes entry i, shifting the later ones down. */
void psy_list_remove(uint8_t *s, const psy_list_t *list, uint64_t i);

static inline uint8_t *psy_current_round(uint8_t *s) { return s + PSY_ACCOUNT_ROUND_OFFSET; }

static inline void psy_bump_nonce(uint8_t *s) {
  PSY_ACCOUNT_NONCE_SET(s, PSY_ACCOUNT_NONCE_GET(s) + 1);
}

/* bloom.part_count: parts of a proof for a round of `clients` clients. */
static inline uint64_t psy_part_count(uint64_t clients) {
  return clients == 0 ? 1 : (clients + PSY_PART_CLIENTS - 1) / PSY_PART_CLIENTS;
}

/* Bits set in a round's witness mask (Round.witness_count). */
uint64_t psy_witness_count(const uint8_t *round);
/* derived.quorum: the configured quorum, capped by how many witnesses the clients allow. */
uint64_t psy_quorum(const uint8_t *s);
/* The round seed's data index: step × global_batch_size. */
uint64_t psy_data_index(const uint8_t *s);

/* Who a list of clients (its healthy ones) or admitted joiners holds: what derived.pipeline_complete looks at. */
typedef struct {
  uint16_t workers[PSY_MAX_STAGES]; /* workers per stage, for stages < num_stages */
  uint64_t members;
  bool has_trainer;
} psy_census_t;

void psy_census(uint8_t *s, const psy_list_t *list, psy_census_t *out);
/* derived.pipeline_formed: a worker in every stage and a trainer. */
bool psy_pipeline_formed(const uint8_t *s, const psy_census_t *census);
/* derived.pipeline_complete: min_clients members as well. */
bool psy_pipeline_complete(const uint8_t *s, const psy_census_t *census);
/* Drops every client that is not healthy, keeping the others' order; each one's left_out count moves with it. */
void psy_keep_healthy_clients(uint8_t *s);
/* pending = clients (as joiners, keeping their stages) + pending; clients = []. */
uint64_t psy_requeue_clients(uint8_t *s);

/* ---- selection (selection.c) and bloom (bloom.c) ------------------------------------------------- */

/* selection.next_seed(previous, 0, reveals): the seed of the round after the one whose seed is `previous` and whose
 * witnesses revealed the XOR `reveals` (32 bytes). Nothing from the transaction or the clock goes in, so no ticker
 * chooses an election by when it ticks. */
uint64_t psy_next_seed(uint64_t previous, const uint8_t *reveals);
/* derived.election: sets the round's witnesses (Round.witnesses) from its seed and the current clients' keys, the
 * lowest witness tickets first; one sha256 a client, so only the ticks that set a round's clients or seed call it. */
void psy_elect(uint8_t *s);
/* selection.assign_data's larger shares: one sample more in `samples` (indexed by the `trainers` current clients
 * that train, in client order) for each of the `extra` (0 < extra < trainers) first in the round's data order, the
 * lowest data tickets (selection.data_ticket); one sha256 a trainer. */
void psy_larger_shares(uint8_t *s, uint64_t trainers, uint64_t extra, uint32_t *samples);

/* The digests of a client's participant key and of its compute key (bloom.compute_key). */
void psy_client_digests(const uint8_t *id, uint8_t participant[32], uint8_t compute[32]);
bool psy_bloom_contains(const uint8_t *bloom, const uint8_t digest[32], uint64_t slices, uint64_t bits_per_slice);

/* ---- config (config.c) ------------------------------------------------------------------------------ */

uint64_t psy_validate_config(const uint8_t *config);
uint64_t psy_validate_model(const uint8_t *model, const uint8_t *config);
uint64_t psy_validate_checkpoint(const uint8_t *checkpoint);
/* Config.bloom_bytes */
uint64_t psy_bloom_bytes(const uint8_t *config);

/* ---- rules (rules.c, proofs.c) and the tick (tick.c) ----------------------------------------------- */

uint64_t psy_update(const psy_op_t *op);
uint64_t psy_set_paused(const psy_op_t *op);
uint64_t psy_join(const psy_op_t *op);
uint64_t psy_withdraw(const psy_op_t *op);
uint64_t psy_release_slot(const psy_op_t *op);
uint64_t psy_checkpoint(const psy_op_t *op);
/* rules.close_run, then the close itself: both accounts' lamports go to the authority and they cease to exist. */
uint64_t psy_close_run(const psy_op_t *op);
uint64_t psy_witness(const psy_op_t *op);
uint64_t psy_warmup_witness(const psy_op_t *op);
uint64_t psy_health_check(const psy_op_t *op);
/* derived.elected: how many witnesses the current round has; psy_elected_client: the client index in slot
 * `position` (below that count), read from the round's witnesses. */
uint64_t psy_elected_count(uint8_t *s);
/* derived.revealing: the warmup still waits for its joiners' reveals (its seats hold UNELECTED). */
bool psy_revealing(uint8_t *s);
/* reveals.join_reveals_over and close_join_reveals (in the warmup's tick). */
bool psy_join_reveals_over(uint8_t *s, int64_t now);
void psy_close_join_reveals(uint8_t *s);
/* Every seat UNELECTED, as the warmup's admission leaves them when a joiner committed to a secret. */
void psy_unelect(uint8_t *s);
/* Whether an admitted client still holds a commitment from its join. */
bool psy_any_join_commitment(uint8_t *s);
uint64_t psy_elected_client(uint8_t *s, uint64_t position);
/* rules._elected_position: the witness slot of client `index` in the current round, or PSY_ERR_NOT_A_WITNESS. */
uint64_t psy_witness_position(uint8_t *s, uint64_t index, uint64_t *position);
/* beacon.c: rules.commit_seed, rules.reveal_seed, and rules._withholders_leave at the round's end. */
uint64_t psy_commit_seed(const psy_op_t *op);
uint64_t psy_reveal_seed(const psy_op_t *op);
void psy_withholders_leave(uint8_t *s);
/* The signer's client index if it is a healthy client (rules._healthy_client), else its error. */
uint64_t psy_healthy_client(uint8_t *s, const uint8_t *signer, uint64_t *index);
uint64_t psy_tick(uint8_t *s, int64_t now);

/* ---- points (points.c) ------------------------------------------------------------------------------ */

/* rules.tally_part: the votes of one proof part's participant filter, for the clients the part covers. */
void psy_tally_part(uint8_t *s, uint64_t part, const uint8_t *participant_bloom);
/* points.credit_chunk: the next clients of the ending round earn their points, from the round's credited count on. */
void psy_credit_chunk(uint8_t *s);
/* rules._close_round_votes: the ending round's votes become the left_out counts of the clients that stay. */
void psy_close_round_votes(uint8_t *s);

#endif /* PSY_COORDINATOR_H */
