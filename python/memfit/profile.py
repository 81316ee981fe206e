"""Measure training memory for real: what `memfit profile` runs, and what the
estimator in memfit.memory is checked against.

For a model, an optimizer and a batch, it runs a few training steps and reports, per
component: parameter bytes, gradient bytes and optimizer-state bytes (exact, from the
tensors), bytes saved for backward (counted by saved-tensor hooks: each storage once,
parameters excluded), peak CUDA memory on a GPU, and the median step time.
"""

from __future__ import annotations

import statistics
import time
from contextlib import nullcontext

import torch


def tensor_bytes(t) -> int:
    return t.numel() * t.element_size()


def state_bytes(optimizer) -> int:
    """Bytes of every tensor held in the optimizer's per-parameter state."""
    total, seen = 0, set()

    def visit(v):
        nonlocal total
        if torch.is_tensor(v):
            key = (v.untyped_storage().data_ptr(), v.device)
            if key not in seen:
                seen.add(key)
                total += v.untyped_storage().nbytes()
        elif isinstance(v, dict):
            for x in v.values():
                visit(x)
        elif isinstance(v, (list, tuple)):
            for x in v:
                visit(x)
        elif hasattr(v, "__dict__") and not isinstance(v, type):
            for x in vars(v).values():
                visit(x)

    for st in optimizer.state.values():
        visit(st)
    return total


class SavedTensorMeter:
    """Context manager counting the bytes autograd saves for backward: each storage
    once, parameters (which exist anyway) excluded."""

    def __init__(self, params=()):
        self.param_ptrs = {p.untyped_storage().data_ptr() for p in params}
        self.storages = {}
        self._ctx = None

    def _pack(self, t):
        st = t.untyped_storage()
        ptr = st.data_ptr()
        if ptr not in self.param_ptrs and ptr != 0:
            self.storages[(ptr, t.device)] = st.nbytes()
        return t

    def __enter__(self):
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        return self._ctx.__exit__(*exc)

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())


def profile_steps(model, optimizer, batches, loss_fn, steps: int = 3, autocast_dtype=None,
                  scaler=None, device=None) -> dict:
    """Runs `steps` training steps (after one warm-up) and measures each component.

    Args:
        model: a torch module.
        optimizer: its optimizer (torch's or memfit's).
        batches: callable returning (inputs, targets) for each step.
        loss_fn: callable (model, inputs, targets) -> scalar loss.
        autocast_dtype: torch.bfloat16 / torch.float16 to train under autocast.
        scaler: an optional GradScaler (torch's or memfit's) for float16.
    """
    device = device or next(model.parameters()).device
    params = list(model.parameters())
    cuda = device.type == "cuda"
    times, saved = [], 0
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
    for step in range(steps + 1):
        x, y = batches()
        t0 = time.perf_counter()
        ctx = torch.autocast(device.type, dtype=autocast_dtype) if autocast_dtype else nullcontext()
        meter = SavedTensorMeter(params)
        with meter, ctx:
            loss = loss_fn(model, x, y)
        saved = max(saved, meter.bytes)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            optimizer.step()
        grad_bytes = sum(tensor_bytes(p.grad) for p in params if p.grad is not None)
        optimizer.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        if step > 0:
            times.append(time.perf_counter() - t0)
    return {
        "params": sum(tensor_bytes(p) for p in params),
        "gradients": grad_bytes,
        "optimizer": state_bytes(optimizer),
        "activations": saved,
        "peak_cuda": torch.cuda.max_memory_allocated(device) if cuda else None,
        "step_time_s": statistics.median(times),
        "loss": float(loss.detach().float()),
    }
