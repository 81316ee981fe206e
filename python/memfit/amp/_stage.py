"""Where each optimizer is in the GradScaler's iteration (torch's OptState), and the
record the scaler keeps per optimizer: its stage and its found_inf per device."""

from __future__ import annotations

from enum import Enum


class OptState(Enum):
    """Where an optimizer is in the current iteration (torch's OptState): unscale_ moves
    READY to UNSCALED, step moves READY or UNSCALED to STEPPED, update returns every
    optimizer to READY. Anything else is misuse, and raises what torch raises."""

    READY = 0
    UNSCALED = 1
    STEPPED = 2


def _refresh_per_optimizer_state() -> dict:
    return {"stage": OptState.READY, "found_inf_per_device": {}}

