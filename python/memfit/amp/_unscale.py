"""The GradScaler's unscale path: the gradients of an optimizer, divided by the scale
(or only checked) in one fused C pass per device with their inf/NaN flag, the
gradients already unscaled this iteration (by clip_grad_norm_(..., scaler=)) left
alone but their flag kept, and the flags made the same on every rank. A base class of
:class:`memfit.amp.GradScaler` (scaler.py), whose stage checks call it; it reads and
records ``_clip_unscaled``, ``_unscaled_lists``, ``_loss_flag``, ``_process_group``,
``_nonfinite_loss`` and ``_state``. Imports torch."""

from __future__ import annotations

import torch

from memfit import _C
from memfit.amp import _dist, in_kernel
from memfit.amp._grads import _BF16, _F16, _F32, _FUSED_DTYPES, _prepare, _Replicator, _stream


class ScalerUnscale:
    """The unscale half of :class:`memfit.amp.GradScaler` (a base class)."""

    def _optimizer_grads(self, optimizer, allow_fp16: bool) -> list:
        """The tensors to unscale for an optimizer (sparse gradients: their values)."""
        fp16 = torch.float16
        out = []
        append = out.append
        for group in optimizer.param_groups:
            for param in group["params"]:
                if not isinstance(param, torch.Tensor):
                    raise AssertionError(
                        f"expected param to be torch.Tensor, got {type(param).__name__}")
                g = param.grad
                if g is None:
                    continue
                if g.dtype is fp16 and not allow_fp16:
                    raise ValueError("Attempting to unscale FP16 gradients.")
                if g.is_sparse:
                    if g.dtype is fp16:
                        param.grad = g = g.coalesce()
                    g = g._values()
                append(_dist.local(g))
        return out

    def _unscale_tensors_(self, grads, scale, skip: dict | None = None):
        """Unscales (scale is a tensor) or only checks (scale None) `grads`, one fused C
        call per device. Gradients in `skip` ({id: (grad, found_inf)}: already unscaled
        this iteration) are not touched again; their found_inf is folded in instead.
        Returns ({device: found_inf}, {device: the gradients it unscaled or checked})."""
        per_device: dict = {}
        done: dict = {}
        others = False
        for g in grads:
            if skip:
                prev = skip.get(id(g))
                if prev is not None and prev[0] is g:
                    done.setdefault(g.device, []).append(prev[1])
                    continue
            if not others:
                dt = g.dtype
                others = not (dt is _F32 or dt is _BF16 or dt is _F16)
            key = g.device
            lst = per_device.get(key)
            if lst is None:
                per_device[key] = lst = []
            lst.append(g)
        scale_r = None if scale is None else _Replicator(scale)
        found: dict = {}
        with torch.no_grad():
            for device in list(per_device) + [d for d in done if d not in per_device]:
                dgrads = per_device.get(device, [])
                fi = torch.zeros((), dtype=torch.float32, device=device)
                other = []
                if others:
                    other = [g for g in dgrads if g.dtype not in _FUSED_DTYPES]
                    dgrads = [g for g in dgrads if g.dtype in _FUSED_DTYPES]
                views, fixups = _prepare(dgrads, write=scale is not None)
                s = None if scale_r is None else scale_r.get(device)
                _C.unscale_grads(views, s, fi, _stream(device))
                for g, c in fixups:
                    g.copy_(c)
                if other:  # float64 gradients: torch's own kernel, as torch would
                    inv = (torch.ones((), device=device) if s is None
                           else s.double().reciprocal().float())
                    torch._amp_foreach_non_finite_check_and_unscale_(other, fi, inv)
                for prev in done.get(device, ()):
                    torch.maximum(fi, prev, out=fi)  # stays 0 or 1: fused optimizers count on it
                found[device] = fi
        return found, per_device

    def _unscale_grads_(self, optimizer, scale, found_inf=None, allow_fp16: bool = False) -> dict:
        found, unscaled = self._unscale_tensors_(self._optimizer_grads(optimizer, allow_fp16), scale,
                                                 in_kernel.skip(optimizer, self._clip_unscaled, scale))
        if scale is not None:
            for device, grads in unscaled.items():
                self._unscaled_lists.append((grads, found[device]))
        self._agree_across_ranks(found)
        return found

    def _agree_across_ranks(self, found: dict) -> None:
        """Makes ``found`` (and, with nonfinite_loss='skip', the loss flag) the MAX over
        the process group, in place: one all-reduce, enqueued without a host sync. Every
        path to an optimizer's found_inf comes through here once per step, so all ranks
        skip and update the scale alike. Runs on every rank even with no gradients
        (a collective that one rank skipped would hang the others)."""
        group = _dist.reduce_group(self._process_group)
        if group is None:
            return
        # the same shape on every rank whatever its gradients: (found_inf[, loss flag])
        with_loss = self._nonfinite_loss == "skip"
        n = 2 if with_loss else 1
        if len(found) == 1 and n == 1:
            _dist.all_reduce_max_(next(iter(found.values())).view(1), group)  # the common case
            return
        dev = next(iter(found)) if found else self._state.device
        flags = [f.to(dev, non_blocking=True) for f in found.values()]
        buf = torch.zeros(n, dtype=torch.float32, device=dev)
        if flags:
            buf[0] = torch.stack(flags).amax()
        if with_loss and self._loss_flag is not None:
            buf[1].copy_(self._loss_flag, non_blocking=True)
        _dist.all_reduce_max_(buf, group)
        if not found:  # another rank's inf must still stop this one
            found[dev] = buf[0]
        for f in found.values():
            f.copy_(buf[0], non_blocking=True)  # in place: _unscaled_lists hold these
        if with_loss:
            self._loss_flag = buf[1].to(self._state.device, non_blocking=True)

    def _unscale_untracked_(self, grads: list) -> None:
        """Unscales what unscale_ has not, and records it so that step()/unscale_() skip
        it but keep its inf/NaN."""
        skip = dict(self._clip_unscaled)
        for lst, fi in self._unscaled_lists:
            for g in lst:
                skip[id(g)] = (g, fi)
        found, unscaled = self._unscale_tensors_(grads, self._scale, skip)
        for device, lst in unscaled.items():
            for g in lst:
                self._clip_unscaled[id(g)] = (g, found[device])

