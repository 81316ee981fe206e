"""How a gradient gets from the device to the host for memfit.optim.offload (docs/offload.md,
"Host buffers"): the copy into a host buffer on the side stream (:func:`to_host`), its
landing on the worker, where it becomes or is added to the host gradient (:func:`land`;
with step_in_backward the tensor steps there), and the gradients a caller assigned on the
device (:func:`adopt_device_grads`), and how zero_grad clears them (:func:`clear_in_flight`).
Functions of the optimizer (``self``), the first three bound as its methods ``_to_host``,
``_land`` and ``_adopt_device_grads``."""

from __future__ import annotations

import torch


def adopt_device_grads(self) -> list:
    """offload_gradients=True: a gradient on the device at this point was assigned by
    the caller (``p.grad = g``) or computed for a parameter unfrozen since its hooks
    were made; it becomes the host gradient, replacing what was there (as assigning
    ``p.grad`` replaces it for a plain optimizer). Returns their slots."""
    adopted = []
    for s in self._slots:
        g = s.dev.grad
        if g is None or s.host is s.dev or (self._in_backward and s.stepped):
            continue
        staged, landed, after = self._to_host(s, g)
        s.dev.grad = None
        self._worker.submit(lambda s=s, job=(staged, landed, after):
                            self._land(s, *job, replace=True))
        adopted.append(s)
    return adopted


def to_host(self, s, g):
    """Starts copying gradient g of slot s into a host buffer (its view of the arena
    when it becomes the host gradient as it is, else a spill buffer: _offload_staging);
    returns the buffer and two CUDA events (None on the CPU, where the copy is
    already done): the copy is complete; the compute stream has reached this point
    (what a later host -> device copy of this parameter must wait for: kernels
    already queued may still read it)."""
    with torch.no_grad():
        if not self._in_backward and not s.claimed:
            staged = self._staging.view(s.index)
            s.claimed = True
        else:
            staged = self._staging.spill(s.index)
        if self._d2h is None:
            staged.copy_(g)
            return staged, None, None
        ready = torch.cuda.current_stream(self._device).record_event()
        self._d2h.wait_event(ready)
        with torch.cuda.stream(self._d2h):
            staged.copy_(g.detach(), non_blocking=True)
            g.record_stream(self._d2h)  # its memory is not reused before the copy ends
            return staged, self._d2h.record_event(), ready


def land(self, s, staged, landed, after, positions=None, replace=False) -> None:
    """Worker: the copied gradient becomes (or is added to, unless ``replace``) the
    host gradient; with step_in_backward (``positions`` given), the tensor steps
    right away."""
    h = s.host
    try:
        if landed is not None:
            landed.synchronize()
        _into_host_grad(self, s, h, staged, positions, replace)
    except BaseException:
        if h.grad is not staged:  # a buffer (a FIFO piece) is never kept by an error
            self._staging.release(staged)
        raise
    if positions is None:  # measured while backward goes on
        if self._norms.wanted:
            self._norms.record(s.index, h.grad)  # for clipping
        if self._flags.wanted:
            self._flags.record(s.index, h.grad)  # a GradScaler's inf check
    if positions is not None:  # step in backward: the tensor steps at once
        self._log("tensor_start", s.index)
        try:
            self._host_step([s], None, None, after, positions)
        except BaseException:
            self._drop_host_grad(s)  # the FIFO's space is not held by a step that raised
            raise
        self._log("tensor_end", s.index)


def _into_host_grad(self, s, h, staged, positions, replace) -> None:
    """Worker (land): ``staged`` becomes, or is added to, the host gradient ``h.grad``."""
    with torch.no_grad():
        if h.grad is None:
            if (self._in_backward and positions is not None) or \
                    staged is self._staging.view(s.index):
                h.grad = staged  # a FIFO piece lives until the tensor has stepped (land)
            else:  # the caller had dropped the host gradient, or no_step() sums it
                h.grad = self._staging.view(s.index).copy_(staged)
                self._staging.release(staged)
        else:
            if replace:
                h.grad.copy_(staged)
            else:
                h.grad.add_(staged)  # gradient accumulation, as autograd adds on the device
            self._staging.release(staged)


def _zero(g) -> None:
    """zero_grad(set_to_none=False) on one gradient, as torch's zero_grad does it (host
    gradients are views of the arena: zeroed in place, never replaced)."""
    if g.grad_fn is not None:
        g.detach_()
    else:
        g.requires_grad_(False)
    g.zero_()


def clear_device_grads(self, set_to_none: bool) -> None:
    """zero_grad on the model's tensors (the offloaded ones and those kept on the device)."""
    with torch.no_grad():
        for s in self._slots:
            if s.dev.grad is not None:
                if set_to_none:
                    s.dev.grad = None
                else:
                    _zero(s.dev.grad)


def clear_host_grads(self, set_to_none: bool) -> None:
    """zero_grad on the host copies' gradients (dropped: the arena view or spill buffer
    goes back, :meth:`_drop_host_grad`; or zeroed in place)."""
    with torch.no_grad():
        for s in self._slots:
            if s.host is not s.dev and s.host.grad is not None:
                if set_to_none:
                    self._drop_host_grad(s)
                else:
                    _zero(s.host.grad)


def clear_in_flight(self, set_to_none: bool) -> None:
    """zero_grad while the last step's chunks may still be on the worker
    (overlap_forward): it does not wait for them. The device gradients are cleared at
    once: the chunks never read them (their copies out were issued by step(), and the
    compute stream waits for those copies before anything after step() runs). The host
    gradients, which the chunks step with, are cleared by a job on the worker, after
    every chunk (the worker runs its jobs in order). Nobody sees them before that job
    has run: every API that reads the host gradients waits for the whole step, and so
    does the next backward's first gradient hook (offload_gradients, ``_take_grad``). An
    error a chunk raised is raised by the next API that waits for the whole step, not
    here."""
    clear_device_grads(self, set_to_none)
    job = self._worker.submit(lambda: clear_host_grads(self, set_to_none))
    # the step stays in flight until this job has run too: otherwise a forward that saw
    # every chunk's copies issued would end it, and the next backward's gradients would
    # land (_to_host reads s.claimed) while the clearing may still be dropping them
    self._inflight.until(job)
