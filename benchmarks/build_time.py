"""How long nvcc takes to compile one of memfit's CUDA files for the default architecture
list, one architecture after another (nvcc's default) and in parallel (`--threads 0`, what
CMakeLists.txt passes since issue 41). Prints a table, writes benchmarks/out/build_time.json.

    python benchmarks/build_time.py                     # cuda/optim.cu, 1 round
    python benchmarks/build_time.py --source cuda/unscale.cu --rounds 3

Not run by run_all.py: it times the toolchain, not memfit, and takes minutes of CPU. The
flags are CMakeLists.txt's for cuda/optim.cu (-O3, C++17, --fmad=false) and the gencode
options CMake derives from cmake/memfit_cuda_archs.cmake's default list. Wall time falls
with --threads only where cores are idle: the CPU time (user + sys of nvcc and its
children) shows the work, the load average says how busy the machine was.
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import markdown_table, metadata, write_json  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def default_archs() -> list:
    text = (ROOT / "cmake" / "memfit_cuda_archs.cmake").read_text()
    return re.search(r'set\(MEMFIT_DEFAULT_CUDA_ARCHS "([^"]+)"\)', text).group(1).split(";")


def gencode(archs: list) -> list:
    """CMake's --generate-code options for CMAKE_CUDA_ARCHITECTURES entries."""
    out = []
    for a in archs:
        num = re.match(r"\d+[af]?", a).group(0)
        codes = [f"sm_{num}"] if a.endswith("-real") else [f"compute_{num}"] if a.endswith("-virtual") \
            else [f"compute_{num}", f"sm_{num}"]
        out.append(f"--generate-code=arch=compute_{num},code=[{','.join(codes)}]")
    return out


def compile_once(nvcc: str, source: Path, archs: list, threads: bool) -> dict:
    cmd = [nvcc, "-O3", "-std=c++17", "--expt-relaxed-constexpr", "--fmad=false", "-Xcompiler=-fPIC",
           "-DMEMFIT_WITH_CUDA", f"-I{ROOT / 'csrc' / 'include'}", *gencode(archs),
           *(["--threads", "0"] if threads else []), "-x", "cu", "-c", str(source)]
    with tempfile.TemporaryDirectory() as tmp:
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        load = os.getloadavg()[0]
        t0 = time.perf_counter()
        subprocess.run([*cmd, "-o", str(Path(tmp) / "out.o")], check=True)
        wall = time.perf_counter() - t0
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"wall_s": wall, "cpu_s": cpu, "load_before": load, "load_after": os.getloadavg()[0]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--source", default="cuda/optim.cu")
    ap.add_argument("--rounds", type=int, default=1)
    args = ap.parse_args(argv)
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        print("build_time: no nvcc on PATH: nothing to measure")
        return 0
    version = re.search(r"release ([\d.]+)", subprocess.run([nvcc, "--version"], capture_output=True,
                                                              text=True).stdout).group(1)
    archs = default_archs()
    source = ROOT / args.source
    runs = {"one after another": [], "--threads 0": []}
    for _ in range(args.rounds):  # interleaved: both see the same machine, round by round
        runs["one after another"].append(compile_once(nvcc, source, archs, threads=False))
        runs["--threads 0"].append(compile_once(nvcc, source, archs, threads=True))
    meta = metadata("cpu")
    print(f"# {args.source}, nvcc {version}, archs {';'.join(archs)}; {meta['cpu_model']}, "
          f"{meta['cores']} cores, commit {meta['commit']}, {meta['date']}")
    rows = []
    base = statistics.median(r["wall_s"] for r in runs["one after another"])
    for name, rs in runs.items():
        wall = statistics.median(r["wall_s"] for r in rs)
        rows.append([name, f"{wall:.0f}", f"{statistics.median(r['cpu_s'] for r in rs):.0f}",
                     f"{base / wall:.2f}",
                     " / ".join(f"{r['load_before']:.1f}-{r['load_after']:.1f}" for r in rs)])
    print(markdown_table(["nvcc", "wall s (median)", "CPU s", "speed-up", "load average before-after"], rows))
    path = write_json("build_time", {"meta": meta, "nvcc": version, "source": args.source,
                                     "archs": archs, "runs": runs})
    print(f"\nJSON: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
