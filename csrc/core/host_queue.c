/*
 * The host queue (memfit/host_queue.h): a linked FIFO under one mutex, one pthread that
 * runs it and sleeps on `work` when it is empty, and a completion counter with `done`
 * for the waiters. Nothing spins: an idle queue costs no CPU time (tests/test_host_queue.py
 * checks the process's CPU time over an idle wait).
 */
#define _GNU_SOURCE /* pthread_setname_np */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "memfit/host_queue.h"
#include "memfit/thread_pool.h"
#ifdef MEMFIT_WITH_CUDA
#include "memfit/cuda_launch.h"
#endif

typedef enum { JOB_CALL, JOB_COPY, JOB_EVENT_WAIT, JOB_TICKET } job_kind;

typedef struct job {
  struct job *next;
  job_kind kind;
  int64_t seq;
  mf_host_job_fn fn; /* JOB_CALL */
  void *ctx;
  void *dst; /* JOB_COPY */
  const void *src;
  size_t n;
  int device;
  void *stream, *event; /* JOB_COPY, JOB_EVENT_WAIT */
} job;

struct mf_host_queue {
  pthread_mutex_t mu;
  pthread_cond_t work; /* the thread: a job was queued, or stop */
  pthread_cond_t done; /* waiters: a job completed */
  job *head, *tail;
  int64_t submitted, completed;
  int stop;
  int self_free; /* destroyed from its own thread: the thread frees the queue on exit */
  int joined;
  pthread_t thread;
  int threads;
  mf_host_payload_free payload_free;
  /* the first error not yet taken by a wait */
  mf_status err;
  char err_msg[1024];
  void *err_payload;
};

int mf_host_queue_keep_error(mf_host_queue *q, mf_status status, const char *msg, void *payload) {
  int kept = 0;
  pthread_mutex_lock(&q->mu);
  if (q->err == MF_OK) {
    q->err = status == MF_OK ? MF_ERR_INTERNAL : status;
    snprintf(q->err_msg, sizeof q->err_msg, "%s", msg ? msg : "");
    q->err_payload = payload;
    kept = 1;
  }
  pthread_mutex_unlock(&q->mu);
  return kept;
}

static mf_status run_copy(const job *j) {
  if (j->device < 0) { /* host to host */
    if (j->n) memcpy(j->dst, j->src, j->n);
    return MF_OK;
  }
#ifdef MEMFIT_WITH_CUDA
  return mf_cuda_copy_async(j->dst, j->src, j->n, j->device, j->stream, j->event);
#else
  return mf_error_no_cuda("host queue copy"); /* refused at submit; kept for safety */
#endif
}

static mf_status run_job(mf_host_queue *q, const job *j) {
  switch (j->kind) {
    case JOB_CALL: return j->fn(q, j->ctx);
    case JOB_COPY: return run_copy(j);
    case JOB_EVENT_WAIT:
#ifdef MEMFIT_WITH_CUDA
      return mf_cuda_event_wait(j->event);
#else
      return mf_error_no_cuda("host queue event wait");
#endif
    case JOB_TICKET: return MF_OK;
  }
  return mf_error(MF_ERR_INTERNAL, "host queue: unknown job kind %d", (int)j->kind);
}

static void queue_free(mf_host_queue *q) {
  if (q->err_payload && q->payload_free) q->payload_free(q->err_payload);
  pthread_cond_destroy(&q->work);
  pthread_cond_destroy(&q->done);
  pthread_mutex_destroy(&q->mu);
  free(q);
}

static atomic_int live_threads; /* queue threads running, process-wide */

int mf_host_queue_live(void) { return atomic_load(&live_threads); }

static void *queue_main(void *arg) {
  mf_host_queue *q = (mf_host_queue *)arg;
#ifdef __linux__
  pthread_setname_np(pthread_self(), "memfit-queue"); /* what top -H and gdb show */
#endif
  mf_thread_pool *pool = NULL;
  if (mf_thread_pool_create(q->threads, &pool) != MF_OK) {
    /* the step then runs on this thread alone (a pool of one): slower, still correct */
    pool = NULL;
    mf_thread_pool_create(1, &pool);
  }
  mf_thread_pool_attach(pool);
  pthread_mutex_lock(&q->mu);
  for (;;) {
    while (!q->head && !q->stop) pthread_cond_wait(&q->work, &q->mu);
    job *j = q->head;
    if (!j) break; /* stopped and drained */
    q->head = j->next;
    if (!q->head) q->tail = NULL;
    pthread_mutex_unlock(&q->mu);
    mf_clear_error();
    const mf_status st = run_job(q, j);
    if (st != MF_OK) mf_host_queue_keep_error(q, st, mf_last_error(), NULL);
    pthread_mutex_lock(&q->mu);
    q->completed = j->seq;
    pthread_cond_broadcast(&q->done);
    free(j);
  }
  const int self_free = q->self_free;
  pthread_mutex_unlock(&q->mu);
  mf_thread_pool_attach(NULL);
  mf_thread_pool_destroy(pool);
  if (self_free) queue_free(q);
  atomic_fetch_sub(&live_threads, 1);
  return NULL;
}

mf_status mf_host_queue_create(int threads, mf_host_payload_free payload_free,
                               mf_host_queue **out) {
  *out = NULL;
  if (threads < 1) return mf_error(MF_ERR_VALUE, "threads: expected at least 1, got %d", threads);
  mf_host_queue *q = (mf_host_queue *)calloc(1, sizeof *q);
  if (!q) return mf_error(MF_ERR_NOMEM, "host queue: out of host memory");
  q->threads = threads;
  q->payload_free = payload_free;
  pthread_mutex_init(&q->mu, NULL);
  pthread_cond_init(&q->work, NULL);
  pthread_cond_init(&q->done, NULL);
  atomic_fetch_add(&live_threads, 1);
  if (pthread_create(&q->thread, NULL, queue_main, q) != 0) {
    atomic_fetch_sub(&live_threads, 1);
    queue_free(q);
    return mf_error(MF_ERR_NOMEM, "host queue: could not start its thread");
  }
  *out = q;
  return MF_OK;
}

int mf_host_queue_is_own_thread(const mf_host_queue *q) {
  return pthread_equal(pthread_self(), q->thread);
}

int mf_host_queue_threads(const mf_host_queue *q) { return q->threads; }

void mf_host_queue_stop(mf_host_queue *q) {
  pthread_mutex_lock(&q->mu);
  q->stop = 1;
  pthread_cond_signal(&q->work);
  pthread_mutex_unlock(&q->mu);
}

void mf_host_queue_join(mf_host_queue *q) {
  mf_host_queue_stop(q);
  if (mf_host_queue_is_own_thread(q) || q->joined) return;
  pthread_join(q->thread, NULL);
  q->joined = 1;
}

void mf_host_queue_destroy(mf_host_queue *q) {
  if (!q) return;
  if (mf_host_queue_is_own_thread(q)) {
    pthread_mutex_lock(&q->mu);
    q->stop = 1;
    q->self_free = 1;
    pthread_mutex_unlock(&q->mu);
    pthread_detach(q->thread);
    return;
  }
  mf_host_queue_join(q);
  queue_free(q);
}

static mf_status enqueue(mf_host_queue *q, job *j, int64_t *seq) {
  pthread_mutex_lock(&q->mu);
  if (q->stop) {
    pthread_mutex_unlock(&q->mu);
    free(j);
    return mf_error(MF_ERR_VALUE, "host queue: stopped; it takes no more jobs");
  }
  const int64_t number = j->seq = ++q->submitted;
  j->next = NULL;
  if (q->tail) q->tail->next = j;
  else q->head = j;
  q->tail = j;
  pthread_cond_signal(&q->work);
  pthread_mutex_unlock(&q->mu);
  /* not j->seq: once the lock is released the queue thread may have run and freed j */
  if (seq) *seq = number;
  return MF_OK;
}

static job *new_job(job_kind kind) {
  job *j = (job *)calloc(1, sizeof *j);
  if (j) {
    j->kind = kind;
    j->device = -1;
  }
  return j;
}

#define NEW_JOB(j, kind)                                                             \
  job *j = new_job(kind);                                                            \
  if (!j) return mf_error(MF_ERR_NOMEM, "host queue: out of host memory")

mf_status mf_host_queue_submit(mf_host_queue *q, mf_host_job_fn fn, void *ctx, int64_t *seq) {
  if (!fn) return mf_error(MF_ERR_VALUE, "fn: must not be NULL");
  NEW_JOB(j, JOB_CALL);
  j->fn = fn;
  j->ctx = ctx;
  return enqueue(q, j, seq);
}

mf_status mf_host_queue_submit_copy(mf_host_queue *q, void *dst, const void *src, size_t n,
                                    int device, void *stream, void *event, int64_t *seq) {
  if (n && (!dst || !src)) return mf_error(MF_ERR_VALUE, "%s: NULL pointer", dst ? "src" : "dst");
#ifndef MEMFIT_WITH_CUDA
  if (device >= 0 || event) return mf_error_no_cuda("host queue copy");
#endif
  if (device < 0 && (stream || event))
    return mf_error(MF_ERR_VALUE, "%s: only a copy to or from a CUDA device takes one "
                    "(both arrays are on the host)", event ? "event" : "stream");
  NEW_JOB(j, JOB_COPY);
  j->dst = dst;
  j->src = src;
  j->n = n;
  j->device = device;
  j->stream = stream;
  j->event = event;
  return enqueue(q, j, seq);
}

mf_status mf_host_queue_submit_event_wait(mf_host_queue *q, void *event, int64_t *seq) {
  if (!event) return mf_error(MF_ERR_VALUE, "event: must not be NULL (0)");
#ifndef MEMFIT_WITH_CUDA
  (void)q;
  (void)seq;
  return mf_error_no_cuda("host queue event wait");
#else
  NEW_JOB(j, JOB_EVENT_WAIT);
  j->event = event;
  return enqueue(q, j, seq);
#endif
}

mf_status mf_host_queue_signal(mf_host_queue *q, int64_t *ticket) {
  NEW_JOB(j, JOB_TICKET);
  return enqueue(q, j, ticket);
}

int64_t mf_host_queue_completed(mf_host_queue *q) {
  pthread_mutex_lock(&q->mu);
  const int64_t c = q->completed;
  pthread_mutex_unlock(&q->mu);
  return c;
}

/* Called with q->mu held: waits (releasing it) until job seq (<= 0: every job so far)
 * has run; returns with q->mu held, or unlocked with an error for a job that will never
 * run. */
static mf_status reach_locked(mf_host_queue *q, int64_t seq) {
  if (seq <= 0) seq = q->submitted;
  if (seq > q->submitted) {
    const int64_t submitted = q->submitted;
    pthread_mutex_unlock(&q->mu);
    return mf_error(MF_ERR_VALUE, "ticket: no job %lld was submitted (the last is %lld)",
                    (long long)seq, (long long)submitted);
  }
  if (q->completed < seq && mf_host_queue_is_own_thread(q)) {
    pthread_mutex_unlock(&q->mu);
    return mf_error(MF_ERR_VALUE, "ticket: a job cannot wait for a later job of its own "
                    "queue (it would wait forever)");
  }
  while (q->completed < seq) pthread_cond_wait(&q->done, &q->mu);
  return MF_OK;
}

mf_status mf_host_queue_reach(mf_host_queue *q, int64_t seq) {
  pthread_mutex_lock(&q->mu);
  const mf_status st = reach_locked(q, seq);
  if (st == MF_OK) pthread_mutex_unlock(&q->mu);
  return st;
}

mf_status mf_host_queue_wait(mf_host_queue *q, int64_t seq, void **payload) {
  if (payload) *payload = NULL;
  pthread_mutex_lock(&q->mu);
  const mf_status reached = reach_locked(q, seq);
  if (reached != MF_OK) return reached;
  mf_status st = q->err;
  if (st != MF_OK) {
    mf_error(st, "%s", q->err_msg);
    if (payload) *payload = q->err_payload;
    else if (q->err_payload && q->payload_free) q->payload_free(q->err_payload);
    q->err = MF_OK;
    q->err_payload = NULL;
  }
  pthread_mutex_unlock(&q->mu);
  return st;
}
