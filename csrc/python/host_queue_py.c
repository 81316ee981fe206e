/*
 * memfit._C.HostQueue: the host queue (memfit/host_queue.h) for Python. Jobs that call
 * Python live here, not in the core: the queue's thread takes the GIL
 * (PyGILState_Ensure) only for the call, so native jobs (copies, event waits, tickets)
 * and the waits between jobs never hold it.
 *
 *   q = HostQueue(threads)     a queue, its thread, a passive pool of `threads` threads
 *                              (0: memfit's thread count of the caller) for the steps
 *   q.submit(fn) -> job        fn() on the queue's thread; its exception is kept for wait()
 *   q.submit_copy(dst, src, stream=0, event=0) -> job
 *                              dst <- src byte for byte (arrays of the same size in
 *                              bytes); on a CUDA device cudaMemcpyAsync on `stream`, then
 *                              cudaEventRecord(event) (handles as ints: a torch stream's
 *                              .cuda_stream, an event's .cuda_event)
 *   q.submit_event_wait(event) -> job   cudaEventSynchronize(event) on the queue's thread
 *   q.signal() -> ticket       a ticket: completes when every job before it has
 *   q.wait(ticket=None, raise_error=True)
 *                              blocks (GIL released) until that job, or every job, has
 *                              run; raises the first error kept since the last wait
 *                              (raise_error=False: leaves it kept for the next wait)
 *   q.stop()                   takes no more jobs; lets the queued ones run; joins
 *
 * A copy's arrays are kept alive here until its job has run (released by the next call
 * that holds the GIL, or when the queue goes).
 */
#include "bindings.h"
#include "memfit/host_queue.h"

typedef struct {
  int64_t job;
  mf_py_view dst, src;
} held_copy;

typedef struct {
  PyObject_HEAD
  mf_host_queue *q;
  held_copy *held; /* copies whose arrays are kept alive until their job has run */
  Py_ssize_t n_held, cap_held;
} HostQueueObject;

/* ---- the jobs that call Python (run on the queue's thread) ---------------------------- */

/* a kept exception nobody collected (the queue is going away) */
static void payload_free(void *payload) {
  PyGILState_STATE g = PyGILState_Ensure();
  Py_DECREF((PyObject *)payload);
  PyGILState_Release(g);
}

/* Takes the raised exception, its traceback's frames cleared (traceback.clear_frames):
 * an error nobody collects must not keep what the frames' locals held (an optimizer the
 * user dropped) alive. A new reference, never NULL. */
static PyObject *take_exception(void) {
#if PY_VERSION_HEX >= 0x030C0000
  PyObject *value = PyErr_GetRaisedException(); /* normalized, with its traceback */
  PyObject *tb = value ? PyException_GetTraceback(value) : NULL;
#else
  PyObject *type, *value, *tb;
  PyErr_Fetch(&type, &value, &tb);
  PyErr_NormalizeException(&type, &value, &tb);
  if (tb && value) PyException_SetTraceback(value, tb);
  Py_XDECREF(type);
#endif
  if (tb) {
    PyObject *mod = PyImport_ImportModule("traceback");
    PyObject *r = mod ? PyObject_CallMethod(mod, "clear_frames", "O", tb) : NULL;
    Py_XDECREF(r);
    Py_XDECREF(mod);
    PyErr_Clear();
  }
  Py_XDECREF(tb);
  if (!value) value = Py_NewRef(PyExc_RuntimeError); /* cannot happen after a failed call */
  return value;
}

static mf_status call_job(mf_host_queue *q, void *ctx) {
  PyObject *fn = (PyObject *)ctx;
  PyGILState_STATE g = PyGILState_Ensure();
  PyObject *r = PyObject_CallNoArgs(fn);
  Py_DECREF(fn); /* not kept alive while the thread waits for the next job */
  if (r) {
    Py_DECREF(r);
  } else {
    PyObject *exc = take_exception();
    if (!mf_host_queue_keep_error(q, MF_ERR_INTERNAL, "a job raised a Python exception", exc))
      Py_DECREF(exc); /* an earlier error is kept: this one is dropped, as documented */
  }
  PyGILState_Release(g);
  return MF_OK;
}

/* The arrays of copies that may still be queued, released with the GIL on the queue's
 * thread (a queue dropped by one of its own jobs). */
typedef struct {
  held_copy *held;
  Py_ssize_t n;
} release_ctx;

static mf_status release_job(mf_host_queue *q, void *ctx) {
  (void)q;
  release_ctx *r = (release_ctx *)ctx;
  PyGILState_STATE g = PyGILState_Ensure();
  for (Py_ssize_t i = 0; i < r->n; i++) {
    mf_py_view_release(&r->held[i].dst);
    mf_py_view_release(&r->held[i].src);
  }
  PyGILState_Release(g);
  PyMem_RawFree(r->held);
  PyMem_RawFree(r);
  return MF_OK;
}

/* ---- the object -------------------------------------------------------------------- */

/* Releases the arrays of the copies that have run. */
static void release_done(HostQueueObject *self) {
  if (!self->q || self->n_held == 0) return;
  const int64_t done = mf_host_queue_completed(self->q);
  Py_ssize_t keep = 0;
  for (Py_ssize_t i = 0; i < self->n_held; i++) {
    held_copy *h = &self->held[i];
    if (h->job <= done) {
      mf_py_view_release(&h->dst);
      mf_py_view_release(&h->src);
    } else {
      self->held[keep++] = *h;
    }
  }
  self->n_held = keep;
}

static int check_open(HostQueueObject *self) {
  if (self->q) return 0;
  PyErr_SetString(mf_py_ValueError, "HostQueue: stopped; it takes no more jobs");
  return -1;
}

static PyObject *HostQueue_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
  static char *kwlist[] = {"threads", NULL};
  PyObject *threads_obj;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O:HostQueue", kwlist, &threads_obj))
    return NULL;
  if (PyBool_Check(threads_obj) || !PyLong_Check(threads_obj))
    return PyErr_Format(mf_py_TypeError, "threads: expected an int, got %s",
                        Py_TYPE(threads_obj)->tp_name);
  long threads = PyLong_AsLong(threads_obj);
  if (threads == -1 && PyErr_Occurred()) return NULL;
  if (threads < 0 || threads > 4096)
    return PyErr_Format(mf_py_ValueError, "threads: expected 0 (memfit's thread count) to "
                        "4096, got %ld", threads);
  if (threads == 0) threads = mf_get_num_threads();
  HostQueueObject *self = (HostQueueObject *)type->tp_alloc(type, 0);
  if (!self) return NULL;
  const mf_status st = mf_host_queue_create((int)threads, payload_free, &self->q);
  if (st) {
    Py_DECREF(self);
    return mf_py_raise(st);
  }
  return (PyObject *)self;
}

static void HostQueue_dealloc(HostQueueObject *self) {
  if (self->q) {
    if (mf_host_queue_is_own_thread(self->q)) {
      /* Dropped by one of its own jobs: copies queued after this job still need their
       * arrays, so a last job releases them once those have run. If the queue was
       * already stopped (it takes no job), they are left unreleased (a leak, never a
       * copy from freed memory). */
      release_done(self);
      if (self->n_held > 0) {
        release_ctx *r = (release_ctx *)PyMem_RawMalloc(sizeof *r);
        if (r) {
          r->held = self->held;
          r->n = self->n_held;
          if (mf_host_queue_submit(self->q, release_job, r, NULL) != MF_OK) {
            PyMem_RawFree(r);
            mf_clear_error();
          }
        }
        self->held = NULL;
        self->n_held = 0;
      }
      mf_host_queue_destroy(self->q);
    } else {
      Py_BEGIN_ALLOW_THREADS /* the queued Python jobs need the GIL to drain */
      mf_host_queue_destroy(self->q);
      Py_END_ALLOW_THREADS
    }
    self->q = NULL;
  }
  for (Py_ssize_t i = 0; i < self->n_held; i++) {
    mf_py_view_release(&self->held[i].dst);
    mf_py_view_release(&self->held[i].src);
  }
  PyMem_RawFree(self->held);
  Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *HostQueue_submit(HostQueueObject *self, PyObject *fn) {
  if (check_open(self)) return NULL;
  if (!PyCallable_Check(fn))
    return PyErr_Format(mf_py_TypeError, "fn: expected a callable, got %s", Py_TYPE(fn)->tp_name);
  release_done(self);
  int64_t job = 0;
  Py_INCREF(fn); /* the job's reference, dropped on the queue's thread after the call */
  const mf_status st = mf_host_queue_submit(self->q, call_job, fn, &job);
  if (st) {
    Py_DECREF(fn);
    return mf_py_raise(st);
  }
  return PyLong_FromLongLong(job);
}

/* A CUDA handle (stream or event) given as an int; 0 is none. */
static int handle_arg(PyObject *obj, const char *name, void **out) {
  *out = NULL;
  if (!obj || obj == Py_None) return 0;
  if (PyBool_Check(obj) || !PyLong_Check(obj)) {
    PyErr_Format(mf_py_TypeError, "%s: expected an int handle (a torch stream's .cuda_stream, "
                 "an event's .cuda_event), got %s", name, Py_TYPE(obj)->tp_name);
    return -1;
  }
  const unsigned long long v = PyLong_AsUnsignedLongLong(obj);
  if (v == (unsigned long long)-1 && PyErr_Occurred()) {
    PyErr_Clear();
    PyErr_Format(mf_py_ValueError, "%s: expected a handle >= 0 that fits 64 bits", name);
    return -1;
  }
  *out = (void *)(uintptr_t)v;
  return 0;
}

static PyObject *HostQueue_submit_copy(HostQueueObject *self, PyObject *args, PyObject *kwargs) {
  static char *kwlist[] = {"dst", "src", "stream", "event", NULL};
  PyObject *dst_obj, *src_obj, *stream_obj = NULL, *event_obj = NULL;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO|OO:submit_copy", kwlist, &dst_obj,
                                   &src_obj, &stream_obj, &event_obj))
    return NULL;
  if (check_open(self)) return NULL;
  void *stream, *event;
  if (handle_arg(stream_obj, "stream", &stream) || handle_arg(event_obj, "event", &event))
    return NULL;
  release_done(self);
  if (self->n_held == self->cap_held) {
    const Py_ssize_t cap = self->cap_held ? 2 * self->cap_held : 16;
    held_copy *h = (held_copy *)PyMem_RawRealloc(self->held, (size_t)cap * sizeof *h);
    if (!h) return PyErr_NoMemory();
    self->held = h;
    self->cap_held = cap;
  }
  held_copy *h = &self->held[self->n_held];
  memset(h, 0, sizeof *h);
  PyObject *objs[2] = {dst_obj, src_obj};
  const char *names[2] = {"dst", "src"};
  const int flags[2] = {MF_PY_WRITABLE, MF_PY_READ};
  mf_py_view v[2];
  memset(v, 0, sizeof v);
  if (mf_py_views_get(2, objs, names, flags, (uintptr_t)stream, v)) return NULL;
  const size_t nd = (size_t)v[0].t.numel * mf_dtype_size(v[0].t.dtype);
  const size_t ns = (size_t)v[1].t.numel * mf_dtype_size(v[1].t.dtype);
  mf_status st = MF_OK;
  if (nd != ns) {
    st = mf_error(MF_ERR_VALUE, "src: %zu bytes (%lld %s), but dst holds %zu (%lld %s): a copy "
                  "takes arrays of the same size in bytes", ns, (long long)v[1].t.numel,
                  mf_dtype_name(v[1].t.dtype), nd, (long long)v[0].t.numel,
                  mf_dtype_name(v[0].t.dtype));
  } else {
    const int device = v[0].t.device == MF_CUDA ? v[0].t.device_id
                       : v[1].t.device == MF_CUDA ? v[1].t.device_id : -1;
    int64_t job = 0;
    st = mf_host_queue_submit_copy(self->q, v[0].t.data, v[1].t.data, nd, device, stream, event,
                                   &job);
    if (st == MF_OK) {
      h->job = job;
      h->dst = v[0];
      h->src = v[1];
      self->n_held++;
      return PyLong_FromLongLong(job);
    }
  }
  mf_py_views_release(2, v);
  return mf_py_raise(st);
}

static PyObject *HostQueue_submit_event_wait(HostQueueObject *self, PyObject *event_obj) {
  if (check_open(self)) return NULL;
  void *event;
  if (handle_arg(event_obj, "event", &event)) return NULL;
  int64_t job = 0;
  const mf_status st = mf_host_queue_submit_event_wait(self->q, event, &job);
  if (st) return mf_py_raise(st);
  return PyLong_FromLongLong(job);
}

static PyObject *HostQueue_signal(HostQueueObject *self, PyObject *noargs) {
  (void)noargs;
  if (check_open(self)) return NULL;
  release_done(self);
  int64_t ticket = 0;
  const mf_status st = mf_host_queue_signal(self->q, &ticket);
  if (st) return mf_py_raise(st);
  return PyLong_FromLongLong(ticket);
}

static PyObject *HostQueue_wait(HostQueueObject *self, PyObject *args, PyObject *kwargs) {
  static char *kwlist[] = {"ticket", "raise_error", NULL};
  PyObject *ticket_obj = Py_None, *raise_obj = Py_True;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|OO:wait", kwlist, &ticket_obj, &raise_obj))
    return NULL;
  if (!PyBool_Check(raise_obj))
    return PyErr_Format(mf_py_TypeError, "raise_error: expected True or False, got %s",
                        Py_TYPE(raise_obj)->tp_name);
  long long ticket = 0;
  if (ticket_obj != Py_None) {
    if (PyBool_Check(ticket_obj) || !PyLong_Check(ticket_obj))
      return PyErr_Format(mf_py_TypeError, "ticket: expected an int (what signal() or a "
                          "submit returned) or None, got %s", Py_TYPE(ticket_obj)->tp_name);
    ticket = PyLong_AsLongLong(ticket_obj);
    if (ticket == -1 && PyErr_Occurred()) return NULL;
    if (ticket < 1)
      return PyErr_Format(mf_py_ValueError, "ticket: expected a job number >= 1, got %lld",
                          ticket);
  }
  if (!self->q) Py_RETURN_NONE; /* stopped: every job has run */
  mf_status st;
  void *payload = NULL;
  const int take = raise_obj == Py_True;
  Py_BEGIN_ALLOW_THREADS
  st = take ? mf_host_queue_wait(self->q, (int64_t)ticket, &payload)
            : mf_host_queue_reach(self->q, (int64_t)ticket);
  Py_END_ALLOW_THREADS
  release_done(self);
  if (payload) { /* a job's Python exception, raised here as it was */
    PyObject *exc = (PyObject *)payload;
#if PY_VERSION_HEX >= 0x030C0000
    PyErr_SetRaisedException(exc);
#else
    PyErr_Restore(Py_NewRef((PyObject *)Py_TYPE(exc)), exc, PyException_GetTraceback(exc));
#endif
    mf_clear_error();
    return NULL;
  }
  if (st) return mf_py_raise(st);
  Py_RETURN_NONE;
}

static PyObject *HostQueue_stop(HostQueueObject *self, PyObject *noargs) {
  (void)noargs;
  if (!self->q) Py_RETURN_NONE;
  Py_BEGIN_ALLOW_THREADS /* the queued Python jobs need the GIL to drain */
  mf_host_queue_join(self->q);
  Py_END_ALLOW_THREADS
  release_done(self);
  Py_RETURN_NONE;
}

static PyObject *HostQueue_get_threads(HostQueueObject *self, void *closure) {
  (void)closure;
  return PyLong_FromLong(self->q ? mf_host_queue_threads(self->q) : 0);
}

static PyObject *HostQueue_get_completed(HostQueueObject *self, void *closure) {
  (void)closure;
  return PyLong_FromLongLong(self->q ? mf_host_queue_completed(self->q) : 0);
}

static PyObject *HostQueue_get_on_queue_thread(HostQueueObject *self, void *closure) {
  (void)closure;
  return PyBool_FromLong(self->q && mf_host_queue_is_own_thread(self->q));
}

static PyMethodDef HostQueue_methods[] = {
    {"submit", (PyCFunction)HostQueue_submit, METH_O,
     "submit(fn) -> job: fn() on the queue's thread (with the GIL for the call only)."},
    {"submit_copy", (PyCFunction)(void (*)(void))HostQueue_submit_copy,
     METH_VARARGS | METH_KEYWORDS,
     "submit_copy(dst, src, stream=0, event=0) -> job: dst <- src, byte for byte."},
    {"submit_event_wait", (PyCFunction)HostQueue_submit_event_wait, METH_O,
     "submit_event_wait(event) -> job: cudaEventSynchronize(event) on the queue's thread."},
    {"signal", (PyCFunction)HostQueue_signal, METH_NOARGS,
     "signal() -> ticket: completes once every job before it has run."},
    {"wait", (PyCFunction)(void (*)(void))HostQueue_wait, METH_VARARGS | METH_KEYWORDS,
     "wait(ticket=None, raise_error=True): until that job (None: every job) has run; raises "
     "the first error (raise_error=False: leaves it for the next wait)."},
    {"stop", (PyCFunction)HostQueue_stop, METH_NOARGS,
     "stop(): no more jobs; the queued ones run; the thread ends (joined unless it is this)."},
    {NULL, NULL, 0, NULL}};

static PyGetSetDef HostQueue_getset[] = {
    {"threads", (getter)HostQueue_get_threads, NULL, "Threads of the pool the steps run on.", NULL},
    {"completed", (getter)HostQueue_get_completed, NULL, "Number of the last job that ran.", NULL},
    {"on_queue_thread", (getter)HostQueue_get_on_queue_thread, NULL,
     "Whether the caller is the queue's own thread.", NULL},
    {NULL, NULL, NULL, NULL, NULL}};

static PyTypeObject HostQueue_type = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "memfit._C.HostQueue",
    .tp_basicsize = sizeof(HostQueueObject),
    .tp_dealloc = (destructor)HostQueue_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "HostQueue(threads): jobs run in order by a thread of memfit's core "
              "(csrc/python/host_queue_py.c).",
    .tp_methods = HostQueue_methods,
    .tp_getset = HostQueue_getset,
    .tp_new = HostQueue_new,
};

static PyObject *py_host_queues_live(PyObject *self, PyObject *noargs) {
  (void)self;
  (void)noargs;
  return PyLong_FromLong(mf_host_queue_live());
}

PyMethodDef mf_host_queue_methods[] = {
    {"host_queues_live", py_host_queues_live, METH_NOARGS,
     "Host queue threads running in this process."},
    {NULL, NULL, 0, NULL}};

int mf_py_host_queue_add(PyObject *module) {
  if (PyType_Ready(&HostQueue_type) < 0) return -1;
  return PyModule_AddObjectRef(module, "HostQueue", (PyObject *)&HostQueue_type);
}
