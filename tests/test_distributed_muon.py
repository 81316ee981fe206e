"""memfit's Muon8bit and Muon under FSDP2 (fully_shard: DTensor parameters sharded on
dim 0) and HSDP, on the CPU with gloo.

- The same bits as one process and at every world size: Muon groups for the weights
  (their matrices orthogonalized once, by one rank, the rows scattered back), a
  ``use_muon=False`` (AdamW) group for the biases; float32 and bfloat16 parameters (the
  bfloat16 writes round stochastically, each shard drawing its elements' bits in the
  whole tensor); parameters, states and dequantized momentum compared bitwise, for shapes
  that shard badly (a weight of one row: one rank holds none; 37 rows as 19 + 18; a
  tall (300, 1) weight with float32 momentum in a bucket of its own).
- Distributed Checkpoint: saved on 1 rank and resumed on 2, saved on 2 and resumed in
  one process (a plain model), continuing bit-exactly against the uninterrupted run.
- Refused, naming the parameter, with nothing changed: a Muon parameter sharded on
  another dim, or on two mesh dimensions, and a gradient laid out unlike its parameter.

Spawns: world size 1 (saves a checkpoint), then 2 (resumes it, saves its own, which the
test process resumes without torch.distributed); 4 ranks with MEMFIT_SLOW_TESTS=1.
"""

import copy
import os

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch was built without torch.distributed", allow_module_level=True)

from dist_util import checkpoint_spawns, run_ranks  # noqa: E402
from test_distributed_optim import (  # noqa: E402 - one definition of each helper
    AFTER,
    DIMS,
    MIN_8BIT,
    SAVE_AT,
    STEPS,
    _assert_same_run,
    _fsdp_step,
    _full,
    _full_states,
    _model,
    _plain_step,
    _shard,
)

# label -> (optimizer, parameter dtype)
CASES = {"Muon8bit": ("Muon8bit", torch.float32), "Muon8bit bf16": ("Muon8bit", torch.bfloat16),
         "Muon": ("Muon", torch.float32), "Muon bf16": ("Muon", torch.bfloat16)}
CHECKPOINTED = ("Muon8bit", "Muon8bit bf16")
KWARGS = dict(lr=0.02, weight_decay=0.1, adamw_lr=1e-2, min_8bit_size=MIN_8BIT)


def _opt(label, model):
    """The weights (2-D) in a Muon group, the biases in an AdamW one."""
    import memfit

    params = list(model.parameters())
    groups = [{"params": [p for p in params if p.dim() == 2]},
              {"params": [p for p in params if p.dim() != 2], "use_muon": False}]
    return getattr(memfit.optim, CASES[label][0])(groups, **KWARGS)


def _dequantized(opt, p):
    import memfit

    return {k: _full(v) for k, v in memfit.optim.dequantized_state(opt, p).items()}


def _run(model, opt):
    """(gathered parameters, states, dequantized states) of a run."""
    params = list(model.parameters())
    return ([_full(p) for p in params], _full_states(opt, params),
            [_dequantized(opt, p) for p in params])


# ---- ranks ---------------------------------------------------------------------------------


def _train_rank(rank, world, labels=tuple(CASES), hsdp=False):
    """Each case for STEPS FSDP2 (or HSDP) steps against one process fed the same global
    gradients; the gathered run comes back for the comparison across world sizes."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, world // 2) if hsdp else (world,),
                            mesh_dim_names=("replicate", "shard") if hsdp else None)
    out = {}
    for label in labels:
        ref = _model().to(CASES[label][1])
        init = [p.detach().clone() for p in ref.parameters()]
        model = _shard(copy.deepcopy(ref), mesh)
        opt, ref_opt = _opt(label, model), _opt(label, ref)
        for step in range(STEPS):
            _plain_step(ref, ref_opt, _fsdp_step(model, opt, step))
        run, want = _run(model, opt), _run(ref, ref_opt)
        out[label] = dict(
            run=run, one_process=want,
            moved=all(not torch.equal(q.detach(), q0) for q, q0 in zip(ref.parameters(), init)),
            local_rows=[p.to_local().shape[0] for p in model.parameters()],
            placements=[repr(pl) for pl in next(model.parameters()).placements],
            dtypes=[str(opt.state[p]["state1"].dtype) for p in model.parameters()])
    return out


def _refusals_rank(rank, world):
    """Muon's refusals of DTensor layouts it cannot orthogonalize, and a step refused for
    a bad gradient: the messages, and whether anything changed."""
    import memfit
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    out = {}

    def param(placements, m=mesh):
        torch.manual_seed(0)
        return torch.nn.Parameter(distribute_tensor(torch.randn(8, 6), m, placements))

    try:
        memfit.optim.Muon8bit([param([Shard(1)])])
        out["shard1"] = None
    except ValueError as e:
        out["shard1"] = str(e)
    good = param([Shard(0)])
    opt = memfit.optim.Muon8bit([good], min_8bit_size=0)
    try:  # (Shard(0), Shard(0)) on a (world, 1) mesh: rows cut on two mesh dimensions
        opt.add_param_group({"params": [param([Shard(0), Shard(0)],
                                              init_device_mesh("cpu", (world, 1)))]})
        out["two_dims"] = None
    except ValueError as e:
        out["two_dims"] = str(e)
    out["groups_after_refusal"] = len(opt.param_groups)
    bad = param([Shard(0)])
    opt.add_param_group({"params": [bad]})
    before = [_full(good), _full(bad)]
    good.grad = distribute_tensor(torch.ones(8, 6), mesh, [Shard(0)])
    bad.grad = distribute_tensor(torch.ones(8, 6), mesh, [Replicate()])
    try:
        opt.step()
        out["bad_grad"] = None
    except ValueError as e:
        out["bad_grad"] = str(e)
    out["unchanged"] = (torch.equal(_full(good), before[0]) and torch.equal(_full(bad), before[1])
                        and len(opt.state) == 0)
    bad.grad = distribute_tensor(torch.ones(8, 6), mesh, [Shard(0)])
    opt.step()  # the same step, fixed, goes through
    out["then_steps"] = not torch.equal(_full(good), before[0])
    return out


def _newton_schulz_rank(rank, world):
    """The shapes of the matrices this rank orthogonalizes in one FSDP2 step of
    Muon8bit (every rank must not orthogonalize every matrix)."""
    from memfit.optim import muon

    model = _shard(_model())
    opt = _opt("Muon8bit", model)
    shapes, ns = [], muon.zeropower_via_newtonschulz

    def counted(g, *args):
        shapes.append(tuple(g.shape))
        return ns(g, *args)

    muon.zeropower_via_newtonschulz = counted
    try:
        _fsdp_step(model, opt, 0)
    finally:
        muon.zeropower_via_newtonschulz = ns
    return shapes


def _dcp_rank(rank, world, save_to, load_from):
    """For each CHECKPOINTED case: trains SAVE_AT steps, saves to ``save_to/label``
    (get_state_dict + dcp.save), trains AFTER more (the uninterrupted run; its gradients
    come back for a resume in one process); with ``load_from``, loads the checkpoint
    another world size saved there into a fresh model and optimizer and trains the same
    AFTER steps."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    def fresh(label):
        model = _shard(_model().to(CASES[label][1]))
        return model, _opt(label, model)

    out = {}
    for label in CHECKPOINTED:
        res = {}
        if save_to is not None:
            model, opt = fresh(label)
            for step in range(SAVE_AT):
                _fsdp_step(model, opt, step)
            msd, osd = get_state_dict(model, opt)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(save_to, label))
            res["grads"] = [_fsdp_step(model, opt, SAVE_AT + i) for i in range(AFTER)]
            res["straight"] = _run(model, opt)[:2]
        if load_from is not None:
            model, opt = fresh(label)
            msd, osd = get_state_dict(model, opt)
            sd = {"model": msd, "optim": osd}
            dcp.load(sd, checkpoint_id=os.path.join(load_from, label))
            set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
            for i in range(AFTER):
                _fsdp_step(model, opt, SAVE_AT + i)
            res["resumed"] = _run(model, opt)[:2]
        out[label] = res
    return out


def _checks_rank(rank, world, save_to, load_from):
    out = dict(train=_train_rank(rank, world), dcp=_dcp_rank(rank, world, save_to, load_from),
               newton_schulz=_newton_schulz_rank(rank, world))
    if world >= 2:
        out["hsdp"] = _train_rank(rank, world, ("Muon8bit",), hsdp=True)
        out["refusals"] = _refusals_rank(rank, world)
    return out


def _resume_plain(ckpt, label, grads):
    """Loads a checkpoint into a plain model and optimizer in this process (no process
    group) and steps with the recorded global gradients."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model = _model().to(CASES[label][1])
    opt = _opt(label, model)
    msd, osd = get_state_dict(model, opt)
    sd = {"model": msd, "optim": osd}
    dcp.load(sd, checkpoint_id=os.path.join(ckpt, label))
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    for step_grads in grads:
        _plain_step(model, opt, step_grads)
    return _run(model, opt)[:2]


# ---- the tests -----------------------------------------------------------------------------


ckpt_dirs, one_rank, two_ranks = checkpoint_spawns(_checks_rank, "muon")


def _assert_same_dequantized(got, want, where):
    for i, (a, b) in enumerate(zip(got, want)):
        assert sorted(a) == sorted(b) != [], (where, i)
        assert all(torch.equal(a[k], b[k]) for k in a), (where, i)


def _check_train(res, want, world):
    """``res``: one rank's _train_rank result; ``want``: the 1-rank one (or None)."""
    for label, st in res.items():
        where = f"{label} on {world} ranks"
        assert st["moved"], where
        (params, states, deq), (ref_params, ref_states, ref_deq) = st["run"], st["one_process"]
        _assert_same_run((params, states), (ref_params, ref_states), f"{where} vs one process")
        _assert_same_dequantized(deq, ref_deq, where)
        if want is not None:  # and the same bits as on 1 rank
            _assert_same_run((params, states), want[label]["run"][:2], f"{where} vs 1 rank")
            _assert_same_dequantized(deq, want[label]["run"][2], f"{where} vs 1 rank")
        # the momentum's precision from the global size: 8-bit where Muon8bit says so
        weights = st["dtypes"][0::2]
        eight = [d == "torch.uint8" for d in weights]
        assert eight == ([True, False, True, True, True] if CASES[label][0] == "Muon8bit"
                         else [False] * 5), (where, weights)


def test_muon_fsdp2_same_bits_as_one_process_at_1_and_2_ranks(one_rank, two_ranks):
    _check_train(one_rank["train"], None, 1)
    for r in two_ranks:
        _check_train(r["train"], one_rank["train"], 2)
    # the awkward shards: (1, 2100) as 1 + 0 rows, (37, 300) as 19 + 18
    rows = [r["train"]["Muon8bit"]["local_rows"][0::2] for r in two_ranks]
    assert rows == [[1, 150, 19, 350, 2], [0, 150, 18, 350, 1]]
    assert two_ranks[0]["train"]["Muon8bit"]["placements"] == ["Shard(dim=0)"]


def test_each_matrix_orthogonalized_once(one_rank, two_ranks):
    """Each whole matrix once per step, over all ranks: on 2 ranks the matrices of each
    bucket go to rank 0, 1, 0, ... in turn (the 8-bit bucket, then the float32 one)."""
    weights = [(b, a) for a, b in zip(DIMS, DIMS[1:])]
    assert sorted(one_rank["newton_schulz"]) == sorted(weights)
    got = [r["newton_schulz"] for r in two_ranks]
    assert got == [[(1, 2100), (700, 37), (300, 1)], [(37, 300), (3, 700)]]


def test_muon_hsdp_same_bits(one_rank, two_ranks):
    for r in two_ranks:
        assert r["hsdp"]["Muon8bit"]["placements"] == ["Replicate()", "Shard(dim=0)"]
        _check_train(r["hsdp"], one_rank["train"], 2)


def test_muon_refuses_what_it_cannot_orthogonalize(two_ranks):
    for r in two_ranks:
        msg = r["refusals"]
        assert msg["shard1"] is not None and "param_groups[0]['params'][0]" in msg["shard1"], msg
        assert "Shard(dim=1)" in msg["shard1"] and "dim 0" in msg["shard1"], msg
        assert msg["two_dims"] is not None and "param_groups[1]['params'][0]" in msg["two_dims"]
        assert "2 mesh dimensions" in msg["two_dims"], msg
        assert msg["groups_after_refusal"] == 1
        assert "param_groups[1]['params'][0]" in msg["bad_grad"] and "Replicate()" in msg["bad_grad"]
        assert msg["unchanged"] and msg["then_steps"]


def test_muon_dcp_saved_on_1_rank_resumes_on_2(one_rank, two_ranks):
    for label in CHECKPOINTED:
        straight = one_rank["dcp"][label]["straight"]
        assert int(straight[1][0]["step"]) == SAVE_AT + AFTER
        for rank, r in enumerate(two_ranks):
            _assert_same_run(r["dcp"][label]["straight"], straight, f"{label} straight, rank {rank}")
            _assert_same_run(r["dcp"][label]["resumed"], straight, f"{label} 1 -> 2, rank {rank}")


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # one process: meant
def test_muon_dcp_saved_on_2_ranks_resumes_in_one_process(ckpt_dirs, two_ranks):
    for label in CHECKPOINTED:
        d = two_ranks[0]["dcp"][label]
        _assert_same_run(_resume_plain(ckpt_dirs[1], label, d["grads"]), d["straight"],
                         f"{label} 2 -> one process")


def _four_ranks(rank, world, ckpt):
    return dict(train=_train_rank(rank, world), hsdp=_train_rank(rank, world, ("Muon8bit",), True),
                dcp=_dcp_rank(rank, world, None, ckpt),
                newton_schulz=_newton_schulz_rank(rank, world))


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("MEMFIT_SLOW_TESTS"),
                    reason="4 spawned ranks take about 40 s on 2 shared cores; set MEMFIT_SLOW_TESTS=1")
def test_muon_4_ranks_same_bits_and_resume_from_2(ckpt_dirs, one_rank, two_ranks):
    """On 4 ranks (a batch of 4 matrices, one per rank; the (3, 700) weight as 1+1+1+0
    rows; HSDP on a (2, 2) mesh): the same bits, and the 2-rank checkpoint resumes."""
    res = run_ranks(_four_ranks, world_size=4, args=(ckpt_dirs[1],), timeout=300)
    for r in res:
        _check_train(r["train"], one_rank["train"], 4)
        _check_train(r["hsdp"], one_rank["train"], 4)
        for label in CHECKPOINTED:
            _assert_same_run(r["dcp"][label]["resumed"], two_ranks[0]["dcp"][label]["straight"],
                             f"{label} 2 -> 4")
    assert [r["train"]["Muon8bit"]["local_rows"][8] for r in res] == [1, 1, 1, 0]
    # the 8-bit bucket's 4 matrices, one per rank; the float32 one on rank 0
    assert [r["newton_schulz"] for r in res] == [[(1, 2100), (300, 1)], [(37, 300)], [(700, 37)],
                                                 [(3, 700)]]
