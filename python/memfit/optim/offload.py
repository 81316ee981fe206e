"""Optimizer states and master weights on the host, stepped by the CPU (docs/offload.md).

:class:`CPUOffloadOptimizer` has torchao's name and signature. The device keeps the
parameters, in their dtype, and nothing else of the optimizer; the host keeps a copy of
each parameter (the master weight: float32 for float32 parameters, the parameter's own
float16/bfloat16 dtype otherwise, written with memfit's stochastic rounding), the wrapped
memfit optimizer built on those copies (its 8/4-bit states live on the host), and the
gradients while a step needs them.

How the work flows, one path for every device (when the "device" is the CPU, as in CI,
the copies are real copies and the streams are no-ops, so the same code is tested):

- a gradient goes device -> host on a side stream (``offload_gradients=True``: as soon
  as autograd has accumulated it, from ``register_post_accumulate_grad_hook``, and the
  device's ``p.grad`` is dropped; else in :meth:`step`); it lands in the host gradient
  (``host.grad``, added to it when several backwards accumulate);
- ONE worker thread does all host work in order: landing gradients, the wrapped
  optimizer's own ``step()`` (memfit's kernels release the GIL), and the host -> device
  copies of the updated parameters on another side stream;
- :meth:`step` returns only when every update has landed (on the CPU) or the current
  CUDA stream waits for the copies (no host sync on the GPU): the next forward never
  reads a parameter before its update.

``step_in_backward=True`` steps each tensor as soon as its gradient is ready, during
backward, and frees the gradient (torchtune's recipe): on the host (``offload=True``,
with ``offload_gradients=True``) or on the device (``offload=False``: no offload, the
wrapped optimizer holds the device parameters). Nothing can then need all gradients
first: a GradScaler and global clipping are refused.
"""

from __future__ import annotations

import queue
import threading
from collections import OrderedDict
from collections.abc import MutableMapping

import torch

from memfit._C import MemfitTypeError, MemfitValueError
from memfit.optim import _dtensor
from memfit.optim._torch import (
    _MemfitOptimizer,
    run_load_state_dict_post_hooks,
    run_load_state_dict_pre_hooks,
    run_state_dict_post_hooks,
)

__all__ = ["CPUOffloadOptimizer"]


class _Group(MutableMapping):
    """One of :attr:`CPUOffloadOptimizer.param_groups`: the wrapped optimizer's group
    (so an LR scheduler's ``group['lr'] = ...`` changes the lr the host step uses), with
    ``'params'`` the tensors whose ``.grad`` the step reads. The group is looked up at
    each use: the wrapped optimizer's load_state_dict replaces its group dicts."""

    def __init__(self, optimizer, index: int, params: list):
        self._optimizer, self._index, self._params = optimizer, index, params

    @property
    def _inner(self) -> dict:
        return self._optimizer.param_groups[self._index]

    def __getitem__(self, key):
        return self._params if key == "params" else self._inner[key]

    def __setitem__(self, key, value):
        if key == "params":
            raise MemfitValueError("CPUOffloadOptimizer: param_groups[g]['params'] cannot be "
                                   "replaced; build a new optimizer over the new parameters")
        self._inner[key] = value

    def __delitem__(self, key):
        if key == "params":
            raise MemfitValueError("CPUOffloadOptimizer: param_groups[g]['params'] cannot be "
                                   "deleted")
        del self._inner[key]

    def __iter__(self):
        return iter(self._inner)

    def __len__(self):
        return len(self._inner)

    def __repr__(self):
        return repr({**self._inner, "params": self._params})


class _Worker:
    """One thread that runs jobs in submission order. The first error a job raises is
    kept and raised by :meth:`wait` in the caller's thread; jobs after it still run
    (each one is self-contained), so the queue always drains."""

    def __init__(self):
        self._jobs: queue.Queue = queue.Queue()
        self._error = None
        self._thread = None

    def submit(self, job) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="memfit-offload", daemon=True)
            self._thread.start()
        self._jobs.put(job)

    def _run(self):
        while True:
            job = self._jobs.get()
            try:
                job()
            except BaseException as e:  # handed to the caller by wait()
                if self._error is None:
                    self._error = e
            finally:
                self._jobs.task_done()

    def wait(self) -> None:
        """Blocks until every submitted job has run; raises the first error one raised."""
        self._jobs.join()
        error, self._error = self._error, None
        if error is not None:
            raise error


class _Slot:
    """One parameter: the model's tensor (``dev``), its host copy (``host``; ``dev``
    itself without offload) and where it is in the current step."""

    __slots__ = ("dev", "h2d_done", "host", "landed", "stepped", "where")

    def __init__(self, dev, host, where):
        self.dev, self.host, self.where = dev, host, where
        self.landed = None     # CUDA event: the last device->host gradient copy is complete
        self.stepped = False   # step_in_backward: stepped since the last step()
        self.h2d_done = None   # CUDA event: the last host->device parameter copy is complete


def _groups_of(params) -> list:
    """The param groups as dicts with a list of params (torch's forms: tensors, dicts)."""
    if isinstance(params, torch.Tensor):
        raise MemfitTypeError("params: expected an iterable of tensors or dicts, got a tensor; "
                              "pass [tensor] or model.parameters()")
    items = list(params)
    if not items:
        raise MemfitValueError("params: optimizer got an empty parameter list")
    if not isinstance(items[0], dict):
        items = [{"params": items}]
    groups = []
    for gi, g in enumerate(items):
        if not isinstance(g, dict):
            raise MemfitTypeError(f"params[{gi}]: expected a dict (a param group) like params[0], "
                                  f"got {type(g).__name__}")
        ps = g.get("params")
        ps = [ps] if isinstance(ps, torch.Tensor) else list(ps if ps is not None else ())
        groups.append({**g, "params": ps})
    return groups


class CPUOffloadOptimizer(torch.optim.Optimizer):
    """A memfit optimizer whose states and master weights live on the host.

    Args:
        params: the model's parameters (tensors or param groups), all on one device.
        optimizer_class: a memfit.optim optimizer class (default AdamW8bit); it is
            built on the host copies with ``**kwargs`` (lr, betas, weight_decay, bits,
            bf16_stochastic_round, ...).
        offload_gradients: move each gradient to the host as soon as autograd has
            accumulated it and drop it on the device (``p.grad`` is None after
            backward; the gradient is ``param_groups[g]['params'][i].grad``, on the
            host). Several backwards before :meth:`step` add into the host gradient.
        step_in_backward: step each tensor as soon as its gradient is ready and free
            the gradient (needs ``offload_gradients=True`` when offloading). One
            backward per :meth:`step`; no GradScaler, no global clipping.
        offload: False keeps everything on the device (only with
            ``step_in_backward=True``: the step in backward without offload).

    ``param_groups`` are the wrapped optimizer's groups (an LR scheduler changes the
    host step's lr), with ``'params'`` the tensors whose ``.grad`` the step reads: the
    model's parameters, or with ``offload_gradients=True`` their host copies. ``state``
    maps those tensors to the wrapped optimizer's states. ``state_dict`` and
    ``load_state_dict`` are the wrapped optimizer's (same format, same order of
    parameters), so a checkpoint moves between this optimizer and
    ``optimizer_class(model.parameters())``. The wrapped optimizer is ``.optimizer``.
    """

    _memfit_scale_in_kernel = True  # grad_scale/found_inf reach the wrapped step (amp/in_kernel.py)

    def __init__(self, params, optimizer_class=None, *, offload_gradients=False,
                 step_in_backward=False, offload=True, **kwargs):
        if optimizer_class is None:
            from memfit.optim.optimizers import AdamW8bit as optimizer_class
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, _MemfitOptimizer)):
            raise MemfitTypeError(
                "optimizer_class: expected a memfit.optim optimizer class (AdamW8bit, AdamW, "
                f"Lion8bit, ...), got {getattr(optimizer_class, '__name__', optimizer_class)!r}; "
                "its states are what this optimizer keeps on the host")
        for name, v in (("offload_gradients", offload_gradients),
                        ("step_in_backward", step_in_backward), ("offload", offload)):
            if not isinstance(v, bool):
                raise MemfitTypeError(f"{name}: expected True or False, got {v!r}")
        if offload and step_in_backward and not offload_gradients:
            raise MemfitValueError("step_in_backward=True with offload needs offload_gradients="
                                   "True: a tensor steps on the host once its gradient is there")
        if not offload and not step_in_backward:
            raise MemfitValueError("offload=False: only with step_in_backward=True (the step in "
                                   "backward on the device); else use optimizer_class directly")
        if not offload and offload_gradients:
            raise MemfitValueError("offload_gradients=True needs offload=True")
        groups = _groups_of(params)
        device, seen = None, set()
        for gi, g in enumerate(groups):
            for i, p in enumerate(g["params"]):
                where = f"param_groups[{gi}]['params'][{i}]"
                if not isinstance(p, torch.Tensor):
                    raise MemfitTypeError(f"{where}: expected a tensor, got {type(p).__name__}")
                if _dtensor.is_dtensor(p):
                    raise MemfitValueError(
                        f"{where}: is a DTensor; sharded parameters are offloaded by FSDP2's own "
                        "fully_shard(..., offload_policy=CPUOffloadPolicy()) with the memfit "
                        "optimizer itself (docs/offload.md)")
                if not p.is_leaf:
                    raise MemfitValueError(f"{where}: can't optimize a non-leaf Tensor")
                if id(p) in seen:
                    raise MemfitValueError(f"{where}: appears more than once in params")
                seen.add(id(p))
                if device is None:
                    device, first = p.device, where
                elif p.device != device:
                    raise MemfitValueError(
                        f"{where}: is on {p.device} but {first} on {device}; all parameters of "
                        "one CPUOffloadOptimizer must be on one device (build one per device)")
        self._device = device
        self._offload, self._offload_grads, self._in_backward = offload, offload_gradients, step_in_backward
        cuda = device.type == "cuda"
        self._d2h = torch.cuda.Stream(device) if cuda and offload else None
        self._h2d = torch.cuda.Stream(device) if cuda and offload else None
        slots, inner_groups = [], []
        with torch.no_grad():
            for gi, g in enumerate(groups):
                hosts = []
                for i, p in enumerate(g["params"]):
                    h = p
                    if offload:
                        # the master weight: the parameter's dtype and layout, pinned for
                        # asynchronous copies when the parameter is on a GPU
                        h = torch.empty_like(p, device="cpu", pin_memory=cuda).copy_(p.detach())
                        h.requires_grad_(p.requires_grad)
                    hosts.append(h)
                    slots.append(_Slot(p, h, f"param_groups[{gi}]['params'][{i}]"))
                inner_groups.append({**g, "params": hosts})
        # raises (bad hyperparameters) before any hook is registered
        self.optimizer = optimizer_class(inner_groups, **kwargs)
        self._slots = slots
        self._slot_of = {id(s.dev): s for s in slots}
        self._worker = _Worker()
        self._stepping = False
        # what torch.optim.Optimizer's own methods (hooks, repr) read
        self.defaults = self.optimizer.defaults
        for name in ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks",
                     "_optimizer_state_dict_pre_hooks", "_optimizer_state_dict_post_hooks",
                     "_optimizer_load_state_dict_pre_hooks", "_optimizer_load_state_dict_post_hooks"):
            setattr(self, name, OrderedDict())
        # torch.optim.Optimizer.__init__ (not called: the wrapped optimizer holds the groups)
        # wraps the class's step once so that step runs the step hooks, torch's global
        # ones included, as for any torch optimizer
        self._patch_step_function()
        # the tensors whose .grad the step reads: the host copies when the gradients are
        # moved there, else the model's parameters (a scaler and clipping read these)
        it = iter(slots)
        self._groups = [_Group(self.optimizer, gi, [(s.host if offload_gradients else s.dev)
                                                    for s in (next(it) for _ in ig["params"])])
                        for gi, ig in enumerate(self.optimizer.param_groups)]
        self._hooks = []
        if offload_gradients or step_in_backward:
            for s in slots:
                if s.dev.requires_grad:
                    self._hooks.append(s.dev.register_post_accumulate_grad_hook(self._grad_ready))
        # step_in_backward: the wrapped optimizer's parameters that step in each backward
        # (those with a hook), and the numbers its step() would give them
        # (_MemfitOptimizer._sr_positions: the same random bits), made at the first
        # gradient of each backward
        self._in_step_set = {id(s.host) for s in slots if s.dev.requires_grad}
        self._positions = None

    # -- what torch's Optimizer API exposes ---------------------------------------------

    @property
    def param_groups(self) -> list:
        self._worker.wait()  # host gradients landed: a scaler or clipping may read them
        return self._groups

    @property
    def state(self) -> dict:
        self._worker.wait()
        inner = self.optimizer.state
        return {p: inner[h] for g, ig in zip(self._groups, self.optimizer.param_groups)
                for p, h in zip(g["params"], ig["params"]) if h in inner}

    def add_param_group(self, param_group):
        raise MemfitValueError(
            "CPUOffloadOptimizer.add_param_group: parameters cannot be added after construction "
            "(each needs a host copy and a gradient hook); pass every param group to the "
            "constructor, or build a new CPUOffloadOptimizer; nothing was added")

    def __repr__(self):
        return (f"CPUOffloadOptimizer({type(self.optimizer).__name__}, offload={self._offload}, "
                f"offload_gradients={self._offload_grads}, step_in_backward={self._in_backward})")

    def __getstate__(self):
        raise TypeError("CPUOffloadOptimizer cannot be pickled; save its state_dict()")

    # -- gradients ---------------------------------------------------------------------

    def _grad_ready(self, p) -> None:
        """Autograd has accumulated p's gradient (this backward's last contribution)."""
        s = self._slot_of[id(p)]
        if self._in_backward and s.stepped:
            p.grad = None  # as before this backward: its gradient was consumed by the step
            raise RuntimeError(
                f"CPUOffloadOptimizer: {s.where} got a second gradient before step(): with "
                "step_in_backward=True every backward steps the parameters, so call step() "
                "after each backward (gradient accumulation is not possible)")
        g = p.grad
        positions = None
        if self._in_backward:
            if self._positions is None:  # the first gradient of this backward: O(n), once
                self._positions = self.optimizer._sr_positions(self._in_step_set)
            positions = self._positions
        if not self._offload:  # step in backward on the device
            self.optimizer._step_params([p], positions)
            p.grad = None
            s.stepped = True
            return
        staged, landed, after = self._to_host(s, g)
        p.grad = None
        if self._in_backward:
            s.stepped = True
        self._worker.submit(lambda: self._land(s, staged, landed, after, positions))

    def _to_host(self, s, g):
        """Starts copying gradient g of slot s into a fresh host buffer; returns the buffer
        and two CUDA events (None on the CPU, where the copy is already done): the copy is
        complete; the compute stream has reached this point (what a later host -> device
        copy of this parameter must wait for: kernels already queued may still read it)."""
        with torch.no_grad():
            staged = torch.empty_like(s.host, pin_memory=self._d2h is not None)
            if self._d2h is None:
                staged.copy_(g)
                return staged, None, None
            ready = torch.cuda.current_stream(self._device).record_event()
            self._d2h.wait_event(ready)
            with torch.cuda.stream(self._d2h):
                staged.copy_(g.detach(), non_blocking=True)
                g.record_stream(self._d2h)  # its memory is not reused before the copy ends
                return staged, self._d2h.record_event(), ready

    def _land(self, s, staged, landed, after, positions=None) -> None:
        """Worker: the copied gradient becomes (or is added to) the host gradient; with
        step_in_backward (``positions`` given), the tensor steps right away."""
        if landed is not None:
            landed.synchronize()
        h = s.host
        with torch.no_grad():
            if h.grad is None:
                h.grad = staged
            else:
                h.grad.add_(staged)  # gradient accumulation, as autograd adds on the device
        if positions is not None:
            self._host_step([s], None, None, after, positions)

    def _host_step(self, slots, grad_scale, found_inf, after, positions=None) -> None:
        """Worker: the wrapped optimizer's own step over the host gradients of ``slots``
        (every host gradient there is; with ``positions``, the step in backward of
        ``slots`` alone, _MemfitOptimizer._step_params), then their updated parameters go
        to the device (after CUDA event ``after`` of the compute stream) and their host
        gradients are dropped when the step consumed them."""
        for s in slots:  # the previous copy of this master to the device has read it
            if s.h2d_done is not None:
                s.h2d_done.synchronize()
        inner = self.optimizer
        if grad_scale is not None:
            inner.grad_scale = grad_scale
        if found_inf is not None:
            inner.found_inf = found_inf
        try:
            if positions is None:
                inner.step()
            else:
                inner._step_params([s.host for s in slots], positions)
        finally:
            inner.__dict__.pop("grad_scale", None)
            inner.__dict__.pop("found_inf", None)
        with torch.no_grad():
            for s in slots:
                if s.host.grad is None:
                    continue
                if not self._offload_grads or self._in_backward:
                    s.host.grad = None  # consumed; else kept until zero_grad, as torch keeps p.grad
                if self._h2d is None:
                    s.dev.detach().copy_(s.host)
                    continue
                self._h2d.wait_event(after)
                with torch.cuda.stream(self._h2d):
                    s.dev.detach().copy_(s.host, non_blocking=True)
                    s.h2d_done = self._h2d.record_event()

    def _landed_on_device(self) -> None:
        """The current stream waits for every host -> device copy (no host sync)."""
        if self._h2d is not None:
            torch.cuda.current_stream(self._device).wait_stream(self._h2d)

    # -- the step ------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure=None):
        """Steps every parameter with a gradient on the host (with step_in_backward:
        waits for the steps taken during backward) and returns once the updated
        parameters are on the device (on a GPU: once the current stream waits for them).
        A GradScaler's ``grad_scale``/``found_inf`` reach the wrapped optimizer's step,
        which unscales and skips on inf/NaN exactly as it does without offload."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad_scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        if self._in_backward:
            self._worker.wait()
            if grad_scale is not None or found_inf is not None:
                raise RuntimeError(
                    "CPUOffloadOptimizer(step_in_backward=True) cannot be used with a GradScaler: "
                    "each tensor stepped during backward, before the scaler could check the "
                    "gradients for inf/NaN; use step_in_backward=False")
            self.optimizer._advance_sr_step()  # one optimizer step, as the wrapped step()
            self._positions = None  # the next backward numbers its parameters anew
            for s in self._slots:
                s.stepped = False
            self._landed_on_device()
            return loss
        self._stepping = True
        try:
            if not self._offload_grads:
                for s in self._slots:
                    if s.dev.grad is not None:
                        job = self._to_host(s, s.dev.grad)
                        self._worker.submit(lambda s=s, job=job: self._land(s, *job))
            after = (torch.cuda.current_stream(self._device).record_event()
                     if self._h2d is not None else None)
            self._worker.submit(lambda: self._host_step(self._slots, grad_scale, found_inf, after))
            try:
                self._worker.wait()
            finally:
                if not self._offload_grads:  # a step that raised leaves no host copy behind
                    for s in self._slots:
                        s.host.grad = None
            self._landed_on_device()
        finally:
            self._stepping = False
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears the gradients on the device and on the host. Refused (RuntimeError,
        nothing cleared) while a step is in flight: during :meth:`step`, or with
        step_in_backward between a backward and its step()."""
        if self._stepping or any(s.stepped for s in self._slots):
            raise RuntimeError(
                "CPUOffloadOptimizer.zero_grad: called in the middle of a step (parameters "
                "were stepped during backward and step() has not been called yet); call "
                "step() first; nothing was cleared")
        self._worker.wait()
        with torch.no_grad():
            for s in self._slots:
                for t in {id(s.dev): s.dev, id(s.host): s.host}.values():
                    if t.grad is None:
                        continue
                    if set_to_none:
                        t.grad = None
                    else:
                        t.grad.detach_().zero_()

    def clip_grad_norm_(self, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None):
        """torch.nn.utils.clip_grad_norm_ over the gradients the step reads (on the host
        with offload_gradients=True, where ``p.grad`` on the device is gone); returns the
        total norm, as torch does. Refused with step_in_backward (no step waits for all
        gradients)."""
        if self._in_backward:
            raise RuntimeError("CPUOffloadOptimizer.clip_grad_norm_: with step_in_backward=True "
                               "each tensor steps before the others' gradients exist, so there "
                               "is no global norm to clip by; use step_in_backward=False")
        params = [p for g in self.param_groups for p in g["params"]]
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite,
                                              foreach)

    # -- state dict -----------------------------------------------------------------------

    def state_dict(self):
        """The wrapped optimizer's state dict (loads into ``optimizer_class`` over the same
        parameters, and back). The state-dict hooks registered on this optimizer run as
        torch runs them (pre-hooks first, post-hooks on the finished dict)."""
        self._worker.wait()
        for hook in list(self._optimizer_state_dict_pre_hooks.values()):
            hook(self)
        return run_state_dict_post_hooks(self, self.optimizer.state_dict())

    def load_state_dict(self, state_dict):
        """Loads a state dict of ``optimizer_class`` (saved offloaded or not), checked by
        it before anything changes; then the host copies are re-read from the model's
        parameters, so load the model's weights first. The load_state_dict hooks
        registered on this optimizer run as torch runs them (a pre-hook may return a
        replacement dict; post-hooks after loading)."""
        if self._stepping or any(s.stepped for s in self._slots):
            raise RuntimeError("CPUOffloadOptimizer.load_state_dict: called in the middle of a "
                               "step; call step() first; nothing was loaded")
        self._worker.wait()
        self.optimizer.load_state_dict(run_load_state_dict_pre_hooks(self, state_dict))
        self.reload_params()
        run_load_state_dict_post_hooks(self)

    @torch.no_grad()
    def reload_params(self) -> None:
        """Copies the model's parameters into the host copies: call it after changing the
        parameters outside the optimizer (``load_state_dict`` calls it)."""
        self._worker.wait()
        for s in self._slots:
            if s.host is not s.dev:
                s.host.copy_(s.dev.detach())
