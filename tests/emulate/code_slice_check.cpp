/* cuda/code_slice.cuh against the binary search it replaces (mf_optim_quantize), on the
 * CPU (built with g++ against mfemu's <cuda_runtime.h>; tests/test_cuda_emulated.py).
 * Reads codes from the files named on the command line (raw float32, 16 or 256 each),
 * builds the slice of each as one thread of one block, and checks, for nearest and
 * keep_positive: both ends and 16 inner positions of every bucket, every position of
 * each bucket where q steps, +-0, the tiny values, values past the slice, NaN, +-Inf
 * and 2^22 random floats in [-2, 2]. Prints one line per mismatch (at most 20) and
 * "code slice ok N" when there is none. */
#include <cuda_runtime.h>

#include <stdio.h>
#include <stdlib.h>

#include "code_slice.cuh"

uint3 threadIdx, blockIdx;
dim3 blockDim, gridDim;

static long long checked = 0, bad = 0;

template <int CS>
static void check_one(const uint32_t *slice, const float *code, bool keep, float x) {
  const uint8_t want = mf_optim_quantize(code, CS, x, keep);
  const uint8_t got = slice_quantize<CS>(slice, code, keep, x);
  checked++;
  if (want != got && bad++ < 20)
    printf("MISMATCH size %d keep %d x=%a (bits %08x): slice %d, search %d\n", CS, (int)keep, x,
           mf_f32_bits(x), got, want);
}

template <int CS>
static void check_code(const float *code) {
  static uint32_t slice[kSliceSigned];
  uint64_t rng = 0x9e3779b97f4a7c15ull;
  for (int keep = 0; keep < 2; keep++) {
    slice_build<CS>(slice, code, keep != 0);
    for (uint32_t neg = 0; neg < 2; neg++) {
      for (uint32_t hi = 0; hi < 0x8000u; hi++) {
        const uint32_t b = (neg << 31) | (hi << 16);
        const bool in = hi >= kSliceLow && hi - kSliceLow < kSliceRange;
        for (uint32_t pos : {0u, 1u, 0x7fffu, 0xfffeu, 0xffffu}) check_one<CS>(slice, code, keep, mf_f32_from_bits(b | pos));
        for (int k = 0; k < 16; k++) check_one<CS>(slice, code, keep, mf_f32_from_bits(b | (uint32_t)(k * 4099)));
        if (in && mf_optim_quantize(code, CS, mf_f32_from_bits(b), keep) !=
                      mf_optim_quantize(code, CS, mf_f32_from_bits(b | 0xffffu), keep))
          for (uint32_t pos = 0; pos <= 0xffffu; pos++) check_one<CS>(slice, code, keep, mf_f32_from_bits(b | pos));
      }
    }
    for (uint32_t u : {0u, 0x80000000u, 1u, 0x80000001u, 0x7f800000u, 0xff800000u, 0x7fc00000u, 0xffc00000u,
                       0x7f800001u, 0x3f800000u, 0x3f800001u, 0xbf800001u, 0x40000000u, 0xc0000000u})
      check_one<CS>(slice, code, keep, mf_f32_from_bits(u));
    for (int k = 0; k < (1 << 22); k++) {
      rng = rng * 6364136223846793005ull + 1442695040888963407ull;
      const uint32_t r = (uint32_t)(rng >> 32);
      check_one<CS>(slice, code, keep, (float)((int32_t)r) * (2.0f / 2147483648.0f) *
                                            mf_f32_from_bits(0x3f800000u - ((r & 31u) << 23)));
    }
  }
}

int main(int argc, char **argv) {
  threadIdx = uint3{0, 0, 0};
  blockDim = dim3(1);
  for (int a = 1; a < argc; a++) {
    FILE *f = fopen(argv[a], "rb");
    if (!f) return 2;
    float code[MF_CODE_SIZE];
    const size_t n = fread(code, sizeof(float), MF_CODE_SIZE, f);
    fclose(f);
    if (n == MF_CODE_SIZE) check_code<MF_CODE_SIZE>(code);
    else if (n == MF_CODE4_SIZE) check_code<MF_CODE4_SIZE>(code);
    else return 2;
  }
  if (bad) {
    printf("%lld mismatches in %lld\n", bad, checked);
    return 1;
  }
  printf("code slice ok %lld\n", checked);
  return 0;
}
