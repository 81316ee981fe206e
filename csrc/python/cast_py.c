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
  PyObject *o[2] = {ox, oout};
  static const char *const names[] = {"x", "out"};
  static const int flags[] = {MF_PY_READ, MF_PY_WRITABLE};
  mf_py_view v[2];
  if (mf_py_views_get(2, o, names, flags, (uintptr_t)stream, v)) return NULL;
  mf_status st;
  Py_BEGIN_ALLOW_THREADS
  st = mf_cast(&v[0].t, &v[1].t, stochastic ? MF_ROUND_STOCHASTIC : MF_ROUND_NEAREST, seed,
               (void *)(uintptr_t)stream);
  Py_END_ALLOW_THREADS
  mf_py_views_release(2, v);
  if (st) return mf_py_raise(st);
  Py_RETURN_NONE;
}

PyMethodDef mf_cast_methods[] = {
    {"cast", py_cast, METH_VARARGS, "cast(x, out, stochastic, seed, stream)"},
    {NULL, NULL, 0, NULL}};
