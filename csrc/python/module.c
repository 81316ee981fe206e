/*
 * memfit._C: the CPython module. Creates the exception classes, answers build and
 * runtime queries, and merges the method tables of the capability bindings.
 */
#include "bindings.h"
#include "memfit/cuda_hint.h"
#include "memfit/optim.h"
#ifdef MEMFIT_WITH_CUDA
#include "memfit/cuda_launch.h"
#endif

PyObject *mf_py_Error, *mf_py_TypeError, *mf_py_ValueError, *mf_py_CudaError;

PyObject *mf_py_raise(mf_status status) {
  const char *msg = mf_last_error();
  if (!msg || !msg[0]) msg = "memfit: unknown error";
  switch (status) {
    case MF_ERR_TYPE: PyErr_SetString(mf_py_TypeError, msg); break;
    case MF_ERR_VALUE: PyErr_SetString(mf_py_ValueError, msg); break;
    case MF_ERR_NOMEM: PyErr_SetString(PyExc_MemoryError, msg); break;
    case MF_ERR_CUDA:
    case MF_ERR_NO_CUDA: PyErr_SetString(mf_py_CudaError, msg); break;
    default: PyErr_SetString(mf_py_Error, msg); break;
  }
  return NULL;
}

static PyObject *py_build_info(PyObject *self, PyObject *noargs) {
  (void)self;
  (void)noargs;
  return Py_BuildValue("{s:s,s:O,s:s,s:O,s:s}", "version", mf_version(), "cuda",
                       mf_built_with_cuda() ? Py_True : Py_False, "cuda_archs",
                       mf_cuda_archs(), "openmp", mf_built_with_openmp() ? Py_True : Py_False,
                       "compiler", mf_compiler());
}

static PyObject *py_set_num_threads(PyObject *self, PyObject *arg) {
  (void)self;
  long n = PyLong_AsLong(arg);
  if (n == -1 && PyErr_Occurred()) return NULL;
  if (n < 0) {
    PyErr_SetString(mf_py_ValueError, "n: must be >= 0 (0 restores the OpenMP default)");
    return NULL;
  }
  mf_set_num_threads((int)n);
  Py_RETURN_NONE;
}

static PyObject *py_set_thread_num_threads(PyObject *self, PyObject *arg) {
  (void)self;
  long n = PyLong_AsLong(arg);
  if (n == -1 && PyErr_Occurred()) return NULL;
  if (n < 0) {
    PyErr_SetString(mf_py_ValueError, "n: must be >= 0 (0: the process's count)");
    return NULL;
  }
  mf_set_thread_num_threads((int)n);
  Py_RETURN_NONE;
}

static PyObject *py_get_num_threads(PyObject *self, PyObject *noargs) {
  (void)self;
  (void)noargs;
  return PyLong_FromLong(mf_get_num_threads());
}

static PyObject *py_cpu_kernels(PyObject *self, PyObject *noargs) {
  (void)self;
  (void)noargs;
  return PyUnicode_FromString(mf_cpu_kernels());
}

static PyObject *py_cpu_info(PyObject *self, PyObject *noargs) {
  (void)self;
  (void)noargs;
  return Py_BuildValue("{s:s,s:s,s:s}", "model_name", mf_cpu_model_name(), "vendor",
                       mf_cpu_vendor(), "bf16_features", mf_cpu_bf16_features());
}

static PyObject *py_optim_kernel(PyObject *self, PyObject *noargs) {
  (void)self;
  (void)noargs;
  return PyUnicode_FromString(mf_optim_cpu_kernel());
}

static PyObject *py_cuda_device_count(PyObject *self, PyObject *noargs) {
  (void)self;
  (void)noargs;
#ifdef MEMFIT_WITH_CUDA
  int n = 0;
  mf_status st = mf_cuda_device_count(&n);
  if (st) return mf_py_raise(st);
  return PyLong_FromLong(n);
#else
  return PyLong_FromLong(0);
#endif
}

/* Why CUDA is unusable here, or None (doctor shows it: a driver too old for the build) */
static PyObject *py_cuda_unavailable(PyObject *self, PyObject *noargs) {
  (void)self;
  (void)noargs;
#ifdef MEMFIT_WITH_CUDA
  char why[512];
  mf_status st = mf_cuda_unavailable(why, sizeof why);
  if (st) return mf_py_raise(st);
  if (why[0]) return PyUnicode_FromString(why);
  Py_RETURN_NONE;
#else
  return PyUnicode_FromString("this memfit was built without CUDA support");
#endif
}

/* The one-line fix for a CUDA error code (memfit/cuda_hint.h), or None: the formatter
 * itself, in every build, so its words are tested without a GPU. */
static PyObject *py_cuda_hint(PyObject *self, PyObject *args) {
  (void)self;
  int err, driver, runtime, major, minor;
  const char *archs;
  if (!PyArg_ParseTuple(args, "iiisii", &err, &driver, &runtime, &archs, &major, &minor))
    return NULL;
  char hint[640];
  if (!mf_cuda_hint(err, driver, runtime, archs, major, minor, hint, sizeof hint)) Py_RETURN_NONE;
  return PyUnicode_FromString(hint);
}

static PyObject *py_cuda_archs_run_on(PyObject *self, PyObject *args) {
  (void)self;
  int major, minor;
  const char *archs;
  if (!PyArg_ParseTuple(args, "sii", &archs, &major, &minor)) return NULL;
  return PyBool_FromLong(mf_cuda_archs_run_on(archs, major, minor));
}

/* The hint when the driver is older than this build's CUDA, else None; CUDA stays
 * uninitialized (import memfit calls it). */
static PyObject *py_cuda_driver_hint(PyObject *self, PyObject *noargs) {
  (void)self;
  (void)noargs;
#ifdef MEMFIT_WITH_CUDA
  char hint[640];
  mf_status st = mf_cuda_driver_hint(hint, sizeof hint);
  if (st) return mf_py_raise(st);
  if (hint[0]) return PyUnicode_FromString(hint);
#endif
  Py_RETURN_NONE;
}

static PyObject *py_cuda_device_info(PyObject *self, PyObject *arg) {
  (void)self;
  long dev = PyLong_AsLong(arg);
  if (dev == -1 && PyErr_Occurred()) return NULL;
#ifdef MEMFIT_WITH_CUDA
  char name[256];
  int major = 0, minor = 0, driver = 0, runtime = 0;
  int64_t mem = 0;
  mf_status st = mf_cuda_device_info((int)dev, name, sizeof name, &major, &minor, &mem);
  if (!st) st = mf_cuda_versions(&driver, &runtime);
  if (st) return mf_py_raise(st);
  return Py_BuildValue("{s:s,s:(ii),s:L,s:i,s:i}", "name", name, "capability", major, minor,
                       "total_memory", (long long)mem, "driver_version", driver,
                       "runtime_version", runtime);
#else
  (void)dev;
  mf_error(MF_ERR_NO_CUDA, "cuda_device_info: this memfit was built without CUDA support");
  return mf_py_raise(MF_ERR_NO_CUDA);
#endif
}

static PyMethodDef core_methods[] = {
    {"build_info", py_build_info, METH_NOARGS, "What this build of memfit was compiled with."},
    {"set_num_threads", py_set_num_threads, METH_O, "Threads for CPU kernels (0: default)."},
    {"get_num_threads", py_get_num_threads, METH_NOARGS, "Threads CPU kernels use."},
    {"set_thread_num_threads", py_set_thread_num_threads, METH_O,
     "Threads for CPU kernels called from this thread (0: the process's count)."},
    {"cpu_kernels", py_cpu_kernels, METH_NOARGS, "Vector form of the CPU kernels in use."},
    {"cpu_info", py_cpu_info, METH_NOARGS, "CPU model name, vendor and native bf16 features."},
    {"optim_kernel", py_optim_kernel, METH_NOARGS,
     "CPU optimizer kernel for 8/4-bit states (measured once where CPUID cannot tell)."},
    {"cuda_device_count", py_cuda_device_count, METH_NOARGS, "Visible CUDA devices (0 without)."},
    {"cuda_device_info", py_cuda_device_info, METH_O, "Name, capability and memory of a GPU."},
    {"cuda_unavailable", py_cuda_unavailable, METH_NOARGS, "Why no GPU is usable, or None."},
    {"cuda_hint", py_cuda_hint, METH_VARARGS,
     "cuda_hint(error, driver, runtime, archs, major, minor): the fix for a CUDA error, or None."},
    {"cuda_archs_run_on", py_cuda_archs_run_on, METH_VARARGS,
     "cuda_archs_run_on(archs, major, minor): whether the list has code for that GPU."},
    {"cuda_driver_hint", py_cuda_driver_hint, METH_NOARGS,
     "The fix when the driver is older than this build's CUDA, or None (no CUDA init)."},
    {NULL, NULL, 0, NULL}};

/* Every capability's table; module init adds them all. */
static PyMethodDef *method_tables[] = {
    core_methods,
    mf_quant_methods,
    mf_cast_methods,
    mf_gemm_methods,
    mf_plan_methods,
    mf_optim_methods,
    mf_amp_methods,
    mf_host_queue_methods,
};

static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "memfit._C",
                                        "memfit's C core (see the memfit package).", -1,
                                        NULL, NULL, NULL, NULL, NULL};

static PyObject *new_error(PyObject *module, const char *name, PyObject *builtin) {
  char full[64];
  snprintf(full, sizeof full, "memfit.%s", name);
  PyObject *bases = builtin ? PyTuple_Pack(2, mf_py_Error, builtin) : NULL;
  if (builtin && !bases) return NULL;
  PyObject *cls = PyErr_NewException(full, builtin ? bases : PyExc_Exception, NULL);
  Py_XDECREF(bases);
  if (!cls) return NULL;
  if (PyModule_AddObjectRef(module, name, cls) < 0) {
    Py_DECREF(cls);
    return NULL;
  }
  return cls;
}

PyMODINIT_FUNC PyInit__C(void) {
  PyObject *m = PyModule_Create(&module_def);
  if (!m) return NULL;
  for (size_t i = 0; i < sizeof method_tables / sizeof method_tables[0]; i++) {
    if (PyModule_AddFunctions(m, method_tables[i]) < 0) goto fail;
  }
  if (!(mf_py_Error = new_error(m, "Error", NULL))) goto fail;
  if (!(mf_py_TypeError = new_error(m, "MemfitTypeError", PyExc_TypeError))) goto fail;
  if (!(mf_py_ValueError = new_error(m, "MemfitValueError", PyExc_ValueError))) goto fail;
  if (!(mf_py_CudaError = new_error(m, "CudaError", PyExc_RuntimeError))) goto fail;
  if (mf_py_host_queue_add(m) < 0) goto fail;
  return m;
fail:
  Py_DECREF(m);
  return NULL;
}
