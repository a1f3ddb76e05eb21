/* text.c: FixedStr fields (run ids, dataset, checkpoint repo and revision), byte for byte as layout.py
 * decodes them and as the rules test them. */
#include "coordinator.h"

uint64_t psy_text_len(const uint8_t *field, uint64_t size) {
  uint64_t n = 0;
  while (n < size && field[n] != 0) {
    n++;
  }
  return n;
}

/* The length of the UTF-8 sequence starting at p[0] (p holds n > 0 bytes), or 0 if Python's strict
 * decoder rejects it: no overlong forms, no surrogates (U+D800-DFFF), nothing above U+10FFFF. */
static uint64_t utf8_sequence(const uint8_t *p, uint64_t n) {
  uint8_t lead = p[0];
  uint64_t length;
  uint8_t low = 0x80, high = 0xbf; /* the range of the second byte */
  if (lead < 0x80) {
    return 1;
  } else if (lead >= 0xc2 && lead <= 0xdf) {
    length = 2;
  } else if (lead >= 0xe0 && lead <= 0xef) {
    length = 3;
    low = lead == 0xe0 ? 0xa0 : low;
    high = lead == 0xed ? 0x9f : high;
  } else if (lead >= 0xf0 && lead <= 0xf4) {
    length = 4;
    low = lead == 0xf0 ? 0x90 : low;
    high = lead == 0xf4 ? 0x8f : high;
  } else {
    return 0;
  }
  if (n < length || p[1] < low || p[1] > high) {
    return 0;
  }
  for (uint64_t i = 2; i < length; i++) {
    if ((p[i] & 0xc0) != 0x80) {
      return 0;
    }
  }
  return length;
}

bool psy_text_valid(const uint8_t *field, uint64_t size) {
  /* FixedStr strips trailing zeros, then rejects a NUL left inside: so after the first zero byte every
   * byte must be zero. */
  uint64_t n = psy_text_len(field, size);
  for (uint64_t i = n; i < size; i++) {
    if (field[i] != 0) {
      return false;
    }
  }
  for (uint64_t i = 0; i < n;) {
    uint64_t step = utf8_sequence(field + i, n - i);
    if (step == 0) {
      return false;
    }
    i += step;
  }
  return true;
}

bool psy_text_printable(const uint8_t *field, uint64_t size) {
  /* Multi-byte UTF-8 characters are all bytes >= 0x80, so a byte test matches the character test. */
  uint64_t n = psy_text_len(field, size);
  for (uint64_t i = 0; i < n; i++) {
    if (field[i] < 0x20 || field[i] > 0x7e) {
      return false;
    }
  }
  return true;
}
