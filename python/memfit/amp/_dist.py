"""What the scaler and clipping exchange between processes: the group a found_inf flag
is reduced over, and for DTensor gradients (FSDP2, tensor parallel) the local shard the
fused kernels work on and the mesh dimensions a partial norm is summed over.

Nothing here runs a collective unless torch.distributed is initialized and the group
has more than one rank. Imports torch.
"""

from __future__ import annotations

import torch

from memfit._C import MemfitValueError

try:  # torch builds without distributed support have neither
    import torch.distributed as _dist
    from torch.distributed.tensor import DTensor as _DTensor
except ImportError:  # pragma: no cover - depends on the torch build
    _dist = _DTensor = None


def reduce_group(group):
    """The process group to reduce a flag over: ``group`` (None: the default group)
    when torch.distributed is initialized and that group has more than one rank,
    else None (nothing to reduce)."""
    if _dist is None or not _dist.is_available() or not _dist.is_initialized():
        return None
    g = group if group is not None else _dist.group.WORLD
    return g if _dist.get_world_size(g) > 1 else None


def all_reduce_max_(t: torch.Tensor, group) -> None:
    """In place, the element-wise MAX of ``t`` over ``group`` (from :func:`reduce_group`).
    Enqueued on the current stream on CUDA (NCCL): no host sync."""
    _dist.all_reduce(t, op=_dist.ReduceOp.MAX, group=group)


def is_dtensor(t) -> bool:
    return _DTensor is not None and isinstance(t, _DTensor)


def local(g: torch.Tensor) -> torch.Tensor:
    """The tensor the kernels see: a DTensor's local shard (its storage: in-place
    writes reach the DTensor), any other tensor itself."""
    if _DTensor is not None and isinstance(g, _DTensor):
        with torch.no_grad():
            return g.to_local()
    return g


def shard_dims(g) -> tuple:
    """The mesh dimensions over which a DTensor gradient is split (Shard placements):
    a norm's partial sums are reduced over these and not over replicated ones (a
    replica summed W times would count W times). Partial gradients (not yet reduced)
    are refused: their norm is not a function of the local values."""
    dims = []
    for i, p in enumerate(g.placements):
        if p.is_partial():
            raise MemfitValueError(
                "parameters: a gradient is a DTensor with a Partial placement (not yet "
                "reduced across ranks); reduce it (e.g. redistribute to Shard/Replicate) "
                "before clipping")
        if p.is_shard():
            dims.append(i)
    return tuple(dims)
