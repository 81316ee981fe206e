"""Regenerate benchmarks/RESULTS.md by running every benchmark script.

Each benchmark prints its run metadata (machine, commit, date, threads) and a markdown
table; this script runs them one after another (never in parallel: they time things),
and writes their output into RESULTS.md under one section each, with the command that
reproduces it. GPU rows appear only when the machine has a GPU. It replaces the whole
file: move the sections it replaces to history/ first (history/README.md).

    python benchmarks/run_all.py                   # all benchmarks
    python benchmarks/run_all.py bench_quant        # only some
"""

from __future__ import annotations

import argparse
import datetime
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
INTRO = """# Benchmark results

Numbers measured by the scripts in this folder; regenerate with
`python benchmarks/run_all.py`. Every table says the machine, the commit and the date
it came from. Peers run in the same process, interleaved, medians of repeated runs,
so ratios hold up better than absolute times on a shared machine. GPU numbers appear
only where a GPU was measured: a missing GPU table means it is still owed.

This file holds today's numbers: for each capability, the latest measurement on each
machine. How they came about (every session's attempts, what helped and what did not,
the llvm-mca models) is in [history/](history/README.md), one file per session, moved
there unchanged.
"""


def discover():
    return sorted(p.stem for p in HERE.glob("bench_*.py"))


def run_one(name: str, extra: list) -> str:
    cmd = [sys.executable, str(HERE / f"{name}.py"), *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    body = proc.stdout.strip()
    if proc.returncode != 0:
        body += f"\n\n(failed with exit code {proc.returncode})\n```\n{proc.stderr.strip()[-2000:]}\n```"
    return body


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("names", nargs="*", help="benchmark scripts to run (default: all)")
    p.add_argument("--output", default=str(HERE / "RESULTS.md"))
    args = p.parse_args(argv)
    names = args.names or discover()
    sections = [INTRO, f"_Generated {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC._\n"]
    for i, name in enumerate(names, 1):
        print(f"[{i}/{len(names)}] {name} ...", file=sys.stderr, flush=True)
        body = run_one(name, [])
        sections.append(f"## {name}\n\n`python benchmarks/{name}.py`\n\n{body}\n")
    Path(args.output).write_text("\n".join(sections))
    print(f"wrote {args.output}", file=sys.stderr)


if __name__ == "__main__":
    main()
