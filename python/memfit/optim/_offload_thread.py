"""The offloader's worker thread and what ties it, and the gradient hooks, to the
optimizer's lifetime (memfit.optim.offload; docs/offload.md, "Its lifetime")."""

from __future__ import annotations

import os
import weakref

from memfit._C import MemfitTypeError, MemfitValueError


class _Worker:
    """One thread that runs jobs in submission order: memfit's host queue
    (``_C.HostQueue``, csrc/core/host_queue.c), a thread of the C core that holds no
    GIL while it waits or copies and takes it only to call a job. The first error a job
    raises is kept and raised by :meth:`wait` in the caller's thread; jobs after it still
    run (each one is self-contained), so the queue always drains. The thread holds no
    reference to the optimizer between jobs (a job's closure does, while it is queued),
    so a dropped optimizer is collected and its finalizer stops the thread.

    The queue's host steps run on its own pool of ``threads`` threads (the queue's thread
    and threads - 1 more), which wait on condition variables between steps instead of
    spinning as OpenMP's do (docs/offload.md, "Threads")."""

    def __init__(self, threads: int = 0):
        self._threads = threads  # the pool's threads for the host step (0: the process's)
        self._queue = None  # started by the first job
        self._stopped = False
        # the CUDA event recorded after the last copy back queued (_offload_pipeline): its
        # native copies read the pinned masters behind torch's back (torch's pinned
        # allocator records no use for them), so stop() waits for them before the
        # masters can be freed and their memory handed out again
        self.copies_done = None

    def _open(self):
        if self._stopped:
            raise RuntimeError("CPUOffloadOptimizer: the optimizer was closed; build a new one")
        if self._queue is None:
            from memfit import _C

            self._queue = _C.HostQueue(self._threads)
        return self._queue

    def submit(self, job) -> int:
        """A Python job (the queue's thread takes the GIL for the call); its number."""
        return self._open().submit(job)

    def submit_copy(self, dst, src, stream: int = 0, event: int = 0) -> int:
        """A native job (no GIL): dst <- src byte for byte, both contiguous, of the same
        size in bytes (memcpy on the host; cudaMemcpyAsync on ``stream``, then
        ``event`` recorded, when one is on a GPU; handles as ints). The queue holds both
        tensors until the copy has run. Its number."""
        return self._open().submit_copy(dst, src, stream, event)

    def submit_event_wait(self, event: int) -> int:
        """A native job (no GIL): cudaEventSynchronize(event). Its number."""
        return self._open().submit_event_wait(event)

    def reach(self, job=None) -> None:
        """Blocks until job ``job`` (None: every job submitted) has run, raising nothing:
        an error a job raised stays for the next :meth:`wait`."""
        if self._queue is not None:
            self._queue.wait(job, raise_error=False)

    @property
    def completed(self) -> int:
        """The number of the last job that has run (jobs run in order)."""
        return self._queue.completed if self._queue is not None else 0

    def on_thread(self) -> bool:
        """Whether the caller is the worker's own thread (a job)."""
        return self._queue is not None and self._queue.on_queue_thread

    def wait(self) -> None:
        """Blocks until every submitted job has run; raises the first error one raised."""
        if self._queue is not None:
            self._queue.wait()

    def stop(self) -> None:
        """Lets the queued jobs run, then ends the thread (joined unless this is it)."""
        if self._stopped:
            return
        self._stopped = True
        if self._queue is not None:
            if self.copies_done is not None:  # (kept referenced: the wait reads it)
                self._queue.submit_event_wait(self.copies_done.cuda_event)
            self._queue.stop()


def _release(hooks: list, worker: _Worker, staging=None) -> None:
    """What an offloader leaves on the model and in the process: its gradient hooks, its
    thread and its host buffers' CUDA registration (weakref.finalize: runs at close()
    or when the optimizer is collected)."""
    for handle in hooks:
        handle.remove()
    hooks.clear()
    worker.stop()
    if staging is not None:
        staging.close()


def _weak_hook(optimizer):
    """The gradient hook: holds the optimizer weakly, so the hook does not keep a dropped
    optimizer (and its host copies and states) alive; once it is gone, does nothing."""
    ref = weakref.ref(optimizer)

    def hook(p):
        opt = ref()
        if opt is not None:
            opt._grad_ready(p)
    return hook


def _host_threads(n) -> int:
    """The core's threads for the host step (CPUOffloadOptimizer's ``host_threads``):
    by default one per core this process may run on, less one for the training thread
    (autograd, the GPU's launches), at least one."""
    if n is None:
        try:
            cores = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            cores = os.cpu_count() or 1
        return max(1, cores - 1)
    if isinstance(n, bool) or not isinstance(n, int):
        raise MemfitTypeError(f"host_threads: expected an int or None, got {type(n).__name__}")
    if n < 1:
        raise MemfitValueError(f"host_threads: expected at least 1 thread, got {n}")
    return n
