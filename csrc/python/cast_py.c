/* Bindings for float casts (csrc/core/cast.c, cuda/cast.cu). */
#include "bindings.h"
#include "memfit/cast.h"

/* cast(x, out, stochastic, seed, stream) */
static PyObject *py_cast(PyObject *self, PyObject *args) {
  (void)self;
  PyObject *ox, *oout;
  int stochastic;
  unsigned long long seed, stream;
  if (!PyArg_ParseTuple(args, "OOpKK", &ox, &oout, &stochastic, &seed, &stream)) return NULL;
  mf_py_view x, out;
  if (mf_py_view_get(ox, "x", 0, (uintptr_t)stream, &x)) return NULL;
  if (mf_py_view_get(oout, "out", 1, (uintptr_t)stream, &out)) {
    mf_py_view_release(&x);
    return NULL;
  }
  mf_status st;
  Py_BEGIN_ALLOW_THREADS
  st = mf_cast(&x.t, &out.t, stochastic ? MF_ROUND_STOCHASTIC : MF_ROUND_NEAREST, seed,
               (void *)(uintptr_t)stream);
  Py_END_ALLOW_THREADS
  mf_py_view_release(&out);
  mf_py_view_release(&x);
  if (st) return mf_py_raise(st);
  Py_RETURN_NONE;
}

PyMethodDef mf_cast_methods[] = {
    {"cast", py_cast, METH_VARARGS, "cast(x, out, stochastic, seed, stream)"},
    {NULL, NULL, 0, NULL}};
