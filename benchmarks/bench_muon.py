"""Muon step time: memfit's Muon8bit and Muon against torch.optim.Muon, in one process.

    python benchmarks/bench_muon.py                      # CPU
    python benchmarks/bench_muon.py --device cuda        # GPU (CUDA events)
    python benchmarks/bench_muon.py --shapes 1024x1024,1024x4096,4096x1024 --reps 11

A "model" of hidden matrices (default: one transformer block of width 768: 768x2304,
768x768, 768x3072, 3072x768), fp32 parameters, gradients randn * 0.01. Every
repetition steps each optimizer once, in turn (interleaved, so machine noise hits all
alike); the table gives the median time per step, the median over repetitions of
torch's time over memfit's in the same repetition, and the momentum bytes per parameter
counted from the state tensors. Newton-Schulz (5 iterations of three matmuls of the
matrix's smaller side) dominates, and all three run torch's; what differs is the
momentum pass (memfit: one fused C/CUDA pass that also requantizes; torch: lerp_, lerp)
and the scratch it allocates.

Prints a markdown table (for RESULTS.md) and writes benchmarks/out/bench_muon.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import make_timer, markdown_table, metadata, write_json  # noqa: E402

import memfit.optim as mo  # noqa: E402

DEFAULT_SHAPES = "768x2304,768x768,768x3072,3072x768"


def _state_bytes(opt, params) -> float:
    """Momentum bytes per parameter (codes, absmax or float32 buffers; not the step)."""
    total = 0
    for p in params:
        for key, t in opt.state[p].items():
            if key != "step":
                total += t.numel() * t.element_size()
    return total / sum(p.numel() for p in params)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--shapes", default=DEFAULT_SHAPES)
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    gen = torch.Generator().manual_seed(0)
    base = [torch.randn(s, generator=gen) for s in shapes]
    grads = [(torch.randn(s, generator=gen) * 0.01).to(dev) for s in shapes]
    makers = {"torch.optim.Muon": torch.optim.Muon, "memfit Muon (fp32)": mo.Muon,
              "memfit Muon8bit": mo.Muon8bit}
    runs = {}
    for name, cls in makers.items():
        params = [b.to(dev).requires_grad_() for b in base]
        for p, g in zip(params, grads):
            p.grad = g
        runs[name] = (cls(params, lr=0.02), params)
    time_once = make_timer(args.device)
    for opt, _ in runs.values():  # warm-up (states made, kernels loaded)
        opt.step()
        opt.step()
    samples = {name: [] for name in runs}
    for _ in range(args.reps):
        for name, (opt, _) in runs.items():
            samples[name].append(time_once(opt.step))
    ref = "torch.optim.Muon"
    rows, results = [], {}
    for name, (opt, params) in runs.items():
        med = statistics.median(samples[name])
        ratio = statistics.median(t / m for t, m in zip(samples[ref], samples[name]))
        nbytes = _state_bytes(opt, params)
        results[name] = {"median_s": med, "samples_s": samples[name], "torch_over_this": ratio,
                         "state_bytes_per_param": nbytes}
        rows.append([name, f"{med * 1e3:.1f}", f"{ratio:.3f}", f"{nbytes:.3f}"])
    nparams = sum(b.numel() for b in base)
    print(f"Muon step, {len(shapes)} matrices ({args.shapes}), {nparams / 1e6:.2f}M fp32 params, "
          f"device {args.device}, {args.reps} interleaved reps")
    print(markdown_table(["optimizer", "median step (ms)", "torch time / this (median)",
                          "momentum bytes/param"], rows))
    path = write_json("bench_muon", {"meta": metadata(args.device), "shapes": shapes,
                                     "reps": args.reps, "results": results})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
