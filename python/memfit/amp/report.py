"""What the GradScaler says: the warnings after update() (a streak of skipped steps, the
scale at min_scale or below 1, a loss that was NaN/Inf before backward) and stats().
Both read the counters the C update rule keeps in the scaler's state block. Imports
torch."""

from __future__ import annotations

import math
import warnings

import numpy as np
import torch

from memfit import _C

_LAYOUT = _C.scaler_layout()
_HEAD = _LAYOUT["history"]  # the counters live in the first _HEAD words
_ONE_BITS = 0x3F800000  # 1.0f


class ScalerWarning(UserWarning):
    """What the scaler saw: skipped steps, a collapsing scale, a non-finite loss."""


class ScalerReport:
    """The reporting half of :class:`memfit.amp.GradScaler` (a base class): reads
    ``self._state``, ``self._seen``, ``self._pending`` and the scaler's settings."""

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
