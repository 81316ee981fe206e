"""memfit.amp.GradAccumulator: gradient accumulation over micro-batches, with the
mean, the scaler, clipping and DDP's no_sync handled at the boundary. Imports torch."""

from __future__ import annotations

from contextlib import nullcontext

import torch

from memfit._C import MemfitValueError
from memfit.amp._grads import _as_float, _as_int
from memfit.amp.clip import clip_grad_norm_
from memfit.amp.scaler import GradScaler

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
