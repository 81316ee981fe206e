/*
 * mfemu's runtime: the fibers, the scheduler of a thread block, the barriers and warp
 * collectives, and the host API of cuda_runtime.h (see there for the model). One
 * launch at a time (a mutex): the built-ins are plain globals that the scheduler sets
 * at every switch, which is what makes threadIdx a cheap load in the kernels.
 */
#include "cuda_runtime.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#define MFEMU_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define MFEMU_ASAN 1
#endif
#endif
#ifdef MFEMU_ASAN
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif

#if !defined(__x86_64__) && !defined(__aarch64__)
#define MFEMU_UCONTEXT 1
#include <ucontext.h>
#endif

uint3 threadIdx, blockIdx;
dim3 blockDim, gridDim;

/* ---- context switch: saves the callee-saved registers (and the FP control state) on
 * the current stack, stores the stack pointer in *save, continues on `to` ------------ */
#if defined(__x86_64__)
extern "C" void mfemu_swap_context(void **save, void *to);
asm(R"(
  .text
  .globl mfemu_swap_context
  .hidden mfemu_swap_context
  .type mfemu_swap_context,@function
mfemu_swap_context:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size mfemu_swap_context,.-mfemu_swap_context
)");
#elif defined(__aarch64__)
extern "C" void mfemu_swap_context(void **save, void *to);
asm(R"(
  .text
  .globl mfemu_swap_context
  .hidden mfemu_swap_context
  .type mfemu_swap_context,%function
mfemu_swap_context:
  sub sp, sp, #176
  stp x19, x20, [sp, #0]
  stp x21, x22, [sp, #16]
  stp x23, x24, [sp, #32]
  stp x25, x26, [sp, #48]
  stp x27, x28, [sp, #64]
  stp x29, x30, [sp, #80]
  stp d8, d9, [sp, #96]
  stp d10, d11, [sp, #112]
  stp d12, d13, [sp, #128]
  stp d14, d15, [sp, #144]
  mrs x9, fpcr
  str x9, [sp, #160]
  mov x9, sp
  str x9, [x0]
  mov sp, x1
  ldr x9, [sp, #160]
  msr fpcr, x9
  ldp x19, x20, [sp, #0]
  ldp x21, x22, [sp, #16]
  ldp x23, x24, [sp, #32]
  ldp x25, x26, [sp, #48]
  ldp x27, x28, [sp, #64]
  ldp x29, x30, [sp, #80]
  ldp d8, d9, [sp, #96]
  ldp d10, d11, [sp, #112]
  ldp d12, d13, [sp, #128]
  ldp d14, d15, [sp, #144]
  add sp, sp, #176
  ret
  .size mfemu_swap_context,.-mfemu_swap_context
)");
#endif

namespace {

enum State { kRunnable, kAtBarrier, kAtWarp, kExited };

struct Fiber {
  void *sp = nullptr;
  char *stack = nullptr; /* usable stack, above a guard page */
  size_t size = 0;
#ifdef MFEMU_UCONTEXT
  ucontext_t uc;
#endif
  void *fake_stack = nullptr;
  uint3 tid{};
  State state = kRunnable;
  const char *file = nullptr; /* where it waits */
  int line = 0;
  int kind = 0;
  unsigned mask = 0;
  uint64_t value = 0;
  int src = 0;
  uint64_t result = 0;
};

#ifdef MFEMU_ASAN
constexpr size_t kStack = 512 * 1024; /* ASan's redzones and fake frames need room */
#else
constexpr size_t kStack = 128 * 1024;
#endif

struct Runtime {
  std::mutex launch_mutex;
  std::vector<Fiber> fibers;
  std::vector<int> runq;
  std::vector<uint64_t> priority; /* per warp (odd seeds) */
  Fiber *cur = nullptr;
  void *main_sp = nullptr;
#ifdef MFEMU_UCONTEXT
  ucontext_t main_uc;
#endif
  const void *main_bottom = nullptr;
  size_t main_size = 0;
  void *main_fake = nullptr;
  mfemu::thread_body body = nullptr;
  void *ctx = nullptr;
  int nthreads = 0, live = 0, at_barrier = 0;
  bool failed = false, stacks_dirty = false;
  std::string failure;
  const char *kernel = "", *launch_file = "";
  int launch_line = 0;
  uint64_t rng = 0;
  unsigned long long seed = 0;
  bool seed_read = false;
  unsigned long long launches = 0;
  std::vector<std::pair<char *, size_t>> shared;
  cudaError_t last_error = cudaSuccess;
  int device = 0;
} g;

uint64_t splitmix(uint64_t *s) {
  uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

void fail(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
void fail(const char *fmt, ...) {
  if (g.failed) return;
  char what[2048];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(what, sizeof what, fmt, ap);
  va_end(ap);
  char msg[3072];
  snprintf(msg, sizeof msg, "mfemu: kernel %s (launched at %s:%d), block (%u,%u,%u), MFEMU_SEED=%llu: %s",
           g.kernel, g.launch_file, g.launch_line, blockIdx.x, blockIdx.y, blockIdx.z, g.seed, what);
  g.failure = msg;
  g.failed = true;
  fprintf(stderr, "%s\n", msg);
}

int linear_tid(const Fiber &f) {
  return (int)(f.tid.x + blockDim.x * (f.tid.y + blockDim.y * f.tid.z));
}

/* ---- switching ------------------------------------------------------------------------ */
void trampoline();

void to_fiber(Fiber &f) {
  g.cur = &f;
  threadIdx = f.tid;
#ifdef MFEMU_ASAN
  __sanitizer_start_switch_fiber(&g.main_fake, f.stack, f.size);
#endif
#ifdef MFEMU_UCONTEXT
  swapcontext(&g.main_uc, &f.uc);
#else
  mfemu_swap_context(&g.main_sp, f.sp);
#endif
#ifdef MFEMU_ASAN
  __sanitizer_finish_switch_fiber(g.main_fake, nullptr, nullptr);
#endif
  g.cur = nullptr;
}

/* From the running fiber back to the scheduler; returns when the scheduler resumes it. */
void to_scheduler(bool exiting) {
  Fiber &f = *g.cur;
#ifdef MFEMU_ASAN
  __sanitizer_start_switch_fiber(exiting ? nullptr : &f.fake_stack, g.main_bottom, g.main_size);
#else
  (void)exiting;
#endif
#ifdef MFEMU_UCONTEXT
  swapcontext(&f.uc, &g.main_uc);
#else
  mfemu_swap_context(&f.sp, g.main_sp);
#endif
#ifdef MFEMU_ASAN
  __sanitizer_finish_switch_fiber(f.fake_stack, &g.main_bottom, &g.main_size);
#endif
}

void trampoline() {
#ifdef MFEMU_ASAN
  __sanitizer_finish_switch_fiber(nullptr, &g.main_bottom, &g.main_size);
#endif
  g.body(g.ctx);
  g.cur->state = kExited;
  g.live--;
  to_scheduler(true);
  __builtin_unreachable();
}

/* Prepares a fiber to start the thread body at its next switch. */
void start_fiber(Fiber &f) {
  if (!f.stack) {
    const size_t page = (size_t)sysconf(_SC_PAGESIZE);
    char *m = (char *)mmap(nullptr, kStack + page, PROT_READ | PROT_WRITE,
                           MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (m == MAP_FAILED) {
      fail("out of memory for the stacks of %d threads", g.nthreads);
      return;
    }
    mprotect(m, page, PROT_NONE); /* a stack overflow faults instead of corrupting */
    f.stack = m + page;
    f.size = kStack;
  }
#ifdef MFEMU_ASAN
  if (g.stacks_dirty) __asan_unpoison_memory_region(f.stack, f.size);
#endif
  f.fake_stack = nullptr;
#ifdef MFEMU_UCONTEXT
  getcontext(&f.uc);
  f.uc.uc_stack.ss_sp = f.stack;
  f.uc.uc_stack.ss_size = f.size;
  f.uc.uc_link = nullptr;
  makecontext(&f.uc, trampoline, 0);
#else
  uintptr_t top = ((uintptr_t)(f.stack + f.size)) & ~(uintptr_t)15;
#if defined(__x86_64__)
  /* the frame mfemu_swap_context pops: fp control, r15..rbp, return address; and the
   * slot of the trampoline's own return address, so it starts as if called */
  uint64_t *sp = (uint64_t *)(top - 72);
  uint32_t mxcsr;
  uint16_t fpucw;
  asm volatile("stmxcsr %0" : "=m"(mxcsr));
  asm volatile("fnstcw %0" : "=m"(fpucw));
  sp[0] = (uint64_t)mxcsr | ((uint64_t)fpucw << 32);
  for (int i = 1; i <= 6; i++) sp[i] = 0;
  sp[7] = (uint64_t)(uintptr_t)&trampoline;
  sp[8] = 0;
#else
  uint64_t *sp = (uint64_t *)(top - 176);
  for (int i = 0; i < 22; i++) sp[i] = 0;
  uint64_t fpcr;
  asm volatile("mrs %0, fpcr" : "=r"(fpcr));
  sp[11] = (uint64_t)(uintptr_t)&trampoline; /* x30 */
  sp[20] = fpcr;
#endif
  f.sp = sp;
#endif
}

/* ---- the block scheduler -------------------------------------------------------------- */
void make_runnable(int i) {
  g.fibers[i].state = kRunnable;
  g.runq.push_back(i);
}

/* Seed 0: first come, first run (round robin). Even seeds: a uniformly random runnable
 * thread. Odd seeds: the runnable thread of the warp with the highest priority, the
 * priorities redrawn at every block start and __syncthreads, so one warp runs as far
 * ahead of the others as the barriers let it: the schedule that shows a warp
 * overwriting shared memory another warp has not read yet (uniform picks almost never
 * let a warp through its shuffles that far ahead). */
void draw_priorities() {
  for (auto &p : g.priority) p = splitmix(&g.rng);
}

int pick() {
  size_t k = 0;
  if (g.seed != 0 && (g.seed & 1)) {
    for (size_t j = 1; j < g.runq.size(); j++)
      if (g.priority[g.runq[j] / 32] > g.priority[g.runq[k] / 32]) k = j;
  } else if (g.seed != 0) {
    k = (size_t)(splitmix(&g.rng) % g.runq.size());
  }
  const int i = g.runq[k];
  g.runq.erase(g.runq.begin() + (long)k); /* seed 0: first come, first run */
  return i;
}

void describe_waiters(std::string *out) {
  /* one line per wait site, with its threads */
  std::vector<bool> done(g.nthreads, false);
  for (int i = 0; i < g.nthreads; i++) {
    const Fiber &f = g.fibers[i];
    if (done[i] || (f.state != kAtBarrier && f.state != kAtWarp)) continue;
    char line[256];
    snprintf(line, sizeof line, "\n  %s at %s:%d: threads", f.state == kAtBarrier ? "__syncthreads" : "warp collective",
             f.file, f.line);
    *out += line;
    int shown = 0;
    for (int j = i; j < g.nthreads; j++) {
      const Fiber &h = g.fibers[j];
      if (h.state == f.state && h.file == f.file && h.line == f.line) {
        done[j] = true;
        if (shown++ < 16) *out += " " + std::to_string(j);
      }
    }
    if (shown > 16) *out += " ... (" + std::to_string(shown) + " threads)";
  }
}

/* Every live thread waits at __syncthreads: check they wait at the same one, fold the
 * predicate, let them go. */
void release_barrier() {
  const Fiber *first = nullptr;
  int count = 0, any = 0, all = 1;
  for (int i = 0; i < g.nthreads; i++) {
    const Fiber &f = g.fibers[i];
    if (f.state != kAtBarrier) continue;
    if (!first) first = &f;
    if (f.file != first->file || f.line != first->line || f.kind != first->kind) {
      std::string w;
      describe_waiters(&w);
      fail("threads wait at different __syncthreads:%s", w.c_str());
      return;
    }
    count += f.value != 0;
    any |= f.value != 0;
    all &= f.value != 0;
  }
  for (int i = 0; i < g.nthreads; i++) {
    Fiber &f = g.fibers[i];
    if (f.state != kAtBarrier) continue;
    f.result = f.kind == mfemu::kSyncOr ? any : f.kind == mfemu::kSyncAnd ? all
                                                : f.kind == mfemu::kSyncCount ? count : 0;
    make_runnable(i);
  }
  g.at_barrier = 0;
  draw_priorities();
}

void run_block() {
  for (auto &s : g.shared) memset(s.first, 0xFF, s.second);
  g.runq.clear();
  for (int i = 0; i < g.nthreads; i++) {
    Fiber &f = g.fibers[i];
    f.tid = uint3{i % blockDim.x, i / blockDim.x % blockDim.y, i / (blockDim.x * blockDim.y)};
    start_fiber(f);
    if (g.failed) return;
    make_runnable(i);
  }
  g.stacks_dirty = false;
  g.priority.assign((size_t)(g.nthreads + 31) / 32, 0);
  draw_priorities();
  g.live = g.nthreads;
  g.at_barrier = 0;
  for (;;) {
    if (g.runq.empty()) {
      if (g.live == 0) return;
      if (g.at_barrier == g.live) {
        release_barrier();
        if (g.failed) break;
        continue;
      }
      std::string w;
      describe_waiters(&w);
      fail("deadlock: %d live threads, none can run:%s", g.live, w.c_str());
      break;
    }
    to_fiber(g.fibers[pick()]);
    if (g.failed) break;
  }
  g.stacks_dirty = true; /* abandoned fibers: their stacks keep ASan's frame poison */
}

}  // namespace

/* ---- called by the kernels ------------------------------------------------------------ */
int mfemu::block_barrier(const char *file, int line, BarrierKind kind, int pred) {
  if (!g.cur) return pred; /* not in a kernel */
  Fiber &f = *g.cur;
  f.state = kAtBarrier;
  f.file = file;
  f.line = line;
  f.kind = kind;
  f.value = pred != 0;
  g.at_barrier++;
  to_scheduler(false);
  return (int)f.result;
}

uint64_t mfemu::warp_collective(const char *file, int line, Collective kind, unsigned mask,
                                uint64_t value, int src, int width) {
  if (!g.cur) return value;
  Fiber &f = *g.cur;
  const int me = linear_tid(f), base = me / 32 * 32, lane = me % 32;
  static const char *names[] = {"shuffle", "__ballot_sync", "__syncwarp"};
  if (width <= 0 || width > 32 || (width & (width - 1)))
    fail("thread %d: %s at %s:%d: width %d is not a power of two <= 32", me, names[kind], file, line, width);
  if (!(mask >> lane & 1))
    fail("thread %d: %s at %s:%d: mask 0x%08x does not name the calling lane %d", me, names[kind], file,
         line, mask, lane);
  for (int l = 0; l < 32 && !g.failed; l++) {
    if (!(mask >> l & 1)) continue;
    if (base + l >= g.nthreads)
      fail("thread %d: %s at %s:%d: mask 0x%08x names lane %d, which does not exist (%d threads)", me,
           names[kind], file, line, mask, l, g.nthreads);
    else if (g.fibers[base + l].state == kExited)
      fail("thread %d: %s at %s:%d: mask 0x%08x names lane %d, which has exited", me, names[kind], file,
           line, mask, l);
  }
  if (kind == kShfl && !g.failed && (src < 0 || src >= 32 || !(mask >> src & 1)))
    fail("thread %d: shuffle at %s:%d reads lane %d, not named by mask 0x%08x", me, file, line, src, mask);
  if (g.failed) {
    to_scheduler(true); /* never resumed: the launch is abandoned */
    __builtin_unreachable();
  }
  f.state = kAtWarp;
  f.file = file;
  f.line = line;
  f.kind = kind;
  f.mask = mask;
  f.value = value;
  f.src = src;
  bool complete = true;
  for (int l = 0; l < 32 && complete; l++) {
    if (!(mask >> l & 1)) continue;
    const Fiber &o = g.fibers[base + l];
    if (o.state != kAtWarp) {
      complete = false;
    } else if (o.mask != mask || o.kind != kind) {
      fail("thread %d (%s at %s:%d, mask 0x%08x) and thread %d (%s at %s:%d, mask 0x%08x) meet in one "
           "warp collective", me, names[kind], file, line, mask, base + l, names[o.kind], o.file, o.line, o.mask);
      to_scheduler(true);
      __builtin_unreachable();
    }
  }
  if (complete) {
    uint64_t ballot = 0;
    for (int l = 0; l < 32; l++)
      if (mask >> l & 1) ballot |= (uint64_t)(g.fibers[base + l].value != 0) << l;
    for (int l = 0; l < 32; l++) {
      if (!(mask >> l & 1)) continue;
      Fiber &o = g.fibers[base + l];
      o.result = kind == kShfl ? g.fibers[base + o.src].value : kind == kBallot ? ballot : 0;
      make_runnable(base + l);
    }
  }
  to_scheduler(false);
  return f.result;
}

bool mfemu_register_shared(void *p, size_t size) {
  g.shared.emplace_back((char *)p, size);
  memset(p, 0xFF, size);
  return true;
}

/* Failure injection, for memfit's hints on the CUDA errors a rebuild fixes
 * (memfit/cuda_hint.h): MFEMU_DRIVER=12040 emulates a driver for CUDA 12.4 (0: none), too
 * old for CUDART_VERSION's major, so every call that needs the device fails with
 * cudaErrorInsufficientDriver as the real runtime's do; MFEMU_NO_KERNEL_IMAGE=1 fails every
 * launch with cudaErrorNoKernelImageForDevice, as on a GPU the build has no code for. */
static int emulated_driver_version() {
  const char *d = getenv("MFEMU_DRIVER");
  return d && *d ? atoi(d) : CUDART_VERSION;
}
static bool driver_too_old() { return emulated_driver_version() / 1000 < CUDART_VERSION / 1000; }
static bool no_kernel_image() {
  const char *k = getenv("MFEMU_NO_KERNEL_IMAGE");
  return k && !strcmp(k, "1");
}

cudaError_t mfemu::run_grid(const char *kernel, const char *file, int line, dim3 grid, dim3 block,
                            size_t dynamic_smem, thread_body body, void *ctx) {
  std::lock_guard<std::mutex> lock(g.launch_mutex);
  if (!g.seed_read) {
    const char *s = getenv("MFEMU_SEED");
    g.seed = s ? strtoull(s, nullptr, 0) : 0;
    g.seed_read = true;
  }
  if (driver_too_old()) return g.last_error = cudaErrorInsufficientDriver;
  if (no_kernel_image()) return g.last_error = cudaErrorNoKernelImageForDevice;
  g.kernel = kernel;
  g.launch_file = file;
  g.launch_line = line;
  g.failed = false;
  blockIdx = uint3{0, 0, 0};
  const unsigned long long nthreads = (unsigned long long)block.x * block.y * block.z;
  if (nthreads == 0 || nthreads > 1024 || block.z > 64 || grid.x == 0 || grid.y == 0 || grid.z == 0 ||
      grid.x > 0x7fffffffu || grid.y > 65535 || grid.z > 65535 || dynamic_smem > 0) {
    fail("invalid launch configuration: grid (%u,%u,%u), block (%u,%u,%u), %zu bytes of dynamic "
         "shared memory (not emulated)", grid.x, grid.y, grid.z, block.x, block.y, block.z, dynamic_smem);
    return g.last_error = cudaErrorInvalidConfiguration;
  }
  g.rng = g.seed ^ (0xD1B54A32D192ED03ull * ++g.launches);
  g.body = body;
  g.ctx = ctx;
  g.nthreads = (int)nthreads;
  if (g.fibers.size() < nthreads) g.fibers.resize(nthreads);
  blockDim = block;
  gridDim = grid;
  for (unsigned z = 0; z < grid.z && !g.failed; z++)
    for (unsigned y = 0; y < grid.y && !g.failed; y++)
      for (unsigned x = 0; x < grid.x && !g.failed; x++) {
        blockIdx = uint3{x, y, z};
        run_block();
      }
  if (g.failed) return g.last_error = cudaErrorLaunchFailure;
  return cudaSuccess;
}

extern "C" const char *mfemu_last_failure(void) { return g.failure.c_str(); }
extern "C" unsigned long long mfemu_seed(void) { return g.seed; }
extern "C" void mfemu_set_seed(unsigned long long seed) {
  std::lock_guard<std::mutex> lock(g.launch_mutex);
  g.seed = seed;
  g.seed_read = true;
}

/* ---- host API ------------------------------------------------------------------------- */
namespace {
struct DeviceModel {
  const char *name;
  int major, minor, sms;
  size_t memory;
};
const DeviceModel &device_model() {
  static const DeviceModel t4{"Tesla T4 (mfemu)", 7, 5, 40, 15655829504ull};
  static const DeviceModel h100{"NVIDIA H100 80GB HBM3 (mfemu)", 9, 0, 132, 85045198848ull};
  const char *d = getenv("MFEMU_DEVICE");
  return d && (!strcmp(d, "h100") || !strcmp(d, "H100")) ? h100 : t4;
}
cudaError_t set_error(cudaError_t e) {
  if (e != cudaSuccess) g.last_error = e;
  return e;
}
}  // namespace

const char *cudaGetErrorName(cudaError_t err) {
  switch (err) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
    case cudaErrorInitializationError: return "cudaErrorInitializationError";
    case cudaErrorInvalidConfiguration: return "cudaErrorInvalidConfiguration";
    case cudaErrorInvalidDevice: return "cudaErrorInvalidDevice";
    case cudaErrorInsufficientDriver: return "cudaErrorInsufficientDriver";
    case cudaErrorNoDevice: return "cudaErrorNoDevice";
    case cudaErrorNoKernelImageForDevice: return "cudaErrorNoKernelImageForDevice";
    case cudaErrorUnsupportedPtxVersion: return "cudaErrorUnsupportedPtxVersion";
    case cudaErrorNotSupported: return "cudaErrorNotSupported";
    case cudaErrorStreamCaptureImplicit: return "cudaErrorStreamCaptureImplicit";
    case cudaErrorLaunchFailure: return "cudaErrorLaunchFailure";
  }
  return "cudaErrorUnknown";
}

const char *cudaGetErrorString(cudaError_t err) {
  switch (err) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    case cudaErrorLaunchFailure:
      return g.failure.empty() ? "unspecified launch failure" : g.failure.c_str();
    default: return cudaGetErrorName(err);
  }
}

cudaError_t cudaGetLastError(void) {
  const cudaError_t e = g.last_error;
  g.last_error = cudaSuccess;
  return e;
}
cudaError_t cudaPeekAtLastError(void) { return g.last_error; }
cudaError_t cudaGetDeviceCount(int *count) {
  *count = 0;
  if (driver_too_old()) return set_error(cudaErrorInsufficientDriver);
  *count = 1;
  return cudaSuccess;
}
cudaError_t cudaGetDevice(int *device) {
  if (driver_too_old()) return set_error(cudaErrorInsufficientDriver);
  *device = g.device;
  return cudaSuccess;
}
cudaError_t cudaSetDevice(int device) {
  if (driver_too_old()) return set_error(cudaErrorInsufficientDriver);
  if (device != 0) return set_error(cudaErrorInvalidDevice);
  g.device = device;
  return cudaSuccess;
}
cudaError_t cudaGetDeviceProperties(cudaDeviceProp *prop, int device) {
  if (driver_too_old()) return set_error(cudaErrorInsufficientDriver);
  if (device != 0) return set_error(cudaErrorInvalidDevice);
  const DeviceModel &m = device_model();
  memset(prop, 0, sizeof *prop);
  snprintf(prop->name, sizeof prop->name, "%s", m.name);
  prop->totalGlobalMem = m.memory;
  prop->sharedMemPerBlock = 48 * 1024;
  prop->warpSize = 32;
  prop->maxThreadsPerBlock = 1024;
  prop->maxThreadsDim[0] = prop->maxThreadsDim[1] = 1024;
  prop->maxThreadsDim[2] = 64;
  prop->maxGridSize[0] = 0x7fffffff;
  prop->maxGridSize[1] = prop->maxGridSize[2] = 65535;
  prop->major = m.major;
  prop->minor = m.minor;
  prop->multiProcessorCount = m.sms;
  return cudaSuccess;
}
cudaError_t cudaDeviceGetAttribute(int *value, cudaDeviceAttr attr, int device) {
  cudaDeviceProp p;
  if (cudaGetDeviceProperties(&p, device) != cudaSuccess) return cudaErrorInvalidDevice;
  switch (attr) {
    case cudaDevAttrMaxThreadsPerBlock: *value = p.maxThreadsPerBlock; return cudaSuccess;
    case cudaDevAttrMultiProcessorCount: *value = p.multiProcessorCount; return cudaSuccess;
    case cudaDevAttrComputeCapabilityMajor: *value = p.major; return cudaSuccess;
    case cudaDevAttrComputeCapabilityMinor: *value = p.minor; return cudaSuccess;
  }
  return set_error(cudaErrorInvalidValue);
}
cudaError_t cudaDriverGetVersion(int *version) {
  *version = emulated_driver_version();
  return cudaSuccess;
}
cudaError_t cudaRuntimeGetVersion(int *version) {
  *version = CUDART_VERSION;
  return cudaSuccess;
}
cudaError_t cudaGetDriverEntryPoint(const char *, void **fn, unsigned long long,
                                    cudaDriverEntryPointQueryResult *status) {
  *fn = nullptr; /* no driver: memfit then assumes every device has a context */
  if (status) *status = cudaDriverEntryPointSymbolNotFound;
  return cudaSuccess;
}
cudaError_t cudaGetDriverEntryPointByVersion(const char *symbol, void **fn, unsigned,
                                             unsigned long long flags,
                                             cudaDriverEntryPointQueryResult *status) {
  return cudaGetDriverEntryPoint(symbol, fn, flags, status);
}
cudaError_t cudaMalloc(void **ptr, size_t size) {
  if (driver_too_old()) return set_error(cudaErrorInsufficientDriver);
  *ptr = malloc(size ? size : 1);
  return *ptr ? cudaSuccess : set_error(cudaErrorMemoryAllocation);
}
cudaError_t cudaFree(void *ptr) {
  free(ptr);
  return cudaSuccess;
}
cudaError_t cudaMemcpy(void *dst, const void *src, size_t n, cudaMemcpyKind) {
  if (n) memmove(dst, src, n);
  return cudaSuccess;
}
cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t n, cudaMemcpyKind kind, cudaStream_t) {
  return cudaMemcpy(dst, src, n, kind);
}
cudaError_t cudaMemset(void *dst, int value, size_t n) {
  if (n) memset(dst, value, n);
  return cudaSuccess;
}
cudaError_t cudaMemsetAsync(void *dst, int value, size_t n, cudaStream_t) { return cudaMemset(dst, value, n); }
cudaError_t cudaDeviceSynchronize(void) { return cudaSuccess; }
cudaError_t cudaStreamSynchronize(cudaStream_t) { return cudaSuccess; }
cudaError_t cudaStreamIsCapturing(cudaStream_t, cudaStreamCaptureStatus *status) {
  *status = cudaStreamCaptureStatusNone;
  return cudaSuccess;
}
cudaError_t cudaEventCreate(cudaEvent_t *event) {
  static char token;
  *event = (cudaEvent_t)&token;
  return cudaSuccess;
}
cudaError_t cudaEventDestroy(cudaEvent_t) { return cudaSuccess; }
cudaError_t cudaEventRecord(cudaEvent_t, cudaStream_t) { return cudaSuccess; }
cudaError_t cudaEventSynchronize(cudaEvent_t) { return cudaSuccess; } /* work ran in order */
cudaError_t cudaStreamWaitEvent(cudaStream_t, cudaEvent_t, unsigned) { return cudaSuccess; }
