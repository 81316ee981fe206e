"""memfit's optimizers under FSDP2 with its own CPU offload
(``fully_shard(..., offload_policy=CPUOffloadPolicy())``: sharded parameters, gradients
and the optimizer's states on the host, the step run there), on the CPU with gloo.

- Training runs with AdamW8bit, AdamW4bit, Lion8bit and SGD8bit (momentum) at world
  sizes 1 and 2, and gives the same bits as FSDP2 without offload (every local shard of
  parameters and states) and the same bits at both world sizes (parameters, states and
  dequantized states, gathered).
- Distributed Checkpoint: saved on 1 rank and resumed on 2, saved on 2 and resumed on 1,
  both continuing bit-exactly against the uninterrupted run.
- Host bytes per parameter, counted from the storages each rank holds (sharded
  parameters, gradients, states, absmax), against the layout's formula and torch AdamW.
- The layout the offload makes on a GPU machine (a CUDA mesh whose shards live on the
  host), built here as FSDP2 builds it: states are made, stepped and loaded on the host,
  next to the shards, never on the mesh's device (DTensor.from_local would put them
  there; the step then failed, as torchao's AdamW8bit did: pytorch/ao#1931, #3116).

On the CPU, FSDP2's "device" is the CPU too: what offload adds here is FSDP2's offload
path (its host copies, its gradient hand-off), not the host/device split; the mixed
layout is the last check's. Speed and GPU memory are owed to a GPU.

Spawns: world size 1, then 2 (it resumes the 1-rank checkpoint), then 1 again (it
resumes the 2-rank checkpoint); each runs many checks and returns plain values, and the
assertions run here.
"""

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch was built without torch.distributed", allow_module_level=True)

from dist_util import checkpoint_spawns, run_ranks  # noqa: E402
from test_distributed_optim import (  # noqa: E402 - one definition of each helper
    AFTER,
    MIN_8BIT,
    OPTIMIZERS,
    SAVE_AT,
    STEPS,
    _assert_same_run,
    _dcp_model_and_opt,
    _fsdp_step,
    _full,
    _full_states,
    _model,
    _shard,
)

TRAINED = {**OPTIMIZERS, "SGD8bit": dict(lr=1e-2, momentum=0.9, min_8bit_size=MIN_8BIT)}
CHECKPOINTED = ("AdamW8bit", "AdamW4bit")  # 8-bit codes, and 4-bit codes packed 2 per byte
# the host-bytes model: two weights every one of whose states is quantized, rows that
# split evenly (FSDP2 pads uneven shards, and the padding would blur the count)
BYTES_DIMS = (256, 512, 256)


def _offload():
    from torch.distributed.fsdp import CPUOffloadPolicy

    # pinned host memory needs an accelerator; the layout is the same either way
    return CPUOffloadPolicy(pin_memory=torch.cuda.is_available())


def _locals_on_cpu(opt, params) -> bool:
    from torch.distributed.tensor import DTensor

    return all(isinstance(v, DTensor) and v.to_local().device.type == "cpu"
               for p in params for k, v in opt.state[p].items() if k != "step") \
        and all(p.to_local().device.type == "cpu" for p in params)


# ---- ranks ---------------------------------------------------------------------------------


def _train_rank(rank, world):
    """Each optimizer, STEPS steps, on an offloaded and a not offloaded FSDP2 model fed the
    same batches: local shards compared bitwise; gathered parameters, states and
    dequantized states returned for the comparison across world sizes."""
    import memfit

    out = {}
    for name, kwargs in TRAINED.items():
        cls = getattr(memfit.optim, name)
        init = [p.detach().clone() for p in _model().parameters()]
        offloaded = _shard(_model(), offload_policy=_offload())
        plain = _shard(_model())
        opt, plain_opt = cls(offloaded.parameters(), **kwargs), cls(plain.parameters(), **kwargs)
        for step in range(STEPS):
            _fsdp_step(offloaded, opt, step)
            _fsdp_step(plain, plain_opt, step)
        params, plain_params = list(offloaded.parameters()), list(plain.parameters())
        same_local = all(torch.equal(p.to_local(), q.to_local()) for p, q in zip(params, plain_params)) \
            and all(sorted(opt.state[p]) == sorted(plain_opt.state[q]) and all(
                torch.equal(_local(v), _local(plain_opt.state[q][k])) for k, v in opt.state[p].items())
                for p, q in zip(params, plain_params))
        out[name] = dict(
            same_as_not_offloaded=same_local,
            on_host=_locals_on_cpu(opt, params),
            moved=all(not torch.equal(_full(p), p0) for p, p0 in zip(params, init)),
            params=[_full(p) for p in params],
            states=_full_states(opt, params),
            dequantized=[{k: v.full_tensor() for k, v in memfit.optim.dequantized_state(opt, p).items()}
                         for p in params],
            dtypes=[str(opt.state[p]["state1"].dtype) for p in params])
    return out


def _local(t):
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a DTensor: its local shard)."""
    seen = {}
    for t in tensors:
        s = _local(t).untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


# what the host-bytes check steps: label -> (optimizer, parameter dtype); torch's AdamW
# keeps exp_avg and exp_avg_sq in the parameter's dtype
HOST_BYTES_CASES = {"AdamW8bit": ("AdamW8bit", torch.float32), "AdamW4bit": ("AdamW4bit", torch.float32),
                    "torch.AdamW": ("torch", torch.float32),
                    "AdamW8bit bf16": ("AdamW8bit", torch.bfloat16),
                    "torch.AdamW bf16": ("torch", torch.bfloat16)}
HOLDERS = ("params", "grads", "states", "absmax", "step")


def _host_bytes_rank(rank, world):
    """One offloaded FSDP2 step for each of HOST_BYTES_CASES; this rank's host bytes, by
    what holds them, counted from the storages just after the step (the gradients still
    held: the peak of a step)."""
    import memfit

    out = {}
    for label, (name, dtype) in HOST_BYTES_CASES.items():
        torch.manual_seed(0)
        model = torch.nn.Sequential(*(torch.nn.Linear(a, b, bias=False)
                                      for a, b in zip(BYTES_DIMS, BYTES_DIMS[1:]))).to(dtype)
        _shard(model, offload_policy=_offload())
        params = list(model.parameters())
        quantized = name != "torch"
        opt = (getattr(memfit.optim, name)(params, lr=1e-3) if quantized
               else torch.optim.AdamW(params, lr=1e-3))
        x = torch.randn(4, BYTES_DIMS[0], generator=torch.Generator().manual_seed(1)).to(dtype)
        model(x).float().square().mean().backward()
        opt.step()
        states = [v for p in params for k, v in opt.state[p].items() if k != "step"]
        is_absmax = [quantized and v.dtype == torch.float32 for v in states]
        out[label] = dict(params=_storage_bytes(params), grads=_storage_bytes(p.grad for p in params),
                          states=_storage_bytes(v for v, a in zip(states, is_absmax) if not a),
                          absmax=_storage_bytes(v for v, a in zip(states, is_absmax) if a),
                          step=_storage_bytes(opt.state[p]["step"] for p in params),
                          blocks=[tuple(opt.state[p]["absmax1"].shape) for p in params]
                          if quantized else None,
                          numel=sum(p.numel() for p in params))
    return out


def _cuda_mesh_rank(rank, world):
    """The layout FSDP2's CPUOffloadPolicy makes on a GPU machine, on this CPU: parameters
    and gradients that are DTensors of a CUDA mesh with their local shards on the host,
    built by FSDP2's own constructor. Nothing here may touch the mesh's device (there is
    none): memfit makes, steps, saves, loads and dequantizes the states on the host, the
    same bits as a plain parameter stepped with the same gradients."""
    import memfit
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp._fully_shard._fsdp_common import _from_local_no_grad
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    mesh = DeviceMesh.from_group(dist.group.WORLD, "cuda")  # a 1-rank mesh: no collective

    def host_shard(t):
        spec = DTensorSpec(mesh, (Shard(0),), tensor_meta=TensorMeta(t.shape, t.stride(), t.dtype))
        return _from_local_no_grad(t.detach().clone(), spec)

    out = {}
    for name, kwargs in TRAINED.items():
        cls = getattr(memfit.optim, name)
        ref = list(_model().parameters())
        params = [torch.nn.Parameter(host_shard(q)) for q in ref]
        opt, ref_opt = cls(params, **kwargs), cls(ref, **kwargs)
        g = torch.Generator().manual_seed(7)
        for _ in range(STEPS):
            for p, q in zip(params, ref):
                q.grad = torch.randn(q.shape, generator=g)
                p.grad = host_shard(q.grad)
            opt.step()
            ref_opt.step()

        def same(o, ps):
            return all(torch.equal(p.to_local(), q.detach()) for p, q in zip(ps, ref)) and all(
                sorted(o.state[p]) == sorted(ref_opt.state[q])
                and all(torch.equal(_local(v), ref_opt.state[q][k]) for k, v in o.state[p].items())
                for p, q in zip(ps, ref))

        from_sharded = cls(params, **kwargs)
        from_sharded.load_state_dict(opt.state_dict())  # DTensor states, the same placements
        from_plain = cls(params, **kwargs)
        from_plain.load_state_dict(ref_opt.state_dict())  # plain states: each rank cuts its rows
        out[name] = dict(
            mesh=mesh.device_type, stepped=same(opt, params),
            on_host=all(_locals_on_cpu(o, params) for o in (opt, from_sharded, from_plain)),
            from_sharded=same(from_sharded, params), from_plain=same(from_plain, params),
            dequantized=all(v.device_mesh.device_type == "cuda" and v.to_local().device.type == "cpu"
                            and torch.equal(v.to_local(), memfit.optim.dequantized_state(ref_opt, q)[k])
                            for p, q in zip(params, ref)
                            for k, v in memfit.optim.dequantized_state(opt, p).items()))
    return out


def _dcp_rank(rank, world, save_to, load_from):
    """For each CHECKPOINTED optimizer, with offload: trains SAVE_AT steps, saves to
    ``save_to/name`` (get_state_dict + dcp.save), trains AFTER more (the uninterrupted
    run); and, when ``load_from`` is given, loads the checkpoint another world size saved
    there into a fresh offloaded model and optimizer and trains the same AFTER steps."""
    import os

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    out = {}
    for name in CHECKPOINTED:
        res = {}
        if save_to is not None:
            model, opt = _dcp_model_and_opt(True, name, offload_policy=_offload())
            for step in range(SAVE_AT):
                _fsdp_step(model, opt, step)
            msd, osd = get_state_dict(model, opt)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(save_to, name))
            for i in range(AFTER):
                _fsdp_step(model, opt, SAVE_AT + i)
            res["straight"] = ([_full(p) for p in model.parameters()],
                               _full_states(opt, model.parameters()))
        if load_from is not None:
            model, opt = _dcp_model_and_opt(True, name, offload_policy=_offload())
            msd, osd = get_state_dict(model, opt)
            sd = {"model": msd, "optim": osd}
            dcp.load(sd, checkpoint_id=os.path.join(load_from, name))
            set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
            for i in range(AFTER):
                _fsdp_step(model, opt, SAVE_AT + i)
            res["resumed"] = ([_full(p) for p in model.parameters()],
                              _full_states(opt, model.parameters()))
            res["on_host"] = _locals_on_cpu(opt, list(model.parameters()))
        out[name] = res
    return out


def _checks_rank(rank, world, save_to, load_from):
    """Every check of one world size, in one spawn."""
    out = dict(train=_train_rank(rank, world), host_bytes=_host_bytes_rank(rank, world),
               dcp=_dcp_rank(rank, world, save_to, load_from))
    if world == 1:
        try:  # its own test fails, not every test of this spawn
            out["cuda_mesh"] = _cuda_mesh_rank(rank, world)
        except Exception:  # noqa: BLE001 - reported by test_states_stay_on_the_host_of_a_cuda_mesh
            import traceback

            out["cuda_mesh"] = traceback.format_exc()
    return out


# ---- the tests -----------------------------------------------------------------------------


ckpt_dirs, one_rank, two_ranks = checkpoint_spawns(_checks_rank, "ckpt")


def test_offloaded_training_equals_fsdp2_without_offload(one_rank, two_ranks):
    for world, res in ((1, [one_rank]), (2, two_ranks)):
        for r in res:
            for name, st in r["train"].items():
                where = f"{name} on {world} ranks"
                assert st["same_as_not_offloaded"], where
                assert st["on_host"] and st["moved"], where
                # 8-bit or 4-bit states where the global size says so, float32 elsewhere
                weights = st["dtypes"][0::2]
                assert weights.count("torch.uint8") == 4, (where, weights)
                assert all(d == "torch.float32" for d in st["dtypes"][1::2]), where


def test_offloaded_training_same_bits_at_1_and_2_ranks(one_rank, two_ranks):
    for name in TRAINED:
        want = one_rank["train"][name]
        for rank, r in enumerate(two_ranks):
            got = r["train"][name]
            where = f"{name}, rank {rank} of 2 against 1 rank"
            _assert_same_run((got["params"], got["states"]), (want["params"], want["states"]), where)
            for i, (a, b) in enumerate(zip(got["dequantized"], want["dequantized"])):
                assert sorted(a) == sorted(b) != [], (where, i)
                assert all(torch.equal(a[k], b[k]) for k in a), (where, i)


def test_dcp_saved_on_1_rank_resumes_on_2(one_rank, two_ranks):
    for name in CHECKPOINTED:
        straight = one_rank["dcp"][name]["straight"]
        for rank, r in enumerate(two_ranks):
            # the uninterrupted 2-rank run is the 1-rank run, bit for bit, and so is the resume
            _assert_same_run(r["dcp"][name]["straight"], straight, f"{name} straight, rank {rank}")
            _assert_same_run(r["dcp"][name]["resumed"], straight, f"{name} 1 -> 2, rank {rank}")
            assert r["dcp"][name]["on_host"], name
        assert int(straight[1][0]["step"]) == SAVE_AT + AFTER


def test_dcp_saved_on_2_ranks_resumes_on_1(ckpt_dirs, two_ranks):
    res = run_ranks(_dcp_rank, world_size=1, args=(None, ckpt_dirs[1]), timeout=120)[0]
    for name in CHECKPOINTED:
        _assert_same_run(res[name]["resumed"], two_ranks[0]["dcp"][name]["straight"], f"{name} 2 -> 1")
        assert res[name]["on_host"], name


def _expected_host_bytes(label, numel, blocks, world):
    """The layout's count: shards of parameters and gradients in the parameters' dtype
    (2 x 4 bytes per parameter in float32, 2 x 2 in bfloat16), the states (2 x 1 byte
    for 8-bit codes, 2 x 1/2 for 4-bit, torch's exp_avg and exp_avg_sq in the parameters'
    dtype), one float32 absmax per block of each quantized state, and a 4-byte step per
    tensor on every rank."""
    name, dtype = HOST_BYTES_CASES[label]
    size = torch.empty((), dtype=dtype).element_size()
    states = {"AdamW8bit": 2, "AdamW4bit": 1, "torch": 2 * size}[name]
    absmax = 0 if blocks is None else 2 * 4 * sum(r * b for r, b in blocks)
    return (2 * size + states) * numel + absmax + 4 * len(BYTES_DIMS[1:]) * world


# the bytes per parameter docs/distributed.md states (8-bit blocks of 256 values, 4-bit of 128)
DOCUMENTED = {"AdamW8bit": 10.03, "AdamW4bit": 9.06, "torch.AdamW": 16.0,
              "AdamW8bit bf16": 6.03, "torch.AdamW bf16": 8.0}


def test_host_bytes_per_parameter(one_rank, two_ranks):
    for world, res in ((1, [one_rank]), (2, two_ranks)):
        per_rank = [r["host_bytes"] for r in res]
        for label in HOST_BYTES_CASES:
            counted = {k: sum(b[label][k] for b in per_rank) for k in HOLDERS}
            numel, blocks = per_rank[0][label]["numel"], per_rank[0][label]["blocks"]
            where = (label, world, counted)
            # the shards add up to the whole, and nothing is held twice
            size = torch.empty((), dtype=HOST_BYTES_CASES[label][1]).element_size()
            assert counted["params"] == counted["grads"] == size * numel, where
            assert sum(counted.values()) == _expected_host_bytes(label, numel, blocks, world), where
            assert round(sum(counted.values()) / numel, 2) == DOCUMENTED[label], where


def test_states_stay_on_the_host_of_a_cuda_mesh(one_rank):
    assert isinstance(one_rank["cuda_mesh"], dict), one_rank["cuda_mesh"]
    for name, st in one_rank["cuda_mesh"].items():
        assert st["mesh"] == "cuda", name
        assert st["stepped"], name
        assert st["on_host"], name
        assert st["from_sharded"] and st["from_plain"], name
        assert st["dequantized"], name
