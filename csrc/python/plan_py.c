/*
 * Bindings of the checkpoint planner (memfit/plan.h). Plain Python sequences in
 * (lists, tuples, NumPy arrays of ints/floats), plain Python objects out; the
 * Python layer (memfit.checkpoint) wraps them into a Plan.
 */
#include "bindings.h"
#include "memfit/plan.h"

#include <stdlib.h>

/* A sequence of numbers as a new malloc'ed C array: int64 (anything with __index__)
 * when as_int, else double. Returns 0, or -1 with an exception naming `name` and the
 * bad element. */
static int number_list(PyObject *obj, const char *name, int as_int, void **out, Py_ssize_t *n) {
  *out = NULL;
  PyObject *seq = PySequence_Fast(obj, "");
  if (!seq) {
    PyErr_Format(mf_py_TypeError, "%s: expected a sequence of %s, got %.100s", name,
                 as_int ? "ints" : "numbers", Py_TYPE(obj)->tp_name);
    return -1;
  }
  int rc = -1;
  Py_ssize_t len = PySequence_Fast_GET_SIZE(seq);
  void *arr = malloc((as_int ? sizeof(int64_t) : sizeof(double)) * (size_t)(len > 0 ? len : 1));
  if (!arr) {
    PyErr_NoMemory();
    goto finish;
  }
  for (Py_ssize_t i = 0; i < len; i++) {
    PyObject *item = PySequence_Fast_GET_ITEM(seq, i); /* borrowed */
    if (!as_int) {
      double v = PyFloat_AsDouble(item);
      if (v == -1.0 && PyErr_Occurred()) {
        PyErr_Format(mf_py_TypeError, "%s[%zd]: expected a number, got %.100s", name, i,
                     Py_TYPE(item)->tp_name);
        goto finish;
      }
      ((double *)arr)[i] = v;
      continue;
    }
    PyObject *idx = PyNumber_Index(item);
    if (!idx) {
      PyErr_Format(mf_py_TypeError, "%s[%zd]: expected an int number of bytes, got %.100s",
                   name, i, Py_TYPE(item)->tp_name);
      goto finish;
    }
    long long v = PyLong_AsLongLong(idx);
    Py_DECREF(idx);
    if (v == -1 && PyErr_Occurred()) {
      PyErr_Format(mf_py_ValueError, "%s[%zd]: does not fit in 64 bits", name, i);
      goto finish;
    }
    ((int64_t *)arr)[i] = (int64_t)v;
  }
  *out = arr;
  *n = len;
  arr = NULL;
  rc = 0;
finish:
  free(arr);
  Py_DECREF(seq);
  return rc;
}

static int int64_list(PyObject *obj, const char *name, int64_t **out, Py_ssize_t *n) {
  return number_list(obj, name, 1, (void **)out, n);
}

static int double_list(PyObject *obj, const char *name, double **out, Py_ssize_t *n) {
  return number_list(obj, name, 0, (void **)out, n);
}

static int check_len(Py_ssize_t got, Py_ssize_t want, const char *name) {
  if (got != want) {
    PyErr_Format(mf_py_ValueError,
                 "%s: expected %zd entries (one per stage, as input_bytes), got %zd", name,
                 want, got);
    return -1;
  }
  return 0;
}

/* The per-stage lists every planner call but plan_sqrt takes, as malloc'ed C arrays
 * (stages_free releases them). */
typedef struct {
  int64_t *in, *saved;
  double *cost; /* null where the call got None for forward_cost */
  Py_ssize_t n;
} stages;

/* input_bytes, saved_bytes and forward_cost (None only where none_ok) into s, their
 * lengths checked against input_bytes'. Returns 0, or -1 with an exception naming the
 * bad argument; s is stages_free'd by the caller either way. */
static int stages_parse(stages *s, PyObject *in_obj, PyObject *saved_obj, PyObject *cost_obj,
                        int none_ok) {
  Py_ssize_t n2, n3;
  if (int64_list(in_obj, "input_bytes", &s->in, &s->n) < 0) return -1;
  if (int64_list(saved_obj, "saved_bytes", &s->saved, &n2) < 0) return -1;
  if (check_len(n2, s->n, "saved_bytes") < 0) return -1;
  if (none_ok && cost_obj == Py_None) return 0;
  if (double_list(cost_obj, "forward_cost", &s->cost, &n3) < 0) return -1;
  return check_len(n3, s->n, "forward_cost");
}

static void stages_free(stages *s) {
  free(s->in);
  free(s->saved);
  free(s->cost);
}

/* A plan's segments as the C API writes them: segment j ends (exclusive) at end[j] and
 * is checkpointed where ckpt[j]. */
typedef struct {
  int64_t *end;
  uint8_t *ckpt;
} segments;

/* Room for n segments (at least one). Returns 0, or -1 with MemoryError; s is
 * segments_free'd by the caller either way. */
static int segments_alloc(segments *s, Py_ssize_t n) {
  const size_t m = (size_t)(n > 0 ? n : 1);
  s->end = malloc(sizeof(int64_t) * m);
  s->ckpt = malloc(m);
  if (s->end && s->ckpt) return 0;
  PyErr_NoMemory();
  return -1;
}

static void segments_free(segments *s) {
  free(s->end);
  free(s->ckpt);
}

/* [(start, end, checkpointed), ...] */
static PyObject *segments_to_list(int64_t ns, const segments *sg) {
  PyObject *list = PyList_New((Py_ssize_t)ns);
  if (!list) return NULL;
  int64_t start = 0;
  for (int64_t j = 0; j < ns; j++) {
    PyObject *t = Py_BuildValue("(LLO)", (long long)start, (long long)sg->end[j],
                                sg->ckpt[j] ? Py_True : Py_False);
    if (!t) {
      Py_DECREF(list);
      return NULL;
    }
    PyList_SET_ITEM(list, (Py_ssize_t)j, t); /* steals t */
    start = sg->end[j];
  }
  return list;
}

/* plan_budget(input_bytes, saved_bytes, forward_cost, budget_bytes, max_slots=0)
 *   -> (segments, memory_bytes, recompute_cost, unit_bytes, exact) */
static PyObject *py_plan_budget(PyObject *self, PyObject *args) {
  (void)self;
  PyObject *in_obj, *saved_obj, *cost_obj, *result = NULL;
  long long budget, max_slots = 0;
  stages s = {0};
  segments sg = {0};
  if (!PyArg_ParseTuple(args, "OOOL|L:plan_budget", &in_obj, &saved_obj, &cost_obj, &budget,
                        &max_slots))
    return NULL;
  if (stages_parse(&s, in_obj, saved_obj, cost_obj, 0) < 0 || segments_alloc(&sg, s.n) < 0)
    goto finish;
  mf_plan_info info;
  mf_status st;
  Py_BEGIN_ALLOW_THREADS
  st = mf_plan_budget((int64_t)s.n, s.in, s.saved, s.cost, (int64_t)budget, (int64_t)max_slots,
                      sg.end, sg.ckpt, &info);
  Py_END_ALLOW_THREADS
  if (st) {
    mf_py_raise(st);
    goto finish;
  }
  PyObject *segs = segments_to_list(info.n_segments, &sg);
  if (segs)
    result = Py_BuildValue("(NLdLO)", segs, (long long)info.memory_bytes, info.recompute_cost,
                           (long long)info.unit_bytes, info.exact ? Py_True : Py_False);
finish:
  stages_free(&s);
  segments_free(&sg);
  return result;
}

/* plan_min_budget(input_bytes, saved_bytes) -> int */
static PyObject *py_plan_min_budget(PyObject *self, PyObject *args) {
  (void)self;
  PyObject *in_obj, *saved_obj, *result = NULL;
  stages s = {0};
  int64_t out = 0;
  if (!PyArg_ParseTuple(args, "OO:plan_min_budget", &in_obj, &saved_obj)) return NULL;
  if (stages_parse(&s, in_obj, saved_obj, Py_None, 1) == 0) {
    mf_status st;
    Py_BEGIN_ALLOW_THREADS
    st = mf_plan_min_budget((int64_t)s.n, s.in, s.saved, &out);
    Py_END_ALLOW_THREADS
    result = st ? mf_py_raise(st) : PyLong_FromLongLong((long long)out);
  }
  stages_free(&s);
  return result;
}

/* plan_sqrt(n) -> segments */
static PyObject *py_plan_sqrt(PyObject *self, PyObject *arg) {
  (void)self;
  long long n = PyLong_AsLongLong(arg);
  if (n == -1 && PyErr_Occurred()) return NULL;
  if (n < 1) {
    mf_error(MF_ERR_VALUE, "n: the chain needs at least one stage, got %lld", n);
    return mf_py_raise(MF_ERR_VALUE);
  }
  segments sg = {0};
  PyObject *result = NULL;
  int64_t ns = 0;
  if (segments_alloc(&sg, (Py_ssize_t)n) == 0) {
    mf_status st = mf_plan_sqrt((int64_t)n, sg.end, sg.ckpt, &ns);
    result = st ? mf_py_raise(st) : segments_to_list(ns, &sg);
  }
  segments_free(&sg);
  return result;
}

/* plan_evaluate(input_bytes, saved_bytes, forward_cost or None, segments)
 *   -> (memory_bytes, recompute_cost) */
static PyObject *py_plan_evaluate(PyObject *self, PyObject *args) {
  (void)self;
  PyObject *in_obj, *saved_obj, *cost_obj, *segs_obj, *result = NULL, *seq = NULL;
  stages s = {0};
  segments sg = {0};
  if (!PyArg_ParseTuple(args, "OOOO:plan_evaluate", &in_obj, &saved_obj, &cost_obj, &segs_obj))
    return NULL;
  if (stages_parse(&s, in_obj, saved_obj, cost_obj, 1) < 0) goto finish;
  seq = PySequence_Fast(segs_obj, "segments: expected a sequence of (start, end, checkpointed)");
  if (!seq) goto finish;
  Py_ssize_t ns = PySequence_Fast_GET_SIZE(seq);
  if (segments_alloc(&sg, ns) < 0) goto finish;
  int64_t expect_start = 0;
  for (Py_ssize_t j = 0; j < ns; j++) {
    PyObject *item = PySequence_Fast_GET_ITEM(seq, j);
    long long b, e;
    int c;
    if (!PyTuple_Check(item) || !PyArg_ParseTuple(item, "LLp", &b, &e, &c)) {
      PyErr_Clear();
      PyErr_Format(mf_py_TypeError,
                   "segments[%zd]: expected a tuple (start, end, checkpointed)", j);
      goto finish;
    }
    if (b != expect_start) {
      PyErr_Format(mf_py_ValueError,
                   "segments[%zd]: starts at %lld, expected %lld (segments must be "
                   "contiguous, in order, from 0)",
                   j, b, (long long)expect_start);
      goto finish;
    }
    sg.end[j] = (int64_t)e;
    sg.ckpt[j] = (uint8_t)c;
    expect_start = (int64_t)e;
  }
  int64_t mem = 0;
  double rc = 0.0;
  mf_status st = mf_plan_evaluate((int64_t)s.n, s.in, s.saved, s.cost, (int64_t)ns, sg.end,
                                  sg.ckpt, &mem, &rc);
  result = st ? mf_py_raise(st) : Py_BuildValue("(Ld)", (long long)mem, rc);
finish:
  Py_XDECREF(seq);
  stages_free(&s);
  segments_free(&sg);
  return result;
}

PyMethodDef mf_plan_methods[] = {
    {"plan_budget", py_plan_budget, METH_VARARGS,
     "plan_budget(input_bytes, saved_bytes, forward_cost, budget_bytes, max_slots=0) -> "
     "(segments, memory_bytes, recompute_cost, unit_bytes, exact)"},
    {"plan_min_budget", py_plan_min_budget, METH_VARARGS,
     "plan_min_budget(input_bytes, saved_bytes) -> smallest feasible budget in bytes"},
    {"plan_sqrt", py_plan_sqrt, METH_O, "plan_sqrt(n) -> segments of the sqrt(n) plan"},
    {"plan_evaluate", py_plan_evaluate, METH_VARARGS,
     "plan_evaluate(input_bytes, saved_bytes, forward_cost, segments) -> "
     "(memory_bytes, recompute_cost)"},
    {NULL, NULL, 0, NULL}};
