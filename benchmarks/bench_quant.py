"""Blockwise quantize / dequantize throughput: memfit against a peer in the same run.

Peers: bitsandbytes' quantize_blockwise/dequantize_blockwise where it installs and
runs on the device, and a vectorised torch implementation of the same algorithm
(always). The floor is the bytes each op must move (read the input once, write the
output once) over the measured copy bandwidth of the device.

    python benchmarks/bench_quant.py                  # CPU (and GPU when present)
    python benchmarks/bench_quant.py --device cuda --numel 268435456

Prints a markdown table and writes benchmarks/out/bench_quant.json.
"""

from __future__ import annotations

import argparse
import sys

import torch

sys.path.insert(0, __import__("os").path.dirname(__file__))
from _common import Progress, copy_bandwidth, interleaved_medians, markdown_table, metadata, write_json  # noqa: E402

import memfit  # noqa: E402
import memfit.quant as mq  # noqa: E402


def torch_reference(code: torch.Tensor, block_size: int):
    """The same algorithm in plain torch ops: absmax per block, nearest code by
    searchsorted over the midpoints between code values."""
    mids = (code[1:] + code[:-1]) / 2

    def quantize(x):
        flat = x.reshape(-1).float()
        n = flat.numel()
        pad = (-n) % block_size
        blocks = torch.nn.functional.pad(flat, (0, pad)).view(-1, block_size)
        absmax = blocks.abs().amax(dim=1)
        xn = blocks / absmax.clamp_min(1e-30)[:, None]
        codes = torch.searchsorted(mids, xn.contiguous()).to(torch.uint8).view(-1)[:n]
        return codes, absmax

    def dequantize(codes, absmax, dtype):
        n = codes.numel()
        vals = code[codes.long()]
        pad = (-n) % block_size
        vals = torch.nn.functional.pad(vals, (0, pad)).view(-1, block_size) * absmax[:, None]
        return vals.view(-1)[:n].to(dtype)

    return quantize, dequantize


def bnb_functions(device: str):
    try:
        import bitsandbytes.functional as F
    except Exception:
        return None
    try:  # it must actually run on this device
        q, s = F.quantize_blockwise(torch.randn(4096, device=device), blocksize=256)
        F.dequantize_blockwise(q, s)
    except Exception:
        return None
    return F


def bench_device(device: str, numel: int, reps: int, dtypes, block_sizes, clock: str) -> list:
    bw = copy_bandwidth(device)
    F = bnb_functions(device)
    rows = []
    prog = Progress(len(dtypes) * len(block_sizes), f"bench_quant[{device}]")
    for dtype_name in dtypes:
        dtype = getattr(torch, dtype_name)
        x = torch.randn(numel, device=device).to(dtype)
        for bs in block_sizes:
            code = mq._default_code(x)
            tq, tdq = torch_reference(code, bs)
            state = mq.quantize_blockwise(x, block_size=bs)
            out = torch.empty_like(x)
            tcodes, tabsmax = tq(x)
            fns_q = {"memfit": lambda: mq.quantize_blockwise(x, block_size=bs),
                     "torch": lambda: tq(x)}
            fns_d = {"memfit": lambda: mq.dequantize_blockwise(state, out=out),
                     "torch": lambda: tdq(tcodes, tabsmax, dtype)}
            if F is not None:
                bq, bstate = F.quantize_blockwise(x, blocksize=bs)
                fns_q["bitsandbytes"] = lambda: F.quantize_blockwise(x, blocksize=bs)
                fns_d["bitsandbytes"] = lambda: F.dequantize_blockwise(bq, bstate)
            floats = numel * x.element_size()
            moved = floats + numel + 4 * (-(-numel // bs))  # floats + codes + absmax
            for op, fns in (("quantize", fns_q), ("dequantize", fns_d)):
                t = interleaved_medians(fns, reps, device, clock=clock if device == "cpu" else "wall")
                peer = "bitsandbytes" if "bitsandbytes" in t else "torch"
                rows.append({
                    "device": device, "op": op, "dtype": dtype_name, "block_size": bs, "numel": numel,
                    "memfit_s": t["memfit"], "torch_s": t["torch"], "bnb_s": t.get("bitsandbytes"),
                    "memfit_gbps_input": floats / t["memfit"] / 1e9,
                    "memfit_gbps_moved": moved / t["memfit"] / 1e9,
                    "floor_s": moved / bw, "pct_of_floor": 100 * (moved / bw) / t["memfit"],
                    "peer": peer, "speedup_vs_peer": t[peer] / t["memfit"],
                    "speedup_vs_torch": t["torch"] / t["memfit"],
                })
            prog.step(f"{dtype_name} bs={bs}")
    return rows, bw


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--numel", type=int, default=None, help="elements (default 16M CPU, 256M GPU)")
    p.add_argument("--reps", type=int, default=None)
    p.add_argument("--block-sizes", type=int, nargs="+", default=[256, 4096])
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                   help="CPU timing: wall time, or process CPU time (robust on a shared machine; "
                        "with OMP_NUM_THREADS=1 it is the single-thread cost)")
    args = p.parse_args(argv)
    devices = ["cpu"] if args.device == "cpu" else ["cuda"] if args.device == "cuda" else (
        ["cpu", "cuda"] if torch.cuda.is_available() and memfit.cuda_device_count() else ["cpu"])
    all_rows, meta = [], {}
    for dev in devices:
        numel = args.numel or (16 << 20 if dev == "cpu" else 256 << 20)
        reps = args.reps or (15 if dev == "cpu" else 50)
        rows, bw = bench_device(dev, numel, reps, args.dtypes, args.block_sizes, args.clock)
        all_rows += rows
        meta[dev] = dict(metadata(dev), copy_bandwidth_gbps=bw / 1e9, reps=reps,
                         clock=args.clock if dev == "cpu" else "wall")
    table = markdown_table(
        ["device", "op", "dtype", "block", "memfit GB/s (floats)", "GB/s moved", "% of copy floor",
         "peer", "x vs peer", "x vs torch ref"],
        [[r["device"], r["op"], r["dtype"], r["block_size"], f"{r['memfit_gbps_input']:.2f}",
          f"{r['memfit_gbps_moved']:.2f}", f"{r['pct_of_floor']:.0f}%", r["peer"],
          f"{r['speedup_vs_peer']:.2f}", f"{r['speedup_vs_torch']:.2f}"] for r in all_rows])
    for dev, m in meta.items():
        print(f"{dev}: {m.get('gpu', m['cpu_model'])}, memfit CPU kernels {m['memfit_cpu_kernels']}, "
              f"copy {m['copy_bandwidth_gbps']:.1f} GB/s (read+write), "
              f"memfit {m['memfit']} @ {m['commit']}, torch {m.get('torch')}, "
              f"bitsandbytes {m.get('bitsandbytes', 'not installed')}, {m['date']}, "
              f"threads memfit={m['memfit_threads']} torch={m.get('torch_threads')}, median of {m['reps']} "
              f"({m['clock']} time)")
    print(table)
    path = write_json("bench_quant", {"meta": meta, "rows": all_rows})
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
