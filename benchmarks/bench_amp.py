"""memfit.amp against torch.amp in the same process: interleaved, medians.

1. unscale: fused unscale + non-finite check, memfit's _C.unscale_grads against
   torch._amp_foreach_non_finite_check_and_unscale_ over the same gradients (10, 100,
   1000 tensors; float32 and bfloat16), as GB/s moved (read + write) and % of the
   measured copy floor.
2. step overhead: the host cost of scaler.step(optimizer) + scaler.update() for 10,
   100 and 1000 small gradients (64 elements each, so the arithmetic is negligible),
   with an optimizer whose step() does nothing: what the scaler itself costs.
3. clip: memfit.amp.clip_grad_norm_ against torch.nn.utils.clip_grad_norm_(foreach=True),
   once where every call clips (then both restore the gradients with one
   _foreach_copy_, timed on both sides) and once with max_norm=1e30 (no clipping needed:
   memfit skips the multiply by 1, torch does it).

    python benchmarks/bench_amp.py                    # CPU (and GPU when present)
    python benchmarks/bench_amp.py --device cpu --threads 1 --reps 61

Prints a markdown table and writes benchmarks/out/bench_amp.json.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _common import Progress, copy_bandwidth, interleaved_medians, markdown_table, metadata, write_json  # noqa: E402

import memfit  # noqa: E402
import memfit.amp as amp  # noqa: E402
from memfit import _C  # noqa: E402

COUNTS = (10, 100, 1000)


class NoOpOptimizer(torch.optim.Optimizer):
    def __init__(self, params):
        super().__init__(params, {})

    def step(self, closure=None):
        return None


def bench_unscale(device, numel, reps, bw, prog):
    rows = []
    stream = amp._stream(torch.device(device))
    for dtype in (torch.float32, torch.bfloat16):
        for n in COUNTS:
            per = numel // n
            gen = torch.Generator().manual_seed(0)
            gm = [torch.randn(per, generator=gen).to(dtype).to(device) for _ in range(n)]
            gt = [g.clone() for g in gm]
            fm = torch.zeros((), device=device)
            ft = torch.zeros((), device=device)
            # a scale of 1.0000001: the full read-modify-write runs (a scale of exactly 1
            # is a check-only pass for both) and the values stay normal across repetitions
            scale = torch.full((), 1.0000001, device=device)
            inv = scale.double().reciprocal().float()
            t = interleaved_medians({
                "memfit": lambda: _C.unscale_grads(gm, scale, fm, stream),
                "torch": lambda: torch._amp_foreach_non_finite_check_and_unscale_(gt, ft, inv),
            }, reps, device)
            moved = 2 * per * n * gm[0].element_size()
            rows.append({
                "bench": "unscale+check", "device": device, "dtype": str(dtype).split(".")[1],
                "tensors": n, "elements": per * n,
                "memfit_s": t["memfit"], "torch_s": t["torch"],
                "memfit_gbps": moved / t["memfit"] / 1e9, "torch_gbps": moved / t["torch"] / 1e9,
                "pct_of_floor": 100 * (moved / t["memfit"]) / bw,
                "speedup": t["torch"] / t["memfit"],
            })
            prog.step(f"unscale {dtype} x{n}")
    return rows


def bench_step_overhead(device, reps, prog):
    rows = []
    for n in COUNTS:
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

        t = interleaved_medians({k: (lambda s=s, o=o: step_update(s, o))
                                 for k, (s, o) in setups.items()}, reps, device)
        rows.append({"bench": "step+update (host)", "device": device, "dtype": "float32",
                     "tensors": n, "elements": 64 * n, "memfit_s": t["memfit"],
                     "torch_s": t["torch"], "speedup": t["torch"] / t["memfit"]})
        prog.step(f"step overhead x{n}")
    return rows


def bench_clip(device, numel, reps, prog):
    rows = []
    # "clips": max_norm 1 against gradients of norm ~2000, so every call clips; both
    # sides then restore the gradients with one torch._foreach_copy_ (the same cost on
    # each side, included in both times). "no clip": max_norm 1e30, nothing to clip
    # (memfit skips the multiply by 1, torch does it).
    for max_norm, label in ((1.0, "clip_grad_norm_ (clips) + restore"),
                            (1e30, "clip_grad_norm_ (no clip)")):
        for n in COUNTS:
            per = numel // n
            gen = torch.Generator().manual_seed(1)
            pm = [torch.nn.Parameter(torch.zeros(per, device=device)) for _ in range(n)]
            pt = [torch.nn.Parameter(torch.zeros(per, device=device)) for _ in range(n)]
            saved = [torch.randn(per, generator=gen).to(device) for _ in range(n)]
            for a, b, g in zip(pm, pt, saved):
                a.grad, b.grad = g.clone(), g.clone()
            gm, gt = [p.grad for p in pm], [p.grad for p in pt]
            restore = max_norm < 1e30

            def run_memfit():
                amp.clip_grad_norm_(pm, max_norm)
                if restore:
                    torch._foreach_copy_(gm, saved)

            def run_torch():
                torch.nn.utils.clip_grad_norm_(pt, max_norm, foreach=True)
                if restore:
                    torch._foreach_copy_(gt, saved)

            t = interleaved_medians({"memfit": run_memfit, "torch": run_torch}, reps, device)
            rows.append({"bench": label, "device": device, "dtype": "float32",
                         "tensors": n, "elements": per * n, "memfit_s": t["memfit"],
                         "torch_s": t["torch"], "speedup": t["torch"] / t["memfit"]})
            prog.step(f"clip x{n}")
    return rows


def fmt_time(s):
    return f"{s * 1e6:.1f} us" if s < 1e-3 else f"{s * 1e3:.2f} ms"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--numel", type=int, default=None,
                   help="gradient elements for unscale/clip (default 4M CPU, 64M GPU)")
    p.add_argument("--reps", type=int, default=None)
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads for both memfit and torch (default: torch's default)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    devices = ["cpu"] if args.device == "cpu" else ["cuda"] if args.device == "cuda" else (
        ["cpu", "cuda"] if torch.cuda.is_available() and memfit.cuda_device_count() else ["cpu"])
    # the same number of CPU threads on both sides
    memfit.set_num_threads(torch.get_num_threads())
    all_rows, meta = [], {}
    for dev in devices:
        numel = args.numel or (4 << 20 if dev == "cpu" else 64 << 20)
        reps = args.reps or (31 if dev == "cpu" else 100)
        prog = Progress(5 * len(COUNTS), f"bench_amp[{dev}]")
        # a copy with the same memory footprint as the float32 gradients (two buffers of
        # half their size), so both stay in cache or both do not
        bw = copy_bandwidth(dev, nbytes=2 * numel)
        rows = bench_unscale(dev, numel, reps, bw, prog)
        rows += bench_step_overhead(dev, 3 * reps, prog)
        rows += bench_clip(dev, numel, reps, prog)
        all_rows += rows
        meta[dev] = dict(metadata(dev), copy_bandwidth_gbps=bw / 1e9, reps=reps)
    table = markdown_table(
        ["device", "bench", "dtype", "tensors", "elements", "memfit", "torch", "x vs torch",
         "memfit GB/s", "torch GB/s", "% of copy floor"],
        [[r["device"], r["bench"], r["dtype"], r["tensors"], r["elements"], fmt_time(r["memfit_s"]),
          fmt_time(r["torch_s"]), f"{r['speedup']:.2f}",
          f"{r['memfit_gbps']:.1f}" if "memfit_gbps" in r else "",
          f"{r['torch_gbps']:.1f}" if "torch_gbps" in r else "",
          f"{r['pct_of_floor']:.0f}%" if "pct_of_floor" in r else ""] for r in all_rows])
    for dev, m in meta.items():
        print(f"{dev}: {m.get('gpu', m['cpu'])}, {m['cores']} cores, copy "
              f"{m['copy_bandwidth_gbps']:.1f} GB/s (read+write), memfit {m['memfit']} @ "
              f"{m['commit']}, torch {m.get('torch')}, {m['date']}, threads memfit="
              f"{m['memfit_threads']} torch={m.get('torch_threads')}, median of {m['reps']} "
              f"(step overhead: {3 * m['reps']})")
    print(table)
    path = write_json("bench_amp", {"meta": meta, "rows": all_rows})
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
