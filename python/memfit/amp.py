"""Mixed precision for PyTorch: a GradScaler that explains itself, fused gradient
passes, and autocast helpers.

``memfit.amp.GradScaler`` takes torch's constructor, methods and semantics (it is a
drop-in for ``torch.amp.GradScaler``) and keeps its state machine and update rule in
memfit's C core. On CUDA the scale, the growth tracker and the step statistics live
on the device and ``update()`` is one kernel launch with no host sync; on the CPU the
same rule (one C function, see ``csrc/include/memfit/scaler.h``) runs on host memory.

Beyond torch (all optional):

* ``hysteresis=N``: back off only after N consecutive non-finite steps.
* ``min_scale`` / ``max_scale``: bounds on the scale.
* ``stats()``: skipped steps, backoffs, growths and the recent scale history.
* warnings that say what happened: many steps in a row skipped, the scale stuck at
  ``min_scale`` (or below 1), a loss that was already NaN/Inf before backward.
* ``nonfinite_loss="warn" | "skip" | "raise"``: what to do with such a loss.

The classic loop::

    import memfit.amp as amp
    autocast, scaler = amp.setup(model, optimizer)        # bf16 or fp16, scaler if fp16
    for x, y in loader:
        with autocast:
            loss = loss_fn(model(x), y)
        scaler.scale(loss).backward()
        amp.clip_grad_norm_(model.parameters(), 1.0, scaler=scaler, optimizer=optimizer)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)

This module imports torch.
"""

from __future__ import annotations

import inspect
import math
import warnings
from collections import abc, defaultdict
from contextlib import nullcontext
from enum import Enum
from typing import Any

import numpy as np
import torch

from memfit._cast import cast  # re-exported: casts with stochastic rounding
from memfit._matmul import gemm_backend, matmul, set_gemm_backend  # re-exported (matrix products)

from memfit import _C
from memfit._C import MemfitTypeError, MemfitValueError

__all__ = [
    "AutocastContext",
    "GradAccumulator",
    "GradScaler",
    "OptState",
    "Precision",
    "ScalerConfigError",
    "ScalerWarning",
    "autocast",
    "cast",
    "clip_grad_norm_",
    "gemm_backend",
    "matmul",
    "precision",
    "set_gemm_backend",
    "setup",
]

_LAYOUT = _C.scaler_layout()
_WORDS = _LAYOUT["words"]
_HEAD = _LAYOUT["history"]  # the counters live in the first _HEAD words
_ONE_BITS = 0x3F800000  # 1.0f

_FUSED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_F32, _F16, _BF16 = _FUSED_DTYPES
_is_contiguous = torch.Tensor.is_contiguous


class ScalerConfigError(MemfitValueError, AssertionError):
    """A bad scaler setting. Also an AssertionError, which is what torch raises for
    ``growth_factor <= 1`` and ``backoff_factor >= 1``."""


class ScalerWarning(UserWarning):
    """What the scaler saw: skipped steps, a collapsing scale, a non-finite loss."""


class OptState(Enum):
    READY = 0
    UNSCALED = 1
    STEPPED = 2


_EVENT_UNSCALE, _EVENT_STEP = 0, 1


def _refresh_per_optimizer_state() -> dict:
    return {"stage": OptState.READY, "found_inf_per_device": {}}


def _stream(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.current_stream(device).cuda_stream)
    return 0


def _flat_view(g: torch.Tensor):
    """A contiguous 1-d view of g's memory when g is dense in some order (contiguous,
    transposed, permuted: an element-wise pass may then walk its memory in storage
    order); None when g has gaps (a slice) or overlaps (an expanded tensor)."""
    if g.is_contiguous():
        return g
    sizes, strides = g.shape, g.stride()
    order = sorted(range(g.dim()), key=lambda d: strides[d])
    expected = 1
    for d in order:
        if sizes[d] == 1:
            continue
        if strides[d] != expected:
            return None
        expected *= sizes[d]
    return g.as_strided((g.numel(),), (1,))


def _prepare(grads: list, write: bool):
    """Views the kernels can take, plus (original, copy) pairs to write back for
    gradients with gaps. The common case (all contiguous) returns the list as is."""
    if all(map(_is_contiguous, grads)):
        return grads, ()
    views, fixups = [], []
    for g in grads:
        v = _flat_view(g)
        if v is None:
            v = g.contiguous()
            if write:
                fixups.append((g, v))
        views.append(v)
    return views, fixups


class _Replicator:
    """One tensor, copied lazily to each device that asks (torch's _MultiDeviceReplicator)."""

    def __init__(self, master: torch.Tensor):
        self.master = master
        self.per_device: dict = {}

    def get(self, device: torch.device) -> torch.Tensor:
        t = self.per_device.get(device)
        if t is None:
            t = self.master if self.master.device == device else self.master.to(
                device=device, non_blocking=True, copy=True)
            self.per_device[device] = t
        return t


def _as_float(v, name: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float, np.floating, np.integer)):
        raise MemfitTypeError(f"{name}: expected a number, got {type(v).__name__}")
    return float(v)


def _as_int(v, name: str) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise MemfitTypeError(f"{name}: expected an int, got {type(v).__name__}")
    return int(v)


class GradScaler:
    """Dynamic loss scaling for float16 training; a drop-in for ``torch.amp.GradScaler``.

    Args:
        device: ``"cuda"`` (default, as torch) or ``"cpu"``: where the scale lives.
            A CUDA scaler on a machine without CUDA warns and disables itself, as
            torch's does.
        init_scale: initial scale (default 2**16, as torch; :func:`setup` uses 2**10,
            which calibrates in fewer skipped steps).
        growth_factor: multiplies the scale after ``growth_interval`` finite steps in
            a row (> 1).
        backoff_factor: multiplies the scale after a non-finite step (in (0, 1)).
        growth_interval: finite steps in a row before the scale grows.
        enabled: False makes every method a pass-through (``step`` just steps).
        hysteresis: back off only from the N-th consecutive non-finite step on
            (1 = every non-finite step, as torch).
        min_scale, max_scale: bounds on the scale (None = unbounded, as torch).
            Reaching ``min_scale`` with gradients still non-finite warns: that is not
            an overflow the scale can fix.
        nonfinite_loss: a loss that is NaN/Inf when it is scaled (before backward):
            ``"warn"`` (default) behaves as torch (the step is skipped because its
            gradients are non-finite, and the scale backs off) and says so; ``"skip"``
            skips the step without touching the scale (it was not an overflow);
            ``"raise"`` raises FloatingPointError from :meth:`scale` (a host sync).
        warn_after_skips: warn once when this many steps in a row are skipped
            (None: never).

    Misuse raises what torch raises: RuntimeError for ``unscale_`` twice, ``step``
    twice or a ``closure`` keyword; AssertionError for ``step``/``update`` before
    :meth:`scale` and for a bad ``new_scale`` tensor; ValueError for float16
    gradients in :meth:`unscale_`.

    On CUDA, warnings are read from a non-blocking copy of the counters and may come
    one update late; nothing in ``unscale_``/``step``/``update`` waits for the GPU
    except what torch also waits for (a non-fused optimizer's skip decision).
    """

    def __init__(self, device: str = "cuda", init_scale: float = 2.0**16,
                 growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, enabled: bool = True, *,
                 hysteresis: int = 1, min_scale: float | None = None,
                 max_scale: float | None = None, nonfinite_loss: str = "warn",
                 warn_after_skips: int | None = 20) -> None:
        self._device = device.type if isinstance(device, torch.device) else device
        self._enabled = bool(enabled)
        if self._device == "cuda" and self._enabled and not torch.cuda.is_available():
            warnings.warn("memfit.amp.GradScaler is enabled, but CUDA is not available.  Disabling.",
                          stacklevel=2)
            self._enabled = False
        if nonfinite_loss not in ("warn", "skip", "raise"):
            raise MemfitValueError(
                f"nonfinite_loss: expected 'warn', 'skip' or 'raise', got {nonfinite_loss!r}")
        if warn_after_skips is not None and _as_int(warn_after_skips, "warn_after_skips") < 1:
            raise MemfitValueError(f"warn_after_skips: must be >= 1 or None, got {warn_after_skips}")
        self._nonfinite_loss = nonfinite_loss
        self._warn_after_skips = warn_after_skips
        self._state: torch.Tensor | None = None
        self._scale_view: torch.Tensor | None = None
        self._loss_flag: torch.Tensor | None = None
        self._pending = None
        self._saved_words = None
        self._seen = {"loss": 0, "min_clamps": 0, "streak_warned": -1, "below_one": False}
        self._per_optimizer_states: dict = defaultdict(_refresh_per_optimizer_state)
        # gradients unscaled this iteration: by unscale_ ([(grads, found_inf)], O(1) to
        # record) and by clip_grad_norm_(..., scaler=) ({id: (grad, found_inf)})
        self._unscaled_lists: list = []
        self._clip_unscaled: dict = {}
        if self._enabled:
            self._init_scale = _as_float(init_scale, "init_scale")
            if not (math.isfinite(self._init_scale) and self._init_scale > 0):
                raise ScalerConfigError(f"init_scale: must be a finite number > 0, got {init_scale}")
            self._growth_factor = _as_float(growth_factor, "growth_factor")
            self._backoff_factor = _as_float(backoff_factor, "backoff_factor")
            self._growth_interval = _as_int(growth_interval, "growth_interval")
            self._hysteresis = _as_int(hysteresis, "hysteresis")
            self._min_scale = None if min_scale is None else _as_float(min_scale, "min_scale")
            self._max_scale = None if max_scale is None else _as_float(max_scale, "max_scale")
            self._init_growth_tracker = 0
            self._check_config()

    # ---- configuration -------------------------------------------------------------

    def _config(self) -> tuple:
        return (self._growth_factor, self._backoff_factor, self._growth_interval,
                self._hysteresis, self._min_scale or 0.0, self._max_scale or 0.0,
                self._nonfinite_loss == "skip")

    def _check_config(self) -> None:
        try:
            _C.scaler_config_check(self._config())
        except MemfitValueError as e:
            raise ScalerConfigError(str(e)) from None

    def get_growth_factor(self) -> float:
        """The scale growth factor."""
        return self._growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        """Sets the growth factor (> 1; checked now, not at the next update)."""
        old, self._growth_factor = getattr(self, "_growth_factor", None), _as_float(new_factor, "new_factor")
        self._revert_on_error("_growth_factor", old)

    def get_backoff_factor(self) -> float:
        """The scale backoff factor."""
        return self._backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        """Sets the backoff factor (in (0, 1))."""
        old, self._backoff_factor = getattr(self, "_backoff_factor", None), _as_float(new_factor, "new_factor")
        self._revert_on_error("_backoff_factor", old)

    def get_growth_interval(self) -> int:
        """Finite steps in a row before the scale grows."""
        return self._growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        """Sets the growth interval (>= 1)."""
        old, self._growth_interval = getattr(self, "_growth_interval", None), _as_int(new_interval, "new_interval")
        self._revert_on_error("_growth_interval", old)

    def _revert_on_error(self, attr: str, old) -> None:
        if not self._enabled:  # torch's disabled scaler takes any value
            return
        try:
            self._check_config()
        except ScalerConfigError:
            setattr(self, attr, old)
            raise

    def is_enabled(self) -> bool:
        """Whether this scaler scales (False: every method passes through)."""
        return self._enabled

    # ---- state ---------------------------------------------------------------------

    @property
    def _scale(self) -> torch.Tensor | None:
        """The scale as a 0-d float32 view of the state block (torch's ``_scale``)."""
        if self._state is None:
            return None
        if self._scale_view is None:
            self._scale_view = self._state[0]
        return self._scale_view

    @property
    def _growth_tracker(self) -> torch.Tensor | None:
        """The growth tracker as a 0-d int32 view (torch's ``_growth_tracker``)."""
        return None if self._state is None else self._state.view(torch.int32)[1]

    def _lazy_init_scale_growth_tracker(self, dev: torch.device) -> None:
        words = np.zeros(_WORDS, dtype=np.float32)
        _C.scaler_state_init(words, self._init_scale, self._init_growth_tracker)
        if self._saved_words is not None:  # unpickled: keep the statistics and history
            saved = np.array(self._saved_words, dtype=np.float32)
            saved[:2] = words[:2]
            words = saved
            self._saved_words = None
        state = torch.from_numpy(words)
        self._state = state if dev.type == "cpu" else state.to(dev)
        self._scale_view = None

    def _check_scale_growth_tracker(self, funcname: str) -> torch.Tensor:
        if self._state is None:
            raise AssertionError(
                f"Attempted {funcname} but _scale is None.  This may indicate your script did "
                "not use scaler.scale(loss or outputs) earlier in the iteration.")
        return self._state

    def _get_scale_async(self) -> torch.Tensor | None:
        return self._scale

    def get_scale(self) -> float:
        """The current scale as a Python float (1.0 when disabled). Syncs on CUDA."""
        if not self._enabled:
            return 1.0
        return self._init_scale if self._state is None else float(self._state[0].item())

    def _get_growth_tracker(self) -> int:
        if not self._enabled:
            return 0
        if self._state is None:
            return self._init_growth_tracker
        return int(self._growth_tracker.item())

    # ---- scale ---------------------------------------------------------------------

    def scale(self, outputs):
        """Multiplies a tensor, or the tensors in nested lists/tuples/iterables, by the
        scale (returned unchanged when disabled). Also notes whether the loss is already
        NaN/Inf (see ``nonfinite_loss``)."""
        if not self._enabled:
            return outputs
        if isinstance(outputs, torch.Tensor):
            if self._state is None:
                self._lazy_init_scale_growth_tracker(outputs.device)
            self._note_loss(outputs)
            return outputs * self._scale.to(device=outputs.device, non_blocking=True)

        stash: list = []

        def apply_scale(val):
            if isinstance(val, torch.Tensor):
                if not stash:
                    if self._state is None:
                        self._lazy_init_scale_growth_tracker(val.device)
                    stash.append(_Replicator(self._scale))
                self._note_loss(val)
                return val * stash[0].get(val.device)
            if isinstance(val, abc.Iterable):
                it = map(apply_scale, val)
                if isinstance(val, (list, tuple)):
                    return type(val)(it)
                return it
            raise ValueError("outputs must be a Tensor or an iterable of Tensors")

        return apply_scale(outputs)

    def _note_loss(self, t: torch.Tensor) -> None:
        if not t.is_floating_point():
            return
        if self._nonfinite_loss == "raise" or t.device.type == "cpu":
            bad = not bool(torch.isfinite(t).all())
            if bad and self._nonfinite_loss == "raise":
                raise FloatingPointError(
                    "memfit.amp.GradScaler: the loss is already NaN/Inf before backward "
                    "(nonfinite_loss='raise'). This is not an fp16 gradient overflow: look at the "
                    "inputs, the loss function (log of 0, division by 0) or a learning rate that "
                    "diverged.")
            if bad:
                self._loss_flag = torch.ones((), dtype=torch.float32, device=self._state.device)
            return
        bad = torch.isfinite(t).logical_not_().any().to(self._state.device, torch.float32)
        self._loss_flag = bad if self._loss_flag is None else torch.maximum(self._loss_flag, bad)

    # ---- unscale / step ----------------------------------------------------------------

    def _optimizer_grads(self, optimizer, allow_fp16: bool) -> list:
        """The tensors to unscale for an optimizer (sparse gradients: their values)."""
        fp16 = torch.float16
        out = []
        append = out.append
        for group in optimizer.param_groups:
            for param in group["params"]:
                if not isinstance(param, torch.Tensor):
                    raise AssertionError(
                        f"expected param to be torch.Tensor, got {type(param).__name__}")
                g = param.grad
                if g is None:
                    continue
                if g.dtype is fp16 and not allow_fp16:
                    raise ValueError("Attempting to unscale FP16 gradients.")
                if g.is_sparse:
                    if g.dtype is fp16:
                        param.grad = g = g.coalesce()
                    g = g._values()
                append(g)
        return out

    def _unscale_tensors_(self, grads, scale, skip: dict | None = None):
        """Unscales (scale is a tensor) or only checks (scale None) `grads`, one fused C
        call per device. Gradients in `skip` ({id: (grad, found_inf)}: already unscaled
        this iteration) are not touched again; their found_inf is folded in instead.
        Returns ({device: found_inf}, {device: the gradients it unscaled or checked})."""
        per_device: dict = {}
        done: dict = {}
        others = False
        for g in grads:
            if skip:
                prev = skip.get(id(g))
                if prev is not None and prev[0] is g:
                    done.setdefault(g.device, []).append(prev[1])
                    continue
            if not others:
                dt = g.dtype
                others = not (dt is _F32 or dt is _BF16 or dt is _F16)
            key = g.device
            lst = per_device.get(key)
            if lst is None:
                per_device[key] = lst = []
            lst.append(g)
        scale_r = None if scale is None else _Replicator(scale)
        found: dict = {}
        with torch.no_grad():
            for device in list(per_device) + [d for d in done if d not in per_device]:
                dgrads = per_device.get(device, [])
                fi = torch.zeros((), dtype=torch.float32, device=device)
                other = []
                if others:
                    other = [g for g in dgrads if g.dtype not in _FUSED_DTYPES]
                    dgrads = [g for g in dgrads if g.dtype in _FUSED_DTYPES]
                views, fixups = _prepare(dgrads, write=scale is not None)
                s = None if scale_r is None else scale_r.get(device)
                _C.unscale_grads(views, s, fi, _stream(device))
                for g, c in fixups:
                    g.copy_(c)
                if other:  # float64 gradients: torch's own kernel, as torch would
                    inv = (torch.ones((), device=device) if s is None
                           else s.double().reciprocal().float())
                    torch._amp_foreach_non_finite_check_and_unscale_(other, fi, inv)
                for prev in done.get(device, ()):
                    torch.maximum(fi, prev, out=fi)  # stays 0 or 1: fused optimizers count on it
                found[device] = fi
        return found, per_device

    def _unscale_grads_(self, optimizer, scale, found_inf=None, allow_fp16: bool = False) -> dict:
        found, unscaled = self._unscale_tensors_(self._optimizer_grads(optimizer, allow_fp16),
                                                 scale, self._clip_unscaled)
        if scale is not None:
            for device, grads in unscaled.items():
                self._unscaled_lists.append((grads, found[device]))
        return found

    def _unscale_for_clip_(self, grads: list) -> None:
        """clip_grad_norm_(..., scaler=) without the optimizer: unscale what unscale_ has
        not, and record it so that step()/unscale_() skip it but keep its inf/NaN."""
        skip = dict(self._clip_unscaled)
        for lst, fi in self._unscaled_lists:
            for g in lst:
                skip[id(g)] = (g, fi)
        found, unscaled = self._unscale_tensors_(grads, self._scale, skip)
        for device, lst in unscaled.items():
            for g in lst:
                self._clip_unscaled[id(g)] = (g, found[device])

    def unscale_(self, optimizer) -> None:
        """Divides the optimizer's gradients by the scale in place (one fused pass per
        device) and records whether any was NaN/Inf. Optional: :meth:`step` unscales
        if this was not called. Once per optimizer per iteration."""
        if not self._enabled:
            return
        self._check_scale_growth_tracker("unscale_")
        opt_state = self._per_optimizer_states[id(optimizer)]
        nxt = _C.scaler_stage_next(opt_state["stage"].value, _EVENT_UNSCALE)
        opt_state["found_inf_per_device"] = self._unscale_grads_(optimizer, self._scale, None, False)
        opt_state["stage"] = OptState(nxt)

    def _check_inf_per_device(self, optimizer) -> dict:
        self._check_scale_growth_tracker("_check_inf_per_device")
        found = self._unscale_grads_(optimizer, None, None, True)
        self._per_optimizer_states[id(optimizer)]["found_inf_per_device"] = found
        return found

    def _found_inf_per_device(self, optimizer) -> dict:
        return self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]

    def _loss_skip_flag(self, device):
        if self._nonfinite_loss == "skip" and self._loss_flag is not None:
            return self._loss_flag.to(device, non_blocking=True)
        return None

    def step(self, optimizer, *args: Any, **kwargs: Any):
        """Unscales (unless :meth:`unscale_` was called) and runs ``optimizer.step(*args,
        **kwargs)`` unless a gradient is NaN/Inf. Optimizers that advertise
        ``_step_supports_amp_scaling`` (torch's fused AdamW/Adam/SGD, memfit's
        optimizers) get ``optimizer.grad_scale`` and ``optimizer.found_inf`` instead and
        skip on the device, with no host sync. Returns what ``optimizer.step`` returns
        (None when skipped)."""
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        self._check_scale_growth_tracker("step")
        opt_state = self._per_optimizer_states[id(optimizer)]
        nxt = _C.scaler_stage_next(opt_state["stage"].value, _EVENT_STEP)

        if getattr(optimizer, "_step_supports_amp_scaling", False):
            kwargs_ = kwargs
            has_grad_scaler_kwarg = "grad_scaler" in inspect.signature(optimizer.step).parameters
            if has_grad_scaler_kwarg:
                warnings.warn(
                    "GradScaler is going to stop passing itself as a keyword argument to the "
                    "passed optimizer. In the near future GradScaler registers `grad_scale: Tensor` "
                    "and `found_inf: Tensor` to the passed optimizer and let the optimizer use them "
                    "directly.", FutureWarning, stacklevel=2)
                kwargs_.update({"grad_scaler": self})
            else:
                if opt_state["stage"] is OptState.READY and self._clip_unscaled and any(
                        id(g) in self._clip_unscaled
                        for g in self._optimizer_grads(optimizer, True)):
                    # some gradients were unscaled already (clip_grad_norm_ with scaler=):
                    # unscale the rest too, and step as after unscale_ (grad_scale None)
                    self.unscale_(optimizer)
                if opt_state["stage"] is OptState.READY:
                    self._check_inf_per_device(optimizer)
                scale = self._scale
                flags = [t.to(scale.device, non_blocking=True)
                         for t in opt_state["found_inf_per_device"].values()]
                loss = self._loss_skip_flag(scale.device)
                if loss is not None:
                    flags.append(loss)
                found_inf = sum(flags)
                if len(flags) > 1:
                    # several devices (or the loss flag): torch passes the sum, but fused
                    # kernels subtract found_inf from their step count, so keep it 0 or 1
                    found_inf = found_inf.clamp_(max=1.0)
                optimizer.grad_scale = (getattr(optimizer, "grad_scale", None)
                                        if opt_state["stage"] is OptState.UNSCALED
                                        else scale * getattr(optimizer, "grad_scale", 1))
                optimizer.found_inf = found_inf
            retval = optimizer.step(*args, **kwargs_)
            opt_state["stage"] = OptState(nxt)
            if not has_grad_scaler_kwarg:
                del optimizer.grad_scale
                del optimizer.found_inf
            return retval

        if opt_state["stage"] is OptState.READY:
            self.unscale_(optimizer)
        if len(opt_state["found_inf_per_device"]) == 0:
            raise AssertionError("No inf checks were recorded for this optimizer.")
        skip = sum(v.item() for v in opt_state["found_inf_per_device"].values())
        if self._nonfinite_loss == "skip" and self._loss_flag is not None:
            skip += self._loss_flag.item()
        retval = None
        if not skip:
            retval = optimizer.step(*args, **kwargs)
        opt_state["stage"] = OptState(nxt)
        return retval

    # ---- update ------------------------------------------------------------------------

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Updates the scale: backoff after a non-finite step, growth after
        ``growth_interval`` finite ones (see the class doc for the extras). With
        ``new_scale`` (a float or a 1-element float32 tensor on the scaler's device),
        sets the scale instead. Call once per iteration, after every ``step``."""
        if not self._enabled:
            return
        state = self._check_scale_growth_tracker("update")
        if new_scale is not None:
            if isinstance(new_scale, (float, int)) and not isinstance(new_scale, bool):
                state[0].fill_(float(new_scale))
            elif isinstance(new_scale, torch.Tensor):
                reason = ("new_scale should be a float or a 1-element torch.cuda.FloatTensor or "
                          "torch.FloatTensor with requires_grad=False.")
                if new_scale.device.type != self._device:
                    raise AssertionError(reason)
                if new_scale.numel() != 1:
                    raise AssertionError(reason)
                if new_scale.requires_grad is True:
                    raise AssertionError(reason)
                state[0].copy_(new_scale.reshape(()))
            else:
                raise MemfitTypeError(
                    f"new_scale: expected a float or a 1-element tensor, got {type(new_scale).__name__}")
        else:
            flags = [fi.to(device=state.device, non_blocking=True)
                     for st in self._per_optimizer_states.values()
                     for fi in st["found_inf_per_device"].values()]
            if len(flags) == 0:
                raise AssertionError("No inf checks were recorded prior to update.")
            if len(flags) > _LAYOUT["max_flags"]:
                flags = [torch.stack(flags).sum()]
            _C.scaler_update(state, flags, self._loss_flag, self._config(), _stream(state.device))
            self._after_update()
        self._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)
        self._loss_flag = None
        self._unscaled_lists = []
        self._clip_unscaled = {}

    # ---- statistics and warnings --------------------------------------------------------

    def _after_update(self) -> None:
        state = self._state
        if state.device.type == "cpu":
            self._inspect(state.numpy().view(np.uint32))
            return
        if self._pending is not None and self._pending[1].query():
            self._inspect(self._pending[0].numpy().view(np.uint32))
            self._pending = None
        if self._pending is None:
            buf = torch.empty(_HEAD, dtype=torch.float32, pin_memory=True)
            buf.copy_(state[:_HEAD], non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(state.device))
            self._pending = (buf, ev)

    def _inspect(self, w: np.ndarray) -> None:
        L, seen = _LAYOUT, self._seen
        consec, loss_bad = int(w[L["consec_inf"]]), int(w[L["loss_nonfinite"]])
        if consec == 0 and loss_bad == seen["loss"] and (seen["below_one"] or w[0] >= _ONE_BITS):
            return  # a clean step: nothing to say (positive floats order like their bits)
        scale = float(w[L["scale"]:L["scale"] + 1].view(np.float32)[0])
        updates = int(w[L["updates"]])
        if loss_bad > seen["loss"]:
            first, seen["loss"] = seen["loss"], loss_bad
            # say it the first time and then each time the count doubles
            if first == 0 or loss_bad >= 2 * first:
                what = {"warn": "its gradients are non-finite, so the step was skipped and the "
                                "scale backed off as if fp16 had overflowed",
                        "skip": "the step was skipped and the scale left as it was",
                        "raise": ""}[self._nonfinite_loss]
                hint = (" Pass nonfinite_loss='skip' to keep the scale, or 'raise' to stop at the "
                        "first one." if self._nonfinite_loss == "warn" else "")
                warnings.warn(
                    f"memfit.amp.GradScaler: the loss was already NaN/Inf before backward "
                    f"({loss_bad} time(s) in {updates} steps); {what}. A non-finite loss is not an "
                    f"fp16 overflow: check the inputs, the loss (log(0), 0/0) and the learning "
                    f"rate.{hint}", ScalerWarning, stacklevel=4)
        streak_start = updates - consec
        min_clamps = int(w[L["min_clamps"]])
        if min_clamps > seen["min_clamps"]:
            seen["min_clamps"] = min_clamps
            if seen["streak_warned"] != streak_start:
                seen["streak_warned"] = streak_start
                warnings.warn(
                    f"memfit.amp.GradScaler: the scale reached min_scale={self._min_scale:g} and the "
                    f"gradients are still NaN/Inf ({consec} step(s) in a row skipped). Scaling "
                    f"cannot fix this: something produces NaN/Inf at any scale (bad inputs, a "
                    f"diverged model, an fp16 overflow in the forward pass). Steps stay skipped "
                    f"until the gradients are finite.", ScalerWarning, stacklevel=4)
        if (self._warn_after_skips is not None and consec >= self._warn_after_skips
                and seen["streak_warned"] != streak_start):
            seen["streak_warned"] = streak_start
            warnings.warn(
                f"memfit.amp.GradScaler: {consec} optimizer steps in a row were skipped because "
                f"gradients had NaN/Inf; the scale is now {scale:g} (backoff_factor="
                f"{self._backoff_factor}). If the scale keeps falling the NaN/Inf do not come from "
                f"loss scaling: look at the loss, the inputs and the learning rate; "
                f"scaler.stats() has the history.", ScalerWarning, stacklevel=4)
        if self._min_scale is None and scale < 1.0 and not seen["below_one"]:
            seen["below_one"] = True
            warnings.warn(
                f"memfit.amp.GradScaler: the scale fell below 1 ({scale:g}), so gradients are now "
                f"scaled down, not up. This usually means NaN/Inf that scaling cannot fix (for "
                f"example a bf16-pretrained model run in fp16). Set min_scale to stop the fall.",
                ScalerWarning, stacklevel=4)

    def stats(self) -> dict:
        """What happened so far (syncs on CUDA): ``scale``, ``growth_tracker``, ``steps``
        (updates that applied the rule), ``skipped_steps``, ``skip_rate``,
        ``consecutive_skipped``, ``longest_skip_streak``, ``backoffs``, ``growths``,
        ``min_scale_hits``, ``max_scale_hits``, ``overflow_holds`` (growths refused because
        the scale would overflow float32), ``nonfinite_losses``, and ``history``: the last
        up to 240 steps as ``(step, scale used, skipped)`` tuples, with
        ``skipped_recent`` the steps among them that were skipped."""
        if not self._enabled or self._state is None:
            return {"enabled": self._enabled, "scale": self.get_scale(), "steps": 0,
                    "skipped_steps": 0, "history": [], "skipped_recent": []}
        w = self._state.detach().cpu().numpy().view(np.uint32)
        L = _LAYOUT
        f32 = w.view(np.float32)
        updates, skipped = int(w[L["updates"]]), int(w[L["skipped"]])
        n = min(updates, L["history_len"])
        history = []
        for step in range(updates - n, updates):
            v = float(f32[L["history"] + step % L["history_len"]])
            history.append((step, abs(v), v < 0 or (v == 0 and math.copysign(1, v) < 0)))
        return {
            "enabled": True,
            "scale": float(f32[L["scale"]]),
            "growth_tracker": int(w[L["growth_tracker"]]),
            "steps": updates,
            "skipped_steps": skipped,
            "skip_rate": skipped / updates if updates else 0.0,
            "consecutive_skipped": int(w[L["consec_inf"]]),
            "longest_skip_streak": int(w[L["max_consec_inf"]]),
            "backoffs": int(w[L["backoffs"]]),
            "growths": int(w[L["growths"]]),
            "min_scale_hits": int(w[L["min_clamps"]]),
            "max_scale_hits": int(w[L["max_clamps"]]),
            "overflow_holds": int(w[L["overflow_holds"]]),
            "nonfinite_losses": int(w[L["loss_nonfinite"]]),
            "history": history,
            "skipped_recent": [s for s, _, sk in history if sk],
        }

    # ---- state_dict and pickling ----------------------------------------------------------

    def state_dict(self) -> dict:
        """torch's five keys: ``scale``, ``growth_factor``, ``backoff_factor``,
        ``growth_interval``, ``_growth_tracker`` (empty when disabled). Loads into
        ``torch.amp.GradScaler`` and back."""
        if not self._enabled:
            return {}
        return {"scale": self.get_scale(), "growth_factor": self._growth_factor,
                "backoff_factor": self._backoff_factor, "growth_interval": self._growth_interval,
                "_growth_tracker": self._get_growth_tracker()}

    def load_state_dict(self, state_dict: dict) -> None:
        """Loads what :meth:`state_dict` (memfit's or torch's) returned. Raises
        RuntimeError for an empty dict (saved from a disabled scaler), as torch does."""
        if not self._enabled:
            return
        if len(state_dict) == 0:
            raise RuntimeError("The source state dict is empty, possibly because it was saved "
                               "from a disabled instance of GradScaler.")
        scale = float(state_dict["scale"])
        tracker = int(state_dict["_growth_tracker"])
        old = (self._growth_factor, self._backoff_factor, self._growth_interval)
        self._growth_factor = float(state_dict["growth_factor"])
        self._backoff_factor = float(state_dict["backoff_factor"])
        self._growth_interval = int(state_dict["growth_interval"])
        try:
            self._check_config()
        except ScalerConfigError:
            self._growth_factor, self._backoff_factor, self._growth_interval = old
            raise
        self._init_scale = scale
        self._init_growth_tracker = tracker
        if self._state is not None:
            self._state[0].fill_(scale)
            self._growth_tracker.fill_(tracker)

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        if self._enabled:
            if len(self._per_optimizer_states) != 0 or self._clip_unscaled:
                raise AssertionError(
                    "A GradScaler instance may only be pickled at the beginning of an iteration, "
                    "or at the end after scaler.update().")
            state["_init_scale"] = self.get_scale()
            state["_init_growth_tracker"] = self._get_growth_tracker()
            if self._state is not None:
                state["_saved_words"] = self._state.detach().cpu().numpy().copy()
        state["_state"] = None
        state["_scale_view"] = None
        state["_loss_flag"] = None
        state["_pending"] = None
        state["_per_optimizer_states"] = None
        state["_unscaled_lists"] = []
        state["_clip_unscaled"] = {}
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)


# ---- clipping ---------------------------------------------------------------------------


def clip_grad_norm_(parameters, max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False, foreach: bool | None = None, *,
                    scaler: GradScaler | None = None, optimizer=None) -> torch.Tensor:
    """Clips the gradients' global norm to ``max_norm`` in place and returns the norm
    (a float32 0-d tensor), like ``torch.nn.utils.clip_grad_norm_``, in one fused pass
    per device for the norm and one for the clip, with no host sync.

    With ``scaler=`` (enabled), the gradients are unscaled first, so the norm is the
    true one: through ``scaler.unscale_(optimizer)`` when ``optimizer=`` is given (or
    the optimizer is passed as ``parameters``), else directly; either way the scaler
    records which gradients it unscaled this iteration, so ``scaler.step`` neither
    unscales them twice nor forgets their inf/NaN.

    ``foreach`` is accepted for signature compatibility and ignored. Float64 or
    sparse gradients, and norm types other than p > 0 / inf, are handed to torch's
    own function.
    """
    if isinstance(parameters, torch.optim.Optimizer):
        optimizer = parameters if optimizer is None else optimizer
        parameters = [p for g in parameters.param_groups for p in g["params"]]
    elif isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    params = list(parameters)
    if scaler is not None and scaler.is_enabled():
        if optimizer is not None:
            if scaler._per_optimizer_states[id(optimizer)]["stage"] is OptState.READY:
                scaler.unscale_(optimizer)
        else:
            # unscale these gradients now; the scaler records them, so step()/unscale_()
            # will not unscale them again and will still skip on their inf/NaN
            scaler._check_scale_growth_tracker("clip_grad_norm_")
            pending = [p.grad for p in params if p.grad is not None]
            if any(g.is_sparse for g in pending):
                raise MemfitValueError(
                    "parameters: sparse gradients with scaler= need optimizer=... (the scaler "
                    "tracks their unscaling per optimizer)")
            if any(g.dtype is torch.float16 for g in pending):
                raise ValueError("Attempting to unscale FP16 gradients.")
            scaler._unscale_for_clip_(pending)
    max_norm = _as_float(max_norm, "max_norm")
    norm_type = _as_float(norm_type, "norm_type")
    grads = [p.grad for p in params if p.grad is not None]
    if len(grads) == 0:
        return torch.tensor(0.0)
    if (not (norm_type > 0) or any(g.is_sparse or g.dtype not in _FUSED_DTYPES for g in grads)):
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type,
                                              error_if_nonfinite=error_if_nonfinite)
    per_device: dict = defaultdict(list)
    for g in grads:
        per_device[g.device].append(g)
    norms = []
    with torch.no_grad():
        for device, gs in per_device.items():
            views, _ = _prepare(gs, write=False)
            out = torch.empty((), dtype=torch.float32, device=device)
            ws = None
            if device.type == "cuda":
                ws = torch.empty(max(1, _C.mt_num_chunks([v.numel() for v in views])),
                                 dtype=torch.float32, device=device)
            _C.grad_norm(views, norm_type, ws, out, _stream(device))
            norms.append(out)
        first = grads[0].device
        if len(norms) == 1:
            total = norms[0]
        elif math.isinf(norm_type):
            total = torch.stack([n.to(first) for n in norms]).max()
        else:
            total = torch.stack([n.to(first).double() for n in norms]).pow(norm_type).sum().pow(
                1.0 / norm_type).float()
        if error_if_nonfinite and bool(torch.logical_or(total.isnan(), total.isinf())):
            raise RuntimeError(
                f"The total norm of order {norm_type} for gradients from `parameters` is "
                "non-finite, so it cannot be clipped. To disable this error and scale the "
                "gradients by the non-finite norm anyway, set `error_if_nonfinite=False`")
        for device, gs in per_device.items():
            views, fixups = _prepare(gs, write=True)
            _C.clip_grads(views, total.to(device, non_blocking=True), max_norm, _stream(device))
            for g, c in fixups:
                g.copy_(c)
    return total


# ---- precision and autocast -----------------------------------------------------------------

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class Precision(str):
    """``"bf16"``, ``"fp16"`` or ``"fp32"`` (compares equal to the string), with
    ``.dtype``, ``.device`` and ``.reason``."""

    dtype: torch.dtype
    device: str
    reason: str

    def __new__(cls, name: str, device: str, reason: str):
        self = super().__new__(cls, name)
        self.dtype = _DTYPES[name]
        self.device = device
        self.reason = reason
        return self

    def __repr__(self) -> str:
        return f"Precision({str(self)!r}, device={self.device!r}, reason={self.reason!r})"


def _default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def precision(device=None) -> Precision:
    """The best autocast precision for ``device`` (default: the current CUDA device if
    there is one, else the CPU), with the reason:

    * ``"bf16"`` on GPUs of compute capability >= 8.0 (A100, RTX 30xx/40xx, H100) and
      on CPUs that compute bfloat16 natively (AMX, AVX512-BF16, Arm BF16) or measurably
      faster (:func:`memfit.hardware.cpu_precision`): bfloat16 has float32's range, so no
      loss scaling is needed;
    * ``"fp16"`` on GPUs with float16 tensor cores but no native bfloat16 (T4, V100,
      RTX 20xx: capability 7.x) and on P100 (6.0): use a GradScaler;
    * ``"fp32"`` where neither is faster (older GPUs, CPUs that would emulate bfloat16,
      other devices).

    >>> precision("cpu") in ("bf16", "fp32")
    True
    """
    if device is None:
        device = _default_device()
    dev = torch.device(device) if not isinstance(device, torch.device) else device
    if dev.type == "cpu":
        from memfit.hardware import cpu_precision

        name, reason = cpu_precision()
        return Precision(name, "cpu", reason)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            return Precision("fp32", str(dev), "CUDA is not available")
        major, minor = torch.cuda.get_device_capability(dev)
        name = torch.cuda.get_device_name(dev)
        cap = f"{name}, compute capability {major}.{minor}"
        if major >= 8:
            return Precision("bf16", str(dev), f"{cap}: native bfloat16 tensor cores; bfloat16 "
                             "has float32's range, so no GradScaler is needed")
        if major == 7 or (major, minor) == (6, 0):
            return Precision("fp16", str(dev), f"{cap}: float16 tensor cores but no native "
                             "bfloat16; use float16 with a GradScaler")
        return Precision("fp32", str(dev), f"{cap}: no fast float16 or bfloat16 arithmetic")
    if dev.type == "mps":
        return Precision("fp16", "mps", "Apple GPUs run float16 natively; use a GradScaler")
    return Precision("fp32", str(dev), f"no mixed-precision recommendation for {dev.type}")


class AutocastContext:
    """A reusable, re-entrant ``torch.autocast``: each ``with`` opens a fresh one.
    ``enabled`` is False for fp32 (autocast then does nothing)."""

    def __init__(self, device_type: str, dtype: torch.dtype, enabled: bool = True,
                 cache_enabled: bool | None = None):
        self.device_type, self.dtype, self.enabled = device_type, dtype, enabled
        self.cache_enabled = cache_enabled
        self._stack: list = []

    def _make(self):
        if not self.enabled:
            return nullcontext()
        kw = {} if self.cache_enabled is None else {"cache_enabled": self.cache_enabled}
        return torch.autocast(device_type=self.device_type, dtype=self.dtype, **kw)

    def __enter__(self):
        ctx = self._make()
        self._stack.append(ctx)
        return ctx.__enter__()

    def __exit__(self, *exc):
        return self._stack.pop().__exit__(*exc)

    def __repr__(self) -> str:
        return (f"AutocastContext(device_type={self.device_type!r}, dtype={self.dtype}, "
                f"enabled={self.enabled})")


def _dtype_of(p) -> torch.dtype:
    if isinstance(p, torch.dtype):
        return p
    name = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32"}.get(p, p)
    if name not in _DTYPES:
        raise MemfitValueError(f"precision: expected 'auto', 'bf16', 'fp16', 'fp32' or a torch "
                               f"dtype, got {p!r}")
    return _DTYPES[name]


def autocast(device_type: str | None = None, dtype: torch.dtype | str | None = None,
             enabled: bool = True, cache_enabled: bool | None = None) -> AutocastContext:
    """``torch.autocast`` with the dtype :func:`precision` picks for the device
    (``device_type`` default: ``"cuda"`` when available, else ``"cpu"``). For fp32 the
    context is disabled (autocast has nothing to do)."""
    if device_type is None:
        device_type = _default_device()
    if dtype is None:
        dt = precision(device_type).dtype
    else:
        dt = _dtype_of(dtype)
    return AutocastContext(device_type, dt, enabled and dt != torch.float32, cache_enabled)


_bf16_notice_given = False


def setup(model, optimizer=None, precision: str | torch.dtype = "auto", *,
          init_scale: float | None = None, device: str | None = None, **scaler_kwargs):
    """The autocast context and a GradScaler for ``model``'s device.

    ``precision="auto"`` asks :func:`memfit.amp.precision`. The scaler is enabled
    only for fp16, with ``init_scale=2**10`` unless given (a 2**16 start costs a few
    skipped steps while the scale calibrates; 2**10 rarely overflows and grows to
    where it should). For bf16 and fp32 the scaler is disabled (every method passes
    through, so the same loop works), and the first time this says why.

    ``optimizer`` is accepted so the call reads as the loop does; it is not modified.
    Extra keyword arguments go to :class:`GradScaler` (``hysteresis``, ``min_scale``,
    ...). Returns ``(autocast_context, scaler)``.
    """
    global _bf16_notice_given
    del optimizer
    if device is None:
        p = next(iter(model.parameters()), None) if hasattr(model, "parameters") else None
        device = p.device.type if p is not None else _default_device()
    device = torch.device(device).type
    if isinstance(precision, str) and precision == "auto":
        choice = globals()["precision"](device)
        dt = choice.dtype
    else:
        dt = _dtype_of(precision)
    ctx = AutocastContext(device, dt, dt != torch.float32)
    if dt == torch.float16:
        scaler = GradScaler(device=device, init_scale=2.0**10 if init_scale is None else init_scale,
                            **scaler_kwargs)
    else:
        scaler = GradScaler(device=device, enabled=False, **scaler_kwargs)
        if dt == torch.bfloat16 and not _bf16_notice_given:
            _bf16_notice_given = True
            warnings.warn("memfit.amp.setup: bfloat16 autocast has float32's exponent range, so "
                          "gradients do not overflow and no loss scaling is needed; the "
                          "GradScaler is disabled (its methods pass through).", ScalerWarning,
                          stacklevel=2)
    return ctx, scaler


# ---- gradient accumulation ---------------------------------------------------------------------


class GradAccumulator:
    """Gradient accumulation over ``steps`` micro-batches, with the details right:

    * each micro-batch loss is divided by ``steps`` before backward, so the summed
      gradient is the mean over the whole batch;
    * the optimizer only steps at the boundary: (with a scaler) unscale, optional
      clipping to ``max_grad_norm``, ``scaler.step``, ``scaler.update``; then
      ``optimizer.zero_grad(set_to_none=True)``;
    * :meth:`sync_context` skips DDP's gradient all-reduce on non-boundary micro-batches
      (``model.no_sync()``) when given a DDP model;
    * :meth:`flush` steps on a partial accumulation at the end of an epoch, rescaling
      the gradients by ``steps / micro_batches_seen`` so it is still a mean.

    Works with a scaler (enabled or disabled) or without one::

        acc = GradAccumulator(optimizer, steps=4, scaler=scaler, max_grad_norm=1.0)
        for x, y in loader:
            with acc.sync_context(model), autocast:
                loss = loss_fn(model(x), y)
            acc.backward(loss)     # steps on every 4th call
        acc.flush()
    """

    def __init__(self, optimizer, steps: int, scaler: GradScaler | None = None, *,
                 max_grad_norm: float | None = None, norm_type: float = 2.0):
        self.optimizer = optimizer
        self.steps = _as_int(steps, "steps")
        if self.steps < 1:
            raise MemfitValueError(f"steps: must be >= 1, got {steps}")
        self.scaler = scaler
        self.max_grad_norm = None if max_grad_norm is None else _as_float(max_grad_norm, "max_grad_norm")
        self.norm_type = norm_type
        self.micro = 0
        self.optimizer_steps = 0
        self.last_grad_norm: torch.Tensor | None = None

    @property
    def at_boundary(self) -> bool:
        """True when the next :meth:`backward` completes an accumulation."""
        return self.micro + 1 >= self.steps

    def sync_context(self, model):
        """``model.no_sync()`` unless the next backward is a boundary (DDP); a null
        context for models without ``no_sync``."""
        if not self.at_boundary and hasattr(model, "no_sync"):
            return model.no_sync()
        return nullcontext()

    def backward(self, loss: torch.Tensor, **backward_kwargs) -> bool:
        """Backward of ``loss / steps`` (scaled when there is a scaler); steps at the
        boundary. Returns True when the optimizer was stepped (or its step skipped by
        the scaler) on this call."""
        loss = loss / self.steps
        if self.scaler is not None:
            loss = self.scaler.scale(loss)
        loss.backward(**backward_kwargs)
        self.micro += 1
        if self.micro >= self.steps:
            self._step()
            return True
        return False

    def flush(self) -> bool:
        """Steps on a partial accumulation (rescaled to a mean); False if there was none."""
        if self.micro == 0:
            return False
        if self.micro != self.steps:
            factor = self.steps / self.micro
            with torch.no_grad():
                for group in self.optimizer.param_groups:
                    for p in group["params"]:
                        if p.grad is not None:
                            p.grad.mul_(factor)
        self._step()
        return True

    def _step(self) -> None:
        opt, scaler = self.optimizer, self.scaler
        if self.max_grad_norm is not None:
            params = [p for g in opt.param_groups for p in g["params"]]
            self.last_grad_norm = clip_grad_norm_(params, self.max_grad_norm, self.norm_type,
                                                  scaler=scaler, optimizer=opt)
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad(set_to_none=True)
        self.micro = 0
        self.optimizer_steps += 1
