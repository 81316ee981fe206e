"""Matrix products: memfit against torch in the same run.

Two workloads on transformer-shaped sizes (tokens x d_model -> 4 d_model, GPT-2
small/medium widths):
  matmul        C = A @ B, float16/bfloat16 inputs, float32 accumulation
  linear+GELU   y = gelu(x W^T + b), forward and backward (memfit.nn.functional.linear
                against torch.nn.functional.linear + gelu)
TFLOP/s counts 2*m*n*k per product (3 products for forward+backward).

    python benchmarks/bench_gemm.py                 # CPU (and GPU when present)
    python benchmarks/bench_gemm.py --device cuda

Prints a markdown table, writes benchmarks/out/bench_gemm.json.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _common import Progress, interleaved_medians, markdown_table, metadata, write_json  # noqa: E402

import memfit  # noqa: E402
import memfit._matmul as mm  # noqa: E402
import memfit.nn.functional as MF  # noqa: E402

CPU_SHAPES = [(512, 768, 3072), (512, 1024, 4096)]  # tokens, d_in, d_out
GPU_SHAPES = [(8192, 768, 3072), (8192, 1024, 4096), (16384, 2048, 8192)]


def run(device, shapes, dtypes, reps):
    rows = []
    prog = Progress(len(shapes) * len(dtypes), f"bench_gemm[{device}]")
    for dtype_name in dtypes:
        dt = getattr(torch, dtype_name)
        for m, k, n in shapes:
            a = torch.randn(m, k, device=device, dtype=dt)
            b = torch.randn(k, n, device=device, dtype=dt)
            w = (torch.randn(n, k, device=device) / k**0.5).to(dt).requires_grad_()
            bias = torch.zeros(n, device=device, dtype=dt, requires_grad=True)
            x = torch.randn(m, k, device=device, dtype=dt, requires_grad=True)
            gy = torch.randn(m, n, device=device, dtype=dt)

            def mf_lin():
                MF.linear(x, w, bias, "gelu").backward(gy)

            def torch_lin():
                torch.nn.functional.gelu(torch.nn.functional.linear(x, w, bias)).backward(gy)

            t = interleaved_medians({"memfit": lambda: mm.matmul(a, b), "torch": lambda: a @ b}, reps, device)
            tl = interleaved_medians({"memfit": mf_lin, "torch": torch_lin}, reps, device)
            flops = 2 * m * n * k
            for op, tt, f in (("matmul", t, flops), ("linear+gelu fwd+bwd", tl, 3 * flops)):
                rows.append({"device": device, "op": op, "dtype": dtype_name, "m": m, "k": k, "n": n,
                             "memfit_s": tt["memfit"], "torch_s": tt["torch"],
                             "memfit_tflops": f / tt["memfit"] / 1e12, "torch_tflops": f / tt["torch"] / 1e12,
                             "speedup": tt["torch"] / tt["memfit"]})
            prog.step(f"{dtype_name} {m}x{k}x{n}")
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--reps", type=int, default=None)
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float16"])
    args = p.parse_args(argv)
    devices = ["cpu"] if args.device == "cpu" else ["cuda"] if args.device == "cuda" else (
        ["cpu", "cuda"] if torch.cuda.is_available() and memfit.cuda_device_count() else ["cpu"])
    rows, meta = [], {}
    for dev in devices:
        reps = args.reps or (5 if dev == "cpu" else 30)
        rows += run(dev, CPU_SHAPES if dev == "cpu" else GPU_SHAPES, args.dtypes, reps)
        meta[dev] = dict(metadata(dev), reps=reps)
    for dev, m in meta.items():
        print(f"{dev}: {m.get('gpu', m['cpu'])}, memfit {m['memfit']} @ {m['commit']}, torch {m.get('torch')}, "
              f"{m['date']}, threads memfit={m['memfit_threads']} torch={m.get('torch_threads')}, median of {m['reps']}")
    print(markdown_table(
        ["device", "op", "dtype", "m x k x n", "memfit TFLOP/s", "torch TFLOP/s", "memfit / torch speed"],
        [[r["device"], r["op"], r["dtype"], f"{r['m']}x{r['k']}x{r['n']}", f"{r['memfit_tflops']:.3f}",
          f"{r['torch_tflops']:.3f}", f"{r['speedup']:.2f}"] for r in rows]))
    print(f"\nwrote {write_json('bench_gemm', {'meta': meta, 'rows': rows})}")


if __name__ == "__main__":
    main()
