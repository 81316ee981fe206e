/*
 * Private to the core: the fused, software-pipelined CPU optimizer step for quantized
 * states, written once and built per instruction set (optim_avx512.c: AVX-512 with or
 * without VBMI; optim_avx2.c: AVX2). 8-bit states (every optimizer kind, AdEMAMix's three
 * included) and 4-bit states (Adam/AdamW, as AdamW4bit ships).
 *
 * Why a separate kernel. The generic block kernel (optim.c) runs four loops per block
 * (dequantize, update, absmax, requantize). Each loop is bound by a different unit:
 * the update by the divider (one sqrt and one division per element), the dequantize
 * and requantize loops by table lookups. Run one after the other they add up. Here one
 * loop does, for every group of 64 elements, the dequantize and update of block j and
 * the requantize of block j - 1 (whose absmax is known by then), so the out-of-order
 * core can overlap the divider with the lookups:
 *
 *   for j = 0 .. blocks:                       (one extra round drains the pipeline)
 *     if j < blocks:    ring[j] <- dequant(codes of block j at 0)
 *     for each group of 64 elements o in a block:
 *       if j < blocks:  ring[j] <- dequant(codes of block j at o + 64)  (one group ahead)
 *       for each half of 32 elements x in the group:
 *         if j < blocks:  update p, ring[j] at o + x (mf_optim_update_one, the same
 *                         math as every other path)
 *         if j > 0:       codes of block j-1 at o + x <- nearest(ring[j-1] * inv[j-1])
 *       if j < blocks:  running absmax of ring[j]
 *
 * The arithmetic is the generic kernel's, operation for operation (the update loop is
 * the same inline function, absmax is the same integer max, the code search is the
 * exact table of code_lut.h), so the bits are the same; tests compare the variants.
 * Tables with slow buckets (codes closer than 1/128 of a binade; none that memfit
 * ships) go to the block kernel instead (pick_fused in optim.c), so the search here
 * never needs the binary-search fallback. The including file is compiled with
 * -ffp-contract=off like optim.c.
 *
 * The including file defines, for its instruction set:
 *   FUSED_TARGET                      the target attribute of the kernels
 *   FUSED8_ENTRY, FUSED4_ENTRY        the names of the two entry points (optim_cpu.h)
 *   fused_acc                         a vector of uint32 lanes, with
 *     acc_zero(), acc_absmax64(acc, s)  (max of the |bit patterns| of s[0..63]),
 *     acc_max(acc)                      (the max lane)
 *   update_half(kind, c, ns, n, ...)  the update of HALF elements: update_loop, or a
 *                                     faster form with the same bits (AdEMAMix, the one
 *                                     three-state kind, takes update_ademamix instead)
 *   store_half(h, t, v, first, n)     the store of updated half-precision parameters:
 *                                     store_params, or a faster form with the same bits
 *   tables_init(b, qc, ns)            per-thread lookup tables, once per step call
 *                                     (one per code: FUSED_TABLE)
 *   dequant64_8(b, k, code, q, absmax, out), dequant64_4(code, q, absmax, out)
 *   quantize32(lut, search, s, inv, bits, out)   32 codes (bytes, or nibbles for 4-bit),
 *                                     in the search form `search` (quant_ctx.search)
 */
#ifndef MEMFIT_OPTIM_FUSED_H
#define MEMFIT_OPTIM_FUSED_H

#define GROUP 64 /* elements per dequantize / absmax call */

/* Update and requantize take turns every HALF elements: the update waits on the
 * divider (a sqrt and a division per element), the code search on table loads, two
 * different units. Written one after the other per group of 64, the instructions that
 * wait on the divider filled the out-of-order window and the loads of the next phase
 * could not start; in halves of 32 they overlap (measured:
 * benchmarks/history/2026-11-23-optim-fused-kernel-design.md). */
#define HALF 32

/* Software prefetch, PREFETCH elements (1-2 KB of each array) ahead of the group being
 * dequantized. The loop is compute-heavy, so the demand misses of its streams (param,
 * grad, the code arrays) come late for the hardware prefetchers (measured gain and the
 * distances tried: benchmarks/history/2026-11-23-optim-fused-kernel-design.md). Only
 * within the work item: prefetches never cross into another thread's. */
#define PREFETCH 512

/* (Always inlined, and the builtin rather than _mm_prefetch: GCC 12 otherwise finds a
 * non-inlined helper "pure" and deletes its calls, prefetches and all.) */
MF_INLINE void prefetch_group(const mf_optim_tensor *t, size_t es, int bits, int ns, int64_t i) {
  const char *p = (const char *)t->param.data + i * es, *g = (const char *)t->grad.data + i * es;
  for (size_t off = 0; off < GROUP * es; off += 64) {
    __builtin_prefetch(p + off, 0, 3);
    __builtin_prefetch(g + off, 0, 3);
  }
  const int64_t byte = bits == 8 ? i : i / 2;
  __builtin_prefetch((const char *)t->state1.data + byte, 0, 3);
  if (ns > 1) __builtin_prefetch((const char *)t->state2.data + byte, 0, 3);
  if (ns > 2) __builtin_prefetch((const char *)t->state3.data + byte, 0, 3);
}

/* What one call of the fused kernel works on: the work item [first, first + n) of one
 * tensor and the running state of the block pipeline. */
typedef struct {
  const mf_optim_hparams *h;
  const mf_optim_consts *c;
  const quant_ctx *qc;
  const mf_optim_tensor *t;
  thread_bufs *b;
  int64_t bs, first, n;
  uint8_t *codes[3];  /* the item's state bytes */
  float *absmax[3];   /* and absmax, per block */
  float *p;           /* parameters as float32 (the tensor's own, or scratch) */
  const float *g;     /* gradients as float32 */
  float inv_prev[3];  /* inv of block j - 1's mf_absmax_scale (its pre already applied) */
} fused_state;

/* The states of the group at `at` (element index in the item) into the ring at `o`. */
MF_INLINE FUSED_TARGET void dequant_group(const int ns, const int bits, const fused_state *s,
                                          const float am[3], float *const cur[3], int64_t at,
                                          int64_t o) {
  for (int k = 0; k < ns; k++) {
    if (bits == 8) dequant64_8(s->b, FUSED_TABLE(k), s->qc->code[k], s->codes[k] + at, am[k], cur[k] + o);
    else dequant64_4(s->qc->code[k], s->codes[k] + at / 2, am[k], cur[k] + o);
  }
}

/* Round j of the pipeline: dequantize and update block j (when `update`), requantize
 * block j - 1 (when `quant`). `kind`, `ns`, `bits` (8 or 4), `f32` (float32 params)
 * and the two flags are constants in each inlined copy, so the steady-state loop has
 * no branches on them.
 *
 * The states are dequantized one group ahead of their update (the block's first group
 * before the loop), so the update reads values stored a group earlier instead of
 * waiting on the loads and permutes that make them (measured: the same file as above). */
MF_INLINE FUSED_TARGET void fused_round(const mf_optim_kind kind, const int ns, const int bits,
                                        const int f32, const int update, const int quant,
                                        fused_state *s, int64_t j) {
  const int64_t bs = s->bs;
  thread_bufs *b = s->b;
  const quant_ctx *qc = s->qc;
  const mf_optim_tensor *t = s->t;
  const size_t es = f32 ? 4 : 2;
  /* the ring: ns blocks for round j's states, ns for round j - 1's (thread_bufs.ring) */
  float *cur[3] = {NULL, NULL, NULL}, *prev[3] = {NULL, NULL, NULL};
  float am[3] = {0.0f, 0.0f, 0.0f};
  fused_acc mx[3] = {acc_zero(), acc_zero(), acc_zero()};
  for (int k = 0; k < ns; k++) {
    cur[k] = b->ring + ((j & 1) * ns + k) * bs;
    prev[k] = b->ring + (((j + 1) & 1) * ns + k) * bs;
    if (update) am[k] = s->absmax[k][j];
  }
  if (update) dequant_group(ns, bits, s, am, cur, j * bs, 0);
  for (int64_t o = 0; o < bs; o += GROUP) {
    const int64_t at = j * bs + o, at_prev = (j - 1) * bs + o;
    if (update) {
      if (at + PREFETCH < s->n) prefetch_group(t, es, bits, ns, s->first + at + PREFETCH);
      if (o + GROUP < bs) dequant_group(ns, bits, s, am, cur, at + GROUP, o + GROUP);
      if (!f32) {
        load_params(t, s->first + at, GROUP, s->p + at);
        widen(t->grad.data, t->param.dtype, s->first + at, GROUP, b->g + at);
      }
    }
    for (int64_t x = 0; x < GROUP; x += HALF) {
      if (update && kind == MF_OPT_ADEMAMIX)
        update_ademamix(s->c, HALF, s->p + at + x, s->g + at + x, cur[0] + o + x,
                        cur[1] + o + x, cur[2] + o + x);
      else if (update)
        update_half(kind, s->c, ns, HALF, s->p + at + x, s->g + at + x, cur[0] + o + x,
                    ns > 1 ? cur[1] + o + x : b->zero);
      if (quant)
        for (int k = 0; k < ns; k++)
          quantize32(qc->lut[k], qc->search, prev[k] + o + x, s->inv_prev[k], bits,
                     s->codes[k] + (bits == 8 ? at_prev + x : (at_prev + x) / 2));
    }
    if (update) {
      if (!f32) store_half(s->h, t, s->p + at, s->first + at, GROUP);
      for (int k = 0; k < ns; k++) mx[k] = acc_absmax64(mx[k], cur[k] + o);
    }
  }
  if (update) {
    for (int k = 0; k < ns; k++) {
      const float a = mf_f32_from_bits(acc_max(mx[k]));
      s->absmax[k][j] = a;
      const mf_block_scale sc = mf_absmax_scale(a);
      prescale_block(cur[k], bs, sc.pre);
      s->inv_prev[k] = sc.inv;
    }
  }
}

MF_INLINE FUSED_TARGET void fused(const mf_optim_kind kind, const int ns, const int bits,
                                  const int f32, const mf_optim_hparams *h,
                                  const mf_optim_consts *c, int64_t bs, const quant_ctx *qc,
                                  const mf_optim_tensor *t, int64_t first, int64_t n,
                                  thread_bufs *b) {
  /* state bytes of this item (4-bit: first is a multiple of the block size, so even) */
  const int64_t byte0 = bits == 8 ? first : first / 2, blocks = n / bs;
  fused_state s = {
      .h = h, .c = c, .qc = qc, .t = t, .b = b, .bs = bs, .first = first, .n = n,
      .codes = {(uint8_t *)t->state1.data + byte0, ns > 1 ? (uint8_t *)t->state2.data + byte0 : NULL,
                ns > 2 ? (uint8_t *)t->state3.data + byte0 : NULL},
      .absmax = {(float *)t->absmax1.data + first / bs,
                 ns > 1 ? (float *)t->absmax2.data + first / bs : NULL,
                 ns > 2 ? (float *)t->absmax3.data + first / bs : NULL},
      .p = f32 ? (float *)t->param.data + first : b->p,
      .g = f32 ? (const float *)t->grad.data + first : b->g,
      .inv_prev = {0.0f, 0.0f, 0.0f}};
  if (blocks == 0) return;
  if (bits == 8) tables_init(b, qc, ns);
  fused_round(kind, ns, bits, f32, 1, 0, &s, 0);
  for (int64_t j = 1; j < blocks; j++) fused_round(kind, ns, bits, f32, 1, 1, &s, j);
  fused_round(kind, ns, bits, f32, 0, 1, &s, blocks);
}

/* fused() with the parameter width a constant too. */
#define FUSED_BY_DTYPE(kind, ns, bits)                                            \
  do {                                                                            \
    if (t->param.dtype == MF_FLOAT32) fused(kind, ns, bits, 1, h, c, bs, qc, t, first, n, b); \
    else fused(kind, ns, bits, 0, h, c, bs, qc, t, first, n, b);                   \
  } while (0)

/* One instantiation per optimizer kind and state count, for 8-bit states. */
FUSED_TARGET void FUSED8_ENTRY(const mf_optim_hparams *h, const mf_optim_consts *c, int ns,
                               int64_t bs, const quant_ctx *qc, const mf_optim_tensor *t,
                               int64_t first, int64_t n, thread_bufs *b) {
#define FUSED(kind, ns) FUSED_BY_DTYPE(kind, ns, 8)
  switch (h->kind) {
    case MF_OPT_ADAMW: FUSED(MF_OPT_ADAMW, 2); break;
    case MF_OPT_ADAM: FUSED(MF_OPT_ADAM, 2); break;
    case MF_OPT_LION: FUSED(MF_OPT_LION, 1); break;
    case MF_OPT_SGD: FUSED(MF_OPT_SGD, 1); break; /* with momentum: one state */
    case MF_OPT_RMSPROP:
      if (ns == 2) FUSED(MF_OPT_RMSPROP, 2);
      else FUSED(MF_OPT_RMSPROP, 1);
      break;
    case MF_OPT_MUON: FUSED(MF_OPT_MUON, 1); break;
    case MF_OPT_ADAGRAD: FUSED(MF_OPT_ADAGRAD, 1); break;
    case MF_OPT_ADEMAMIX: FUSED(MF_OPT_ADEMAMIX, 3); break;
  }
#undef FUSED
}

/* 4-bit states: the optimizers that ship them (AdamW4bit; the functional API also
 * takes other kinds, which use the block kernel). */
FUSED_TARGET void FUSED4_ENTRY(const mf_optim_hparams *h, const mf_optim_consts *c, int ns,
                               int64_t bs, const quant_ctx *qc, const mf_optim_tensor *t,
                               int64_t first, int64_t n, thread_bufs *b) {
  (void)ns;
  if (h->kind == MF_OPT_ADAMW) FUSED_BY_DTYPE(MF_OPT_ADAMW, 2, 4);
  else FUSED_BY_DTYPE(MF_OPT_ADAM, 2, 4);
}

#endif /* MEMFIT_OPTIM_FUSED_H */
