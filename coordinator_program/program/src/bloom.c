/* bloom.c: membership in a witness's participant filter from its raw bits, as bloom.contains_raw tests it
 * (pybloom-live's bit positions for 11-16 slices of fewer than 32,768 bits). */
#include "coordinator.h"

static const uint8_t SALT_PREFIX[32] = PSY_BLOOM_SALT_PREFIX;
static const char HEX_DIGITS[16] = "0123456789abcdef";

void psy_participant_digest(const uint8_t *id, uint8_t digest[32]) {
  uint8_t hex[2 * PSY_PUBKEY_BYTES]; /* bloom.participant_key: the id in lowercase hex */
  for (uint64_t i = 0; i < PSY_PUBKEY_BYTES; i++) {
    hex[2 * i] = (uint8_t)HEX_DIGITS[id[i] >> 4];
    hex[2 * i + 1] = (uint8_t)HEX_DIGITS[id[i] & 15];
  }
  psy_bytes_t pieces[2] = {{SALT_PREFIX, sizeof SALT_PREFIX}, {hex, sizeof hex}};
  sol_sha256(pieces, 2, digest);
}

bool psy_bloom_contains(const uint8_t *bloom, const uint8_t digest[32], uint64_t slices, uint64_t bits_per_slice) {
  for (uint64_t slice = 0; slice < slices; slice++) {
    uint64_t bit = slice * bits_per_slice + psy_load_u16(digest + 2 * slice) % bits_per_slice;
    if ((bloom[bit >> 3] & (1u << (bit & 7))) == 0) {
      return false;
    }
  }
  return true;
}
