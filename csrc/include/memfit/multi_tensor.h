/*
 * memfit core: cutting many tensors into work items, and packing them into CUDA
 * launches (apex / PyTorch multi_tensor_apply). Plain C, used by the CPU loops
 * (csrc/core/optim.c, csrc/core/unscale.c) and the CUDA launchers (cuda/optim.cu,
 * cuda/unscale.cu), and checked on the CPU by tests/c/test_scaler.c.
 *
 * Work items. A tensor of numel elements is cut into mf_mt_items(numel, item) items of
 * `item` elements (the last one may be shorter; the caller picks the item size: 65536
 * for the gradient passes, whole quantization blocks for the optimizer). Items are
 * numbered across the tensors in order: with start[] the prefix sum of the tensors'
 * item counts, tensor i owns items [start[i], start[i + 1]), and mf_mt_tensor_of()
 * finds the tensor of an item by binary search. A CPU loop runs over every item of a
 * call (one parallel region for 1000 small tensors, not 1000).
 *
 * Launches. mf_mt_pack_next() packs consecutive tensors into one launch, one thread
 * block per item, until the launch holds `cap` tensors (the size of the launcher's
 * kernel argument, under the classic 4 KB limit so every driver takes it) or its grid
 * would pass `max_items` blocks; the kernel argument carries the launch's own start[]
 * and block b finds its tensor with mf_mt_tensor_of(). A model with 500 small tensors
 * costs a handful of launches, and a 1B-element tensor one launch.
 */
#ifndef MEMFIT_MULTI_TENSOR_H
#define MEMFIT_MULTI_TENSOR_H

#include "memfit/common.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Elements per item of the gradient passes (unscale, norm, clip): the unit of CPU
 * threading and of one CUDA thread block; also the unit of grad_norm's workspace (one
 * partial per item). */
#define MF_MT_CHUNK 65536
/* Tensors per launch of the gradient passes. */
#define MF_MT_MAX_TENSORS 96
/* Blocks per launch: CUDA's limit on gridDim.x. */
#define MF_MT_MAX_GRID 0x7fffffffLL

static inline MF_HD int64_t mf_mt_items(int64_t numel, int64_t item) {
  return (numel + item - 1) / item;
}

/* The numel of element i of an array of structs, given the address of element 0's
 * numel field and the struct's size (mf_tensor, mf_optim_tensor's param, ...). */
static inline int64_t mf_mt_numel_at(const int64_t *numel0, size_t stride, int64_t i) {
  return *(const int64_t *)((const char *)numel0 + (size_t)i * stride);
}

/* Items of tensor i: its rows are cut one by one when rows (n entries, or NULL for all
 * 1) says it has several, so that no item crosses a row (the optimizer's row blocks:
 * memfit/optim.h, mf_optim_row); item k of it is then item k % per_row of row
 * k / per_row, per_row = mf_mt_items(numel / rows[i], item). */
static inline int64_t mf_mt_items_at(const int64_t *numel0, size_t stride, const int64_t *rows,
                                     int64_t i, int64_t item) {
  const int64_t numel = mf_mt_numel_at(numel0, stride, i), r = rows ? rows[i] : 1;
  return r > 1 ? r * mf_mt_items(numel / r, item) : mf_mt_items(numel, item);
}

/* start[i] = items of tensors 0 .. i-1, for i = 0 .. n (n + 1 entries); returns start[n].
 * rows: NULL, or n row counts (mf_mt_items_at). */
static inline int64_t mf_mt_prefix(const int64_t *numel0, size_t stride, const int64_t *rows,
                                   int64_t n, int64_t item, int64_t *start) {
  start[0] = 0;
  for (int64_t i = 0; i < n; i++)
    start[i + 1] = start[i] + mf_mt_items_at(numel0, stride, rows, i, item);
  return start[n];
}

/* The tensor that item w (0 <= w < start[n]) belongs to: the largest i < n with
 * start[i] <= w. Empty tensors share their start with the next one and are never
 * returned. */
static inline MF_HD int64_t mf_mt_tensor_of(const int64_t *start, int64_t n, int64_t w) {
  int64_t lo = 0, hi = n - 1;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo + 1) / 2;
    if (start[mid] <= w) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

typedef struct {
  const int64_t *numel0; /* see mf_mt_numel_at */
  size_t stride;
  const int64_t *rows;   /* see mf_mt_items_at */
  int64_t n, item;
  int64_t next; /* first tensor not packed yet */
  int64_t base; /* items packed so far: the global index of the next launch's block 0 */
} mf_mt_packer;

static inline void mf_mt_pack_begin(mf_mt_packer *pk, const int64_t *numel0, size_t stride,
                                    const int64_t *rows, int64_t n, int64_t item) {
  pk->numel0 = numel0;
  pk->stride = stride;
  pk->rows = rows;
  pk->n = n;
  pk->item = item;
  pk->next = 0;
  pk->base = 0;
}

/* The next launch: tensors *first .. *first + count - 1, count returned (0 when every
 * item has been packed), start[0 .. count] the launch's own prefix sum (start[0] = 0,
 * start[count] >= 1 blocks). Empty tensors before a launch are skipped; those inside
 * one take a slot and no block. A tensor with more than max_items items must have been
 * refused by the caller (it would be packed alone, over the limit). */
static inline int64_t mf_mt_pack_next(mf_mt_packer *pk, int64_t cap, int64_t max_items,
                                      int64_t *start, int64_t *first) {
  while (pk->next < pk->n && mf_mt_numel_at(pk->numel0, pk->stride, pk->next) == 0) pk->next++;
  *first = pk->next;
  start[0] = 0;
  int64_t count = 0;
  while (pk->next < pk->n && count < cap) {
    const int64_t items = mf_mt_items_at(pk->numel0, pk->stride, pk->rows, pk->next, pk->item);
    if (count > 0 && start[count] + items > max_items) break;
    start[count + 1] = start[count] + items;
    count++;
    pk->next++;
  }
  pk->base += start[count];
  return count;
}

#ifdef __cplusplus
}
#endif
#endif /* MEMFIT_MULTI_TENSOR_H */
