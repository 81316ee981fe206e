/* Bindings for matrix products, activation gradients and the CUDA GEMM backend
 * (csrc/core/gemm.c, cuda/gemm.cu, cuda/gemm_cublaslt.cu). Shapes are checked by the Python layer and again, as element
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

/* gemm_set_backend(code): 0 auto, 1 portable, 2 cublaslt */
static PyObject *py_gemm_set_backend(PyObject *self, PyObject *arg) {
  (void)self;
  long code = PyLong_AsLong(arg);
  if (code == -1 && PyErr_Occurred()) return NULL;
  mf_status st = mf_gemm_set_backend((mf_gemm_backend)code);
  if (st) return mf_py_raise(st);
  Py_RETURN_NONE;
}

static PyObject *py_gemm_get_backend(PyObject *self, PyObject *noargs) {
  (void)self;
  (void)noargs;
  return PyLong_FromLong((long)mf_gemm_get_backend());
}

/* gemm_last_backend() -> (backend, reason) of this thread's last gemm */
static PyObject *py_gemm_last_backend(PyObject *self, PyObject *noargs) {
  (void)self;
  (void)noargs;
  const char *backend, *reason;
  mf_gemm_last_backend(&backend, &reason);
  return Py_BuildValue("(ss)", backend, reason);
}

/* cublaslt_info(load) -> dict(attempted, loaded, version, path, reason) */
static PyObject *py_cublaslt_info(PyObject *self, PyObject *arg) {
  (void)self;
  int load = PyObject_IsTrue(arg);
  if (load < 0) return NULL;
  mf_cublaslt_info info;
  mf_status st;
  Py_BEGIN_ALLOW_THREADS
  st = mf_gemm_cublaslt_info(&info, load);
  Py_END_ALLOW_THREADS
  if (st) return mf_py_raise(st);
  return Py_BuildValue("{s:O,s:O,s:i,s:s,s:s}", "attempted", info.attempted ? Py_True : Py_False,
                       "loaded", info.loaded ? Py_True : Py_False, "version", info.version,
                       "path", info.path, "reason", info.reason);
}

static PyObject *py_cublaslt_add_path(PyObject *self, PyObject *arg) {
  (void)self;
  const char *path = PyUnicode_AsUTF8(arg);
  if (!path) return NULL;
  mf_status st = mf_gemm_cublaslt_add_path(path);
  if (st) return mf_py_raise(st);
  Py_RETURN_NONE;
}

/* cublaslt_device(index) -> (usable, reason) */
static PyObject *py_cublaslt_device(PyObject *self, PyObject *arg) {
  (void)self;
  long dev = PyLong_AsLong(arg);
  if (dev == -1 && PyErr_Occurred()) return NULL;
  int usable = 0;
  const char *reason = "";
  mf_status st;
  Py_BEGIN_ALLOW_THREADS
  st = mf_gemm_cublaslt_device((int)dev, &usable, &reason);
  Py_END_ALLOW_THREADS
  if (st) return mf_py_raise(st);
  return Py_BuildValue("(Os)", usable ? Py_True : Py_False, usable ? "" : reason);
}

static PyObject *py_cublaslt_selfcheck(PyObject *self, PyObject *noargs) {
  (void)self;
  (void)noargs;
  mf_status st;
  Py_BEGIN_ALLOW_THREADS
  st = mf_gemm_cublaslt_selfcheck();
  Py_END_ALLOW_THREADS
  if (st) return mf_py_raise(st);
  Py_RETURN_NONE;
}

PyMethodDef mf_gemm_methods[] = {
    {"gemm", py_gemm, METH_VARARGS,
     "gemm(a, trans_a, b, trans_b, out, m, n, k, bias, act, pre, stream)"},
    {"act_backward", py_act_backward, METH_VARARGS, "act_backward(dy, pre, out, act, stream)"},
    {"gemm_set_backend", py_gemm_set_backend, METH_O, "CUDA GEMM backend: 0 auto, 1 portable, 2 cublaslt."},
    {"gemm_get_backend", py_gemm_get_backend, METH_NOARGS, "The CUDA GEMM backend code."},
    {"gemm_last_backend", py_gemm_last_backend, METH_NOARGS,
     "(backend, reason) of this thread's last gemm."},
    {"cublaslt_info", py_cublaslt_info, METH_O, "cuBLASLt load state; loads it first if the arg is true."},
    {"cublaslt_add_path", py_cublaslt_add_path, METH_O, "A libcublasLt file to try (before the first load)."},
    {"cublaslt_device", py_cublaslt_device, METH_O, "(usable, reason) of cuBLASLt on a CUDA device."},
    {"cublaslt_selfcheck", py_cublaslt_selfcheck, METH_NOARGS,
     "Builds every cuBLASLt descriptor memfit uses (no GPU needed)."},
    {NULL, NULL, 0, NULL}};
