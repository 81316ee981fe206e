/*
 * The host queue: a FIFO of jobs run in submission order by one thread of its own (a
 * pthread, no Python), which sleeps on a condition variable when the queue is empty.
 * memfit's offloader (python/memfit/optim/_offload_thread.py) runs its host steps and
 * copies on it; the Python bindings add jobs that call Python (csrc/python/host_queue_py.c).
 *
 * Every job gets a number (1, 2, ...) in submission order; mf_host_queue_wait(q, k)
 * blocks until job k has run. mf_host_queue_signal enqueues a job that does nothing
 * but complete: a ticket to wait for.
 *
 * Errors: the first error a job reports is kept (status, message, and an optional
 * payload such as a Python exception) and handed to the next mf_host_queue_wait; later
 * jobs still run, so the queue always drains. Nothing here aborts.
 *
 * The queue's thread owns a passive thread pool (thread_pool.h) of `threads` threads
 * (itself included), attached to it: the CPU optimizer step called from a job runs on
 * that pool instead of OpenMP.
 */
#ifndef MEMFIT_HOST_QUEUE_H
#define MEMFIT_HOST_QUEUE_H

#include "memfit/common.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct mf_host_queue mf_host_queue;

/* A job: returns MF_OK or an error (its message in mf_last_error() of the queue's
 * thread). It may instead keep its error itself with mf_host_queue_keep_error (for a
 * payload) and return MF_OK. */
typedef mf_status (*mf_host_job_fn)(mf_host_queue *q, void *ctx);
/* Disposes of a kept error's payload that nobody took (mf_host_queue_destroy). */
typedef void (*mf_host_payload_free)(void *payload);

/* A queue and its thread, with a pool of `threads` threads (>= 1) for the jobs' steps.
 * The thread starts here. */
mf_status mf_host_queue_create(int threads, mf_host_payload_free payload_free,
                               mf_host_queue **out);
/* Lets the queued jobs run, ends the thread and frees the queue. From the queue's own
 * thread (a job dropping the last reference), the thread frees it once it has drained. */
void mf_host_queue_destroy(mf_host_queue *q);
/* No job is taken after this; the queued ones still run (mf_host_queue_wait works). */
void mf_host_queue_stop(mf_host_queue *q);
/* mf_host_queue_stop, then waits until the thread has run them and ended (at once when
 * called from the queue's own thread, which ends when that job returns). */
void mf_host_queue_join(mf_host_queue *q);
/* Queue threads running in this process (the lifecycle tests count them). */
int mf_host_queue_live(void);
/* 1 when called from the queue's own thread. */
int mf_host_queue_is_own_thread(const mf_host_queue *q);
int mf_host_queue_threads(const mf_host_queue *q);

/* Enqueues fn(q, ctx); *job = its number. The job owns ctx (frees it when it runs). */
mf_status mf_host_queue_submit(mf_host_queue *q, mf_host_job_fn fn, void *ctx, int64_t *job);
/* Enqueues a copy of n bytes from src to dst. Both on the host: memcpy on the queue's
 * thread. Either on a CUDA device (`device`: its id, -1 for none): cudaMemcpyAsync on
 * `stream` (a cudaStream_t, NULL: the default stream) with that device current, then,
 * when `event` (a cudaEvent_t) is not NULL, cudaEventRecord(event, stream). The memory
 * must stay valid until the copy has run (and, on a device, until the stream did it). */
mf_status mf_host_queue_submit_copy(mf_host_queue *q, void *dst, const void *src, size_t n,
                                    int device, void *stream, void *event, int64_t *job);
/* Enqueues a wait for `event` (a cudaEvent_t: cudaEventSynchronize), so that the jobs
 * after it see what the device did before the event. */
mf_status mf_host_queue_submit_event_wait(mf_host_queue *q, void *event, int64_t *job);
/* Enqueues a ticket: a job that only completes; *ticket = its number. */
mf_status mf_host_queue_signal(mf_host_queue *q, int64_t *ticket);

/* Number of the last job that has run (jobs run in order: every job up to it has). */
int64_t mf_host_queue_completed(mf_host_queue *q);
/* Blocks until job `job` has run (job <= 0: every job submitted so far). Then, if an
 * error is kept, takes it: returns its status with its message set on this thread
 * (mf_last_error) and *payload = its payload (NULL for the core's own errors; payload
 * may be NULL when the caller keeps none). Call without holding locks the jobs need
 * (the Python bindings release the GIL). */
mf_status mf_host_queue_wait(mf_host_queue *q, int64_t job, void **payload);
/* mf_host_queue_wait that leaves a kept error where it is, for the next
 * mf_host_queue_wait (the offloader's forward waits for one chunk's copies this way; its
 * errors are raised by the next API that waits for the whole step). Returns MF_OK once
 * job `job` has run; MF_ERR_VALUE for a job not submitted, or a later job of the queue
 * waited for from its own thread. */
mf_status mf_host_queue_reach(mf_host_queue *q, int64_t job);
/* Keeps (status, msg, payload) as the queue's error if none is kept: returns 1 (the
 * queue now owns payload), else 0 (the caller still does). */
int mf_host_queue_keep_error(mf_host_queue *q, mf_status status, const char *msg, void *payload);

#ifdef __cplusplus
}
#endif

#endif /* MEMFIT_HOST_QUEUE_H */
