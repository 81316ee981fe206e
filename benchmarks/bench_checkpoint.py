"""Checkpointing: memory and step time of a GPT-style stack of blocks under
no checkpointing, every block, sqrt(n), memfit's planner at 25/50/75% budgets and
int8-compressed boundaries, against torch.utils.checkpoint in the same run.

    python benchmarks/bench_checkpoint.py                     # CPU, small model
    python benchmarks/bench_checkpoint.py --device cuda --n-layer 24 --d-model 1024 \
        --seq 1024 --batch 8

Memory columns:
  kept      bytes allocated by the forward and still alive when backward starts
            (CUDA: memory_allocated delta; CPU: torch profiler memory events)
  peak      peak bytes above the start of the step, forward + backward
            (CUDA: max_memory_allocated; CPU: profiler events at op granularity)
  model     the planner's accounting measured with memfit's ActivationMeter
            (saved tensors + checkpoint inputs + largest recompute); memfit only
  plan      the plan's memory under the planner's model (what the budget bounds)
Time: median and minimum of --reps interleaved steps (forward + backward), and the
ratio of the medians to no checkpointing. On a shared CPU the minimum is the least
disturbed number; compare implementations only within one run. grad err: relative L2 error of all parameter gradients against no
checkpointing (dropout on, same seed): 0 means bitwise identical.

Prints a markdown table; writes benchmarks/out/checkpoint.json.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as tuc

import memfit.checkpoint as mc

sys.path.insert(0, os.path.dirname(__file__))
from _common import markdown_table, metadata, write_json  # noqa: E402


class Block(nn.Module):
    """Pre-norm transformer block: causal attention + GELU MLP, dropout."""

    def __init__(self, d, heads, p):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.heads, self.p = heads, p

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(C // self.heads)
        mask = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        att = F.dropout(att.masked_fill(~mask, float("-inf")).softmax(-1), self.p, self.training)
        y = (att @ v).transpose(1, 2).reshape(B, T, C)
        x = x + F.dropout(self.proj(y), self.p, self.training)
        return x + F.dropout(self.out(F.gelu(self.fc(self.ln2(x)))), self.p, self.training)


# ------------------------------------------------------------ strategies --

def run_none(model, x):
    return model(x)


def run_memfit_every(model, x, compress=None):
    for blk in model:
        x = mc.checkpoint(blk, x, compress=compress)
    return x


def run_torch_every(model, x):
    for blk in model:
        x = tuc.checkpoint(blk, x, use_reentrant=False)
    return x


def run_memfit_sqrt(model, x):
    return mc.checkpoint_sequential(model, x, plan=mc.plan_sqrt(len(model)))


def run_torch_sqrt(model, x):
    k = max(1, round(math.sqrt(len(model))))
    return tuc.checkpoint_sequential(model, k, x, use_reentrant=False)


def run_memfit_plan(the_plan, compress=None):
    def run(model, x):
        return mc.checkpoint_sequential(model, x, plan=the_plan, compress=compress)
    return run


# ---------------------------------------------------------------- meters --

def cpu_profile_memory(fn):
    """(net bytes still allocated at the end, peak bytes) of fn, from the torch
    profiler's memory events at op granularity."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted(prof.events(), key=lambda e: e.time_range.start)
    live = peak = 0
    for e in events:
        live += e.self_cpu_memory_usage
        peak = max(peak, live)
    return live, peak


def measure_memory(model, x, run, device):
    """(kept after forward, peak over the step) in bytes."""
    holder = {}

    def fwd():
        holder["out"] = run(model, x)

    def bwd():
        holder.pop("out").pow(2).mean().backward()

    model.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fwd()
        torch.cuda.synchronize()
        kept = torch.cuda.memory_allocated() - base
        bwd()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        model.zero_grad(set_to_none=True)
        return kept, peak
    kept, _ = cpu_profile_memory(fwd)
    bwd()
    model.zero_grad(set_to_none=True)

    def step():
        fwd()
        bwd()

    _, peak = cpu_profile_memory(step)
    model.zero_grad(set_to_none=True)
    return kept, peak


def meter_bytes(model, x, run):
    model.zero_grad(set_to_none=True)
    with mc.ActivationMeter(exclude=model) as m:
        out = run(model, x)
    out.pow(2).mean().backward()
    model.zero_grad(set_to_none=True)
    return m.total_bytes


def grads(model, x, run, seed=1234):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    run(model, x).pow(2).mean().backward()
    g = torch.cat([p.grad.reshape(-1).float() for p in model.parameters()])
    model.zero_grad(set_to_none=True)
    return g


def timed_step(model, x, run, device):
    model.zero_grad(set_to_none=True)
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run(model, x).pow(2).mean().backward()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    run(model, x).pow(2).mean().backward()
    return time.perf_counter() - t0


# ------------------------------------------------------------------ main --

def mib(v):
    return "-" if v is None else f"{v / 2**20:.2f}"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--n-layer", type=int, default=12)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = ap.parse_args(argv)

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    model = nn.Sequential(*[Block(args.d_model, args.heads, args.dropout)
                            for _ in range(args.n_layer)]).to(device, dtype).train()
    x = torch.randn(args.batch, args.seq, args.d_model, device=device, dtype=dtype)

    # measure the chain once and plan the budgets
    t0 = time.perf_counter()
    chain = mc.measure(model, x)
    t_measure = time.perf_counter() - t0
    full = chain.full_memory_bytes
    plans = {}
    plan_time = {}
    for pct in (25, 50, 75):
        t0 = time.perf_counter()
        try:
            plans[pct] = mc.plan(chain.input_bytes, chain.saved_bytes, chain.forward_cost,
                                 f"{pct}%", names=chain.names)
        except ValueError as e:  # too small for this chain: say so, skip its rows
            print(f"plan at {pct}%: {e}", file=sys.stderr)
            plans[pct] = None
        plan_time[pct] = time.perf_counter() - t0
    n = len(model)
    every = mc.Plan.from_segments([(i, i + 1, True) for i in range(n)], chain.input_bytes,
                                  chain.saved_bytes, chain.forward_cost)
    sqrt_plan = mc.plan_sqrt(n, chain.input_bytes, chain.saved_bytes, chain.forward_cost)
    total_cost = sum(chain.forward_cost)

    configs = [
        # name, peer, runner, plan (for the model memory / recompute columns)
        ("none", "-", run_none, mc.Plan([(0, n, False)], full, 0.0)),
        ("every block", "memfit", run_memfit_every, every),
        ("every block", "torch", run_torch_every, every),
        ("sqrt(n)", "memfit", run_memfit_sqrt, sqrt_plan),
        ("sqrt(n)", "torch", run_torch_sqrt, sqrt_plan),
        ("plan 25%", "memfit", run_memfit_plan(plans[25]), plans[25]),
        ("plan 50%", "memfit", run_memfit_plan(plans[50]), plans[50]),
        ("plan 75%", "memfit", run_memfit_plan(plans[75]), plans[75]),
        ("every block int8", "memfit", lambda m, t: run_memfit_every(m, t, "int8"), every),
        ("plan 25% int8", "memfit", run_memfit_plan(plans[25], "int8"), plans[25]),
    ]
    configs = [c for c in configs if c[3] is not None]

    ref_grad = grads(model, x, run_none)
    rows = []
    for name, peer, run, p in configs:
        kept, peak = measure_memory(model, x, run, device)
        model_b = meter_bytes(model, x, run) if peer == "memfit" else None
        g = grads(model, x, run)
        err = ((g - ref_grad).norm() / ref_grad.norm()).item()
        rows.append({"config": name, "impl": peer, "kept_bytes": kept, "peak_bytes": peak,
                     "model_bytes": model_b, "plan_bytes": p.memory_bytes,
                     "recompute_share": (p.recompute_cost / total_cost) if p.recompute_cost
                     is not None and total_cost > 0 else 0.0,
                     "grad_rel_err": err, "times": []})

    for _ in range(2):  # warm-up
        for (_, _, run, _) in configs:
            timed_step(model, x, run, device)
    for _ in range(args.reps):  # interleaved
        for row, (_, _, run, _) in zip(rows, configs):
            row["times"].append(timed_step(model, x, run, device))
    base = statistics.median(rows[0]["times"])
    for row in rows:
        row["median_s"] = statistics.median(row["times"])
        row["min_s"] = min(row["times"])
        row["vs_none"] = row["median_s"] / base

    meta = metadata(device.type)
    meta.update({
        "model": {k: getattr(args, k) for k in ("n_layer", "d_model", "heads", "seq", "batch",
                                                "dropout", "dtype", "reps")},
        "full_activation_bytes": full,
        "measure_s": t_measure,
        "plan_s": plan_time,
        "plans": {str(k): (v.to_dict() if v else None) for k, v in plans.items()},
    })
    where = meta.get("gpu") or f"{meta['cpu']} CPU, {meta['cores']} cores, torch threads " \
                               f"{meta.get('torch_threads')}"
    print(f"{device.type}: {where}, memfit {meta['memfit']} @ {meta['commit']}, "
          f"torch {meta.get('torch')}, {meta['date']}")
    print(f"model: {args.n_layer} GPT-style blocks, d={args.d_model}, seq={args.seq}, "
          f"batch={args.batch}, {args.dtype}, dropout {args.dropout}; activations with no "
          f"checkpointing (measured) {mib(full)} MiB; measure {t_measure:.2f} s, plan "
          f"{max(plan_time.values()) * 1e3:.1f} ms; {args.reps} interleaved steps\n")
    print(markdown_table(
        ["config", "impl", "step ms (median)", "min ms", "x none", "kept MiB", "peak MiB",
         "model MiB", "plan MiB", "recompute", "grad rel err"],
        [[r["config"], r["impl"], f"{r['median_s'] * 1e3:.1f}", f"{r['min_s'] * 1e3:.1f}",
          f"{r['vs_none']:.2f}", mib(r["kept_bytes"]), mib(r["peak_bytes"]),
          mib(r["model_bytes"]), mib(r["plan_bytes"]), f"{100 * r['recompute_share']:.0f}%",
          f"{r['grad_rel_err']:.1e}"] for r in rows]))
    print("\nkept: allocated by the forward and alive when backward starts; peak: over the "
          "whole step (CPU: torch profiler memory events; CUDA: allocator); model: memfit's "
          "ActivationMeter (saved tensors + checkpoint inputs + largest recompute), the "
          "quantity the plan bounds; recompute: share of one forward run again.")
    for pct in (25, 50, 75):
        if plans[pct] is not None:
            print(f"\nplan at {pct}%:\n```\n{plans[pct]}\n```")
    print(f"\nwrote {write_json('checkpoint', {'meta': meta, 'rows': rows})}")


if __name__ == "__main__":
    main()
