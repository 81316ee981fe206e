/*
 * Optimizer steps on the GPU: multi-tensor apply over all parameters of a call.
 *
 * The host packs up to kMaxTensors tensors (pointers, sizes and the prefix sum of their
 * work items: mf_mt_pack_next, memfit/multi_tensor.h) into a kernel argument (< 4 KB,
 * so no host-to-device copy and no sync); thread block b finds its tensor in that
 * prefix sum and updates one item of kItem elements. A model with hundreds of small
 * parameters costs a handful of launches, not one per parameter (the apex /
 * torch._foreach pattern), and a 1B-parameter tensor is one launch of 250k blocks. All
 * launches go to the caller's stream.
 *
 * optim_quant_kernel<BS, BITS, S3>: quantized states (8-bit: one code per byte; 4-bit: two
 * per byte). A tile of max(BS, 256) elements is spread over the 256 threads, so each
 * quantization block is owned by one thread block: every thread dequantizes its
 * elements, applies mf_optim_update_one() (optim.h, the same function as the CPU loop),
 * writes the parameter, then the block reduces the new absmax (max of the float bit
 * patterns with the sign cleared, exactly as the CPU does) and requantizes with
 * mf_optim_quantize() (the binary search that the CPU's lookup table reproduces bit for
 * bit; keep_positive for non-negative states; values scaled by mf_absmax_scale). The
 * absmax reduction is a warp shuffle, then one value per warp in shared memory: one
 * barrier per tile. 4-bit codes of elements 2j and 2j+1 live in
 * neighbouring lanes and are packed with one shuffle. S3: the third state (AdEMAMix,
 * mf_optim_update_one3; signed, code1); the instantiations without it are the two-state
 * kernel as it was.
 * optim_warp_kernel<BITS, KIND, PM>: the same step for the common cases (8-bit blocks of
 *   256, 4-bit of 128; AdamW, Adam, Lion, SGD, Muon; float32 or bfloat16 parameters),
 *   shaped for memory bandwidth: a warp per quantization block, a resident grid, the code
 *   search through a shared-memory slice (optim_warp.cuh; warp_form() picks it).
 * optim_fp32_kernel: float32 states, element-wise.
 * Both read and write parameters through mf_optim_load_param/mf_optim_store_param
 * (optim.h): the Kahan compensation buffer and stochastic rounding live there.
 * optim_count_kernel: after all updates, step += 1 for every tensor (unless found_inf).
 * trust_partial_kernel, trust_finish_kernel: the trust ratio's norm pass (LAMB, LARS;
 *   optim.h, "trust ratio"), before the updates: one thread block per chunk of
 *   MF_OPTIM_TRUST_CHUNK elements, thread l the lane l of the fixed summation order, the
 *   lanes added as the tree of mf_optim_trust_tree in shared memory; then one block per
 *   tensor adds the chunk sums the same way. The update kernels read the totals on the
 *   device (prepare_once): no host synchronisation.
 *
 * Per-tensor constants: mf_optim_prepare() (bias corrections in FP64: powers, a
 * division, a square root) depends on the step counter and the scale, which live on the
 * device, so the host cannot compute it without a sync. Thread 0 of each block computes
 * it once into shared memory: FP64 runs at 1/32 rate on sm_75 (the T4), and all 256
 * threads computing it cost about as much as the step's DRAM traffic. Same function,
 * same inputs: the same bits as the CPU.
 *
 * GradScaler: grad_scale and found_inf are device pointers read inside the kernels;
 * with found_inf != 0 every block returns at once and the step counters stay put, so
 * a skipped step costs no host synchronisation.
 *
 * This file is compiled with --fmad=false (CMakeLists.txt): the CPU build uses
 * -ffp-contract=off, and both sides then round every operation the same way.
 */
#include "code_slice.cuh"
#include "cuda_util.cuh"
#include "optim_warp.cuh"
#include "wide_access.cuh"
#include "memfit/cuda_launch.h"
#include "memfit/multi_tensor.h"
#include "memfit/numeric.h"
#include "memfit/optim.h"
#include "memfit/quant.h"

#include <stdlib.h>

namespace {

constexpr int kThreads = 256;
/* Elements one thread block updates: a whole number of tiles (a tile is max(BS, 256)
 * elements, BS <= 4096), so quantization blocks never straddle two thread blocks. */
constexpr int64_t kItem = 4096;

struct TensorSlot {
  void *p;
  const void *g;
  void *s1, *s2, *s3;
  void *c; /* Kahan compensation, or null */
  float *a1, *a2, *a3;
  const float *step;
  int64_t numel;
  int64_t rows;       /* rows stepped one by one (mf_optim_split_rows); 1: the whole tensor */
  int64_t index_base; /* mf_optim_tensor.index_base */
  int dtype;
  int sr_stream;
  int bits;           /* state format (mf_state_format) */
  int block_size;
  const double *trust; /* the trust ratio's totals (mf_optim_trust_totals), or null */
};

/* As many tensors as one launch's arguments hold: a LaunchList (a slot and a start per
 * tensor, one more start, n and its padding) and the hparams stay below the 4 KB of
 * kernel parameters every CUDA version takes. */
constexpr int kMaxTensors = (int)((4096 - 64 - sizeof(mf_optim_hparams) - 2 * sizeof(int64_t)) /
                                  (sizeof(TensorSlot) + sizeof(int64_t)));

/* Up to kMaxTensors tensors of one launch (Slot: TensorSlot for the steps, NormSlot for
 * the norm pass); thread block b works on tensor i with start[i] <= b < start[i + 1],
 * item b - start[i] of it. */
template <class Slot>
struct SlotList {
  Slot t[kMaxTensors];
  int64_t start[kMaxTensors + 1];
  int n;
  static_assert(sizeof(Slot) <= sizeof(TensorSlot), "kMaxTensors is sized for TensorSlot");
};
static_assert(sizeof(SlotList<TensorSlot>) + sizeof(mf_optim_hparams) + 64 <= 4096,
              "kernel arguments must stay below 4 KB");

/* Named types rather than aliases of SlotList: the kernels' symbols (profiles,
 * tests/test_cuda_resources.py) name them as before. */
struct LaunchList : SlotList<TensorSlot> {};

/* The tensor of item b (a thread block's item, or a warp's in optim_warp_kernel) and
 * the first element of the item. A tensor stepped row by row (rows > 1) comes back as
 * the row of the item (mf_optim_row), so the kernels see one whole tensor whose blocks
 * start at its element 0. */
__device__ __forceinline__ TensorSlot locate(const LaunchList &L, int64_t b, int64_t *start) {
  const int64_t i = mf_mt_tensor_of(L.start, L.n, b);
  TensorSlot t = L.t[i];
  int64_t k = b - L.start[i];
  if (t.rows > 1) {
    const int64_t row_len = t.numel / t.rows, per_row = mf_mt_items(row_len, kItem);
    const mf_optim_row_start at = mf_optim_row(row_len, t.block_size, k / per_row);
    const int64_t esize = t.dtype == MF_FLOAT32 ? 4 : 2;
    const int64_t code = t.bits == MF_STATE_4BIT ? at.code4 : at.elem;
    k %= per_row;
    t.p = (char *)t.p + at.elem * esize;
    t.g = (const char *)t.g + at.elem * esize;
    if (t.c) t.c = (char *)t.c + at.elem * esize;
    if (t.s1) t.s1 = (uint8_t *)t.s1 + code;
    if (t.s2) t.s2 = (uint8_t *)t.s2 + code;
    if (t.s3) t.s3 = (uint8_t *)t.s3 + code;
    if (t.a1) t.a1 += at.block;
    if (t.a2) t.a2 += at.block;
    if (t.a3) t.a3 += at.block;
    t.numel = row_len;
    t.index_base += at.elem;
  }
  *start = k * kItem;
  return t;
}

constexpr int kMaxCountTensors = 480;
struct StepList {
  float *step[kMaxCountTensors];
  int n;
};

__device__ __forceinline__ float inverse_scale(const float *grad_scale) {
  return grad_scale ? 1.0f / *grad_scale : 1.0f;
}

__device__ __forceinline__ bool skipped(const float *found_inf) {
  return found_inf && *found_inf != 0.0f;
}

/* mf_optim_prepare() for tensor t, its trust ratio applied. */
__device__ __forceinline__ mf_optim_consts consts_of(const mf_optim_hparams &h, const TensorSlot &t,
                                                     const float *grad_scale) {
  const float step = *t.step + 1.0f;
  mf_optim_consts c = mf_optim_prepare(&h, step, inverse_scale(grad_scale));
  if (h.max_unorm > 0.0 && t.trust)
    mf_optim_trust_apply(&h, &c, mf_optim_trust_scale(&h, step, t.trust[0], t.trust[1]));
  return c;
}

/* consts_of() for tensor t by thread 0 into `out`; the caller's next __syncthreads()
 * publishes it. */
__device__ __forceinline__ void prepare_once(mf_optim_consts *out, const mf_optim_hparams &h,
                                             const TensorSlot &t, const float *grad_scale) {
  if (threadIdx.x == 0) *out = consts_of(h, t, grad_scale);
}

/* The fields a step slot (TensorSlot) and a norm-pass slot (NormSlot) take alike. */
template <class Slot>
void fill_common(Slot &s, const mf_optim_tensor &x) {
  s.p = x.param.data;
  s.g = x.grad.data;
  s.s1 = x.state1.data;
  s.s2 = x.state2.data;
  s.c = x.comp.data;
  s.a1 = (float *)x.absmax1.data;
  s.a2 = (float *)x.absmax2.data;
  s.step = (const float *)x.step.data;
  s.numel = x.param.numel;
  s.dtype = (int)x.param.dtype;
}

/* The launches over ts of `item` elements per thread block (split: rows stepped one by
 * one, or null): checks every tensor's grid first, then packs kMaxTensors tensors at a
 * time (mf_mt_pack_next), lets fill(slot, tensor, index) fill each slot and go(list)
 * launch. */
template <class List, class Fill, class Go>
mf_status for_each_launch(const mf_optim_tensor *ts, int64_t n, const int64_t *split, int64_t item,
                          Fill fill, Go go) {
  for (int64_t i = 0; i < n; i++)
    if (mf_mt_items_at(&ts[0].param.numel, sizeof *ts, split, i, item) > MF_MT_MAX_GRID)
      return mf_error(MF_ERR_VALUE, "params[%lld]: too many elements for one launch", (long long)i);
  mf_mt_packer pk;
  mf_mt_pack_begin(&pk, &ts[0].param.numel, sizeof *ts, split, n, item);
  List L;
  int64_t first;
  while ((L.n = (int)mf_mt_pack_next(&pk, kMaxTensors, MF_MT_MAX_GRID, L.start, &first)) > 0) {
    for (int k = 0; k < L.n; k++) fill(L.t[k], ts[first + k], first + k);
    const mf_status st = go(L);
    if (st) return st;
  }
  return MF_OK;
}

/* ---- the trust ratio's norm pass ---------------------------------------------------- */

/* A tensor of the norm pass, whole (chunks run over the flat storage, whatever its rows). */
struct NormSlot {
  const void *p, *g, *s1, *s2, *c;
  const float *a1, *a2;
  const float *step;
  double *ws; /* mf_optim_tensor.trust */
  int64_t numel, row_len;
  int dtype;
};

struct NormList : SlotList<NormSlot> {};
static_assert(kThreads == MF_OPTIM_TRUST_LANES, "one thread per lane of the norm pass");

/* The block's sums of every thread's u and p (thread l is lane l) by mf_optim_trust_tree
 * (v[l] += v[l + w] for halving w) in the kernel's shared su and sp; thread 0 writes them
 * to out[0] and out[1]. Every thread must call it. */
__device__ __forceinline__ void block_tree(double *su, double *sp, double u, double p, double *out) {
  su[threadIdx.x] = u;
  sp[threadIdx.x] = p;
  __syncthreads();
  for (int w = MF_OPTIM_TRUST_LANES / 2; w > 0; w /= 2) {
    if ((int)threadIdx.x < w) {
      su[threadIdx.x] = su[threadIdx.x] + su[threadIdx.x + w];
      sp[threadIdx.x] = sp[threadIdx.x] + sp[threadIdx.x + w];
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    out[0] = su[0];
    out[1] = sp[0];
  }
}

__global__ void __launch_bounds__(kThreads)
    trust_partial_kernel(NormList L, mf_optim_hparams h, int fmt, int64_t bs,
                         const float *code1, const float *code2, const float *grad_scale,
                         const float *found_inf) {
  __shared__ mf_optim_consts cs;
  __shared__ double su[MF_OPTIM_TRUST_LANES], sp[MF_OPTIM_TRUST_LANES];
  if (skipped(found_inf)) return;
  const int64_t b = blockIdx.x, ti = mf_mt_tensor_of(L.start, L.n, b), k = b - L.start[ti];
  const NormSlot &t = L.t[ti];
  if (threadIdx.x == 0) cs = mf_optim_prepare(&h, *t.step + 1.0f, inverse_scale(grad_scale));
  __syncthreads();
  const mf_optim_consts c = cs;
  const int ns = mf_optim_num_states(&h);
  const mf_state_format f = (mf_state_format)fmt;
  const mf_dtype dt = (mf_dtype)t.dtype;
  const int64_t first = k * MF_OPTIM_TRUST_CHUNK;
  const int64_t last = first + MF_OPTIM_TRUST_CHUNK < t.numel ? first + MF_OPTIM_TRUST_CHUNK : t.numel;
  double u = 0.0, p = 0.0;
  for (int64_t i = first + threadIdx.x; i < last; i += MF_OPTIM_TRUST_LANES) {
    const float s1 = ns >= 1 ? mf_optim_state_at(f, t.s1, t.a1, code1, bs, t.row_len, i) : 0.0f;
    const float s2 = ns >= 2 ? mf_optim_state_at(f, t.s2, t.a2, code2, bs, t.row_len, i) : 0.0f;
    double u2, p2;
    mf_optim_trust_element(h.kind, &c, ns, mf_optim_load_param(t.p, t.c, i, dt),
                           mf_load_f32(t.g, i, dt), s1, s2, &u2, &p2);
    u = u + u2;
    p = p + p2;
  }
  block_tree(su, sp, u, p, t.ws + 2 * k);
}

/* Block i: tensor i's totals from its chunk sums. */
__global__ void __launch_bounds__(kThreads) trust_finish_kernel(NormList L, const float *found_inf) {
  __shared__ double su[MF_OPTIM_TRUST_LANES], sp[MF_OPTIM_TRUST_LANES];
  if (skipped(found_inf)) return;
  const NormSlot &t = L.t[blockIdx.x];
  if (t.numel == 0) return;
  const int64_t chunks = mf_optim_trust_chunks(t.numel);
  double u = 0.0, p = 0.0;
  for (int64_t k = threadIdx.x; k < chunks; k += MF_OPTIM_TRUST_LANES) {
    u = u + t.ws[2 * k];
    p = p + t.ws[2 * k + 1];
  }
  block_tree(su, sp, u, p, t.ws + 2 * chunks);
}

/* Pass 1 of the trust ratio for all tensors, on `stream`. */
mf_status trust_norms(const mf_optim_hparams *h, mf_state_format fmt, int64_t bs,
                      const float *code1, const float *code2, const mf_optim_tensor *ts,
                      int64_t n, const float *scale, const float *inf, cudaStream_t stream) {
  return for_each_launch<NormList>(
      ts, n, nullptr, MF_OPTIM_TRUST_CHUNK,
      [](NormSlot &s, const mf_optim_tensor &x, int64_t) {
        fill_common(s, x);
        s.ws = (double *)x.trust.data;
        s.row_len = x.param.numel / (x.rows ? x.rows : 1);
      },
      [&](const NormList &L) {
        if (L.start[L.n] > 0) {
          trust_partial_kernel<<<(unsigned)L.start[L.n], kThreads, 0, stream>>>(
              L, *h, (int)fmt, bs, code1, code2, scale, inf);
          trust_finish_kernel<<<(unsigned)L.n, kThreads, 0, stream>>>(L, inf);
        }
        return mf_cuda_status(cudaGetLastError(), "optimizer step");
      });
}

/* Max of v over the 32 lanes of the warp (every lane gets it). */
__device__ __forceinline__ uint32_t warp_max_u32(uint32_t v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    const uint32_t o = __shfl_xor_sync(0xffffffffu, v, off);
    v = o > v ? o : v;
  }
  return v;
}

/* Code index of state element i (8-bit: its byte; 4-bit: its nibble). */
template <int BITS>
__device__ __forceinline__ uint8_t code_at(const void *s, int64_t i) {
  return BITS == 8 ? ((const uint8_t *)s)[i] : (((const uint8_t *)s)[i >> 1] >> ((i & 1) * 4)) & 15;
}

template <int BS, int BITS, bool S3>
__global__ void __launch_bounds__(kThreads)
    optim_quant_kernel(LaunchList L, mf_optim_hparams h, const float *__restrict__ code1,
                       const float *__restrict__ code2, const float *grad_scale,
                       const float *found_inf) {
  constexpr int CS = BITS == 8 ? MF_CODE_SIZE : MF_CODE4_SIZE;
  constexpr int ITEMS = BS >= kThreads ? BS / kThreads : 1;
  constexpr int TILE = kThreads * ITEMS;
  constexpr int GROUP = BS < kThreads ? BS : kThreads; /* threads sharing one block */
  constexpr int WARPS = GROUP / 32; /* warps sharing one quantization block (BS >= 64) */
  static_assert(GROUP % 32 == 0, "a quantization block spans whole warps");
  __shared__ float c1s[CS], c2s[CS];
  /* per-warp absmax, double-buffered by tile parity: tile k + 2 writes a buffer only
   * after tile k + 1's barrier, when every thread has read tile k's values */
  __shared__ uint32_t red1[2][kThreads / 32], red2[2][kThreads / 32], red3[2][S3 ? kThreads / 32 : 1];
  __shared__ mf_optim_consts cs;

  if (skipped(found_inf)) return;
  const int ns = mf_optim_num_states(&h);
  /* non-negative states never round a positive value to a code value <= 0 */
  const int keep1 = !mf_optim_state_signed(h.kind, 1), keep2 = !mf_optim_state_signed(h.kind, 2);
  for (int i = threadIdx.x; i < CS; i += blockDim.x) {
    if (ns >= 1) c1s[i] = code1[i];
    if (ns >= 2) c2s[i] = code2[i];
  }
  int64_t cstart;
  const TensorSlot t = locate(L, blockIdx.x, &cstart);
  const int64_t cend = cstart + kItem < t.numel ? cstart + kItem : t.numel;
  prepare_once(&cs, h, t, grad_scale);
  const mf_dtype dt = (mf_dtype)t.dtype;
  const int tid = threadIdx.x, warp = tid / 32;
  __syncthreads(); /* codes and constants */
  const mf_optim_consts c = cs;

  int parity = 0;
  for (int64_t base = cstart; base < cend; base += TILE, parity ^= 1) {
    float s1v[ITEMS], s2v[ITEMS], s3v[S3 ? ITEMS : 1];
    uint32_t m1 = 0, m2 = 0, m3 = 0;
#pragma unroll
    for (int k = 0; k < ITEMS; k++) {
      const int64_t i = base + (int64_t)k * kThreads + tid;
      float s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
      if (i < cend) {
        const int64_t blk = i / BS;
        if (ns >= 1) {
          uint8_t q = BITS == 8 ? ((const uint8_t *)t.s1)[i]
                                : (((const uint8_t *)t.s1)[i >> 1] >> ((i & 1) * 4)) & 15;
          s1 = mf_dequantize_one(c1s, q, t.a1[blk]);
        }
        if (ns >= 2) {
          uint8_t q = BITS == 8 ? ((const uint8_t *)t.s2)[i]
                                : (((const uint8_t *)t.s2)[i >> 1] >> ((i & 1) * 4)) & 15;
          s2 = mf_dequantize_one(c2s, q, t.a2[blk]);
        }
        if (S3) s3 = mf_dequantize_one(c1s, code_at<BITS>(t.s3, i), t.a3[blk]);
        float p = mf_optim_load_param(t.p, t.c, i, dt);
        if (S3)
          mf_optim_update_one3(h.kind, &c, ns, &p, mf_load_f32(t.g, i, dt), &s1, &s2, &s3);
        else
          mf_optim_update_one(h.kind, &c, ns, &p, mf_load_f32(t.g, i, dt), &s1, &s2);
        mf_optim_store_param(t.p, t.c, i, dt, p, &h, t.sr_stream, t.index_base);
      }
      s1v[k] = s1;
      s2v[k] = s2;
      if (S3) {
        s3v[S3 ? k : 0] = s3;
        const uint32_t b3 = mf_f32_bits(s3) & 0x7fffffffu;
        m3 = b3 > m3 ? b3 : m3;
      }
      const uint32_t b1 = mf_f32_bits(s1) & 0x7fffffffu, b2 = mf_f32_bits(s2) & 0x7fffffffu;
      m1 = b1 > m1 ? b1 : m1;
      m2 = b2 > m2 ? b2 : m2;
    }
    /* absmax of each quantization block: shuffles within each warp, then the max over
     * the WARPS warps that own the block */
    m1 = warp_max_u32(m1);
    m2 = warp_max_u32(m2);
    if (S3) m3 = warp_max_u32(m3);
    if (tid % 32 == 0) {
      red1[parity][warp] = m1;
      red2[parity][warp] = m2;
      if (S3) red3[parity][warp] = m3;
    }
    __syncthreads();
    const int lead = warp & ~(WARPS - 1);
    m1 = red1[parity][lead];
    m2 = red2[parity][lead];
    if (S3) m3 = red3[parity][lead];
#pragma unroll
    for (int w = 1; w < WARPS; w++) {
      const uint32_t o1 = red1[parity][lead + w], o2 = red2[parity][lead + w];
      m1 = o1 > m1 ? o1 : m1;
      m2 = o2 > m2 ? o2 : m2;
      if (S3) {
        const uint32_t o3 = red3[parity][lead + w];
        m3 = o3 > m3 ? o3 : m3;
      }
    }
    const float am1 = mf_f32_from_bits(m1), am2 = mf_f32_from_bits(m2), am3 = mf_f32_from_bits(m3);
    const int64_t first = base + tid; /* element of this thread in item 0 */
    if ((tid & (GROUP - 1)) == 0 && first < cend) {
      const int64_t blk = first / BS;
      if (ns >= 1) t.a1[blk] = am1;
      if (ns >= 2) t.a2[blk] = am2;
      if (S3) t.a3[blk] = am3;
    }
    const mf_block_scale sc1 = mf_absmax_scale(am1), sc2 = mf_absmax_scale(am2);
    const mf_block_scale sc3 = mf_absmax_scale(am3);
#pragma unroll
    for (int k = 0; k < ITEMS; k++) {
      const int64_t i = base + (int64_t)k * kThreads + tid;
      const bool in = i < cend;
      uint8_t q1 = (in && ns >= 1) ? mf_optim_quantize(c1s, CS, mf_block_normalize(s1v[k], sc1), keep1) : 0;
      uint8_t q2 = (in && ns >= 2) ? mf_optim_quantize(c2s, CS, mf_block_normalize(s2v[k], sc2), keep2) : 0;
      /* the third state is signed: code1, nearest */
      uint8_t q3 = (S3 && in) ? mf_optim_quantize(c1s, CS, mf_block_normalize(s3v[S3 ? k : 0], sc3), 0) : 0;
      if (BITS == 8) {
        if (in && ns >= 1) ((uint8_t *)t.s1)[i] = q1;
        if (in && ns >= 2) ((uint8_t *)t.s2)[i] = q2;
        if (S3 && in) ((uint8_t *)t.s3)[i] = q3;
      } else {
        /* lanes 2j and 2j+1 hold neighbouring elements (base and kThreads are even) */
        const uint8_t o1 = (uint8_t)__shfl_xor_sync(0xffffffffu, q1, 1);
        const uint8_t o2 = (uint8_t)__shfl_xor_sync(0xffffffffu, q2, 1);
        const uint8_t o3 = S3 ? (uint8_t)__shfl_xor_sync(0xffffffffu, q3, 1) : 0;
        if (in && (tid & 1) == 0) {
          if (ns >= 1) ((uint8_t *)t.s1)[i >> 1] = (uint8_t)(q1 | (o1 << 4));
          if (ns >= 2) ((uint8_t *)t.s2)[i >> 1] = (uint8_t)(q2 | (o2 << 4));
          if (S3) ((uint8_t *)t.s3)[i >> 1] = (uint8_t)(q3 | (o3 << 4));
        }
      }
    }
  }
}

__global__ void __launch_bounds__(kThreads)
    optim_fp32_kernel(LaunchList L, mf_optim_hparams h, const float *grad_scale,
                      const float *found_inf) {
  __shared__ mf_optim_consts cs;
  if (skipped(found_inf)) return;
  const int ns = mf_optim_num_states(&h);
  int64_t cstart;
  const TensorSlot t = locate(L, blockIdx.x, &cstart);
  const int64_t cend = cstart + kItem < t.numel ? cstart + kItem : t.numel;
  prepare_once(&cs, h, t, grad_scale);
  __syncthreads();
  const mf_optim_consts c = cs;
  const mf_dtype dt = (mf_dtype)t.dtype;
  float *s1p = (float *)t.s1, *s2p = (float *)t.s2, *s3p = (float *)t.s3;
  for (int64_t i = cstart + threadIdx.x; i < cend; i += kThreads) {
    float s1 = ns >= 1 ? s1p[i] : 0.0f, s2 = ns >= 2 ? s2p[i] : 0.0f;
    float s3 = ns >= 3 ? s3p[i] : 0.0f;
    float p = mf_optim_load_param(t.p, t.c, i, dt);
    mf_optim_update_one3(h.kind, &c, ns, &p, mf_load_f32(t.g, i, dt), &s1, &s2, &s3);
    mf_optim_store_param(t.p, t.c, i, dt, p, &h, t.sr_stream, t.index_base);
    if (ns >= 1) s1p[i] = s1;
    if (ns >= 2) s2p[i] = s2;
    if (ns >= 3) s3p[i] = s3;
  }
}

/* ---- the warp kernel (optim_warp.cuh: its design, its lane-level pieces, warp_form) ---- */
constexpr int kWarps = kThreads / 32;
static_assert(kItem % kTile == 0, "items are whole tiles");

template <int BITS, int KIND, int PM>
__global__ void __launch_bounds__(kThreads, 2)
    optim_warp_kernel(LaunchList L, mf_optim_hparams h, const float *__restrict__ code1,
                      const float *__restrict__ code2, const float *grad_scale,
                      const float *found_inf, int use_slice) {
  constexpr int CS = BITS == 8 ? MF_CODE_SIZE : MF_CODE4_SIZE;
  constexpr int BS = BITS == 8 ? MF_OPTIM_BLOCK_8BIT : MF_OPTIM_BLOCK_4BIT;
  constexpr int LANES = BS / kPerLane; /* lanes of one quantization block */
  static_assert(LANES == 32 || LANES == 16, "a block is a warp or half a warp");
  constexpr mf_optim_kind kind = (mf_optim_kind)KIND;
  /* the kinds warp_form() admits: state1 signed, state2 (Adam's) non-negative */
  constexpr int NS = KIND == MF_OPT_ADAMW || KIND == MF_OPT_ADAM ? 2 : 1;
  __shared__ float c1s[CS], c2s[NS >= 2 ? CS : 1];
  __shared__ uint32_t sl1[kSliceSigned], sl2[NS >= 2 ? kSlicePositive : 1];

  if (skipped(found_inf)) return;
  for (int i = threadIdx.x; i < CS; i += blockDim.x) {
    c1s[i] = code1[i];
    if (NS >= 2) c2s[i] = code2[i];
  }
  __syncthreads(); /* the codes */
  if (use_slice) {
    slice_build<CS>(sl1, c1s, false);
    if (NS >= 2) slice_build<CS>(sl2, c2s, true);
    __syncthreads(); /* the slices */
  }
  const bool slice = use_slice != 0;
  const int lane = threadIdx.x % 32;
  const int64_t items = L.start[L.n];
  int64_t cur = -1;
  mf_optim_consts c;
  uint64_t seed = 0;
  for (int64_t w = (int64_t)blockIdx.x * kWarps + threadIdx.x / 32; w < items;
       w += (int64_t)gridDim.x * kWarps) {
    int64_t first;
    const TensorSlot t = locate(L, w, &first);
    const int64_t ti = mf_mt_tensor_of(L.start, L.n, w);
    if (ti != cur) { /* the same for every lane of the warp */
      cur = ti;
      c = consts_of(h, t, grad_scale);
      seed = mf_optim_sr_seed(&h, t.sr_stream);
    }
    const int64_t end = first + kItem < t.numel ? first + kItem : t.numel;
    for (int64_t base = first; base < end; base += kTile) {
      const int64_t i = base + lane * kPerLane;
      const int valid = i >= end ? 0 : (end - i >= kPerLane ? kPerLane : (int)(end - i));
      const int64_t blk = (int64_t)((uint64_t)i / BS);
      const int esize = PM == kParamF32 ? 4 : 2;
      const bool vec = valid == kPerLane && aligned_to((const char *)t.p + i * esize, 16) &&
                       aligned_to((const char *)t.g + i * esize, 16);
      const uintptr_t cbytes = BITS == 8 ? 8 : 4;
      const int64_t cat = BITS == 8 ? i : i / 2;
      const bool cvec = valid == kPerLane && aligned_to((const uint8_t *)t.s1 + cat, cbytes) &&
                        (NS < 2 || aligned_to((const uint8_t *)t.s2 + cat, cbytes));
      /* every load of the tile first */
      float am1 = 0.0f, am2 = 0.0f;
      if (valid > 0) {
        am1 = t.a1[blk];
        if (NS >= 2) am2 = t.a2[blk];
      }
      uint32_t q1[kPerLane], q2[kPerLane];
      load_codes<BITS>(t.s1, i, cvec, valid, q1);
      if (NS >= 2) load_codes<BITS>(t.s2, i, cvec, valid, q2);
      float p[kPerLane], g[kPerLane];
      if (KIND != MF_OPT_MUON) { /* Muon's `param` is its output, never read */
        load8<PM>(t.p, i, vec, valid, p);
      } else {
#pragma unroll
        for (int k = 0; k < kPerLane; k++) p[k] = 0.0f;
      }
      load8<PM>(t.g, i, vec, valid, g);

      float s1[kPerLane], s2[kPerLane];
      uint32_t m1 = 0, m2 = 0;
#pragma unroll
      for (int k = 0; k < kPerLane; k++) {
        float a = mf_dequantize_one(c1s, (uint8_t)q1[k], am1);
        float b = NS >= 2 ? mf_dequantize_one(c2s, (uint8_t)q2[k], am2) : 0.0f;
        if (k < valid) {
          mf_optim_update_one(kind, &c, NS, &p[k], g[k], &a, &b);
        } else {
          a = 0.0f;
          b = 0.0f;
        }
        s1[k] = a;
        s2[k] = b;
        const uint32_t b1 = mf_f32_bits(a) & 0x7fffffffu, b2 = mf_f32_bits(b) & 0x7fffffffu;
        m1 = b1 > m1 ? b1 : m1;
        m2 = b2 > m2 ? b2 : m2;
      }
      if (valid > 0) store8<PM>(t.p, i, vec, valid, p, seed, t.index_base + i);

      /* the new absmax of each block, as optim_quant_kernel reduces it */
      m1 = group_max_u32<LANES>(m1);
      if (NS >= 2) m2 = group_max_u32<LANES>(m2);
      if (lane % LANES == 0 && valid > 0) {
        t.a1[blk] = mf_f32_from_bits(m1);
        if (NS >= 2) t.a2[blk] = mf_f32_from_bits(m2);
      }
      if (valid == 0) continue;
      const mf_block_scale sc1 = mf_absmax_scale(mf_f32_from_bits(m1));
      const mf_block_scale sc2 = mf_absmax_scale(mf_f32_from_bits(m2));
#pragma unroll
      for (int k = 0; k < kPerLane; k++) {
        const bool in = k < valid;
        q1[k] = in ? quantize_state<CS>(sl1, c1s, false, slice, mf_block_normalize(s1[k], sc1)) : 0u;
        if (NS >= 2)
          q2[k] = in ? quantize_state<CS>(sl2, c2s, true, slice, mf_block_normalize(s2[k], sc2)) : 0u;
      }
      store_codes<BITS>(t.s1, i, cvec, valid, q1);
      if (NS >= 2) store_codes<BITS>(t.s2, i, cvec, valid, q2);
    }
  }
}

__global__ void optim_count_kernel(StepList S, const float *found_inf) {
  if (skipped(found_inf)) return;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < S.n; i += gridDim.x * blockDim.x)
    *S.step[i] += 1.0f;
}

/* Launches the update kernel for the tensors gathered so far. */
mf_status launch(const LaunchList &L, const mf_optim_hparams *h, mf_state_format fmt,
                 int64_t bs, const float *code1, const float *code2, const float *scale,
                 const float *inf, cudaStream_t stream) {
  const int64_t items = L.start[L.n];
  if (L.n == 0 || items == 0) return MF_OK;
  const dim3 grid((unsigned)items), block(kThreads);
  if (fmt == MF_STATE_FP32) {
    optim_fp32_kernel<<<grid, block, 0, stream>>>(L, *h, scale, inf);
  } else {
    const bool three = mf_optim_num_states(h) > 2;
#define MF_LAUNCH_QUANT_S(BS, S3)                                                                \
  if (fmt == MF_STATE_8BIT)                                                                      \
    optim_quant_kernel<BS, 8, S3><<<grid, block, 0, stream>>>(L, *h, code1, code2, scale, inf);  \
  else                                                                                           \
    optim_quant_kernel<BS, 4, S3><<<grid, block, 0, stream>>>(L, *h, code1, code2, scale, inf);
#define MF_LAUNCH_QUANT(BS)                                                                      \
  case BS:                                                                                       \
    if (three) {                                                                                 \
      MF_LAUNCH_QUANT_S(BS, true)                                                                \
    } else {                                                                                     \
      MF_LAUNCH_QUANT_S(BS, false)                                                               \
    }                                                                                            \
    break;
    switch (bs) {
      MF_LAUNCH_QUANT(64)
      MF_LAUNCH_QUANT(128)
      MF_LAUNCH_QUANT(256)
      MF_LAUNCH_QUANT(512)
      MF_LAUNCH_QUANT(1024)
      MF_LAUNCH_QUANT(2048)
      MF_LAUNCH_QUANT(4096)
      default: return mf_error(MF_ERR_INTERNAL, "optimizer step: unexpected block size %lld", (long long)bs);
    }
#undef MF_LAUNCH_QUANT
#undef MF_LAUNCH_QUANT_S
  }
  return mf_cuda_status(cudaGetLastError(), "optimizer step");
}

struct WarpLaunch {
  const mf_optim_hparams *h;
  const float *code1, *code2, *scale, *inf;
  cudaStream_t stream;
};

template <int BITS, int KIND, int PM>
mf_status launch_warp(const LaunchList &L, const WarpLaunch &a) {
  const int64_t items = L.start[L.n];
  if (L.n == 0 || items == 0) return MF_OK;
  /* a resident grid: as many blocks as fit the SMs at once, each walking its items (the
   * blocks per SM are asked once per instantiation: a process with GPUs of two
   * architectures gets the first one's count, which only sizes the grid) */
  static const int per_sm = [] {
    int b = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&b, optim_warp_kernel<BITS, KIND, PM>, kThreads, 0) !=
            cudaSuccess ||
        b < 1) {
      cudaGetLastError();
      b = 2;
    }
    return b;
  }();
  int dev = 0, sms = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  if (err != cudaSuccess) return mf_cuda_status(err, "optimizer step");
  const int64_t want = (items + kWarps - 1) / kWarps, resident = (int64_t)(sms > 0 ? sms : 1) * per_sm;
  const unsigned blocks = (unsigned)(want < resident ? want : resident);
  const int use_slice = items * kItem >= slice_min_elements();
  optim_warp_kernel<BITS, KIND, PM><<<blocks, kThreads, 0, a.stream>>>(L, *a.h, a.code1, a.code2, a.scale,
                                                                       a.inf, use_slice);
  return mf_cuda_status(cudaGetLastError(), "optimizer step");
}

template <int BITS, int KIND>
mf_status launch_warp_form(int form, const LaunchList &L, const WarpLaunch &a) {
  switch (form) {
    case kParamF32: return launch_warp<BITS, KIND, kParamF32>(L, a);
    case kParamBF16: return launch_warp<BITS, KIND, kParamBF16>(L, a);
    default: return launch_warp<BITS, KIND, kParamBF16SR>(L, a);
  }
}

template <int BITS>
mf_status launch_warp_kind(int form, const LaunchList &L, const WarpLaunch &a) {
  switch (a.h->kind) {
    case MF_OPT_ADAMW: return launch_warp_form<BITS, MF_OPT_ADAMW>(form, L, a);
    case MF_OPT_ADAM: return launch_warp_form<BITS, MF_OPT_ADAM>(form, L, a);
    case MF_OPT_LION: return launch_warp_form<BITS, MF_OPT_LION>(form, L, a);
    case MF_OPT_SGD: return launch_warp_form<BITS, MF_OPT_SGD>(form, L, a);
    case MF_OPT_MUON: return launch_warp_form<BITS, MF_OPT_MUON>(form, L, a);
    default: return mf_error(MF_ERR_INTERNAL, "optimizer step: no warp kernel for kind %d", (int)a.h->kind);
  }
}

}  // namespace

extern "C" mf_status mf_cuda_optim_step(const mf_optim_hparams *h, mf_state_format fmt,
                                        int64_t block_size, const mf_tensor *code1,
                                        const mf_tensor *code2, const mf_optim_tensor *ts,
                                        int64_t n, const mf_tensor *grad_scale,
                                        const mf_tensor *found_inf, void *stream_) {
  MfDeviceGuard guard(ts[0].param.device_id);
  if (guard.err != cudaSuccess) return mf_cuda_status(guard.err, "optimizer step");
  cudaStream_t stream = (cudaStream_t)stream_;
  const float *scale = grad_scale ? (const float *)grad_scale->data : nullptr;
  const float *inf = found_inf ? (const float *)found_inf->data : nullptr;
  const float *c1 = code1 ? (const float *)code1->data : nullptr;
  const float *c2 = code2 ? (const float *)code2->data : nullptr;
  mf_status st;
  if (h->max_unorm > 0.0 &&
      (st = trust_norms(h, fmt, block_size, c1, c2, ts, n, scale, inf, stream)))
    return st;

  /* pack tensors kMaxTensors at a time; a launch also stops before its grid would
   * exceed 2^31 - 1 blocks (a single larger tensor is refused first, before any launch) */
  int64_t *split = (int64_t *)malloc((size_t)n * sizeof *split);
  if (!split) return mf_error(MF_ERR_NOMEM, "optimizer step: out of host memory");
  for (int64_t i = 0; i < n; i++)
    split[i] = mf_optim_split_rows(fmt, block_size, ts[i].param.numel, ts[i].rows ? ts[i].rows : 1);
  const int form = warp_form(h, fmt, block_size, ts, n);
  st = for_each_launch<LaunchList>(
      ts, n, split, kItem,
      [&](TensorSlot &s, const mf_optim_tensor &x, int64_t i) {
        fill_common(s, x);
        s.s3 = x.state3.data;
        s.a3 = (float *)x.absmax3.data;
        s.rows = split[i];
        s.index_base = x.index_base;
        s.sr_stream = x.sr_stream;
        s.bits = (int)fmt;
        s.block_size = (int)block_size;
        s.trust = h->max_unorm > 0.0 && x.param.numel > 0
                      ? mf_optim_trust_totals(x.trust.data, x.param.numel) : nullptr;
      },
      [&](const LaunchList &L) {
        if (form < 0) return launch(L, h, fmt, block_size, c1, c2, scale, inf, stream);
        const WarpLaunch a = {h, c1, c2, scale, inf, stream};
        return fmt == MF_STATE_8BIT ? launch_warp_kind<8>(form, L, a) : launch_warp_kind<4>(form, L, a);
      });
  free(split);
  if (st) return st;

  /* the step counters move only after every chunk of every tensor has read them */
  StepList S;
  S.n = 0;
  for (int64_t i = 0; i < n; i++) {
    S.step[S.n++] = (float *)ts[i].step.data;
    if (S.n == kMaxCountTensors || i == n - 1) {
      optim_count_kernel<<<(S.n + kThreads - 1) / kThreads, kThreads, 0, stream>>>(S, inf);
      if ((st = mf_cuda_status(cudaGetLastError(), "optimizer step"))) return st;
      S.n = 0;
    }
  }
  return MF_OK;
}
