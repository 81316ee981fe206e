/*
 * mfemu: a CUDA runtime that executes memfit's kernels (the .cu files of cuda/,
 * unchanged) on the CPU, so the test suite can compare every kernel bit for bit with
 * the C core on a machine with no GPU. This header replaces <cuda_runtime.h> for a g++ build of the
 * kernels (CMake: -DMEMFIT_CUDA=EMULATE); runtime.cpp implements it.
 *
 * How a kernel runs: one fiber (its own stack) per CUDA thread; the blocks of a launch
 * run one after another and launches run synchronously, in call order, whatever the
 * stream. A scheduler runs the threads of a block; each runs until it waits (a
 * barrier, a warp collective, its exit). The next thread to run is drawn by a PRNG
 * seeded from MFEMU_SEED (0, the default: first come, first run; see pick() in
 * runtime.cpp for the odd and even seeds), so a
 * read of shared memory that a barrier does not order shows up as a mismatch under
 * some seeds. Warp collectives (__shfl*_sync, __ballot_sync, __syncwarp) wait only for
 * the lanes of their own 32-lane warp named in the mask; __syncthreads* waits for every
 * thread of the block that has not exited. Shared memory (`__shared__`, turned into a
 * registered static by rewrite_launches.py) is filled with 0xFF bytes (NaN floats) at
 * the start of every block, so a read before any write cannot see a previous block's
 * values. A deadlock, threads at different __syncthreads, a mask naming an exited or
 * nonexistent lane, or a bad launch configuration fail the launch: cudaGetLastError()
 * returns an error, and the message (with the seed) goes to stderr and to
 * mfemu_last_failure(). Nothing aborts.
 *
 * What this does not model: nvcc's code generation (FMA contraction, flush to zero,
 * device libm, the __CUDA_ARCH__ paths of memfit's headers: neither __CUDACC__ nor
 * __CUDA_ARCH__ is defined here, so MF_HD is empty and the host forms are compiled),
 * warp lockstep and the GPU memory model, cuBLASLt, speed.
 */
#ifndef MFEMU_CUDA_RUNTIME_H
#define MFEMU_CUDA_RUNTIME_H

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <utility>

#define MFEMU 1
#define CUDART_VERSION 13000

/* ---- qualifiers ---------------------------------------------------------------------- */
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#ifndef __restrict__
#define __restrict__ __restrict
#endif
/* rewrite_launches.py turns every `__shared__ T name[...];` into MFEMU_SHARED(...); a
 * __shared__ it did not rewrite (say, in a header) must not compile as something else */
#define __shared__ __shared___was_not_rewritten_by_rewrite_launches_py
#define MFEMU_SHARED(decl, name) \
  static decl;                   \
  static const bool mfemu_shared_reg_##name [[maybe_unused]] = mfemu_register_shared(&name, sizeof name)

/* ---- types --------------------------------------------------------------------------- */
struct uint3 {
  unsigned x, y, z;
};
struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned vx = 1, unsigned vy = 1, unsigned vz = 1) : x(vx), y(vy), z(vz) {}
  constexpr dim3(uint3 v) : x(v.x), y(v.y), z(v.z) {}
};

enum cudaError_t {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorMemoryAllocation = 2,
  cudaErrorInitializationError = 3,
  cudaErrorInvalidConfiguration = 9,
  cudaErrorInvalidDevice = 101,
  cudaErrorInsufficientDriver = 35,
  cudaErrorNoDevice = 100,
  cudaErrorNoKernelImageForDevice = 209,
  cudaErrorUnsupportedPtxVersion = 222,
  cudaErrorNotSupported = 801,
  cudaErrorStreamCaptureImplicit = 906,
  cudaErrorLaunchFailure = 719,
};
typedef cudaError_t cudaError;

typedef struct mfemu_stream *cudaStream_t;
typedef struct mfemu_event *cudaEvent_t;

enum cudaMemcpyKind {
  cudaMemcpyHostToHost = 0,
  cudaMemcpyHostToDevice = 1,
  cudaMemcpyDeviceToHost = 2,
  cudaMemcpyDeviceToDevice = 3,
  cudaMemcpyDefault = 4
};
enum cudaDeviceAttr {
  cudaDevAttrMaxThreadsPerBlock = 1,
  cudaDevAttrMultiProcessorCount = 16,
  cudaDevAttrComputeCapabilityMajor = 75,
  cudaDevAttrComputeCapabilityMinor = 76,
};
enum cudaStreamCaptureStatus {
  cudaStreamCaptureStatusNone = 0,
  cudaStreamCaptureStatusActive = 1,
  cudaStreamCaptureStatusInvalidated = 2
};
enum cudaDriverEntryPointQueryResult {
  cudaDriverEntryPointSuccess = 0,
  cudaDriverEntryPointSymbolNotFound = 1,
  cudaDriverEntryPointVersionNotSufficent = 2
};
enum { cudaEnableDefault = 0 };

struct cudaDeviceProp {
  char name[256];
  size_t totalGlobalMem;
  size_t sharedMemPerBlock;
  int warpSize;
  int maxThreadsPerBlock;
  int maxThreadsDim[3];
  int maxGridSize[3];
  int major, minor;
  int multiProcessorCount;
};

/* ---- runtime API (runtime.cpp) ------------------------------------------------------- */
const char *cudaGetErrorName(cudaError_t err);
const char *cudaGetErrorString(cudaError_t err);
cudaError_t cudaGetLastError(void);
cudaError_t cudaPeekAtLastError(void);
cudaError_t cudaGetDeviceCount(int *count);
cudaError_t cudaGetDevice(int *device);
cudaError_t cudaSetDevice(int device);
cudaError_t cudaGetDeviceProperties(cudaDeviceProp *prop, int device);
cudaError_t cudaDeviceGetAttribute(int *value, cudaDeviceAttr attr, int device);
cudaError_t cudaDriverGetVersion(int *version);
cudaError_t cudaRuntimeGetVersion(int *version);
cudaError_t cudaGetDriverEntryPoint(const char *symbol, void **fn, unsigned long long flags,
                                    cudaDriverEntryPointQueryResult *status = nullptr);
cudaError_t cudaGetDriverEntryPointByVersion(const char *symbol, void **fn, unsigned version,
                                             unsigned long long flags,
                                             cudaDriverEntryPointQueryResult *status = nullptr);
cudaError_t cudaMalloc(void **ptr, size_t size);
template <class T>
cudaError_t cudaMalloc(T **ptr, size_t size) {
  return cudaMalloc((void **)ptr, size);
}
cudaError_t cudaFree(void *ptr);
cudaError_t cudaMemcpy(void *dst, const void *src, size_t n, cudaMemcpyKind kind);
cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t n, cudaMemcpyKind kind,
                            cudaStream_t stream = nullptr);
cudaError_t cudaMemset(void *dst, int value, size_t n);
cudaError_t cudaMemsetAsync(void *dst, int value, size_t n, cudaStream_t stream = nullptr);
cudaError_t cudaDeviceSynchronize(void);
cudaError_t cudaStreamSynchronize(cudaStream_t stream);
cudaError_t cudaStreamIsCapturing(cudaStream_t stream, cudaStreamCaptureStatus *status);
cudaError_t cudaEventCreate(cudaEvent_t *event);
cudaError_t cudaEventDestroy(cudaEvent_t event);
cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream = nullptr);
cudaError_t cudaEventSynchronize(cudaEvent_t event);
cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned flags = 0);
/* Blocks of `kernel` one SM holds at once: mfemu runs blocks one after another and has no
 * occupancy; it answers 2, so a launcher that sizes a resident grid from this (cuda/optim.cu's
 * warp kernel) gets blocks that each walk several items, as on a GPU. */
template <class K>
cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessor(int *blocks, K kernel, int block_size,
                                                          size_t dynamic_smem) {
  (void)kernel;
  (void)dynamic_smem;
  if (!blocks || block_size < 1) return cudaErrorInvalidValue;
  *blocks = 2;
  return cudaSuccess;
}

/* ---- mfemu's own interface ------------------------------------------------------------ */
extern "C" {
/* The message of the last failed launch ("" when none failed since the last query). */
const char *mfemu_last_failure(void);
/* The schedule seed in use (MFEMU_SEED, read at the first launch; settable). */
unsigned long long mfemu_seed(void);
void mfemu_set_seed(unsigned long long seed);
}

bool mfemu_register_shared(void *p, size_t size);

/* The built-ins of the running CUDA thread (set by the scheduler at each switch). */
extern uint3 threadIdx, blockIdx;
extern dim3 blockDim, gridDim;
constexpr int warpSize = 32;

namespace mfemu {
typedef void (*thread_body)(void *ctx);
/* Runs the grid: body(ctx) once per CUDA thread. */
cudaError_t run_grid(const char *kernel, const char *file, int line, dim3 grid, dim3 block,
                     size_t dynamic_smem, thread_body body, void *ctx);

enum Collective { kShfl, kBallot, kSyncwarp };
/* A warp collective of the running thread: waits for the lanes of `mask`; returns the
 * value of lane `src` (shuffles), the ballot (kBallot) or 0. */
uint64_t warp_collective(const char *file, int line, Collective kind, unsigned mask,
                         uint64_t value, int src_lane, int width);
enum BarrierKind { kSync, kSyncOr, kSyncAnd, kSyncCount };
int block_barrier(const char *file, int line, BarrierKind kind, int pred);

template <class T>
T shfl(const char *file, int line, unsigned mask, T v, int src, int width) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable<T>::value, "shuffle of a small value");
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof v);
  bits = warp_collective(file, line, kShfl, mask, bits, src, width);
  T r;
  std::memcpy(&r, &bits, sizeof r);
  return r;
}
inline int lane_in(int width, int lane) { return lane / width * width; }

/* kernel<<<g, b, s, st>>>(args...) -> mfemu::launcher(name, file, line, kernel, g, b, s,
 * st)(args...) (rewrite_launches.py): the arguments are converted to the kernel's
 * parameter types once, then copied into every thread's call (by value, as CUDA passes
 * them). Returns the launch's error, which cudaGetLastError() also reports. */
template <class... P>
struct Launcher {
  const char *name, *file;
  int line;
  void (*kernel)(P...);
  dim3 grid, block;
  size_t smem;
  template <class... A>
  cudaError_t operator()(A &&...args) const {
    static_assert(sizeof...(P) == sizeof...(A), "kernel launched with the wrong argument count");
    struct Ctx {
      void (*k)(P...);
      std::tuple<typename std::decay<P>::type...> params;
    } ctx{kernel, std::tuple<typename std::decay<P>::type...>(std::forward<A>(args)...)};
    auto body = [](void *c) {
      Ctx &x = *static_cast<Ctx *>(c);
      std::apply([&](const auto &...p) { x.k(p...); }, x.params);
    };
    return run_grid(name, file, line, grid, block, smem, body, &ctx);
  }
};
template <class... P>
Launcher<P...> launcher(const char *name, const char *file, int line, void (*kernel)(P...), dim3 grid,
                        dim3 block, size_t smem = 0, cudaStream_t = nullptr) {
  return Launcher<P...>{name, file, line, kernel, grid, block, smem};
}
}  // namespace mfemu

/* ---- device built-ins ---------------------------------------------------------------- */
#define __syncthreads() ((void)mfemu::block_barrier(__FILE__, __LINE__, mfemu::kSync, 0))
#define __syncthreads_or(p) mfemu::block_barrier(__FILE__, __LINE__, mfemu::kSyncOr, (p) != 0)
#define __syncthreads_and(p) mfemu::block_barrier(__FILE__, __LINE__, mfemu::kSyncAnd, (p) != 0)
#define __syncthreads_count(p) mfemu::block_barrier(__FILE__, __LINE__, mfemu::kSyncCount, (p) != 0)
#define __syncwarp(...) ((void)mfemu::warp_collective(__FILE__, __LINE__, mfemu::kSyncwarp, \
                                                       mfemu_mask_or_full(__VA_ARGS__), 0, 0, 32))
#define __ballot_sync(mask, p) \
  ((unsigned)mfemu::warp_collective(__FILE__, __LINE__, mfemu::kBallot, (mask), (p) != 0, 0, 32))
#define __shfl_sync(mask, v, src, ...) \
  mfemu::shfl(__FILE__, __LINE__, (mask), (v), mfemu_shfl_idx((src), ##__VA_ARGS__), mfemu_width(__VA_ARGS__))
#define __shfl_xor_sync(mask, v, lm, ...) \
  mfemu::shfl(__FILE__, __LINE__, (mask), (v), mfemu_shfl_xor((lm), ##__VA_ARGS__), mfemu_width(__VA_ARGS__))
#define __shfl_down_sync(mask, v, d, ...) \
  mfemu::shfl(__FILE__, __LINE__, (mask), (v), mfemu_shfl_down((d), ##__VA_ARGS__), mfemu_width(__VA_ARGS__))
#define __shfl_up_sync(mask, v, d, ...) \
  mfemu::shfl(__FILE__, __LINE__, (mask), (v), mfemu_shfl_up((d), ##__VA_ARGS__), mfemu_width(__VA_ARGS__))

inline unsigned mfemu_mask_or_full(unsigned mask = 0xffffffffu) { return mask; }
inline int mfemu_width(int width = 32) { return width; }
/* Source lanes (0..31 in the warp) as CUDA defines them: a lane outside the caller's
 * segment of `width` lanes reads its own value. */
inline int mfemu_lane() { return (int)(threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z)) % 32; }
inline int mfemu_shfl_idx(int src, int width = 32) {
  return mfemu::lane_in(width, mfemu_lane()) + ((src % width) + width) % width;
}
inline int mfemu_shfl_xor(int lm, int width = 32) {
  const int lane = mfemu_lane(), t = lane ^ lm;
  return t >= mfemu::lane_in(width, lane) + width ? lane : t;
}
inline int mfemu_shfl_down(unsigned d, int width = 32) {
  const int lane = mfemu_lane(), t = lane + (int)d;
  return t >= mfemu::lane_in(width, lane) + width ? lane : t;
}
inline int mfemu_shfl_up(unsigned d, int width = 32) {
  const int lane = mfemu_lane(), t = lane - (int)d;
  return t < mfemu::lane_in(width, lane) ? lane : t;
}

/* Atomics: the scheduler switches threads only at barriers and collectives, so a plain
 * read-modify-write is atomic with respect to the other CUDA threads. */
template <class T>
inline T atomicAdd(T *p, T v) { T o = *p; *p = o + v; return o; }
template <class T>
inline T atomicMax(T *p, T v) { T o = *p; *p = v > o ? v : o; return o; }
template <class T>
inline T atomicMin(T *p, T v) { T o = *p; *p = v < o ? v : o; return o; }
template <class T>
inline T atomicExch(T *p, T v) { T o = *p; *p = v; return o; }
template <class T>
inline T atomicCAS(T *p, T cmp, T v) { T o = *p; if (o == cmp) *p = v; return o; }
template <class T>
inline T __ldg(const T *p) { return *p; }
inline void __threadfence() {}
inline void __threadfence_block() {}

/* The device's integer max/min overloads (float ones come from <cmath>'s fmaxf). */
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
inline unsigned long long max(unsigned long long a, unsigned long long b) { return a > b ? a : b; }
inline int min(int a, int b) { return a < b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline unsigned long long min(unsigned long long a, unsigned long long b) { return a < b ? a : b; }
inline float max(float a, float b) { return fmaxf(a, b); }
inline float min(float a, float b) { return fminf(a, b); }
inline double max(double a, double b) { return fmax(a, b); }
inline double min(double a, double b) { return fmin(a, b); }

#endif /* MFEMU_CUDA_RUNTIME_H */
