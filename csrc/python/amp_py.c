/*
 * Bindings for the gradient scaler and the fused gradient passes (csrc/core/scaler.c,
 * csrc/core/unscale.c, cuda/scaler.cu, cuda/unscale.cu).
 *
 * Lists of gradients: a step may touch hundreds of tensors, and a DLPack export costs
 * a few microseconds per tensor in torch (two Python-level calls and a capsule), more
 * than the unscale of a small gradient. So for torch tensors (once torch is imported;
 * its references come from mf_py_torch() in views.c) we read data_ptr/numel/device/dtype/layout
 * from the tensor directly, with the same checks as the DLPack path (dense layout,
 * contiguous, CPU or CUDA, float dtype), and fall back to mf_py_view_get() for
 * everything else (NumPy, CuPy, JAX, other __dlpack__ producers). The list holds a
 * reference to every tensor for the duration of the call, which keeps the memory alive
 * while the GIL is released.
 */
#include <string.h>

#include "bindings.h"
#include "memfit/scaler.h"

/* ---- torch fast path ------------------------------------------------------------------ */

/* obj.<name>() when call, else obj.<name>: new reference or NULL. */
static PyObject *attr(PyObject *obj, PyObject *name, int call) {
  return call ? PyObject_CallMethodNoArgs(obj, name) : PyObject_GetAttr(obj, name);
}

static int truthy(PyObject *obj, PyObject *name, int call) {
  PyObject *r = attr(obj, name, call);
  if (!r) return -1;
  int v = PyObject_IsTrue(r);
  Py_DECREF(r);
  return v;
}

static int64_t int_of(PyObject *obj, PyObject *name) {
  PyObject *r = attr(obj, name, 1);
  if (!r) return -1;
  long long v = PyLong_AsLongLong(r);
  Py_DECREF(r);
  return (int64_t)v;
}

/* Fills t from a torch tensor. Returns 0, 1 (not handled here: use the generic path)
 * or -1 with an exception set. Six attribute reads/calls for a CPU tensor. */
static int torch_view(PyObject *obj, const char *base, Py_ssize_t index, mf_tensor *t) {
  const mf_py_torch_refs *T = mf_py_torch();
  if (!T || !PyObject_TypeCheck(obj, (PyTypeObject *)T->tensor_type)) return 1;
  /* the argument's name ("grads[3]"), formatted only when an error needs it */
  char name[96];
#define NAME() (index < 0 ? base : (snprintf(name, sizeof name, "%s[%zd]", base, index), name))
  PyObject *dtype = attr(obj, T->s_dtype, 0);
  if (!dtype) return -1;
  Py_DECREF(dtype); /* the registered dtypes stay alive, so identity is safe */
  if (dtype == T->float32) t->dtype = MF_FLOAT32;
  else if (dtype == T->float16) t->dtype = MF_FLOAT16;
  else if (dtype == T->bfloat16) t->dtype = MF_BFLOAT16;
  else {
    PyObject *str = PyObject_Str(dtype);
    PyErr_Format(mf_py_TypeError, "%s: unsupported dtype %s; expected float32, float16 or "
                 "bfloat16", NAME(), str ? PyUnicode_AsUTF8(str) : "?");
    Py_XDECREF(str);
    return -1;
  }
  int is_cuda = truthy(obj, T->s_is_cuda, 0);
  if (is_cuda < 0) return -1;
  if (is_cuda) {
    int64_t dev = int_of(obj, T->s_get_device);
    if (dev == -1 && PyErr_Occurred()) return -1;
    t->device = MF_CUDA;
    t->device_id = (int)dev;
  } else {
    int is_cpu = truthy(obj, T->s_is_cpu, 0);
    if (is_cpu < 0) return -1;
    if (!is_cpu) return 1; /* meta, mps, xpu...: the DLPack path names the device */
    t->device = MF_CPU;
    t->device_id = 0;
  }
  int contig = truthy(obj, T->s_is_contiguous, 1);
  if (contig <= 0) {
    /* sparse and other non-strided layouts are "not contiguous" (or raise): say what
     * they are instead */
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyObject *layout = attr(obj, T->s_layout, 0);
    int strided = !layout || layout == T->strided;
    Py_XDECREF(layout);
    PyErr_Clear();
    if (!strided) {
      Py_XDECREF(type);
      Py_XDECREF(value);
      Py_XDECREF(tb);
      PyErr_Format(mf_py_ValueError, "%s: sparse or other non-strided tensors are not "
                   "supported (pass the values of a sparse gradient)", NAME());
      return -1;
    }
    PyErr_Restore(type, value, tb);
    if (contig < 0) return -1;
  }
  if (!contig) {
    PyErr_Format(mf_py_ValueError, "%s: must be contiguous (row-major); call .contiguous() first",
                 NAME());
    return -1;
  }
  t->numel = int_of(obj, T->s_numel);
  if (t->numel == -1 && PyErr_Occurred()) return -1;
  PyObject *ptr = attr(obj, T->s_data_ptr, 1);
  if (!ptr) return -1;
  t->data = PyLong_AsVoidPtr(ptr);
  Py_DECREF(ptr);
  if (!t->data && PyErr_Occurred()) return -1;
  if (!t->data && t->numel > 0) {
    PyErr_Format(mf_py_ValueError, "%s: tensor has no data", NAME());
    return -1;
  }
  return 0;
#undef NAME
}

/* One array: the torch fast path, else the generic view. Release with
 * mf_py_view_release() either way (a fast-path view owns nothing). */
static int view_get(PyObject *obj, const char *name, int writable, uintptr_t stream,
                    mf_py_view *v) {
  memset(v, 0, sizeof *v);
  int rc = torch_view(obj, name, -1, &v->t);
  if (rc == 1) return mf_py_view_get(obj, name, writable, stream, v);
  return rc;
}

/* ---- lists of arrays ------------------------------------------------------------------- */

typedef struct {
  PyObject *seq;       /* a tuple of the arrays (holds a reference to each) */
  Py_ssize_t n;
  mf_tensor *t;        /* n views */
  mf_py_view *generic; /* n slots; generic[i].owner != NULL where the generic path was used */
} view_list;

static void view_list_release(view_list *l) {
  if (l->generic)
    for (Py_ssize_t i = 0; i < l->n; i++)
      if (l->generic[i].owner || l->generic[i].managed) mf_py_view_release(&l->generic[i]);
  PyMem_Free(l->generic);
  PyMem_Free(l->t);
  Py_CLEAR(l->seq);
  memset(l, 0, sizeof *l);
}

static int view_list_get(PyObject *obj, const char *name, int writable, uintptr_t stream,
                         view_list *l) {
  memset(l, 0, sizeof *l);
  /* only lists and tuples: an array is iterable too, and its rows are not gradients */
  if (!PyList_Check(obj) && !PyTuple_Check(obj)) {
    PyErr_Format(mf_py_TypeError, "%s: expected a list or tuple of arrays, got %s", name,
                 Py_TYPE(obj)->tp_name);
    return -1;
  }
  /* a tuple of our own: it keeps every array alive while the GIL is released, even if
   * another thread empties the caller's list meanwhile */
  l->seq = PyTuple_Check(obj) ? Py_NewRef(obj) : PyList_AsTuple(obj);
  if (!l->seq) return -1;
  l->n = PyTuple_GET_SIZE(l->seq);
  l->t = (mf_tensor *)PyMem_Calloc(l->n ? (size_t)l->n : 1, sizeof(mf_tensor));
  l->generic = (mf_py_view *)PyMem_Calloc(l->n ? (size_t)l->n : 1, sizeof(mf_py_view));
  if (!l->t || !l->generic) {
    PyErr_NoMemory();
    view_list_release(l);
    return -1;
  }
  PyObject **items = PySequence_Fast_ITEMS(l->seq); /* valid for tuples */
  for (Py_ssize_t i = 0; i < l->n; i++) {
    int rc = torch_view(items[i], name, i, &l->t[i]);
    if (rc == 1) {
      char item[96];
      mf_py_index_name(item, sizeof item, name, i);
      rc = mf_py_view_get(items[i], item, writable, stream, &l->generic[i]);
      if (rc == 0) l->t[i] = l->generic[i].t;
    }
    if (rc) {
      view_list_release(l);
      return -1;
    }
  }
  return 0;
}

/* ---- scaler ----------------------------------------------------------------------------- */

static PyObject *py_scaler_layout(PyObject *self, PyObject *noargs) {
  (void)self;
  (void)noargs;
  return Py_BuildValue(
      "{s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i}", "words",
      MF_SCALER_WORDS, "scale", MF_SW_SCALE, "growth_tracker", MF_SW_GROWTH_TRACKER,
      "consec_inf", MF_SW_CONSEC_INF, "updates", MF_SW_UPDATES, "skipped", MF_SW_SKIPPED,
      "backoffs", MF_SW_BACKOFFS, "growths", MF_SW_GROWTHS, "min_clamps", MF_SW_MIN_CLAMPS,
      "max_clamps", MF_SW_MAX_CLAMPS, "max_consec_inf", MF_SW_MAX_CONSEC_INF,
      "overflow_holds", MF_SW_OVERFLOW_HOLDS, "loss_nonfinite", MF_SW_LOSS_NONFINITE, "history", MF_SW_HISTORY, "history_len",
      MF_SCALER_HISTORY, "max_flags", MF_SCALER_MAX_FLAGS, "chunk", MF_MT_CHUNK);
}

/* scaler_state_init(state, init_scale, growth_tracker): state is a float32 CPU array
 * of `words` elements, filled as 32-bit words. */
static PyObject *py_scaler_state_init(PyObject *self, PyObject *args) {
  (void)self;
  PyObject *ostate;
  double init_scale;
  long long tracker;
  if (!PyArg_ParseTuple(args, "OdL", &ostate, &init_scale, &tracker)) return NULL;
  mf_py_view v;
  if (view_get(ostate, "state", 1, 0, &v)) return NULL;
  mf_status st;
  if (v.t.device != MF_CPU || v.t.dtype != MF_FLOAT32)
    st = mf_error(MF_ERR_TYPE, "state: expected a float32 CPU array");
  else
    st = mf_scaler_state_init((uint32_t *)v.t.data, v.t.numel, (float)init_scale, tracker);
  mf_py_view_release(&v);
  if (st) return mf_py_raise(st);
  Py_RETURN_NONE;
}

static int32_t clamp_i32(long long v) {
  return v > 0x7fffffffLL ? 0x7fffffff : v < 0 ? 0 : (int32_t)v;
}

/* The config tuple (growth_factor, backoff_factor, growth_interval, hysteresis,
 * min_scale, max_scale, loss_skip) shared by scaler_config_check and scaler_update. */
static int parse_config(PyObject *tuple, mf_scaler_config *c) {
  long long gi, hy;
  double gf, bf, mn, mx;
  int ls;
  if (!PyArg_ParseTuple(tuple, "ddLLddp", &gf, &bf, &gi, &hy, &mn, &mx, &ls)) return -1;
  c->growth_factor = (float)gf;
  c->backoff_factor = (float)bf;
  c->growth_interval = clamp_i32(gi);
  c->hysteresis = clamp_i32(hy);
  c->min_scale = (float)mn;
  c->max_scale = (float)mx;
  c->loss_skip = ls;
  return 0;
}

/* scaler_config_check(config) */
static PyObject *py_scaler_config_check(PyObject *self, PyObject *config) {
  (void)self;
  mf_scaler_config c;
  if (parse_config(config, &c)) return NULL;
  mf_status st = mf_scaler_config_check(&c);
  if (st) return mf_py_raise(st);
  Py_RETURN_NONE;
}

/* scaler_update(state, found_infs, loss_flag_or_None, config, stream) */
static PyObject *py_scaler_update(PyObject *self, PyObject *args) {
  (void)self;
  PyObject *ostate, *oflags, *oloss, *oconfig;
  mf_scaler_config c;
  unsigned long long stream;
  if (!PyArg_ParseTuple(args, "OOOO!K", &ostate, &oflags, &oloss, &PyTuple_Type, &oconfig,
                        &stream))
    return NULL;
  if (parse_config(oconfig, &c)) return NULL;
  PyObject *result = NULL;
  mf_py_view state, loss;
  view_list flags;
  int have = 0, has_loss = oloss != Py_None;
  if (view_get(ostate, "state", 1, (uintptr_t)stream, &state)) goto finish;
  have = 1;
  if (view_list_get(oflags, "found_inf", 0, (uintptr_t)stream, &flags)) goto finish;
  have = 2;
  if (has_loss && view_get(oloss, "loss_flag", 0, (uintptr_t)stream, &loss)) goto finish;
  have = 3;
  mf_status st;
  Py_BEGIN_ALLOW_THREADS
  st = mf_scaler_update(&state.t, flags.t, flags.n, has_loss ? &loss.t : NULL, &c,
                        (void *)(uintptr_t)stream);
  Py_END_ALLOW_THREADS
  if (st) {
    mf_py_raise(st);
    goto finish;
  }
  result = Py_NewRef(Py_None);
finish:
  if (have >= 3 && has_loss) mf_py_view_release(&loss);
  if (have >= 2) view_list_release(&flags);
  if (have >= 1) mf_py_view_release(&state);
  return result;
}

/* ---- fused gradient passes --------------------------------------------------------------- */

/* unscale_grads(grads, scale_or_None, found_inf, stream) */
static PyObject *py_unscale_grads(PyObject *self, PyObject *args) {
  (void)self;
  PyObject *ograds, *oscale, *ofound;
  unsigned long long stream;
  if (!PyArg_ParseTuple(args, "OOOK", &ograds, &oscale, &ofound, &stream)) return NULL;
  PyObject *result = NULL;
  view_list grads;
  mf_py_view found, scale;
  int have = 0, has_scale = oscale != Py_None;
  if (view_list_get(ograds, "grads", 1, (uintptr_t)stream, &grads)) goto finish;
  have = 1;
  if (view_get(ofound, "found_inf", 1, (uintptr_t)stream, &found)) goto finish;
  have = 2;
  if (has_scale && view_get(oscale, "scale", 0, (uintptr_t)stream, &scale)) goto finish;
  have = 3;
  mf_status st;
  Py_BEGIN_ALLOW_THREADS
  st = mf_unscale_grads(grads.t, grads.n, has_scale ? &scale.t : NULL, &found.t,
                        (void *)(uintptr_t)stream);
  Py_END_ALLOW_THREADS
  if (st) {
    mf_py_raise(st);
    goto finish;
  }
  result = Py_NewRef(Py_None);
finish:
  if (have >= 3 && has_scale) mf_py_view_release(&scale);
  if (have >= 2) mf_py_view_release(&found);
  if (have >= 1) view_list_release(&grads);
  return result;
}

/* grad_norm(grads, norm_type, workspace_or_None, out, stream) */
static PyObject *py_grad_norm(PyObject *self, PyObject *args) {
  (void)self;
  PyObject *ograds, *ows, *oout;
  double norm_type;
  unsigned long long stream;
  if (!PyArg_ParseTuple(args, "OdOOK", &ograds, &norm_type, &ows, &oout, &stream)) return NULL;
  PyObject *result = NULL;
  view_list grads;
  mf_py_view out, ws;
  int have = 0, has_ws = ows != Py_None;
  if (view_list_get(ograds, "grads", 0, (uintptr_t)stream, &grads)) goto finish;
  have = 1;
  if (view_get(oout, "out", 1, (uintptr_t)stream, &out)) goto finish;
  have = 2;
  if (has_ws && view_get(ows, "workspace", 1, (uintptr_t)stream, &ws)) goto finish;
  have = 3;
  mf_tensor none = {0};
  mf_status st;
  Py_BEGIN_ALLOW_THREADS
  st = mf_grad_norm(grads.t, grads.n, norm_type, has_ws ? &ws.t : &none, &out.t,
                    (void *)(uintptr_t)stream);
  Py_END_ALLOW_THREADS
  if (st) {
    mf_py_raise(st);
    goto finish;
  }
  result = Py_NewRef(Py_None);
finish:
  if (have >= 3 && has_ws) mf_py_view_release(&ws);
  if (have >= 2) mf_py_view_release(&out);
  if (have >= 1) view_list_release(&grads);
  return result;
}

/* clip_grads(grads, norm, max_norm, stream) */
static PyObject *py_clip_grads(PyObject *self, PyObject *args) {
  (void)self;
  PyObject *ograds, *onorm;
  double max_norm;
  unsigned long long stream;
  if (!PyArg_ParseTuple(args, "OOdK", &ograds, &onorm, &max_norm, &stream)) return NULL;
  PyObject *result = NULL;
  view_list grads;
  mf_py_view norm;
  int have = 0;
  if (view_list_get(ograds, "grads", 1, (uintptr_t)stream, &grads)) goto finish;
  have = 1;
  if (view_get(onorm, "norm", 0, (uintptr_t)stream, &norm)) goto finish;
  have = 2;
  mf_status st;
  Py_BEGIN_ALLOW_THREADS
  st = mf_clip_grads(grads.t, grads.n, &norm.t, (float)max_norm, (void *)(uintptr_t)stream);
  Py_END_ALLOW_THREADS
  if (st) {
    mf_py_raise(st);
    goto finish;
  }
  result = Py_NewRef(Py_None);
finish:
  if (have >= 2) mf_py_view_release(&norm);
  if (have >= 1) view_list_release(&grads);
  return result;
}

/* grad_norm_workspace_size(numels) -> chunks */
static PyObject *py_num_chunks(PyObject *self, PyObject *arg) {
  (void)self;
  PyObject *seq = PySequence_Fast(arg, "numels: expected a sequence of ints");
  if (!seq) return NULL;
  long long total = 0;
  for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); i++) {
    long long v = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(seq, i));
    if (v == -1 && PyErr_Occurred()) {
      Py_DECREF(seq);
      return NULL;
    }
    total += (v + MF_MT_CHUNK - 1) / MF_MT_CHUNK;
  }
  Py_DECREF(seq);
  return PyLong_FromLongLong(total);
}

PyMethodDef mf_amp_methods[] = {
    {"scaler_layout", py_scaler_layout, METH_NOARGS, "Word offsets of the scaler state block."},
    {"scaler_state_init", py_scaler_state_init, METH_VARARGS,
     "scaler_state_init(state, init_scale, growth_tracker)"},
    {"scaler_config_check", py_scaler_config_check, METH_O,
     "scaler_config_check((growth_factor, backoff_factor, growth_interval, hysteresis, "
     "min_scale, max_scale, loss_skip))"},
    {"scaler_update", py_scaler_update, METH_VARARGS,
     "scaler_update(state, found_infs, loss_flag_or_None, config, stream)"},
    {"unscale_grads", py_unscale_grads, METH_VARARGS,
     "unscale_grads(grads, scale_or_None, found_inf, stream)"},
    {"grad_norm", py_grad_norm, METH_VARARGS,
     "grad_norm(grads, norm_type, workspace_or_None, out, stream)"},
    {"clip_grads", py_clip_grads, METH_VARARGS, "clip_grads(grads, norm, max_norm, stream)"},
    {"mt_num_chunks", py_num_chunks, METH_O, "mt_num_chunks(numels): grad_norm workspace size"},
    {NULL, NULL, 0, NULL}};
