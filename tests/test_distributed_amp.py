"""memfit.amp across processes (CPU, gloo, spawned ranks): GradScaler's skip decision
agrees on every rank, clip_grad_norm_ on DTensor gradients gives the global norm, and
DDP with memfit's 8-bit AdamW matches one process bitwise.

Each test is one spawn running a group of checks (a spawn costs seconds); the rank
functions return plain values and the assertions that compare ranks run here.
"""

import copy
import math
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch was built without torch.distributed", allow_module_level=True)

from dist_util import run_ranks  # noqa: E402

INIT_SCALE = 2.0**10
BACKOFF = 0.5


def _all_checks(rank, world):
    """Every group of checks in one spawn (each spawn costs seconds)."""
    return dict(scaler=_scaler_rank(rank, world), clip=_clip_rank(rank, world),
                fsdp=_fsdp_rank(rank, world), ddp=_ddp_rank(rank, world))


@pytest.fixture(scope="module")
def two_ranks():
    return run_ranks(_all_checks, world_size=2, timeout=180)


class _CountAllReduce:
    """Counts torch.distributed.all_reduce calls (the scaler's collectives)."""

    def __init__(self):
        self.calls = 0
        self._orig = dist.all_reduce

    def __enter__(self):
        def counting(*a, **k):
            self.calls += 1
            return self._orig(*a, **k)

        dist.all_reduce = counting
        return self

    def __exit__(self, *exc):
        dist.all_reduce = self._orig


def _scaled_step(scaler, opt, params, grads_unscaled):
    """One iteration with gradients set to scale * g (g may hold inf); returns the
    number of all-reduces unscale/step/update issued."""
    scaler.scale(torch.ones(()))  # the scale exists from here on
    s = scaler.get_scale()
    for p, g in zip(params, grads_unscaled):
        p.grad = g * s
    with _CountAllReduce() as c:
        scaler.step(opt)
        scaler.update()
    return c.calls


# ---- ranks: scaler with local (DDP-style) and DTensor gradients, clip of DTensor grads ----


def _scaler_rank(rank, world):
    import memfit
    from memfit.amp import GradScaler
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    out = {}
    # local gradients: an inf on the last rank only; SGD (host decision) and AdamW8bit
    # (fused: found_inf on the device) must both skip on every rank
    for name in ("sgd", "adamw8bit"):
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(16, 8))
        p0 = p.detach().clone()
        opt = (torch.optim.SGD([p], lr=0.1) if name == "sgd"
               else memfit.optim.AdamW8bit([p], lr=0.1, min_8bit_size=64))
        scaler = GradScaler("cpu", init_scale=INIT_SCALE, backoff_factor=BACKOFF, growth_interval=1)
        torch.manual_seed(1 + rank)
        g = torch.randn(16, 8)
        if rank == world - 1:
            g[3, 5] = float("inf")
        calls = _scaled_step(scaler, opt, [p], [g])
        skipped = torch.equal(p.detach(), p0)
        scale_after_skip = scaler.get_scale()
        calls2 = _scaled_step(scaler, opt, [p], [torch.randn(16, 8)])
        out[name] = dict(calls=[calls, calls2], skipped=skipped, scale_after_skip=scale_after_skip,
                         stepped=not torch.equal(p.detach(), p0), scale_after_step=scaler.get_scale())

    # nonfinite_loss="skip": a NaN loss on one rank skips the step everywhere, scale kept
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(4, 4))
    p0 = p.detach().clone()
    opt = torch.optim.SGD([p], lr=0.1)
    scaler = GradScaler("cpu", init_scale=INIT_SCALE, nonfinite_loss="skip")
    loss = (p * p).sum() * (float("nan") if rank == 0 else 1.0)
    scaler.scale(loss).backward()
    with _CountAllReduce() as c:
        scaler.step(opt)
        scaler.update()
    out["nan_loss"] = dict(calls=c.calls, skipped=torch.equal(p.detach(), p0),
                           scale=scaler.get_scale())

    # an explicit process_group; rank 0 has no gradient at all, the last rank an inf:
    # rank 0 still joins the collective and backs off with the others
    group = dist.new_group(list(range(world)))
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.1)
    scaler = GradScaler("cpu", init_scale=INIT_SCALE, backoff_factor=BACKOFF, process_group=group)
    scaler.scale(torch.ones(()))
    if rank != 0:
        p.grad = torch.full((3,), float("inf") if rank == world - 1 else 1.0)
    with _CountAllReduce() as c:
        scaler.step(opt)
        scaler.update()
    out["group_no_grads"] = dict(calls=c.calls, scale=scaler.get_scale(),
                                 unchanged=torch.equal(p.detach(), torch.ones(3)))

    # a DTensor gradient sharded on dim 0 (5 rows: uneven), inf only in the last shard
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    full = torch.randn(5, 3)
    g_full = torch.randn(5, 3)
    g_bad = g_full.clone()
    g_bad[-1, 0] = float("inf")
    p = torch.nn.Parameter(distribute_tensor(full.clone(), mesh, [Shard(0)]))
    opt = torch.optim.SGD([p], lr=0.25, foreach=False)
    scaler = GradScaler("cpu", init_scale=INIT_SCALE, backoff_factor=BACKOFF)
    calls = _scaled_step(scaler, opt, [p], [distribute_tensor(g_bad, mesh, [Shard(0)])])
    skipped = torch.equal(p.full_tensor(), full)
    local_inf = bool((~torch.isfinite(distribute_tensor(g_bad, mesh, [Shard(0)]).to_local())).any())
    scale_after_skip = scaler.get_scale()
    _scaled_step(scaler, opt, [p], [distribute_tensor(g_full, mesh, [Shard(0)])])
    out["dtensor"] = dict(calls=calls, skipped=skipped, local_inf=local_inf,
                          scale_after_skip=scale_after_skip,
                          stepped_ok=torch.equal(p.full_tensor(), full - 0.25 * g_full))
    return out


def test_scaler_skips_on_every_rank(two_ranks):
    res = [r["scaler"] for r in two_ranks]
    for name in ("sgd", "adamw8bit"):
        for r in res:
            st = r[name]
            assert st["calls"] == [1, 1], name  # one collective per step
            assert st["skipped"], name
            assert st["scale_after_skip"] == INIT_SCALE * BACKOFF, name
            assert st["stepped"], name
            assert st["scale_after_step"] == INIT_SCALE * BACKOFF * 2.0, name
    for r in res:
        assert r["nan_loss"]["calls"] == 1
        assert r["nan_loss"]["skipped"]
        assert r["nan_loss"]["scale"] == INIT_SCALE  # a NaN loss is not an overflow
        g = r["group_no_grads"]
        assert g["calls"] == 1 and g["unchanged"]
        assert g["scale"] == INIT_SCALE * BACKOFF
        d = r["dtensor"]
        assert d["calls"] == 1 and d["skipped"] and d["stepped_ok"]
        assert d["scale_after_skip"] == INIT_SCALE * BACKOFF
    # the inf was only in the last rank's shard, yet rank 0 skipped too
    assert [r["dtensor"]["local_inf"] for r in res] == [False, True]


# ---- ranks: the global clip norm of DTensor gradients ----------------------------------

_SHAPES = [(5, 3), (1, 4), (9,), (3, 2, 2), (6, 6)]  # uneven, smaller than W, a replica
_NORMS = (2.0, 1.0, 3.0, math.inf)


def _clip_rank(rank, world):
    import memfit
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for norm_type in _NORMS:
        torch.manual_seed(0)
        fulls = [torch.randn(s) for s in _SHAPES]
        grads = [torch.randn(s) * 3 for s in _SHAPES]

        def dparams():
            ps = []
            for i, (w, g) in enumerate(zip(fulls, grads)):
                pl = [Replicate()] if i == len(_SHAPES) - 1 else [Shard(0)]
                # clones: a local shard may be a view of the tensor it came from
                p = torch.nn.Parameter(distribute_tensor(w.clone(), mesh, pl))
                p.grad = distribute_tensor(g.clone(), mesh, pl)
                ps.append(p)
            return ps

        ps = dparams()
        ref_norm = float(np.linalg.norm(np.concatenate([g.double().numpy().ravel() for g in grads]),
                                        ord=norm_type))
        max_norm = 0.5 * ref_norm
        with _CountAllReduce() as c:
            norm = memfit.amp.clip_grad_norm_(ps, max_norm, norm_type)
        t_norm = t_clipped = None
        if norm_type != math.inf:  # torch raises on one rank (the inf norm of an empty
            # shard, (1, 4) on 2 ranks) and the others would wait for it forever
            t_ps = dparams()
            t_norm = torch.nn.utils.clip_grad_norm_(t_ps, max_norm, norm_type)
            if isinstance(t_norm, DTensor):
                t_norm = t_norm.full_tensor()
            t_clipped = [p.grad.full_tensor() for p in t_ps]
        # one process, plain tensors
        sp = [torch.nn.Parameter(w.clone()) for w in fulls]
        for p, g in zip(sp, grads):
            p.grad = g.clone()
        sp_norm = memfit.amp.clip_grad_norm_(sp, max_norm, norm_type)
        out[norm_type] = dict(
            calls=c.calls, norm=norm, is_plain=type(norm) is torch.Tensor, ref=ref_norm,
            torch_norm=t_norm, single_norm=sp_norm,
            clipped=[p.grad.full_tensor() for p in ps],
            torch_clipped=t_clipped,
            single_clipped=[p.grad for p in sp])

    # a Partial gradient (not yet reduced) is refused on every rank, before any collective
    from torch.distributed.tensor import Partial
    p = torch.nn.Parameter(distribute_tensor(torch.ones(4, 2), mesh, [Shard(0)]))
    p.grad = DTensor.from_local(torch.ones(4, 2), mesh, [Partial()])
    try:
        memfit.amp.clip_grad_norm_([p], 1.0)
        out["partial"] = None
    except memfit.MemfitValueError as e:
        out["partial"] = str(e)
    return out


def test_clip_grad_norm_dtensor_is_global(two_ranks):
    _check_clip([r["clip"] for r in two_ranks])


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("MEMFIT_SLOW_TESTS"),
                    reason="4 spawned ranks take 30-60 s on 2 shared cores; "
                           "set MEMFIT_SLOW_TESTS=1")
def test_clip_grad_norm_dtensor_is_global_4_ranks():
    _check_clip(run_ranks(_clip_rank, world_size=4, timeout=300))


def _check_clip(res):
    for r in res:
        assert "Partial placement" in r["partial"]
    for norm_type in _NORMS:
        r0 = res[0][norm_type]
        assert r0["calls"] == 1  # one all-reduce: all shards on one mesh dim
        for r in res:
            st = r[norm_type]
            assert st["is_plain"]
            # the same total, bit for bit, on every rank: the same clip coefficient
            assert torch.equal(st["norm"], r0["norm"]), norm_type
            for a, b in zip(st["clipped"], r0["clipped"]):
                assert torch.equal(a, b)
        ref = r0["ref"]
        assert r0["norm"].item() == pytest.approx(ref, rel=2e-6), norm_type
        assert r0["norm"].item() == pytest.approx(r0["single_norm"].item(), rel=2e-6), norm_type
        if norm_type != math.inf:
            assert r0["norm"].item() == pytest.approx(float(r0["torch_norm"]), rel=2e-6), norm_type
            for a, b in zip(r0["clipped"], r0["torch_clipped"]):
                torch.testing.assert_close(a, b, rtol=2e-6, atol=1e-7)
        for a, c in zip(r0["clipped"], r0["single_clipped"]):
            torch.testing.assert_close(a, c, rtol=2e-6, atol=1e-7)
            assert torch.linalg.vector_norm(a.double(), norm_type) < ref  # clipped


# ---- ranks: FSDP2 (fully_shard) gradients, scaler and clip -----------------------------


def _fsdp_rank(rank, world):
    import memfit
    from memfit.amp import GradScaler
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
    ref_model = copy.deepcopy(model)
    for m in (model[0], model[2], model):
        fully_shard(m)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, foreach=False)
    scaler = GradScaler("cpu", init_scale=INIT_SCALE, backoff_factor=BACKOFF)
    torch.manual_seed(1)
    x, y = torch.randn(8, 5), torch.randn(8, 3)  # the same batch on every rank

    def backward():
        opt.zero_grad()
        scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()

    # step 1: an inf in the last rank's shard of the first weight's gradient
    before = [p.full_tensor() for p in model.parameters()]
    backward()
    if rank == world - 1:
        with torch.no_grad():
            model[0].weight.grad.to_local()[0, 0] = float("inf")
    scaler.step(opt)
    scaler.update()
    skipped = all(torch.equal(b, p.full_tensor()) for b, p in zip(before, model.parameters()))
    scale = scaler.get_scale()

    # step 2: finite; the clip norm (after unscaling) equals one process's
    backward()
    norm = memfit.amp.clip_grad_norm_(model.parameters(), 1e-3, scaler=scaler, optimizer=opt)
    scaler.step(opt)
    scaler.update()
    ref_model.zero_grad()
    torch.nn.functional.mse_loss(ref_model(x), y).backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 1e-3)
    return dict(skipped=skipped, scale=scale, norm=norm, ref_norm=ref_norm,
                scale2=scaler.get_scale())


def test_fsdp2_scaler_and_clip(two_ranks):
    res = [r["fsdp"] for r in two_ranks]
    for r in res:
        assert r["skipped"]
        assert r["scale"] == INIT_SCALE * BACKOFF
        assert r["scale2"] == INIT_SCALE * BACKOFF
        assert torch.equal(r["norm"], res[0]["norm"])
        torch.testing.assert_close(r["norm"], r["ref_norm"], rtol=1e-5, atol=0)


# ---- ranks: DDP with AdamW8bit, bitwise against one process ----------------------------


def _ddp_rank(rank, world):
    import memfit
    from memfit.amp import GradScaler
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))
    ref = copy.deepcopy(model)
    ddp = DDP(model)
    opt = memfit.optim.AdamW8bit(ddp.parameters(), lr=1e-2, min_8bit_size=64)
    ref_opt = memfit.optim.AdamW8bit(ref.parameters(), lr=1e-2, min_8bit_size=64)
    torch.manual_seed(1)
    steps = [(torch.randn(4 * world, 16), torch.randn(4 * world, 8)) for _ in range(3)]
    mse = torch.nn.functional.mse_loss
    grad_gap = 0.0
    for x, y in steps:
        xs, ys = x.chunk(world), y.chunk(world)
        opt.zero_grad()
        mse(ddp(xs[rank]), ys[rank]).backward()
        opt.step()
        # one process, no collectives: each rank's gradient computed here, then the
        # mean DDP takes (W = 2: (a + b) / 2 is exact whichever way DDP divides)
        per_rank = []
        for r in range(world):
            ref.zero_grad()
            mse(ref(xs[r]), ys[r]).backward()
            per_rank.append([p.grad.clone() for p in ref.parameters()])
        for i, p in enumerate(ref.parameters()):
            p.grad = sum(g[i] for g in per_rank) / world
        # the same global batch in one piece: the same gradient up to rounding
        full = copy.deepcopy(ref)
        full.zero_grad()
        mse(full(x), y).backward()
        grad_gap = max(grad_gap, max(float((a.grad - b.grad).abs().max())
                                     for a, b in zip(full.parameters(), ref.parameters())))
        ref_opt.step()
    params = [p.detach().clone() for p in ddp.parameters()]
    ref_params = [p.detach().clone() for p in ref.parameters()]
    states = [[v.clone() for v in opt.state[p].values() if isinstance(v, torch.Tensor)]
              for p in ddp.parameters()]
    ref_states = [[v.clone() for v in ref_opt.state[p].values() if isinstance(v, torch.Tensor)]
                  for p in ref.parameters()]

    # DDP + GradScaler: an inf in the last rank's input; every rank skips
    scaler = GradScaler("cpu", init_scale=INIT_SCALE, backoff_factor=BACKOFF)
    x, y = steps[0]
    xr = x.chunk(world)[rank].clone()
    if rank == world - 1:
        xr[0, 0] = float("inf")
    opt.zero_grad()
    scaler.scale(mse(ddp(xr), y.chunk(world)[rank])).backward()
    scaler.step(opt)
    scaler.update()
    skipped = all(torch.equal(a, b) for a, b in zip(params, ddp.parameters()))
    return dict(params=params, ref_params=ref_params, states=states, ref_states=ref_states,
                grad_gap=grad_gap, skipped=skipped, scale=scaler.get_scale())


def test_ddp_adamw8bit_bitwise_and_scaler(two_ranks):
    res = [r["ddp"] for r in two_ranks]
    for r in res:
        for a, b in zip(r["params"], res[0]["ref_params"]):
            assert torch.equal(a, b)
        for sa, sb in zip(r["states"], res[0]["ref_states"]):
            assert len(sa) == len(sb) > 0
            for a, b in zip(sa, sb):
                assert torch.equal(a, b)
        assert r["grad_gap"] < 1e-6
        assert r["skipped"]
        assert r["scale"] == INIT_SCALE * BACKOFF


# ---- the harness itself: a failing rank fails the test, naming the rank and the error ----


def _fail_on_last_rank(rank, world):
    if rank == world - 1:
        raise ValueError(f"deliberate failure on rank {rank}")
    return rank


def test_run_ranks_reports_the_failing_rank():
    with pytest.raises(pytest.fail.Exception) as e:
        run_ranks(_fail_on_last_rank, world_size=2, timeout=120)
    msg = str(e.value)
    assert "--- rank 1 ---" in msg and "ValueError: deliberate failure on rank 1" in msg
    assert "--- rank 0 ---" not in msg
    with pytest.raises(ValueError, match="module-level"):
        run_ranks(lambda rank, world: None, world_size=2)
