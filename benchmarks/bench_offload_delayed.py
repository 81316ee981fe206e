"""What the delayed update (CPUOffloadOptimizer(delayed_update=True), issue 40 §5) hides,
on the CPU: a training loop whose device time is a sleep (the GPU's forward and backward,
GIL released) after a small real backward, stepped by the offloader undelayed and
delayed, interleaved round by round over two copies of one model.

Undelayed, an iteration is forward + backward + the device time + the host step; with
the delay the host step runs during the next iteration's forward, backward and device
time, so step() keeps only what cannot overlap (on the CPU: the gradients' and the
parameters' copies, which are DMA on a GPU). Reported per device time: median iteration
and step() time of each, the ratio, and the host step alone (from the undelayed step()).

    python benchmarks/bench_offload_delayed.py                     # ~1 minute on 2 cores
    python benchmarks/bench_offload_delayed.py --sleep-ms 0 50 200 --rounds 8

Timings on a shared machine are noisy: compare the two recipes of the same run (the
rounds interleave them). The quality cost of the delay is bench_convergence.py's
"offload AdamW8bit delayed" rows. Writes benchmarks/out/bench_offload_delayed.json.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import markdown_table, metadata, write_json  # noqa: E402

import memfit.optim as mo  # noqa: E402
from memfit.optim import CPUOffloadOptimizer  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sleep-ms", type=float, nargs="+", default=[25.0, 100.0],
                    help="the device's forward + backward time per iteration (a sleep)")
    ap.add_argument("--layers", type=int, default=8, help="Linear(width, width) layers, bf16")
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds per device time")
    ap.add_argument("--iters", type=int, default=6, help="iterations per round (2 warm-up)")
    ap.add_argument("--host-threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    torch.set_num_threads(1)  # the training thread; the host step has --host-threads
    base = torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width)
                                 for _ in range(args.layers)]).to(torch.bfloat16)
    x = torch.randn(4, args.width, dtype=torch.bfloat16)
    models = {"undelayed": base, "delayed": copy.deepcopy(base)}
    opts = {name: CPUOffloadOptimizer(m.parameters(), mo.AdamW8bit, lr=1e-4,
                                      offload_gradients=True, host_threads=args.host_threads,
                                      delayed_update=name == "delayed")
            for name, m in models.items()}
    params = sum(p.numel() for p in base.parameters())
    meta = metadata("cpu")
    print(f"commit {meta['commit']}, {meta['date']}, {meta['cpu_model']}, torch {meta['torch']}; "
          f"{params / 1e6:.1f}M bf16 parameters, AdamW8bit, host_threads={args.host_threads}")
    rows, results = [], []
    for sleep_ms in args.sleep_ms:
        it = {k: [] for k in opts}
        st = {k: [] for k in opts}
        for _ in range(args.rounds):
            for name, opt in opts.items():
                model = models[name]
                for i in range(args.iters):
                    t0 = time.perf_counter()
                    model(x).float().square().mean().backward()
                    time.sleep(sleep_ms / 1e3)
                    t1 = time.perf_counter()
                    opt.step()
                    opt.zero_grad()
                    t2 = time.perf_counter()
                    if i >= 2:
                        it[name].append(t2 - t0)
                        st[name].append(t2 - t1)
                opt.flush()
        med = {k: (statistics.median(it[k]) * 1e3, statistics.median(st[k]) * 1e3) for k in opts}
        ratio = med["delayed"][0] / med["undelayed"][0]
        rows.append([f"{sleep_ms:g}", f"{med['undelayed'][0]:.1f}", f"{med['undelayed'][1]:.1f}",
                     f"{med['delayed'][0]:.1f}", f"{med['delayed'][1]:.1f}", f"{ratio:.2f}"])
        results.append({"sleep_ms": sleep_ms, "undelayed_iter_ms": med["undelayed"][0],
                        "undelayed_step_ms": med["undelayed"][1],
                        "delayed_iter_ms": med["delayed"][0], "delayed_step_ms": med["delayed"][1],
                        "ratio": ratio, "n": len(it["delayed"])})
    for opt in opts.values():
        opt.close()
    print(markdown_table(["device ms", "undelayed iteration ms", "undelayed step() ms",
                          "delayed iteration ms", "delayed step() ms", "delayed / undelayed"],
                         rows))
    path = write_json("bench_offload_delayed", {"meta": meta, "args": vars(args),
                                                 "parameters": params, "results": results})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
