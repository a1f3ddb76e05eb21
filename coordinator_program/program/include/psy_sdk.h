/*
 * psy_sdk.h: the small C SDK psyswarm's on-chain programs are written on.
 *
 * Target: SBPFv0 as run by Solana's BPF loader 2 / upgradeable loader, reached through upstream
 * clang-14 (-target bpf -mcpu=v2) and the project's own linker (coordinator_program/program/linker.py).
 * Solana's C SDK is not available here, so this header defines what a program needs itself:
 *
 *   - the entrypoint input deserializer (psy_deserialize) for the loader's aligned input format;
 *   - syscall prototypes (sol_*), which the linker turns into dynamic syscall relocations;
 *   - pubkey comparison, unaligned little-endian loads/stores for Borsh-style codecs, logging macros;
 *   - system program CPI helpers (create_account, transfer, allocate, assign) with PDA signing;
 *   - a bump allocator on the 32 KiB heap (there is no writable global data in SBPFv0);
 *   - return-code conventions (builtin program errors, custom and Anchor-style errors).
 *
 * Constraints that shape every function here (see shared/notes/sbf-toolchain.md): a stack frame is at
 * most 512 bytes (clang rejects more), at most 5 arguments (larger calls take a struct pointer), no
 * struct returns, no writable globals, and variable-length copies go through sol_memcpy_.
 *
 * Types come from the compiler's own freestanding <stdint.h>, <stdbool.h> and <stddef.h> (build.py
 * always passes -ffreestanding, so no host C library header is involved).
 */
#ifndef PSY_SDK_H
#define PSY_SDK_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

_Static_assert(sizeof(void *) == 8, "psy_sdk.h targets 64-bit BPF");
_Static_assert(sizeof(uint64_t) == 8 && sizeof(uint32_t) == 4 && sizeof(uint16_t) == 2, "fixed-width types");

/* ---------------------------------------------------------------------------------------------- */
/* Return codes: what entrypoint returns in r0.                                                     */
/* ---------------------------------------------------------------------------------------------- */

/* 0 is success. A value below 2^32 is a custom error and surfaces as InstructionError::Custom(value).
 * A builtin error is its index shifted left by 32 (the runtime's ProgramError encoding). */
#define PSY_SUCCESS 0ULL
#define PSY_BUILTIN_ERROR(index) ((uint64_t)(index) << 32)

/* Custom(0) cannot be returned as 0 (that is success), so the runtime reserves builtin index 1 for it.
 * The macro evaluates `code` twice: pass a constant or a plain variable. */
#define PSY_ERROR_CUSTOM(code) ((uint32_t)(code) == 0 ? PSY_BUILTIN_ERROR(1) : (uint64_t)(uint32_t)(code))

/* Anchor numbers a program's own errors (#[error_code]) from 6000; clients decode them from the IDL. */
#define PSY_ANCHOR_ERROR_BASE 6000u
#define PSY_ANCHOR_ERROR(n) PSY_ERROR_CUSTOM(PSY_ANCHOR_ERROR_BASE + (uint32_t)(n))

#define PSY_ERROR_INVALID_ARGUMENT PSY_BUILTIN_ERROR(2)
#define PSY_ERROR_INVALID_INSTRUCTION_DATA PSY_BUILTIN_ERROR(3)
#define PSY_ERROR_INVALID_ACCOUNT_DATA PSY_BUILTIN_ERROR(4)
#define PSY_ERROR_ACCOUNT_DATA_TOO_SMALL PSY_BUILTIN_ERROR(5)
#define PSY_ERROR_INSUFFICIENT_FUNDS PSY_BUILTIN_ERROR(6)
#define PSY_ERROR_INCORRECT_PROGRAM_ID PSY_BUILTIN_ERROR(7)
#define PSY_ERROR_MISSING_REQUIRED_SIGNATURES PSY_BUILTIN_ERROR(8)
#define PSY_ERROR_ACCOUNT_ALREADY_INITIALIZED PSY_BUILTIN_ERROR(9)
#define PSY_ERROR_UNINITIALIZED_ACCOUNT PSY_BUILTIN_ERROR(10)
#define PSY_ERROR_NOT_ENOUGH_ACCOUNT_KEYS PSY_BUILTIN_ERROR(11)
#define PSY_ERROR_MAX_SEED_LENGTH_EXCEEDED PSY_BUILTIN_ERROR(13)
#define PSY_ERROR_INVALID_SEEDS PSY_BUILTIN_ERROR(14)
#define PSY_ERROR_UNSUPPORTED_SYSVAR PSY_BUILTIN_ERROR(17)
#define PSY_ERROR_ILLEGAL_OWNER PSY_BUILTIN_ERROR(18)
#define PSY_ERROR_INVALID_ACCOUNT_OWNER PSY_BUILTIN_ERROR(23)
#define PSY_ERROR_ARITHMETIC_OVERFLOW PSY_BUILTIN_ERROR(24)

/* ---------------------------------------------------------------------------------------------- */
/* Core types. Their layouts are the runtime's C ABI: the CPI syscall reads them field by field.     */
/* ---------------------------------------------------------------------------------------------- */

#define PSY_PUBKEY_BYTES 32

typedef struct {
  uint8_t bytes[PSY_PUBKEY_BYTES];
} psy_pubkey_t;

/* One account of the instruction. The pointers point into the input region, so writing *lamports,
 * data[..] or *owner changes the account (when it is writable and owned by the program). This is also
 * exactly the AccountInfo layout sol_invoke_signed_c takes, so an array of these passes straight to CPI.
 * A duplicate account (the same account listed twice in the instruction) is a copy of the first entry:
 * both share the same key/data pointers, so `a->key == b->key` tells duplicates apart. */
typedef struct {
  psy_pubkey_t *key;
  uint64_t *lamports;
  uint64_t data_len;
  uint8_t *data;
  psy_pubkey_t *owner;
  uint64_t rent_epoch;
  bool is_signer;
  bool is_writable;
  bool executable;
} psy_account_t;

_Static_assert(sizeof(psy_account_t) == 56, "psy_account_t must match the runtime's C AccountInfo");

/* A byte slice: a sha256 input piece, a PDA seed, return data. */
typedef struct {
  const uint8_t *addr;
  uint64_t len;
} psy_bytes_t;

/* The seeds of one PDA signer of a CPI (the bump byte included as the last seed). */
typedef struct {
  const psy_bytes_t *seeds;
  uint64_t len;
} psy_signer_seeds_t;

typedef struct {
  const psy_pubkey_t *pubkey;
  bool is_writable;
  bool is_signer;
} psy_account_meta_t;

typedef struct {
  const psy_pubkey_t *program_id;
  const psy_account_meta_t *accounts;
  uint64_t accounts_len;
  const uint8_t *data;
  uint64_t data_len;
} psy_instruction_t;

_Static_assert(sizeof(psy_account_meta_t) == 16 && sizeof(psy_instruction_t) == 40, "CPI C ABI layouts");

/* The Clock sysvar as sol_get_clock_sysvar writes it. */
typedef struct {
  uint64_t slot;
  int64_t epoch_start_timestamp;
  uint64_t epoch;
  uint64_t leader_schedule_epoch;
  int64_t unix_timestamp;
} psy_clock_t;

/* The Rent sysvar as sol_get_rent_sysvar writes it. exemption_threshold is an IEEE f64 (BPF has no
 * floating point, so it is kept as raw bits; psy_rent_exempt_minimum decodes it). */
typedef struct {
  uint64_t lamports_per_byte_year;
  uint64_t exemption_threshold_bits;
  uint8_t burn_percent;
} psy_rent_t;

_Static_assert(sizeof(psy_clock_t) == 40 && sizeof(psy_rent_t) == 24, "sysvar layouts");

/* ---------------------------------------------------------------------------------------------- */
/* Syscalls. The names are resolved by the loader; the linker checks they are known ones.           */
/* ---------------------------------------------------------------------------------------------- */

void sol_log_(const char *message, uint64_t len);
void sol_log_64_(uint64_t a, uint64_t b, uint64_t c, uint64_t d, uint64_t e);
void sol_log_compute_units_(void);
void sol_log_pubkey(const psy_pubkey_t *key);
uint64_t sol_sha256(const psy_bytes_t *pieces, uint64_t pieces_len, uint8_t *hash_out);
uint64_t sol_get_clock_sysvar(psy_clock_t *out);
uint64_t sol_get_rent_sysvar(psy_rent_t *out);
/* dst and src must not overlap (the runtime fails the instruction if they do; use sol_memmove_). */
void sol_memcpy_(void *dst, const void *src, uint64_t n);
void sol_memmove_(void *dst, const void *src, uint64_t n);
void sol_memset_(void *dst, uint8_t value, uint64_t n);
void sol_memcmp_(const void *a, const void *b, uint64_t n, int32_t *result);
uint64_t sol_invoke_signed_c(const psy_instruction_t *instruction, const psy_account_t *account_infos,
                             uint64_t account_infos_len, const psy_signer_seeds_t *signers,
                             uint64_t signers_len);
uint64_t sol_create_program_address(const psy_bytes_t *seeds, uint64_t seeds_len, const psy_pubkey_t *program_id,
                                    psy_pubkey_t *address_out);
uint64_t sol_try_find_program_address(const psy_bytes_t *seeds, uint64_t seeds_len,
                                      const psy_pubkey_t *program_id, psy_pubkey_t *address_out,
                                      uint8_t *bump_out);
void sol_set_return_data(const uint8_t *data, uint64_t len);

/* Every program defines this: it receives the serialized input and returns PSY_SUCCESS or an error. */
uint64_t entrypoint(const uint8_t *input);

/* ---------------------------------------------------------------------------------------------- */
/* Small helpers                                                                                    */
/* ---------------------------------------------------------------------------------------------- */

/* Logs a string literal (its length is known at compile time). */
#define psy_log(literal) sol_log_((literal), sizeof(literal) - 1)

/* Unaligned little-endian access. The SBPF VM allows unaligned loads and stores and BPF is little-endian,
 * so each of these is one ldx/stx instruction (a packed or aligned(1) type would make clang split it into
 * byte loads); may_alias keeps them legal C over byte buffers. Use them for Borsh fields in instruction
 * and account data, which have no alignment guarantee. */
typedef uint64_t __attribute__((may_alias)) psy__u64_alias;
typedef uint32_t __attribute__((may_alias)) psy__u32_alias;
typedef uint16_t __attribute__((may_alias)) psy__u16_alias;

static inline uint64_t psy_load_u64(const void *p) { return *(const psy__u64_alias *)p; }
static inline uint32_t psy_load_u32(const void *p) { return *(const psy__u32_alias *)p; }
static inline uint16_t psy_load_u16(const void *p) { return *(const psy__u16_alias *)p; }
static inline void psy_store_u64(void *p, uint64_t v) { *(psy__u64_alias *)p = v; }
static inline void psy_store_u32(void *p, uint32_t v) { *(psy__u32_alias *)p = v; }
static inline void psy_store_u16(void *p, uint16_t v) { *(psy__u16_alias *)p = v; }

/* Pubkey equality in four 8-byte loads (keys in the input may be unaligned, e.g. the program id). */
static inline bool psy_pubkey_eq(const psy_pubkey_t *a, const psy_pubkey_t *b) {
  const uint8_t *x = a->bytes, *y = b->bytes;
  return ((psy_load_u64(x) ^ psy_load_u64(y)) | (psy_load_u64(x + 8) ^ psy_load_u64(y + 8)) |
          (psy_load_u64(x + 16) ^ psy_load_u64(y + 16)) | (psy_load_u64(x + 24) ^ psy_load_u64(y + 24))) == 0;
}

/* Byte comparison of n bytes (memcmp's sign convention) through the sol_memcmp_ syscall. */
static inline int32_t psy_memcmp(const void *a, const void *b, uint64_t n) {
  int32_t result = 0;
  sol_memcmp_(a, b, n, &result);
  return result;
}

/* ---------------------------------------------------------------------------------------------- */
/* Entrypoint input (loader 2 / upgradeable loader, aligned format)                                 */
/* ---------------------------------------------------------------------------------------------- */

/* Layout of the input region, all little-endian:
 *   u64 number of accounts, then per account either
 *     u8 0xff, u8 is_signer, u8 is_writable, u8 executable, 4 bytes padding, 32 key, 32 owner,
 *     u64 lamports, u64 data_len, data, 10 KiB of room to grow, padding to 8, u64 rent_epoch
 *   or, for a duplicate, u8 index of the first occurrence and 7 bytes padding;
 *   then u64 instruction data length, the data, and the 32-byte program id. */
#define PSY_NON_DUP_MARKER 0xff
#define PSY_MAX_PERMITTED_DATA_INCREASE (10u * 1024u)

typedef struct {
  const psy_pubkey_t *program_id;
  psy_account_t *accounts;   /* the caller's array */
  uint64_t accounts_len;     /* entries filled: min(total_accounts, capacity) */
  uint64_t total_accounts;   /* accounts in the input; more than accounts_len if the array was too small */
  const uint8_t *data;       /* instruction data (no alignment guarantee) */
  uint64_t data_len;
} psy_input_t;

/* Parses the input into `out`, filling up to `capacity` entries of `accounts` (which the caller owns:
 * a local array, or psy_alloc'ed when the stack is too small for it). Input from the runtime is always
 * well formed, so this cannot fail; check out->total_accounts against what the instruction expects. */
static inline void psy_deserialize(const uint8_t *input, psy_input_t *out, psy_account_t *accounts,
                                   uint64_t capacity) {
  uint64_t total = psy_load_u64(input);
  input += sizeof(uint64_t);
  for (uint64_t i = 0; i < total; i++) {
    uint8_t dup = input[0];
    if (dup != PSY_NON_DUP_MARKER) {
      if (i < capacity) {
        accounts[i] = accounts[dup]; /* dup < i < capacity: the original was filled */
      }
      input += sizeof(uint64_t);
      continue;
    }
    uint64_t data_len = psy_load_u64(input + 80);
    if (i < capacity) {
      psy_account_t *a = &accounts[i];
      a->is_signer = input[1] != 0;
      a->is_writable = input[2] != 0;
      a->executable = input[3] != 0;
      a->key = (psy_pubkey_t *)(input + 8);
      a->owner = (psy_pubkey_t *)(input + 40);
      a->lamports = (uint64_t *)(input + 72);
      a->data_len = data_len;
      a->data = (uint8_t *)(input + 88);
    }
    input += 88 + data_len + PSY_MAX_PERMITTED_DATA_INCREASE;
    input = (const uint8_t *)(((uint64_t)input + 7) & ~7ULL);
    if (i < capacity) {
      accounts[i].rent_epoch = psy_load_u64(input);
    }
    input += sizeof(uint64_t);
  }
  out->accounts = accounts;
  out->accounts_len = total < capacity ? total : capacity;
  out->total_accounts = total;
  out->data_len = psy_load_u64(input);
  out->data = input + sizeof(uint64_t);
  out->program_id = (const psy_pubkey_t *)(out->data + out->data_len);
}

/* ---------------------------------------------------------------------------------------------- */
/* Heap: a bump allocator on the region the runtime zeroes for each instruction                     */
/* ---------------------------------------------------------------------------------------------- */

#define PSY_HEAP_START 0x300000000ULL
#ifndef PSY_HEAP_LENGTH
#define PSY_HEAP_LENGTH (32u * 1024u) /* the default; raise it only with a ComputeBudget heap request */
#endif

/* Returns 8-byte aligned, zeroed memory, or NULL when the heap is exhausted. Nothing is ever freed
 * (an instruction is short-lived). There is no writable global for the cursor, so it lives in the first
 * heap word: 0 there (the runtime's zero fill) means nothing has been allocated yet. Memory is zero
 * because the heap starts zeroed and is never handed out twice. */
static inline void *psy_alloc(uint64_t size) {
  uint64_t *cursor = (uint64_t *)PSY_HEAP_START;
  uint64_t next = *cursor ? *cursor : PSY_HEAP_START + sizeof(uint64_t);
  if (size > PSY_HEAP_START + PSY_HEAP_LENGTH - next) {
    return NULL;
  }
  *cursor = next + ((size + 7) & ~7ULL);
  return (void *)next;
}

/* ---------------------------------------------------------------------------------------------- */
/* Sysvar helpers                                                                                   */
/* ---------------------------------------------------------------------------------------------- */

/* Minimum lamports for an account of data_len bytes to be rent exempt:
 * (128 + data_len) * lamports_per_byte_year * exemption_threshold. The threshold is an f64 the program
 * cannot compute with, so it is decoded from its bits; only a whole-number threshold (2.0 on every
 * cluster) is supported, anything else returns PSY_ERROR_UNSUPPORTED_SYSVAR. */
static inline uint64_t psy_rent_exempt_minimum(uint64_t data_len, uint64_t *lamports_out) {
  psy_rent_t rent;
  uint64_t err = sol_get_rent_sysvar(&rent);
  if (err != PSY_SUCCESS) {
    return err;
  }
  uint64_t bits = rent.exemption_threshold_bits;
  uint64_t exponent = (bits >> 52) & 0x7ff;
  uint64_t mantissa = (bits & ((1ULL << 52) - 1)) | (1ULL << 52);
  if ((bits >> 63) != 0 || exponent < 1023 || exponent > 1023 + 52) {
    return PSY_ERROR_UNSUPPORTED_SYSVAR;
  }
  uint64_t shift = 52 - (exponent - 1023);
  if ((mantissa & ((1ULL << shift) - 1)) != 0) {
    return PSY_ERROR_UNSUPPORTED_SYSVAR;
  }
  *lamports_out = (128 + data_len) * rent.lamports_per_byte_year * (mantissa >> shift);
  return PSY_SUCCESS;
}

/* ---------------------------------------------------------------------------------------------- */
/* CPI into the system program                                                                      */
/* ---------------------------------------------------------------------------------------------- */

/* The system program's id is 32 zero bytes. The runtime finds the callee among the accounts of the
 * current instruction, so the transaction must list the system program in this instruction's accounts;
 * it need not be in the account_infos passed to sol_invoke_signed_c. */

typedef struct {
  psy_account_t *payer;               /* funds the new account: signer, writable */
  psy_account_t *new_account;         /* writable; a signer of the transaction, or a PDA in `signers` */
  uint64_t lamports;
  uint64_t space;                     /* at most 10 KiB when created through CPI */
  const psy_pubkey_t *owner;          /* the program that will own it, typically input.program_id */
  const psy_signer_seeds_t *signers;  /* seeds of PDA signers, or NULL */
  uint64_t signers_len;
} psy_create_account_t;

typedef struct {
  psy_account_t *from;                /* system-owned, signer (or a PDA in `signers`), writable */
  psy_account_t *to;                  /* writable */
  uint64_t lamports;
  const psy_signer_seeds_t *signers;
  uint64_t signers_len;
} psy_transfer_t;

/* What the system helpers share: a system instruction over one account (allocate, assign: `second` is NULL)
 * or two (create_account, transfer). `first` is always a writable signer. */
typedef struct {
  psy_account_t *first;
  psy_account_t *second;
  bool second_signs;
  const uint8_t *data;
  uint64_t data_len;
  const psy_signer_seeds_t *signers;
  uint64_t signers_len;
} psy__system_call_t;

static inline __attribute__((noinline)) uint64_t psy__system_invoke(const psy__system_call_t *c) {
  psy_pubkey_t system_program = {{0}};
  uint64_t count = c->second != NULL ? 2 : 1;
  psy_account_t *second = c->second != NULL ? c->second : c->first;
  psy_account_meta_t metas[2] = {
      {c->first->key, true, true},
      {second->key, true, c->second_signs},
  };
  /* The runtime writes each account's new data length back into these copies, so copy them back:
   * after creating or allocating an account, its data_len is its new size. */
  psy_account_t infos[2] = {*c->first, *second};
  psy_instruction_t instruction = {&system_program, metas, count, c->data, c->data_len};
  uint64_t err = sol_invoke_signed_c(&instruction, infos, count, c->signers, c->signers_len);
  c->first->data_len = infos[0].data_len;
  second->data_len = infos[count - 1].data_len;
  return err;
}

/* SystemInstruction::CreateAccount { lamports, space, owner }: bincode u32 tag 0, u64, u64, pubkey. */
static inline uint64_t psy_system_create_account(const psy_create_account_t *args) {
  uint8_t data[4 + 8 + 8 + PSY_PUBKEY_BYTES];
  psy_store_u32(data, 0);
  psy_store_u64(data + 4, args->lamports);
  psy_store_u64(data + 12, args->space);
  __builtin_memcpy(data + 20, args->owner->bytes, PSY_PUBKEY_BYTES);
  psy__system_call_t call = {args->payer, args->new_account, true, data, sizeof data, args->signers,
                             args->signers_len};
  return psy__system_invoke(&call);
}

/* SystemInstruction::Transfer { lamports }: bincode u32 tag 2, u64. */
static inline uint64_t psy_system_transfer(const psy_transfer_t *args) {
  uint8_t data[4 + 8];
  psy_store_u32(data, 2);
  psy_store_u64(data + 4, args->lamports);
  psy__system_call_t call = {args->from, args->to, false, data, sizeof data, args->signers, args->signers_len};
  return psy__system_invoke(&call);
}

/* SystemInstruction::Assign { owner }: bincode u32 tag 1, pubkey. `account` must sign (a PDA through
 * `signers`), be system-owned and hold no data. */
static inline uint64_t psy_system_assign(psy_account_t *account, const psy_pubkey_t *owner,
                                         const psy_signer_seeds_t *signers, uint64_t signers_len) {
  uint8_t data[4 + PSY_PUBKEY_BYTES];
  psy_store_u32(data, 1);
  __builtin_memcpy(data + 4, owner->bytes, PSY_PUBKEY_BYTES);
  psy__system_call_t call = {account, NULL, false, data, sizeof data, signers, signers_len};
  return psy__system_invoke(&call);
}

/* SystemInstruction::Allocate { space }: bincode u32 tag 8, u64. The same conditions as assign; unlike
 * create_account it does not care how many lamports the account already holds. */
static inline uint64_t psy_system_allocate(psy_account_t *account, uint64_t space, const psy_signer_seeds_t *signers,
                                           uint64_t signers_len) {
  uint8_t data[4 + 8];
  psy_store_u32(data, 8);
  psy_store_u64(data + 4, space);
  psy__system_call_t call = {account, NULL, false, data, sizeof data, signers, signers_len};
  return psy__system_invoke(&call);
}

#endif /* PSY_SDK_H */
