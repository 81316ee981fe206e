/*
 * The passive thread pool (memfit/thread_pool.h). Each run bumps a generation number
 * under the mutex and wakes the workers; each worker runs the function once for that
 * generation and counts itself done; the caller runs its share (tid 0) and then sleeps
 * until the count reaches zero. Every wait is pthread_cond_wait: an idle pool uses no
 * CPU, and a worker that wakes finds its work at once (no spinning either way).
 */
#define _GNU_SOURCE /* pthread_setname_np */
#include <pthread.h>
#include <stdlib.h>

#include "memfit/thread_pool.h"

struct mf_thread_pool {
  pthread_mutex_t mu;
  pthread_cond_t wake; /* workers: a new generation, or stop */
  pthread_cond_t done; /* the caller: every worker finished this generation */
  int n;               /* threads in all, the caller included */
  int started;         /* pthreads actually started (n - 1 unless creation failed) */
  unsigned long generation;
  int pending;         /* workers still running this generation */
  int stop;
  mf_pool_fn fn;
  void *ctx;
  pthread_t *threads;
};

typedef struct {
  mf_thread_pool *pool;
  int tid;
} worker_arg;

static void *worker_main(void *arg_) {
  worker_arg *arg = (worker_arg *)arg_;
  mf_thread_pool *p = arg->pool;
  const int tid = arg->tid;
  free(arg);
#ifdef __linux__
  pthread_setname_np(pthread_self(), "memfit-pool"); /* what top -H and the tests see */
#endif
  unsigned long seen = 0;
  pthread_mutex_lock(&p->mu);
  for (;;) {
    while (p->generation == seen && !p->stop) pthread_cond_wait(&p->wake, &p->mu);
    if (p->stop) break;
    seen = p->generation;
    mf_pool_fn fn = p->fn;
    void *ctx = p->ctx;
    pthread_mutex_unlock(&p->mu);
    fn(ctx, tid, p->n);
    pthread_mutex_lock(&p->mu);
    if (--p->pending == 0) pthread_cond_signal(&p->done);
  }
  pthread_mutex_unlock(&p->mu);
  return NULL;
}

mf_status mf_thread_pool_create(int threads, mf_thread_pool **out) {
  *out = NULL;
  if (threads < 1) return mf_error(MF_ERR_VALUE, "threads: expected at least 1, got %d", threads);
  mf_thread_pool *p = (mf_thread_pool *)calloc(1, sizeof *p);
  if (!p) return mf_error(MF_ERR_NOMEM, "thread pool: out of host memory");
  p->n = threads;
  if (threads > 1 && !(p->threads = (pthread_t *)calloc((size_t)threads - 1, sizeof(pthread_t)))) {
    free(p);
    return mf_error(MF_ERR_NOMEM, "thread pool: out of host memory");
  }
  pthread_mutex_init(&p->mu, NULL);
  pthread_cond_init(&p->wake, NULL);
  pthread_cond_init(&p->done, NULL);
  for (int t = 1; t < threads; t++) {
    worker_arg *arg = (worker_arg *)malloc(sizeof *arg);
    if (arg) {
      arg->pool = p;
      arg->tid = t;
    }
    if (!arg || pthread_create(&p->threads[t - 1], NULL, worker_main, arg) != 0) {
      free(arg);
      mf_thread_pool_destroy(p);
      return mf_error(MF_ERR_NOMEM, "thread pool: could not start thread %d of %d", t, threads);
    }
    p->started++;
  }
  *out = p;
  return MF_OK;
}

void mf_thread_pool_destroy(mf_thread_pool *p) {
  if (!p) return;
  pthread_mutex_lock(&p->mu);
  p->stop = 1;
  pthread_cond_broadcast(&p->wake);
  pthread_mutex_unlock(&p->mu);
  for (int t = 0; t < p->started; t++) pthread_join(p->threads[t], NULL);
  pthread_cond_destroy(&p->wake);
  pthread_cond_destroy(&p->done);
  pthread_mutex_destroy(&p->mu);
  free(p->threads);
  free(p);
}

int mf_thread_pool_size(const mf_thread_pool *p) { return p ? p->n : 1; }

void mf_thread_pool_run(mf_thread_pool *p, mf_pool_fn fn, void *ctx) {
  if (p->n == 1) {
    fn(ctx, 0, 1);
    return;
  }
  pthread_mutex_lock(&p->mu);
  p->fn = fn;
  p->ctx = ctx;
  p->pending = p->n - 1;
  p->generation++;
  pthread_cond_broadcast(&p->wake);
  pthread_mutex_unlock(&p->mu);
  fn(ctx, 0, p->n);
  pthread_mutex_lock(&p->mu);
  while (p->pending > 0) pthread_cond_wait(&p->done, &p->mu);
  pthread_mutex_unlock(&p->mu);
}

static _Thread_local mf_thread_pool *current_pool = NULL;

void mf_thread_pool_attach(mf_thread_pool *pool) { current_pool = pool; }

mf_thread_pool *mf_thread_pool_current(void) { return current_pool; }
