"""The host buffers gradients land in, for memfit.optim.offload (docs/offload.md,
"Host buffers"): allocated once and reused, never one per gradient per step.

- The arena: one host allocation holding a gradient buffer for every parameter, made at
  the first gradient. When gradients are kept until the step (every mode but
  step_in_backward) the host gradient *is* its parameter's view of the arena: the
  first gradient of a step is copied straight into it.
- Spill buffers: a gradient that cannot go straight to its view goes to a spill buffer,
  given back once it is added or stepped. When gradients are kept (a second backward's
  gradient, added into the host gradient; one the caller assigned, replacing it) the
  spill buffers are a ring of two of the largest gradient's size, made at the first
  spill: a third gradient waits for the worker to add one of the two (the memory stays
  two gradients whatever the timing). With step_in_backward (every gradient lives only
  until its tensor has stepped, and the worker steps them in the order they came) one
  buffer used first in, first out (:class:`_Fifo`): of ``memfit.recipes.STAGING_SLOTS``
  (two) gradients of the largest tensor's size, the staging ``memfit estimate`` counts,
  made at the first spill; a gradient that finds it full waits for the worker to step
  the oldest (so the host holds that much in flight, whatever the timing, and nothing
  is allocated after the first step). Gradients summed under
  ``no_step()`` live until the last micro-batch: they move to the arena.

On a GPU the buffers are page-locked for asynchronous copies. torch's caching host
allocator rounds every pinned allocation up to a power of two (up to twice the bytes
for one arena), so the arena is allocated pageable and registered with CUDA at its
exact size (cudaHostRegister), falling back to a pinned allocation where that fails.
The CUDA path is not exercised by the CPU suite (no GPU there); on the CPU the same
code runs with pageable buffers.
"""

from __future__ import annotations

import collections
import threading

import torch

from memfit.recipes import STAGING_SLOTS  # the estimator's count of the staging

_ALIGN = 64  # bytes: every view starts on a cache line (and a vector load's alignment)


def _round_up(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _dense(t: torch.Tensor) -> bool:
    """True when t's elements fill exactly numel() places of its storage (contiguous or
    a permutation of it: channels_last), so a buffer of numel() elements can take its
    strides."""
    return t.is_contiguous() or t.is_contiguous(memory_format=torch.channels_last) or (
        t.dim() == 5 and t.is_contiguous(memory_format=torch.channels_last_3d))


def _shaped(flat: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A tensor on the memory of the uint8 buffer ``flat`` with ``like``'s dtype, shape
    and strides. Not a view (set_, not view ops): it has a version counter of its own,
    so an in-place change of one host gradient is told apart from the others'
    (_offload_norms)."""
    start = flat.storage_offset()  # bytes: flat is uint8; 64-byte aligned, so a whole element
    return torch.empty(0, dtype=like.dtype).set_(
        flat.untyped_storage(), start // like.element_size(), like.size(), like.stride())


class _Fifo:
    """One host buffer handed out first in, first out: each piece taken is put after the
    last one (wrapping to the start when the end is too short) and given back in any
    order; the space before the oldest piece still out is free again only once that
    piece is back. :meth:`take` waits (GIL released) while it is full."""

    def __init__(self, nbytes: int, alloc):
        self._size, self._alloc, self._buf = nbytes, alloc, None
        self._live = collections.deque()  # [start, end, given back], oldest first
        self._head = 0  # where the next piece goes
        self._cond = threading.Condition()

    def _fit(self, n: int):
        if not self._live:
            self._head = 0
            return 0
        tail = self._live[0][0]
        if self._live[-1][0] < tail:  # wrapped: free is [head, tail)
            return self._head if tail - self._head >= n else None
        if self._size - self._head >= n:  # free is [head, size) and [0, tail)
            return self._head
        return 0 if tail >= n else None

    def take(self, n: int) -> tuple:
        """A piece of n bytes (n <= the buffer's size): (flat uint8 tensor, its entry)."""
        with self._cond:
            if self._buf is None:
                self._buf = self._alloc(self._size)
            while (start := self._fit(n)) is None:
                self._cond.wait()
            entry = [start, start + n, False]
            self._live.append(entry)
            self._head = start + n
            return self._buf[start:start + n], entry

    def give_back(self, entry) -> None:
        with self._cond:
            entry[2] = True
            while self._live and self._live[0][2]:
                self._live.popleft()
            self._cond.notify_all()


class Staging:
    """The arena and the spill buffers of one offloader. ``allocations`` counts the host
    allocations made (the arena is one; the ring's two buffers or the FIFO buffer one
    each): none after the first step."""

    RING = 2  # spill buffers when gradients are kept: one landing, one being added

    def __init__(self, hosts: list, pinned: bool, ring: bool):
        # hosts: each parameter's host copy, None for one kept on the device
        self._hosts, self._pinned = hosts, pinned
        largest = max((_round_up(h.numel() * h.element_size()) for h in hosts
                       if h is not None), default=_ALIGN)
        self._fifo = None if ring else _Fifo(STAGING_SLOTS * largest, self._alloc)
        self._ring = None  # [flat buffers] when ring: made at the first spill
        self._ring_free = threading.Semaphore(self.RING) if ring else None
        self._views = None     # index -> the parameter's view of the arena
        self._registered = []  # data_ptrs registered with CUDA (unregistered by close)
        self._free = {}        # -1 -> [the ring's free flat uint8 buffers]
        self._out = {}         # id(spill view) -> (-1 or its FIFO entry, flat buffer, view)
        self._lock = threading.Lock()
        self.allocations = 0
        self.nbytes = 0  # host bytes allocated (what the arena and spill buffers hold)

    def _alloc(self, nbytes: int) -> torch.Tensor:
        self.allocations += 1
        self.nbytes += max(nbytes, 1)
        if not self._pinned:
            return torch.empty(max(nbytes, 1), dtype=torch.uint8)
        buf = torch.empty(max(nbytes, 1), dtype=torch.uint8)
        try:  # torch's own helper (cudaHostRegister, portable), as torch's pinned checkpoints
            from torch.cuda._pin_memory_utils import pin_memory

            pin_memory(buf.data_ptr(), buf.numel())
            self._registered.append(buf.data_ptr())
            return buf
        except (ImportError, AttributeError, RuntimeError, TypeError):
            return torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=True)

    def view(self, i: int) -> torch.Tensor:
        """Parameter i's view of the arena (made, for every parameter, at the first
        call)."""
        if self._views is None:
            sizes = [_round_up(h.numel() * h.element_size()) if h is not None and _dense(h)
                     else 0 for h in self._hosts]
            arena = self._alloc(sum(sizes))
            views, at = [], 0
            for h, n in zip(self._hosts, sizes):
                if h is None:  # kept on the device: no host buffer
                    views.append(None)
                elif n == 0:  # overlapping or gapped strides: a buffer of its own, once
                    views.append(torch.empty_like(h, pin_memory=self._pinned))
                    self.allocations += 1
                    self.nbytes += views[-1].untyped_storage().nbytes()
                else:
                    views.append(_shaped(arena[at:at + n], h))
                at += n
            self._views = views
        return self._views[i]

    def spill(self, i: int) -> torch.Tensor:
        """A buffer shaped like parameter i, from the pool (allocated when none is free)."""
        h = self._hosts[i]
        if not _dense(h):
            self.allocations += 1
            return torch.empty_like(h, pin_memory=self._pinned)
        nbytes = _round_up(h.numel() * h.element_size())
        if self._ring_free is not None:
            self._ring_free.acquire()  # releases the GIL: the worker adds and gives one back
            with self._lock:
                if self._ring is None:
                    largest = max(_round_up(t.numel() * t.element_size())
                                  for t in self._hosts if t is not None)
                    self._ring = [self._alloc(largest) for _ in range(self.RING)]
                    self._free[-1] = list(self._ring)
                flat = self._free[-1].pop()
            t = _shaped(flat, h)
            with self._lock:
                self._out[id(t)] = (-1, flat, t)
            return t
        flat, entry = self._fifo.take(nbytes)  # releases the GIL while it waits
        t = _shaped(flat, h)
        with self._lock:
            self._out[id(t)] = (entry, flat, t)
        return t

    def release(self, t) -> None:
        """Returns a spill buffer to the pool (anything else: nothing to do)."""
        if t is None:
            return
        with self._lock:
            entry = self._out.pop(id(t), None)
            if entry is not None and entry[0] == -1:
                self._free[-1].append(entry[1])
        if entry is None:
            return
        if entry[0] == -1:
            self._ring_free.release()
        else:
            self._fifo.give_back(entry[0])

    def close(self) -> None:
        """Unregisters the CUDA-registered buffers (before their memory is freed)."""
        for ptr in self._registered:
            try:
                from torch.cuda._pin_memory_utils import unpin_memory

                unpin_memory(ptr)
            except (ImportError, AttributeError, AssertionError, RuntimeError, TypeError):
                pass
        self._registered.clear()
