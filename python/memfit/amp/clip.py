"""memfit.amp.clip_grad_norm_: the global gradient norm and the clip, one fused pass per
device each, with no host sync; for DTensor gradients, one all-reduce per sharded mesh
dimension. Imports torch."""

from __future__ import annotations

import math
from collections import defaultdict

import torch

from memfit import _C
from memfit.amp import _dist
from memfit.amp._grads import _FUSED_DTYPES, _as_float, _prepare, _stream
from memfit.amp.scaler import GradScaler


def _device_norm(device: torch.device, gs: list, norm_type: float) -> torch.Tensor:
    """The norm of the gradients ``gs`` (all on ``device``): one fused pass, float32."""
    views, _ = _prepare(gs, write=False)
    out = torch.empty((), dtype=torch.float32, device=device)
    ws = None
    if device.type == "cuda":
        ws = torch.empty(max(1, _C.mt_num_chunks([v.numel() for v in views])),
                         dtype=torch.float32, device=device)
    _C.grad_norm(views, norm_type, ws, out, _stream(device))
    return out


def _dist_reduce(part: torch.Tensor, inf_norm: bool, group) -> None:
    """Sums (p-th powers) or maxes (inf norm) a partial norm over ``group``, in place."""
    import torch.distributed as dist

    dist.all_reduce(part, op=dist.ReduceOp.MAX if inf_norm else dist.ReduceOp.SUM, group=group)


def clip_grad_norm_(parameters, max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False, foreach: bool | None = None, *,
                    scaler: GradScaler | None = None, optimizer=None) -> torch.Tensor:
    """Clips the gradients' global norm to ``max_norm`` in place and returns the norm
    (a float32 0-d tensor), like ``torch.nn.utils.clip_grad_norm_``, in one fused pass
    per device for the norm and one for the clip, with no host sync.

    With ``scaler=`` (enabled), the gradients are unscaled first, so the norm is the
    true one: through ``scaler.unscale_(optimizer)`` when ``optimizer=`` is given (or
    the optimizer is passed as ``parameters``), else directly; either way the scaler
    records which gradients it unscaled this iteration, so ``scaler.step`` neither
    unscales them twice nor forgets their inf/NaN.

    DTensor gradients (FSDP2, tensor parallel) are measured and clipped on their
    local shards; the partial norms are all-reduced over the mesh dimensions they are
    sharded on (SUM of p-th powers in float64, MAX for inf), so the returned norm (a
    plain tensor) is the global one, identical on every rank. See docs/amp.md.

    ``foreach`` is accepted for signature compatibility and ignored. Float64 or
    sparse gradients, and norm types other than p > 0 / inf, are handed to torch's
    own function.
    """
    if isinstance(parameters, torch.optim.Optimizer):
        optimizer = parameters if optimizer is None else optimizer
        parameters = [p for g in parameters.param_groups for p in g["params"]]
    elif isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    params = list(parameters)
    if scaler is not None and scaler.is_enabled():
        scaler._unscale_for_clip(params, optimizer)
    max_norm = _as_float(max_norm, "max_norm")
    norm_type = _as_float(norm_type, "norm_type")
    grads = [p.grad for p in params if p.grad is not None]
    if len(grads) == 0:
        return torch.tensor(0.0)
    if (not (norm_type > 0) or any(g.is_sparse or g.dtype not in _FUSED_DTYPES for g in grads)):
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type,
                                              error_if_nonfinite=error_if_nonfinite)
    # gradients by where their norm's partial sums must be reduced: None for plain
    # tensors (whole on this process), (mesh, sharded mesh dims) for DTensor shards
    buckets: dict = defaultdict(lambda: defaultdict(list))
    per_device: dict = defaultdict(list)
    for g in grads:
        local = _dist.local(g)
        key = None
        if _dist.is_dtensor(g):
            dims = tuple(d for d in _dist.shard_dims(g) if g.device_mesh.size(d) > 1)
            key = (g.device_mesh, dims) if dims else None
        buckets[key][local.device].append(local)
        per_device[local.device].append(local)
    inf_norm = math.isinf(norm_type)
    first = _dist.local(grads[0]).device
    with torch.no_grad():
        partials = []  # per bucket: the max (inf norm) or the sum of p-th powers, float64
        for key, devices in buckets.items():
            norms = [_device_norm(device, gs, norm_type) for device, gs in devices.items()]
            if key is None and len(buckets) == 1 and len(norms) == 1:
                partials = None
                total = norms[0]  # one device, nothing to reduce: the kernel's own result
                break
            norms = torch.stack([n.to(first).double() for n in norms])
            part = norms.max() if inf_norm else norms.pow(norm_type).sum()
            if key is not None:
                mesh, dims = key
                for d in dims:  # the shards of a mesh dim add up to the whole tensor
                    _dist_reduce(part, inf_norm, mesh.get_group(d))
            partials.append(part)
        if partials is not None:
            parts = torch.stack(partials)
            total = (parts.max() if inf_norm else parts.sum().pow(1.0 / norm_type)).float()
        if error_if_nonfinite and bool(torch.logical_or(total.isnan(), total.isinf())):
            raise RuntimeError(
                f"The total norm of order {norm_type} for gradients from `parameters` is "
                "non-finite, so it cannot be clipped. To disable this error and scale the "
                "gradients by the non-finite norm anyway, set `error_if_nonfinite=False`")
        for device, gs in per_device.items():
            views, fixups = _prepare(gs, write=True)
            _C.clip_grads(views, total.to(device, non_blocking=True), max_norm, _stream(device))
            for g, c in fixups:
                g.copy_(c)
    return total
