"""The CPU step's cost by parameter dtype and rounding: AdamW8bit over three tensors of
4096 x 4096 parameters (float32, and bfloat16/float16 written back with stochastic
rounding, nearest-even or Kahan compensation), the mean of 3 steps after one warm-up.

    python benchmarks/bench_param_store.py [--reps 3]     # writes benchmarks/out/bench_param_store.json

Why: the offloader keeps bfloat16 master weights on the host with stochastic rounding, and
CPU bf16 training does the same; their step is this one.
"""
from __future__ import annotations

import argparse
import time

import torch

import memfit.optim as mo
from _common import markdown_table, metadata, write_json

CASES = [("float32", torch.float32, {}),
         ("bfloat16, stochastic rounding", torch.bfloat16, {}),
         ("bfloat16, nearest-even", torch.bfloat16, dict(bf16_stochastic_round=False)),
         ("bfloat16, Kahan", torch.bfloat16, dict(kahan=True)),
         ("float16, stochastic rounding", torch.float16, {})]


def step_ms(dtype, kw, n, reps):
    torch.manual_seed(0)
    params = [torch.randn(n).to(dtype) for _ in range(3)]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-2
    opt = mo.AdamW8bit(params, lr=1e-4, **kw)
    opt.step()  # states made
    t0 = time.perf_counter()
    for _ in range(reps):
        opt.step()
    return (time.perf_counter() - t0) / reps * 1e3


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--numel", type=int, default=4096 * 4096, help="elements per tensor")
    args = ap.parse_args(argv)
    print(f"AdamW8bit step, 3 x {args.numel} parameters, mean of {args.reps} steps")
    ms = {name: step_ms(dtype, kw, args.numel, args.reps) for name, dtype, kw in CASES}
    base = ms["float32"]
    print(markdown_table(["parameters", "ms per step", "x float32"],
                         [(k, f"{v:.1f}", f"{v / base:.2f}") for k, v in ms.items()]))
    path = write_json("bench_param_store", {"meta": metadata("cpu"), "numel": args.numel,
                                            "reps": args.reps, "ms": ms})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
