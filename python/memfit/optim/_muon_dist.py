"""Newton-Schulz of matrices sharded by rows across ranks (FSDP2, HSDP): each matrix is
orthogonalized once, by one rank, and each rank gets its rows of the result back.

Muon's momentum pass runs on every rank's local rows (the momentum stays sharded like the
parameter), but Newton-Schulz is a function of the whole matrix. Gathering every matrix
on every rank and orthogonalizing it there would do the same work W times; instead the
matrices of a step are handed to the ranks in turn, as distributed Muon implementations
do: in a batch of up to W sharded matrices, matrix k goes to rank k of the shard group
(``torch.distributed.gather`` of the rows, padded to torch.chunk's row count), every rank
orthogonalizes the one it was given at the same time as the others, and the rows of each
result go back to the ranks that hold them (``torch.distributed.scatter``). Per matrix
and step: one gather and one scatter on the parameter's shard group (each rank sends and
receives its rows once; the owner receives and sends the whole matrix), and one
Newton-Schulz on one rank. torch.distributed does the talking; the collectives run on
the mesh's device (under CPUOffloadPolicy the host rows are copied there and back).

Same bits at any world size: the owner orthogonalizes exactly the matrix one process
would (its rows gathered unchanged), and Newton-Schulz of the same matrix on the same
kind of device gives the same bits on any rank.

Every rank of a shard group must step the same sharded parameters in the same order (as
FSDP2's gradients make them: every rank has a gradient for every parameter or none):
the collectives pair up by their order.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from memfit.optim import _dtensor


def shard_dim(p, where):
    """The one mesh dimension along which the DTensor ``p`` is sharded (Shard(0)), or None
    when it is replicated on every dimension (every rank holds the whole matrix). Two
    sharded mesh dimensions are refused: a matrix is gathered over one process group."""
    dims = [d for d, pl in enumerate(p.placements) if pl.is_shard()]
    if len(dims) > 1:
        raise ValueError(
            f"{where}: a DTensor of shape {tuple(p.shape)} with placements "
            f"{_dtensor._placements(p)} is sharded on {len(dims)} mesh dimensions; Muon "
            "gathers a matrix over one: shard it with Shard(0) on one mesh dimension "
            "(fully_shard's and HSDP's layouts)")
    return dims[0] if dims else None


def _comm_device(local: torch.Tensor, mesh) -> torch.device:
    """Where the collectives of ``mesh`` take tensors: the local tensor's device, or the
    mesh's (a host shard of a CUDA mesh under CPUOffloadPolicy)."""
    if local.device.type == mesh.device_type:
        return local.device
    return torch.device(mesh.device_type, torch.get_device_module(mesh.device_type).current_device())


def batches(dists):
    """The items of one call, in order, grouped as they are orthogonalized: ``dists`` is
    the DTensor (or None) of each item; yields lists of item indices. A sharded matrix
    joins a batch of consecutive sharded matrices of the same shard group, at most the
    group's size; anything else is a batch of its own."""
    batch, key, size = [], None, 0
    for i, p in enumerate(dists):
        d = None if p is None else shard_dim(p, "")  # (refused before the step: no raise)
        k = None if d is None else p.device_mesh.get_group(d)
        if batch and (k is None or k is not key or len(batch) == size):
            yield batch
            batch = []
        if k is None:
            yield [i]
            continue
        batch.append(i)
        key, size = k, p.device_mesh.size(d)
    if batch:
        yield batch


def orthogonalize(batch, newton_schulz, out_dtype):
    """The local rows of ``newton_schulz(whole matrix)`` for each (DTensor p or None, its
    local update as a (local rows, cols) matrix) of ``batch`` (one batch of
    :func:`batches`). ``newton_schulz`` returns ``out_dtype``; a rank that holds a whole
    matrix (plain tensor, replicated) orthogonalizes it itself."""
    p0 = batch[0][0]
    d = None if p0 is None else shard_dim(p0, "")
    if d is None:
        return [newton_schulz(u) for _, u in batch]
    mesh = p0.device_mesh
    group, world, me = mesh.get_group(d), mesh.size(d), mesh.get_local_rank(d)
    gathered, works, shapes = [], [], []
    for k, (p, u) in enumerate(batch):
        rows, cols = p.shape[0], u.shape[1]
        chunk = -(-rows // world)  # torch.chunk's rows per rank (the last ones may have fewer)
        dev = _comm_device(u, mesh)
        send = torch.zeros((chunk, cols), dtype=u.dtype, device=dev)
        send[:u.shape[0]].copy_(u)
        recv = [torch.empty_like(send) for _ in range(world)] if k == me else None
        works.append(dist.gather(send, recv, group=group, group_dst=k, async_op=True))
        gathered.append(recv)
        shapes.append((rows, cols, chunk, dev, u))
    for w in works:
        w.wait()
    results, works = [], []
    for k, ((rows, cols, chunk, dev, u), recv) in enumerate(zip(shapes, gathered)):
        pieces = None
        if k == me:  # this rank's matrix: orthogonalized while the others do theirs
            o = newton_schulz(torch.cat(recv)[:rows])
            padded = torch.zeros((chunk * world, cols), dtype=out_dtype, device=dev)
            padded[:rows].copy_(o)
            pieces = list(padded.split(chunk))
        mine = torch.empty((chunk, cols), dtype=out_dtype, device=dev)
        works.append(dist.scatter(mine, pieces, group=group, group_src=k, async_op=True))
        results.append(mine)
    for w in works:
        w.wait()
    return [mine[:u.shape[0]].to(u.device) for mine, (*_, u) in zip(results, shapes)]
