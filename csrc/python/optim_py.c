/* Bindings for the optimizer steps (mf_optim_step in csrc/core/optim_api.c, which checks
 * the arguments and runs csrc/core/optim.c or cuda/optim.cu). The Python layer
 * (memfit.optim) allocates the states in the caller's framework and passes them in;
 * this file only turns the lists of arrays into views and calls the core. */
#include <stddef.h>
#include <string.h>

#include "bindings.h"
#include "memfit/optim.h"

/* The list arguments of optim_step: one array (or None, where optional) per parameter. */
enum {
  L_PARAMS, L_GRADS, L_STATE1, L_ABSMAX1, L_STATE2, L_ABSMAX2, L_STEPS, L_COMPS, L_TRUST,
  L_STATE3, L_ABSMAX3, L_COUNT
};
static const char *const list_names[L_COUNT] = {"params", "grads", "state1", "absmax1", "state2",
                                                "absmax2", "steps", "comps", "trust",
                                                "state3", "absmax3"};
/* params, grads, the states and comps may be dense in any order (check_layouts) */
static const int list_flags[L_COUNT] = {
    MF_PY_WRITABLE | MF_PY_DENSE, MF_PY_READ | MF_PY_DENSE,
    MF_PY_WRITABLE | MF_PY_OPTIONAL | MF_PY_DENSE, MF_PY_WRITABLE | MF_PY_OPTIONAL,
    MF_PY_WRITABLE | MF_PY_OPTIONAL | MF_PY_DENSE, MF_PY_WRITABLE | MF_PY_OPTIONAL,
    MF_PY_WRITABLE, MF_PY_WRITABLE | MF_PY_OPTIONAL | MF_PY_DENSE,
    MF_PY_WRITABLE | MF_PY_OPTIONAL,
    MF_PY_WRITABLE | MF_PY_OPTIONAL | MF_PY_DENSE, MF_PY_WRITABLE | MF_PY_OPTIONAL};

/* Where a parameter's arrays are dense but not row-major (channels_last, a transposed
 * weight), the core treats each as flat storage: right only when every array that
 * holds one value per element (param, grad, comp, and states of the parameter's shape)
 * has the parameter's own strides. States and comps may also be 1-D (the functional
 * API's flat states): a flat array over the storage. Checked only where a view is
 * permuted. */
static int check_layouts(const mf_py_view_list *lists, Py_ssize_t i, int fmt) {
  static const int per_element[] = {L_GRADS, L_STATE1, L_STATE2, L_COMPS, L_STATE3};
  const mf_py_view *p = &lists[L_PARAMS].v[i];
  int permuted = p->permuted;
  for (size_t k = 0; k < sizeof per_element / sizeof *per_element; k++)
    permuted |= lists[per_element[k]].v[i].permuted;
  if (!permuted) return 0;
  for (size_t k = 0; k < sizeof per_element / sizeof *per_element; k++) {
    const int l = per_element[k];
    const mf_py_view *x = &lists[l].v[i];
    if (!x->owner || ((l == L_STATE1 || l == L_STATE2 || l == L_STATE3) && fmt == MF_STATE_4BIT))
      continue;
    if (l != L_GRADS && !x->permuted) {
      const int nd = mf_py_torch_ndim(x->owner);
      if (nd < 0) return -1;
      if (nd == 1) continue;
    }
    const int same = mf_py_same_layout(p->owner, x->owner);
    if (same < 0) return -1;
    if (same) continue;
    char pn[32], xn[32];
    mf_py_index_name(pn, sizeof pn, "params", i);
    mf_py_index_name(xn, sizeof xn, list_names[l], i);
    if (l == L_GRADS)
      PyErr_Format(mf_py_ValueError,
                   "%s: must be contiguous (row-major), or dense with a gradient of the same "
                   "strides, but %s has other strides; make the gradient match the parameter's "
                   "memory format (e.g. p.grad = p.grad.contiguous(memory_format=torch."
                   "channels_last)) or call .contiguous() on the parameter",
                   pn, xn);
    else
      PyErr_Format(mf_py_ValueError,
                   "%s: its strides differ from %s's: the states of a dense parameter that is "
                   "not row-major follow its memory layout (make it with torch.zeros_like(p))",
                   xn, pn);
    return -1;
  }
  return 0;
}

/* An optional list of n integers (None: all 0) into field `off` of every tensor. */
static int int_list(PyObject *obj, const char *name, Py_ssize_t n, mf_optim_tensor *ts,
                    size_t off) {
  if (obj == Py_None) return 0;
  PyObject *seq = PySequence_Fast(obj, name);
  if (!seq) return -1;
  int rc = 0;
  if (PySequence_Fast_GET_SIZE(seq) != n) {
    PyErr_Format(mf_py_ValueError, "%s: expected %zd entries (one per parameter), got %zd", name,
                 n, PySequence_Fast_GET_SIZE(seq));
    rc = -1;
  }
  for (Py_ssize_t i = 0; rc == 0 && i < n; i++) {
    const long long v = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(seq, i));
    if (v == -1 && PyErr_Occurred()) {
      PyErr_Format(mf_py_TypeError, "%s[%zd]: expected an int", name, i);
      rc = -1;
    } else {
      *(int64_t *)((char *)&ts[i] + off) = (int64_t)v;
    }
  }
  Py_DECREF(seq);
  return rc;
}

static PyObject *step_call(const mf_optim_hparams *h, int bits, long long block_size,
                           PyObject *const *objs, PyObject *ocode1, PyObject *ocode2,
                           PyObject *oscale, PyObject *oinf, uintptr_t s, PyObject *orows,
                           PyObject *obase) {
  mf_py_view_list lists[L_COUNT] = {{0}};
  mf_py_view code1 = {0}, code2 = {0}, scale = {0}, inf = {0};
  mf_optim_tensor *ts = NULL;
  mf_status st = MF_OK;
  const Py_ssize_t n = PySequence_Size(objs[L_PARAMS]);
  if (n < 0) goto finish;
  for (int l = 0; l < L_COUNT; l++)
    if (mf_py_view_list_get(objs[l], list_names[l], n, list_flags[l], s, &lists[l])) goto finish;
  if (mf_py_view_get(ocode1, "code1", -1, MF_PY_OPTIONAL, s, &code1) ||
      mf_py_view_get(ocode2, "code2", -1, MF_PY_OPTIONAL, s, &code2) ||
      mf_py_view_get(oscale, "grad_scale", -1, MF_PY_OPTIONAL, s, &scale) ||
      mf_py_view_get(oinf, "found_inf", -1, MF_PY_OPTIONAL, s, &inf))
    goto finish;
  if (!(ts = PyMem_Calloc(n > 0 ? (size_t)n : 1, sizeof(mf_optim_tensor)))) {
    PyErr_NoMemory();
    goto finish;
  }
  for (Py_ssize_t i = 0; i < n; i++) {
    if (check_layouts(lists, i, bits)) goto finish;
    ts[i].param = lists[L_PARAMS].t[i];
    ts[i].grad = lists[L_GRADS].t[i];
    ts[i].state1 = lists[L_STATE1].t[i]; /* absent views are all zero: data NULL, numel 0 */
    ts[i].absmax1 = lists[L_ABSMAX1].t[i];
    ts[i].state2 = lists[L_STATE2].t[i];
    ts[i].absmax2 = lists[L_ABSMAX2].t[i];
    ts[i].state3 = lists[L_STATE3].t[i];
    ts[i].absmax3 = lists[L_ABSMAX3].t[i];
    ts[i].step = lists[L_STEPS].t[i];
    ts[i].comp = lists[L_COMPS].t[i];
    ts[i].trust = lists[L_TRUST].t[i];
    ts[i].sr_stream = (int32_t)i;
  }
  if (int_list(orows, "rows", n, ts, offsetof(mf_optim_tensor, rows)) ||
      int_list(obase, "index_base", n, ts, offsetof(mf_optim_tensor, index_base)))
    goto finish;
  Py_BEGIN_ALLOW_THREADS
  st = mf_optim_step(h, (mf_state_format)bits, (int64_t)block_size, mf_py_tensor_or_null(&code1),
                     mf_py_tensor_or_null(&code2), ts, (int64_t)n, mf_py_tensor_or_null(&scale),
                     mf_py_tensor_or_null(&inf), (void *)s);
  Py_END_ALLOW_THREADS
finish:
  PyMem_Free(ts);
  mf_py_view_release(&inf);
  mf_py_view_release(&scale);
  mf_py_view_release(&code2);
  mf_py_view_release(&code1);
  for (int l = L_COUNT - 1; l >= 0; l--) mf_py_view_list_release(&lists[l]);
  return mf_py_result(st);
}

/* Hyperparameters by name: a dict with any of the keys below (absent ones are 0 or
 * False); sr_seed != 0 turns on stochastic rounding of half-precision parameters. */
static int parse_hparams(int kind, PyObject *dict, mf_optim_hparams *h) {
  static char *kw[] = {"lr", "beta1", "beta2", "eps", "weight_decay", "momentum", "dampening",
                       "alpha", "nesterov", "maximize", "sr_seed", "lr_decay", "max_unorm",
                       "no_bias_correction", "beta3", "t_alpha", "t_beta3", NULL};
  static PyObject *no_args;
  if (!no_args && !(no_args = PyTuple_New(0))) return -1;
  if (!PyDict_Check(dict)) {
    PyErr_Format(mf_py_TypeError, "hparams: expected a dict of hyperparameters by name, got %s",
                 Py_TYPE(dict)->tp_name);
    return -1;
  }
  int nesterov = 0, maximize = 0, no_bias_correction = 0;
  unsigned long long sr_seed = 0;
  memset(h, 0, sizeof *h);
  if (!PyArg_ParseTupleAndKeywords(no_args, dict, "|ddddddddppKddpddd:hparams", kw, &h->lr,
                                   &h->beta1, &h->beta2, &h->eps, &h->weight_decay, &h->momentum,
                                   &h->dampening, &h->alpha, &nesterov, &maximize, &sr_seed,
                                   &h->lr_decay, &h->max_unorm, &no_bias_correction, &h->beta3,
                                   &h->t_alpha, &h->t_beta3))
    return -1;
  h->no_bias_correction = no_bias_correction;
  h->kind = (mf_optim_kind)kind;
  h->nesterov = nesterov;
  h->maximize = maximize;
  h->stochastic_round = sr_seed != 0;
  h->sr_seed = sr_seed;
  return 0;
}

/* optim_step(kind, bits, block_size, hparams, params, grads, state1, absmax1, state2,
 *            absmax2, steps, code1=None, code2=None, grad_scale=None, found_inf=None,
 *            stream=0, comps=None, rows=None, index_base=None, trust=None), any argument
 *            by name.
 * hparams: a dict (parse_hparams). Lists have one entry per parameter; state and absmax
 * entries may be None (states this optimizer does not keep). comps: None, or a list of
 * Kahan compensation buffers (None for a parameter without one; see optim.h). rows,
 * index_base: None (all whole tensors), or one int per parameter (mf_optim_tensor).
 * trust: None, or per parameter the trust ratio's scratch (mf_optim_tensor.trust; needed
 * with hparams max_unorm > 0).
 * state3, absmax3: None, or the third state's lists (AdEMAMix). */
static PyObject *py_optim_step(PyObject *self, PyObject *args, PyObject *kwargs) {
  (void)self;
  static char *kw[] = {"kind", "bits", "block_size", "hparams", "params", "grads", "state1",
                       "absmax1", "state2", "absmax2", "steps", "code1", "code2", "grad_scale",
                       "found_inf", "stream", "comps", "rows", "index_base", "trust", "state3",
                       "absmax3", NULL};
  int kind, bits;
  long long block_size;
  mf_optim_hparams h;
  PyObject *ohp, *lists[L_COUNT], *ocode1 = Py_None, *ocode2 = Py_None, *oscale = Py_None,
                                  *oinf = Py_None;
  PyObject *orows = Py_None, *obase = Py_None;
  unsigned long long stream = 0;
  lists[L_COMPS] = lists[L_TRUST] = lists[L_STATE3] = lists[L_ABSMAX3] = Py_None;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "iiLOOOOOOOO|OOOOKOOOOOO:optim_step", kw, &kind,
                                   &bits, &block_size, &ohp, &lists[L_PARAMS], &lists[L_GRADS],
                                   &lists[L_STATE1], &lists[L_ABSMAX1], &lists[L_STATE2],
                                   &lists[L_ABSMAX2], &lists[L_STEPS], &ocode1, &ocode2, &oscale,
                                   &oinf, &stream, &lists[L_COMPS], &orows, &obase,
                                   &lists[L_TRUST], &lists[L_STATE3], &lists[L_ABSMAX3]))
    return NULL;
  if (parse_hparams(kind, ohp, &h)) return NULL;
  return step_call(&h, bits, block_size, lists, ocode1, ocode2, oscale, oinf, (uintptr_t)stream,
                   orows, obase);
}

/* optim_check(kind, hparams): raises for out-of-range hyperparameters (the optimizer
 * constructors call it so a bad lr fails at construction, as in torch). */
static PyObject *py_optim_check(PyObject *self, PyObject *args) {
  (void)self;
  int kind;
  PyObject *ohp;
  mf_optim_hparams h;
  if (!PyArg_ParseTuple(args, "iO:optim_check", &kind, &ohp) || parse_hparams(kind, ohp, &h))
    return NULL;
  mf_status st = mf_optim_check_hparams(&h);
  if (st) return mf_py_raise(st);
  Py_RETURN_NONE;
}

/* optim_state_layout(kind, bits, block_size, numel, momentum=0.0, rows=1) -> dict: the
 * states a parameter of numel elements in `rows` rows needs (mf_optim_state_layout,
 * the definition the step checks): num_states, signed (per state), state_dtype
 * ("float32" or "uint8"), rows, state_row_numel, blocks_per_row, state_numel and
 * absmax_numel (per state). */
static PyObject *py_optim_state_layout(PyObject *self, PyObject *args, PyObject *kwargs) {
  (void)self;
  static char *kw[] = {"kind", "bits", "block_size", "numel", "momentum", "rows", NULL};
  int kind, bits;
  long long block_size, numel, rows = 1;
  mf_optim_hparams h = {0};
  mf_optim_layout l;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "iiLL|dL:optim_state_layout", kw, &kind, &bits,
                                   &block_size, &numel, &h.momentum, &rows))
    return NULL;
  h.kind = (mf_optim_kind)kind;
  mf_status st = mf_optim_state_layout(&h, (mf_state_format)bits, (int64_t)block_size,
                                       (int64_t)numel, (int64_t)rows, &l);
  if (st) return mf_py_raise(st);
  return Py_BuildValue("{s:i,s:(OOO),s:s,s:L,s:L,s:L,s:L,s:L}", "num_states", l.num_states,
                       "signed", l.is_signed[0] ? Py_True : Py_False,
                       l.is_signed[1] ? Py_True : Py_False, l.is_signed[2] ? Py_True : Py_False,
                       "state_dtype",
                       mf_dtype_name(l.state_dtype), "rows", (long long)l.rows, "state_row_numel",
                       (long long)l.state_row_numel, "blocks_per_row", (long long)l.blocks_per_row,
                       "state_numel", (long long)l.state_numel, "absmax_numel",
                       (long long)l.absmax_numel);
}

/* optim_constants() -> dict: the kind numbers (mf_optim_kind, by torch's class names
 * without "8bit"), the state formats and the default block size of each format. */
static PyObject *py_optim_constants(PyObject *self, PyObject *noargs) {
  (void)self;
  (void)noargs;
  return Py_BuildValue("{s:{s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i},s:(iii),s:{i:i,i:i,i:i}}", "kinds",
                       "AdamW", MF_OPT_ADAMW, "Adam", MF_OPT_ADAM, "Lion", MF_OPT_LION, "SGD",
                       MF_OPT_SGD, "RMSprop", MF_OPT_RMSPROP, "Muon", MF_OPT_MUON, "Adagrad",
                       MF_OPT_ADAGRAD, "AdEMAMix", MF_OPT_ADEMAMIX, "formats",
                       MF_STATE_8BIT, MF_STATE_4BIT, MF_STATE_FP32, "default_block_size", MF_STATE_8BIT, MF_OPTIM_BLOCK_8BIT,
                       MF_STATE_4BIT, MF_OPTIM_BLOCK_4BIT, MF_STATE_FP32, MF_OPTIM_BLOCK_8BIT);
}

PyMethodDef mf_optim_methods[] = {
    {"optim_step", (PyCFunction)(void (*)(void))py_optim_step, METH_VARARGS | METH_KEYWORDS,
     "optim_step(kind, bits, block_size, hparams, params, grads, state1, absmax1, state2, "
     "absmax2, steps, code1=None, code2=None, grad_scale=None, found_inf=None, stream=0, "
     "comps=None, rows=None, index_base=None, trust=None, state3=None, absmax3=None)"},
    {"optim_check", py_optim_check, METH_VARARGS, "optim_check(kind, hparams)"},
    {"optim_state_layout", (PyCFunction)(void (*)(void))py_optim_state_layout,
     METH_VARARGS | METH_KEYWORDS, "optim_state_layout(kind, bits, block_size, numel, momentum=0.0, rows=1)"},
    {"optim_constants", py_optim_constants, METH_NOARGS,
     "Kind numbers, state formats and default block sizes."},
    {NULL, NULL, 0, NULL}};
