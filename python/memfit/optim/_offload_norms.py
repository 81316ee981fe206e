"""The gradients' norm for clipping, computed as the gradients land (memfit.optim.offload;
docs/offload.md, "Clipping").

Once ``CPUOffloadOptimizer.clip_grad_norm_`` has been called (the 2-norm, torch's default
foreach), the worker thread takes each host gradient's norm right after it lands, while
backward goes on, and clip_grad_norm_ then only sums them: the whole-model pass over the
gradients after backward is gone. The result is torch.nn.utils.clip_grad_norm_'s, bit for
bit: each tensor's norm is the one torch._foreach_norm gives it (on the host, one tensor
at a time either way), summed in torch's order (by device and dtype, as
clip_grad._get_total_norm groups them). A norm is used only for the very tensor it was
taken of, unchanged since: the same tensor object, the same version counter (the arena's
tensors each have their own, _offload_staging), and no reading of the offloader's
``param_groups`` or ``state`` in between (the ways a caller reaches the host gradients:
a scaler's unscale_ changes them in place without bumping their version counters, so
every norm is forgotten when they are read). Otherwise the norm is taken again at clip
time, as torch would.
"""

from __future__ import annotations

import torch
from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype, _has_foreach_support


class LandedNorms:
    """The per-tensor 2-norms the worker took (index -> (gradient, its version, norm))."""

    def __init__(self):
        self.wanted = False  # set by the first clip_grad_norm_ that can use them
        self._norms = {}

    def record(self, index: int, grad: torch.Tensor) -> None:
        """Worker: grad has landed (its last change for now): its norm, for clipping."""
        self._norms[index] = (grad, grad._version, torch._foreach_norm([grad], 2.0)[0])

    def forget(self) -> None:
        self._norms.clear()

    def _valid(self, index: int, grad: torch.Tensor):
        entry = self._norms.get(index)
        if entry is None or entry[0] is not grad or entry[1] != grad._version:
            return None
        return entry[2]

    def total(self, grads: list, indices: list, error_if_nonfinite: bool):
        """clip_grad._get_total_norm(grads, 2.0, error_if_nonfinite, foreach=None) from
        the recorded norms, those missing or stale taken now; None where torch would not
        take its foreach path (the caller then uses torch's own function)."""
        if not grads:
            return None
        grouped = _group_tensors_by_device_and_dtype([grads], with_indices=True)
        norms = []
        for (device, _), ([tensors], at) in grouped.items():
            if not _has_foreach_support(tensors, device):
                return None
            have = [self._valid(indices[k], grads[k]) for k in at]
            missing = [j for j, n in enumerate(have) if n is None]
            if missing:
                for j, n in zip(missing, torch._foreach_norm([tensors[j] for j in missing], 2.0)):
                    have[j] = n
            norms.extend(have)
        first = grads[0].device
        total = torch.linalg.vector_norm(torch.stack([n.to(first) for n in norms]), 2.0)
        if error_if_nonfinite and torch.logical_or(total.isnan(), total.isinf()):
            raise RuntimeError(
                "The total norm of order 2.0 for gradients from `parameters` is non-finite, so "
                "it cannot be clipped. To disable this error and scale the gradients by the "
                "non-finite norm anyway, set `error_if_nonfinite=False`")
        return total
