"""memfit.amp against torch.amp in the same process, interleaved, medians.

1. Fused unscale + non-finite check: memfit's _C.unscale_grads against
   torch._amp_foreach_non_finite_check_and_unscale_ over the same gradients (10, 100,
   1000 tensors; float32 and bfloat16), as GB/s of gradient traffic (read + write).
2. Host overhead of scaler.step(optimizer) and scaler.update() for 10, 100 and 1000
   small gradients (64 elements each, so the arithmetic is negligible), with an
   optimizer whose step() does nothing: what the scaler itself costs per iteration.
3. Global norm + clip: memfit.amp.clip_grad_norm_ against torch.nn.utils.clip_grad_norm_.

CPU by default; --device cuda times the same on a GPU (device events are not used:
the wall clock includes a synchronize per repetition). Writes a table to stdout and
JSON to benchmarks/out/bench_amp.json.

    python benchmarks/bench_amp.py            # full run (~1-2 min on 2 cores)
    python benchmarks/bench_amp.py --quick    # fewer repetitions
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import torch

import memfit
import memfit.amp as amp
from memfit import _C


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def interleaved(fns: dict, reps: int, device: str) -> dict:
    """Median seconds per call of each fn, calling them in alternating order."""
    times = {k: [] for k in fns}
    names = list(fns)
    for fn in fns.values():  # warm up
        fn()
    for r in range(reps):
        order = names if r % 2 == 0 else names[::-1]
        for k in order:
            sync(device)
            t0 = time.perf_counter()
            fns[k]()
            sync(device)
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def bench_unscale(device, reps, total_elems):
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for n in (10, 100, 1000):
            per = total_elems // n
            gen = torch.Generator().manual_seed(0)
            grads_m = [torch.randn(per, generator=gen).to(dtype).to(device) for _ in range(n)]
            grads_t = [g.clone() for g in grads_m]
            found_m = torch.zeros((), device=device)
            found_t = torch.zeros((), device=device)
            # scale 1/1: values stay the same across repetitions, the full
            # read-modify-write still runs (inv != 1 is forced by 1.0000001)
            scale = torch.full((), 1.0000001, device=device)
            inv = scale.double().reciprocal().float()
            stream = amp._stream(torch.device(device))
            t = interleaved({
                "memfit": lambda: _C.unscale_grads(grads_m, scale, found_m, stream),
                "torch": lambda: torch._amp_foreach_non_finite_check_and_unscale_(grads_t, found_t, inv),
            }, reps, device)
            nbytes = 2 * per * n * grads_m[0].element_size()
            rows.append({
                "bench": "unscale", "dtype": str(dtype).split(".")[1], "tensors": n,
                "elements": per * n, "memfit_ms": t["memfit"] * 1e3, "torch_ms": t["torch"] * 1e3,
                "memfit_GBps": nbytes / t["memfit"] / 1e9, "torch_GBps": nbytes / t["torch"] / 1e9,
                "speedup": t["torch"] / t["memfit"],
            })
    return rows


class NoOpOptimizer(torch.optim.Optimizer):
    def __init__(self, params):
        super().__init__(params, {})

    def step(self, closure=None):
        return None


def bench_step_overhead(device, reps):
    rows = []
    for n in (10, 100, 1000):
        setups = {}
        for name, cls in (("memfit", amp.GradScaler), ("torch", torch.amp.GradScaler)):
            params = [torch.nn.Parameter(torch.zeros(64, device=device)) for _ in range(n)]
            for p in params:
                p.grad = torch.randn(64, device=device)
            opt = NoOpOptimizer(params)
            s = cls(device=device, init_scale=1.0, growth_interval=10**9)
            s.scale(torch.ones((), device=device))
            setups[name] = (s, opt)

        def step_update(s, opt):
            s.step(opt)
            s.update()

        t = interleaved({k: (lambda s=s, o=o: step_update(s, o)) for k, (s, o) in setups.items()},
                        reps, device)
        rows.append({"bench": "step+update host overhead", "tensors": n,
                     "memfit_us": t["memfit"] * 1e6, "torch_us": t["torch"] * 1e6,
                     "speedup": t["torch"] / t["memfit"]})
    return rows


def bench_clip(device, reps, total_elems):
    rows = []
    for n in (10, 100, 1000):
        per = total_elems // n
        gen = torch.Generator().manual_seed(1)
        pm = [torch.nn.Parameter(torch.zeros(per, device=device)) for _ in range(n)]
        pt = [torch.nn.Parameter(torch.zeros(per, device=device)) for _ in range(n)]
        for a, b in zip(pm, pt):
            g = torch.randn(per, generator=gen).to(device)
            a.grad, b.grad = g.clone(), g.clone()
        big = 1e30  # no actual clipping: values stay put, the multiply still runs
        t = interleaved({
            "memfit": lambda: amp.clip_grad_norm_(pm, big),
            "torch": lambda: torch.nn.utils.clip_grad_norm_(pt, big, foreach=True),
        }, reps, device)
        rows.append({"bench": "clip_grad_norm_", "tensors": n, "elements": per * n,
                     "memfit_ms": t["memfit"] * 1e3, "torch_ms": t["torch"] * 1e3,
                     "speedup": t["torch"] / t["memfit"]})
    return rows


def machine_info(device):
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, cwd=os.path.dirname(__file__)).stdout.strip()
    except OSError:
        commit = "?"
    info = {"cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "memfit_threads": memfit.get_num_threads(), "torch": torch.__version__,
            "memfit": memfit.build_info(), "python": sys.version.split()[0],
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": commit, "device": device}
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
    return info


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--quick", action="store_true", help="fewer repetitions")
    ap.add_argument("--elements", type=int, default=1 << 22,
                    help="total gradient elements for the throughput benches (default 4M)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "out", "bench_amp.json"))
    args = ap.parse_args()
    reps = 15 if args.quick else 61
    # the same number of threads for both sides (memfit's default is OMP's)
    memfit.set_num_threads(torch.get_num_threads())
    info = machine_info(args.device)
    rows = bench_unscale(args.device, reps, args.elements)
    rows += bench_step_overhead(args.device, reps * 3)
    rows += bench_clip(args.device, reps, args.elements)

    print(f"# memfit.amp vs torch.amp on {info['device']} ({info['cpu']}, "
          f"{info['torch_threads']} threads), torch {info['torch']}, commit {info['commit']}")
    print(f"{'bench':28} {'dtype':9} {'tensors':>7} {'memfit':>12} {'torch':>12} {'torch/memfit':>12}")
    for r in rows:
        if "memfit_us" in r:
            m, t = f"{r['memfit_us']:.1f} us", f"{r['torch_us']:.1f} us"
        elif "memfit_GBps" in r:
            m, t = f"{r['memfit_GBps']:.2f} GB/s", f"{r['torch_GBps']:.2f} GB/s"
        else:
            m, t = f"{r['memfit_ms']:.3f} ms", f"{r['torch_ms']:.3f} ms"
        print(f"{r['bench']:28} {r.get('dtype', 'float32'):9} {r['tensors']:7d} {m:>12} {t:>12} "
              f"{r['speedup']:11.2f}x")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"machine": info, "reps": reps, "rows": rows}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
