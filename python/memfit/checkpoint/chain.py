"""measure(): the per-stage input bytes, saved bytes and forward cost of a chain of blocks,
what the planner takes (ChainMeasurement). Imports torch only when used.
"""

from __future__ import annotations

import math
import statistics
import time

from memfit.checkpoint.meter import _storage_key, _torch
from memfit.checkpoint.recompute import CheckpointError


class ChainMeasurement:
    """Per-stage sizes and costs of a chain, measured by :func:`measure`."""

    def __init__(self, input_bytes, saved_bytes, forward_cost, names):
        self.input_bytes = input_bytes
        self.saved_bytes = saved_bytes
        self.forward_cost = forward_cost
        self.names = names

    @property
    def full_memory_bytes(self) -> int:
        return sum(self.saved_bytes)

    def __len__(self):
        return len(self.saved_bytes)

    def __repr__(self):
        return (f"ChainMeasurement(n={len(self)}, input_bytes={self.input_bytes}, "
                f"saved_bytes={self.saved_bytes}, forward_cost={self.forward_cost})")


def _find_blocks(model):
    """The chain inside a model: the nn.ModuleList holding the most parameters
    (transformer blocks in GPT-2, Llama, BERT, ViT ...)."""
    torch = _torch()
    best, best_n = None, -1
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.ModuleList) and len(mod) > 0:
            n = sum(p.numel() for p in mod.parameters())
            if n > best_n:
                best, best_n = mod, n
    if best is None:
        raise ValueError("model: found no nn.ModuleList of blocks in it; pass blocks=")
    return best


def _resolve_chain(model_or_blocks, blocks):
    """-> (list of stage modules, runner(example) -> output)"""
    torch = _torch()
    # torch.compile(model) wraps the model in an OptimizedModule holding it as
    # _orig_mod: the blocks are the original model's, and they are measured eagerly
    # (the compiled graph guards on their forward and recompiles once they are wrapped).
    model_or_blocks = getattr(model_or_blocks, "_orig_mod", model_or_blocks)
    if blocks is not None:
        stages = list(blocks)

        def run(example):
            return _call_with(model_or_blocks, example)
        return stages, run
    if isinstance(model_or_blocks, torch.nn.Sequential):
        stages = list(model_or_blocks)

        def run(example):
            return _call_with(model_or_blocks, example)
        return stages, run
    if isinstance(model_or_blocks, (torch.nn.ModuleList, list, tuple)):
        stages = list(model_or_blocks)

        def run(example):
            x = example
            for st in stages:
                out = _call_with(st, x)
                x = out if isinstance(out, torch.Tensor) else out[0]
            return x
        return stages, run
    if isinstance(model_or_blocks, torch.nn.Module):
        stages = list(_find_blocks(model_or_blocks))

        def run(example):
            return _call_with(model_or_blocks, example)
        return stages, run
    raise TypeError("model_or_module_list: expected an nn.Module (Sequential, ModuleList or "
                    f"a model with a block list), got {type(model_or_blocks).__name__}")


def _places(stages):
    """[(module, [its indices in the chain])] for each distinct module, in the order
    of its first place (a module used twice in the chain is one entry)."""
    found = {}
    for i, st in enumerate(stages):
        found.setdefault(id(st), (st, []))[1].append(i)
    return list(found.values())


def _call_with(fn, example):
    if isinstance(example, dict):
        return fn(**example)
    if isinstance(example, (tuple, list)):
        return fn(*example)
    return fn(example)


def _sync(devices):
    torch = _torch()
    for d in devices:
        torch.cuda.synchronize(d)


def measure(model_or_blocks, example_input, *, blocks=None, cost: str = "time",
            repeats: int = 3) -> ChainMeasurement:
    """Measure each stage of a chain once: the bytes handed to it, the bytes its
    backward would keep (counted with saved-tensor hooks, parameters excluded) and
    its forward cost (``cost="time"``: the fastest of ``repeats`` timed runs, and
    the median of that over identical blocks; ``"flops"``: torch's FLOP counter,
    which counts matrix products only). The measuring forward passes keep nothing
    for backward, so they need about one stage's activations, not the whole
    model's; RNG state and module buffers (e.g. BatchNorm statistics) are restored.

    ``model_or_blocks``: an ``nn.Sequential``; an ``nn.ModuleList`` or list of blocks
    (called in turn, each taking the previous output, or its first element when it
    returns a tuple); or any model, whose largest ``nn.ModuleList`` (or ``blocks=``) is
    the chain and which is called as ``model(example_input)`` (``model(**d)`` for a
    dict, ``model(*t)`` for a tuple).
    """
    torch = _torch()
    if cost not in ("time", "flops"):
        raise ValueError(f"cost: expected 'time' or 'flops', got {cost!r}")
    stages, run = _resolve_chain(model_or_blocks, blocks)
    if not stages:
        raise ValueError("model_or_module_list: the chain has no stages")
    n = len(stages)
    inb = [0] * n
    sab = [0] * n
    cst = [math.inf] * n
    params = set()
    owner = model_or_blocks if isinstance(model_or_blocks, torch.nn.Module) else None
    mods = [owner] if owner is not None else []
    mods += [s for s in stages if isinstance(s, torch.nn.Module)]
    for mod in mods:
        for t in list(mod.parameters()) + list(mod.buffers()):
            params.add(_storage_key(t)[0])
    buffers = []
    for mod in mods:
        buffers += [(b, b.detach().clone()) for b in mod.buffers()]
    devices = set()

    def drop_pack(x):
        return None

    def no_unpack(x):
        raise CheckpointError("memfit.checkpoint.measure: the measuring forward keeps "
                              "nothing for backward")

    originals = []

    def make_wrapper(i, stage_call):
        def wrapper(*args, **kwargs):
            seen = {}
            for v in list(args) + list(kwargs.values()):
                if isinstance(v, torch.Tensor):
                    k, nb = _storage_key(v)
                    if k not in params:
                        seen[k] = nb
                    if v.device.type == "cuda":
                        devices.add(v.device.index)
            inb[i] = max(inb[i], sum(seen.values()))
            saved = {}
            alive = []  # until the stage returns, so freed memory is not reused and
                        # two saved tensors never share an address in `saved`

            def pack(x):
                k, nb = _storage_key(x)
                if k not in params:
                    saved[k] = nb
                    alive.append(x)
                return None

            if cost == "flops":
                from torch.utils.flop_counter import FlopCounterMode

                with FlopCounterMode(display=False) as fc, \
                        torch.autograd.graph.saved_tensors_hooks(pack, no_unpack):
                    out = stage_call(*args, **kwargs)
                cst[i] = float(fc.get_total_flops())
            else:
                _sync(devices)
                t0 = time.perf_counter()
                with torch.autograd.graph.saved_tensors_hooks(pack, no_unpack):
                    out = stage_call(*args, **kwargs)
                _sync(devices)
                cst[i] = min(cst[i], time.perf_counter() - t0)
            sab[i] = max(sab[i], sum(saved.values()))
            del alive[:]
            return out
        return wrapper

    plain = [i for i, st in enumerate(stages) if not isinstance(st, torch.nn.Module)]
    if plain:
        raise TypeError(f"measure: stage {plain[0]} is not an nn.Module; wrap plain "
                        "functions in a module or pass the sizes to plan() yourself")
    # A module may stand at several places of the chain (weight tying by reuse,
    # Sequential(b, act, b)): it gets one wrapper, whose k-th call in a pass measures
    # its k-th place. Wrapping it once per place would wrap the wrapper and leave
    # the first wrapper behind when the forwards are put back.
    calls = {}  # id(module) -> calls so far in this pass
    for st, places in _places(stages):
        stage_calls = [make_wrapper(i, st.forward) for i in places]

        def dispatch(*args, _st=st, _calls=stage_calls, **kwargs):
            k = calls.get(id(_st), 0)
            calls[id(_st)] = k + 1
            return _calls[k % len(_calls)](*args, **kwargs)

        originals.append((st, "forward" in st.__dict__, st.__dict__.get("forward")))
        st.__dict__["forward"] = dispatch
    rng_devs = sorted(d for d in range(torch.cuda.device_count())) \
        if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    try:
        with torch.random.fork_rng(devices=rng_devs), torch.enable_grad(), \
                torch.autograd.graph.saved_tensors_hooks(drop_pack, no_unpack):
            for _ in range(max(1, int(repeats)) if cost == "time" else 1):
                calls.clear()
                out = run(example_input)
                del out
    finally:
        for st, had, fwd in originals:  # exactly as they were: an instance forward stays
            if had:
                st.__dict__["forward"] = fwd
            else:
                st.__dict__.pop("forward", None)
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
    names = []
    for i, st in enumerate(stages):
        names.append(f"{type(st).__name__}[{i}]")
    missing = [i for i in range(n) if cst[i] == math.inf]
    if missing:
        raise ValueError(f"measure: stage {missing[0]} was not called by the forward pass "
                         "(the chain must run every stage once per forward)")
    if cost == "time":
        # Identical blocks (same class, parameter shapes and sizes) cost the same; a
        # shared machine makes single timings differ at random, which would make the
        # planner prefer arbitrary blocks. Give each group its median time.
        groups: dict = {}
        for i, st in enumerate(stages):
            key = (type(st), tuple(tuple(p.shape) for p in st.parameters()), inb[i], sab[i])
            groups.setdefault(key, []).append(i)
        for members in groups.values():
            if len(members) > 1:
                t = statistics.median(cst[i] for i in members)
                for i in members:
                    cst[i] = t
    return ChainMeasurement(inb, sab, cst, names)
