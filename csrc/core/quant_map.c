/*
 * Code tables for blockwise quantization.
 *
 * Dynamic (tree) map, Dettmers et al. 2022, "8-bit Optimizers via Block-wise
 * Quantization", section 2 / appendix: each value is a power of ten times a
 * fraction. For exponent i = 0 .. E-1 (E = max_exponent_bits) the fractions are the
 * midpoints of F_i + 1 evenly spaced points in [0.1, 1], scaled by 10^(i - (E - 1)):
 * small exponents get few fractions, large ones many, so the code is dense near 0
 * (where optimizer states live) and still reaches 1.0. With S = total_bits - 1:
 *   signed:   F_i = 2^(i + S - E)       (each value also taken with a minus sign)
 *   unsigned: F_i = 2^(i + S - E + 1)   (the sign bit becomes one more fraction bit)
 * plus 2^(S - E) - 1 extra fractions at the top exponent, the values 0 and 1.0, and
 * zero padding up to 2^total_bits entries; sorted. For 8 bits, E = 7: 127 positive
 * tree values, 127 negative, 0 and 1.0 (signed); 254 positive, 0 and 1.0 (unsigned).
 * Computed in double, stored as float32.
 */
#include <stdlib.h>

#include "memfit/quant.h"

static int cmp_float(const void *a, const void *b) {
  float x = *(const float *)a, y = *(const float *)b;
  return (x > y) - (x < y);
}

/* Appends the midpoints of `points` evenly spaced values in [0.1, 1], times scale
 * (and their negatives when `both_signs`). Returns the new count, or -1 on overflow. */
static int64_t add_fractions(float *out, int64_t n, int64_t cap, int64_t points,
                             double scale, int both_signs) {
  for (int64_t k = 0; k + 1 < points; k++) {
    double a = 0.1 + 0.9 * (double)k / (double)(points - 1);
    double b = 0.1 + 0.9 * (double)(k + 1) / (double)(points - 1);
    double mid = 0.5 * (a + b) * scale;
    if (n + (both_signs ? 2 : 1) > cap) return -1;
    out[n++] = (float)mid;
    if (both_signs) out[n++] = (float)-mid;
  }
  return n;
}

mf_status mf_dynamic_map(float *out, int64_t out_len, int is_signed, int total_bits,
                         int max_exponent_bits) {
  if (total_bits < 2 || total_bits > 8)
    return mf_error(MF_ERR_VALUE, "total_bits: must be between 2 and 8, got %d", total_bits);
  int non_sign_bits = total_bits - 1;
  if (max_exponent_bits < 1 || max_exponent_bits > non_sign_bits)
    return mf_error(MF_ERR_VALUE,
                    "max_exponent_bits: must be between 1 and total_bits - 1 = %d, got %d",
                    non_sign_bits, max_exponent_bits);
  int64_t size = (int64_t)1 << total_bits;
  if (out_len != size)
    return mf_error(MF_ERR_VALUE, "out: expected %lld elements, got %lld", (long long)size,
                    (long long)out_len);

  int64_t n = 0;
  int extra_bits = non_sign_bits - max_exponent_bits;
  double scale = 1.0;
  for (int i = 0; i < max_exponent_bits; i++) {
    int64_t fractions = (int64_t)1 << (i + extra_bits + (is_signed ? 0 : 1));
    scale = 1.0;
    for (int k = 0; k < max_exponent_bits - 1 - i; k++) scale /= 10.0;
    n = add_fractions(out, n, size - 2, fractions + 1, scale, is_signed);
    if (n < 0) break;
  }
  int64_t additional = ((int64_t)1 << extra_bits) - 1;
  if (n >= 0 && additional > 0)
    n = add_fractions(out, n, size - 2, additional + 1, scale, is_signed);
  if (n < 0)
    return mf_error(MF_ERR_VALUE,
                    "max_exponent_bits=%d with total_bits=%d needs more than %lld values",
                    max_exponent_bits, total_bits, (long long)size);
  out[n++] = 0.0f;
  out[n++] = 1.0f;
  while (n < size) out[n++] = 0.0f;
  qsort(out, (size_t)size, sizeof(float), cmp_float);
  return MF_OK;
}

mf_status mf_linear_map(float *out, int64_t out_len, int is_signed, int total_bits) {
  if (total_bits < 2 || total_bits > 8)
    return mf_error(MF_ERR_VALUE, "total_bits: must be between 2 and 8, got %d", total_bits);
  int64_t size = (int64_t)1 << total_bits;
  if (out_len != size)
    return mf_error(MF_ERR_VALUE, "out: expected %lld elements, got %lld", (long long)size,
                    (long long)out_len);
  if (is_signed) {
    /* 2^bits - 1 points from -1 to 1 put an exact 0 in the middle; the spare entry is
     * a second 0, so the code stays symmetric. */
    int64_t points = size - 1;
    for (int64_t k = 0; k < points; k++)
      out[k] = (float)(-1.0 + 2.0 * (double)k / (double)(points - 1));
    out[(points - 1) / 2] = 0.0f;
    out[points] = 0.0f;
    qsort(out, (size_t)size, sizeof(float), cmp_float);
  } else {
    for (int64_t k = 0; k < size; k++) out[k] = (float)((double)k / (double)(size - 1));
  }
  return MF_OK;
}
