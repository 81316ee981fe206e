/*
 * 16- and 8-byte accesses for the kernels that move several elements per thread
 * (optim.cu's warp kernel, quant.cu): the register images of a 16-byte and an 8-byte
 * word, and the alignment test that decides between one wide access and scalar ones
 * (a tensor's pointer plus an element offset is not always aligned).
 */
#pragma once

#include <stdint.h>

namespace {

struct alignas(16) Vec16 {
  uint32_t w[4];
};
struct alignas(8) Vec8 {
  uint32_t w[2];
};

__device__ __forceinline__ bool aligned_to(const void *p, uintptr_t a) {
  return ((uintptr_t)p & (a - 1)) == 0;
}

}  // namespace
