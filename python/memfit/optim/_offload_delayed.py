"""The one-step-delayed parameter update of memfit.optim.offload (``delayed_update``;
docs/offload.md, "Delayed update"): ZeRO-Offload's "delayed parameter update" (Ren et
al. 2021, section 5), for a backward too short to hide the host step.

With it, :meth:`CPUOffloadOptimizer.step` of iteration t queues the host step of t on
the worker (the pipeline's chunks, _offload_pipeline, without their copies back) and
returns without waiting for it: the forward and backward of t+1 run on the parameters
from before update t while the host steps. ``step()`` of t+1 first waits for step t
and applies it (queues its chunks' copies back to the device and waits for them), then
queues step t+1, whose gradients were computed on the parameters before update t. In
symbols, with ``U`` the wrapped optimizer's step and theta_k the parameters after k
updates:

    theta_{t+1} = U(theta_t, grad L(theta_{t-1}))      (undelayed: grad L(theta_t))

What is where while a step is in flight (from step() of t to the next call that waits):

- the device holds theta_{t-1}; the host masters become theta_t as the worker steps
  (``flush()`` waits and applies them: before evaluating or saving); no copy of the
  step to the device is queued before it is applied, so nothing writes the device
  parameters while forward and backward read them;
- the gradients of t are consumed by the step (the host gradients are gone after
  step(), unlike the undelayed ``offload_gradients=True``, which keeps them until
  zero_grad): with ``offload_gradients=True`` the next backward's gradients land in a
  second arena (one more gradient's bytes on the host, made at the first delayed step),
  swapped with the first at each delayed step, so no landing writes the gradients the
  step in flight is reading; without it the next backward's gradients stay on the
  device until the next step(), which copies them out after step t has ended;
- the step's hyperparameters are those at step(): it steps on copies of the wrapped
  optimizer's group dicts, while ``opt.param_groups`` (an LR scheduler) writes the
  originals; what the step changes in its copies (``sr_step``) is written back to the
  originals when it ends.

Nothing here holds the offloader itself, nor do the step's queued jobs (they hold a
:class:`_Handle`): an offloader dropped with a step in flight is collected at once, and
its finalizer waits for the step and applies it (:func:`_finish`).
"""

from __future__ import annotations

import weakref

import torch

from memfit._C import MemfitTypeError, MemfitValueError
from memfit.optim import _offload_grads
from memfit.optim import _offload_pipeline as pipeline
from memfit.optim._offload_staging import Staging


def undelayed_steps(delayed_update, *, offload: bool, step_in_backward: bool,
                    overlap_forward: bool, keep: int) -> int:
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
    if n and overlap_forward:
        raise MemfitValueError(
            "delayed_update with overlap_forward=True: the delayed step already overlaps the "
            "next forward and backward, and its update reaches the device at the next "
            "step() (use one or the other)")
    if n and keep:
        raise MemfitValueError(
            "delayed_update with keep_on_device_below: the tensors kept on the device would "
            "step undelayed, the others delayed (use one or the other)")
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


class _Handle:
    """The offloader as the delayed step's queued jobs see it: its attributes (the same
    ``__dict__``) and its class's methods bound to this, but no reference to the
    offloader object itself, so that dropping it with a step in flight collects it at
    once (its finalizer then waits for the step and applies it, :func:`_finish`)."""

    __slots__ = ("__dict__", "_cls")

    def __init__(self, opt):
        self.__dict__ = vars(opt)
        object.__setattr__(self, "_cls", type(opt))

    def __getattr__(self, name):  # a class attribute: a method, a property, a constant
        for c in self._cls.__mro__:
            if name in c.__dict__:
                v = c.__dict__[name]
                get = getattr(type(v), "__get__", None)
                return get(v, self, self._cls) if get is not None else v
        raise AttributeError(name)


class Delayed:
    """The delayed update of one offloader: the step in flight, the update not yet on
    the device, the second gradient arena."""

    def __init__(self, opt, undelayed: int):
        self._undelayed = undelayed
        self._inner, self._slots, self._worker = opt.optimizer, opt._slots, opt._worker
        self.front = None  # the original group dicts while a step runs on copies
        # the chunks stepped on the host and not yet copied to the device: [(chunk index,
        # its slots that stepped)] (one list, changed in place: the finalizer holds it)
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
        """step() with delayed_update: waits for the step in flight and applies it, then
        queues this step and returns (the undelayed steps first: the offloader's own
        step)."""
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
            opt._settle()  # every gradient of this step has landed, in the arena in use
            have = {id(s) for s in slots if s.host.grad is not None}
        else:
            have = {id(s) for s in slots if s.dev.grad is not None}
        # a scaler changes its scale in place after step() returns (update())
        grad_scale = grad_scale.clone() if isinstance(grad_scale, torch.Tensor) else grad_scale
        found_inf = found_inf.clone() if isinstance(found_inf, torch.Tensor) else found_inf
        inner = self._inner
        front = inner.param_groups
        back = [dict(g) for g in front]      # this step's hyperparameters
        before = [dict(g) for g in back]     # to tell what the step changes in them
        self.front, inner.param_groups = front, back
        self._pending[:] = [(ci, mine) for ci, chunk in enumerate(opt._chunks)
                            if (mine := [s for s in chunk if id(s) in have])]
        handle, queued = _Handle(opt), []
        consumed = [s for s in slots if id(s) in have]
        offload_grads = opt._offload_grads

        def end():  # worker: after the step's jobs (which ran, or raised)
            for s in consumed:
                if offload_grads:
                    s.host.grad = None  # an arena view: nothing to give back
                elif s.host.grad is not None:
                    handle._drop_host_grad(s)
            for f, b, was in zip(front, back, before):
                for k, v in b.items():
                    if k != "params" and (k not in was or was[k] is not v):
                        f[k] = v  # sr_step: a key the caller does not set
            inner.param_groups = front
            self.front = None

        try:
            pipeline.step(handle, grad_scale, found_inf, delayed=queued)
        finally:
            if not queued:  # refused before any job (closed, or the checks): as it was
                inner.param_groups, self.front = front, None
                self._pending.clear()
            else:  # (also when a chunk's copy in raised: the chunks before it step)
                worker.submit(end)
                if offload_grads:
                    self._swap_arenas(opt)

    def _swap_arenas(self, opt) -> None:
        """The next backward lands in the other arena (this one is the step's)."""
        slots = self._slots
        if not self._spare:
            self._spare.append(Staging([s.host for s in slots], pinned=opt._d2h is not None,
                                       ring=True))
        opt._staging, self._spare[0] = self._spare[0], opt._staging
        for s in slots:
            s.claimed = False  # the next gradient goes straight to its arena view

    # -- waiting -------------------------------------------------------------------------

    def flush(self, opt) -> None:
        """Waits for the step in flight (raising its error, once its update is applied
        all the same: the chunks that stepped have new masters) and queues its chunks'
        copies to the device, then waits for them (on a GPU: the current stream waits)."""
        try:
            opt._settle()
        finally:
            pending = list(self._pending)
            self._pending.clear()
            if pending:
                if opt._h2d is not None:
                    # kernels already queued (the backward just run) may still read the
                    # parameters: the copies come after them on the h2d stream
                    opt._h2d.wait_event(torch.cuda.current_stream(opt._device).record_event())
                for ci, mine in pending:
                    pipeline.enqueue_copies(opt, ci, mine)
                opt._settle()
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
        _offload_grads.clear_device_grads(opt, set_to_none)
        return True


def _finish(worker, pending: list, spare: list) -> None:
    """weakref.finalize of a dropped offloader: the update in flight reaches the model,
    then the second arena's CUDA registration goes."""
    if not worker.on_thread():  # not from inside a job
        worker.reach()  # (an error of the step stays there: nobody is left to raise it)
    with torch.no_grad():
        for _, mine in pending:
            for s in mine:
                s.dev.detach().copy_(s.host)
    pending.clear()
    for staging in spare:
        staging.close()
