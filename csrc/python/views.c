/*
 * Python arrays -> mf_tensor views, with no copies.
 *
 * Order of attempts:
 *   1. NumPy-style objects (have __array_interface__): read pointer, shape, strides and
 *      typestr directly. This path also understands ml_dtypes.bfloat16, which NumPy
 *      cannot export through DLPack.
 *   2. Anything with __dlpack__ (torch, CuPy, JAX): ask for a versioned capsule
 *      (max_version=(1, 0)) and fall back to the legacy one for older producers.
 * Capsules are renamed to "used_*" once we own the tensor (as the DLPack protocol
 * requires) and the producer's deleter runs in mf_py_view_release(), with the GIL held.
 * We reject, rather than copy, what the kernels cannot take: non-contiguous memory,
 * unsupported dtypes and devices, read-only outputs.
 */
#include <string.h>

#include "bindings.h"
#include "dlpack_abi.h"

void mf_py_view_release(mf_py_view *v) {
  if (v->managed) {
    if (v->versioned) {
      mf_dl_managed_versioned *m = (mf_dl_managed_versioned *)v->managed;
      if (m->deleter) m->deleter(m);
    } else {
      mf_dl_managed *m = (mf_dl_managed *)v->managed;
      if (m->deleter) m->deleter(m);
    }
    v->managed = NULL;
  }
  Py_CLEAR(v->owner);
}

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
  for (int d = 0; d < dl->ndim; d++) numel *= dl->shape[d];
  if (numel > 0 && dl->strides && !is_c_contiguous(dl->ndim, dl->shape, dl->strides, 1)) {
    PyErr_Format(mf_py_ValueError,
                 "%s: must be contiguous (row-major); call .contiguous() or "
                 "numpy.ascontiguousarray() first",
                 name);
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
        {&r.s_is_contiguous, "is_contiguous"}, {&r.s_numel, "numel"}, {&r.s_data_ptr, "data_ptr"}};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
      ok = (*names[i].slot = PyUnicode_InternFromString(names[i].name)) && ok;
    Py_XDECREF(nn);
    Py_DECREF(torch);
    PyErr_Clear();
    state = ok ? 1 : -1;
  }
  return state == 1 ? &r : NULL;
}

/* The fast path for CPU torch tensors. torch's __dlpack__ and __dlpack_device__ are
 * Python functions that together cost ~3.5 us per array, paid five to seven times per
 * parameter by an optimizer step (hundreds of parameters in a real model); a DLPack
 * export through their C core, torch._C._to_dlpack_versioned, still cost ~0.65 us per
 * array with its capsule and deleter. Here we read what a view needs from the tensor's
 * own C-level attributes (dtype, is_contiguous(), numel(), data_ptr(): ~0.3 us) and
 * hold a reference to the tensor for the call. Taken once torch is imported, for a
 * plain Tensor or Parameter that does not require grad, on the CPU, contiguous, of a
 * dtype memfit takes: the cases where __dlpack__ would export this same memory with no
 * stream semantics. Anything else, or any failure, returns 0 with no error set and the
 * caller takes the general path (and its error messages). Returns 1 when it filled v.
 * (amp_py.c has its own fast path over the same mf_py_torch() references, for lists of
 * gradients on CPU or CUDA, which names what is wrong instead of falling back.) */
static int view_from_torch_cpu(PyObject *obj, mf_py_view *v) {
  const mf_py_torch_refs *T = mf_py_torch();
  if (!T) return 0;
  if ((PyObject *)Py_TYPE(obj) != T->tensor_type && (PyObject *)Py_TYPE(obj) != T->parameter_type)
    return 0;
  /* requires_grad, is_cpu and dtype are attributes; is_contiguous, numel and data_ptr
   * methods. Each step bails out (general path) on anything unexpected. */
  PyObject *a = PyObject_GetAttr(obj, T->s_requires_grad);
  int ok = a == Py_False;
  Py_XDECREF(a);
  if (ok) {
    a = PyObject_GetAttr(obj, T->s_is_cpu);
    ok = a == Py_True;
    Py_XDECREF(a);
  }
  if (ok) {
    a = PyObject_GetAttr(obj, T->s_dtype);
    if (a == T->float32) v->t.dtype = MF_FLOAT32;
    else if (a == T->float16) v->t.dtype = MF_FLOAT16;
    else if (a == T->bfloat16) v->t.dtype = MF_BFLOAT16;
    else if (a == T->uint8) v->t.dtype = MF_UINT8;
    else ok = 0;
    Py_XDECREF(a);
  }
  if (ok) {
    a = PyObject_CallMethodNoArgs(obj, T->s_is_contiguous);
    ok = a == Py_True;
    Py_XDECREF(a);
  }
  long long numel = -1;
  if (ok) {
    a = PyObject_CallMethodNoArgs(obj, T->s_numel);
    numel = a && PyLong_Check(a) ? PyLong_AsLongLong(a) : -1;
    Py_XDECREF(a);
    ok = numel >= 0;
  }
  void *data = NULL;
  if (ok) {
    a = PyObject_CallMethodNoArgs(obj, T->s_data_ptr);
    data = a && PyLong_Check(a) ? PyLong_AsVoidPtr(a) : NULL;
    ok = a && PyLong_Check(a) && !PyErr_Occurred();
    Py_XDECREF(a);
  }
  if (!ok) {
    PyErr_Clear();
    memset(v, 0, sizeof *v);
    return 0;
  }
  v->t.data = data;
  v->t.numel = (int64_t)numel;
  v->t.device = MF_CPU;
  v->t.device_id = 0;
  Py_INCREF(obj);
  v->owner = obj; /* keeps the tensor (and its memory) alive while we use it */
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

/* Releases a half-filled view without clobbering the pending error. */
static void release_keeping_error(mf_py_view *v) {
  PyObject *type, *value, *tb;
  PyErr_Fetch(&type, &value, &tb);
  mf_py_view_release(v);
  PyErr_Restore(type, value, tb);
}

int mf_py_view_get(PyObject *obj, const char *name, int writable, uintptr_t stream,
                   mf_py_view *v) {
  memset(v, 0, sizeof *v);
  if (view_from_torch_cpu(obj, v)) return 0;
  PyObject *iface = PyObject_GetAttrString(obj, "__array_interface__");
  if (iface) {
    const int rc = view_from_array_interface(obj, iface, name, writable, v);
    Py_DECREF(iface);
    if (rc) mf_py_view_release(v);
    return rc;
  }
  PyErr_Clear();
  if (PyObject_HasAttrString(obj, "__dlpack__")) {
    const int rc = view_from_dlpack(obj, name, writable, stream, v);
    if (rc) release_keeping_error(v); /* the deleter must not clobber the error */
    return rc;
  }
  PyErr_Format(mf_py_TypeError,
               "%s: expected an array (torch.Tensor, numpy.ndarray or any object with "
               "__dlpack__), got %s",
               name, Py_TYPE(obj)->tp_name);
  return -1;
}

void mf_py_views_release(int n, mf_py_view *views) {
  for (int i = n - 1; i >= 0; i--) mf_py_view_release(&views[i]);
}

int mf_py_views_get(int n, PyObject *const *objs, const char *const *names, const int *flags,
                    uintptr_t stream, mf_py_view *views) {
  for (int i = 0; i < n; i++) {
    if (objs[i] == Py_None && (flags[i] & MF_PY_OPTIONAL)) {
      memset(&views[i], 0, sizeof views[i]);
      continue;
    }
    if (mf_py_view_get(objs[i], names[i], flags[i] & MF_PY_WRITABLE, stream, &views[i])) {
      PyObject *type, *value, *tb;
      PyErr_Fetch(&type, &value, &tb); /* releasing runs producers' deleters */
      mf_py_views_release(i, views);
      PyErr_Restore(type, value, tb);
      return -1;
    }
  }
  return 0;
}
