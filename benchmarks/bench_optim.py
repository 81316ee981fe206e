"""Optimizer step speed: memfit vs torch fused AdamW vs bitsandbytes, in one process.

    python benchmarks/bench_optim.py                 # CPU (and GPU when one is present)
    python benchmarks/bench_optim.py --reps 31 --numel 16777216

CPU: one fp32 tensor of --numel parameters (default 16M), gradients randn*0.01, then a
"model" of 200 tensors (3.3M parameters) where per-tensor overhead counts. Every
repetition steps each optimizer once, in a rotating order (interleaved, so machine noise
hits all of them alike); we report the median wall time and the median process CPU
time, and the ratio of the best (minimum) times, which machine noise moves less. Two
cache regimes:
  cold: a 1 GiB buffer is written before each step, so the optimizer's data comes from
        DRAM, as in training, where forward and backward run between two steps;
  warm: steps back to back (on a machine whose L3 holds the working set, this measures
        the arithmetic rather than the memory system).
Bytes per parameter moved (fp32 params and grads): torch AdamW 28 (p, g, m, v read;
p, m, v written), memfit AdamW8bit 16 + absmax, AdamW4bit 14 + absmax; we report GB/s,
and the byte floor: the time those bytes take at the copy bandwidth measured in the same
process (read + write), and so the best ratio to torch fused a step of that many bytes
could reach. The ratio columns: the median over repetitions of torch fused's time over
the optimizer's in the same repetition, with its quartiles, which the machine's swings
move less than a ratio of medians. Beside the AdamW steps: memfit's Lion8bit, SGD8bit
(momentum 0.9), RMSprop8bit, AdEMAMix8bit (three states: AdamW8bit's bytes + 2) and
Adagrad8bit, with torch's fused Adagrad as Adagrad8bit's peer (its own ratio line),
bitsandbytes' AdamW8bit (its CPU path) and torchao's
AdamW8bit/AdamW4bit (pure PyTorch: eager), each where installed; the slow ones get fewer
repetitions, after the others (they slow down the steps that follow them), each paired
with a torch fused step just before it. `--threads N` sets memfit's and torch's thread
counts.

GPU (when torch.cuda is available and memfit has CUDA): AdamW8bit over ~1B parameters as
one tensor and as a model of many small plus a few large tensors, timed with CUDA
events, against torch fused AdamW, bitsandbytes AdamW8bit, and a device-to-device copy
of the same number of bytes (the bandwidth ceiling).

CPU variants: `--cpu-isa avx512vbmi,avx512,avx2` runs the CPU part once per
MEMFIT_CPU_ISA cap, each in its own process (the cap is read once per process), and
tabulates memfit's 8-bit and 4-bit steps against torch fused AdamW measured in the same
process: how the step does on CPUs that lack VBMI or AVX-512.

Prints markdown tables (for RESULTS.md) and writes benchmarks/out/bench_optim.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import copy_bandwidth, markdown_table, metadata, per_core_line, write_json  # noqa: E402

import memfit  # noqa: E402
import memfit.optim as mo  # noqa: E402


def _optional(module: str):
    """An optional peer's module (bitsandbytes, torchao.optim), or None with the reason."""
    import importlib

    try:
        return importlib.import_module(module)
    except Exception as e:  # pragma: no cover - depends on the environment
        print(f"{module} not usable: {e!r}", file=sys.stderr)
        return None


BYTES = {"torch AdamW fused": 28, "torch AdamW foreach": 28, "memfit AdamW": 28,
         "memfit AdamW8bit": 16 + 8 / 256, "memfit AdamW4bit": 14 + 8 / 128,
         "memfit Lion8bit": 14 + 4 / 256, "memfit SGD8bit": 14 + 4 / 256,
         "memfit RMSprop8bit": 14 + 4 / 256,
         # the step's bytes plus the trust ratio's norm pass, which reads p, g and the states
         "memfit LAMB8bit": 16 + 8 / 256 + 10 + 8 / 256, "memfit LARS8bit": 14 + 4 / 256 + 9 + 4 / 256,
         "memfit AdEMAMix8bit": 18 + 12 / 256, "memfit Adagrad8bit": 14 + 4 / 256,
         "torch Adagrad fused": 20,
         "bnb AdamW8bit": 16 + 8 / 256, "torchao AdamW8bit (eager)": 16 + 8 / 256,
         "torchao AdamW4bit (eager)": 14 + 8 / 128}

# memfit optimizers whose peer is not torch AdamW: peer -> memfit optimizer
PEERS = {"torch Adagrad fused": "memfit Adagrad8bit"}

# steps far slower than torch fused (pure PyTorch, or bitsandbytes' CPU path): they get
# max(3, reps // 5) repetitions
SLOW = ("bnb AdamW8bit", "torchao AdamW8bit (eager)", "torchao AdamW4bit (eager)")


# The CPU "model" layout: 50 blocks of Linear(256, 256) + LayerNorm(256), that is 50
# weight matrices of 256 x 256 (quantized states) and 150 vectors of 256 (biases, norm
# weights: below min_8bit_size, fp32 states), 3.3M parameters in 200 tensors, where
# per-tensor overhead shows.
MODEL_SIZES = [256 * 256, 256, 256, 256] * 50


ROW_LEN = 4096  # --row-len


def _matrix(t):
    """t as a weight matrix: memfit's 8-/4-bit states are for tensors of two or more
    dimensions (1-D ones keep float32 states). Rows of ROW_LEN where they divide t, else
    one row. With the default 4096 every row is whole quantization blocks (the flat
    layout); --row-len 4100 measures rows that end in a partial block, stepped row by row."""
    n = t.numel()
    return t.reshape(-1, ROW_LEN if n % ROW_LEN == 0 else max(n, 1))


def cpu_bench(sizes, reps, regimes, with_bnb, torch_only_fused=False):
    gen = torch.Generator().manual_seed(0)
    numel = sum(sizes)
    base = torch.randn(numel, generator=gen) * 0.1
    grad = torch.randn(numel, generator=gen) * 0.01

    def param():
        ps, at = [], 0
        for n in sizes:
            # weights as matrices; small tensors 1-D, as biases and norms are
            shape = (n,) if n <= 4096 else _matrix(base[:n]).shape
            p = torch.nn.Parameter(base[at:at + n].clone().reshape(shape))
            p.grad = grad[at:at + n].clone().reshape(shape)
            ps.append(p)
            at += n
        return ps

    opts = {
        "torch AdamW fused": torch.optim.AdamW(param(), lr=1e-3, fused=True),
        "memfit AdamW8bit": mo.AdamW8bit(param(), lr=1e-3),
        "memfit AdamW4bit": mo.AdamW4bit(param(), lr=1e-3),
        "memfit AdamW": mo.AdamW(param(), lr=1e-3),
    }
    if not torch_only_fused:
        opts["torch AdamW foreach"] = torch.optim.AdamW(param(), lr=1e-3, foreach=True)
        opts["memfit Lion8bit"] = mo.Lion8bit(param(), lr=1e-4)
        opts["memfit SGD8bit"] = mo.SGD8bit(param(), lr=1e-3, momentum=0.9)
        opts["memfit RMSprop8bit"] = mo.RMSprop8bit(param(), lr=1e-3)
        opts["memfit LAMB8bit"] = mo.LAMB8bit(param(), lr=1e-3)
        opts["memfit LARS8bit"] = mo.LARS8bit(param(), lr=1e-3, momentum=0.9)
        opts["memfit AdEMAMix8bit"] = mo.AdEMAMix8bit(param(), lr=1e-3)
        opts["memfit Adagrad8bit"] = mo.Adagrad8bit(param(), lr=1e-2)
        opts["torch Adagrad fused"] = torch.optim.Adagrad(param(), lr=1e-2, fused=True)
    tao = _optional("torchao.optim") if with_bnb else None
    if tao is not None:
        for name, cls in (("torchao AdamW8bit (eager)", tao.AdamW8bit),
                          ("torchao AdamW4bit (eager)", tao.AdamW4bit)):
            try:
                o = cls(param(), lr=1e-3)
                o.step()
                opts[name] = o
            except Exception as e:  # pragma: no cover
                print(f"{name} does not run on CPU here: {e!r}", file=sys.stderr)
    bnb = _optional("bitsandbytes") if with_bnb else None
    if bnb is not None:
        try:
            o = bnb.optim.AdamW8bit(param(), lr=1e-3)
            o.step()
            opts["bnb AdamW8bit"] = o
        except Exception as e:  # pragma: no cover
            print(f"bitsandbytes AdamW8bit does not run on CPU here: {e!r}", file=sys.stderr)
    for o in opts.values():  # warm-up: states allocated, tables built
        o.step()
        o.step()
    for k in [k for k in opts if k.startswith("memfit") and "bit" in k]:  # quantized states, not float32
        if any(st["state1"].dtype != torch.uint8 for p, st in opts[k].state.items()
               if p.numel() >= opts[k].param_groups[0]["min_8bit_size"]):
            raise RuntimeError(f"{k}: a tensor of this run got float32 states; the numbers would "
                               "not be the quantized step's")
    flush = torch.empty(256 * 1024 * 1024, dtype=torch.float32)  # 1 GiB
    names = list(opts)
    results = {}
    for regime in regimes:
        wall = {k: [] for k in names}
        cpu = {k: [] for k in names}
        ref_wall = {k: [] for k in names}  # torch fused's time in each of k's repetitions

        def timed(k, r):
            if regime == "cold":
                flush.fill_(float(r))
            t0, c0 = time.perf_counter(), time.process_time()
            opts[k].step()
            return time.perf_counter() - t0, time.process_time() - c0

        fast = [k for k in names if k not in SLOW]
        for r in range(reps):
            order = fast[r % len(fast):] + fast[:r % len(fast)]
            for k in order:
                w, c = timed(k, r)
                wall[k].append(w)
                cpu[k].append(c)
        for k in fast:
            ref_wall[k] = wall["torch AdamW fused"]
        # the slow peers after the others (they slow down the steps that follow them), fewer
        # repetitions, each paired with a torch fused step just before it
        for k in [k for k in names if k in SLOW]:
            for r in range(max(3, reps // 5)):
                ref_wall[k].append(timed("torch AdamW fused", r)[0])
                w, c = timed(k, r)
                wall[k].append(w)
                cpu[k].append(c)
        ref = statistics.median(wall["torch AdamW fused"])
        ref_cpu = statistics.median(cpu["torch AdamW fused"])
        for k in names:
            w, c = statistics.median(wall[k]), statistics.median(cpu[k])
            # torch fused over this optimizer, repetition by repetition
            paired = [a / b for a, b in zip(ref_wall[k], wall[k])]
            q1, q2, q3 = statistics.quantiles(paired, n=4) if len(paired) > 1 else paired * 3
            results[(regime, k)] = {
                "regime": regime, "optimizer": k, "numel": numel, "tensors": len(sizes),
                "reps": len(wall[k]),
                "wall_ms": w * 1e3, "cpu_ms": c * 1e3,
                "wall_ms_min": min(wall[k]) * 1e3, "wall_ms_max": max(wall[k]) * 1e3,
                "speedup_vs_torch_fused": ref / w, "cpu_speedup_vs_torch_fused": ref_cpu / c,
                "paired_speedup_median": statistics.median(paired), "paired_speedup_q1": q1,
                "paired_speedup_q3": q3,
                "best_speedup_vs_torch_fused": min(wall["torch AdamW fused"]) / min(wall[k]),
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
    bnb = _optional("bitsandbytes")
    for lname, sizes in layouts.items():
        for dtype in (torch.float32, torch.bfloat16):
            # the small tensors stay 1-D, as biases and norms are (float32 states)
            params = [torch.nn.Parameter(torch.randn(n, device=dev, dtype=dtype) * 0.1) for n in sizes]
            params = [p if p.numel() <= 4096 else torch.nn.Parameter(_matrix(p.detach())) for p in params]
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


def core_speeds(numel=262144, steps=20):
    """Single-thread AdamW8bit step time (best of `steps`, ms) on each core this process
    may run on, pinned there in turn. On shared machines the cores need not run at the
    same speed (the 2-vCPU reference VM often runs one 1.5-1.7x slower than the other);
    the compute-bound 8-bit step feels that, torch's memory-bound step much less, so the
    line puts the run's ratios in context. {} where pinning is not available."""
    if not hasattr(os, "sched_getaffinity"):
        return {}
    cpus = sorted(os.sched_getaffinity(0))
    p = torch.nn.Parameter(_matrix(torch.randn(numel) * 0.1))
    p.grad = _matrix(torch.randn(numel) * 0.01)
    opt = mo.AdamW8bit([p], lr=1e-3)
    old = memfit.get_num_threads()
    out = {}
    try:
        memfit.set_num_threads(1)
        for c in cpus:
            os.sched_setaffinity(0, {c})
            opt.step()
            best = float("inf")
            for _ in range(steps):
                t0 = time.perf_counter()
                opt.step()
                best = min(best, time.perf_counter() - t0)
            out[c] = best * 1e3
    finally:
        os.sched_setaffinity(0, set(cpus))
        memfit.set_num_threads(0 if old == 0 else old)
    return out


def cpu_isa_bench(caps, numel, reps, regimes, threads=0):
    """The CPU part under each MEMFIT_CPU_ISA cap, each in a fresh process."""
    import json
    import subprocess

    rows = []
    for i, cap in enumerate(caps):
        print(f"[{i + 1}/{len(caps)}] MEMFIT_CPU_ISA={cap} ...", file=sys.stderr, flush=True)
        env = dict(os.environ, MEMFIT_CPU_ISA=cap)
        out = subprocess.run([sys.executable, os.path.abspath(__file__), "--numel", str(numel),
                              "--reps", str(reps), "--regimes", ",".join(regimes), "--no-bnb",
                              "--no-gpu", "--emit-rows", "--threads", str(threads)], env=env,
                             capture_output=True, text=True, check=True).stdout
        sub = json.loads(out.strip().splitlines()[-1])
        by = {(r["regime"], r["optimizer"]): r for r in sub["rows"]}
        for regime in regimes:
            ref = by[(regime, "torch AdamW fused")]
            row = {"cap": cap, "cpu_kernels": sub["cpu_kernels"], "regime": regime,
                   "torch_fused_ms": ref["wall_ms"]}
            for k in ("memfit AdamW8bit", "memfit AdamW4bit", "memfit AdamW"):
                row[k] = {key: by[(regime, k)][key] for key in
                          ("wall_ms", "speedup_vs_torch_fused", "paired_speedup_median",
                           "paired_speedup_q1", "paired_speedup_q3")}
            rows.append(row)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--numel", type=int, default=16 * 1024 * 1024)
    ap.add_argument("--reps", type=int, default=21)
    ap.add_argument("--regimes", default="cold,warm")
    ap.add_argument("--row-len", type=int, default=4096,
                    help="elements per row of the CPU tensor (must divide --numel), e.g. 4100 "
                         "with --numel 16793600 for rows that end in a partial block")
    ap.add_argument("--threads", type=int, default=0,
                    help="memfit and torch threads (0: as they are, OMP_NUM_THREADS or all cores)")
    ap.add_argument("--no-bnb", action="store_true", help="without bitsandbytes and torchao")
    ap.add_argument("--no-gpu", action="store_true")
    ap.add_argument("--cpu-isa", default=None,
                    help="comma-separated MEMFIT_CPU_ISA caps to compare, e.g. avx512vbmi,avx512,avx2")
    ap.add_argument("--emit-rows", action="store_true", help=argparse.SUPPRESS)  # for --cpu-isa
    args = ap.parse_args(argv)
    global ROW_LEN
    if args.row_len < 1 or args.numel % args.row_len:
        ap.error(f"--row-len {args.row_len} must divide --numel {args.numel}")
    ROW_LEN = args.row_len
    regimes = args.regimes.split(",")
    if args.threads:
        memfit.set_num_threads(args.threads)
        torch.set_num_threads(args.threads)

    if args.emit_rows:
        import json

        rows = cpu_bench([args.numel], args.reps, regimes, False, torch_only_fused=True)
        print(json.dumps({"cpu_kernels": memfit.cpu_kernels(), "rows": rows}))
        return
    if args.cpu_isa:
        caps = [c for c in args.cpu_isa.split(",") if c]
        meta = {"cpu": dict(metadata("cpu"), numel=args.numel, reps=args.reps)}
        rows = cpu_isa_bench(caps, args.numel, args.reps, regimes, args.threads)
        m = meta["cpu"]
        print(f"cpu: {m['cpu_model']} ({m['cpu']}), {m['cores']} cores, memfit {m['memfit_threads']} threads, "
              f"torch {m.get('torch')}, commit {m['commit']}, {m['date']}")
        print(f"AdamW step over {args.numel} fp32 parameters; each cap in its own process, "
              f"median of {args.reps} steps interleaved with torch fused AdamW\n")
        def x(r, k):
            v = r[k]
            return (f"{v['wall_ms']:.2f}", f"{v['paired_speedup_median']:.2f} "
                    f"({v['paired_speedup_q1']:.2f}-{v['paired_speedup_q3']:.2f})")

        print(markdown_table(
            ["MEMFIT_CPU_ISA", "CPU kernels", "regime", "torch fused ms", "AdamW8bit ms",
             "x torch [quartiles]", "AdamW4bit ms", "x torch [quartiles]", "AdamW (fp32) ms",
             "x torch [quartiles]"],
            [[r["cap"], r["cpu_kernels"], r["regime"], f"{r['torch_fused_ms']:.2f}",
              *x(r, "memfit AdamW8bit"), *x(r, "memfit AdamW4bit"), *x(r, "memfit AdamW")]
             for r in rows]))
        path = write_json("bench_optim_cpu_isa", {"meta": meta, "rows": rows})
        print(f"\nwrote {path}")
        return

    meta = {"cpu": dict(metadata("cpu"), row_len=ROW_LEN, copy_bandwidth_gbps=copy_bandwidth("cpu") / 1e9,
                        numel=args.numel, reps=args.reps)}
    speeds = core_speeds()
    rows = cpu_bench([args.numel], args.reps, regimes, not args.no_bnb)
    model_rows = cpu_bench(MODEL_SIZES, args.reps, ["warm"], not args.no_bnb, torch_only_fused=True)
    speeds_after = core_speeds()
    meta["cpu"]["core_step_ms"] = {"before": speeds, "after": speeds_after}
    m = meta["cpu"]
    print(f"cpu: {m['cpu_model']} ({m['cpu']}), {m['cores']} cores, memfit CPU kernels "
          f"{m['memfit_cpu_kernels']}, optimizer kernel {m['memfit_optim_kernel']}, copy {m['copy_bandwidth_gbps']:.1f} GB/s (read+write), "
          f"memfit {m['memfit_threads']} / torch {m.get('torch_threads')} threads, torch {m.get('torch')}, "
          f"commit {m['commit']}, {m['date']}")
    if speeds:
        print(per_core_line(speeds, speeds_after))
    print(f"AdamW step over {args.numel} fp32 parameters (one tensor of {args.numel // ROW_LEN} x "
          f"{ROW_LEN}, grads randn*0.01); median of "
          f"{args.reps} interleaved steps (bitsandbytes: fewer); cold = 1 GiB written before each step\n")
    copy_bw = m["copy_bandwidth_gbps"] * 1e9
    for r in rows:  # the byte floor: this step's bytes at the measured copy bandwidth
        r["floor_ms"] = r["bytes_per_param"] * r["numel"] / copy_bw * 1e3
    torch_ms = {r["regime"]: r["wall_ms"] for r in rows if r["optimizer"] == "torch AdamW fused"}
    print(markdown_table(
        ["regime", "optimizer", "wall ms", "x torch fused (paired median, quartiles)",
         "x torch fused (best of each)", "x torch fused (CPU time)", "B/param", "GB/s",
         "byte floor ms", "x torch at the floor"],
        [[r["regime"], r["optimizer"], f"{r['wall_ms']:.2f}",
          f"{r['paired_speedup_median']:.2f} ({r['paired_speedup_q1']:.2f}-{r['paired_speedup_q3']:.2f})",
          f"{r['best_speedup_vs_torch_fused']:.2f}", f"{r['cpu_speedup_vs_torch_fused']:.2f}",
          f"{r['bytes_per_param']:.1f}", f"{r['GB_per_s']:.1f}", f"{r['floor_ms']:.2f}",
          f"{torch_ms[r['regime']] / r['floor_ms']:.2f}"]
         for r in rows]))
    for peer, k in PEERS.items():  # a memfit optimizer against torch's fused form of it
        by = {(r["regime"], r["optimizer"]): r for r in rows}
        for regime in regimes:
            if (regime, k) in by and (regime, peer) in by:
                a, b = by[(regime, peer)], by[(regime, k)]
                print(f"\n{regime}: {k} against {peer}: {a['wall_ms']:.2f} / {b['wall_ms']:.2f} ms = "
                      f"x{a['wall_ms'] / b['wall_ms']:.2f} (medians), "
                      f"x{a['wall_ms_min'] / b['wall_ms_min']:.2f} (best of each)")
    print(f"\nThe same over {len(MODEL_SIZES)} tensors ({sum(MODEL_SIZES)} parameters: 50 of "
          "256 x 256 with quantized states, 150 of 256 below min_8bit_size), warm\n")
    print(markdown_table(
        ["optimizer", "wall ms", "x torch fused (paired median, quartiles)",
         "x torch fused (best of each)", "x torch fused (CPU time)"],
        [[r["optimizer"], f"{r['wall_ms']:.2f}",
          f"{r['paired_speedup_median']:.2f} ({r['paired_speedup_q1']:.2f}-{r['paired_speedup_q3']:.2f})",
          f"{r['best_speedup_vs_torch_fused']:.2f}", f"{r['cpu_speedup_vs_torch_fused']:.2f}"]
         for r in model_rows]))
    rows += model_rows
    gpu = []
    if not args.no_gpu and torch.cuda.is_available() and memfit.build_info()["cuda"]:
        meta["cuda"] = metadata("cuda")
        gpu = gpu_bench(max(5, args.reps // 2))
        print(f"\ncuda: {meta['cuda'].get('gpu')}\n")
        print(markdown_table(
            ["layout", "dtype", "optimizer", "ms", "GB/s", "% of D2D copy"],
            [[r["layout"], r["dtype"], r["optimizer"], f"{r['ms']:.2f}", f"{r['GB_per_s']:.0f}",
              f"{100 * r['fraction_of_copy']:.0f}"] for r in gpu]))
    else:
        print("\nGPU: not measured here (no CUDA device, or memfit built without CUDA)")
    path = write_json("bench_optim", {"meta": meta, "cpu": rows, "gpu": gpu})
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
