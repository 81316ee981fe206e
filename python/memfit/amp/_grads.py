"""What the scaler and clipping share: the views of gradients the fused C passes take,
the CUDA stream they run on, a tensor copied to each device that asks, and the
checks of numeric arguments. Imports torch."""

from __future__ import annotations

import numpy as np
import torch

from memfit._C import MemfitTypeError

_FUSED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_F32, _F16, _BF16 = _FUSED_DTYPES
_is_contiguous = torch.Tensor.is_contiguous


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
