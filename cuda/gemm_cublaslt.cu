/*
 * Matrix products on CUDA through cuBLASLt (tensor cores, fused epilogues), with the
 * portable kernel of cuda/gemm.cu as the fallback.
 *
 * NOT YET RUN ON A GPU. This file was written and compiled on a machine without a
 * GPU and without cuBLAS. What has executed: loading a real libcublasLt (13.1 and
 * 12.9 from NVIDIA's PyPI wheels), resolving every symbol, reading its version, and
 * building every descriptor below (mf_gemm_cublaslt_selfcheck: the library accepts
 * each attribute and value size). What has not: cublasLtCreate, the heuristic, any
 * product, the epilogues' numerics. tests/test_gemm_cublaslt.py holds the GPU tests
 * (marked cuda) that a GPU session must run before this path is trusted.
 *
 * Loading. memfit does not link cuBLAS: CI and CPU machines have no cuBLAS to link,
 * and the pip wheels of torch carry their own copy. The first CUDA GEMM (or a query,
 * memfit.amp.gemm_backend) loads the library once, under a mutex, trying in order:
 *   1. MEMFIT_CUBLASLT=<file>, if set (and nothing else: the user asked for that one);
 *   2. a libcublasLt already in the process (dlopen RTLD_NOLOAD of libcublasLt.so.13,
 *      .so.12, .so): after `import torch` and a CUDA matmul that is torch's own copy,
 *      so the process does not map a second one;
 *   3. files named by mf_gemm_cublaslt_add_path: the Python layer passes the pip
 *      wheels' nvidia/cu13/lib/libcublasLt.so.13 and nvidia/cublas/lib/libcublasLt.so.12;
 *   4. the same names through the loader's search path (LD_LIBRARY_PATH, ldconfig).
 * It resolves the dozen functions we call with dlsym against our own declarations
 * (cublaslt_abi.h, checked against NVIDIA's header by a test), and is never unloaded.
 *
 * Per device: one cuBLASLt handle and, per stream that calls us, one workspace
 * (cudaMalloc'd on the stream's first product and kept until the process exits, when
 * an atexit handler frees it: 32 MiB on sm_90 and newer, 4 MiB before, as NVIDIA's
 * cuBLAS documentation recommends; outside torch's caching allocator); a workspace is
 * never shared between streams, so concurrent streams cannot race on it. Past 16
 * streams on one device, products run with no workspace (cuBLASLt then picks
 * algorithms that need none). Heuristic results are not cached here: cuBLASLt caches
 * them itself.
 *
 * CUDA graphs. A cudaMalloc while the stream is being captured would invalidate the
 * capture, so a stream under capture never allocates: it uses the workspace it got
 * before the capture (run one product before capturing, as torch's warm-up does) or
 * runs without one. Nothing is remembered from a product under capture, so a later
 * product outside capture still gets its workspace; a failed cudaMalloc (out of
 * memory) is not remembered either.
 *
 * Layout. memfit's matrices are row-major, cuBLASLt's column-major. A row-major C[m,n]
 * is a column-major C^T[n,m], and C^T = op(B)^T op(A)^T, so we ask cuBLASLt for
 * D[n,m] = A'[n,k] B'[k,m] with A' = memfit's B and B' = memfit's A, each with the
 * opposite transpose flag of what its row-major storage would suggest (see lt_plan).
 * The bias runs along D's rows (length n), as cuBLASLt's bias epilogue wants.
 *
 * Precision. float16/bfloat16 inputs: CUBLAS_COMPUTE_32F with float32 scale, i.e.
 * tensor cores with float32 accumulation; D (the output) is the inputs' dtype or
 * float32. float32 inputs also go to cuBLASLt with CUBLAS_COMPUTE_32F, which is full
 * float32 (no TF32: that needs COMPUTE_32F_FAST_TF32, which memfit never asks for),
 * far faster than the portable kernel, with float32 output only.
 *
 * Epilogues. memfit's activations and what runs for each (bias or not):
 *   none, relu, gelu_tanh without a saved pre-activation: one cuBLASLt call with the
 *     DEFAULT/BIAS, RELU(_BIAS) or GELU(_BIAS) epilogue. cuBLASLt's GELU is the tanh
 *     approximation, which is exactly memfit's "gelu_tanh" (torch approximate="tanh").
 *   gelu_tanh with the pre-activation saved: GELU_AUX(_BIAS), which writes the GELU
 *     input to the aux buffer = memfit's `pre`; cuBLASLt wants its leading dimension
 *     (n) a multiple of 8 and the aux dtype equal to the output's.
 *   "gelu" (exact erf, torch's default): cuBLASLt has no exact GELU, and substituting
 *     the tanh form would change results by up to ~1e-3 without saying so. So: the
 *     BIAS epilogue writes the pre-activation (into `pre`, or into C when none is
 *     saved), then memfit's elementwise kernel (mf_cuda_act_forward, the same
 *     mf_act_forward as every other path) writes C = gelu(pre): one extra pass that
 *     reads and writes m*n elements. The same two-pass form serves relu with a saved
 *     pre-activation, and any fused case whose epilogue cuBLASLt declines.
 *   (memfit.nn's relu saves its output, not the pre-activation: relu'(pre) is
 *     relu'(output), so the fused RELU_BIAS epilogue serves training too.)
 *   The two-pass form rounds the pre-activation to D's dtype before the activation;
 *   every other path applies it to the float32 sum. Relu gives the same bits either
 *   way; gelu/gelu_tanh with a half-precision D can differ by about one unit in the last
 *   place (bound in gemm.h's mf_gemm comment). Agreeing would take a float32 copy of
 *   D (m*n*4 bytes this library would have to allocate behind the caller's allocator),
 *   so the difference is documented instead; a float32 pre avoids it.
 *
 * Fallback. The portable kernel runs instead, and mf_gemm_last_backend() says why,
 * when: the backend is set to "portable"; the library is absent or lacks a function;
 * the device's handle cannot be created; k == 0; the dtype combination is not one
 * cuBLASLt has (float16 inputs with a bfloat16 output, float32 inputs with a half
 * output, an output dtype other than the inputs' or float32); the bias dtype differs
 * from the output's; a pointer is not aligned to its element size (or the bias to 16
 * bytes); or the heuristic offers no algorithm. With the backend set to "cublaslt"
 * each of these is an error instead. A failure while running (cublasLtMatmul other than
 * NOT_SUPPORTED / INVALID_VALUE / ARCH_MISMATCH) is an error, never an abort.
 */
#include <dlfcn.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <atomic>
#include <mutex>

#include "cublaslt_abi.h"
#include "cuda_util.cuh"
#include "memfit/cuda_launch.h"
#include "memfit/gemm.h"

namespace {

// ---- the library ------------------------------------------------------------------

struct LtApi {
  mflt_create_fn create;
  mflt_destroy_fn destroy;
  mflt_get_version_fn get_version;
  mflt_desc_create_fn desc_create;
  mflt_desc_destroy_fn desc_destroy;
  mflt_desc_set_fn desc_set;
  mflt_layout_create_fn layout_create;
  mflt_layout_destroy_fn layout_destroy;
  mflt_pref_create_fn pref_create;
  mflt_pref_destroy_fn pref_destroy;
  mflt_pref_set_fn pref_set;
  mflt_heuristic_fn heuristic;
  mflt_matmul_fn matmul;
  mflt_status_string_fn status_name; /* optional */
};

const char *const kSonames[] = {"libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so"};
constexpr int kMaxPaths = 8;

std::mutex g_load_mutex;             // guards everything in this block until g_done
std::atomic<bool> g_done{false};     // a load was tried; the fields below are final
LtApi g_lt;
mf_cublaslt_info g_info;             // attempted, loaded, version, path, reason
char g_paths[kMaxPaths][512];
int g_npaths = 0;

void set_reason(char *buf, size_t len, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;
void set_reason(char *buf, size_t len, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, len, fmt, ap);
  va_end(ap);
}

bool resolve(void *lib, char *why, size_t why_len) {
  struct {
    const char *name;
    void **slot;
  } syms[] = {
      {"cublasLtCreate", (void **)&g_lt.create},
      {"cublasLtDestroy", (void **)&g_lt.destroy},
      {"cublasLtGetVersion", (void **)&g_lt.get_version},
      {"cublasLtMatmulDescCreate", (void **)&g_lt.desc_create},
      {"cublasLtMatmulDescDestroy", (void **)&g_lt.desc_destroy},
      {"cublasLtMatmulDescSetAttribute", (void **)&g_lt.desc_set},
      {"cublasLtMatrixLayoutCreate", (void **)&g_lt.layout_create},
      {"cublasLtMatrixLayoutDestroy", (void **)&g_lt.layout_destroy},
      {"cublasLtMatmulPreferenceCreate", (void **)&g_lt.pref_create},
      {"cublasLtMatmulPreferenceDestroy", (void **)&g_lt.pref_destroy},
      {"cublasLtMatmulPreferenceSetAttribute", (void **)&g_lt.pref_set},
      {"cublasLtMatmulAlgoGetHeuristic", (void **)&g_lt.heuristic},
      {"cublasLtMatmul", (void **)&g_lt.matmul},
  };
  for (auto &s : syms) {
    *s.slot = dlsym(lib, s.name);
    if (!*s.slot) {
      set_reason(why, why_len, "it has no %s", s.name);
      return false;
    }
  }
  g_lt.status_name = (mflt_status_string_fn)dlsym(lib, "cublasLtGetStatusName");
  return true;
}

// Tries one file or name; on failure appends to `tried` its name when it does not
// exist, else the loader's message (a file that exists but cannot load).
void *try_open(const char *what, int flags, char *tried, size_t tried_len) {
  void *lib = dlopen(what, flags);
  if (!lib && !(flags & RTLD_NOLOAD)) {
    const char *err = dlerror();
    if (!err || strstr(err, "No such file or directory")) err = what;
    size_t used = strlen(tried);
    if (used < tried_len)
      snprintf(tried + used, tried_len - used, "%s%s", used ? ", " : "", err);
  }
  return lib;
}

void load_locked() {
  mf_cublaslt_info &info = g_info;
  info.attempted = 1;
  char tried[1024] = "";
  void *lib = nullptr;
  const char *env = getenv("MEMFIT_CUBLASLT");
  if (env && *env) {
    lib = try_open(env, RTLD_NOW | RTLD_LOCAL, tried, sizeof tried);
    if (!lib) {
      set_reason(info.reason, sizeof info.reason, "MEMFIT_CUBLASLT=%s did not load: %s", env, tried);
      return;
    }
  } else {
    for (const char *name : kSonames)
      if (!lib) lib = try_open(name, RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD, tried, sizeof tried);
    for (int i = 0; i < g_npaths && !lib; i++)
      lib = try_open(g_paths[i], RTLD_NOW | RTLD_LOCAL, tried, sizeof tried);
    for (const char *name : kSonames)
      if (!lib) lib = try_open(name, RTLD_NOW | RTLD_LOCAL, tried, sizeof tried);
    if (!lib) {
      set_reason(info.reason, sizeof info.reason,
                 "libcublasLt not found (tried %s); pip install nvidia-cublas, or set "
                 "MEMFIT_CUBLASLT to the file",
                 tried);
      return;
    }
  }
  char why[256];
  if (!resolve(lib, why, sizeof why)) {
    Dl_info dl;
    const char *where = dladdr(dlsym(lib, "cublasLtGetVersion"), &dl) && dl.dli_fname ? dl.dli_fname
                                                                                       : "libcublasLt";
    set_reason(info.reason, sizeof info.reason, "%s cannot be used: %s", where, why);
    dlclose(lib);
    memset(&g_lt, 0, sizeof g_lt);
    return;
  }
  Dl_info dl;
  if (dladdr((void *)g_lt.matmul, &dl) && dl.dli_fname)
    set_reason(info.path, sizeof info.path, "%s", dl.dli_fname);
  info.version = (int)g_lt.get_version();
  info.loaded = 1;
  info.reason[0] = '\0';
}

// Loads the library once; cheap after the first call.
const mf_cublaslt_info &ensure_loaded() {
  if (!g_done.load(std::memory_order_acquire)) {
    std::lock_guard<std::mutex> lock(g_load_mutex);
    if (!g_done.load(std::memory_order_relaxed)) {
      load_locked();
      g_done.store(true, std::memory_order_release);
    }
  }
  return g_info;
}

const char *status_name(mflt_status s) {
  if (g_lt.status_name) {
    const char *name = g_lt.status_name(s);
    if (name) return name;
  }
#define MFLT_STATUS_CASE(name, value) \
  case MFLT_STATUS_##name: return "CUBLAS_STATUS_" #name;
  switch (s) { MFLT_STATUS_LIST(MFLT_STATUS_CASE) }
#undef MFLT_STATUS_CASE
  return "unknown cuBLAS status";
}

// ---- per device: handle and per-stream workspaces ----------------------------------

constexpr int kMaxDevices = 64;
constexpr int kMaxStreams = 16;

struct Workspace {
  void *stream;
  void *ptr;
  size_t size;
};

struct DeviceState {
  bool tried;  // handle creation was attempted; handle/reason are final
  mflt_handle handle;
  size_t ws_size;
  char reason[256];
  Workspace ws[kMaxStreams];
  int nws;
};

std::mutex g_dev_mutex;
DeviceState g_dev[kMaxDevices];

// The device's handle (creating it on first use), or nullptr with *why. The caller
// has made `device` current and holds g_dev_mutex.
mflt_handle device_handle_locked(int device, const char **why) {
  if (device < 0 || device >= kMaxDevices) {
    *why = "device index out of range for cuBLASLt";
    return nullptr;
  }
  DeviceState &d = g_dev[device];
  if (!d.tried) {
    d.tried = true;
    int major = 0;
    cudaError_t err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
    if (err != cudaSuccess) {
      cudaGetLastError();
      set_reason(d.reason, sizeof d.reason, "cuda:%d: %s", device, cudaGetErrorString(err));
    } else {
      d.ws_size = (size_t)(major >= 9 ? 32 : 4) << 20;
      mflt_status s = g_lt.create(&d.handle);
      if (s != MFLT_STATUS_SUCCESS) {
        d.handle = nullptr;
        set_reason(d.reason, sizeof d.reason, "cublasLtCreate on cuda:%d: %s", device,
                   status_name(s));
      }
    }
  }
  *why = d.reason;
  return d.handle;
}

// Frees every workspace (registered with atexit after the first cudaMalloc, so it
// runs before the CUDA runtime's own exit handler, which the runtime registered when
// it initialised). Errors are ignored: the process is ending.
void free_workspaces() {
  std::lock_guard<std::mutex> lock(g_dev_mutex);
  for (DeviceState &d : g_dev) {
    for (int i = 0; i < d.nws; i++) cudaFree(d.ws[i].ptr);
    d.nws = 0;
  }
}

// Whether the stream is being captured into a CUDA graph. An error (the legacy default
// stream while another stream captures, cudaErrorStreamCaptureImplicit) counts as
// capturing: the safe answer, since it only costs the workspace of this one product.
bool capturing(void *stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing((cudaStream_t)stream, &status) != cudaSuccess) {
    cudaGetLastError();
    return true;
  }
  return status != cudaStreamCaptureStatusNone;
}

// This stream's workspace on the device (allocated on first use outside graph capture);
// size 0 when none can be had now. The caller holds g_dev_mutex.
Workspace workspace_locked(int device, void *stream) {
  DeviceState &d = g_dev[device];
  for (int i = 0; i < d.nws; i++)
    if (d.ws[i].stream == stream) return d.ws[i];
  Workspace w = {stream, nullptr, 0};
  if (d.nws == kMaxStreams || capturing(stream)) return w;  // not remembered
  if (cudaMalloc(&w.ptr, d.ws_size) != cudaSuccess) {
    cudaGetLastError();  // out of memory is not sticky: run without, try again next time
    w.ptr = nullptr;
    return w;
  }
  static bool registered = false;
  if (!registered) registered = atexit(free_workspaces) == 0;
  w.size = d.ws_size;
  d.ws[d.nws++] = w;
  return w;
}

// ---- one cuBLASLt call --------------------------------------------------------------

int lt_type(mf_dtype t) {
  return t == MF_FLOAT16 ? MFLT_R_16F : t == MF_BFLOAT16 ? MFLT_R_16BF : MFLT_R_32F;
}

// Largest power of two (<= 256) that divides the address: what cuBLASLt's heuristic
// must assume about a pointer.
uint32_t alignment_of(const void *p) {
  uintptr_t a = (uintptr_t)p;
  uint32_t al = 256;
  while (al > 1 && (a % al)) al >>= 1;
  return al;
}

// Everything cuBLASLt needs for D[n,m] = A'[n,k] B'[k,m] (+ bias) -> epilogue.
struct LtPlan {
  int in_type, d_type;  // the bias has D's type (cuBLASLt's default; we require it)
  int transa, transb;
  uint64_t a_rows, a_cols, b_rows, b_cols, d_rows, d_cols;
  int64_t lda, ldb, ldd;
  uint32_t epilogue;
  const void *a, *b, *bias;
  void *d, *aux;
  int64_t aux_ld;
};

// memfit's (row-major) product -> the column-major cuBLASLt call, without epilogue.
LtPlan lt_plan(const mf_tensor *a, int trans_a, const mf_tensor *b, int trans_b, int64_t m,
               int64_t n, int64_t k, const mf_tensor *bias, void *d, mf_dtype d_dtype) {
  LtPlan p = {};
  p.in_type = lt_type(a->dtype);
  p.d_type = lt_type(d_dtype);
  // A' = memfit's B: stored [k,n] row-major = [n,k] column-major (ld n), used as is;
  //      stored [n,k] (trans_b)  = [k,n] column-major (ld k), used transposed.
  p.a = b->data;
  p.transa = trans_b ? MFLT_OP_T : MFLT_OP_N;
  p.a_rows = trans_b ? k : n;
  p.a_cols = trans_b ? n : k;
  p.lda = trans_b ? k : n;
  // B' = memfit's A: stored [m,k] row-major = [k,m] column-major (ld k), used as is;
  //      stored [k,m] (trans_a)  = [m,k] column-major (ld m), used transposed.
  p.b = a->data;
  p.transb = trans_a ? MFLT_OP_T : MFLT_OP_N;
  p.b_rows = trans_a ? m : k;
  p.b_cols = trans_a ? k : m;
  p.ldb = trans_a ? m : k;
  // D = C^T: [n,m] column-major, ld n
  p.d = d;
  p.d_rows = n;
  p.d_cols = m;
  p.ldd = n;
  p.bias = bias ? bias->data : nullptr;
  p.epilogue = bias ? MFLT_EPILOGUE_BIAS : MFLT_EPILOGUE_DEFAULT;
  return p;
}

struct LtDescs {
  mflt_matmul_desc op = nullptr;
  mflt_layout a = nullptr, b = nullptr, d = nullptr;
  mflt_preference pref = nullptr;
  ~LtDescs() {
    if (pref) g_lt.pref_destroy(pref);
    if (d) g_lt.layout_destroy(d);
    if (b) g_lt.layout_destroy(b);
    if (a) g_lt.layout_destroy(a);
    if (op) g_lt.desc_destroy(op);
  }
};

// Creates the descriptors of plan `p` for a workspace of ws_size bytes; on failure
// says which call failed and how.
mflt_status lt_describe(const LtPlan &p, uint64_t ws_size, LtDescs *x, const char **what) {
  mflt_status s;
#define LT_TRY(call)                                 \
  do {                                               \
    if ((s = (call)) != MFLT_STATUS_SUCCESS) {       \
      *what = #call;                                 \
      return s;                                      \
    }                                                \
  } while (0)
  const int32_t transa = p.transa, transb = p.transb;
  const uint32_t epilogue = p.epilogue;
  LT_TRY(g_lt.desc_create(&x->op, MFLT_COMPUTE_32F, MFLT_R_32F));
  LT_TRY(g_lt.desc_set(x->op, MFLT_DESC_TRANSA, &transa, sizeof transa));
  LT_TRY(g_lt.desc_set(x->op, MFLT_DESC_TRANSB, &transb, sizeof transb));
  LT_TRY(g_lt.desc_set(x->op, MFLT_DESC_EPILOGUE, &epilogue, sizeof epilogue));
  if (p.bias) LT_TRY(g_lt.desc_set(x->op, MFLT_DESC_BIAS_POINTER, &p.bias, sizeof p.bias));
  if (p.aux) {
    LT_TRY(g_lt.desc_set(x->op, MFLT_DESC_EPILOGUE_AUX_POINTER, &p.aux, sizeof p.aux));
    LT_TRY(g_lt.desc_set(x->op, MFLT_DESC_EPILOGUE_AUX_LD, &p.aux_ld, sizeof p.aux_ld));
  }
  LT_TRY(g_lt.layout_create(&x->a, p.in_type, p.a_rows, p.a_cols, p.lda));
  LT_TRY(g_lt.layout_create(&x->b, p.in_type, p.b_rows, p.b_cols, p.ldb));
  LT_TRY(g_lt.layout_create(&x->d, p.d_type, p.d_rows, p.d_cols, p.ldd));
  LT_TRY(g_lt.pref_create(&x->pref));
  LT_TRY(g_lt.pref_set(x->pref, MFLT_PREF_MAX_WORKSPACE_BYTES, &ws_size, sizeof ws_size));
  const uint32_t al[4] = {alignment_of(p.a), alignment_of(p.b), alignment_of(p.d),
                          alignment_of(p.d)};
  const int attrs[4] = {MFLT_PREF_MIN_ALIGNMENT_A_BYTES, MFLT_PREF_MIN_ALIGNMENT_B_BYTES,
                        MFLT_PREF_MIN_ALIGNMENT_C_BYTES, MFLT_PREF_MIN_ALIGNMENT_D_BYTES};
  for (int i = 0; i < 4; i++) LT_TRY(g_lt.pref_set(x->pref, attrs[i], &al[i], sizeof al[i]));
#undef LT_TRY
  return MFLT_STATUS_SUCCESS;
}

enum LtOutcome { LT_RAN, LT_DECLINED, LT_FAILED };

// Heuristic + matmul for one plan. LT_DECLINED (with *why) when cuBLASLt has no
// algorithm for it or refuses it before launching; LT_FAILED (mf_error set) when it
// fails while running.
LtOutcome lt_run(mflt_handle h, const LtPlan &p, Workspace ws, void *stream, char *why,
                 size_t why_len) {
  LtDescs x;
  const char *what = "";
  mflt_status s = lt_describe(p, ws.size, &x, &what);
  if (s != MFLT_STATUS_SUCCESS) {
    set_reason(why, why_len, "cuBLASLt refused a descriptor (%s: %s)", what, status_name(s));
    return LT_DECLINED;
  }
  mflt_heuristic_result r;
  memset(&r, 0, sizeof r);
  int found = 0;
  s = g_lt.heuristic(h, x.op, x.a, x.b, x.d, x.d, x.pref, 1, &r, &found);
  if (s != MFLT_STATUS_SUCCESS || found < 1 || r.state != MFLT_STATUS_SUCCESS ||
      r.workspace_size > ws.size) {
    set_reason(why, why_len, "cuBLASLt has no algorithm for this product (epilogue %u: %s)",
               p.epilogue, s != MFLT_STATUS_SUCCESS ? status_name(s) : "none found");
    return LT_DECLINED;
  }
  const float alpha = 1.0f, beta = 0.0f;
  s = g_lt.matmul(h, x.op, &alpha, p.a, x.a, p.b, x.b, &beta, p.d, x.d, p.d, x.d, &r.algo, ws.ptr,
                  ws.size, stream);
  if (s == MFLT_STATUS_NOT_SUPPORTED || s == MFLT_STATUS_INVALID_VALUE ||
      s == MFLT_STATUS_ARCH_MISMATCH) {
    set_reason(why, why_len, "cublasLtMatmul refused this product (epilogue %u: %s)", p.epilogue,
               status_name(s));
    return LT_DECLINED;
  }
  if (s != MFLT_STATUS_SUCCESS) {
    mf_error(MF_ERR_CUDA, "gemm: cublasLtMatmul failed: %s (%d)", status_name(s), (int)s);
    return LT_FAILED;
  }
  return LT_RAN;
}

bool valid_output(mf_dtype in, mf_dtype out) {
  return out == MF_FLOAT32 ? true : out == in && in != MF_FLOAT32;
}

}  // namespace

/* Runs the product in cuBLASLt if it can: *ran = 1 on success; *ran = 0 and `why`
 * when it leaves the product to the portable kernel; an error status when cuBLASLt
 * failed while running. The caller (mf_cuda_gemm) has made a's device current and
 * handles m == 0 or n == 0. */
extern "C" mf_status mf_cublaslt_gemm(const mf_tensor *a, int trans_a, const mf_tensor *b,
                                      int trans_b, mf_tensor *c, int64_t m, int64_t n, int64_t k,
                                      const mf_tensor *bias, mf_activation act, mf_tensor *pre,
                                      void *stream, int *ran, char *why, size_t why_len) {
  *ran = 0;
  if (mf_gemm_get_backend() == MF_GEMM_PORTABLE) {
    set_reason(why, why_len, "the GEMM backend is set to portable");
    return MF_OK;
  }
  const mf_cublaslt_info &info = ensure_loaded();
  if (!info.loaded) {
    set_reason(why, why_len, "cuBLASLt is not loaded: %s", info.reason);
    return MF_OK;
  }
  if (k == 0) {
    set_reason(why, why_len, "k == 0 (an empty sum; the portable kernel writes the bias)");
    return MF_OK;
  }
  // What D (cuBLASLt's output) is: `pre` when the pre-activation is saved and the
  // activation is not fused, else C. Checked for both plans below.
  const bool fuse_aux = pre && act == MF_ACT_GELU_TANH && pre->dtype == c->dtype && n % 8 == 0 &&
                        alignment_of(pre->data) >= 16;
  const bool can_fuse = !pre || fuse_aux;
  const bool fusable_act = act == MF_ACT_NONE || act == MF_ACT_RELU || act == MF_ACT_GELU_TANH;
  const mf_tensor *d2 = pre ? pre : c;  // D of the two-pass plan
  const mf_tensor *ins[2] = {a, b};
  for (const mf_tensor *t : ins)
    if (alignment_of(t->data) < mf_dtype_size(t->dtype)) {
      set_reason(why, why_len, "an input is not aligned to its element size");
      return MF_OK;
    }
  if (bias && alignment_of(bias->data) < 16) {
    set_reason(why, why_len, "the bias is not 16-byte aligned");
    return MF_OK;
  }

  std::unique_lock<std::mutex> lock(g_dev_mutex);
  const char *no_handle = "";
  mflt_handle h = device_handle_locked(a->device_id, &no_handle);
  if (!h) {
    set_reason(why, why_len, "cuBLASLt is unusable here: %s", no_handle);
    return MF_OK;
  }
  Workspace ws = workspace_locked(a->device_id, stream);
  lock.unlock();

  // Plan 1: everything in one call (the epilogue applies the activation).
  // Plan 2: bias epilogue into D = pre (or C), then our elementwise activation.
  for (int plan = 1; plan <= 2; plan++) {
    const mf_tensor *d = plan == 1 ? c : d2;
    if (plan == 1 && !(can_fuse && fusable_act)) continue;
    if (plan == 2 && !pre && act == MF_ACT_NONE) break;  // same as plan 1
    if (!valid_output(a->dtype, d->dtype)) {
      set_reason(why, why_len, "cuBLASLt has no %s x %s -> %s product", mf_dtype_name(a->dtype),
                 mf_dtype_name(b->dtype), mf_dtype_name(d->dtype));
      continue;
    }
    if (bias && bias->dtype != d->dtype) {
      set_reason(why, why_len,
                 "the bias is %s but cuBLASLt's bias epilogue takes the output's dtype (%s)",
                 mf_dtype_name(bias->dtype), mf_dtype_name(d->dtype));
      continue;
    }
    if (alignment_of(d->data) < mf_dtype_size(d->dtype)) {
      set_reason(why, why_len, "the output is not aligned to its element size");
      continue;
    }
    LtPlan p = lt_plan(a, trans_a, b, trans_b, m, n, k, bias, d->data, d->dtype);
    if (plan == 1 && act == MF_ACT_RELU)
      p.epilogue = bias ? MFLT_EPILOGUE_RELU_BIAS : MFLT_EPILOGUE_RELU;
    if (plan == 1 && act == MF_ACT_GELU_TANH) {
      if (pre) {
        p.epilogue = bias ? MFLT_EPILOGUE_GELU_AUX_BIAS : MFLT_EPILOGUE_GELU_AUX;
        p.aux = pre->data;
        p.aux_ld = n;
      } else {
        p.epilogue = bias ? MFLT_EPILOGUE_GELU_BIAS : MFLT_EPILOGUE_GELU;
      }
    }
    LtOutcome o = lt_run(h, p, ws, stream, why, why_len);
    if (o == LT_FAILED) return MF_ERR_CUDA;
    if (o == LT_DECLINED) continue;
    if (plan == 2) {
      // C = act(D); in place when D is C (then act != NONE)
      mf_status st = mf_cuda_act_forward(d, c, act, stream);
      if (st) return st;
    }
    *ran = 1;
    why[0] = '\0';
    return MF_OK;
  }
  return MF_OK;
}

// ---- queries ---------------------------------------------------------------------------

extern "C" mf_status mf_gemm_cublaslt_info(mf_cublaslt_info *info, int load) {
  if (load) ensure_loaded();
  std::lock_guard<std::mutex> lock(g_load_mutex);
  *info = g_info;
  return MF_OK;
}

extern "C" mf_status mf_gemm_cublaslt_add_path(const char *path) {
  std::lock_guard<std::mutex> lock(g_load_mutex);
  if (g_info.attempted || !path || !*path) return MF_OK;  // too late, or nothing to add
  if (strlen(path) >= sizeof g_paths[0])
    return mf_error(MF_ERR_VALUE, "path: longer than %zu characters", sizeof g_paths[0] - 1);
  for (int i = 0; i < g_npaths; i++)
    if (!strcmp(g_paths[i], path)) return MF_OK;
  if (g_npaths == kMaxPaths) return MF_OK;
  snprintf(g_paths[g_npaths++], sizeof g_paths[0], "%s", path);
  return MF_OK;
}

extern "C" mf_status mf_gemm_cublaslt_device(int device, int *usable, const char **reason) {
  *usable = 0;
  const mf_cublaslt_info &info = ensure_loaded();
  if (!info.loaded) {
    *reason = info.reason;
    return MF_OK;
  }
  int count = 0;
  mf_status st = mf_cuda_device_count(&count);
  if (st) return st;
  if (device < 0 || device >= count) {
    *reason = count ? "no such CUDA device" : "no CUDA device is visible";
    return MF_OK;
  }
  MfDeviceGuard guard(device);
  if (guard.err != cudaSuccess) return mf_cuda_status(guard.err, "gemm_backend");
  std::lock_guard<std::mutex> lock(g_dev_mutex);
  *usable = device_handle_locked(device, reason) != nullptr;
  return MF_OK;
}

extern "C" mf_status mf_gemm_cublaslt_selfcheck(void) {
  const mf_cublaslt_info &info = ensure_loaded();
  if (!info.loaded) return mf_error(MF_ERR_NO_CUDA, "cublaslt: not loaded: %s", info.reason);
  // Fake, 256-byte aligned device addresses: descriptors store pointers, never read them.
  mf_tensor a = {(void *)0x10000, 0, MF_BFLOAT16, MF_CUDA, 0};
  mf_tensor b = {(void *)0x20000, 0, MF_BFLOAT16, MF_CUDA, 0};
  mf_tensor bias = {(void *)0x30000, 0, MF_BFLOAT16, MF_CUDA, 0};
  const mf_dtype ins[3] = {MF_FLOAT32, MF_FLOAT16, MF_BFLOAT16};
  const uint32_t epilogues[8] = {MFLT_EPILOGUE_DEFAULT,   MFLT_EPILOGUE_BIAS,
                                 MFLT_EPILOGUE_RELU,      MFLT_EPILOGUE_RELU_BIAS,
                                 MFLT_EPILOGUE_GELU,      MFLT_EPILOGUE_GELU_BIAS,
                                 MFLT_EPILOGUE_GELU_AUX,  MFLT_EPILOGUE_GELU_AUX_BIAS};
  for (mf_dtype in : ins)
    for (int out_f32 = 0; out_f32 < 2; out_f32++)
      for (int t = 0; t < 4; t++)
        for (uint32_t ep : epilogues) {
          a.dtype = b.dtype = in;
          const mf_dtype out = out_f32 ? MF_FLOAT32 : in;
          bias.dtype = out;
          const bool has_bias = ep & MFLT_EPILOGUE_BIAS;
          LtPlan p = lt_plan(&a, t & 1, &b, t >> 1, 64, 128, 32, has_bias ? &bias : nullptr,
                             (void *)0x40000, out);
          p.epilogue = ep;
          if (ep & 128) {
            p.aux = (void *)0x50000;
            p.aux_ld = 128;
          }
          LtDescs x;
          const char *what = "";
          mflt_status s = lt_describe(p, 32u << 20, &x, &what);
          if (s != MFLT_STATUS_SUCCESS)
            return mf_error(MF_ERR_INTERNAL,
                            "cublaslt: %s (%s -> %s, epilogue %u) failed with %s: our declarations "
                            "do not match this libcublasLt (%s)",
                            what, mf_dtype_name(in), mf_dtype_name(out), ep, status_name(s),
                            info.path);
        }
  return MF_OK;
}
