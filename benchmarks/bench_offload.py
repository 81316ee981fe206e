"""The offloading optimizer against the same optimizer on the device (issue 32 §5).

A GPT (memfit.models) in bfloat16 with activation checkpointing per block is trained
for a few steps by each recipe, from the same weights on the same batches:

    device     memfit AdamW8bit on the device (states, gradients, parameters there)
    offload    CPUOffloadOptimizer(AdamW8bit, offload_gradients=True): states and
               master weights on the host, stepped there
    offload+sib  the same with step_in_backward=True (each tensor steps during backward)
    torchao    torchao's CPUOffloadOptimizer(torch.optim.AdamW, offload_gradients=True),
               where torchao imports

Printed and written to benchmarks/out/bench_offload.json: peak device memory, seconds
per step (median), tokens/s, the host bytes the optimizer holds, and whether the final
parameters equal the device recipe's bit for bit (offload and offload+sib must,
docs/offload.md).

A second table breaks each offloaded step down (medians over the timed steps, from the
offloader's own event log): forward and backward time, the time step() takes after
backward, the host step's start and end relative to the end of backward (negative:
during backward), its core-ns per parameter, its threads and the CPU kernel variant,
the time spent in the gradient hooks on the autograd thread, and the host buffers
allocated during the timed steps (0: the arena and spill buffers are reused). The
copy columns (bytes and GB/s each way, the part of each copy exposed after backward,
the device's idle gap before the next forward) need a GPU's events and print
"gpu-only" on the CPU. Then a predicted-versus-measured line per offloaded recipe
(forward + backward + the part of the host step not hidden behind backward), the
pinned copy bandwidth both ways (GPU only), and a third table timing the host step
alone at several thread counts against torch's AdamW (fused where torch has it) over
the same bf16 tensors.

    python benchmarks/bench_offload.py                 # the CPU, a tiny GPT (seconds)
    python benchmarks/bench_offload.py --size 1b       # a lent GPU: about 1B parameters
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common
import memfit
import memfit.optim as mo
import torch
from memfit.checkpoint import checkpoint
from memfit.models import GPT, GPTConfig

SIZES = {  # (n_layer, d_model, n_head, vocab, seq, batch)
    "tiny": (2, 64, 4, 256, 32, 4),
    "small": (4, 256, 4, 1024, 128, 4),
    "1b": (20, 2048, 16, 32768, 1024, 4),
}


class CheckpointedGPT(GPT):
    """memfit.models.GPT with each block recomputed in backward."""

    def forward(self, idx, targets):
        b, s = idx.shape
        x = self.wte(idx) + self.wpe(torch.arange(s, device=idx.device))
        for block in self.blocks:
            x = checkpoint(block, x)
        logits = torch.nn.functional.linear(self.ln_f(x), self.wte.weight)
        return torch.nn.functional.cross_entropy(logits.float().view(-1, logits.size(-1)),
                                                 targets.reshape(-1))


def storage_bytes(tensors) -> int:
    seen = {}
    for t in tensors:
        if torch.is_tensor(t):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def make_optimizer(recipe, params, lr):
    if recipe == "device":
        return mo.AdamW8bit(params, lr=lr)
    if recipe == "offload":
        return mo.CPUOffloadOptimizer(params, mo.AdamW8bit, offload_gradients=True, lr=lr)
    if recipe == "offload+sib":
        return mo.CPUOffloadOptimizer(params, mo.AdamW8bit, offload_gradients=True,
                                      step_in_backward=True, lr=lr)
    from torchao.optim import (
        CPUOffloadOptimizer,  # raises ImportError where it is missing
    )
    return CPUOffloadOptimizer(params, torch.optim.AdamW, offload_gradients=True, lr=lr)


def host_bytes(recipe, opt) -> int | None:
    """Bytes of the host tensors the optimizer keeps (copies, gradient buffers, states)."""
    if recipe == "device":
        return 0
    if recipe == "torchao":
        return None
    inner = opt.optimizer
    params = [p for g in inner.param_groups for p in g["params"]]
    # the gradients live in the offloader's host buffers (kept across zero_grad)
    return storage_bytes([*params, *(v for st in inner.state.values() for v in st.values())]
                         ) + opt._staging.nbytes


def step_phases(opt, t0, t1, t2, t3) -> dict:
    """One step's phases (ms) from the offloader's event log (_events): the host work's
    start and end relative to the end of backward (t2), and the hooks' time."""
    ev = opt._events
    ms = lambda ns: ns / 1e6
    work = [t for t, kind, _ in ev if kind in ("host_step_start", "tensor_start")]
    ends = [t for t, kind, _ in ev if kind in ("host_step_end", "tensor_end")]
    busy = 0
    starts = [t for t, kind, _ in ev if kind in ("host_step_start", "tensor_start")]
    for a, b in zip(starts, ends):
        busy += b - a
    return {"forward_ms": ms(t1 - t0), "backward_ms": ms(t2 - t1),
            "step_after_backward_ms": ms(t3 - t2),
            "host_start_vs_backward_end_ms": ms(min(work) - t2) if work else None,
            "host_end_vs_backward_end_ms": ms(max(ends) - t2) if ends else None,
            "host_step_ms": ms(busy) if starts else None,
            "hook_ms": ms(sum(d for _, kind, (_, d) in
                              ((t, k, v) for t, k, v in ev if k == "hook"))),
            "host_calls": sum(1 for _, kind, _ in ev if kind in ("tensor_start",
                                                                  "host_step_start"))}


def host_step_alone(cfg, device, threads_list, repeats=3) -> list:
    """The host step by itself over the model's bf16 parameters (random gradients), at
    several thread counts, against torch's AdamW (fused where torch has it for the
    CPU): median seconds and ns per parameter."""
    torch.manual_seed(0)
    model = CheckpointedGPT(cfg).to(dtype=torch.bfloat16)
    params = [p.detach().clone().requires_grad_(True) for p in model.parameters()]
    for p in params:
        p.grad = torch.randn_like(p)
    n = sum(p.numel() for p in params)
    rows = []
    before = memfit.get_num_threads()
    for threads in threads_list:
        for name in ("memfit AdamW8bit", "torch AdamW"):
            if name.startswith("memfit"):
                opt = mo.AdamW8bit(params, lr=1e-4)
            else:
                try:
                    opt = torch.optim.AdamW(params, lr=1e-4, fused=True)
                except (RuntimeError, ValueError):
                    opt = torch.optim.AdamW(params, lr=1e-4, foreach=True)
            memfit.set_num_threads(threads)
            torch_threads = torch.get_num_threads()
            torch.set_num_threads(threads)
            opt.step()  # states made
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                opt.step()
                times.append(time.perf_counter() - t0)
            torch.set_num_threads(torch_threads)
            t = statistics.median(times)
            rows.append({"step": name, "threads": threads, "s": t,
                         "ns_per_param": t * 1e9 / n, "core_ns_per_param": t * 1e9 * threads / n})
    memfit.set_num_threads(before)
    return rows


def pinned_bandwidth(device, nbytes=256 << 20, repeats=3) -> dict | None:
    """GB/s of one pinned host buffer to the GPU and back (CUDA events); None on the CPU."""
    if device.type != "cuda":
        return None
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    out = {}
    for name, dst, src in (("h2d_gb_s", dev, host), ("d2h_gb_s", host, dev)):
        times = []
        for _ in range(repeats):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            dst.copy_(src, non_blocking=True)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        out[name] = nbytes / statistics.median(times) / 1e9
    return out


def predicted_ms(recipe, b) -> float | None:
    """A simple model of one offloaded step from its measured parts: forward, then
    backward, then what of the host step is not hidden behind backward (offload: all of
    it, after backward; step in backward: what runs past the end of backward, at least
    the last tensor's). Copies are not modelled on the CPU (they are memcpy in the
    hooks and the host step there)."""
    if b.get("host_step_ms") is None:
        return None
    if recipe == "offload":
        return b["forward_ms"] + b["backward_ms"] + b["host_step_ms"]
    calls = max(1, b.get("host_calls") or 1)
    tail = max(b["host_step_ms"] - b["backward_ms"], b["host_step_ms"] / calls)
    return b["forward_ms"] + b["backward_ms"] + tail


def run(recipe, cfg, args, device, batches):
    torch.manual_seed(0)
    model = CheckpointedGPT(cfg).to(device=device, dtype=torch.bfloat16)
    opt = make_optimizer(recipe, model.parameters(), args.lr)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times, phases = [], []
    offloaded = isinstance(opt, mo.CPUOffloadOptimizer)
    allocations = None
    for i, (x, y) in enumerate(batches):
        if offloaded:
            opt._events = []
            if i == args.warmup:
                allocations = opt._staging.allocations
        sync()
        t0 = time.perf_counter_ns()
        loss = model(x, y)
        sync()
        t1 = time.perf_counter_ns()
        loss.backward()
        sync()
        t2 = time.perf_counter_ns()
        opt.step()
        sync()
        t3 = time.perf_counter_ns()
        opt.zero_grad(set_to_none=True)
        sync()
        if i >= args.warmup:  # the first step allocates the states
            times.append((time.perf_counter_ns() - t0) / 1e9)
            if offloaded:
                phases.append(step_phases(opt, t0, t1, t2, t3))
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    final = [p.detach().to("cpu", copy=True) for p in model.parameters()]
    row = {"recipe": recipe, "params": sum(p.numel() for p in model.parameters()),
           "s_per_step": statistics.median(times),
           "tokens_per_s": x.numel() / statistics.median(times),
           "peak_device_bytes": peak, "host_bytes": host_bytes(recipe, opt)}
    if phases:
        n = row["params"]
        row["breakdown"] = {k: statistics.median(p[k] for p in phases if p[k] is not None)
                            if any(p[k] is not None for p in phases) else None
                            for k in phases[0]}
        b = row["breakdown"]
        b["host_core_ns_per_param"] = (None if b["host_step_ms"] is None else
                                       b["host_step_ms"] * 1e6 * opt.host_threads / n)
        b["threads"] = opt.host_threads
        b["kernels"] = memfit.cpu_kernels()
        b["allocations_timed"] = opt._staging.allocations - allocations
        for k in ("d2h_gb_s", "h2d_gb_s", "d2h_exposed_ms", "h2d_exposed_ms",
                  "device_idle_ms"):
            b[k] = "gpu-only" if device.type != "cuda" else None  # needs CUDA events
    del model, opt
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row, final


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--steps", type=int, default=4, help="timed steps")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first (states made)")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--recipes", default="device,offload,offload+sib,torchao")
    ap.add_argument("--out", default=str(_common.OUT_DIR / "bench_offload.json"))
    ap.add_argument("--deterministic", action="store_true",
                    help="torch.use_deterministic_algorithms(True): without it a GPU's "
                    "backward (atomic adds) differs from run to run, and so do the "
                    "parameters; name 'device' twice in --recipes to see that")
    args = ap.parse_args(argv)
    if args.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    device = torch.device(args.device)
    n_layer, d_model, n_head, vocab, seq, batch = SIZES[args.size]
    cfg = GPTConfig(n_layer=n_layer, d_model=d_model, n_head=n_head, vocab=vocab, max_pos=seq)
    g = torch.Generator().manual_seed(1)
    batches = [tuple(torch.randint(vocab, (batch, seq), generator=g).to(device) for _ in "xy")
               for _ in range(args.steps + args.warmup)]
    rows, ref = [], None
    recipes = args.recipes.split(",")
    # untimed: the first run of a process pays for lazy initialisation (kernels, threads)
    run(recipes[0], cfg, argparse.Namespace(**{**vars(args), "warmup": 0}), device,
        batches[:1])
    for recipe in recipes:
        try:
            row, final = run(recipe, cfg, args, device, batches)
        except ImportError as e:
            print(f"{recipe}: skipped ({e})")
            continue
        # against the first device run (a second one shows whether the device repeats itself)
        row["bit_exact_vs_device"] = (None if ref is None else
                                      all(torch.equal(a, b) for a, b in zip(ref, final)))
        if recipe == "device" and ref is None:
            ref = final
        rows.append(row)
    base = next((r for r in rows if r["recipe"] == "device"), None)
    gb = lambda b: "-" if b is None else f"{b / 1e9:.2f}"
    print(f"\nGPT {args.size}, bf16, checkpointed blocks, {device}, "
          f"{rows[0]['params'] / 1e6:.1f}M parameters" if rows else "no recipe ran")
    print("| recipe | s/step | x device | tokens/s | peak device GB | host GB | bit-exact |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        ratio = f"{r['s_per_step'] / base['s_per_step']:.2f}" if base else "-"
        exact = {None: "-", True: "yes", False: "no"}[r["bit_exact_vs_device"]]
        print(f"| {r['recipe']} | {r['s_per_step']:.3f} | {ratio} | {r['tokens_per_s']:.0f} | "
              f"{gb(r['peak_device_bytes'])} | {gb(r['host_bytes'])} | {exact} |")
    broken = [r for r in rows if "breakdown" in r]
    if broken:
        keys = list(broken[0]["breakdown"])
        print("\nper step (medians; ms; vs backward end: negative = during backward)")
        print("| recipe | " + " | ".join(keys) + " |")
        print("|---|" + "---|" * len(keys))
        fmt = lambda v: f"{v:.2f}" if isinstance(v, float) else ("-" if v is None else str(v))
        for r in broken:
            print(f"| {r['recipe']} | " + " | ".join(fmt(r["breakdown"][k]) for k in keys) + " |")
    for r in broken:
        b = r["breakdown"]
        pred = predicted_ms(r["recipe"], b)
        r["predicted_ms"] = pred
        if pred is not None:
            measured = b["forward_ms"] + b["backward_ms"] + b["step_after_backward_ms"]
            print(f"{r['recipe']}: predicted {pred:.1f} ms per step (forward + backward + the "
                  f"host step not hidden), measured {measured:.1f} ms (forward + backward + "
                  f"step() after it)")
    bandwidth = pinned_bandwidth(device)
    if bandwidth:
        print(f"pinned copies: host->device {bandwidth['h2d_gb_s']:.1f} GB/s, "
              f"device->host {bandwidth['d2h_gb_s']:.1f} GB/s")
    cores = len(os.sched_getaffinity(0))
    alone = host_step_alone(cfg, device, sorted({1, max(1, cores - 1), cores}))
    print("\nhost step alone (bf16 parameters, the model's tensors)")
    print("| step | threads | s | ns/param | core-ns/param |")
    print("|---|---|---|---|---|")
    for r in alone:
        print(f"| {r['step']} | {r['threads']} | {r['s']:.4f} | {r['ns_per_param']:.2f} | "
              f"{r['core_ns_per_param']:.2f} |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": _common.metadata(str(device)), "size": args.size,
                               "rows": rows, "host_step_alone": alone,
                               "pinned_bandwidth": bandwidth}, indent=1))
    print(f"wrote {out}")
    return rows


if __name__ == "__main__":
    main()
