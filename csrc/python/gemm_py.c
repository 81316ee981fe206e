/* Bindings for matrix products and activation gradients (csrc/core/gemm.c,
 * cuda/gemm.cu). Shapes are checked by the Python layer and again, as element
 * counts, by the core. */
#include "bindings.h"
#include "memfit/gemm.h"

/* gemm(a, trans_a, b, trans_b, out, m, n, k, bias, act, pre, stream) */
static PyObject *py_gemm(PyObject *self, PyObject *args) {
  (void)self;
  PyObject *o[5]; /* a, b, out, bias, pre */
  int trans_a, trans_b, act;
  long long m, n, k;
  unsigned long long stream;
  if (!PyArg_ParseTuple(args, "OpOpOLLLOiOK", &o[0], &trans_a, &o[1], &trans_b, &o[2], &m, &n, &k,
                        &o[3], &act, &o[4], &stream))
    return NULL;
  static const char *const names[] = {"a", "b", "out", "bias", "pre"};
  static const int flags[] = {MF_PY_READ, MF_PY_READ, MF_PY_WRITABLE, MF_PY_OPTIONAL,
                              MF_PY_WRITABLE | MF_PY_OPTIONAL};
  mf_py_view v[5];
  if (mf_py_views_get(5, o, names, flags, (uintptr_t)stream, v)) return NULL;
  mf_status st;
  Py_BEGIN_ALLOW_THREADS
  st = mf_gemm(&v[0].t, trans_a, &v[1].t, trans_b, &v[2].t, (int64_t)m, (int64_t)n, (int64_t)k,
               mf_py_tensor_or_null(&v[3]), (mf_activation)act, mf_py_tensor_or_null(&v[4]),
               (void *)(uintptr_t)stream);
  Py_END_ALLOW_THREADS
  mf_py_views_release(5, v);
  if (st) return mf_py_raise(st);
  Py_RETURN_NONE;
}

/* act_backward(dy, pre, out, act, stream) */
static PyObject *py_act_backward(PyObject *self, PyObject *args) {
  (void)self;
  PyObject *o[3];
  int act;
  unsigned long long stream;
  if (!PyArg_ParseTuple(args, "OOOiK", &o[0], &o[1], &o[2], &act, &stream)) return NULL;
  static const char *const names[] = {"grad_output", "pre", "out"};
  static const int flags[] = {MF_PY_READ, MF_PY_READ, MF_PY_WRITABLE};
  mf_py_view v[3];
  if (mf_py_views_get(3, o, names, flags, (uintptr_t)stream, v)) return NULL;
  mf_status st;
  Py_BEGIN_ALLOW_THREADS
  st = mf_act_backward(&v[0].t, &v[1].t, &v[2].t, (mf_activation)act, (void *)(uintptr_t)stream);
  Py_END_ALLOW_THREADS
  mf_py_views_release(3, v);
  if (st) return mf_py_raise(st);
  Py_RETURN_NONE;
}

PyMethodDef mf_gemm_methods[] = {
    {"gemm", py_gemm, METH_VARARGS,
     "gemm(a, trans_a, b, trans_b, out, m, n, k, bias, act, pre, stream)"},
    {"act_backward", py_act_backward, METH_VARARGS, "act_backward(dy, pre, out, act, stream)"},
    {NULL, NULL, 0, NULL}};
