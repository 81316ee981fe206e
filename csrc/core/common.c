/* memfit core: error buffer, dtype table, argument checks, threads, build info. */
#include "memfit/common.h"
#include "memfit/thread_pool.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#ifndef MEMFIT_VERSION
#define MEMFIT_VERSION "0.0.0+unknown"
#endif
#ifndef MEMFIT_CUDA_ARCHS_STR
#define MEMFIT_CUDA_ARCHS_STR ""
#endif

static _Thread_local char mf_error_buf[1024];

const char *mf_last_error(void) { return mf_error_buf; }

void mf_clear_error(void) { mf_error_buf[0] = '\0'; }

mf_status mf_error(mf_status status, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(mf_error_buf, sizeof mf_error_buf, fmt, ap);
  va_end(ap);
  return status;
}

mf_status mf_error_no_cuda(const char *what) {
  return mf_error(MF_ERR_NO_CUDA,
                  "%s: got CUDA arrays, but this memfit was built without CUDA support "
                  "(rebuild where nvcc is installed, or with -C cmake.define.MEMFIT_CUDA=ON)",
                  what);
}

const char *mf_dtype_name(mf_dtype dtype) {
  switch (dtype) {
    case MF_FLOAT32: return "float32";
    case MF_FLOAT16: return "float16";
    case MF_BFLOAT16: return "bfloat16";
    case MF_UINT8: return "uint8";
  }
  return "unknown";
}

size_t mf_dtype_size(mf_dtype dtype) {
  switch (dtype) {
    case MF_FLOAT32: return 4;
    case MF_FLOAT16: return 2;
    case MF_BFLOAT16: return 2;
    case MF_UINT8: return 1;
  }
  return 0;
}

const char *mf_device_name(mf_device device) {
  return device == MF_CUDA ? "cuda" : "cpu";
}

mf_status mf_check_dtype(const mf_tensor *t, const char *name, mf_dtype want) {
  if (t->dtype != want)
    return mf_error(MF_ERR_TYPE, "%s: expected dtype %s, got %s", name,
                    mf_dtype_name(want), mf_dtype_name(t->dtype));
  return MF_OK;
}

mf_status mf_check_float(const mf_tensor *t, const char *name) {
  if (t->dtype != MF_FLOAT32 && t->dtype != MF_FLOAT16 && t->dtype != MF_BFLOAT16)
    return mf_error(MF_ERR_TYPE,
                    "%s: expected dtype float32, float16 or bfloat16, got %s", name,
                    mf_dtype_name(t->dtype));
  return MF_OK;
}

mf_status mf_check_numel(const mf_tensor *t, const char *name, int64_t want) {
  if (t->numel != want)
    return mf_error(MF_ERR_VALUE, "%s: expected %lld elements, got %lld", name,
                    (long long)want, (long long)t->numel);
  return MF_OK;
}

mf_status mf_check_same_device(const mf_tensor *a, const char *a_name,
                               const mf_tensor *b, const char *b_name) {
  if (a->device != b->device || a->device_id != b->device_id)
    return mf_error(MF_ERR_VALUE,
                    "%s and %s must be on the same device (got %s:%d and %s:%d)",
                    a_name, b_name, mf_device_name(a->device), a->device_id,
                    mf_device_name(b->device), b->device_id);
  return MF_OK;
}

static int mf_threads = 0;
/* The calling thread's own count, over the process's (memfit.optim.offload's worker
 * steps with cores - 1 threads while the training thread keeps its own setting). */
static _Thread_local int mf_thread_threads = 0;

void mf_set_num_threads(int n) { mf_threads = n > 0 ? n : 0; }

void mf_set_thread_num_threads(int n) { mf_thread_threads = n > 0 ? n : 0; }

int mf_get_num_threads(void) {
  /* the host queue's thread (host_queue.c): its pool's size, which its steps run on, and
   * its other (OpenMP) loops use as their count */
  const mf_thread_pool *pool = mf_thread_pool_current();
  if (pool) return mf_thread_pool_size(pool);
#ifdef _OPENMP
  if (mf_thread_threads > 0) return mf_thread_threads;
  return mf_threads > 0 ? mf_threads : omp_get_max_threads();
#else
  return 1;
#endif
}

int mf_built_with_cuda(void) {
#ifdef MEMFIT_WITH_CUDA
  return 1;
#else
  return 0;
#endif
}

int mf_built_with_openmp(void) {
#ifdef _OPENMP
  return 1;
#else
  return 0;
#endif
}

const char *mf_version(void) { return MEMFIT_VERSION; }

const char *mf_cuda_archs(void) { return MEMFIT_CUDA_ARCHS_STR; }

const char *mf_compiler(void) {
#if defined(__clang__)
  return "clang " __clang_version__;
#elif defined(__GNUC__)
  return "gcc " __VERSION__;
#elif defined(_MSC_VER)
  return "msvc";
#else
  return "unknown";
#endif
}
