"""memfit's torch optimizers under FSDP2 (fully_shard: DTensor parameters sharded on
dim 0), HSDP (Replicate, Shard(0)) and Distributed Checkpoint, on the CPU with gloo.

- FSDP2 vs one process, bitwise: the same global gradients give the same parameters
  and the same state bits on W ranks as in one process, for shapes that shard badly
  (rows not a multiple of the block size, dim 0 not divisible by W, a weight whose
  shard is smaller than min_8bit_size while the whole tensor is not, a rank with no
  rows, 1-D biases).
- DCP: a checkpoint saved by 2 ranks loads in one process (plain model) and on 2 ranks
  (FSDP2), and training continues bit-exactly against the uninterrupted run.
- What cannot be stepped (parameters sharded on another dim, Partial or plain
  gradients of DTensor parameters) is refused with ValueError.

One spawn runs every 2-rank check (a spawn costs seconds); the rank functions return
plain values and tensors, and the assertions run here.
"""

import copy
import os

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch was built without torch.distributed", allow_module_level=True)

from dist_util import run_ranks  # noqa: E402

# Linear(2100, 1): weight (1, 2100), 8-bit by its global size, and on 2 ranks one rank
# has no row at all; Linear(1, 300): a small 2-D weight (float32 states); Linear(300, 37):
# weight (37, 300), rows of 300 (not a multiple of 256 or 128), 37 rows (19 + 18 on 2
# ranks, 10+10+10+7 on 4); Linear(37, 700): rows of 37 (shorter than a block);
# Linear(700, 3): weight (3, 700) = 2100 >= MIN_8BIT elements, but a shard of 1 or 2
# rows is < MIN_8BIT; the biases are 1-D (float32 states).
DIMS = (2100, 1, 300, 37, 700, 3)
MIN_8BIT = 2048
STEPS = 3
OPTIMIZERS = {"AdamW8bit": dict(lr=1e-2, min_8bit_size=MIN_8BIT),
              "AdamW4bit": dict(lr=1e-2, min_8bit_size=MIN_8BIT),
              "Lion8bit": dict(lr=1e-3, min_8bit_size=MIN_8BIT),
              "Adagrad8bit": dict(lr=1e-2, min_8bit_size=MIN_8BIT, initial_accumulator_value=0.1),
              # both schedulers move within the steps
              "AdEMAMix8bit": dict(lr=1e-2, min_8bit_size=MIN_8BIT, t_alpha=2, t_beta3=2)}


def _model():
    torch.manual_seed(0)
    layers = []
    for a, b in zip(DIMS, DIMS[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers[:-1])


def _shard(model, mesh=None, **fsdp_kwargs):
    """fully_shard per Linear, then the root; ``fsdp_kwargs`` (offload_policy, ...) go to
    every fully_shard call."""
    from torch.distributed.fsdp import fully_shard

    for m in model:
        if isinstance(m, torch.nn.Linear):
            fully_shard(m, mesh=mesh, **fsdp_kwargs)
    fully_shard(model, mesh=mesh, **fsdp_kwargs)
    return model


def _batch(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(8, DIMS[0], generator=g), torch.randn(8, DIMS[-1], generator=g)


def _full(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t.detach().clone()


def _full_states(opt, params):
    return [{k: _full(v) for k, v in opt.state[p].items()} for p in params]


def _same_states(a, b):
    return len(a) == len(b) > 0 and all(
        sorted(x) == sorted(y) and all(x[k].dtype == y[k].dtype and torch.equal(x[k], y[k]) for k in y)
        for x, y in zip(a, b))


def _same_dequantized(opt, p, ref_opt, q):
    """dequantized_state of a DTensor parameter: DTensors whose gathered values are the
    one-process values."""
    import memfit
    from torch.distributed.tensor import DTensor

    got, want = memfit.optim.dequantized_state(opt, p), memfit.optim.dequantized_state(ref_opt, q)
    return sorted(got) == sorted(want) != [] and all(
        isinstance(v, DTensor) and torch.equal(v.full_tensor(), want[k]) for k, v in got.items())


def _fsdp_step(model, opt, step):
    """One FSDP2 training step (every rank sees the same batch); returns the global
    gradients it stepped with."""
    x, y = (t.to(next(model.parameters()).dtype) for t in _batch(step))
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    grads = [p.grad.full_tensor() for p in model.parameters()]
    opt.step()
    return grads


def _plain_step(model, opt, grads):
    for p, g in zip(model.parameters(), grads):
        p.grad = g.clone()
    opt.step()


# ---- ranks ---------------------------------------------------------------------------------


def _bitwise_rank(rank, world, names=tuple(OPTIMIZERS), hsdp=False, dtype=torch.float32):
    """FSDP2 (or HSDP) with each optimizer for STEPS steps against one process fed the
    same global gradients (bfloat16 parameters: written with stochastic rounding, whose
    random draws must follow the global element index)."""
    import memfit
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    mesh = init_device_mesh("cpu", (2, world // 2) if hsdp else (world,),
                            mesh_dim_names=("replicate", "shard") if hsdp else None)
    out = {}
    for name in names:
        cls = getattr(memfit.optim, name)
        ref = _model().to(dtype)
        init = [p.detach().clone() for p in ref.parameters()]
        model = _shard(copy.deepcopy(ref), mesh)
        opt = cls(model.parameters(), **OPTIMIZERS[name])
        ref_opt = cls(ref.parameters(), **OPTIMIZERS[name])
        for step in range(STEPS):
            _plain_step(ref, ref_opt, _fsdp_step(model, opt, step))
        per_param = []
        for p, q, q0 in zip(model.parameters(), ref.parameters(), init):
            st = {k: _full(v) for k, v in opt.state[p].items()}
            ref_st = ref_opt.state[q]
            per_param.append(dict(
                placements=[repr(pl) for pl in p.placements],
                local_rows=p.to_local().shape[0],
                param=torch.equal(_full(p), q.detach()),
                moved=not torch.equal(q.detach(), q0),
                keys=(sorted(st), sorted(ref_st)),
                states={k: st[k].dtype == ref_st[k].dtype and torch.equal(st[k], ref_st[k])
                        for k in ref_st},
                dtensor_states=sorted(k for k, v in opt.state[p].items()
                                      if isinstance(v, DTensor)),
                dtypes={k: str(v.dtype) for k, v in st.items()},
                dequantized=_same_dequantized(opt, p, ref_opt, q)))
        out[name] = per_param
    return out


def _refusals_rank(rank, world):
    """What the optimizers refuse for DTensor parameters, with the messages."""
    import memfit
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    out = {}

    def attempt(label, placements, grad):
        p = torch.nn.Parameter(distribute_tensor(torch.ones(4, 6), mesh, placements))
        p.grad = grad(p)
        opt = memfit.optim.AdamW8bit([p], min_8bit_size=0)
        try:
            opt.step()
            out[label] = None
        except ValueError as e:
            out[label] = str(e)

    attempt("shard1", [Shard(1)], lambda p: distribute_tensor(torch.ones(4, 6), mesh, [Shard(1)]))
    from torch.distributed.tensor.placement_types import _StridedShard

    strided = [_StridedShard(0, split_factor=2)]  # what FSDP2 over tensor parallel makes
    attempt("strided", strided, lambda p: distribute_tensor(torch.ones(4, 6), mesh, strided))
    attempt("partial_grad", [Replicate()],
            lambda p: DTensor.from_local(torch.ones(4, 6), mesh, [Partial()]))
    attempt("plain_grad", [Shard(0)], lambda p: torch.ones(4, 6))
    attempt("other_grad", [Shard(0)], lambda p: distribute_tensor(torch.ones(4, 6), mesh, [Replicate()]))
    return out


def _load_plain_rank(rank, world):
    """A one-process optimizer's state_dict() loads into the FSDP2 optimizer (each rank
    keeps its rows) and the sharded state_dict() loads into a plain optimizer (gathered):
    the same states either way, and the state dicts say their format in every group."""
    import memfit
    from torch.distributed.tensor import DTensor, Replicate

    ref = _model()
    model = _shard(copy.deepcopy(ref))
    opt = memfit.optim.AdamW8bit(model.parameters(), **OPTIMIZERS["AdamW8bit"])
    ref_opt = memfit.optim.AdamW8bit(ref.parameters(), **OPTIMIZERS["AdamW8bit"])
    _plain_step(ref, ref_opt, _fsdp_step(model, opt, 0))
    _plain_step(ref, ref_opt, _fsdp_step(model, opt, 1))
    sharded_sd = opt.state_dict()
    fresh = memfit.optim.AdamW8bit(model.parameters(), **OPTIMIZERS["AdamW8bit"])
    fresh.load_state_dict(ref_opt.state_dict())
    # DTensor states of other placements (Replicate) are redistributed to the parameter's
    replicated = copy.copy(sharded_sd)
    replicated["state"] = {pid: {k: v.redistribute(v.device_mesh, [Replicate()]) if isinstance(v, DTensor)
                                 else v for k, v in st.items()} for pid, st in sharded_sd["state"].items()}
    from_replicated = memfit.optim.AdamW8bit(model.parameters(), **OPTIMIZERS["AdamW8bit"])
    from_replicated.load_state_dict(replicated)
    plain = memfit.optim.AdamW8bit(ref.parameters(), **OPTIMIZERS["AdamW8bit"])
    del sharded_sd["memfit"]  # as get_state_dict leaves it: the groups say the format
    plain.load_state_dict(sharded_sd)
    return dict(
        formats=[g.get("memfit_format") for g in opt.state_dict()["param_groups"]],
        into_sharded=_same_states(_full_states(fresh, model.parameters()),
                                  _full_states(ref_opt, ref.parameters())),
        sharded_are_dtensors=all(isinstance(fresh.state[p]["state1"], DTensor)
                                 for p in model.parameters()),
        from_replicated=_same_states(_full_states(from_replicated, model.parameters()),
                                     _full_states(ref_opt, ref.parameters())),
        replicated_placements=all(
            from_replicated.state[p]["state1"].placements == p.placements
            and from_replicated.state[p]["state1"].to_local().shape[0] == p.to_local().shape[0]
            for p in model.parameters()),
        into_plain=_same_states(_full_states(plain, ref.parameters()),
                                _full_states(ref_opt, ref.parameters())),
        plain_are_plain=all(type(v) is torch.Tensor for p in ref.parameters()
                            for v in plain.state[p].values()))


def _corrupt_load_rank(rank, world):
    """Sharded state dicts that are corrupt or incomplete (a NaN absmax in the last
    rank's rows only, a state missing, a negative step): every rank refuses them, the
    value checks being reduced over the mesh, and keeps its states."""
    import math

    import memfit

    model = _shard(_model())
    opt = memfit.optim.AdamW8bit(model.parameters(), **OPTIMIZERS["AdamW8bit"])
    _fsdp_step(model, opt, 0)
    params = list(model.parameters())
    before = _full_states(opt, params)
    out = {}

    def attempt(label, spoil):
        sd = opt.state_dict()
        sd["state"] = {pid: {k: v.clone() for k, v in st.items()} for pid, st in sd["state"].items()}
        spoil(sd["state"][4])  # the (37, 300) weight: 8-bit states, rows 19 + 18
        try:
            opt.load_state_dict(sd)
            out[label] = None
        except ValueError as e:
            out[label] = str(e)

    def nan_in_last_rank(st):
        if rank == world - 1:
            st["absmax1"].to_local()[-1, 0] = math.nan

    attempt("nan_absmax", nan_in_last_rank)
    attempt("missing", lambda st: st.pop("state2"))
    attempt("step", lambda st: st["step"].fill_(-2.0))
    out["unchanged"] = _same_states(_full_states(opt, params), before)
    return out


def _scaler_rank(rank, world):
    """GradScaler (memfit's, which hands grad_scale/found_inf to memfit's step, and
    torch's, which unscales the DTensor gradients itself and skips on the host) with
    FSDP2 and AdamW8bit: an inf in the last rank's shard skips the step on
    every rank; a finite scaled step equals one process's unscaled step bitwise (the
    scale is a power of 2, so unscaling is exact)."""
    import memfit
    from memfit.amp import GradScaler

    out = {}
    for kind in ("memfit", "torch"):
        ref = _model()
        model = _shard(copy.deepcopy(ref))
        opt = memfit.optim.AdamW8bit(model.parameters(), **OPTIMIZERS["AdamW8bit"])
        ref_opt = memfit.optim.AdamW8bit(ref.parameters(), **OPTIMIZERS["AdamW8bit"])
        scaler = (GradScaler("cpu", init_scale=2.0**10) if kind == "memfit"
                  else torch.amp.GradScaler("cpu", init_scale=2.0**10))
        skipped = []
        for step in range(3):
            x, y = _batch(step)
            opt.zero_grad()
            scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
            if step == 1 and rank == world - 1:
                with torch.no_grad():
                    model[4].weight.grad.to_local()[-1, 0] = float("inf")
            grads = [(p.grad.full_tensor() / scaler.get_scale()) for p in model.parameters()]
            before = [_full(p) for p in model.parameters()]
            scaler.step(opt)
            scaler.update()
            skipped.append(all(torch.equal(b, _full(p)) for b, p in zip(before, model.parameters())))
            if not skipped[-1]:
                _plain_step(ref, ref_opt, grads)
        out[kind] = dict(skipped=skipped, scale=scaler.get_scale(),
                         same=_same_states(_full_states(opt, model.parameters()),
                                           _full_states(ref_opt, ref.parameters()))
                         and all(torch.equal(_full(p), q.detach())
                                 for p, q in zip(model.parameters(), ref.parameters())))
    return out


def _all_checks(rank, world, ckpt):
    """Every 2-rank group of checks in one spawn."""
    return dict(bitwise=_bitwise_rank(rank, world), hsdp=_bitwise_rank(rank, world, ("AdamW8bit",), True),
                bf16=_bitwise_rank(rank, world, ("AdamW8bit",), dtype=torch.bfloat16),
                refusals=_refusals_rank(rank, world), load_plain=_load_plain_rank(rank, world),
                corrupt=_corrupt_load_rank(rank, world),
                scaler=_scaler_rank(rank, world),
                dcp=_dcp_rank(rank, world, ckpt))


# ---- DCP: save on W ranks, continue; load and continue ----------------------------------


SAVE_AT = 2   # steps before the checkpoint
AFTER = 2     # steps after it


def _dcp_model_and_opt(sharded, name="AdamW8bit", **fsdp_kwargs):
    import memfit

    model = _model()
    if sharded:
        _shard(model, **fsdp_kwargs)
    return model, getattr(memfit.optim, name)(model.parameters(), **OPTIMIZERS[name])


def _dcp_rank(rank, world, ckpt):
    """Trains SAVE_AT steps, saves (get_state_dict + dcp.save), trains AFTER more; then a
    fresh model and optimizer load the checkpoint (dcp.load + set_state_dict) and train
    the same AFTER steps. Returns both runs' final parameters and states, and the
    gradients of the AFTER steps (for the one-process resume in the parent)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, opt = _dcp_model_and_opt(sharded=True)
    for step in range(SAVE_AT):
        _fsdp_step(model, opt, step)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=ckpt)
    grads = [_fsdp_step(model, opt, SAVE_AT + i) for i in range(AFTER)]
    straight = ([_full(p) for p in model.parameters()], _full_states(opt, model.parameters()))

    model, opt = _dcp_model_and_opt(sharded=True)
    msd, osd = get_state_dict(model, opt)
    sd = {"model": msd, "optim": osd}
    dcp.load(sd, checkpoint_id=ckpt)
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    for i in range(AFTER):
        _fsdp_step(model, opt, SAVE_AT + i)
    resumed = ([_full(p) for p in model.parameters()], _full_states(opt, model.parameters()))
    return dict(straight=straight, resumed=resumed, grads=grads)


def _resume(ckpt, grads, sharded):
    """Loads the checkpoint into a fresh model (FSDP2 on this process group, or plain in
    one process) and steps with the recorded global gradients."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.tensor import distribute_tensor

    model, opt = _dcp_model_and_opt(sharded)
    msd, osd = get_state_dict(model, opt)
    sd = {"model": msd, "optim": osd}
    dcp.load(sd, checkpoint_id=ckpt)
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    for step_grads in grads:
        for p, g in zip(model.parameters(), step_grads):
            p.grad = (distribute_tensor(g, p.device_mesh, p.placements, src_data_rank=None)
                      if sharded else g.clone())
        opt.step()
    return [_full(p) for p in model.parameters()], _full_states(opt, model.parameters())


def _four_ranks(rank, world, ckpt, grads):
    return dict(bitwise=_bitwise_rank(rank, world), hsdp=_bitwise_rank(rank, world, ("AdamW8bit",), True),
                resumed=_resume(ckpt, grads, sharded=True))


# ---- the tests -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("dcp") / "ckpt")
    return ckpt, run_ranks(_all_checks, world_size=2, args=(ckpt,), timeout=240)


def _check_bitwise(res, world):
    for name, per_param in res.items():
        for i, st in enumerate(per_param):
            where = f"{name} parameter {i} on {world} ranks"
            assert st["param"] and st["moved"], where
            assert st["dequantized"], where
            assert st["keys"][0] == st["keys"][1], where
            assert all(st["states"].values()), (where, st["states"])
            assert st["dtensor_states"] == sorted(k for k in st["keys"][0] if k != "step"), where
        # 8-bit / 4-bit states from the global size, whatever the local shard's size
        weights = [st["dtypes"]["state1"] for st in per_param[0::2]]
        assert weights == ["torch.uint8" if a * b >= MIN_8BIT else "torch.float32"
                           for a, b in zip(DIMS, DIMS[1:])], name
        assert weights.count("torch.uint8") == 4, name
        assert all(b["dtypes"]["state1"] == "torch.float32" for b in per_param[1::2]), name


def test_fsdp2_matches_one_process_bitwise(two_ranks):
    _, res = two_ranks
    for r in res:
        _check_bitwise(r["bitwise"], 2)
    # the awkward shards: (1, 2100) split 1 + 0, 37 rows 19 + 18, (3, 700) 2 + 1
    rows = [[st["local_rows"] for st in r["bitwise"]["AdamW8bit"][0::2]] for r in res]
    assert rows == [[1, 150, 19, 350, 2], [0, 150, 18, 350, 1]]
    assert res[0]["bitwise"]["AdamW8bit"][0]["placements"] == ["Shard(dim=0)"]


def test_fsdp2_bf16_stochastic_rounding_matches_one_process(two_ranks):
    _, res = two_ranks
    for r in res:
        _check_bitwise(r["bf16"], 2)


def test_hsdp_matches_one_process_bitwise(two_ranks):
    _, res = two_ranks
    for r in res:
        _check_bitwise(r["hsdp"], 2)
        assert r["hsdp"]["AdamW8bit"][0]["placements"] == ["Replicate()", "Shard(dim=0)"]
        # mesh (2, 1): replicated on the 2 ranks, each holds every row
        assert [st["local_rows"] for st in r["hsdp"]["AdamW8bit"][0::2]] == list(DIMS[1:])


def test_refuses_what_cannot_be_stepped(two_ranks):
    _, res = two_ranks
    for r in res:
        msg = r["refusals"]
        assert "param_groups[0]['params'][0]" in msg["shard1"] and "Shard(dim=1)" in msg["shard1"]
        assert "dim 0" in msg["shard1"]
        assert "_StridedShard" in msg["strided"] and "contiguous range" in msg["strided"]
        assert "Partial" in msg["partial_grad"] and "reduce it first" in msg["partial_grad"]
        assert "a Tensor" in msg["plain_grad"]
        assert "Replicate()" in msg["other_grad"]


def test_state_dict_between_sharded_and_plain(two_ranks):
    _, res = two_ranks
    for r in res:
        st = r["load_plain"]
        assert st["formats"] == [st["formats"][0]] and isinstance(st["formats"][0], int)
        assert st["into_sharded"] and st["sharded_are_dtensors"]
        assert st["from_replicated"] and st["replicated_placements"]
        assert st["into_plain"] and st["plain_are_plain"]


def test_corrupt_sharded_state_dict_refused_on_every_rank(two_ranks):
    _, res = two_ranks
    where = "AdamW8bit.load_state_dict: param_groups[0]['params'][4] (shape (37, 300))"
    for r in res:
        msg = r["corrupt"]
        assert msg["nan_absmax"] is not None and msg["nan_absmax"].startswith(
            where + ": state 'absmax1' holds NaN, Inf or negative block scales"), msg
        assert msg["missing"].startswith(where + ": has no state 'state2'"), msg
        assert msg["step"].startswith(where + ": state 'step' (-2.0) is not a whole number"), msg
        assert r["corrupt"]["unchanged"]


def test_grad_scaler_with_fsdp2(two_ranks):
    _, res = two_ranks
    for r in res:
        for kind in ("memfit", "torch"):
            st = r["scaler"][kind]
            assert st["skipped"] == [False, True, False], kind  # the inf on one rank only
            assert st["scale"] == 2.0**9, kind
            assert st["same"], kind


def _assert_same_run(a, b, what):
    (pa, sa), (pb, sb) = a, b
    assert len(pa) == len(pb) == 2 * (len(DIMS) - 1)
    for i, (x, y) in enumerate(zip(pa, pb)):
        assert torch.equal(x, y), f"{what}: parameter {i}"
    for i, (x, y) in enumerate(zip(sa, sb)):
        assert sorted(x) == sorted(y), what
        for k in x:
            assert x[k].dtype == y[k].dtype and torch.equal(x[k], y[k]), f"{what}: state {k} of {i}"


def test_dcp_resumes_bit_exactly_on_2_ranks(two_ranks):
    _, res = two_ranks
    for r in res:
        _assert_same_run(r["dcp"]["resumed"], r["dcp"]["straight"], "2 ranks")
    _assert_same_run(res[1]["dcp"]["straight"], res[0]["dcp"]["straight"], "rank 1 vs rank 0")
    assert int(res[0]["dcp"]["straight"][1][0]["step"]) == SAVE_AT + AFTER


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # one process: meant
def test_dcp_from_2_ranks_resumes_in_one_process(two_ranks):
    ckpt, res = two_ranks
    d = res[0]["dcp"]
    _assert_same_run(_resume(ckpt, d["grads"], sharded=False), d["straight"], "one process")


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("MEMFIT_SLOW_TESTS"),
                    reason="4 spawned ranks take about 40 s on 2 shared cores; set MEMFIT_SLOW_TESTS=1")
def test_4_ranks_bitwise_and_resume_from_2(two_ranks):
    """On 4 ranks (37 rows as 10+10+10+7, the (3, 700) weight as 1+1+1+0, HSDP on a
    (2, 2) mesh) the same bits as one process, and the 2-rank checkpoint resumes."""
    ckpt, res2 = two_ranks
    d = res2[0]["dcp"]
    res = run_ranks(_four_ranks, world_size=4, args=(ckpt, d["grads"]), timeout=300)
    for r in res:
        _check_bitwise(r["bitwise"], 4)
        _check_bitwise(r["hsdp"], 4)
        _assert_same_run(r["resumed"], d["straight"], "4 ranks from 2")
    rows = [[st["local_rows"] for st in r["bitwise"]["AdamW8bit"][0::2]] for r in res]
    assert [row[2] for row in rows] == [10, 10, 10, 7] and [row[4] for row in rows] == [1, 1, 1, 0]


def test_format_recorded_per_group_for_get_state_dict():
    """get_state_dict/set_state_dict keep only "state" and "param_groups": the format in
    every group is enough to load, a wrong one is refused, and a torch.optim state dict
    (no record at all) is still told apart."""
    import memfit

    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(64, 64))
    p.grad = torch.randn(64, 64)
    opt = memfit.optim.AdamW8bit([p], min_8bit_size=0)
    opt.step()
    sd = opt.state_dict()
    assert [g["memfit_format"] for g in sd["param_groups"]] == [sd["memfit"]["format_version"]]
    del sd["memfit"]
    other = memfit.optim.AdamW8bit([p], min_8bit_size=0)
    other.load_state_dict(sd)
    assert "memfit_format" not in other.param_groups[0]  # a record, not a setting
    assert all(torch.equal(v, opt.state[p][k]) for k, v in other.state[p].items())
    sd["param_groups"][0]["memfit_format"] = 99
    with pytest.raises(ValueError, match="unknown format_version 99"):
        other.load_state_dict(sd)
    from memfit.optim._torch import saved_format

    t = torch.optim.AdamW([p])
    t.step()
    assert saved_format(t.state_dict()) == (None, None)
    assert saved_format(opt.state_dict())[0] == "AdamW8bit"
