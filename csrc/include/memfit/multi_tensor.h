/*
 * memfit core: packing many tensors into few CUDA launches (apex / PyTorch
 * multi_tensor_apply). Plain C, so the CPU tests (tests/c/test_scaler.c) check the
 * packing that the CUDA launchers (cuda/unscale.cu) use.
 *
 * Every tensor is cut into chunks of MF_MT_CHUNK elements; one CUDA thread block
 * handles one chunk. A launch takes up to MF_MT_MAX_TENSORS tensor pointers and
 * MF_MT_MAX_BLOCKS (tensor, chunk) pairs in an mf_mt_args passed by value: 3.3 KB, under
 * the classic 4 KB kernel-parameter limit, so every driver takes it. A tensor whose
 * chunks do not all fit continues as tensor 0 of the next launch. Chunks are visited
 * in order, so block b of a launch is global chunk `base + b` (the index grad_norm's
 * workspace uses, matching mf_mt_num_chunks()).
 */
#ifndef MEMFIT_MULTI_TENSOR_H
#define MEMFIT_MULTI_TENSOR_H

#include "memfit/common.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Elements per chunk of the multi-tensor loops: the unit of CPU threading and of one
 * CUDA thread block; also the unit of grad_norm's workspace (one partial per chunk). */
#define MF_MT_CHUNK 65536
#define MF_MT_MAX_TENSORS 96
#define MF_MT_MAX_BLOCKS 320

typedef struct {
  void *ptr[MF_MT_MAX_TENSORS];
  int64_t numel[MF_MT_MAX_TENSORS];
  uint8_t dtype[MF_MT_MAX_TENSORS];
  uint8_t block_tensor[MF_MT_MAX_BLOCKS]; /* index into ptr/numel/dtype */
  int32_t block_chunk[MF_MT_MAX_BLOCKS];  /* chunk of that tensor */
  int32_t ntensors, nblocks;
  int64_t base; /* global chunk index of block 0 */
} mf_mt_args;

typedef struct {
  const mf_tensor *t;
  int64_t n;
  int64_t i;    /* current tensor */
  int64_t ch;   /* next chunk of the current tensor */
  int64_t base; /* global chunks handed out so far */
} mf_mt_iter;

static inline void mf_mt_begin(mf_mt_iter *it, const mf_tensor *t, int64_t n) {
  it->t = t;
  it->n = n;
  it->i = 0;
  it->ch = 0;
  it->base = 0;
}

/* Fills `a` with the next launch and returns its number of blocks; 0 when every
 * chunk has been handed out. Empty tensors are skipped. The caller has checked that
 * no tensor has more than INT32_MAX chunks. */
static inline int mf_mt_next(mf_mt_iter *it, mf_mt_args *a) {
  int nt = 0, nb = 0;
  a->base = it->base;
  while (it->i < it->n && nb < MF_MT_MAX_BLOCKS) {
    const mf_tensor *t = &it->t[it->i];
    const int64_t chunks = (t->numel + MF_MT_CHUNK - 1) / MF_MT_CHUNK;
    if (chunks <= 0) { /* empty: nothing to launch */
      it->i++;
      it->ch = 0;
      continue;
    }
    if (nt == MF_MT_MAX_TENSORS) break; /* no slot for another tensor */
    a->ptr[nt] = t->data;
    a->numel[nt] = t->numel;
    a->dtype[nt] = (uint8_t)t->dtype;
    nt++;
    while (it->ch < chunks && nb < MF_MT_MAX_BLOCKS) {
      a->block_tensor[nb] = (uint8_t)(nt - 1);
      a->block_chunk[nb] = (int32_t)it->ch;
      nb++;
      it->ch++;
    }
    if (it->ch == chunks) {
      it->i++;
      it->ch = 0;
    }
  }
  a->ntensors = nt;
  a->nblocks = nb;
  it->base += nb;
  return nb;
}

#ifdef __cplusplus
}
#endif
#endif /* MEMFIT_MULTI_TENSOR_H */
