"""memfit.amp.GradScaler: dynamic loss scaling, a drop-in for torch.amp.GradScaler.

The update rule and the device-side found_inf live in memfit's C core (one C function,
``csrc/include/memfit/scaler.h``, on host memory or in one CUDA launch); the per-optimizer
stage check (READY -> UNSCALED -> STEPPED) is plain Python, as in torch.

This file is the state machine: the constructor, the state block (scale, growth
tracker), ``scale``, the stage checks of ``unscale_`` and ``step``, ``update``. Its other
capabilities are base classes, one file each, readable on their own:
``_scaler_settings.py`` (the update rule's settings, their checks and torch's getters
and setters; ScalerConfigError), ``_unscale.py`` (the fused unscale and inf check of an
optimizer's gradients, agreed across ranks), ``_scaler_checkpoint.py`` (state_dict,
load_state_dict, pickling) and ``report.py`` (the warnings, stats()); ``_stage.py`` has
OptState. Every name is importable from here and from memfit.amp, as before.
"""

from __future__ import annotations

import inspect
import warnings
from collections import abc, defaultdict
from typing import Any

import numpy as np
import torch

from memfit import _C
from memfit._C import MemfitTypeError, MemfitValueError
from memfit.amp import _dist, in_kernel
from memfit.amp._grads import _Replicator, _as_float, _as_int, _stream
from memfit.amp._scaler_checkpoint import ScalerCheckpoint
from memfit.amp._scaler_settings import ScalerConfigError, ScalerSettings, _check_scale  # noqa: F401 (re-exported)
from memfit.amp._stage import OptState, _refresh_per_optimizer_state
from memfit.amp._unscale import ScalerUnscale
from memfit.amp.report import ScalerReport

_LAYOUT = _C.scaler_layout()
_WORDS = _LAYOUT["words"]


class GradScaler(ScalerSettings, ScalerUnscale, ScalerCheckpoint, ScalerReport):
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

    # ---- unscale / step (the stage checks; the unscaling itself: _unscale.py) ------------

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

