"""DTensor parameters (FSDP2's ``fully_shard``, HSDP, replicated tensors) for the torch
optimizers: their states, the local tensors the kernels step, and loading states saved
at another world size.

A DTensor parameter's states are DTensors on the parameter's mesh with the parameter's
placements and the GLOBAL shapes of :meth:`_MemfitOptimizer._expected_state` (which
reads ``p.shape``/``p.numel()``: global for a DTensor, so 8-bit vs float32 does not
depend on the sharding). Every state of more than 0 dimensions has dim 0 of the
parameter's size (quantization blocks never cross a dim-0 slice), so a shard of the
parameter along dim 0 is the same shard of each state: a rank steps its local rows of
the parameter with its local rows of the states, the same bits as one process. Only
Shard(0) and Replicate placements keep that true; anything else is refused.

``step`` stays a plain float32 scalar on the local device, as torch's own AdamW keeps it.

The local tensors may live on another device than the mesh's: FSDP2's
``CPUOffloadPolicy`` keeps the shards of a CUDA mesh on the host, and their states stay
there with them (see ``_wrap``); only the collectives here (a load's checks, gathers,
redistributions) go through the mesh's device.

A torch built without torch.distributed has no DTensor: is_dtensor is then always
False and nothing else here is reached.
"""

from __future__ import annotations

import torch

try:  # torch builds without distributed support have no DTensor
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
except ImportError:  # pragma: no cover - depends on the torch build
    DTensor = Partial = Replicate = Shard = None
try:  # where FSDP2 itself takes it from (torch 2.4 and later); see _wrap
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
except ImportError:  # pragma: no cover - depends on the torch build
    DTensorSpec = TensorMeta = None


# ``where``, in the functions below: a callable that names a parameter in an error
# message (the optimizer's _where), called only when there is an error to raise.


def is_dtensor(t) -> bool:
    return DTensor is not None and isinstance(t, DTensor)


def _placements(t) -> str:
    return "(" + ", ".join(repr(pl) for pl in t.placements) + ")"


def check_param(p, where) -> None:
    """Refuses a DTensor parameter whose placements would let a quantization block or a
    state row straddle two ranks: only Shard(0) and Replicate (on any number of mesh
    dimensions) are taken."""
    for pl in p.placements:
        if type(pl) is Replicate or (type(pl) is Shard and pl.dim == 0):
            continue
        if pl.is_partial():
            why = ("it is Partial (a sum not yet reduced across ranks); redistribute it to "
                   "Replicate or Shard(0)")
        elif getattr(pl, "dim", None) == 0 and hasattr(pl, "split_factor"):  # _StridedShard
            why = (f"{pl!r} (strided: FSDP2 over tensor parallel on the same dim) gives a rank "
                   "rows that are not one contiguous range of the tensor's rows, and memfit's "
                   "states shard by contiguous rows; shard dim 0 with plain Shard(0)")
        elif pl.is_shard():
            why = (f"it is sharded on {pl!r} and memfit's states shard only along dim 0 "
                   "(fully_shard's default, shard_placement_fn=None); shard dim 0 or "
                   "keep it replicated")
        else:
            why = f"{pl!r} is not a placement memfit's states can follow; use Shard(0) or Replicate"
        raise ValueError(f"{where(p)}: a DTensor parameter of shape {tuple(p.shape)} with "
                         f"placements {_placements(p)}: {why}")


def _contiguous_stride(shape) -> tuple:
    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(stride))


def _wrap(local: torch.Tensor, p, shape, stride):
    """``local`` as a DTensor of p's mesh and placements, left on its own device.

    Not DTensor.from_local: that moves the local tensor to the mesh's device type, so
    under FSDP2's CPUOffloadPolicy on a GPU (a CUDA mesh, shards on the host) every state
    would land on the GPU, next to nothing it is stepped with. FSDP2 builds its offloaded
    shards this way too (_from_local_no_grad). (A torch without DTensorSpec where FSDP2
    keeps it gets from_local, right wherever the shards live on the mesh's device.)"""
    if DTensorSpec is None:  # pragma: no cover - depends on the torch build
        return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False,
                                  shape=torch.Size(shape), stride=tuple(stride))
    spec = DTensorSpec(p.device_mesh, tuple(p.placements),
                       tensor_meta=TensorMeta(torch.Size(shape), tuple(stride), local.dtype))
    return DTensor(local, spec, requires_grad=False)


def _on_mesh_device(t):
    """The DTensor ``t`` with its local tensor on its mesh's device, where a collective
    (gather, redistribute) can move it: a host shard of a CUDA mesh (CPUOffloadPolicy) is
    copied to the GPU; anything else is returned as it is."""
    mesh, local = t.device_mesh, t.to_local()
    if local.device.type == mesh.device_type:
        return t
    return DTensor.from_local(local, mesh, t.placements, run_check=False, shape=t.shape,
                              stride=t.stride())


def zeros_state(p, shape: tuple, dtype, where):
    """A zero state of global ``shape`` for the DTensor parameter ``p``: a DTensor of p's
    mesh and placements whose local rows are p's local rows. A state of p's shape
    follows p's memory layout (as for plain parameters)."""
    local_p = p.to_local()
    if shape == tuple(p.shape):
        return _wrap(torch.zeros_like(local_p, dtype=dtype), p, shape, p.stride())
    if not any(type(pl) is Shard for pl in p.placements):  # replicated: local is global
        return _wrap(torch.zeros(shape, dtype=dtype, device=local_p.device), p, shape,
                     _contiguous_stride(shape))
    if len(shape) == 0 or shape[0] != p.shape[0]:
        # a state whose dim 0 is not p's cannot be split like p (never the case for the
        # layouts of format_version 2, where every quantized state has p's rows)
        raise ValueError(f"{where(p)}: a state of shape {shape} cannot follow the sharding "
                         f"{_placements(p)} of a parameter of shape {tuple(p.shape)}")
    local_shape = (local_p.shape[0],) + tuple(shape[1:])
    return _wrap(torch.zeros(local_shape, dtype=dtype, device=local_p.device), p, shape,
                 _contiguous_stride(shape))


def local_step_args(p, g, states: tuple, where):
    """(local parameter, local gradient, local states) of a DTensor parameter: what the
    kernels step, in place (``states``: a tuple of its states or None, step plain). The
    gradient must be a DTensor laid out as ``p``."""
    if not is_dtensor(g) or g.device_mesh != p.device_mesh or g.placements != p.placements:
        got = (f"a DTensor with placements {_placements(g)}" if is_dtensor(g)
               else f"a {type(g).__name__}")
        partial = is_dtensor(g) and any(pl.is_partial() for pl in g.placements)
        raise ValueError(
            f"{where(p)}: the gradient of a DTensor parameter with placements {_placements(p)} is "
            f"{got}; it must be a DTensor of the parameter's mesh and placements"
            + ("; reduce it first (redistribute to the parameter's placements)" if partial else ""))
    return p.to_local(), g.to_local(), tuple(v.to_local() if isinstance(v, DTensor) else v
                                             for v in states)


def describe(t, key=None) -> str:
    """How a state (or, with ``key``, the states ``key`` of parameter ``t``) is laid out
    across ranks, for error messages."""
    if is_dtensor(t) and key != "step":
        return f"a DTensor with placements {_placements(t)}"
    return "a plain tensor"


def with_local(value, local: torch.Tensor, stride=None):
    """The DTensor ``value`` with its local tensor (the same rows, another memory layout)
    replaced by ``local``; ``stride``: the global strides, by default contiguous."""
    return _wrap(local, value, tuple(value.shape),
                 _contiguous_stride(value.shape) if stride is None else stride)


def sum_over_mesh(local: torch.Tensor, p) -> torch.Tensor:
    """``local`` summed over the ranks of p's mesh (one all-reduce): what every rank
    of the mesh needs to agree on, such as whether any rank found a corrupt state. A
    1-rank mesh has nothing to add (and no all-reduce to wait for)."""
    if p.device_mesh.size() == 1:
        return local
    return DTensor.from_local(local, p.device_mesh, [Partial()] * p.device_mesh.ndim,
                              run_check=False).full_tensor()


def local_state(state: dict) -> dict:
    """{key: local tensor} of a DTensor parameter's states (step stays as it is)."""
    return {k: v.to_local() if isinstance(v, DTensor) else v for k, v in state.items()}


def like_param(local: torch.Tensor, p):
    """A tensor of p's local shape as a DTensor laid out as ``p``."""
    return _wrap(local, p, tuple(p.shape), p.stride())


def first_row(p, where) -> int:
    """The global index of the first of this rank's rows of the DTensor ``p``: Shard(0)
    on mesh dimension d cuts the rows left by the earlier dimensions into chunks of
    ceil(n / size) (torch.chunk, as DTensor and fully_shard do). Checked against the
    local tensor: a layout that disagrees is refused rather than stepped with the wrong
    random draws."""
    coord = p.device_mesh.get_coordinate()
    start, n = 0, p.shape[0] if p.dim() else 0
    for d, pl in enumerate(p.placements):
        if type(pl) is Shard:
            size = p.device_mesh.size(d)
            chunk = -(-n // size) if n else 0
            lo = min(coord[d] * chunk, n)
            start, n = start + lo, min(lo + chunk, n) - lo
    local = p.to_local()
    if p.dim() and n != local.shape[0]:
        raise ValueError(f"{where(p)}: the local shard has {local.shape[0]} rows where "
                         f"placements {_placements(p)} give {n}; memfit expects "
                         "torch.chunk's split (fully_shard's and distribute_tensor's)")
    return start


def index_base(p, where) -> int:
    """The number, in the whole tensor, of the first element of this rank's shard of
    ``p`` (0 for a plain tensor): stochastic rounding draws by it, so that the shard
    rounds as the whole tensor would."""
    if not is_dtensor(p) or p.dim() == 0 or p.shape[0] == 0:
        return 0
    return first_row(p, where) * (p.numel() // p.shape[0])


def plain(t):
    """A GradScaler tensor (grad_scale, found_inf) as the kernels take it: a plain tensor
    (a DTensor is gathered: Partial sums reduced, replicas read locally)."""
    if not is_dtensor(t):
        return t
    if any(pl.is_partial() or pl.is_shard() for pl in t.placements):
        return t.full_tensor()
    return t.to_local()


def loaded_value(key: str, value: torch.Tensor, p) -> torch.Tensor:
    """A fresh copy of a loaded state ``value`` (plain or DTensor, of the global shape
    already checked) laid out as the states of ``p`` are: for a DTensor ``p``, a DTensor
    of p's mesh and placements (redistributed, or cut from the full tensor); for a plain
    ``p``, a plain tensor on p's device (a DTensor value gathered). ``step`` is always a
    plain tensor on the local device."""
    value = value.detach()
    device = p.to_local().device if is_dtensor(p) else p.device
    if key == "step" or not is_dtensor(p):
        if is_dtensor(value):
            value = _on_mesh_device(value).full_tensor()
        return value.to(device=device, copy=True)
    stride = value.stride()
    if is_dtensor(value) and value.device_mesh == p.device_mesh:
        if value.placements != p.placements:
            value = _on_mesh_device(value).redistribute(p.device_mesh, p.placements)
        local = value.to_local()
    else:
        # a plain full tensor (saved by one process), or a DTensor of another mesh: every
        # rank holds the whole value and keeps its own rows, without communication (and
        # without a trip through the mesh's device: a CPU-offloaded shard stays on the host)
        full = _on_mesh_device(value).full_tensor() if is_dtensor(value) else value
        local = _own_rows(full, p)
    return _wrap(local.to(device=device, copy=True), p, tuple(value.shape), stride)


def _own_rows(full: torch.Tensor, p) -> torch.Tensor:
    """This rank's rows of ``full``, a whole state of the DTensor parameter ``p`` (every
    state but step has p's rows): the rows p's own shard holds (torch.chunk's split, as
    distribute_tensor cuts them)."""
    if full.dim() == 0 or not any(type(pl) is Shard for pl in p.placements):
        return full
    start = first_row(p, lambda q: f"a parameter of shape {tuple(q.shape)}")
    return full[start:start + p.to_local().shape[0]]
