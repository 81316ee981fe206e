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

/* A borrowed view of a Python array: DLPack (torch, CuPy, JAX, NumPy) or NumPy's
 * __array_interface__ (which also carries ml_dtypes.bfloat16). Holds what keeps the
 * memory alive until mf_py_view_release(). */
typedef struct {
  mf_tensor t;
  PyObject *owner;   /* the object itself (array interface) or the DLPack capsule */
  void *managed;     /* DLPack managed tensor we must delete, or NULL */
  int versioned;     /* managed is a versioned DLPack tensor */
} mf_py_view;

/* Fills *v from obj. `name` is the argument's name for error messages; `writable`
 * rejects read-only memory; `stream` is the CUDA stream the caller will launch on
 * (passed to __dlpack__ so the producer orders its work before ours; 0 = default).
 * Returns 0, or -1 with TypeError/ValueError set. Must be paired with release. */
int mf_py_view_get(PyObject *obj, const char *name, int writable, uintptr_t stream,
                   mf_py_view *v);
void mf_py_view_release(mf_py_view *v);

/* Several views at once, for bindings that take many arrays: all are acquired, or
 * none is held and the exception is set. Per-array flags: MF_PY_WRITABLE, and
 * MF_PY_OPTIONAL (None gives an absent view: views[i].t.data == NULL, numel 0). */
enum { MF_PY_READ = 0, MF_PY_WRITABLE = 1, MF_PY_OPTIONAL = 2 };
int mf_py_views_get(int n, PyObject *const *objs, const char *const *names, const int *flags,
                    uintptr_t stream, mf_py_view *views);
void mf_py_views_release(int n, mf_py_view *views);
/* The view's tensor, or NULL for an absent optional view. */
static inline mf_tensor *mf_py_tensor_or_null(mf_py_view *v) { return v->owner ? &v->t : NULL; }

/* torch's objects the torch fast paths compare against, and the attribute names they
 * read (interned), found in sys.modules once torch is imported: memfit never imports it
 * itself. NULL before that, or if this torch lacks one of them. views.c. */
typedef struct {
  PyObject *tensor_type, *parameter_type;
  PyObject *float32, *float16, *bfloat16, *uint8, *strided;
  PyObject *s_requires_grad, *s_is_cpu, *s_is_cuda, *s_get_device, *s_dtype, *s_layout,
      *s_is_contiguous, *s_numel, *s_data_ptr;
} mf_py_torch_refs;
const mf_py_torch_refs *mf_py_torch(void);

/* out <- "what[i]" (an argument's name for error messages), truncated to cap bytes.
 * Bindings name every array of a list up front, thousands per optimizer step of a
 * large model, so this avoids snprintf's format parsing (~10x slower). */
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

#endif /* MEMFIT_BINDINGS_H */
