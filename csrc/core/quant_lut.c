/*
 * An exact lookup table for nearest-code quantization on the CPU.
 *
 * The binary search of mf_quantize_nearest costs eight dependent loads per element.
 * Instead, floats are grouped into buckets by sign, exponent and the top 10 mantissa
 * bits; each bucket is a contiguous range of float bit patterns, and nearest-code is
 * monotone in x, so if both ends of a bucket map to the same code, every float in it
 * does. Such buckets store the code; the few buckets that straddle a decision
 * boundary (about 3% for the dynamic map) store MF_LUT_FALLBACK and their elements
 * take the binary search. The result is bit-identical to the binary search (and so
 * to the CUDA kernel): the table only skips work, it never approximates.
 *
 * Tables are cached per distinct code (memcmp of the 256 floats) and never freed, so
 * a pointer handed out stays valid while other threads insert. 139 KB each.
 */
#include "quant_lut.h"

#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#define MF_LUT_CACHE 8

typedef struct {
  float code[MF_CODE_SIZE];
  uint16_t *lut;
} lut_entry;

static lut_entry cache[MF_LUT_CACHE];
static int cache_used = 0;
static atomic_flag cache_lock = ATOMIC_FLAG_INIT;

static void lock(void) {
  while (atomic_flag_test_and_set_explicit(&cache_lock, memory_order_acquire)) {
  }
}
static void unlock(void) { atomic_flag_clear_explicit(&cache_lock, memory_order_release); }

/* First and last float bit patterns of bucket `slot` for the given sign. */
static void bucket_ends(uint32_t sign, uint32_t slot, uint32_t *lo, uint32_t *hi) {
  uint32_t s = sign << 31;
  if (slot < (1u << MF_LUT_MANT_BITS)) { /* slot 0 is |x| < 2^-32; 1..1023 unused */
    *lo = s;
    *hi = s | (((uint32_t)MF_LUT_EXP_LO << 23) - 1u);
    return;
  }
  uint32_t e = (slot >> MF_LUT_MANT_BITS) - 1u + MF_LUT_EXP_LO;
  uint32_t m = slot & ((1u << MF_LUT_MANT_BITS) - 1u);
  *lo = s | (e << 23) | (m << (23 - MF_LUT_MANT_BITS));
  *hi = *lo | ((1u << (23 - MF_LUT_MANT_BITS)) - 1u);
}

static uint16_t *build(const float *code) {
  uint16_t *lut = (uint16_t *)malloc(MF_LUT_SIZE * sizeof(uint16_t));
  if (!lut) return NULL;
#pragma omp parallel for schedule(static) num_threads(mf_get_num_threads())
  for (int32_t i = 0; i < MF_LUT_SIZE; i++) {
    uint32_t sign = (uint32_t)i / MF_LUT_PER_SIGN, slot = (uint32_t)i % MF_LUT_PER_SIGN, lo, hi;
    if (slot > 0 && slot < (1u << MF_LUT_MANT_BITS)) {
      lut[i] = MF_LUT_FALLBACK; /* never addressed */
      continue;
    }
    bucket_ends(sign, slot, &lo, &hi);
    uint8_t a = mf_quantize_nearest(code, mf_f32_from_bits(lo));
    uint8_t b = mf_quantize_nearest(code, mf_f32_from_bits(hi));
    lut[i] = a == b ? a : MF_LUT_FALLBACK;
  }
  return lut;
}

const uint16_t *mf_quant_lut_get(const float *code) {
  const uint16_t *found = NULL;
  lock();
  for (int i = 0; i < cache_used; i++)
    if (!memcmp(cache[i].code, code, sizeof cache[i].code)) found = cache[i].lut;
  unlock();
  if (found) return found;
  uint16_t *lut = build(code); /* outside the lock: building takes a while */
  if (!lut) return NULL;
  lock();
  for (int i = 0; i < cache_used && !found; i++) /* another thread may have won */
    if (!memcmp(cache[i].code, code, sizeof cache[i].code)) found = cache[i].lut;
  if (!found && cache_used < MF_LUT_CACHE) {
    memcpy(cache[cache_used].code, code, sizeof cache[cache_used].code);
    cache[cache_used].lut = lut;
    cache_used++;
    found = lut;
    lut = NULL;
  }
  unlock();
  free(lut); /* NULL when it went into the cache */
  return found; /* NULL when the cache is full: callers use the binary search */
}
