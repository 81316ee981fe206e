"""Host time of one optimizer step() for a model of many tiny CPU tensors.

    python benchmarks/bench_step_overhead.py                     # this interpreter's memfit
    python benchmarks/bench_step_overhead.py --against /work/venv/base/bin/python

A 200-tensor model (shapes cycling through small vectors and matrices, 16 to 128
elements each, about 12k parameters) on the CPU, with gradients set once. The tensors
are so small that the kernels take a few tens of microseconds in all: the time of a step() is
the Python and binding work per tensor (state lookup, the view of each array, the
argument checks), which is what a real model of hundreds of tensors pays on any device.
memfit runs on one thread (set_num_threads(1)) so the OpenMP fork/join of a shared
machine does not swamp the number.

Each measurement is a process that times --reps steps one by one (time.perf_counter_ns)
after --warmup steps, for AdamW8bit (8-bit states for every tensor: min_8bit_size=0)
and AdamW (float32 states), and reports the minimum, the 10th percentile and the
median. On a shared machine a step of a few milliseconds is often preempted, which
the median feels and the minimum (the step's cost when nothing interrupted it) does
not: the table's main number, and the ratio, use the minimum.
With `--against PYTHON`, each of --rounds rounds runs one process with this interpreter
and one with PYTHON (another venv with another memfit installed), in alternating
order, so both see the same machine state; the table gives, per build, the median over
rounds of the per-process minimum, p10 and median, and the median over rounds of the
ratio of the minima.

Prints a markdown table and writes benchmarks/out/bench_step_overhead.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

OPTIMIZERS = ("AdamW8bit", "AdamW")
SHAPES = ((16,), (64,), (8, 8), (4, 4, 2), (128,), (32,), (8, 16), (64,))


def measure(n_tensors: int, reps: int, warmup: int) -> dict:
    """{optimizer: {median_us, p25_us, p75_us}} of one step() in this process."""
    import torch

    import memfit
    import memfit.optim

    memfit.set_num_threads(1)
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    out = {}
    for name in OPTIMIZERS:
        params = []
        for i in range(n_tensors):
            p = torch.nn.Parameter(torch.randn(SHAPES[i % len(SHAPES)], generator=gen))
            p.grad = torch.randn(p.shape, generator=gen) * 1e-3
            params.append(p)
        opt = getattr(memfit.optim, name)(params, lr=1e-3, min_8bit_size=0)
        for _ in range(warmup):
            opt.step()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter_ns()
            opt.step()
            times.append((time.perf_counter_ns() - t0) / 1e3)
        out[name] = {"p10_us": statistics.quantiles(times, n=10)[0],
                     "median_us": statistics.median(times), "min_us": min(times),
                     "params": sum(p.numel() for p in params)}
    return out


def run_child(python: str, args) -> dict:
    cmd = [python, __file__, "--child", "--tensors", str(args.tensors), "--reps", str(args.reps),
           "--warmup", str(args.warmup)]
    res = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tensors", type=int, default=200)
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--against", default=None, help="another Python whose memfit to compare with")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(measure(args.tensors, args.reps, args.warmup)))
        return

    from _common import markdown_table, metadata, write_json

    builds = {"this": sys.executable}
    if args.against:
        builds["against"] = args.against
    rounds = {b: [] for b in builds}
    for r in range(args.rounds):
        order = list(builds) if r % 2 == 0 else list(reversed(builds))
        for b in order:
            rounds[b].append(run_child(builds[b], args))
    summary = {b: {name: {stat: statistics.median(x[name][stat] for x in rounds[b])
                          for stat in ("min_us", "p10_us", "median_us")}
                   for name in OPTIMIZERS} for b in builds}
    headers = ["optimizer"] + [f"{b}: min / p10 / median (us)" for b in builds]
    if args.against:
        headers += ["this / against (min; median of rounds, range)"]
    rows = []
    for name in OPTIMIZERS:
        row = [name] + [" / ".join(f"{summary[b][name][k]:.0f}" for k in ("min_us", "p10_us", "median_us"))
                        for b in builds]
        if args.against:
            ratios = [t[name]["min_us"] / a[name]["min_us"]
                      for t, a in zip(rounds["this"], rounds["against"])]
            row.append(f"{statistics.median(ratios):.3f} (rounds: {min(ratios):.2f}..{max(ratios):.2f})")
        rows.append(row)
    print(f"host time of one step(), {args.tensors} CPU tensors, 1 thread, {args.reps} steps per "
          f"process, {args.rounds} rounds")
    print(markdown_table(headers, rows))
    path = write_json("bench_step_overhead", {
        "meta": metadata("cpu"), "args": vars(args), "builds": builds, "summary_us": summary,
        "rounds": rounds})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
