/* bloom.c: membership in a witness's participant filter from its raw bits, as bloom.contains_raw tests it
 * (pybloom-live's bit positions for 11-16 slices of fewer than 32,768 bits), for a client's participant key and
 * its compute key. */
#include "coordinator.h"

static const uint8_t SALT_PREFIX[32] = PSY_BLOOM_SALT_PREFIX;
/* HEX_PAIRS[b] is byte b in lowercase hex, its two characters as the u16 a little-endian load of them yields:
 * one load and one store per byte of an id. */
#define HEX_CHAR(n) ((n) < 10 ? '0' + (n) : 'a' + (n) - 10)
#define HEX_PAIR(b) (uint16_t)(HEX_CHAR((b) >> 4) | HEX_CHAR((b) & 15) << 8)
#define HEX_PAIRS_4(b) HEX_PAIR(b), HEX_PAIR((b) + 1), HEX_PAIR((b) + 2), HEX_PAIR((b) + 3)
#define HEX_PAIRS_16(b) HEX_PAIRS_4(b), HEX_PAIRS_4((b) + 4), HEX_PAIRS_4((b) + 8), HEX_PAIRS_4((b) + 12)
#define HEX_PAIRS_64(b) HEX_PAIRS_16(b), HEX_PAIRS_16((b) + 16), HEX_PAIRS_16((b) + 32), HEX_PAIRS_16((b) + 48)
static const uint16_t HEX_PAIRS[256] = {HEX_PAIRS_64(0), HEX_PAIRS_64(64), HEX_PAIRS_64(128), HEX_PAIRS_64(192)};

#define PREFIX_LEN (sizeof(PSY_COMPUTE_KEY_PREFIX) - 1)
_Static_assert(PREFIX_LEN == sizeof(uint64_t), "the compute key's prefix is written as one u64");

/* bloom.compute_key is bloom.participant_key (the id in lowercase hex) behind a prefix, so one buffer holds
 * both keys: the compute key is all of it, the participant key its tail. */
static void write_keys(const uint8_t *id, uint8_t keys[PREFIX_LEN + 2 * PSY_PUBKEY_BYTES]) {
  psy_store_u64(keys, psy_load_u64(PSY_COMPUTE_KEY_PREFIX));
  uint8_t *hex = keys + PREFIX_LEN;
#pragma clang loop unroll(full) /* every witness proof writes the keys of every client: 5 instructions a byte */
  for (uint64_t i = 0; i < PSY_PUBKEY_BYTES; i++) {
    psy_store_u16(hex + 2 * i, HEX_PAIRS[id[i]]);
  }
}

static void key_digest(const uint8_t *key, uint64_t len, uint8_t digest[32]) {
  psy_bytes_t pieces[2] = {{SALT_PREFIX, sizeof SALT_PREFIX}, {key, len}};
  sol_sha256(pieces, 2, digest);
}

void psy_client_digests(const uint8_t *id, uint8_t participant[32], uint8_t compute[32]) {
  uint8_t keys[PREFIX_LEN + 2 * PSY_PUBKEY_BYTES];
  write_keys(id, keys);
  key_digest(keys + PREFIX_LEN, 2 * PSY_PUBKEY_BYTES, participant);
  key_digest(keys, sizeof keys, compute);
}

bool psy_bloom_contains(const uint8_t *bloom, const uint8_t digest[32], uint64_t slices, uint64_t bits_per_slice) {
  uint64_t slice_start = 0;
  for (const uint8_t *word = digest; word < digest + 2 * slices; word += 2) {
    uint64_t bit = slice_start + psy_load_u16(word) % bits_per_slice;
    if (((bloom[bit >> 3] >> (bit & 7)) & 1) == 0) {
      return false;
    }
    slice_start += bits_per_slice;
  }
  return true;
}
