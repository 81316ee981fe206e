/* The host queue (memfit/host_queue.h) and the passive thread pool (memfit/thread_pool.h)
 * on their own: order, kept errors and payloads, tickets, copies, stop, a queue destroyed
 * by its own job, every pool thread running once per run. Run under ASan + UBSan by
 * tests/test_c_core.py (leaks and use-after-free of the self-freeing path show there). */
#define _POSIX_C_SOURCE 199309L /* nanosleep */
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "check.h"
#include "memfit/host_queue.h"
#include "memfit/thread_pool.h"

#define N_JOBS 1000

typedef struct {
  int order[N_JOBS];
  int n;
} log_t;

typedef struct {
  log_t *log;
  int i;
} append_ctx;

static mf_status append_job(mf_host_queue *q, void *ctx) {
  (void)q;
  append_ctx *a = (append_ctx *)ctx;
  a->log->order[a->log->n++] = a->i;
  const int i = a->i;
  free(a);
  if (i == 3) return mf_error(MF_ERR_VALUE, "job %d failed", i);
  if (i == 5) return mf_error(MF_ERR_TYPE, "job %d failed too", i);
  return MF_OK;
}

static int payloads_freed = 0;
static void count_free(void *payload) {
  payloads_freed++;
  free(payload);
}

static mf_status payload_job(mf_host_queue *q, void *ctx) {
  int *payload = (int *)malloc(sizeof(int));
  *payload = 42;
  if (!mf_host_queue_keep_error(q, MF_ERR_INTERNAL, "with a payload", payload)) free(payload);
  (void)ctx;
  return MF_OK;
}

static mf_status destroy_job(mf_host_queue *q, void *ctx) {
  (void)ctx;
  mf_host_queue_destroy(q); /* from its own thread: it frees itself once drained */
  return MF_OK;
}

static void sleep_ms(int ms) {
  struct timespec ts = {0, ms * 1000000L};
  nanosleep(&ts, NULL);
}

/* Holds the queue thread until the test has queued what must come after (*ctx set):
 * else on a slow machine (qemu) the thread runs a job before the next one is queued. */
static mf_status gate_job(mf_host_queue *q, void *ctx) {
  (void)q;
  for (int t = 0; t < 5000 && !atomic_load((atomic_int *)ctx); t++) sleep_ms(1);
  return MF_OK;
}

static void test_order_errors_tickets(void) {
  mf_host_queue *q = NULL;
  CHECK(mf_host_queue_create(2, count_free, &q) == MF_OK && q);
  CHECK(mf_host_queue_live() == 1);
  log_t log = {{0}, 0};
  int64_t last = 0;
  for (int i = 0; i < N_JOBS; i++) {
    append_ctx *a = (append_ctx *)malloc(sizeof *a);
    a->log = &log;
    a->i = i;
    CHECK(mf_host_queue_submit(q, append_job, a, &last) == MF_OK);
    CHECK(last == i + 1, "job number %lld for job %d", (long long)last, i);
  }
  int64_t ticket = 0;
  CHECK(mf_host_queue_signal(q, &ticket) == MF_OK && ticket == N_JOBS + 1);
  CHECK(mf_host_queue_reach(q, ticket) == MF_OK); /* reached: the error stays kept */
  CHECK(mf_host_queue_reach(q, ticket + 1) == MF_ERR_VALUE); /* no such job */
  const mf_status st = mf_host_queue_wait(q, ticket, NULL);
  CHECK(st == MF_ERR_VALUE, "got %d", (int)st); /* the first error (job 3), not job 5's */
  CHECK(strstr(mf_last_error(), "job 3 failed") != NULL, "%s", mf_last_error());
  CHECK(log.n == N_JOBS); /* the jobs after the errors ran */
  for (int i = 0; i < log.n; i++) CHECK(log.order[i] == i, "job %d ran %d-th", log.order[i], i);
  CHECK(mf_host_queue_completed(q) == ticket);
  CHECK(mf_host_queue_wait(q, 0, NULL) == MF_OK); /* taken: nothing to report */
  CHECK(mf_host_queue_wait(q, ticket + 5, NULL) == MF_ERR_VALUE); /* no such job */

  /* copies */
  enum { BYTES = 1 << 20 };
  uint8_t *src = (uint8_t *)malloc(BYTES), *dst = (uint8_t *)calloc(BYTES, 1);
  for (int i = 0; i < BYTES; i++) src[i] = (uint8_t)(i * 2654435761u >> 13);
  int64_t job = 0;
  CHECK(mf_host_queue_submit_copy(q, dst, src, BYTES, -1, NULL, NULL, &job) == MF_OK);
  CHECK(mf_host_queue_wait(q, job, NULL) == MF_OK);
  CHECK(memcmp(dst, src, BYTES) == 0);
  CHECK(mf_host_queue_submit_copy(q, dst, src, BYTES, -1, (void *)1, NULL, &job) == MF_ERR_VALUE);
#ifndef MEMFIT_WITH_CUDA
  CHECK(mf_host_queue_submit_copy(q, dst, src, BYTES, 0, NULL, NULL, &job) == MF_ERR_NO_CUDA);
  CHECK(mf_host_queue_submit_event_wait(q, (void *)1, &job) == MF_ERR_NO_CUDA);
#endif
  free(src);
  free(dst);

  /* a payload taken by a wait, and one nobody takes (freed by destroy) */
  CHECK(mf_host_queue_submit(q, payload_job, NULL, NULL) == MF_OK);
  void *payload = NULL;
  CHECK(mf_host_queue_wait(q, 0, &payload) == MF_ERR_INTERNAL);
  CHECK(payload && *(int *)payload == 42);
  free(payload);
  CHECK(mf_host_queue_submit(q, payload_job, NULL, NULL) == MF_OK);
  mf_host_queue_join(q);
  CHECK(mf_host_queue_submit(q, payload_job, NULL, NULL) == MF_ERR_VALUE); /* stopped */
  CHECK(mf_host_queue_live() == 0);
  mf_host_queue_destroy(q);
  CHECK(payloads_freed == 1, "%d", payloads_freed);
  CHECK(mf_host_queue_create(0, NULL, &q) == MF_ERR_VALUE && q == NULL);
}

static void test_destroyed_by_its_own_job(void) {
  mf_host_queue *q = NULL;
  CHECK(mf_host_queue_create(3, NULL, &q) == MF_OK);
  log_t log = {{0}, 0};
  atomic_int queued = 0;
  CHECK(mf_host_queue_submit(q, gate_job, &queued, NULL) == MF_OK);
  CHECK(mf_host_queue_submit(q, destroy_job, NULL, NULL) == MF_OK);
  for (int i = 10; i < 20; i++) { /* queued after it: they still run */
    append_ctx *a = (append_ctx *)malloc(sizeof *a);
    a->log = &log;
    a->i = i;
    CHECK(mf_host_queue_submit(q, append_job, a, NULL) == MF_OK);
  }
  atomic_store(&queued, 1);
  for (int t = 0; t < 500 && mf_host_queue_live() > 0; t++) sleep_ms(10);
  CHECK(mf_host_queue_live() == 0);
  CHECK(log.n == 10, "%d", log.n);
}

typedef struct {
  int hits[64];
  int nthreads;
} pool_ctx;

static void pool_fn(void *ctx, int tid, int nthreads) {
  pool_ctx *p = (pool_ctx *)ctx;
  __atomic_fetch_add(&p->hits[tid], 1, __ATOMIC_RELAXED);
  if (tid == 0) p->nthreads = nthreads;
}

static void test_pool(void) {
  for (int n = 1; n <= 4; n++) {
    mf_thread_pool *pool = NULL;
    CHECK(mf_thread_pool_create(n, &pool) == MF_OK && pool);
    CHECK(mf_thread_pool_size(pool) == n);
    pool_ctx p;
    memset(&p, 0, sizeof p);
    for (int r = 0; r < 200; r++) mf_thread_pool_run(pool, pool_fn, &p);
    for (int t = 0; t < n; t++) CHECK(p.hits[t] == 200, "pool of %d: thread %d ran %d times", n, t, p.hits[t]);
    CHECK(p.hits[n] == 0 && p.nthreads == n);
    mf_thread_pool_attach(pool);
    CHECK(mf_thread_pool_current() == pool && mf_get_num_threads() == n);
    mf_thread_pool_attach(NULL);
    mf_thread_pool_destroy(pool);
  }
  mf_thread_pool *pool = NULL;
  CHECK(mf_thread_pool_create(0, &pool) == MF_ERR_VALUE && pool == NULL);
}

int main(void) {
  test_order_errors_tickets();
  test_destroyed_by_its_own_job();
  test_pool();
  return check_exit("test_host_queue");
}
