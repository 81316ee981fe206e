"""The GradScaler's settings: the update rule's factors, interval, hysteresis and bounds,
checked as the C core will hold them (float32, int32) with messages that echo what the
caller gave; torch's getters and setters; ScalerConfigError. A base class of
:class:`memfit.amp.GradScaler` (scaler.py), which sets the ``_growth_factor``,
``_backoff_factor``, ``_growth_interval``, ``_hysteresis``, ``_min_scale``,
``_max_scale``, ``_nonfinite_loss`` and ``_enabled`` it reads. Imports torch."""

from __future__ import annotations

import math

import numpy as np
import torch

from memfit import _C
from memfit._C import MemfitValueError
from memfit.amp._grads import _as_float, _as_int


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



class ScalerSettings:
    """The settings half of :class:`memfit.amp.GradScaler` (a base class)."""

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

