/*
 * Shared pieces of the CPython bindings (module memfit._C).
 *
 * Each capability has one binding file <cap>_py.c that defines a NULL-terminated
 * PyMethodDef table, listed in module.c. Bindings turn Python objects into mf_tensor
 * views (views.c), release the GIL around the core call, and map an mf_status to an
 * exception with mf_py_raise().
 */
#ifndef MEMFIT_BINDINGS_H
#define MEMFIT_BINDINGS_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "memfit/common.h"

/* Exception classes created in module.c: memfit.Error and subclasses that also
 * derive from the matching builtin (TypeError, ValueError, RuntimeError). */
extern PyObject *mf_py_Error, *mf_py_TypeError, *mf_py_ValueError, *mf_py_CudaError;

/* Raises the exception for `status` with the core's thread-local message; returns NULL. */
PyObject *mf_py_raise(mf_status status);

/* What a binding returns after its cleanup block: NULL with the pending exception (a
 * view failed), the core's error for `status`, or None. */
static inline PyObject *mf_py_result(mf_status status) {
  if (PyErr_Occurred()) return NULL;
  if (status) return mf_py_raise(status);
  Py_RETURN_NONE;
}

/* A borrowed view of a Python array: torch tensors through their own attributes (CPU
 * and CUDA), other arrays through NumPy's __array_interface__ (which also carries
 * ml_dtypes.bfloat16) or DLPack (CuPy, JAX, any __dlpack__ producer). Holds what keeps
 * the memory alive until mf_py_view_release(). Every view starts zeroed (an absent
 * view: data NULL, numel 0) and is released in the owner's one cleanup block; releasing
 * a zeroed view does nothing. */
typedef struct {
  mf_tensor t;
  PyObject *owner;   /* the object itself (torch, array interface) or the DLPack capsule */
  void *managed;     /* DLPack managed tensor we must delete, or NULL */
  int versioned;     /* managed is a versioned DLPack tensor */
  int permuted;      /* dense but not row-major (torch tensors under MF_PY_DENSE only):
                        t.data runs over the storage in memory order, not row-major */
} mf_py_view;

/* Dimensions a torch tensor may have on the view path. */
#define MF_PY_MAX_DIMS 64

/* Per-array flags: MF_PY_WRITABLE rejects read-only memory; MF_PY_OPTIONAL takes None
 * as an absent view; MF_PY_DENSE also takes a torch tensor that is dense but not
 * row-major (a permutation of a row-major layout, e.g. channels_last), for callers
 * that treat the storage as flat and check that the arrays they combine share one
 * layout (mf_py_same_layout). */
enum { MF_PY_READ = 0, MF_PY_WRITABLE = 1, MF_PY_OPTIONAL = 2, MF_PY_DENSE = 4 };

/* Fills *v (zeroed by the caller) from obj. The argument's name is "what[index]", or
 * "what" when index < 0, formatted only when an error needs it; `stream` is the CUDA
 * stream the caller will launch on (passed to __dlpack__ so the producer orders its
 * work before ours; 0 = default). Returns 0, or -1 with TypeError/ValueError set; *v
 * may then hold references: release it either way. */
int mf_py_view_get(PyObject *obj, const char *what, Py_ssize_t index, int flags,
                   uintptr_t stream, mf_py_view *v);
/* Releases what v holds and zeroes it, keeping a pending exception. */
void mf_py_view_release(mf_py_view *v);

/* Several views at once, for bindings with a few array arguments: all are acquired,
 * or none is held and the exception is set. */
int mf_py_views_get(int n, PyObject *const *objs, const char *const *names, const int *flags,
                    uintptr_t stream, mf_py_view *views);
void mf_py_views_release(int n, mf_py_view *views);
/* The view's tensor, or NULL for an absent optional view. */
static inline mf_tensor *mf_py_tensor_or_null(mf_py_view *v) { return v->owner ? &v->t : NULL; }

/* A list argument: the views of the items of a list or tuple ("what[i]"). Zero it
 * before mf_py_view_list_get and release it in the cleanup block, whether get
 * succeeded or not. expect_n >= 0 requires that many items; with MF_PY_OPTIONAL,
 * None then gives expect_n absent views. `t` repeats the views' tensors contiguously
 * for core calls that take an array of mf_tensor. */
typedef struct {
  PyObject *seq;   /* a tuple of the arrays (holds a reference to each), or NULL */
  Py_ssize_t n;
  mf_py_view *v;   /* n views */
  mf_tensor *t;    /* n tensors: t[i] == v[i].t */
} mf_py_view_list;
int mf_py_view_list_get(PyObject *obj, const char *what, Py_ssize_t expect_n, int flags,
                        uintptr_t stream, mf_py_view_list *l);
void mf_py_view_list_release(mf_py_view_list *l);

/* 1 when two torch tensors have the same shape and strides (strides of size-1
 * dimensions aside), 0 when not (or when either is not a torch tensor), -1 with an
 * error set. */
int mf_py_same_layout(PyObject *a, PyObject *b);
/* obj.dim() of a torch tensor; 0 for anything else; -1 with an error set. */
int mf_py_torch_ndim(PyObject *obj);

/* torch's objects the torch view path compares against, and the attribute names it
 * reads (interned), found in sys.modules once torch is imported: memfit never imports
 * it itself. NULL before that, or if this torch lacks one of them. views.c. */
typedef struct {
  PyObject *tensor_type, *parameter_type;
  PyObject *float32, *float16, *bfloat16, *uint8, *strided;
  PyObject *s_requires_grad, *s_is_cpu, *s_is_cuda, *s_get_device, *s_dtype, *s_layout,
      *s_is_contiguous, *s_numel, *s_shape, *s_stride, *s_dim, *s_data_ptr, *s_is_neg;
} mf_py_torch_refs;
const mf_py_torch_refs *mf_py_torch(void);

/* out <- "what[i]" (an argument's name for error messages), truncated to cap bytes.
 * Cheaper than snprintf's format parsing; used on error paths and for arrays that
 * take the (slower) general view paths. */
static inline void mf_py_index_name(char *out, size_t cap, const char *what, Py_ssize_t i) {
  char digits[24];
  int nd = 0;
  size_t k = 0;
  unsigned long long u = i < 0 ? 0ull - (unsigned long long)i : (unsigned long long)i;
  do digits[nd++] = (char)('0' + u % 10); while ((u /= 10) && nd < (int)sizeof digits);
  if (cap == 0) return;
  while (*what && k + 1 < cap) out[k++] = *what++;
  if (k + 1 < cap) out[k++] = '[';
  if (i < 0 && k + 1 < cap) out[k++] = '-';
  while (nd > 0 && k + 1 < cap) out[k++] = digits[--nd];
  if (k + 1 < cap) out[k++] = ']';
  out[k] = '\0';
}

extern PyMethodDef mf_quant_methods[];
extern PyMethodDef mf_cast_methods[];
extern PyMethodDef mf_gemm_methods[];
extern PyMethodDef mf_plan_methods[];
extern PyMethodDef mf_optim_methods[];
extern PyMethodDef mf_amp_methods[];
extern PyMethodDef mf_host_queue_methods[];
/* Adds the type memfit._C.HostQueue (host_queue_py.c) to the module; -1 with an error. */
int mf_py_host_queue_add(PyObject *module);

#endif /* MEMFIT_BINDINGS_H */
