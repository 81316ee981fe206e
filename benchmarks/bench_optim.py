"""Optimizer step speed: memfit vs torch fused AdamW vs bitsandbytes, in one process.

    python benchmarks/bench_optim.py                 # CPU (and GPU when one is present)
    python benchmarks/bench_optim.py --reps 30 --numel 16777216 --markdown

CPU: one fp32 tensor of --numel parameters (default 16M), gradients randn*0.01. Every
repetition steps each optimizer once, in a rotating order (interleaved, so machine noise
hits all of them alike); we report the median wall time and the median process CPU
time. Two cache regimes:
  cold: a 1 GiB buffer is written before each step, so the optimizer's data comes from
        DRAM, as in training, where forward and backward run between two steps;
  warm: steps back to back (on a machine whose L3 holds the working set, this measures
        the arithmetic rather than the memory system).
Bytes per parameter moved (fp32 params and grads): torch AdamW 28 (p, g, m, v read;
p, m, v written), memfit AdamW8bit 16 + absmax, AdamW4bit 14 + absmax; we report GB/s.

GPU (when torch.cuda is available and memfit has CUDA): AdamW8bit over ~1B parameters as
one tensor and as a model of many small plus a few large tensors, timed with CUDA
events, against torch fused AdamW, bitsandbytes AdamW8bit, and a device-to-device copy
of the same number of bytes (the bandwidth ceiling).

Writes benchmarks/out/bench_optim-<host>-<time>.json and prints a table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time

import torch

import memfit
import memfit.optim as mo


def _git_commit():
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    except OSError:
        return "unknown"


def _bnb():
    try:
        import bitsandbytes as bnb  # noqa: F401

        return bnb
    except Exception as e:  # pragma: no cover - depends on the environment
        print(f"bitsandbytes not usable: {e!r}", file=sys.stderr)
        return None


BYTES = {"torch AdamW fused": 28, "torch AdamW foreach": 28, "memfit AdamW": 28,
         "memfit AdamW8bit": 16 + 8 / 256, "memfit AdamW4bit": 14 + 8 / 128,
         "bnb AdamW8bit": 16 + 8 / 256}


def cpu_bench(numel, reps, regimes, with_bnb, torch_only_fused=False):
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(numel, generator=gen) * 0.1
    grad = torch.randn(numel, generator=gen) * 0.01

    def param():
        p = torch.nn.Parameter(base.clone())
        p.grad = grad.clone()
        return p

    opts = {
        "torch AdamW fused": torch.optim.AdamW([param()], lr=1e-3, fused=True),
        "memfit AdamW8bit": mo.AdamW8bit([param()], lr=1e-3),
        "memfit AdamW4bit": mo.AdamW4bit([param()], lr=1e-3),
        "memfit AdamW": mo.AdamW([param()], lr=1e-3),
    }
    if not torch_only_fused:
        opts["torch AdamW foreach"] = torch.optim.AdamW([param()], lr=1e-3, foreach=True)
    bnb = _bnb() if with_bnb else None
    if bnb is not None:
        try:
            o = bnb.optim.AdamW8bit([param()], lr=1e-3)
            o.step()
            opts["bnb AdamW8bit"] = o
        except Exception as e:  # pragma: no cover
            print(f"bitsandbytes AdamW8bit does not run on CPU here: {e!r}", file=sys.stderr)
    for o in opts.values():  # warm-up: states allocated, tables built
        o.step()
        o.step()
    flush = torch.empty(256 * 1024 * 1024, dtype=torch.float32)  # 1 GiB
    names = list(opts)
    results = {}
    for regime in regimes:
        wall = {k: [] for k in names}
        cpu = {k: [] for k in names}
        # the slow bitsandbytes CPU path gets fewer repetitions
        for r in range(reps):
            order = names[r % len(names):] + names[:r % len(names)]
            for k in order:
                if k == "bnb AdamW8bit" and r >= max(3, reps // 5):
                    continue
                if regime == "cold":
                    flush.fill_(float(r))
                t0, c0 = time.perf_counter(), time.process_time()
                opts[k].step()
                wall[k].append(time.perf_counter() - t0)
                cpu[k].append(time.process_time() - c0)
        ref = statistics.median(wall["torch AdamW fused"])
        ref_cpu = statistics.median(cpu["torch AdamW fused"])
        for k in names:
            w, c = statistics.median(wall[k]), statistics.median(cpu[k])
            results[(regime, k)] = {
                "regime": regime, "optimizer": k, "numel": numel, "reps": len(wall[k]),
                "wall_ms": w * 1e3, "cpu_ms": c * 1e3,
                "wall_ms_min": min(wall[k]) * 1e3, "wall_ms_max": max(wall[k]) * 1e3,
                "speedup_vs_torch_fused": ref / w, "cpu_speedup_vs_torch_fused": ref_cpu / c,
                "bytes_per_param": BYTES.get(k), "GB_per_s": BYTES.get(k, 0) * numel / w / 1e9,
            }
    return list(results.values())


def gpu_bench(reps):  # pragma: no cover - needs a GPU
    dev = torch.device("cuda")
    out = []

    def timed(fn, n):
        fn()
        torch.cuda.synchronize()
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
        for a, b in ev:
            a.record()
            fn()
            b.record()
        torch.cuda.synchronize()
        return statistics.median(a.elapsed_time(b) for a, b in ev)

    total = 1 << 30
    layouts = {
        "one 1B tensor": [total],
        # many small (biases, norms) and a few large (embeddings, projections)
        "model: 2000 small + 8 large": [4096] * 2000 + [(total - 4096 * 2000) // 8] * 8,
    }
    bnb = _bnb()
    for lname, sizes in layouts.items():
        for dtype in (torch.float32, torch.bfloat16):
            params = [torch.nn.Parameter(torch.randn(n, device=dev, dtype=dtype) * 0.1) for n in sizes]
            for p in params:
                p.grad = torch.randn_like(p) * 0.01
            esz = params[0].element_size()
            cands = {"memfit AdamW8bit": lambda: mo.AdamW8bit(params, lr=1e-3),
                     "memfit AdamW4bit": lambda: mo.AdamW4bit(params, lr=1e-3)}
            cands["torch AdamW fused"] = lambda: torch.optim.AdamW(params, lr=1e-3, fused=True)
            if bnb is not None:
                cands["bnb AdamW8bit"] = lambda: bnb.optim.AdamW8bit(params, lr=1e-3)
            src = torch.empty(int(sum(sizes) * (2 * esz + 2)), dtype=torch.uint8, device=dev)
            dst = torch.empty_like(src)
            copy_ms = timed(lambda: dst.copy_(src), reps)
            copy_gbs = 2 * src.numel() / copy_ms / 1e6
            for name, make in cands.items():
                try:
                    opt = make()
                except Exception as e:
                    print(f"{name}: {e!r}", file=sys.stderr)
                    continue
                ms = timed(opt.step, reps)
                bpp = {"memfit AdamW8bit": 3 * esz + 2 + 8 / 256, "bnb AdamW8bit": 3 * esz + 2 + 8 / 256,
                       "memfit AdamW4bit": 3 * esz + 1 + 8 / 128, "torch AdamW fused": 3 * esz + 16}[name]
                gbs = bpp * sum(sizes) / ms / 1e6
                out.append({"layout": lname, "dtype": str(dtype), "optimizer": name, "ms": ms,
                            "GB_per_s": gbs, "copy_GB_per_s": copy_gbs,
                            "fraction_of_copy": gbs / copy_gbs, "device": torch.cuda.get_device_name()})
                del opt
                torch.cuda.empty_cache()
            del params, src, dst
            torch.cuda.empty_cache()
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--numel", type=int, default=16 * 1024 * 1024)
    ap.add_argument("--reps", type=int, default=21)
    ap.add_argument("--regimes", default="cold,warm")
    ap.add_argument("--no-bnb", action="store_true")
    ap.add_argument("--no-gpu", action="store_true")
    ap.add_argument("--markdown", action="store_true", help="print RESULTS.md rows")
    args = ap.parse_args(argv)

    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": _git_commit(), "host": socket.gethostname(), "machine": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(), "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
        "memfit_threads": memfit.get_num_threads(), "memfit_build": memfit.build_info(),
    }
    rows = cpu_bench(args.numel, args.reps, args.regimes.split(","), not args.no_bnb)
    print(f"CPU, {args.numel} fp32 parameters, {meta['cpu_count']} cores, torch {meta['torch']}, "
          f"median of {args.reps} interleaved steps")
    print(f"{'regime':6} {'optimizer':22} {'wall ms':>9} {'cpu ms':>9} {'x torch fused':>14} {'x (cpu time)':>13} {'GB/s':>7}")
    for r in rows:
        print(f"{r['regime']:6} {r['optimizer']:22} {r['wall_ms']:9.2f} {r['cpu_ms']:9.2f} "
              f"{r['speedup_vs_torch_fused']:14.2f} {r['cpu_speedup_vs_torch_fused']:13.2f} {r['GB_per_s']:7.1f}")
    gpu = []
    if not args.no_gpu and torch.cuda.is_available() and memfit.build_info()["cuda"]:
        gpu = gpu_bench(max(5, args.reps // 2))
        for r in gpu:
            print(f"GPU {r['layout']:28} {r['dtype']:15} {r['optimizer']:18} {r['ms']:8.2f} ms "
                  f"{r['GB_per_s']:7.1f} GB/s ({100 * r['fraction_of_copy']:.0f}% of copy)")
    else:
        print("GPU: not run (no CUDA device, or memfit built without CUDA)")
    os.makedirs(os.path.join(os.path.dirname(os.path.abspath(__file__)), "out"), exist_ok=True)
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out",
                        f"bench_optim-{meta['host']}-{time.strftime('%Y%m%d-%H%M%S')}.json")
    with open(path, "w") as f:
        json.dump({"meta": meta, "cpu": rows, "gpu": gpu}, f, indent=1)
    print(f"wrote {path}")
    if args.markdown:
        print("\n| regime | optimizer | wall ms | x torch fused (wall) | x torch fused (CPU time) | GB/s |")
        print("|---|---|---:|---:|---:|---:|")
        for r in rows:
            print(f"| {r['regime']} | {r['optimizer']} | {r['wall_ms']:.2f} | {r['speedup_vs_torch_fused']:.2f} | "
                  f"{r['cpu_speedup_vs_torch_fused']:.2f} | {r['GB_per_s']:.1f} |")


if __name__ == "__main__":
    main()
