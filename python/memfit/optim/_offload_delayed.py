"""The one-step-delayed parameter update of memfit.optim.offload (``delayed_update``;
docs/offload.md, "Delayed update"): ZeRO-Offload's "delayed parameter update" (Ren et
al. 2021, section 5), for a backward too short to hide the host step.

With it, :meth:`CPUOffloadOptimizer.step` of iteration t submits the host step of t to
the worker thread and returns without waiting for it: the forward and backward of t+1
run on the parameters from before update t while the host steps. ``step()`` of t+1 first
waits for step t and copies its parameters to the device, then submits step t+1, whose
gradients were computed on the parameters before update t. In symbols, with ``U`` the
wrapped optimizer's step and theta_k the parameters after k updates:

    theta_{t+1} = U(theta_t, grad L(theta_{t-1}))      (undelayed: grad L(theta_t))

What is where while a step is in flight (from step() of t to the next call that waits):

- the device holds theta_{t-1}; the host masters become theta_t as the worker steps
  (``flush()`` waits and copies them to the device: before evaluating or saving);
- the gradients of t are consumed by the step (the host gradients are gone after
  step(), unlike the undelayed ``offload_gradients=True``, which keeps them until
  zero_grad): the next backward's gradients land in a second arena (one more gradient's
  bytes on the host, made at the first delayed step), swapped with the first at each
  delayed step, so no landing writes the gradients the step in flight is reading;
- the step's hyperparameters are those at step(): it steps on copies of the wrapped
  optimizer's group dicts, while ``opt.param_groups`` (an LR scheduler) writes the
  originals; what the step changes in its copies (``sr_step``) is written back to the
  originals when it ends.

Nothing here holds the offloader itself (its worker's jobs and finalizer would keep a
dropped one alive): the offloader passes itself to each call.
"""

from __future__ import annotations

import threading
import weakref

import torch

from memfit._C import MemfitTypeError, MemfitValueError
from memfit.optim._offload_staging import Staging
from memfit.optim._offload_torch import _inner_step


def undelayed_steps(delayed_update, *, offload: bool, step_in_backward: bool) -> int:
    """CPUOffloadOptimizer's ``delayed_update``, checked: how many steps run undelayed
    first (0: off). True is 1: the first step is undelayed (ZeRO-Offload delays from its
    N-th step on, to let the first, fast-changing steps use fresh gradients)."""
    if isinstance(delayed_update, bool):
        n = int(delayed_update)
    elif isinstance(delayed_update, int):
        if delayed_update < 1:
            raise MemfitValueError(
                f"delayed_update: expected True, False or the number of undelayed steps "
                f"first (at least 1), got {delayed_update}")
        n = delayed_update
    else:
        raise MemfitTypeError(f"delayed_update: expected True, False or an int, got "
                              f"{type(delayed_update).__name__}")
    if n and not offload:
        raise MemfitValueError("delayed_update needs offload=True: it delays the host step")
    if n and step_in_backward:
        raise MemfitValueError(
            "delayed_update with step_in_backward=True: each tensor already steps during "
            "backward; the delayed update is for a backward too short to hide the host step "
            "(use one or the other)")
    return n


class _FrontGroups:
    """What ``CPUOffloadOptimizer.param_groups``' dicts resolve to (_offload_torch._Group
    looks up ``.param_groups[i]`` of this): the wrapped optimizer's own group dicts,
    also while a delayed step runs on copies of them."""

    __slots__ = ("_delayed", "_inner")

    def __init__(self, delayed, inner):
        self._delayed, self._inner = delayed, inner

    @property
    def param_groups(self) -> list:
        front = self._delayed.front
        return front if front is not None else self._inner.param_groups


class Delayed:
    """The delayed update of one offloader: the step in flight, the update not yet on
    the device, the second gradient arena."""

    def __init__(self, opt, undelayed: int):
        self._undelayed = undelayed
        self._inner, self._slots, self._worker = opt.optimizer, opt._slots, opt._worker
        self.front = None  # the original group dicts while a step runs on copies
        # slots stepped on the host and not yet copied to the device (one list, changed in
        # place: the finalizer holds it)
        self._pending = []
        self._spare = []   # [the other gradient arena] once made
        for g in opt._groups:
            g._optimizer = _FrontGroups(self, opt.optimizer)
        # an offloader dropped with an update pending applies it to the model, as close()
        weakref.finalize(opt, _finish, self._worker, self._pending, self._spare)

    # -- the step ------------------------------------------------------------------------

    def delays(self) -> bool:
        """Whether the next step is delayed: once the wrapped optimizer has taken the
        undelayed steps (its ``sr_step``, one per step and saved in its state dict, so
        a resumed run goes on delaying as the run it resumes)."""
        return self._inner.param_groups[0].get("sr_step", 0) >= self._undelayed

    def step(self, opt, grad_scale, found_inf) -> None:
        """step() with delayed_update: waits for the step in flight and copies its
        parameters to the device, then submits this step and returns (the undelayed
        steps first: the offloader's own step)."""
        self.flush(opt)
        if not self.delays():
            opt._step(grad_scale, found_inf)
            return
        opt._stepping = True
        try:
            self._submit(opt, grad_scale, found_inf)
        finally:
            opt._stepping = False

    def _submit(self, opt, grad_scale, found_inf) -> None:
        slots, worker = self._slots, self._worker
        if opt._offload_grads:
            opt._adopt_device_grads()
        else:
            for s in slots:
                if s.dev.grad is not None:
                    job = opt._to_host(s, s.dev.grad)
                    worker.submit(lambda s=s, job=job: opt._land(s, *job))
        try:
            worker.wait()  # every gradient has landed: this step's, in the arena in use
        except BaseException:
            if not opt._offload_grads:  # as the undelayed step: no host copy left behind
                for s in slots:
                    opt._drop_host_grad(s)
            raise
        stepped = [s for s in slots if s.host.grad is not None]
        # a scaler changes its scale in place after step() returns (update())
        grad_scale = grad_scale.clone() if isinstance(grad_scale, torch.Tensor) else grad_scale
        found_inf = found_inf.clone() if isinstance(found_inf, torch.Tensor) else found_inf
        inner = self._inner
        front = inner.param_groups
        back = [dict(g) for g in front]      # this step's hyperparameters
        before = [dict(g) for g in back]     # to tell what the step changes in them

        def job():
            try:
                for s in stepped:  # the last copy of this master to the device has read it
                    if s.h2d_done is not None:
                        s.h2d_done.synchronize()
                if grad_scale is not None:
                    inner.grad_scale = grad_scale
                if found_inf is not None:
                    inner.found_inf = found_inf
                _inner_step(inner)
            finally:
                inner.__dict__.pop("grad_scale", None)
                inner.__dict__.pop("found_inf", None)
                for s in stepped:  # consumed (arena views: nothing to give back)
                    s.host.grad = None
                for f, b, was in zip(front, back, before):
                    for k, v in b.items():
                        if k != "params" and (k not in was or was[k] is not v):
                            f[k] = v  # sr_step: a key the caller does not set
                inner.param_groups = front
                self.front = None

        if opt._offload_grads:
            # the next backward lands in the other arena (this one is the step's)
            if not self._spare:
                self._spare.append(Staging([s.host for s in slots], pinned=opt._d2h is not None,
                                           ring=True))
            opt._staging, self._spare[0] = self._spare[0], opt._staging
        claimed = [s.claimed for s in slots]
        for s in slots:
            s.claimed = False  # the next gradient goes straight to its arena view
        self._pending[:] = stepped
        self.front = front
        inner.param_groups = back
        try:
            worker.submit(job)
        except BaseException:  # a closed optimizer: as it was, the gradients kept
            inner.param_groups, self.front = front, None
            self._pending.clear()
            for s, c in zip(slots, claimed):
                s.claimed = c
            if opt._offload_grads:
                opt._staging, self._spare[0] = self._spare[0], opt._staging
            raise

    # -- waiting -------------------------------------------------------------------------

    def flush(self, opt) -> None:
        """Waits for the step in flight (raising its error) and copies the parameters it
        updated to the device (on a GPU: the current stream waits for the copies)."""
        self._worker.wait()
        pending = list(self._pending)
        self._pending.clear()
        if not pending:
            return
        with torch.no_grad():
            if opt._h2d is None:
                for s in pending:
                    s.dev.detach().copy_(s.host)
                return
            # kernels already queued (the backward just run) may still read the parameters
            after = torch.cuda.current_stream(opt._device).record_event()
            opt._h2d.wait_event(after)
            with torch.cuda.stream(opt._h2d):
                for s in pending:
                    s.dev.detach().copy_(s.host, non_blocking=True)
                    s.h2d_done = opt._h2d.record_event()
        opt._landed_on_device()

    def discard(self) -> None:
        """The host copies are re-read from the model (reload_params): the update not yet
        on the device is dropped (after the step in flight has ended)."""
        self._worker.wait()
        self._pending.clear()

    def groups(self, opt) -> list:
        """``param_groups`` without waiting for the step in flight when no gradient has
        been taken since step() (an LR scheduler right after step(): the step uses the
        hyperparameters it started with). Else the offloader's own, which waits for
        every gradient to land (and so for the step in flight, queued before them)."""
        if opt._offload_grads and any(s.claimed or s.dev.grad is not None for s in self._slots):
            return opt._landed_groups()
        return opt._groups

    def zero_grad(self, opt, set_to_none: bool) -> bool:
        """zero_grad without waiting for the step in flight when the host holds no
        gradient of the next step (the step in flight drops its own): clears the device
        gradients. False: the offloader's own zero_grad is needed (it waits)."""
        if opt._offload_grads and any(s.claimed for s in self._slots):
            return False
        opt._sync_hooks()
        with torch.no_grad():
            for s in self._slots:
                g = s.dev.grad
                if g is None:
                    continue
                if set_to_none:
                    s.dev.grad = None
                else:  # as torch's zero_grad
                    if g.grad_fn is not None:
                        g.detach_()
                    else:
                        g.requires_grad_(False)
                    g.zero_()
        return True


def _finish(worker, pending: list, spare: list) -> None:
    """weakref.finalize of a dropped offloader: the update in flight reaches the model,
    then the second arena's CUDA registration goes."""
    if worker._thread is not threading.current_thread():  # not from inside a job
        worker._jobs.join()
    with torch.no_grad():
        for s in pending:
            s.dev.detach().copy_(s.host)
    pending.clear()
    for staging in spare:
        staging.close()
