"""memfit.amp.GradScaler: dynamic loss scaling, a drop-in for torch.amp.GradScaler.

The update rule and the device-side found_inf live in memfit's C core (one C function,
``csrc/include/memfit/scaler.h``, on host memory or in one CUDA launch); the per-optimizer
stage check (READY -> UNSCALED -> STEPPED) is plain Python, as in torch.
"""

from __future__ import annotations

import inspect
import math
import warnings
from collections import abc, defaultdict
from enum import Enum
from typing import Any

import numpy as np
import torch

from memfit import _C
from memfit._C import MemfitTypeError, MemfitValueError
from memfit.amp import _dist, in_kernel
from memfit.amp.report import ScalerReport
from memfit.amp._grads import (_BF16, _F16, _F32, _FUSED_DTYPES, _Replicator, _as_float, _as_int,
                               _prepare, _stream)

_LAYOUT = _C.scaler_layout()
_WORDS = _LAYOUT["words"]
_STATE_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")
_INT32_MAX = 2**31 - 1


class ScalerConfigError(MemfitValueError, AssertionError):
    """A bad scaler setting. Also an AssertionError, which is what torch raises for
    ``growth_factor <= 1`` and ``backoff_factor >= 1``."""


def _float32(v: float) -> float:
    """v as the float32 the scaler computes in (inf where float32 overflows)."""
    with np.errstate(over="ignore"):
        return float(np.float32(v))


def _check_scale(v, name: str) -> float:
    """A scale: a number > 0 that stays finite and non-zero in float32."""
    if torch.is_tensor(v) and v.numel() == 1:
        v = v.item()
    f = _as_float(v, name)
    if not (math.isfinite(f) and f > 0 and math.isfinite(_float32(f)) and _float32(f) > 0):
        raise ScalerConfigError(f"{name}: must be a finite number > 0 within float32's range "
                                f"(about 1.4e-45 to 3.4e38: the scale is a float32), got {v!r}")
    return f


def _echo_given(message: str, given: dict) -> str:
    """The core checks the config as it will hold it (float32, int32 clamped to
    [0, 2**31 - 1]); its message echoes that. Echo the value the caller gave instead,
    and what float32 made of it where that is the reason."""
    name = message.split(":", 1)[0]
    if name not in given or ", got " not in message:
        if name == "min_scale" and "larger than max_scale" in message:
            return (f"min_scale: {given['min_scale']!r} is larger than max_scale "
                    f"{given['max_scale']!r}")
        return message
    v = given[name]
    text = f"{message.rsplit(', got ', 1)[0]}, got {v!r}"
    if isinstance(v, float) and not math.isnan(v) and _float32(v) != v:
        text += f" ({_float32(v)!r} in float32, which the scaler computes in)"
    return text


class OptState(Enum):
    """Where an optimizer is in the current iteration (torch's OptState): unscale_ moves
    READY to UNSCALED, step moves READY or UNSCALED to STEPPED, update returns every
    optimizer to READY. Anything else is misuse, and raises what torch raises."""

    READY = 0
    UNSCALED = 1
    STEPPED = 2


def _refresh_per_optimizer_state() -> dict:
    return {"stage": OptState.READY, "found_inf_per_device": {}}


class GradScaler(ScalerReport):
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
        process_group: the ranks that must agree on skipping a step (None: the
            default group). When torch.distributed is initialized with more than one
            rank there, the inf/NaN flag is all-reduced (MAX) once per optimizer step,
            so a non-finite gradient on any rank makes every rank skip and back off
            alike. DTensor gradients (FSDP2) are unscaled on their local shards.

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
                 warn_after_skips: int | None = 20, process_group=None) -> None:
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
        self._process_group = process_group
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
            self._init_scale = _check_scale(init_scale, "init_scale")
            self._growth_factor = _as_float(growth_factor, "growth_factor")
            self._backoff_factor = _as_float(backoff_factor, "backoff_factor")
            self._growth_interval = _as_int(growth_interval, "growth_interval")
            self._hysteresis = _as_int(hysteresis, "hysteresis")
            self._min_scale = None if min_scale is None else _as_float(min_scale, "min_scale")
            self._max_scale = None if max_scale is None else _as_float(max_scale, "max_scale")
            self._init_growth_tracker = 0
            self._check_config()

    # ---- configuration -------------------------------------------------------------

    def _settings(self) -> dict:
        """The update rule's settings, by the names the constructor takes."""
        return {"growth_factor": self._growth_factor, "backoff_factor": self._backoff_factor,
                "growth_interval": self._growth_interval, "hysteresis": self._hysteresis,
                "min_scale": self._min_scale, "max_scale": self._max_scale}

    def _config(self, settings: dict | None = None) -> tuple:
        """The settings (the scaler's own, or these) as the core's config tuple."""
        c = self._settings() if settings is None else settings
        return (c["growth_factor"], c["backoff_factor"], c["growth_interval"], c["hysteresis"],
                c["min_scale"] or 0.0, c["max_scale"] or 0.0, self._nonfinite_loss == "skip")

    def _check_config(self, settings: dict | None = None, label: str = "{}") -> None:
        """Checks the settings (the scaler's own, or candidate ones) as the core will hold
        them; changes nothing, so callers check first and assign after. ``label`` names a
        setting in the message (``"state_dict['{}']"`` for a loaded dict)."""
        given = self._settings() if settings is None else settings
        for name in ("min_scale", "max_scale"):
            v = given[name]  # a negative value too small for float32 would pass as -0.0
            if v is not None and not (math.isfinite(v) and v >= 0):
                raise ScalerConfigError(f"{label.format(name)}: must be a finite number >= 0, got {v!r}")
        try:
            _C.scaler_config_check(self._config(given))
        except MemfitValueError as e:
            message = _echo_given(str(e), given)
            name, sep, rest = message.partition(":")
            if sep and name in given:
                message = label.format(name) + sep + rest
            raise ScalerConfigError(message) from None

    def get_growth_factor(self) -> float:
        """The scale growth factor."""
        return self._growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        """Sets the growth factor (> 1; checked now, not at the next update)."""
        self._set("growth_factor", _as_float(new_factor, "new_factor"))

    def get_backoff_factor(self) -> float:
        """The scale backoff factor."""
        return self._backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        """Sets the backoff factor (in (0, 1))."""
        self._set("backoff_factor", _as_float(new_factor, "new_factor"))

    def get_growth_interval(self) -> int:
        """Finite steps in a row before the scale grows."""
        return self._growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        """Sets the growth interval (>= 1)."""
        self._set("growth_interval", _as_int(new_interval, "new_interval"))

    def _set(self, name: str, value) -> None:
        if self._enabled:  # torch's disabled scaler takes any value
            self._check_config(dict(self._settings(), **{name: value}))
        setattr(self, "_" + name, value)

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
                append(_dist.local(g))
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
        found, unscaled = self._unscale_tensors_(self._optimizer_grads(optimizer, allow_fp16), scale,
                                                 in_kernel.skip(optimizer, self._clip_unscaled, scale))
        if scale is not None:
            for device, grads in unscaled.items():
                self._unscaled_lists.append((grads, found[device]))
        self._agree_across_ranks(found)
        return found

    def _agree_across_ranks(self, found: dict) -> None:
        """Makes ``found`` (and, with nonfinite_loss='skip', the loss flag) the MAX over
        the process group, in place: one all-reduce, enqueued without a host sync. Every
        path to an optimizer's found_inf comes through here once per step, so all ranks
        skip and update the scale alike. Runs on every rank even with no gradients
        (a collective that one rank skipped would hang the others)."""
        group = _dist.reduce_group(self._process_group)
        if group is None:
            return
        # the same shape on every rank whatever its gradients: (found_inf[, loss flag])
        with_loss = self._nonfinite_loss == "skip"
        n = 2 if with_loss else 1
        if len(found) == 1 and n == 1:
            _dist.all_reduce_max_(next(iter(found.values())).view(1), group)  # the common case
            return
        dev = next(iter(found)) if found else self._state.device
        flags = [f.to(dev, non_blocking=True) for f in found.values()]
        buf = torch.zeros(n, dtype=torch.float32, device=dev)
        if flags:
            buf[0] = torch.stack(flags).amax()
        if with_loss and self._loss_flag is not None:
            buf[1].copy_(self._loss_flag, non_blocking=True)
        _dist.all_reduce_max_(buf, group)
        if not found:  # another rank's inf must still stop this one
            found[dev] = buf[0]
        for f in found.values():
            f.copy_(buf[0], non_blocking=True)  # in place: _unscaled_lists hold these
        if with_loss:
            self._loss_flag = buf[1].to(self._state.device, non_blocking=True)

    # ---- the protocol clip_grad_norm_(..., scaler=self) uses -------------------------------
    #
    # clip_grad_norm_ needs the true (unscaled) norm, so before it measures, the scaler
    # must unscale the gradients it is given, once per iteration, and remember that it
    # did: step() then neither unscales them twice nor forgets their inf/NaN. That is
    # the one call below; clip_grad_norm_ touches nothing else of the scaler's.

    def _unscale_for_clip(self, params: list, optimizer=None) -> None:
        """Leaves the gradients of ``params`` unscaled for clipping (enabled scalers only).

        With ``optimizer``: ``unscale_(optimizer)`` unless it already ran this iteration.
        Without: unscales the gradients not yet unscaled this iteration and records them
        (sparse and float16 gradients raise, as unscale_ would)."""
        if optimizer is not None:
            if self._per_optimizer_states[id(optimizer)]["stage"] is OptState.READY:
                self.unscale_(optimizer)
            return
        self._check_scale_growth_tracker("clip_grad_norm_")
        pending = [_dist.local(p.grad) for p in params if p.grad is not None]
        if any(g.is_sparse for g in pending):
            raise MemfitValueError(
                "parameters: sparse gradients with scaler= need optimizer=... (the scaler "
                "tracks their unscaling per optimizer)")
        if any(g.dtype is torch.float16 for g in pending):
            raise ValueError("Attempting to unscale FP16 gradients.")
        self._unscale_untracked_(pending)

    def _unscale_untracked_(self, grads: list) -> None:
        """Unscales what unscale_ has not, and records it so that step()/unscale_() skip
        it but keep its inf/NaN."""
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
        if opt_state["stage"] is OptState.UNSCALED:
            raise RuntimeError(
                "unscale_() has already been called on this optimizer since the last update().")
        if opt_state["stage"] is OptState.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        opt_state["found_inf_per_device"] = self._unscale_grads_(optimizer, self._scale, None, False)
        opt_state["stage"] = OptState.UNSCALED

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
        **kwargs)`` unless a gradient is NaN/Inf. Optimizers whose step takes the scale
        (memfit's, torch's fused AdamW/Adam/SGD: see amp/in_kernel.py) get
        ``optimizer.grad_scale`` and ``optimizer.found_inf`` instead and skip on the
        device, with no host sync. Returns what ``optimizer.step`` returns
        (None when skipped)."""
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        self._check_scale_growth_tracker("step")
        opt_state = self._per_optimizer_states[id(optimizer)]
        if opt_state["stage"] is OptState.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")

        if in_kernel.takes_scale_in_kernel(optimizer):
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
            opt_state["stage"] = OptState.STEPPED
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
        opt_state["stage"] = OptState.STEPPED
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

    # ---- state_dict and pickling ----------------------------------------------------------

    def state_dict(self) -> dict:
        """torch's five keys: ``scale``, ``growth_factor``, ``backoff_factor``,
        ``growth_interval``, ``_growth_tracker`` (empty when disabled). Loads into
        ``torch.amp.GradScaler`` and back."""
        if not self._enabled:
            return {}
        values = (self.get_scale(), self._growth_factor, self._backoff_factor,
                  self._growth_interval, self._get_growth_tracker())
        return dict(zip(_STATE_KEYS, values))

    def load_state_dict(self, state_dict: dict) -> None:
        """Loads what :meth:`state_dict` (memfit's or torch's) returned. The whole dict is
        checked before anything changes: a refused dict leaves the scaler as it was.
        Raises RuntimeError for an empty dict (saved from a disabled scaler) and KeyError
        for a missing key, as torch does; a value of the wrong type raises
        MemfitTypeError, one out of range (NaN included) ScalerConfigError, each naming
        ``state_dict['key']``. Other keys are ignored, as torch ignores them."""
        if not self._enabled:
            return
        if not isinstance(state_dict, abc.Mapping):
            raise MemfitTypeError(f"state_dict: expected a dict (from GradScaler.state_dict()), "
                                  f"got {type(state_dict).__name__}")
        if len(state_dict) == 0:
            raise RuntimeError("The source state dict is empty, possibly because it was saved "
                               "from a disabled instance of GradScaler.")
        missing = [k for k in _STATE_KEYS if k not in state_dict]
        if missing:
            raise KeyError(f"state_dict: missing {', '.join(map(repr, missing))}; a GradScaler "
                           f"state dict has {', '.join(map(repr, _STATE_KEYS))}")
        scale = _check_scale(state_dict["scale"], "state_dict['scale']")
        tracker = _as_int(state_dict["_growth_tracker"], "state_dict['_growth_tracker']")
        if not 0 <= tracker <= _INT32_MAX:  # the state block holds it as an int32
            raise ScalerConfigError(f"state_dict['_growth_tracker']: must be >= 0 and <= "
                                    f"{_INT32_MAX}, got {tracker}")
        settings = dict(self._settings(),
                        growth_factor=_as_float(state_dict["growth_factor"],
                                                "state_dict['growth_factor']"),
                        backoff_factor=_as_float(state_dict["backoff_factor"],
                                                 "state_dict['backoff_factor']"),
                        growth_interval=_as_int(state_dict["growth_interval"],
                                                "state_dict['growth_interval']"))
        self._check_config(settings, "state_dict['{}']")
        # checked: from here on nothing raises
        self._growth_factor = settings["growth_factor"]
        self._backoff_factor = settings["backoff_factor"]
        self._growth_interval = settings["growth_interval"]
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
        state["_process_group"] = None  # a process group does not pickle: the default group
        state["_unscaled_lists"] = []
        state["_clip_unscaled"] = {}
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)
