/* Unit tests of mfemu (cuda/emulate), the CPU runtime the emulated kernel tests run on:
 * rewritten by cuda/emulate/rewrite_launches.py and built with g++ with runtime.cpp
 * (tests/test_cuda_emulated.py; natively, and for aarch64 under qemu). Prints one line
 * per failed check; exit status 1 if any. */
#include <cuda_runtime.h>

#include <stdio.h>
#include <string.h>

static int failures = 0;
#define CHECK(cond, ...)                                  \
  do {                                                    \
    if (!(cond)) {                                        \
      printf("FAIL %s:%d: ", __FILE__, __LINE__);         \
      printf(__VA_ARGS__);                                \
      printf("\n");                                       \
      failures++;                                         \
    }                                                     \
  } while (0)

__global__ void shuffles(int *out) {
  const int t = threadIdx.x, lane = t % 32;
  out[t * 8 + 0] = __shfl_xor_sync(0xffffffffu, t, 5);
  out[t * 8 + 1] = __shfl_down_sync(0xffffffffu, t, 3);
  out[t * 8 + 2] = __shfl_up_sync(0xffffffffu, t, 2, 8);
  out[t * 8 + 3] = __shfl_sync(0xffffffffu, t, 7, 16);
  out[t * 8 + 4] = (int)__ballot_sync(0xffffffffu, lane % 3 == 0);
  out[t * 8 + 5] = __syncthreads_or(t == 40);
  out[t * 8 + 6] = __syncthreads_and(t != 40);
  out[t * 8 + 7] = __syncthreads_count(t % 2);
}

template <class T>
__device__ T first_of_block(T v) {
  __shared__ T s[2];
  if (threadIdx.x == 0) s[0] = v;
  __syncthreads();
  return s[0];
}

/* block 0 writes shared memory; later blocks read it before writing */
__global__ void stale_shared(unsigned *out) {
  __shared__ unsigned x;
  if (blockIdx.x == 0 && threadIdx.x == 0) x = 42;
  __syncthreads();
  if (threadIdx.x == 0) out[blockIdx.x] = x;
  out[4 + blockIdx.x] = (unsigned)first_of_block(blockIdx.x + 100); /* a template's static */
}

__global__ void different_barriers() {
  if (threadIdx.x == 0) __syncthreads();
  else __syncthreads();
}

__global__ void deadlock() {
  if (threadIdx.x < 16) __syncwarp();  /* waits for lanes 16..31, which wait at the barrier */
  else __syncthreads();
}

__global__ void missing_lane(int *out) { out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, 1, 1); }

__global__ void exited_lane(int *out) {
  if (threadIdx.x == 1) return;
  out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, 1, 2);
}

/* warp 1 reads what warp 0 wrote with no barrier between: depends on the schedule */
__global__ void racy(int *out) {
  __shared__ int s;
  if (threadIdx.x == 0) s = 0;
  __syncthreads();
  if (threadIdx.x / 32 == 0) {
    __syncwarp();
    if (threadIdx.x == 0) s = 1;
  } else {
    __syncwarp();
    if (threadIdx.x == 32) *out = s;
  }
}

static bool failed_with(const char *what) {
  const cudaError_t e = cudaGetLastError();
  return e == cudaErrorLaunchFailure && strstr(mfemu_last_failure(), what) &&
         strstr(mfemu_last_failure(), "MFEMU_SEED=");
}

int main() {
  int out[64 * 8];
  /* the occupancy query a resident grid is sized by (cuda/optim.cu, quant.cu) */
  int per_sm = 0;
  CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, shuffles, 256, 0) == cudaSuccess && per_sm == 2,
        "occupancy: %d", per_sm);
  CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, shuffles, 0, 0) == cudaErrorInvalidValue,
        "occupancy of 0 threads accepted");
  shuffles<<<1, 64>>>(out);
  CHECK(cudaGetLastError() == cudaSuccess, "shuffles: %s", mfemu_last_failure());
  for (int t = 0; t < 64; t++) {
    const int lane = t % 32, base = t - lane;
    const int down = lane + 3 < 32 ? t + 3 : t, up = lane % 8 >= 2 ? t - 2 : t;
    unsigned ballot = 0;
    for (int l = 0; l < 32; l++) ballot |= (unsigned)(l % 3 == 0) << l;
    CHECK(out[t * 8 + 0] == (base | (lane ^ 5)), "xor %d: %d", t, out[t * 8 + 0]);
    CHECK(out[t * 8 + 1] == down, "down %d: %d", t, out[t * 8 + 1]);
    CHECK(out[t * 8 + 2] == up, "up (width 8) %d: %d", t, out[t * 8 + 2]);
    CHECK(out[t * 8 + 3] == base + lane / 16 * 16 + 7, "idx (width 16) %d: %d", t, out[t * 8 + 3]);
    CHECK((unsigned)out[t * 8 + 4] == ballot, "ballot %d: %x", t, out[t * 8 + 4]);
    CHECK(out[t * 8 + 5] == 1 && out[t * 8 + 6] == 0 && out[t * 8 + 7] == 32, "syncthreads_or/and/count %d", t);
  }

  unsigned got[8];
  stale_shared<<<3, 32>>>(got);
  CHECK(cudaGetLastError() == cudaSuccess, "stale_shared: %s", mfemu_last_failure());
  CHECK(got[0] == 42 && got[1] == 0xffffffffu && got[2] == 0xffffffffu,
        "shared memory not poisoned between blocks: %x %x %x", got[0], got[1], got[2]);
  CHECK(got[4] == 100 && got[5] == 101 && got[6] == 102, "template shared: %u %u %u", got[4], got[5], got[6]);

  different_barriers<<<1, 64>>>();
  CHECK(failed_with("different __syncthreads"), "different barriers: %s", mfemu_last_failure());
  deadlock<<<1, 32>>>();
  CHECK(failed_with("deadlock"), "deadlock: %s", mfemu_last_failure());
  missing_lane<<<1, 20>>>(out);
  CHECK(failed_with("does not exist"), "missing lane: %s", mfemu_last_failure());
  exited_lane<<<1, 32>>>(out);
  CHECK(failed_with("has exited"), "exited lane: %s", mfemu_last_failure());
  shuffles<<<1, 2048>>>(out);
  CHECK(cudaGetLastError() == cudaErrorInvalidConfiguration, "2048 threads accepted");
  shuffles<<<1, 64>>>(out); /* a failure leaves the runtime usable */
  CHECK(cudaGetLastError() == cudaSuccess && out[5 * 8] == 0, "launch after failures: %s", mfemu_last_failure());

  /* seed 0 runs warp 0 first; some seeded schedules run warp 1's read first */
  int seen[2] = {0, 0};
  for (unsigned long long seed = 0; seed < 40; seed++) {
    mfemu_set_seed(seed);
    int v = -1;
    racy<<<1, 64>>>(&v);
    CHECK(cudaGetLastError() == cudaSuccess && (v == 0 || v == 1), "racy seed %llu: %d", seed, v);
    if (v == 0 || v == 1) seen[v]++;
  }
  CHECK(seen[0] > 0 && seen[1] > 0, "the seeded schedules never reorder warps: %d %d", seen[0], seen[1]);

  printf("%s\n", failures ? "mfemu selftest FAILED" : "mfemu selftest ok");
  return failures ? 1 : 0;
}
