/* Bindings for matrix products and activation gradients (csrc/core/gemm.c,
 * cuda/gemm.cu). Shapes are checked by the Python layer and again, as element
 * counts, by the core. */
#include "bindings.h"
#include "memfit/gemm.h"

/* Optional arrays: None -> no view. */
static int view_opt(PyObject *o, const char *name, int writable, uintptr_t stream, mf_py_view *v,
                    int *have) {
  *have = 0;
  if (o == Py_None) return 0;
  if (mf_py_view_get(o, name, writable, stream, v)) return -1;
  *have = 1;
  return 0;
}

/* gemm(a, trans_a, b, trans_b, out, m, n, k, bias, act, pre, stream) */
static PyObject *py_gemm(PyObject *self, PyObject *args) {
  (void)self;
  PyObject *oa, *ob, *oout, *obias, *opre;
  int trans_a, trans_b, act;
  long long m, n, k;
  unsigned long long stream;
  if (!PyArg_ParseTuple(args, "OpOpOLLLOiOK", &oa, &trans_a, &ob, &trans_b, &oout, &m, &n, &k,
                        &obias, &act, &opre, &stream))
    return NULL;
  PyObject *result = NULL;
  mf_py_view a, b, out, bias, pre;
  int have_a = 0, have_b = 0, have_out = 0, have_bias = 0, have_pre = 0;
  uintptr_t s = (uintptr_t)stream;
  if (mf_py_view_get(oa, "a", 0, s, &a)) goto finish;
  have_a = 1;
  if (mf_py_view_get(ob, "b", 0, s, &b)) goto finish;
  have_b = 1;
  if (mf_py_view_get(oout, "out", 1, s, &out)) goto finish;
  have_out = 1;
  if (view_opt(obias, "bias", 0, s, &bias, &have_bias)) goto finish;
  if (view_opt(opre, "pre", 1, s, &pre, &have_pre)) goto finish;
  mf_status st;
  Py_BEGIN_ALLOW_THREADS
  st = mf_gemm(&a.t, trans_a, &b.t, trans_b, &out.t, (int64_t)m, (int64_t)n, (int64_t)k,
               have_bias ? &bias.t : NULL, (mf_activation)act, have_pre ? &pre.t : NULL,
               (void *)s);
  Py_END_ALLOW_THREADS
  if (st) {
    mf_py_raise(st);
    goto finish;
  }
  result = Py_NewRef(Py_None);
finish:
  if (have_pre) mf_py_view_release(&pre);
  if (have_bias) mf_py_view_release(&bias);
  if (have_out) mf_py_view_release(&out);
  if (have_b) mf_py_view_release(&b);
  if (have_a) mf_py_view_release(&a);
  return result;
}

/* act_backward(dy, pre, out, act, stream) */
static PyObject *py_act_backward(PyObject *self, PyObject *args) {
  (void)self;
  PyObject *ody, *opre, *oout;
  int act;
  unsigned long long stream;
  if (!PyArg_ParseTuple(args, "OOOiK", &ody, &opre, &oout, &act, &stream)) return NULL;
  PyObject *result = NULL;
  mf_py_view dy, pre, out;
  int have = 0;
  uintptr_t s = (uintptr_t)stream;
  if (mf_py_view_get(ody, "grad_output", 0, s, &dy)) goto finish;
  have = 1;
  if (mf_py_view_get(opre, "pre", 0, s, &pre)) goto finish;
  have = 2;
  if (mf_py_view_get(oout, "out", 1, s, &out)) goto finish;
  have = 3;
  mf_status st;
  Py_BEGIN_ALLOW_THREADS
  st = mf_act_backward(&dy.t, &pre.t, &out.t, (mf_activation)act, (void *)s);
  Py_END_ALLOW_THREADS
  if (st) {
    mf_py_raise(st);
    goto finish;
  }
  result = Py_NewRef(Py_None);
finish:
  if (have >= 3) mf_py_view_release(&out);
  if (have >= 2) mf_py_view_release(&pre);
  if (have >= 1) mf_py_view_release(&dy);
  return result;
}

PyMethodDef mf_gemm_methods[] = {
    {"gemm", py_gemm, METH_VARARGS,
     "gemm(a, trans_a, b, trans_b, out, m, n, k, bias, act, pre, stream)"},
    {"act_backward", py_act_backward, METH_VARARGS, "act_backward(dy, pre, out, act, stream)"},
    {NULL, NULL, 0, NULL}};
