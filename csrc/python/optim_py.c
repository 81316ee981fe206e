/* Bindings for the optimizer steps (csrc/core/optim.c, cuda/optim.cu). The Python
 * layer (memfit.optim) allocates the states in the caller's framework and passes
 * them in; this file only turns the lists of arrays into views and calls the core. */
#include "bindings.h"
#include "memfit/optim.h"

/* Views of one list argument: PyMem-allocated, released together. */
typedef struct {
  mf_py_view *v;
  char *got;
  Py_ssize_t n;
} view_list;

static void view_list_release(view_list *l) {
  if (l->v) {
    for (Py_ssize_t i = 0; i < l->n; i++)
      if (l->got[i]) mf_py_view_release(&l->v[i]);
  }
  PyMem_Free(l->v);
  PyMem_Free(l->got);
  l->v = NULL;
  l->got = NULL;
}

/* seq: a list/tuple of n arrays (entries may be None when allow_none), or None
 * (allow_none: no arrays at all). */
static int view_list_get(PyObject *seq, const char *name, Py_ssize_t n, int writable,
                         int allow_none, uintptr_t stream, view_list *l) {
  l->n = n;
  l->v = (mf_py_view *)PyMem_Calloc(n > 0 ? (size_t)n : 1, sizeof(mf_py_view));
  l->got = (char *)PyMem_Calloc(n > 0 ? (size_t)n : 1, 1);
  if (!l->v || !l->got) {
    PyErr_NoMemory();
    return -1;
  }
  if (seq == Py_None && allow_none) return 0;
  PyObject *fast = PySequence_Fast(seq, "expected a list of arrays");
  if (!fast) return -1;
  int rc = -1;
  if (PySequence_Fast_GET_SIZE(fast) != n) {
    PyErr_Format(mf_py_ValueError, "%s: expected %zd arrays (one per parameter), got %zd", name,
                 n, PySequence_Fast_GET_SIZE(fast));
    goto finish;
  }
  for (Py_ssize_t i = 0; i < n; i++) {
    PyObject *o = PySequence_Fast_GET_ITEM(fast, i);
    if (o == Py_None && allow_none) continue;
    char item[64];
    snprintf(item, sizeof item, "%s[%zd]", name, i);
    if (mf_py_view_get(o, item, writable, stream, &l->v[i])) goto finish;
    l->got[i] = 1;
  }
  rc = 0;
finish:
  Py_DECREF(fast);
  return rc;
}

static const mf_tensor *view_or_null(view_list *l, Py_ssize_t i) {
  return l->got[i] ? &l->v[i].t : NULL;
}

/* optim_step(kind, bits, block_size, hparams, code1, code2, params, grads, state1, absmax1,
 *            state2, absmax2, steps, grad_scale, found_inf, stream)
 * hparams = (lr, beta1, beta2, eps, weight_decay, momentum, dampening, alpha, nesterov,
 *            maximize). */
static PyObject *py_optim_step(PyObject *self, PyObject *args) {
  (void)self;
  int kind, bits, nesterov, maximize;
  long long block_size;
  mf_optim_hparams h;
  PyObject *ocode1, *ocode2, *oparams, *ograds, *os1, *oa1, *os2, *oa2, *osteps, *oscale, *oinf;
  unsigned long long stream;
  if (!PyArg_ParseTuple(args, "iiL(ddddddddpp)OOOOOOOOOOOK", &kind, &bits, &block_size, &h.lr,
                        &h.beta1, &h.beta2, &h.eps, &h.weight_decay, &h.momentum, &h.dampening,
                        &h.alpha, &nesterov, &maximize, &ocode1, &ocode2, &oparams, &ograds, &os1,
                        &oa1, &os2, &oa2, &osteps, &oscale, &oinf, &stream))
    return NULL;
  h.kind = (mf_optim_kind)kind;
  h.nesterov = nesterov;
  h.maximize = maximize;
  const uintptr_t s = (uintptr_t)stream;

  PyObject *result = NULL;
  Py_ssize_t n = PySequence_Size(oparams);
  if (n < 0) return NULL;
  view_list L[7] = {{0}};
  mf_py_view code1, code2, scale, inf;
  int have_code1 = 0, have_code2 = 0, have_scale = 0, have_inf = 0;
  mf_optim_tensor *ts = NULL;

  if (view_list_get(oparams, "params", n, 1, 0, s, &L[0])) goto finish;
  if (view_list_get(ograds, "grads", n, 0, 0, s, &L[1])) goto finish;
  if (view_list_get(os1, "state1", n, 1, 1, s, &L[2])) goto finish;
  if (view_list_get(oa1, "absmax1", n, 1, 1, s, &L[3])) goto finish;
  if (view_list_get(os2, "state2", n, 1, 1, s, &L[4])) goto finish;
  if (view_list_get(oa2, "absmax2", n, 1, 1, s, &L[5])) goto finish;
  if (view_list_get(osteps, "steps", n, 1, 0, s, &L[6])) goto finish;
  if (ocode1 != Py_None) {
    if (mf_py_view_get(ocode1, "code1", 0, s, &code1)) goto finish;
    have_code1 = 1;
  }
  if (ocode2 != Py_None) {
    if (mf_py_view_get(ocode2, "code2", 0, s, &code2)) goto finish;
    have_code2 = 1;
  }
  if (oscale != Py_None) {
    if (mf_py_view_get(oscale, "grad_scale", 0, s, &scale)) goto finish;
    have_scale = 1;
  }
  if (oinf != Py_None) {
    if (mf_py_view_get(oinf, "found_inf", 0, s, &inf)) goto finish;
    have_inf = 1;
  }
  ts = (mf_optim_tensor *)PyMem_Calloc(n > 0 ? (size_t)n : 1, sizeof(mf_optim_tensor));
  if (!ts) {
    PyErr_NoMemory();
    goto finish;
  }
  for (Py_ssize_t i = 0; i < n; i++) {
    const mf_tensor *x;
    ts[i].param = L[0].v[i].t;
    ts[i].grad = L[1].v[i].t;
    if ((x = view_or_null(&L[2], i))) ts[i].state1 = *x;
    if ((x = view_or_null(&L[3], i))) ts[i].absmax1 = *x;
    if ((x = view_or_null(&L[4], i))) ts[i].state2 = *x;
    if ((x = view_or_null(&L[5], i))) ts[i].absmax2 = *x;
    ts[i].step = L[6].v[i].t;
  }
  mf_status st;
  Py_BEGIN_ALLOW_THREADS
  st = mf_optim_step(&h, (mf_state_format)bits, (int64_t)block_size,
                     have_code1 ? &code1.t : NULL, have_code2 ? &code2.t : NULL, ts, (int64_t)n,
                     have_scale ? &scale.t : NULL, have_inf ? &inf.t : NULL, (void *)s);
  Py_END_ALLOW_THREADS
  if (st) {
    mf_py_raise(st);
    goto finish;
  }
  result = Py_NewRef(Py_None);
finish:
  PyMem_Free(ts);
  if (have_inf) mf_py_view_release(&inf);
  if (have_scale) mf_py_view_release(&scale);
  if (have_code2) mf_py_view_release(&code2);
  if (have_code1) mf_py_view_release(&code1);
  for (int k = 6; k >= 0; k--) view_list_release(&L[k]);
  return result;
}

/* optim_check(kind, hparams): raises for out-of-range hyperparameters (the optimizer
 * constructors call it so a bad lr fails at construction, as in torch). */
static PyObject *py_optim_check(PyObject *self, PyObject *args) {
  (void)self;
  int kind, nesterov, maximize;
  mf_optim_hparams h;
  if (!PyArg_ParseTuple(args, "i(ddddddddpp)", &kind, &h.lr, &h.beta1, &h.beta2, &h.eps,
                        &h.weight_decay, &h.momentum, &h.dampening, &h.alpha, &nesterov,
                        &maximize))
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
     "absmax1, state2, absmax2, steps, grad_scale, found_inf, stream)"},
    {"optim_check", py_optim_check, METH_VARARGS, "optim_check(kind, hparams)"},
    {NULL, NULL, 0, NULL}};
