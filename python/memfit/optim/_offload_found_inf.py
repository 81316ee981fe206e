"""The gradients' inf/NaN check for a GradScaler, made as the gradients land
(memfit.optim.offload; docs/offload.md, "GradScaler").

With ``offload_gradients=True`` the scaler's inf check reads the host gradients: a pass
over every gradient of the model on the caller's thread, after backward, before the
first chunk can step. Once memfit's scaler has asked for it
(:func:`memfit.amp.in_kernel.skip`), the worker checks each host gradient
right after it lands, while backward goes on, with the scaler's own kernel
(``_C.unscale_grads`` without a scale: it only reads), and the scaler folds those flags
in instead of reading the gradients again: the same found_inf, bit for bit (a 0/1 flag
per device either way). A flag is used only for the very gradient it was taken of,
unchanged since (the same tensor object and version counter; the arena's tensors each
have their own, _offload_staging); any other gradient the scaler checks itself, as it
would. Only the check that precedes a step (the scaler's ``step`` without ``unscale_``)
uses them: ``unscale_`` must write every gradient anyway.
"""

from __future__ import annotations

import torch

from memfit import _C
from memfit.amp._grads import _FUSED_DTYPES, _prepare


class LandedFlags:
    """The per-gradient non-finite flags the worker took (index -> (gradient, its
    version, a 0/1 float32 flag))."""

    def __init__(self):
        self.wanted = False  # set by the first scaler check that can use them
        self._flags = {}

    def record(self, index: int, grad: torch.Tensor) -> None:
        """Worker: grad has landed (its last change for now): is any element inf/NaN."""
        if grad.dtype not in _FUSED_DTYPES:
            return  # the scaler checks these itself, with torch's kernel
        flag = torch.zeros((), dtype=torch.float32)
        views, _ = _prepare([grad], write=False)
        _C.unscale_grads(views, None, flag, 0)
        self._flags[index] = (grad, grad._version, flag)

    def checked(self, grads: dict) -> dict:
        """{id(g): (g, flag)} for the gradients of ``grads`` (index -> gradient) whose
        flag is valid; from now on every landing records one."""
        self.wanted = True
        out = {}
        for index, g in grads.items():
            entry = self._flags.get(index)
            if entry is not None and entry[0] is g and entry[1] == g._version:
                out[id(g)] = (g, entry[2])
        return out
