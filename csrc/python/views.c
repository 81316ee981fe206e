/*
 * Python arrays -> mf_tensor views, with no copies.
 *
 * Order of attempts:
 *   1. torch tensors (plain Tensor or Parameter, CPU or CUDA, once torch is imported):
 *      read dtype, device, shape, stride() and data_ptr() from the tensor itself: one
 *      path for every device, a fraction of the cost of a DLPack export.
 *   2. NumPy-style objects (have __array_interface__): read pointer, shape, strides and
 *      typestr directly. This path also understands ml_dtypes.bfloat16, which NumPy
 *      cannot export through DLPack.
 *   3. Anything else with __dlpack__ (CuPy, JAX, torch subclasses): ask for a versioned
 *      capsule (max_version=(1, 0)) and fall back to the legacy one for older producers.
 * Capsules are renamed to "used_*" once we own the tensor (as the DLPack protocol
 * requires) and the producer's deleter runs in mf_py_view_release(), with the GIL held.
 * We reject, rather than copy, what the kernels cannot take: non-contiguous memory
 * (dense torch tensors in another order only where the caller asks, MF_PY_DENSE),
 * unsupported dtypes and devices, read-only outputs. An argument's name is formatted
 * only when an error needs it.
 */
#include <string.h>

#include "bindings.h"
#include "dlpack_abi.h"

static int is_c_contiguous(int ndim, const int64_t *shape, const int64_t *strides,
                           int64_t itemsize_units) {
  /* strides in the same units as itemsize_units (elements: 1; bytes: itemsize) */
  int64_t expected = itemsize_units;
  for (int d = ndim - 1; d >= 0; d--) {
    if (shape[d] == 1) continue; /* any stride is fine for a size-1 dimension */
    if (strides[d] != expected) return 0;
    expected *= shape[d];
  }
  return 1;
}

static int set_dtype_from_dl(mf_dl_dtype dt, const char *name, mf_tensor *t) {
  if (dt.lanes == 1) {
    if (dt.code == MF_DL_FLOAT && dt.bits == 32) { t->dtype = MF_FLOAT32; return 0; }
    if (dt.code == MF_DL_FLOAT && dt.bits == 16) { t->dtype = MF_FLOAT16; return 0; }
    if (dt.code == MF_DL_BFLOAT && dt.bits == 16) { t->dtype = MF_BFLOAT16; return 0; }
    if (dt.code == MF_DL_UINT && dt.bits == 8) { t->dtype = MF_UINT8; return 0; }
  }
  PyErr_Format(mf_py_TypeError,
               "%s: unsupported dtype (DLPack code %d, %d bits, %d lanes); memfit takes "
               "float32, float16, bfloat16 and uint8",
               name, (int)dt.code, (int)dt.bits, (int)dt.lanes);
  return -1;
}

static int view_from_dl_tensor(const mf_dl_tensor *dl, const char *name, mf_py_view *v) {
  mf_tensor *t = &v->t;
  switch (dl->device.device_type) {
    case MF_DL_CPU:
    case MF_DL_CUDA_HOST: t->device = MF_CPU; t->device_id = 0; break;
    case MF_DL_CUDA:
    case MF_DL_CUDA_MANAGED: t->device = MF_CUDA; t->device_id = dl->device.device_id; break;
    default:
      PyErr_Format(mf_py_TypeError, "%s: unsupported device type %d (memfit takes CPU and CUDA arrays)",
                   name, (int)dl->device.device_type);
      return -1;
  }
  if (set_dtype_from_dl(dl->dtype, name, t)) return -1;
  int64_t numel = 1;
  for (int d = 0; d < dl->ndim; d++) {
    if (dl->shape[d] < 0 || (dl->shape[d] > 0 && numel > INT64_MAX / dl->shape[d])) {
      PyErr_Format(mf_py_ValueError, "%s: invalid DLPack shape (size %lld in dimension %d)",
                   name, (long long)dl->shape[d], d);
      return -1;
    }
    numel *= dl->shape[d];
  }
  if (numel > 0 && dl->strides && !is_c_contiguous(dl->ndim, dl->shape, dl->strides, 1)) {
    PyErr_Format(mf_py_ValueError,
                 "%s: must be contiguous (row-major); call .contiguous() or "
                 "numpy.ascontiguousarray() first",
                 name);
    return -1;
  }
  if (!dl->data && numel > 0) {
    /* what NumPy refuses too: a NULL pointer is only an array when it has no elements */
    PyErr_Format(mf_py_ValueError, "%s: DLPack tensor has a NULL data pointer but %lld elements",
                 name, (long long)numel);
    return -1;
  }
  t->numel = numel;
  t->data = (char *)dl->data + dl->byte_offset;
  return 0;
}

/* Calls obj.__dlpack__(**kwargs) with stream (CUDA only) and max_version. */
static PyObject *call_dlpack(PyObject *obj, uintptr_t stream, int versioned) {
  PyObject *dev = PyObject_CallMethod(obj, "__dlpack_device__", NULL);
  if (!dev) return NULL;
  long dev_type = -1;
  if (PyTuple_Check(dev) && PyTuple_GET_SIZE(dev) >= 1)
    dev_type = PyLong_AsLong(PyTuple_GET_ITEM(dev, 0));
  Py_DECREF(dev);
  if (dev_type == -1 && PyErr_Occurred()) return NULL;

  PyObject *result = NULL, *kwargs = PyDict_New(), *meth = NULL, *args = NULL;
  if (!kwargs) goto finish;
  if (dev_type == MF_DL_CUDA || dev_type == MF_DL_CUDA_MANAGED) {
    /* DLPack: 1 is the legacy default stream, which is what stream 0 means in CUDA. */
    PyObject *s = PyLong_FromUnsignedLongLong(stream ? (unsigned long long)stream : 1ull);
    if (!s || PyDict_SetItemString(kwargs, "stream", s)) { Py_XDECREF(s); goto finish; }
    Py_DECREF(s);
  }
  if (versioned) {
    PyObject *ver = Py_BuildValue("(ii)", 1, 0);
    if (!ver || PyDict_SetItemString(kwargs, "max_version", ver)) { Py_XDECREF(ver); goto finish; }
    Py_DECREF(ver);
  }
  meth = PyObject_GetAttrString(obj, "__dlpack__");
  if (!meth) goto finish;
  args = PyTuple_New(0);
  if (!args) goto finish;
  result = PyObject_Call(meth, args, kwargs);
finish:
  Py_XDECREF(args);
  Py_XDECREF(meth);
  Py_XDECREF(kwargs);
  return result;
}

/* Takes ownership of a DLPack capsule (renaming it "used_*", as the protocol requires;
 * the producer's deleter runs in mf_py_view_release) and fills v from it. */
static int view_from_capsule(PyObject *capsule, const char *name, int writable, mf_py_view *v) {
  if (PyCapsule_IsValid(capsule, "dltensor_versioned")) {
    mf_dl_managed_versioned *m =
        (mf_dl_managed_versioned *)PyCapsule_GetPointer(capsule, "dltensor_versioned");
    if (!m || PyCapsule_SetName(capsule, "used_dltensor_versioned")) goto fail;
    v->managed = m;
    v->versioned = 1;
    v->owner = capsule;
    if (m->version.major != 1) {
      PyErr_Format(mf_py_TypeError, "%s: DLPack major version %u is not supported", name,
                   m->version.major);
      return -1;
    }
    if (writable && (m->flags & MF_DL_FLAG_READ_ONLY)) {
      PyErr_Format(mf_py_ValueError, "%s: array is read-only", name);
      return -1;
    }
    return view_from_dl_tensor(&m->dl_tensor, name, v);
  }
  if (PyCapsule_IsValid(capsule, "dltensor")) {
    mf_dl_managed *m = (mf_dl_managed *)PyCapsule_GetPointer(capsule, "dltensor");
    if (!m || PyCapsule_SetName(capsule, "used_dltensor")) goto fail;
    v->managed = m;
    v->versioned = 0;
    v->owner = capsule;
    return view_from_dl_tensor(&m->dl_tensor, name, v);
  }
  PyErr_Format(mf_py_TypeError, "%s: __dlpack__ returned something that is not a DLPack capsule",
               name);
fail:
  Py_DECREF(capsule);
  return -1;
}

static int view_from_dlpack(PyObject *obj, const char *name, int writable, uintptr_t stream,
                            mf_py_view *v) {
  PyObject *capsule = call_dlpack(obj, stream, 1);
  if (!capsule && PyErr_ExceptionMatches(PyExc_TypeError)) {
    /* an older producer that does not know max_version */
    PyErr_Clear();
    capsule = call_dlpack(obj, stream, 0);
  }
  if (!capsule) {
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyObject *msg = value ? PyObject_Str(value) : NULL;
    PyErr_Format(mf_py_TypeError, "%s: could not be exported through DLPack: %s", name,
                 msg ? PyUnicode_AsUTF8(msg) : "unknown error");
    Py_XDECREF(msg);
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(tb);
    return -1;
  }
  return view_from_capsule(capsule, name, writable, v);
}

const mf_py_torch_refs *mf_py_torch(void) {
  /* 0: torch not imported yet; 1: ready; -1: this torch lacks something we need */
  static int state;
  static mf_py_torch_refs r; /* held for the process's life */
  if (state == 0) {
    static PyObject *torch_name;
    if (!torch_name && !(torch_name = PyUnicode_InternFromString("torch"))) {
      PyErr_Clear();
      return NULL;
    }
    PyObject *torch = PyImport_GetModule(torch_name);
    if (!torch) {
      PyErr_Clear();
      return NULL;
    }
    PyObject *nn = PyObject_GetAttrString(torch, "nn");
    struct { PyObject **slot; PyObject *from; const char *name; } attrs[] = {
        {&r.tensor_type, torch, "Tensor"}, {&r.parameter_type, nn, "Parameter"},
        {&r.float32, torch, "float32"}, {&r.float16, torch, "float16"},
        {&r.bfloat16, torch, "bfloat16"}, {&r.uint8, torch, "uint8"},
        {&r.strided, torch, "strided"}};
    int ok = 1;
    for (size_t i = 0; i < sizeof attrs / sizeof attrs[0]; i++)
      ok = attrs[i].from && (*attrs[i].slot = PyObject_GetAttrString(attrs[i].from, attrs[i].name)) && ok;
    ok = ok && PyType_Check(r.tensor_type) && PyType_Check(r.parameter_type);
    struct { PyObject **slot; const char *name; } names[] = {
        {&r.s_requires_grad, "requires_grad"}, {&r.s_is_cpu, "is_cpu"}, {&r.s_is_cuda, "is_cuda"},
        {&r.s_get_device, "get_device"}, {&r.s_dtype, "dtype"}, {&r.s_layout, "layout"},
        {&r.s_is_contiguous, "is_contiguous"}, {&r.s_numel, "numel"}, {&r.s_shape, "shape"},
        {&r.s_stride, "stride"}, {&r.s_dim, "dim"}, {&r.s_data_ptr, "data_ptr"},
        {&r.s_is_neg, "is_neg"}};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
      ok = (*names[i].slot = PyUnicode_InternFromString(names[i].name)) && ok;
    Py_XDECREF(nn);
    Py_DECREF(torch);
    PyErr_Clear();
    state = ok ? 1 : -1;
  }
  return state == 1 ? &r : NULL;
}

/* out <- "what[index]", or "what" when index < 0: an argument's name, formatted only
 * when an error needs it. */
static const char *arg_name(char *out, size_t cap, const char *what, Py_ssize_t index) {
  if (index < 0) return what;
  mf_py_index_name(out, cap, what, index);
  return out;
}

/* Raises, and returns 1, for a sparse or other non-strided tensor (whose strides, if
 * it has any, describe no dense memory): says what it is, replacing any pending error. */
static int not_strided(PyObject *obj, const mf_py_torch_refs *T, const char *what,
                       Py_ssize_t index) {
  PyObject *type, *value, *tb;
  PyErr_Fetch(&type, &value, &tb);
  PyObject *layout = PyObject_GetAttr(obj, T->s_layout);
  const int strided = !layout || layout == T->strided;
  Py_XDECREF(layout);
  PyErr_Clear();
  PyErr_Restore(type, value, tb);
  if (strided) return 0;
  char buf[96];
  PyErr_Clear();
  PyErr_Format(mf_py_ValueError, "%s: sparse or other non-strided tensors are not supported "
               "(pass the values of a sparse gradient)", arg_name(buf, sizeof buf, what, index));
  return 1;
}

/* obj.shape and obj.stride() of a torch tensor into shape/strides (elements), with
 * every conversion checked. Returns 0; or -1 with an error set (a sparse or other
 * non-strided tensor, a negative or overflowing size). */
static int torch_dims(PyObject *obj, const mf_py_torch_refs *T, const char *what,
                      Py_ssize_t index, int *ndim, int64_t *shape, int64_t *strides,
                      int64_t *numel) {
  char buf[96];
  PyObject *sz = PyObject_GetAttr(obj, T->s_shape);
  PyObject *st = sz ? PyObject_CallMethodNoArgs(obj, T->s_stride) : NULL;
  int rc = -1;
  if (!st) {
    not_strided(obj, T, what, index); /* else keeps torch's own error */
    goto finish;
  }
  if (!PyTuple_Check(sz) || !PyTuple_Check(st) || PyTuple_GET_SIZE(sz) != PyTuple_GET_SIZE(st) ||
      PyTuple_GET_SIZE(sz) > MF_PY_MAX_DIMS) {
    PyErr_Format(mf_py_ValueError, "%s: unsupported shape/strides (at most %d dimensions)",
                 arg_name(buf, sizeof buf, what, index), MF_PY_MAX_DIMS);
    goto finish;
  }
  *ndim = (int)PyTuple_GET_SIZE(sz);
  int64_t n = 1;
  for (int d = 0; d < *ndim; d++) {
    const Py_ssize_t a = PyLong_AsSsize_t(PyTuple_GET_ITEM(sz, d));
    const Py_ssize_t b = PyLong_AsSsize_t(PyTuple_GET_ITEM(st, d));
    if ((a == -1 || b == -1) && PyErr_Occurred()) goto finish;
    if (a < 0) {
      PyErr_Format(mf_py_ValueError, "%s: negative size %zd in dimension %d",
                   arg_name(buf, sizeof buf, what, index), a, d);
      goto finish;
    }
    if (a > 0 && n > INT64_MAX / a) {
      PyErr_Format(mf_py_ValueError, "%s: too many elements (the size overflows 64 bits)",
                   arg_name(buf, sizeof buf, what, index));
      goto finish;
    }
    n *= a;
    shape[d] = a;
    strides[d] = b;
  }
  *numel = n;
  rc = 0;
finish:
  Py_XDECREF(st);
  Py_XDECREF(sz);
  return rc;
}

/* Whether a strided layout is dense (every element once, no gaps: a permutation of a
 * row-major layout) and whether it is row-major itself. Size-1 dimensions may have any
 * stride. */
static void classify_layout(int ndim, const int64_t *shape, const int64_t *strides, int *dense,
                            int *row_major) {
  *row_major = is_c_contiguous(ndim, shape, strides, 1);
  if (*row_major) {
    *dense = 1;
    return;
  }
  /* dense <=> sorted by stride (size-1 dimensions left out), each stride is the
   * product of the sizes below it; ndim <= MF_PY_MAX_DIMS, so an insertion sort */
  int order[MF_PY_MAX_DIMS], m = 0;
  for (int d = 0; d < ndim; d++) {
    if (shape[d] == 1) continue;
    int j = m++;
    while (j > 0 && strides[order[j - 1]] > strides[d]) {
      order[j] = order[j - 1];
      j--;
    }
    order[j] = d;
  }
  int64_t expected = 1;
  *dense = 1;
  for (int k = 0; k < m && *dense; k++) {
    *dense = strides[order[k]] == expected;
    expected *= shape[order[k]];
  }
}

/* The view path for torch tensors, on any device. torch's __dlpack__ and
 * __dlpack_device__ are Python functions that together cost several microseconds per
 * array (about 18 us for CUDA tensors), paid five to seven times per parameter by an
 * optimizer step; here we read what a view needs from the tensor's own C-level
 * attributes (dtype, device, shape, stride(), data_ptr()) and hold a reference to the
 * tensor for the call. There is no stream handshake as in __dlpack__(stream=...): the
 * torch adapters launch on torch's current stream, where torch has already ordered the
 * work that produced the tensor, as its own operators assume. Taken once torch is imported, for a plain Tensor or Parameter
 * on the CPU or a CUDA device. Returns 1 when it filled v, -1 with an error set (named
 * what[index]), and 0 with no error set for what the general path should handle
 * instead (other devices, subclasses, a writable tensor that requires grad: DLPack
 * refuses it, and its message says why). */
static int view_from_torch(PyObject *obj, const char *what, Py_ssize_t index, int flags,
                           mf_py_view *v) {
  const mf_py_torch_refs *T = mf_py_torch();
  if (!T) return 0;
  if ((PyObject *)Py_TYPE(obj) != T->tensor_type && (PyObject *)Py_TYPE(obj) != T->parameter_type)
    return 0;
  char buf[96];
  PyObject *a;
  int truth;
  if (flags & MF_PY_WRITABLE) {
    /* writing behind autograd's back: refused, as DLPack refuses it */
    if (!(a = PyObject_GetAttr(obj, T->s_requires_grad))) return -1;
    truth = a == Py_True;
    Py_DECREF(a);
    if (truth) return 0;
  }
  if (!(a = PyObject_GetAttr(obj, T->s_dtype))) return -1;
  Py_DECREF(a); /* torch's dtype objects live as long as torch: identity is safe */
  if (a == T->float32) v->t.dtype = MF_FLOAT32;
  else if (a == T->float16) v->t.dtype = MF_FLOAT16;
  else if (a == T->bfloat16) v->t.dtype = MF_BFLOAT16;
  else if (a == T->uint8) v->t.dtype = MF_UINT8;
  else {
    PyObject *str = PyObject_Str(a);
    PyErr_Format(mf_py_TypeError, "%s: unsupported dtype %s; memfit takes float32, float16, "
                 "bfloat16 and uint8", arg_name(buf, sizeof buf, what, index),
                 str ? PyUnicode_AsUTF8(str) : "?");
    Py_XDECREF(str);
    return -1;
  }
  /* a lazy negation (x.conj().imag, torch._neg_view) keeps the values' sign in a flag,
   * not in memory: refused, as torch's __dlpack__ refuses it, rather than read without
   * its sign or copied silently. (The conjugate bit exists only on complex tensors,
   * which the dtype check above has refused.) */
  if (!(a = PyObject_CallMethodNoArgs(obj, T->s_is_neg))) return -1;
  truth = a == Py_True;
  Py_DECREF(a);
  if (truth) {
    PyErr_Format(mf_py_ValueError, "%s: the tensor has its negative bit set (a lazy negation "
                 "view such as x.conj().imag or torch._neg_view(x)); call .resolve_neg() first",
                 arg_name(buf, sizeof buf, what, index));
    return -1;
  }
  /* is_cpu first: one read for a CPU tensor, two for a CUDA one (whose step pays a
   * kernel launch per call anyway) */
  if (!(a = PyObject_GetAttr(obj, T->s_is_cpu))) return -1;
  truth = a == Py_True;
  Py_DECREF(a);
  if (truth) {
    v->t.device = MF_CPU;
    v->t.device_id = 0;
  } else {
    if (!(a = PyObject_GetAttr(obj, T->s_is_cuda))) return -1;
    truth = a == Py_True;
    Py_DECREF(a);
    if (!truth) return 0; /* meta, mps, xpu...: the general path names the device */
    if (!(a = PyObject_CallMethodNoArgs(obj, T->s_get_device))) return -1;
    const long dev = PyLong_AsLong(a);
    Py_DECREF(a);
    if (dev == -1 && PyErr_Occurred()) return -1;
    if (dev < 0 || dev > INT32_MAX) {
      PyErr_Format(mf_py_ValueError, "%s: invalid CUDA device index %ld",
                   arg_name(buf, sizeof buf, what, index), dev);
      return -1;
    }
    v->t.device = MF_CUDA;
    v->t.device_id = (int)dev;
  }
  /* is_contiguous() and numel() first: cheaper than building shape and stride() tuples,
   * which only a tensor that is not row-major needs */
  int dense = 1, row_major;
  long long numel;
  if (!(a = PyObject_CallMethodNoArgs(obj, T->s_is_contiguous))) {
    not_strided(obj, T, what, index);
    return -1;
  }
  row_major = a == Py_True;
  Py_DECREF(a);
  if (row_major) {
    if (!(a = PyObject_CallMethodNoArgs(obj, T->s_numel))) return -1;
    numel = PyLong_AsLongLong(a);
    Py_DECREF(a);
    if (numel == -1 && PyErr_Occurred()) return -1;
  } else {
    int ndim;
    int64_t shape[MF_PY_MAX_DIMS], strides[MF_PY_MAX_DIMS], n;
    if (torch_dims(obj, T, what, index, &ndim, shape, strides, &n)) return -1;
    classify_layout(ndim, shape, strides, &dense, &row_major);
    numel = n;
  }
  if (numel > 0 && (!dense || (!row_major && !(flags & MF_PY_DENSE)))) {
    if (not_strided(obj, T, what, index)) return -1;
    PyErr_Format(mf_py_ValueError,
                 dense ? "%s: must be contiguous (row-major); call .contiguous() first"
                       : "%s: must be contiguous (this tensor has gaps or overlapping elements: "
                         "a slice, an expand() or a view of part of a tensor); call "
                         ".contiguous() first",
                 arg_name(buf, sizeof buf, what, index));
    return -1;
  }
  if (!(a = PyObject_CallMethodNoArgs(obj, T->s_data_ptr))) {
    not_strided(obj, T, what, index);
    return -1;
  }
  void *data = PyLong_AsVoidPtr(a);
  Py_DECREF(a);
  if (!data && PyErr_Occurred()) return -1;
  if (!data && numel > 0) {
    PyErr_Format(mf_py_ValueError, "%s: tensor has no data", arg_name(buf, sizeof buf, what, index));
    return -1;
  }
  v->t.data = data;
  v->t.numel = numel;
  v->permuted = numel > 0 && !row_major;
  v->owner = Py_NewRef(obj); /* keeps the tensor (and its memory) alive while we use it */
  return 1;
}

int mf_py_torch_ndim(PyObject *obj) {
  const mf_py_torch_refs *T = mf_py_torch();
  if (!T || !PyObject_TypeCheck(obj, (PyTypeObject *)T->tensor_type)) return 0;
  PyObject *r = PyObject_CallMethodNoArgs(obj, T->s_dim);
  if (!r) return -1;
  const long d = PyLong_AsLong(r);
  Py_DECREF(r);
  return d == -1 && PyErr_Occurred() ? -1 : (int)d;
}

int mf_py_same_layout(PyObject *a, PyObject *b) {
  const mf_py_torch_refs *T = mf_py_torch();
  if (!T || !PyObject_TypeCheck(a, (PyTypeObject *)T->tensor_type) ||
      !PyObject_TypeCheck(b, (PyTypeObject *)T->tensor_type))
    return 0;
  int na, nb;
  int64_t sa[MF_PY_MAX_DIMS], ta[MF_PY_MAX_DIMS], sb[MF_PY_MAX_DIMS], tb[MF_PY_MAX_DIMS], ma, mb;
  if (torch_dims(a, T, "a", -1, &na, sa, ta, &ma) || torch_dims(b, T, "b", -1, &nb, sb, tb, &mb))
    return -1;
  if (na != nb) return 0;
  for (int d = 0; d < na; d++)
    if (sa[d] != sb[d] || (sa[d] != 1 && ta[d] != tb[d])) return 0;
  return 1;
}

/* NumPy's typestr plus dtype.name (for ml_dtypes.bfloat16, whose typestr is '<V2'). */
static int dtype_from_array_interface(PyObject *obj, PyObject *typestr, const char *name,
                                      mf_tensor *t) {
  const char *ts = PyUnicode_Check(typestr) ? PyUnicode_AsUTF8(typestr) : NULL;
  if (!ts) {
    PyErr_Format(mf_py_TypeError, "%s: __array_interface__ has no valid typestr", name);
    return -1;
  }
  if (!strcmp(ts, "<f4") || !strcmp(ts, "=f4")) { t->dtype = MF_FLOAT32; return 0; }
  if (!strcmp(ts, "<f2") || !strcmp(ts, "=f2")) { t->dtype = MF_FLOAT16; return 0; }
  if (!strcmp(ts, "|u1")) { t->dtype = MF_UINT8; return 0; }
  PyObject *dtype = PyObject_GetAttrString(obj, "dtype");
  PyObject *dname = dtype ? PyObject_GetAttrString(dtype, "name") : NULL;
  Py_XDECREF(dtype);
  if (!dname) PyErr_Clear();
  const char *dn = dname && PyUnicode_Check(dname) ? PyUnicode_AsUTF8(dname) : ts;
  if (!strcmp(ts, "<V2") && !strcmp(dn, "bfloat16")) {
    Py_XDECREF(dname);
    t->dtype = MF_BFLOAT16;
    return 0;
  }
  if (ts[0] == '>') {
    /* the dtype itself may be one we take: say what is wrong with it */
    PyErr_Format(mf_py_TypeError,
                 "%s: big-endian %s arrays (typestr '%s') are not supported; memfit takes "
                 "native little-endian arrays: convert with x.astype(x.dtype.newbyteorder('<'))",
                 name, dn, ts);
    Py_XDECREF(dname);
    return -1;
  }
  PyErr_Format(mf_py_TypeError,
               "%s: unsupported dtype %s; memfit takes float32, float16, bfloat16 and uint8",
               name, dn);
  Py_XDECREF(dname);
  return -1;
}

static int view_from_array_interface(PyObject *obj, PyObject *iface, const char *name,
                                     int writable, mf_py_view *v) {
  mf_tensor *t = &v->t;
  if (!PyDict_Check(iface)) {
    PyErr_Format(mf_py_TypeError, "%s: __array_interface__ is not a dict", name);
    return -1;
  }
  PyObject *data = PyDict_GetItemString(iface, "data");
  PyObject *shape = PyDict_GetItemString(iface, "shape");
  PyObject *strides = PyDict_GetItemString(iface, "strides");
  PyObject *typestr = PyDict_GetItemString(iface, "typestr");
  if (!data || !PyTuple_Check(data) || PyTuple_GET_SIZE(data) != 2 || !shape ||
      !PyTuple_Check(shape) || !typestr) {
    PyErr_Format(mf_py_TypeError, "%s: unsupported __array_interface__ layout", name);
    return -1;
  }
  if (dtype_from_array_interface(obj, typestr, name, t)) return -1;
  int ndim = (int)PyTuple_GET_SIZE(shape);
  if (ndim > 64) {
    PyErr_Format(mf_py_ValueError, "%s: too many dimensions (%d)", name, ndim);
    return -1;
  }
  int64_t dims[64], st[64], numel = 1;
  for (int d = 0; d < ndim; d++) {
    dims[d] = PyLong_AsLongLong(PyTuple_GET_ITEM(shape, d));
    if (dims[d] == -1 && PyErr_Occurred()) return -1;
    if (dims[d] < 0 || (dims[d] > 0 && numel > INT64_MAX / dims[d])) {
      PyErr_Format(mf_py_ValueError, "%s: invalid __array_interface__ shape (size %lld in "
                   "dimension %d)", name, (long long)dims[d], d);
      return -1;
    }
    numel *= dims[d];
  }
  if (strides && strides != Py_None && numel > 0) {
    if (!PyTuple_Check(strides) || PyTuple_GET_SIZE(strides) != ndim) {
      PyErr_Format(mf_py_TypeError, "%s: malformed strides in __array_interface__", name);
      return -1;
    }
    for (int d = 0; d < ndim; d++) {
      st[d] = PyLong_AsLongLong(PyTuple_GET_ITEM(strides, d));
      if (st[d] == -1 && PyErr_Occurred()) return -1;
    }
    if (!is_c_contiguous(ndim, dims, st, (int64_t)mf_dtype_size(t->dtype))) {
      PyErr_Format(mf_py_ValueError,
                   "%s: must be contiguous (row-major); call numpy.ascontiguousarray() first",
                   name);
      return -1;
    }
  }
  if (writable && PyObject_IsTrue(PyTuple_GET_ITEM(data, 1))) {
    PyErr_Format(mf_py_ValueError, "%s: array is read-only", name);
    return -1;
  }
  void *ptr = PyLong_AsVoidPtr(PyTuple_GET_ITEM(data, 0));
  if (!ptr && PyErr_Occurred()) return -1;
  if (!ptr && numel > 0) {
    /* NumPy refuses this too: only an array without elements may have no memory */
    PyErr_Format(mf_py_ValueError, "%s: __array_interface__ has a NULL data pointer but %lld "
                 "elements", name, (long long)numel);
    return -1;
  }
  PyObject *offset = PyDict_GetItemString(iface, "offset");
  if (offset && PyLong_Check(offset)) ptr = (char *)ptr + PyLong_AsSsize_t(offset);
  t->data = ptr;
  t->numel = numel;
  t->device = MF_CPU;
  t->device_id = 0;
  Py_INCREF(obj);
  v->owner = obj; /* keeps the memory alive while we use it */
  return 0;
}

int mf_py_view_get(PyObject *obj, const char *what, Py_ssize_t index, int flags,
                   uintptr_t stream, mf_py_view *v) {
  if (obj == Py_None && (flags & MF_PY_OPTIONAL)) return 0; /* absent: v stays zero */
  const int rc = view_from_torch(obj, what, index, flags, v);
  if (rc) return rc < 0 ? -1 : 0;
  /* the general paths cost microseconds anyway: name the argument up front */
  char buf[96];
  const char *name = arg_name(buf, sizeof buf, what, index);
  const int writable = flags & MF_PY_WRITABLE;
  PyObject *iface = PyObject_GetAttrString(obj, "__array_interface__");
  if (iface) {
    const int r = view_from_array_interface(obj, iface, name, writable, v);
    Py_DECREF(iface);
    return r;
  }
  PyErr_Clear();
  if (PyObject_HasAttrString(obj, "__dlpack__")) return view_from_dlpack(obj, name, writable, stream, v);
  PyErr_Format(mf_py_TypeError,
               "%s: expected an array (torch.Tensor, numpy.ndarray or any object with "
               "__dlpack__), got %s",
               name, Py_TYPE(obj)->tp_name);
  return -1;
}

void mf_py_view_release(mf_py_view *v) {
  if (v->managed) {
    /* a producer's deleter may run Python code: keep a pending error across it */
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    if (v->versioned) {
      mf_dl_managed_versioned *m = (mf_dl_managed_versioned *)v->managed;
      if (m->deleter) m->deleter(m);
    } else {
      mf_dl_managed *m = (mf_dl_managed *)v->managed;
      if (m->deleter) m->deleter(m);
    }
    PyErr_Restore(type, value, tb);
  }
  PyObject *owner = v->owner;
  memset(v, 0, sizeof *v);
  Py_XDECREF(owner); /* deallocators (finalizers included) keep a pending exception */
}

void mf_py_views_release(int n, mf_py_view *views) {
  for (int i = n - 1; i >= 0; i--) mf_py_view_release(&views[i]);
}

int mf_py_views_get(int n, PyObject *const *objs, const char *const *names, const int *flags,
                    uintptr_t stream, mf_py_view *views) {
  memset(views, 0, (size_t)n * sizeof *views);
  for (int i = 0; i < n; i++) {
    if (mf_py_view_get(objs[i], names[i], -1, flags[i], stream, &views[i])) {
      mf_py_views_release(i + 1, views);
      return -1;
    }
  }
  return 0;
}

void mf_py_view_list_release(mf_py_view_list *l) {
  if (l->v)
    for (Py_ssize_t i = l->n - 1; i >= 0; i--) mf_py_view_release(&l->v[i]);
  PyMem_Free(l->v);
  PyMem_Free(l->t);
  Py_CLEAR(l->seq);
  memset(l, 0, sizeof *l);
}

int mf_py_view_list_get(PyObject *obj, const char *what, Py_ssize_t expect_n, int flags,
                        uintptr_t stream, mf_py_view_list *l) {
  if (obj == Py_None && (flags & MF_PY_OPTIONAL) && expect_n >= 0) {
    l->n = expect_n; /* no arrays: n absent views */
  } else {
    /* only lists and tuples: an array is iterable too, and its rows are not arrays */
    if (!PyList_Check(obj) && !PyTuple_Check(obj)) {
      PyErr_Format(mf_py_TypeError, "%s: expected a list or tuple of arrays, got %s", what,
                   Py_TYPE(obj)->tp_name);
      return -1;
    }
    /* a tuple of our own: it keeps every array alive while the GIL is released, even
     * if another thread empties the caller's list meanwhile */
    l->seq = PyTuple_Check(obj) ? Py_NewRef(obj) : PyList_AsTuple(obj);
    if (!l->seq) return -1;
    l->n = PyTuple_GET_SIZE(l->seq);
    if (expect_n >= 0 && l->n != expect_n) {
      PyErr_Format(mf_py_ValueError, "%s: expected %zd arrays (one per parameter), got %zd",
                   what, expect_n, l->n);
      return -1;
    }
  }
  const size_t cap = l->n > 0 ? (size_t)l->n : 1;
  l->v = (mf_py_view *)PyMem_Calloc(cap, sizeof(mf_py_view));
  l->t = (mf_tensor *)PyMem_Calloc(cap, sizeof(mf_tensor));
  if (!l->v || !l->t) {
    PyErr_NoMemory();
    return -1;
  }
  if (!l->seq) return 0;
  for (Py_ssize_t i = 0; i < l->n; i++) {
    if (mf_py_view_get(PyTuple_GET_ITEM(l->seq, i), what, i, flags, stream, &l->v[i])) return -1;
    l->t[i] = l->v[i].t;
  }
  return 0;
}
