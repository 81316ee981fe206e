/*
 * A pool of threads that wait passively (on a condition variable, never spinning) and
 * run one function on every thread at once: the optimizer step's threads when it is
 * called from memfit's host queue (host_queue.h), where libgomp's spinning would take
 * cores from the training thread and the data loader (docs/offload.md, "Threads").
 *
 * A pool of n threads is the calling thread plus n - 1 pthreads. A thread may attach a
 * pool (thread-local): the core's parallel loops that know pools (the CPU optimizer
 * step, optim.c) then run on it instead of OpenMP; everything else still uses OpenMP.
 */
#ifndef MEMFIT_THREAD_POOL_H
#define MEMFIT_THREAD_POOL_H

#include "memfit/common.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct mf_thread_pool mf_thread_pool;

/* fn(ctx, tid, nthreads) on every thread of the pool: tid 0 is the caller of
 * mf_thread_pool_run, 1 .. nthreads - 1 the pool's own threads. */
typedef void (*mf_pool_fn)(void *ctx, int tid, int nthreads);

/* A pool of `threads` threads in all (>= 1; 1 starts none). *out = NULL on failure. */
mf_status mf_thread_pool_create(int threads, mf_thread_pool **out);
/* Ends and joins the pool's threads; NULL is fine. Not while a run is in progress. */
void mf_thread_pool_destroy(mf_thread_pool *pool);
int mf_thread_pool_size(const mf_thread_pool *pool);
/* Runs fn on every thread of the pool and returns when all have returned. One run at a
 * time per pool: only the thread that owns the pool (the one that attached it) runs it. */
void mf_thread_pool_run(mf_thread_pool *pool, mf_pool_fn fn, void *ctx);

/* The calling thread's pool (NULL detaches): thread-local, not owned by the thread. */
void mf_thread_pool_attach(mf_thread_pool *pool);
mf_thread_pool *mf_thread_pool_current(void);

#ifdef __cplusplus
}
#endif

#endif /* MEMFIT_THREAD_POOL_H */
