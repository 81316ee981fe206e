/* Bindings for the optimizer steps (csrc/core/optim.c, cuda/optim.cu). The Python
 * layer (memfit.optim) allocates the states in the caller's framework and passes
 * them in; this file only turns the lists of arrays into views and calls the core. */
#include "bindings.h"
#include "memfit/optim.h"

/* Items of a list argument (a list/tuple of n arrays; or None, when optional, for
 * "no arrays"), appended to objs/names/flags for mf_py_views_get. Borrowed references:
 * `fast` keeps the items alive. */
static int add_list(PyObject *seq, const char *what, Py_ssize_t n, int flags, PyObject **fast,
                    PyObject **objs, char (*names)[32], int *fl, Py_ssize_t *k) {
  *fast = NULL;
  if (seq == Py_None && (flags & MF_PY_OPTIONAL)) {
    for (Py_ssize_t i = 0; i < n; i++) {
      objs[*k] = Py_None;
      mf_py_index_name(names[*k], 32, what, i);
      fl[(*k)++] = flags;
    }
    return 0;
  }
  *fast = PySequence_Fast(seq, "expected a list of arrays");
  if (!*fast) return -1;
  if (PySequence_Fast_GET_SIZE(*fast) != n) {
    PyErr_Format(mf_py_ValueError, "%s: expected %zd arrays (one per parameter), got %zd", what,
                 n, PySequence_Fast_GET_SIZE(*fast));
    return -1;
  }
  for (Py_ssize_t i = 0; i < n; i++) {
    objs[*k] = PySequence_Fast_GET_ITEM(*fast, i);
    mf_py_index_name(names[*k], 32, what, i);
    fl[(*k)++] = flags;
  }
  return 0;
}

/* optim_step(kind, bits, block_size, hparams, code1, code2, params, grads, state1, absmax1,
 *            state2, absmax2, steps, grad_scale, found_inf, stream[, comps])
 * hparams = (lr, beta1, beta2, eps, weight_decay, momentum, dampening, alpha, nesterov,
 *            maximize, sr_seed): sr_seed != 0 turns on stochastic rounding of half-precision
 *            parameters. Lists have one entry per parameter; state and absmax entries may
 * be None (states this optimizer does not keep). comps: None, or a list of Kahan
 * compensation buffers (None for a parameter without one; see optim.h). */
static PyObject *py_optim_step(PyObject *self, PyObject *args) {
  (void)self;
  int kind, bits, nesterov, maximize;
  long long block_size;
  unsigned long long sr_seed;
  mf_optim_hparams h = {0};
  PyObject *lists[8], *ocode1, *ocode2, *oscale, *oinf;
  unsigned long long stream;
  lists[7] = Py_None; /* comps */
  if (!PyArg_ParseTuple(args, "iiL(ddddddddppK)OOOOOOOOOOOK|O", &kind, &bits, &block_size, &h.lr,
                        &h.beta1, &h.beta2, &h.eps, &h.weight_decay, &h.momentum, &h.dampening,
                        &h.alpha, &nesterov, &maximize, &sr_seed, &ocode1, &ocode2, &lists[0],
                        &lists[1], &lists[2], &lists[3], &lists[4], &lists[5], &lists[6], &oscale,
                        &oinf, &stream, &lists[7]))
    return NULL;
  h.kind = (mf_optim_kind)kind;
  h.nesterov = nesterov;
  h.maximize = maximize;
  /* the seed is 0 when stochastic rounding is off (hparams' last field) */
  h.stochastic_round = sr_seed != 0;
  h.sr_seed = sr_seed;
  const uintptr_t s = (uintptr_t)stream;
  const Py_ssize_t n = PySequence_Size(lists[0]);
  if (n < 0) return NULL;

  static const char *const list_names[8] = {"params", "grads", "state1", "absmax1",
                                            "state2", "absmax2", "steps", "comps"};
  static const int list_flags[8] = {MF_PY_WRITABLE, MF_PY_READ,
                                    MF_PY_WRITABLE | MF_PY_OPTIONAL, MF_PY_WRITABLE | MF_PY_OPTIONAL,
                                    MF_PY_WRITABLE | MF_PY_OPTIONAL, MF_PY_WRITABLE | MF_PY_OPTIONAL,
                                    MF_PY_WRITABLE, MF_PY_WRITABLE | MF_PY_OPTIONAL};
  const Py_ssize_t total = 8 * n + 4; /* + code1, code2, grad_scale, found_inf */
  PyObject *result = NULL, *fast[8] = {NULL};
  PyObject **objs = PyMem_Calloc((size_t)total, sizeof(PyObject *));
  char (*names)[32] = PyMem_Calloc((size_t)total, 32);
  const char **name_ptrs = PyMem_Calloc((size_t)total, sizeof(char *));
  int *flags = PyMem_Calloc((size_t)total, sizeof(int));
  mf_py_view *v = PyMem_Calloc((size_t)total, sizeof(mf_py_view));
  mf_optim_tensor *ts = PyMem_Calloc(n > 0 ? (size_t)n : 1, sizeof(mf_optim_tensor));
  int have_views = 0;
  if (!objs || !names || !name_ptrs || !flags || !v || !ts) {
    PyErr_NoMemory();
    goto finish;
  }
  Py_ssize_t k = 0;
  for (int l = 0; l < 8; l++)
    if (add_list(lists[l], list_names[l], n, list_flags[l], &fast[l], objs, names, flags, &k))
      goto finish;
  PyObject *extra[4] = {ocode1, ocode2, oscale, oinf};
  static const char *const extra_names[4] = {"code1", "code2", "grad_scale", "found_inf"};
  for (int e = 0; e < 4; e++) {
    objs[k] = extra[e];
    snprintf(names[k], 32, "%s", extra_names[e]);
    flags[k++] = MF_PY_READ | MF_PY_OPTIONAL;
  }
  for (Py_ssize_t i = 0; i < total; i++) name_ptrs[i] = names[i];
  if (mf_py_views_get((int)total, objs, name_ptrs, flags, s, v)) goto finish;
  have_views = 1;
  for (Py_ssize_t i = 0; i < n; i++) {
    ts[i].param = v[0 * n + i].t;
    ts[i].grad = v[1 * n + i].t;
    ts[i].state1 = v[2 * n + i].t; /* absent views are all zero: data NULL, numel 0 */
    ts[i].absmax1 = v[3 * n + i].t;
    ts[i].state2 = v[4 * n + i].t;
    ts[i].absmax2 = v[5 * n + i].t;
    ts[i].step = v[6 * n + i].t;
    ts[i].comp = v[7 * n + i].t;
    ts[i].sr_stream = (int32_t)i;
  }
  mf_py_view *x = &v[8 * n];
  mf_status st;
  Py_BEGIN_ALLOW_THREADS
  st = mf_optim_step(&h, (mf_state_format)bits, (int64_t)block_size, mf_py_tensor_or_null(&x[0]),
                     mf_py_tensor_or_null(&x[1]), ts, (int64_t)n, mf_py_tensor_or_null(&x[2]),
                     mf_py_tensor_or_null(&x[3]), (void *)s);
  Py_END_ALLOW_THREADS
  if (st) {
    mf_py_raise(st);
    goto finish;
  }
  result = Py_NewRef(Py_None);
finish:
  if (have_views) mf_py_views_release((int)total, v);
  for (int l = 0; l < 8; l++) Py_XDECREF(fast[l]);
  PyMem_Free(ts);
  PyMem_Free(v);
  PyMem_Free(flags);
  PyMem_Free(name_ptrs);
  PyMem_Free(names);
  PyMem_Free(objs);
  return result;
}

/* optim_check(kind, hparams): raises for out-of-range hyperparameters (the optimizer
 * constructors call it so a bad lr fails at construction, as in torch). */
static PyObject *py_optim_check(PyObject *self, PyObject *args) {
  (void)self;
  int kind, nesterov, maximize;
  unsigned long long sr_seed;
  mf_optim_hparams h = {0};
  if (!PyArg_ParseTuple(args, "i(ddddddddppK)", &kind, &h.lr, &h.beta1, &h.beta2, &h.eps,
                        &h.weight_decay, &h.momentum, &h.dampening, &h.alpha, &nesterov,
                        &maximize, &sr_seed))
    return NULL;
  h.kind = (mf_optim_kind)kind;
  h.nesterov = nesterov;
  h.maximize = maximize;
  mf_status st = mf_optim_check_hparams(&h);
  if (st) return mf_py_raise(st);
  Py_RETURN_NONE;
}

PyMethodDef mf_optim_methods[] = {
    {"optim_step", py_optim_step, METH_VARARGS,
     "optim_step(kind, bits, block_size, hparams, code1, code2, params, grads, state1, "
     "absmax1, state2, absmax2, steps, grad_scale, found_inf, stream[, comps])"},
    {"optim_check", py_optim_check, METH_VARARGS, "optim_check(kind, hparams)"},
    {NULL, NULL, 0, NULL}};
