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
  optimizer's step (memfit's kernels release the GIL) and the host -> device copies of
  the updated parameters on another side stream, chunk by chunk, so that the chunks'
  copies and steps overlap (_offload_pipeline);
- :meth:`step` returns only when every update has landed (on the CPU) or the current
  CUDA stream waits for the copies (no host sync on the GPU): the next forward never
  reads a parameter before its update (``overlap_forward=True``: each module's forward
  waits for its own parameters instead; ``delayed_update``: it reads them before the
  update, which the next step() puts on the device, _offload_delayed).

``step_in_backward=True`` steps each tensor as soon as its gradient is ready, during
backward, and frees the gradient (torchtune's recipe): on the host (``offload=True``,
with ``offload_gradients=True``) or on the device (``offload=False``: no offload, the
wrapped optimizer holds the device parameters). Nothing can then need all gradients
first: a GradScaler and global clipping are refused.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from collections import OrderedDict

import torch

from memfit._C import MemfitTypeError, MemfitValueError
from memfit.amp.in_kernel import TORCH_FLAG
from memfit.optim import _dtensor
from memfit.optim import _offload_grads
from memfit.optim import _offload_pipeline as pipeline
from memfit.optim._offload_delayed import Delayed, undelayed_steps
from memfit.optim._offload_found_inf import LandedFlags
from memfit.optim._offload_norms import LandedNorms
from memfit.optim._offload_staging import Staging
from memfit.optim._offload_thread import _host_threads, _release, _weak_hook, _Worker
from memfit.optim._offload_torch import _Group, _groups_of, _inner_step
from memfit.optim._torch import (
    _MemfitOptimizer,
    run_load_state_dict_post_hooks,
    run_load_state_dict_pre_hooks,
    run_state_dict_post_hooks,
)

__all__ = ["CPUOffloadOptimizer"]


class _Slot:
    """One parameter: the model's tensor (``dev``), its host copy (``host``; ``dev``
    itself without offload) and where it is in the current step."""

    __slots__ = ("claimed", "dev", "h2d_done", "host", "index", "landed", "stepped", "where")

    def __init__(self, dev, host, where, index):
        self.dev, self.host, self.where, self.index = dev, host, where, index
        self.claimed = False   # the host gradient is (or is landing in) its arena view
        self.landed = None     # CUDA event: the last device->host gradient copy is complete
        self.stepped = False   # step_in_backward: stepped since the last step()
        self.h2d_done = None   # CUDA event: the last host->device parameter copy is complete


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
        host_threads: the threads of the host step (memfit's core, on the worker
            thread only); default: the cores this process may use, less one for the
            training thread.
        chunk_bytes: the step's chunks hold about this many bytes of gradients (default
            64 MiB): each is copied to the host, stepped and copied back on its own,
            overlapping the others (docs/offload.md, "The pipeline").
        overlap_forward: step() returns once every chunk is queued; each module's
            forward then waits only for the parameters it registers itself (safe only
            when no parameter is read outside its own module's forward).
        keep_on_device_below: tensors with fewer elements stay on the device and are
            stepped there by the wrapped optimizer (torchao keeps those under 4096);
            default 0: every tensor is offloaded.
        delayed_update: step() returns before the host step, whose update reaches the
            device at the next step() or :meth:`flush` (ZeRO-Offload's, docs/offload.md):
            True from the second step on, n after n undelayed steps; off by default.

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
                 step_in_backward=False, offload=True, host_threads=None,
                 chunk_bytes=pipeline.DEFAULT_CHUNK_BYTES, overlap_forward=False,
                 keep_on_device_below=0, delayed_update=False, **kwargs):
        if optimizer_class is None:
            from memfit.optim.optimizers import AdamW8bit as optimizer_class
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, _MemfitOptimizer)):
            raise MemfitTypeError(
                "optimizer_class: expected a memfit.optim optimizer class (AdamW8bit, AdamW, "
                f"Lion8bit, ...), got {getattr(optimizer_class, '__name__', optimizer_class)!r}; "
                "its states are what this optimizer keeps on the host")
        for name, v in (("offload_gradients", offload_gradients), ("offload", offload),
                        ("step_in_backward", step_in_backward),
                        ("overlap_forward", overlap_forward)):
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
        if step_in_backward:
            # the gradients are consumed in backward, so torch's scaler has nothing left to
            # unscale: torch's flag makes it hand its scale to step(), which refuses it with
            # the reason instead of torch's "No inf checks were recorded"
            setattr(self, TORCH_FLAG, True)
        threads = _host_threads(host_threads)
        pipeline.check_count("chunk_bytes", chunk_bytes, 1)
        pipeline.check_count("keep_on_device_below", keep_on_device_below, 0)
        undelayed = undelayed_steps(delayed_update, offload=offload,
                                    step_in_backward=step_in_backward,
                                    overlap_forward=overlap_forward, keep=keep_on_device_below)
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
                    if offload and p.numel() >= keep_on_device_below:
                        # the master weight: the parameter's dtype and layout, pinned for
                        # asynchronous copies when the parameter is on a GPU
                        h = torch.empty_like(p, device="cpu", pin_memory=cuda).copy_(p.detach())
                        h.requires_grad_(p.requires_grad)
                    hosts.append(h)
                    slots.append(_Slot(p, h, f"param_groups[{gi}]['params'][{i}]", len(slots)))
                inner_groups.append({**g, "params": hosts})
        # raises (bad hyperparameters) before any hook is registered
        self.optimizer = optimizer_class(inner_groups, **kwargs)
        if offload and hasattr(self.optimizer, "_override_alias"):
            # memfit.optim.bnb: GlobalOptimManager's overrides are registered for the
            # model's parameters; each host copy takes its parameter's
            self.optimizer._override_alias = {id(s.host): s.dev for s in slots}
        self._slots = slots
        self._slot_of = {id(s.dev): s for s in slots}
        # the step's chunks (_offload_pipeline) and those still in flight (overlap_forward)
        self.chunk_bytes, self.overlap_forward = chunk_bytes, overlap_forward
        self._chunks = pipeline.make_chunks([s for s in slots if s.host is not s.dev],
                                            chunk_bytes)
        self._inflight = pipeline.InFlight()
        self._worker = _Worker(threads)
        self._events = None
        self._accumulating = 0  # no_step() depth: backwards sum their gradients
        self._norms = LandedNorms()  # clipping's per-tensor norms, taken as gradients land
        self._flags = LandedFlags()  # and a GradScaler's inf/NaN check
        self.host_threads = threads
        # the host buffers gradients land in: allocated once (_offload_staging)
        self._staging = Staging([s.host if s.host is not s.dev else None for s in slots],
                                pinned=cuda, ring=not step_in_backward) if offload else None
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
        # the gradient hooks (weak: _weak_hook), removed with the thread by close() or
        # when this optimizer is collected; a parameter frozen now gets its hook once it
        # requires a gradient (_sync_hooks: at each step() and zero_grad(); a gradient it
        # got before that is taken at step(), as one the caller assigned)
        self._hooks, self._hooked = [], set()
        self._hook = _weak_hook(self)
        self._finalizer = weakref.finalize(self, _release, self._hooks, self._worker,
                                           self._staging)
        self._sync_hooks()
        # step_in_backward: the wrapped optimizer's parameters that step in each backward
        # (those requiring a gradient at its first gradient), and the numbers its step()
        # would give them (_MemfitOptimizer._sr_positions: the same random bits), made at
        # the first gradient of each backward
        self._positions = None
        # delayed_update: the step in flight, the update not yet on the device; None if off
        self._delayed = Delayed(self, undelayed) if undelayed else None

    # -- lifecycle ------------------------------------------------------------------------

    @contextlib.contextmanager
    def no_step(self):
        """Gradient accumulation with ``step_in_backward=True``: the backwards inside sum
        their gradients (on the host with offload, in ``p.grad`` without) and step
        nothing; the next backward outside steps each tensor, with the sum, as its
        gradient lands: the steps run during the last micro-batch's backward. ::

            for i, batch in enumerate(micro_batches):
                with opt.no_step() if i < len(micro_batches) - 1 else nullcontext():
                    loss(batch).backward()
            opt.step()
        """
        if not self._in_backward:
            raise MemfitValueError("no_step: only with step_in_backward=True (without it "
                                   "backwards add up until step() anyway)")
        self._accumulating += 1
        try:
            yield self
        finally:
            self._accumulating -= 1

    def close(self) -> None:
        """Waits for the work in flight, then removes the gradient hooks from the model and
        ends the worker thread; afterwards the model trains with any other optimizer. Done
        as well when this optimizer is garbage collected, and by ``with``. Idempotent."""
        if not self._finalizer.alive:
            return
        try:
            self.flush()  # delayed_update: the last update reaches the model
        finally:
            self._finalizer()

    def flush(self) -> None:
        """Waits for the work in flight; with delayed_update puts the last update on the
        device: before evaluating or saving (docs/offload.md, "Delayed update")."""
        if self._delayed is not None:
            self._delayed.flush(self)
        else:
            self._settle()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _sync_hooks(self) -> None:
        """Registers the gradient hook of every parameter that requires a gradient and
        has none yet (torch refuses hooks on frozen tensors: unfrozen ones get theirs
        here). A hook stays when its parameter is frozen again: it fires only for a
        gradient autograd computes."""
        if not (self._offload_grads or self._in_backward) or not self._finalizer.alive:
            return
        for s in self._slots:
            if s.dev.requires_grad and id(s.dev) not in self._hooked and (
                    self._in_backward or s.host is not s.dev):  # (a small one keeps p.grad)
                self._hooks.append(s.dev.register_post_accumulate_grad_hook(self._hook))
                self._hooked.add(id(s.dev))

    # -- what torch's Optimizer API exposes ---------------------------------------------

    @property
    def param_groups(self) -> list:
        # the caller may change the gradients through these (a scaler's unscale_, whose
        # kernel leaves their version counters as they were): the norms taken as they
        # landed no longer count (forgotten once every landing has recorded its norm)
        groups = self._delayed.groups(self) if self._delayed is not None else self._landed_groups()
        self._norms.forget()
        return groups

    def _landed_groups(self) -> list:
        # gradients the caller assigned on the device join the host ones, and every host
        # gradient has landed: a scaler or clipping may read them
        if self._offload_grads and not self._in_backward:
            self._adopt_device_grads()
        self._settle()
        return self._groups

    def _memfit_checked_grads(self) -> dict:
        """memfit.amp.GradScaler's inf check before a step (amp/in_kernel.py): the host
        gradients the worker checked as they landed (_offload_found_inf)."""
        if not self._offload_grads or self._in_backward:
            return {}
        self._settle()
        return self._flags.checked({s.index: s.host.grad for s in self._slots
                                    if s.host.grad is not None and s.host is not s.dev})

    @property
    def state(self) -> dict:
        self._settle()
        self._norms.forget()  # its keys reach the host gradients too
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
        if self._events is None:
            return self._take_grad(p)
        t0 = time.perf_counter_ns()
        try:
            return self._take_grad(p)
        finally:
            self._log("hook", (self._slot_of[id(p)].index, time.perf_counter_ns() - t0))

    def _take_grad(self, p) -> None:
        if self._inflight.pending:  # the next backward's first gradient: the step is over
            self._settle()
        s = self._slot_of[id(p)]
        if self._in_backward and s.stepped:
            p.grad = None  # as before this backward: its gradient was consumed by the step
            raise RuntimeError(
                f"CPUOffloadOptimizer: {s.where} got a second gradient before step(): with "
                "step_in_backward=True every backward steps the parameters, so call step() "
                "after each backward (accumulate with `with opt.no_step(): loss.backward()` "
                "for every micro-batch but the last)")
        g = p.grad
        if self._in_backward and self._accumulating:  # no_step(): summed, not stepped
            if s.host is not s.dev:
                staged, landed, after = self._to_host(s, g)
                p.grad = None
                self._worker.submit(lambda: self._land(s, staged, landed, after))
            return  # without offload p.grad stays: autograd adds the next one to it
        positions = None
        if self._in_backward:
            positions = self._backward_positions()
        if s.host is s.dev:  # step in backward on the device
            try:
                self.optimizer._step_params([p], positions)
            except BaseException:
                # backward ends with this error: the next one starts anew, with no
                # gradient of this one added to it and no parameter marked as stepped
                self._reset_backward_step()
                raise
            p.grad = None
            s.stepped = True
            return
        staged, landed, after = self._to_host(s, g)
        p.grad = None
        if self._in_backward:
            s.stepped = True
        self._worker.submit(lambda: self._land(s, staged, landed, after, positions))

    def _backward_positions(self) -> dict:
        """step_in_backward: the places of this backward's step (made at its first
        gradient, O(parameters), once), for every parameter that requires a gradient."""
        if self._positions is None:
            stepping = {id(s.host) for s in self._slots if s.dev.requires_grad}
            self._positions = pipeline.positions(self.optimizer, stepping)
        return self._positions

    # the gradients' way to the host (_offload_grads)
    _adopt_device_grads = _offload_grads.adopt_device_grads
    _to_host = _offload_grads.to_host
    _land = _offload_grads.land

    def _log(self, kind, detail=None) -> None:
        """The pipeline's event log (``_events``: a list, or None when off): what the
        tests and benchmarks/bench_offload.py read to place the host work against
        backward."""
        if self._events is not None:
            self._events.append((time.perf_counter_ns(), kind, detail))

    def _host_step(self, slots, grad_scale, found_inf, after, positions=None,
                   copy_back=True) -> None:
        """Worker: the wrapped optimizer's own step over the host gradients of ``slots``
        (every host gradient there is; with ``positions``, the step in backward of
        ``slots`` alone, _MemfitOptimizer._step_params), then their updated parameters go
        to the device (after CUDA event ``after`` of the compute stream) and their host
        gradients are dropped when the step consumed them (``copy_back=False``: not copied)."""
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
                self._log("host_step_start")
                _inner_step(inner)
                self._log("host_step_end")
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
                    self._drop_host_grad(s)  # consumed; else kept until zero_grad, as torch keeps p.grad
                if not copy_back:  # delayed_update: applied later (_offload_delayed)
                    continue
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
        try:
            if self._in_backward:
                self._step_in_backward_done(grad_scale, found_inf)
            elif self._delayed is not None:
                self._delayed.step(self, grad_scale, found_inf)  # returns before the host step
            else:
                self._step(grad_scale, found_inf)
        except BaseException:
            # a GradScaler sets these before step() and deletes them after it returns: a
            # step that raised must not leave them to the next step
            self.__dict__.pop("grad_scale", None)
            self.__dict__.pop("found_inf", None)
            raise
        finally:
            self._sync_hooks()  # parameters unfrozen since: hooked from the next backward
        return loss

    def _step(self, grad_scale, found_inf) -> None:
        self._settle()  # the last step's chunks (overlap_forward)
        self._stepping = True
        try:
            pipeline.step(self, grad_scale, found_inf)
            if self.overlap_forward:
                self._inflight.install(self._hooks)
            else:
                self._settle()
                self._landed_on_device()
            self._log("step_returning")
        finally:
            self._stepping = False

    def _settle(self) -> None:
        """Waits for the work in flight (raises the first error a job raised): every API
        but the next forward's modules (overlap_forward) waits for the whole step."""
        try:
            self._worker.wait()
        finally:
            if self._inflight.pending:
                self._inflight.clear(self._hooks)
                self._landed_on_device()

    def _step_in_backward_done(self, grad_scale, found_inf) -> None:
        """step() with step_in_backward: waits for the steps taken during backward, steps
        the gradients no hook saw (assigned by the caller, or of a parameter unfrozen
        since the hooks were made) at their places, and ends the optimizer step. Whatever
        raises, the next backward starts anew: nothing of this one is carried over."""
        ok = False
        try:
            self._settle()
            self._log("step_returning")
            if grad_scale is not None or found_inf is not None:
                raise RuntimeError(
                    "CPUOffloadOptimizer(step_in_backward=True) cannot be used with a GradScaler: "
                    "each tensor stepped during backward, before the scaler could check the "
                    "gradients for inf/NaN; use step_in_backward=False")
            late = [s for s in self._slots if s.dev.grad is not None and not s.stepped]
            # summed on the host under no_step() and not stepped since (no gradient in the
            # last backward, or step() right after no_step()): stepped now
            summed = [s for s in self._slots if s.host is not s.dev and not s.stepped
                      and s.host.grad is not None and s not in late]
            if summed:
                positions = self._backward_positions()
                after = (torch.cuda.current_stream(self._device).record_event()
                         if self._h2d is not None else None)
                self._worker.submit(lambda: self._host_step(summed, None, None, after, positions))
                self._settle()
            if late:
                positions = self._backward_positions()
                if any(id(s.host) not in positions for s in late):  # frozen, assigned a grad
                    stepping = {id(s.host) for s in self._slots if s.stepped or s in late}
                    positions = pipeline.positions(self.optimizer, stepping)
                for s in late:
                    if s.host is not s.dev:
                        job = self._to_host(s, s.dev.grad)
                        s.dev.grad = None
                        self._worker.submit(lambda s=s, job=job: self._land(s, *job, positions))
                self._settle()
                self.optimizer._step_params([s.dev for s in late if s.host is s.dev], positions)
            ok = True
        finally:
            if ok:
                self.optimizer._advance_sr_step()  # one optimizer step, as the wrapped step()
            self._reset_backward_step()
        self._landed_on_device()

    def _reset_backward_step(self) -> None:
        """step_in_backward: ready for the next backward, nothing of this one kept (a
        gradient that did not step is dropped, as a refused step drops it)."""
        self._positions = None  # the next backward numbers its parameters anew
        with torch.no_grad():
            for s in self._slots:
                s.stepped = False
                s.dev.grad = None
                if s.host is not s.dev:
                    self._drop_host_grad(s)

    def _drop_host_grad(self, s) -> None:
        """The host gradient is consumed: its spill buffer goes back to the pool and the
        next gradient lands in the arena view again."""
        self._staging.release(s.host.grad)
        s.host.grad = None
        s.claimed = False

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears the gradients on the device and on the host. Refused (RuntimeError,
        nothing cleared) while a step is in flight: during :meth:`step`, or with
        step_in_backward between a backward and its step(). With ``overlap_forward``
        it does not wait for the last step's chunks: the device gradients are cleared
        at once, the host ones by a job queued after the chunks that read them."""
        if self._stepping or any(s.stepped for s in self._slots):
            raise RuntimeError(
                "CPUOffloadOptimizer.zero_grad: called in the middle of a step (parameters "
                "were stepped during backward and step() has not been called yet); call "
                "step() first; nothing was cleared")
        if self._delayed is not None and self._delayed.zero_grad(self, set_to_none):
            return  # the step in flight goes on (it drops its own gradients)
        if self._inflight.pending:  # overlap_forward: the last step's chunks may still run
            self._sync_hooks()
            _offload_grads.clear_in_flight(self, set_to_none)
            return
        self._settle()
        self._sync_hooks()  # parameters unfrozen since the last step: hooked from now on
        _offload_grads.clear_device_grads(self, set_to_none)
        _offload_grads.clear_host_grads(self, set_to_none)

    def clip_grad_norm_(self, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None):
        """torch.nn.utils.clip_grad_norm_ over the gradients the step reads (on the host
        with offload_gradients=True, where ``p.grad`` on the device is gone); returns the
        total norm, as torch does. Refused with step_in_backward (no step waits for all
        gradients)."""
        if self._in_backward:
            raise RuntimeError("CPUOffloadOptimizer.clip_grad_norm_: with step_in_backward=True "
                               "each tensor steps before the others' gradients exist, so there "
                               "is no global norm to clip by; use step_in_backward=False")
        params = [p for g in self._landed_groups() for p in g["params"]]
        if self._offload_grads and float(norm_type) == 2.0 and foreach is None:
            # the norms the worker took as the gradients landed (_offload_norms): from the
            # next backward on, once clipping has been asked for
            self._norms.wanted = True
            have = [(p.grad, k) for k, p in enumerate(params) if p.grad is not None]
            total = self._norms.total([g for g, _ in have], [k for _, k in have],
                                      error_if_nonfinite)
            if total is not None:
                torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach)
                return total
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite,
                                              foreach)

    # -- state dict -----------------------------------------------------------------------

    def state_dict(self):
        """The wrapped optimizer's state dict (loads into ``optimizer_class`` over the same
        parameters, and back). The state-dict hooks registered on this optimizer run as
        torch runs them (pre-hooks first, post-hooks on the finished dict)."""
        self.flush()  # delayed_update: the model's parameters include the last update too
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
        self._settle()
        self.optimizer.load_state_dict(run_load_state_dict_pre_hooks(self, state_dict))
        self.reload_params()
        run_load_state_dict_post_hooks(self)

    @torch.no_grad()
    def reload_params(self) -> None:
        """Copies the model's parameters into the host copies: call it after changing the
        parameters outside the optimizer (``load_state_dict`` calls it; with delayed_update
        an update not yet on the device is dropped: :meth:`flush` first to keep it)."""
        self._settle()
        if self._delayed is not None:
            self._delayed.discard()
        for s in self._slots:
            if s.host is not s.dev:
                s.host.copy_(s.dev.detach())
