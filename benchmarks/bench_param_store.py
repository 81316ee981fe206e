"""The CPU step's cost by parameter dtype and rounding, and what stochastic rounding adds
over round-to-nearest per CPU kernel variant and per tensor shape.

    python benchmarks/bench_param_store.py      # writes benchmarks/out/bench_param_store.json
    python benchmarks/bench_param_store.py --isa avx512vbmi,avx2 --rounds 3
    python benchmarks/bench_param_store.py --against-python /path/to/other/python  # before/after

1. dtype table: AdamW8bit over three 4096-wide 2-D tensors (--numel elements each; 8-bit
   states, so the fused kernel where the CPU has one), float32, and bfloat16/float16
   written back with stochastic rounding, nearest-even or Kahan compensation; the mean of
   --reps steps after one warm-up, wall time, all threads.
2. stochastic rounding (and Kahan) over nearest, per MEMFIT_CPU_ISA cap (generic, avx2,
   avx512, avx512vbmi; one child process each, since the cap is read once per process),
   one thread, bfloat16 AdamW8bit (and float16 on the big 2-D set), in core-ns per
   parameter (process time, so time the scheduler gave to other jobs is left out), on
   three sets:
     big 2-D   one 4096 x 2048 tensor (8-bit states: the fused kernel),
     big 1-D   one 8M-element tensor (1-D parameters keep float32 states: the block
               kernel; what earlier measurements of this store used),
     GPT-like  73 tensors as a 6-layer GPT of width 768: an 8192 x 768 embedding,
               768 x 768, 3072 x 768 and 768 x 3072 matrices, 768-vectors.
   The eleven (set, dtype, rounding) optimizers are stepped in turn, --steps steps each, and the
   medians over --inner turns are reported with their ratio from the same process (on
   a shared machine only same-run ratios mean much). --rounds repeats the children and
   takes the median; with --against-python the children alternate with ones importing
   memfit from that path (an older build), and the table gets both.

Why: the offloader keeps bfloat16 master weights on the host with stochastic rounding, and
CPU bf16 training does the same; their step is this one. Target: stochastic rounding
within 1.3x of nearest on every variant and set (issue 40).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

import memfit
import memfit.optim as mo
from _common import interleaved_medians, markdown_table, metadata, write_json

CASES = [("float32", torch.float32, {}),
         ("bfloat16, stochastic rounding", torch.bfloat16, {}),
         ("bfloat16, nearest-even", torch.bfloat16, dict(bf16_stochastic_round=False)),
         ("bfloat16, Kahan", torch.bfloat16, dict(kahan=True)),
         ("float16, stochastic rounding", torch.float16, {})]
ISAS = ("generic", "avx2", "avx512", "avx512vbmi")
WIDTH = 768


def gpt_shapes() -> list:
    """73 tensors of a 6-layer GPT of width 768 (8192-token embedding)."""
    layer = [(WIDTH, WIDTH)] * 4 + [(4 * WIDTH, WIDTH), (WIDTH, 4 * WIDTH)] + [(WIDTH,)] * 2
    shapes = [(8192, WIDTH)] + layer * 6
    return shapes + [(WIDTH,)] * (73 - len(shapes))


SETS = {"big 2-D": [(4096, 2048)], "big 1-D": [(4096 * 2048,)], "GPT-like": gpt_shapes()}
# (set, parameter dtype, roundings) stepped by each child of table 2: bfloat16 on every
# set, with Kahan too; float16 on the 2-D set (its stochastic rounding has a store of
# its own, store_sr.h)
RUNS = [(name, torch.bfloat16, ("sr", "nearest", "kahan")) for name in SETS] + \
       [("big 2-D", torch.float16, ("sr", "nearest"))]
ROUNDING_KW = {"sr": dict(bf16_stochastic_round=True), "nearest": dict(bf16_stochastic_round=False),
               "kahan": dict(kahan=True)}


def make_opt(shapes, dtype, kw):
    torch.manual_seed(0)
    params = [torch.randn(*s).to(dtype) for s in shapes]
    for p in params:
        p.grad = (torch.randn(p.shape) * 1e-2).to(dtype)
    opt = mo.AdamW8bit(params, lr=1e-4, **kw)
    opt.step()  # states made
    return opt, sum(p.numel() for p in params)


def step_ms(dtype, kw, n, reps):
    shape = (n // 4096, 4096) if n % 4096 == 0 else (n,)
    opt, _ = make_opt([shape] * 3, dtype, kw)
    t0 = time.perf_counter()
    for _ in range(reps):
        opt.step()
    return (time.perf_counter() - t0) / reps * 1e3


def child(steps: int, inner: int, sets) -> dict:
    """In a process with MEMFIT_CPU_ISA set: {set: {rounding: core-ns per param}}."""
    memfit.set_num_threads(1)
    torch.set_num_threads(1)
    fns, numel = {}, {}
    for name, dtype, roundings in [r for r in RUNS if r[0] in sets]:
        label = run_label(name, dtype)
        for rounding in roundings:
            opt, numel[label] = make_opt(SETS[name], dtype, ROUNDING_KW[rounding])
            fns[(label, rounding)] = (lambda o=opt: [o.step() for _ in range(steps)])
    keys = list(fns)
    med = interleaved_medians({i: fns[k] for i, k in enumerate(keys)}, inner, "cpu", warmup=1,
                              clock="cpu")
    out = {run_label(name, dtype): {} for name, dtype, _ in RUNS if name in sets}
    for i, (label, rounding) in enumerate(keys):
        out[label][rounding] = med[i] / steps / numel[label] * 1e9
    return {"kernel": memfit.cpu_kernels() if hasattr(memfit, "cpu_kernels") else None, "ns": out}


def run_label(name: str, dtype) -> str:
    return name if dtype == torch.bfloat16 else f"{name} {str(dtype).replace('torch.', '')}"


def run_child(isa: str, pythonpath: str | None, steps: int, inner: int, sets) -> dict:
    env = dict(os.environ, MEMFIT_CPU_ISA=isa, OMP_NUM_THREADS="1")
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    r = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", "--steps", str(steps),
                        "--inner", str(inner), "--sets", ",".join(sets)], env=env,
                       capture_output=True, text=True, check=True)
    return json.loads(r.stdout.strip().splitlines()[-1])


def sr_table(isas, rounds, steps, inner, against, sets):
    builds = {"this": None}
    if against:
        builds["against"] = against
    runs = {(b, isa): [] for b in builds for isa in isas}
    for _ in range(rounds):
        for isa in isas:
            for b, path in builds.items():
                runs[(b, isa)].append(run_child(isa, path, steps, inner, sets))
    rows, result = [], {}
    for (b, isa), rs in runs.items():
        for name in rs[0]["ns"]:
            def med(key, over=None):
                return statistics.median(r["ns"][name][key] / (r["ns"][name][over] if over else 1)
                                         for r in rs)
            has_kahan = "kahan" in rs[0]["ns"][name]
            res = {"sr_ns": med("sr"), "nearest_ns": med("nearest"), "ratio": med("sr", "nearest")}
            if has_kahan:
                res.update(kahan_ns=med("kahan"), kahan_ratio=med("kahan", "nearest"))
            result[f"{b}/{isa}/{name}"] = res
            rows.append((b, isa, name, f"{res['sr_ns']:.2f}", f"{res['nearest_ns']:.2f}",
                         f"{res['ratio']:.2f}",
                         f"{res['kahan_ns']:.2f}" if has_kahan else "-",
                         f"{res['kahan_ratio']:.2f}" if has_kahan else "-"))
    print(markdown_table(["build", "MEMFIT_CPU_ISA", "set", "SR core-ns/param",
                          "nearest core-ns/param", "SR / nearest (same run)",
                          "Kahan core-ns/param", "Kahan / nearest"], rows))
    return result


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--numel", type=int, default=4096 * 4096, help="elements per tensor (table 1)")
    ap.add_argument("--isa", default=",".join(ISAS), help="variants for table 2 ('' skips it)")
    ap.add_argument("--rounds", type=int, default=1, help="child processes per variant (median)")
    ap.add_argument("--steps", type=int, default=2, help="steps per timed turn (table 2)")
    ap.add_argument("--inner", type=int, default=5, help="timed turns per child (median)")
    ap.add_argument("--against-python", default=None,
                    help="PYTHONPATH of another memfit build to alternate with (table 2)")
    ap.add_argument("--skip-dtypes", action="store_true", help="only table 2")
    ap.add_argument("--sets", default=",".join(SETS), help=f"table 2's sets, of: {', '.join(SETS)}")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    sets = [x for x in args.sets.split(",") if x]
    unknown = sorted(set(sets) - set(SETS))
    if unknown:
        ap.error(f"--sets: unknown {unknown}; known: {list(SETS)}")
    if args.child:
        print(json.dumps(child(args.steps, args.inner, sets)))
        return
    payload = {"meta": metadata("cpu"), "numel": args.numel, "reps": args.reps}
    if not args.skip_dtypes:
        print(f"AdamW8bit step, 3 x {args.numel} parameters, mean of {args.reps} steps")
        ms = {name: step_ms(dtype, kw, args.numel, args.reps) for name, dtype, kw in CASES}
        base = ms["float32"]
        print(markdown_table(["parameters", "ms per step", "x float32"],
                             [(k, f"{v:.1f}", f"{v / base:.2f}") for k, v in ms.items()]))
        payload["ms"] = ms
    isas = [i for i in args.isa.split(",") if i]
    if isas:
        print(f"\nbf16 AdamW8bit, 1 thread, core-ns per parameter (process time), median of "
              f"{args.inner} interleaved turns x {args.rounds} process(es)")
        payload["sr_over_nearest"] = sr_table(isas, args.rounds, args.steps, args.inner,
                                              args.against_python, sets)
    path = write_json("bench_param_store", payload)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
