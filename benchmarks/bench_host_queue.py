"""The host step on the host queue's passive pool against the same step on OpenMP's
threads (issue 40 §4): step time, and the CPU time the step's threads burn in the idle
gap right after it (libgomp's threads spin for a while after each parallel loop; the
pool's threads sleep on a condition variable).

    openmp   opt.step() on this thread, memfit's OpenMP loop with `threads` threads
    pool     the same step as a job of _C.HostQueue(threads) (the offloader's worker):
             the queue's thread and threads - 1 pool threads

Both step the same AdamW8bit over bfloat16 parameters (stochastic rounding), in turn
(A B A B ...), `--reps` times; medians are printed and written to
benchmarks/out/bench_host_queue.json. "idle CPU" is this process's CPU time over a
`--gap` seconds sleep right after each step (median and largest): about 0 when nothing
spins, up to the gap per spinning thread. Both use wall time; on a shared machine read the
ratios, not the absolute numbers.

    python benchmarks/bench_host_queue.py                     # 4M parameters, 2 threads
    python benchmarks/bench_host_queue.py --params 64 --threads 15
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common
import memfit
import memfit.optim as mo
import torch
from memfit import _C


def make(n_params: int, tensors: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    per = n_params // tensors
    ps = [torch.nn.Parameter(torch.randn(per, generator=g).to(torch.bfloat16))
          for _ in range(tensors)]
    for p in ps:
        p.grad = torch.randn(per, generator=g).to(torch.bfloat16)
    return ps, mo.AdamW8bit(ps, lr=1e-3)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=float, default=4, help="millions of parameters")
    ap.add_argument("--tensors", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--gap", type=float, default=0.05, help="idle seconds after each step")
    ap.add_argument("--out", default=str(_common.OUT_DIR / "bench_host_queue.json"))
    args = ap.parse_args()
    n = int(args.params * 1e6)
    memfit.set_num_threads(args.threads)
    _, opt_omp = make(n, args.tensors, 0)
    _, opt_pool = make(n, args.tensors, 0)
    q = _C.HostQueue(args.threads)

    def step_omp():
        opt_omp.step()

    def step_pool():
        q.submit(opt_pool.step)
        q.wait()

    fns = {"openmp": step_omp, "pool": step_pool}
    for fn in fns.values():  # warm up: tables, buffers, threads
        fn()
        fn()
    step_s = {k: [] for k in fns}
    idle = {k: [] for k in fns}
    for _ in range(args.reps):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            step_s[name].append(time.perf_counter() - t0)
            c0 = time.process_time()
            time.sleep(args.gap)
            idle[name].append(time.process_time() - c0)
    q.stop()
    rows, results = [], {}
    for name in fns:
        s, i = statistics.median(step_s[name]), statistics.median(idle[name])
        results[name] = {"step_s": s, "idle_cpu_s": i, "idle_cpu_s_max": max(idle[name])}
        rows.append([name, f"{s * 1e3:.1f}", f"{s / n * 1e9 * args.threads:.2f}",
                     f"{i * 1e3:.2f}", f"{max(idle[name]) * 1e3:.2f}"])
    ratio = results["pool"]["step_s"] / results["openmp"]["step_s"]
    print(f"AdamW8bit, bf16 parameters (stochastic rounding), {n / 1e6:.1f}M parameters in "
          f"{args.tensors} tensors, {args.threads} threads, {args.reps} interleaved reps; "
          f"idle CPU over {args.gap * 1e3:.0f} ms after each step")
    print(_common.markdown_table(["path", "step ms", "core-ns/param", "idle CPU ms (median)",
                                  "idle CPU ms (max)"], rows))
    print(f"pool / openmp step time: {ratio:.2f}")
    path = _common.write_json(Path(args.out).stem, {
        "meta": _common.metadata("cpu"), "params": n, "tensors": args.tensors,
        "threads": args.threads, "reps": args.reps, "gap_s": args.gap, "results": results,
        "pool_over_openmp": ratio})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
