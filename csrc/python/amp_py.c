/*
 * Bindings for the gradient scaler and the fused gradient passes (csrc/core/scaler.c,
 * csrc/core/unscale.c, cuda/scaler.cu, cuda/unscale.cu).
 *
 * Arrays, and lists of gradients (hundreds per step), become views through views.c's
 * one view path: torch tensors on the CPU or a CUDA device through their attributes,
 * other arrays through NumPy's array interface or DLPack.
 */
#include "bindings.h"
#include "memfit/scaler.h"

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
  mf_py_view v = {0};
  mf_status st = MF_OK;
  if (mf_py_view_get(ostate, "state", -1, MF_PY_WRITABLE, 0, &v)) goto finish;
  if (v.t.device != MF_CPU || v.t.dtype != MF_FLOAT32)
    st = mf_error(MF_ERR_TYPE, "state: expected a float32 CPU array");
  else
    st = mf_scaler_state_init((uint32_t *)v.t.data, v.t.numel, (float)init_scale, tracker);
finish:
  mf_py_view_release(&v);
  return mf_py_result(st);
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
  const uintptr_t s = (uintptr_t)stream;
  mf_py_view state = {0}, loss = {0};
  mf_py_view_list flags = {0};
  mf_status st = MF_OK;
  if (mf_py_view_get(ostate, "state", -1, MF_PY_WRITABLE, s, &state) ||
      mf_py_view_list_get(oflags, "found_inf", -1, MF_PY_READ, s, &flags) ||
      mf_py_view_get(oloss, "loss_flag", -1, MF_PY_OPTIONAL, s, &loss))
    goto finish;
  Py_BEGIN_ALLOW_THREADS
  st = mf_scaler_update(&state.t, flags.t, flags.n, mf_py_tensor_or_null(&loss), &c, (void *)s);
  Py_END_ALLOW_THREADS
finish:
  mf_py_view_release(&loss);
  mf_py_view_list_release(&flags);
  mf_py_view_release(&state);
  return mf_py_result(st);
}

/* ---- fused gradient passes --------------------------------------------------------------- */

/* unscale_grads(grads, scale_or_None, found_inf, stream) */
static PyObject *py_unscale_grads(PyObject *self, PyObject *args) {
  (void)self;
  PyObject *ograds, *oscale, *ofound;
  unsigned long long stream;
  if (!PyArg_ParseTuple(args, "OOOK", &ograds, &oscale, &ofound, &stream)) return NULL;
  const uintptr_t s = (uintptr_t)stream;
  mf_py_view_list grads = {0};
  mf_py_view found = {0}, scale = {0};
  mf_status st = MF_OK;
  if (mf_py_view_list_get(ograds, "grads", -1, MF_PY_WRITABLE, s, &grads) ||
      mf_py_view_get(ofound, "found_inf", -1, MF_PY_WRITABLE, s, &found) ||
      mf_py_view_get(oscale, "scale", -1, MF_PY_OPTIONAL, s, &scale))
    goto finish;
  Py_BEGIN_ALLOW_THREADS
  st = mf_unscale_grads(grads.t, grads.n, mf_py_tensor_or_null(&scale), &found.t, (void *)s);
  Py_END_ALLOW_THREADS
finish:
  mf_py_view_release(&scale);
  mf_py_view_release(&found);
  mf_py_view_list_release(&grads);
  return mf_py_result(st);
}

/* grad_norm(grads, norm_type, workspace_or_None, out, stream) */
static PyObject *py_grad_norm(PyObject *self, PyObject *args) {
  (void)self;
  PyObject *ograds, *ows, *oout;
  double norm_type;
  unsigned long long stream;
  if (!PyArg_ParseTuple(args, "OdOOK", &ograds, &norm_type, &ows, &oout, &stream)) return NULL;
  const uintptr_t s = (uintptr_t)stream;
  mf_py_view_list grads = {0};
  mf_py_view out = {0}, ws = {0}; /* no workspace: ws stays a zero tensor */
  mf_status st = MF_OK;
  if (mf_py_view_list_get(ograds, "grads", -1, MF_PY_READ, s, &grads) ||
      mf_py_view_get(oout, "out", -1, MF_PY_WRITABLE, s, &out) ||
      mf_py_view_get(ows, "workspace", -1, MF_PY_WRITABLE | MF_PY_OPTIONAL, s, &ws))
    goto finish;
  Py_BEGIN_ALLOW_THREADS
  st = mf_grad_norm(grads.t, grads.n, norm_type, &ws.t, &out.t, (void *)s);
  Py_END_ALLOW_THREADS
finish:
  mf_py_view_release(&ws);
  mf_py_view_release(&out);
  mf_py_view_list_release(&grads);
  return mf_py_result(st);
}

/* clip_grads(grads, norm, max_norm, stream) */
static PyObject *py_clip_grads(PyObject *self, PyObject *args) {
  (void)self;
  PyObject *ograds, *onorm;
  double max_norm;
  unsigned long long stream;
  if (!PyArg_ParseTuple(args, "OOdK", &ograds, &onorm, &max_norm, &stream)) return NULL;
  const uintptr_t s = (uintptr_t)stream;
  mf_py_view_list grads = {0};
  mf_py_view norm = {0};
  mf_status st = MF_OK;
  if (mf_py_view_list_get(ograds, "grads", -1, MF_PY_WRITABLE, s, &grads) ||
      mf_py_view_get(onorm, "norm", -1, MF_PY_READ, s, &norm))
    goto finish;
  Py_BEGIN_ALLOW_THREADS
  st = mf_clip_grads(grads.t, grads.n, &norm.t, (float)max_norm, (void *)s);
  Py_END_ALLOW_THREADS
finish:
  mf_py_view_release(&norm);
  mf_py_view_list_release(&grads);
  return mf_py_result(st);
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
