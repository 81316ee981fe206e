"""The CPU optimizer step with no Python in the way, and how fast each core runs it.

    python benchmarks/bench_optim_core.py                  # 16M params, 2 threads, 8 rounds
    python benchmarks/bench_optim_core.py --busy-core 1    # with a busy loop pinned to cpu1
    python benchmarks/bench_optim_core.py --bits 4 --numel 1048576 --threads 1

Builds benchmarks/c/bench_optim_step.c against the C core with CMake (CPU only,
Release, into benchmarks/out/core_build), then
  1. per-core speed: a single-thread AdamW8bit step over 262144 params pinned to each
     core in turn (best of 20 steps). On shared machines the cores need not run at the
     same speed, which a compute-bound step feels;
  2. the step itself: --rounds processes, each timing --reps repetitions of 3 back-to-back
     steps; we report the best time and the median of the processes' medians;
  3. the per-core check again, since the machine may have changed meanwhile.
`--busy-core N` runs a busy loop pinned to core N during step 2 (an uneven machine on
purpose: what dynamic work sharing is for). Prints a markdown table and writes
benchmarks/out/bench_optim_core.json. Needs cmake and a C compiler.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import OUT_DIR, Progress, markdown_table, metadata, per_core_line, write_json  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def build() -> Path:
    cmake = shutil.which("cmake")
    if cmake is None:
        sys.exit("cmake not found (pip install cmake)")
    out = OUT_DIR / "core_build"
    cfg = [cmake, "-S", str(ROOT), "-B", str(out), "-DMEMFIT_PYTHON=OFF", "-DMEMFIT_CUDA=OFF",
           "-DMEMFIT_BUILD_BENCHMARKS=ON", "-DCMAKE_BUILD_TYPE=Release"]
    if shutil.which("ninja"):
        cfg += ["-G", "Ninja"]
    for cmd in (cfg, [cmake, "--build", str(out), "--target", "bench_optim_step", "-j2"]):
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode:
            sys.exit(r.stdout + r.stderr)
    return out / "bench_optim_step"


def run(exe: Path, numel: int, threads: int, reps: int, bits: int, cpu: int | None = None) -> dict:
    pin = (lambda: os.sched_setaffinity(0, {cpu})) if cpu is not None else None
    r = subprocess.run([str(exe), str(numel), str(threads), "3", str(reps), str(bits)],
                       capture_output=True, text=True, check=True, preexec_fn=pin)
    return json.loads(r.stdout)


def core_speeds(exe: Path) -> dict:
    if not hasattr(os, "sched_getaffinity"):
        return {}
    return {c: run(exe, 262144, 1, 20, 8, cpu=c)["best_ms"] for c in sorted(os.sched_getaffinity(0))}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--numel", type=int, default=16 * 1024 * 1024)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--bits", type=int, choices=(8, 4), default=8)
    ap.add_argument("--rounds", type=int, default=8, help="processes (each a fresh start)")
    ap.add_argument("--reps", type=int, default=5, help="timed repetitions per process")
    ap.add_argument("--busy-core", type=int, default=None)
    args = ap.parse_args(argv)

    exe = build()
    before = core_speeds(exe)
    busy = None
    if args.busy_core is not None:
        busy = subprocess.Popen([sys.executable, "-c", "while True: pass"],
                                preexec_fn=lambda: os.sched_setaffinity(0, {args.busy_core}))
    bar = Progress(args.rounds, "rounds")
    try:
        rows = []
        for _ in range(args.rounds):
            rows.append(run(exe, args.numel, args.threads, args.reps, args.bits))
            bar.step(f"best {rows[-1]['best_ms']:.2f} ms")
    finally:
        if busy is not None:
            busy.kill()
            busy.wait()
    after = core_speeds(exe)
    best = min(r["best_ms"] for r in rows)
    med = statistics.median(r["median_ms"] for r in rows)
    meta = metadata("cpu")
    print(f"cpu: {meta['cpu']}, {meta['cores']} cores, commit {meta['commit']}, {meta['date']}")
    print(per_core_line(before, after))
    print(markdown_table(
        ["numel", "threads", "bits", "busy core", "rounds", "best ms", "median of medians ms",
         "ns / param (best)"],
        [[args.numel, args.threads, args.bits, "-" if args.busy_core is None else args.busy_core,
          args.rounds, f"{best:.3f}", f"{med:.3f}", f"{best * 1e6 / args.numel:.3f}"]]))
    path = write_json("bench_optim_core", {
        "meta": meta, "args": vars(args), "core_step_ms": {"before": before, "after": after},
        "best_ms": best, "median_of_medians_ms": med, "rounds": rows})
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
