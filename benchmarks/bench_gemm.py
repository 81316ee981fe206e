"""Matrix products: memfit against torch in the same run.

Two workloads on transformer-shaped sizes (tokens x d_model -> 4 d_model, GPT-2
small/medium widths):
  matmul        C = A @ B, float16/bfloat16 inputs, float32 accumulation
  linear+GELU   y = gelu(x W^T + b), forward and backward (memfit.nn.functional.linear
                against torch.nn.functional.linear + gelu)
TFLOP/s counts 2*m*n*k per product (3 products for forward+backward).

On a GPU each memfit workload runs in both CUDA backends, interleaved with torch:
"cublaslt" (memfit.amp.set_gemm_backend("cublaslt"): every product in cuBLASLt, an
error otherwise) and "portable" (memfit's tiled kernel, no tensor cores); linear+GELU
runs with exact GELU ("gelu", cuBLASLt bias epilogue + memfit's elementwise pass)
and with the tanh form ("gelu_tanh", fused in cuBLASLt's GELU_AUX_BIAS epilogue),
each against torch's same GELU. On the CPU: memfit's blocked kernel against torch.
(The GPU part was written without a GPU and has not been run yet.)

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
import memfit.amp  # noqa: E402
import memfit.nn.functional as MF  # noqa: E402

CPU_SHAPES = [(512, 768, 3072), (512, 1024, 4096)]  # tokens, d_in, d_out
GPU_SHAPES = [(8192, 768, 3072), (8192, 1024, 4096), (16384, 2048, 8192)]
TORCH_GELU = {"gelu": "none", "gelu_tanh": "tanh"}


def on(backend, fn):
    """fn run with memfit's CUDA GEMM backend set to `backend` (None: leave it)."""
    if backend is None:
        return fn

    def call():
        memfit.amp.set_gemm_backend(backend)
        fn()

    return call


def run(device, shapes, dtypes, reps):
    rows = []
    backends = ["cublaslt", "portable"] if device == "cuda" else [None]
    gelus = ["gelu", "gelu_tanh"] if device == "cuda" else ["gelu"]
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

            def mf_lin(act):
                return lambda: MF.linear(x, w, bias, act).backward(gy)

            def torch_lin(act):
                return lambda: torch.nn.functional.gelu(torch.nn.functional.linear(x, w, bias),
                                                        approximate=TORCH_GELU[act]).backward(gy)

            flops = 2 * m * n * k
            try:
                mat = {f"memfit {be}" if be else "memfit": on(be, lambda: mm.matmul(a, b)) for be in backends}
                t = interleaved_medians({**mat, "torch": lambda: a @ b}, reps, device)
                for impl in mat:
                    rows.append(row(device, "matmul", dtype_name, (m, k, n), impl, t[impl], t["torch"], flops))
                for act in gelus:
                    lin = {f"memfit {be}" if be else "memfit": on(be, mf_lin(act)) for be in backends}
                    tl = interleaved_medians({**lin, "torch": torch_lin(act)}, reps, device)
                    for impl in lin:
                        rows.append(row(device, f"linear+{act} fwd+bwd", dtype_name, (m, k, n), impl,
                                        tl[impl], tl["torch"], 3 * flops))
            finally:
                memfit.amp.set_gemm_backend("auto")
            prog.step(f"{dtype_name} {m}x{k}x{n}")
    return rows


def row(device, op, dtype_name, shape, impl, t, t_torch, flops):
    m, k, n = shape
    return {"device": device, "op": op, "dtype": dtype_name, "m": m, "k": k, "n": n, "impl": impl,
            "memfit_s": t, "torch_s": t_torch, "memfit_tflops": flops / t / 1e12,
            "torch_tflops": flops / t_torch / 1e12, "speedup": t_torch / t}


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
        meta[dev] = dict(metadata(dev), reps=reps, gemm_backend=memfit.amp.gemm_backend(dev))
    for dev, m in meta.items():
        print(f"{dev}: {m.get('gpu', m['cpu'])}, memfit {m['memfit']} @ {m['commit']}, torch {m.get('torch')}, "
              f"{m['date']}, threads memfit={m['memfit_threads']} torch={m.get('torch_threads')}, median of {m['reps']}")
        if dev == "cuda":
            lt = m["gemm_backend"]["cublaslt"]
            print(f"cuda: cuBLASLt {lt['version']} from {lt['path']}" if lt["loaded"]
                  else f"cuda: cuBLASLt not loaded ({lt['reason']})")
    print(markdown_table(
        ["device", "op", "dtype", "m x k x n", "memfit", "memfit TFLOP/s", "torch TFLOP/s", "memfit / torch speed"],
        [[r["device"], r["op"], r["dtype"], f"{r['m']}x{r['k']}x{r['n']}", r["impl"], f"{r['memfit_tflops']:.3f}",
          f"{r['torch_tflops']:.3f}", f"{r['speedup']:.2f}"] for r in rows]))
    print(f"\nwrote {write_json('bench_gemm', {'meta': meta, 'rows': rows})}")


if __name__ == "__main__":
    main()
