"""The CPU optimizer step with no Python in the way, and how fast each core runs it.

    python benchmarks/bench_optim_core.py                  # 16M params, 2 threads, 8 rounds
    python benchmarks/bench_optim_core.py --busy-core 1    # with a busy loop pinned to cpu1
    python benchmarks/bench_optim_core.py --bits 4 --numel 1048576 --threads 1
    python benchmarks/bench_optim_core.py --against 2c8a155 --numel 65536 --threads 1 --steps 20 --rounds 20

Builds benchmarks/c/bench_optim_step.c against the C core with CMake (CPU only,
Release, into benchmarks/out/core_build), then
  1. per-core speed: a single-thread AdamW8bit step over 262144 params pinned to each
     core in turn (best of 20 steps). On shared machines the cores need not run at the
     same speed, which a compute-bound step feels;
  2. the step itself: --rounds processes, each timing --reps repetitions of --steps (3)
     back-to-back steps; we report the best time and the median of the processes' medians;
  3. the per-core check again, since the machine may have changed meanwhile.
`--busy-core N` runs a busy loop pinned to core N during step 2 (an uneven machine on
purpose: what dynamic work sharing is for).

`--against REV` builds the same C benchmark against the core of git revision REV too
(exported into benchmarks/out/against_REV; REV must have the MEMFIT_BUILD_BENCHMARKS
option, 230a97f or later) and runs the two in every round, in random order. On a shared
machine whose cores change speed from minute to minute, comparing the two builds round
by round is what separates a change of a few percent from the machine's swings: the
table adds, per build, the median over rounds of (this build's best / REV's best in the
same round) with its quartiles. With --threads 1 the step is pinned to the first core.

Prints a markdown table and writes benchmarks/out/bench_optim_core.json. Needs cmake and
a C compiler (and git for --against).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tarfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import OUT_DIR, Progress, markdown_table, metadata, per_core_line, write_json  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def build(src: Path = ROOT, out: Path = OUT_DIR / "core_build") -> Path:
    cmake = shutil.which("cmake")
    if cmake is None:
        sys.exit("cmake not found (pip install cmake)")
    cfg = [cmake, "-S", str(src), "-B", str(out), "-DMEMFIT_PYTHON=OFF", "-DMEMFIT_CUDA=OFF",
           "-DMEMFIT_BUILD_BENCHMARKS=ON", "-DCMAKE_BUILD_TYPE=Release"]
    if shutil.which("ninja"):
        cfg += ["-G", "Ninja"]
    for cmd in (cfg, [cmake, "--build", str(out), "--target", "bench_optim_step", "-j2"]):
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode:
            sys.exit(r.stdout + r.stderr)
    return out / "bench_optim_step"


def export_revision(rev: str) -> tuple[Path, str]:
    """REV's tree (git archive) in benchmarks/out/against_<commit>, with this tree's C
    benchmark source in it, so that both builds time the same driver."""
    r = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", f"{rev}^{{commit}}"],
                       capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"--against: {rev!r} is not a commit of this repository ({r.stderr.strip()})")
    commit = r.stdout.strip()
    dest = OUT_DIR / f"against_{commit}"
    if not (dest / "CMakeLists.txt").exists():
        tar = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", commit],
                             capture_output=True, check=True).stdout
        with tarfile.open(fileobj=io.BytesIO(tar)) as t:
            if hasattr(tarfile, "data_filter"):  # Python 3.12+ (and 3.11.4+): no links out of dest
                t.extractall(dest, filter="data")
            else:
                t.extractall(dest)
    if "MEMFIT_BUILD_BENCHMARKS" not in (dest / "CMakeLists.txt").read_text():
        sys.exit(f"--against: {commit} predates the C benchmark (MEMFIT_BUILD_BENCHMARKS, 230a97f)")
    bench = dest / "benchmarks" / "c"
    bench.mkdir(parents=True, exist_ok=True)
    shutil.copy(ROOT / "benchmarks" / "c" / "bench_optim_step.c", bench / "bench_optim_step.c")
    return dest, commit


def run(exe: Path, numel: int, threads: int, reps: int, bits: int, cpu: int | None = None,
        steps: int = 3) -> dict:
    pin = (lambda: os.sched_setaffinity(0, {cpu})) if cpu is not None else None
    r = subprocess.run([str(exe), str(numel), str(threads), str(steps), str(reps), str(bits)],
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
    ap.add_argument("--bits", type=int, choices=(32, 8, 4), default=8)
    ap.add_argument("--rounds", type=int, default=8, help="processes (each a fresh start)")
    ap.add_argument("--reps", type=int, default=5, help="timed repetitions per process")
    ap.add_argument("--steps", type=int, default=3,
                    help="back-to-back steps per repetition (more for small --numel)")
    ap.add_argument("--busy-core", type=int, default=None)
    ap.add_argument("--against", metavar="REV", default=None,
                    help="also build the core of this git revision; compare round by round")
    args = ap.parse_args(argv)
    if min(args.rounds, args.reps, args.steps, args.numel, args.threads) < 1:
        ap.error("--rounds, --reps, --steps, --numel and --threads must be positive")

    meta = metadata("cpu")
    against = export_revision(args.against) if args.against else None
    exes = {f"this tree ({meta['commit']})": build()}
    if against:
        src, commit = against
        exes[commit] = build(src, OUT_DIR / f"against_{commit}_build")
    names = list(exes)
    exe = exes[names[0]]
    # with one thread, pin the step (the per-core check says how fast that core runs)
    pin = min(os.sched_getaffinity(0)) if args.threads == 1 and hasattr(os, "sched_getaffinity") else None
    before = core_speeds(exe)
    busy = None
    if args.busy_core is not None:
        busy = subprocess.Popen([sys.executable, "-c", "while True: pass"],
                                preexec_fn=lambda: os.sched_setaffinity(0, {args.busy_core}))
    bar = Progress(args.rounds, "rounds")
    rows = {n: [] for n in names}
    try:
        for _ in range(args.rounds):
            for n in random.sample(names, len(names)):
                rows[n].append(run(exes[n], args.numel, args.threads, args.reps, args.bits, cpu=pin,
                                   steps=args.steps))
            bar.step("  ".join(f"{rows[n][-1]['best_ms']:.2f}" for n in names) + " ms")
    finally:
        if busy is not None:
            busy.kill()
            busy.wait()
    after = core_speeds(exe)
    print(f"cpu: {meta['cpu']}, {meta['cores']} cores, commit {meta['commit']}, {meta['date']}")
    print(per_core_line(before, after))
    table, summary = [], {}
    for n in names:
        best = min(r["best_ms"] for r in rows[n])
        med = statistics.median(r["median_ms"] for r in rows[n])
        summary[n] = {"best_ms": best, "median_of_medians_ms": med, "rounds": rows[n]}
        row = [n, args.numel, args.threads, args.bits,
               "-" if args.busy_core is None else args.busy_core, args.rounds, f"{best:.3f}",
               f"{med:.3f}", f"{best * 1e6 / args.numel:.3f}"]
        if args.against:
            ratios = [a["best_ms"] / b["best_ms"] for a, b in zip(rows[n], rows[names[-1]])]
            q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
            summary[n]["ratio_vs_against"] = {"median": statistics.median(ratios),
                                              "q1": q[0], "q3": q[2]}
            row.append(f"{statistics.median(ratios):.3f} ({q[0]:.3f}-{q[2]:.3f})")
        table.append(row)
    header = ["build", "numel", "threads", "bits", "busy core", "rounds", "best ms",
              "median of medians ms", "ns / param (best)"]
    if args.against:
        header.append(f"x {names[-1]}'s time, same round: median (quartiles)")
    print(markdown_table(header, table))
    path = write_json("bench_optim_core", {
        "meta": meta, "args": vars(args), "core_step_ms": {"before": before, "after": after},
        "builds": summary})
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
