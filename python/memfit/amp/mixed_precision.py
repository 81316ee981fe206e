"""Which autocast precision a device should use (precision), a reusable autocast context
(autocast, AutocastContext) and the two together with a GradScaler (setup). Imports torch."""

from __future__ import annotations

import warnings
from contextlib import nullcontext

import torch

from memfit import _arrays
from memfit._C import MemfitValueError
from memfit.amp.report import ScalerWarning
from memfit.amp.scaler import GradScaler

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


def precision(device=None, *, step=None, what: str | None = None) -> Precision:
    """The best autocast precision for ``device`` (default: the current CUDA device if
    there is one, else the CPU), with the reason:

    * ``"bf16"`` on GPUs of compute capability >= 8.0 (A100, RTX 30xx/40xx, H100) and
      on CPUs where a training step measured faster (or, with native bfloat16, not
      slower) under bf16 autocast (:func:`memfit.hardware.cpu_precision`; ``step(bf16)``
      and ``what``: one forward and backward of the model at hand and its description,
      else a representative small GPT is timed): bfloat16 has float32's range, so no
      loss scaling is needed;
    * ``"fp16"`` on GPUs with float16 tensor cores but no native bfloat16 (T4, V100,
      RTX 20xx: capability 7.x) and on P100 (6.0): use a GradScaler;
    * ``"fp32"`` where neither is faster (older GPUs, CPUs that would emulate bfloat16 or
      where bf16 autocast measured slower for the model, other devices).

    >>> precision("cpu") in ("bf16", "fp32")
    True
    """
    if device is None:
        device = _default_device()
    dev = torch.device(device) if not isinstance(device, torch.device) else device
    if dev.type == "cpu":
        from memfit.hardware import cpu_precision

        name, reason = cpu_precision(step, what)
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
    # NumPy dtypes and scalar types, ml_dtypes.bfloat16: by their names
    key = p if isinstance(p, str) else _arrays.dtype_name(p)
    name = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32"}.get(key, key)
    if name not in _DTYPES:
        raise MemfitValueError(f"precision: expected 'auto', 'bf16', 'fp16', 'fp32', a torch or "
                               f"NumPy dtype, got {p!r}")
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
