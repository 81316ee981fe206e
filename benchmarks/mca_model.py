"""Model hot loops per microarchitecture with llvm-mca: cycles per loop iteration and per
8 / 16 elements on Zen 2/3/4, Skylake-SP, Ice Lake-SP and Sapphire Rapids.

A C source marks each loop to model with an inline-asm comment on either side of it
(the core's sources do it with MF_MCA_BEGIN/END of csrc/core/mca_mark.h, which expand
to nothing unless -DMEMFIT_MCA, so the library carries no markers):

    __asm__ volatile("# LLVM-MCA-BEGIN quant_lut_avx2 elems=8 isa=avx2" ::: "memory");
    for (...) { ... }                       // one loop: the region's hot loop
    __asm__ volatile("# LLVM-MCA-END" ::: "memory");

`elems` is how many elements one iteration of the loop handles; `isa` (generic, avx2,
avx512, avx512vbmi) is what the loop needs, so a CPU without it is skipped (default:
avx512 if the region touches zmm registers, else avx2). The script compiles the source
with gcc to assembly (the project's flags: -O3 -ffp-contract=off -fno-math-errno and
its include dirs), cuts out the loop between its label and its backward branch, and
feeds it to llvm-mca for each CPU. The number reported is llvm-mca's steady state,
total cycles / iterations, which assumes every load hits L1 and every branch is
predicted: a model of the core, not of memory.

    python benchmarks/mca_model.py               # mca_*.c here and the marked core loops
    python benchmarks/mca_model.py --source my.c --cflags "-mavx2 -mfma" --cpus znver3
    python benchmarks/mca_model.py --regions quant_lut_avx2 --show-asm

Prints a markdown table and writes benchmarks/out/mca_model.json (or --json PATH).
The newest llvm-mca on PATH is used (llvm-mca-19 knows znver4; Debian 12's default
llvm-mca 14 does not, and that CPU is then reported as unsupported).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CFLAGS = "-O3 -ffp-contract=off -fno-math-errno -fno-asynchronous-unwind-tables"
INCLUDE_DIRS = [ROOT / "csrc" / "include", ROOT / "csrc" / "core"]

# What each modelled CPU runs. Zen 2/3 have AVX2 and FMA only; Skylake-SP has AVX-512
# without the VBMI byte permutes; Ice Lake-SP, Sapphire Rapids and Zen 4 have VBMI.
CPU_ISAS = {
    "znver2": {"generic", "avx2"},
    "znver3": {"generic", "avx2"},
    "znver4": {"generic", "avx2", "avx512", "avx512vbmi"},
    "skylake-avx512": {"generic", "avx2", "avx512"},
    "icelake-server": {"generic", "avx2", "avx512", "avx512vbmi"},
    "sapphirerapids": {"generic", "avx2", "avx512", "avx512vbmi"},
}
ISAS = ("generic", "avx2", "avx512", "avx512vbmi")

BEGIN_RE = re.compile(r"#\s*LLVM-MCA-BEGIN\s+(.*\S)")
END_RE = re.compile(r"#\s*LLVM-MCA-END")
LABEL_RE = re.compile(r"^\s*([.\w$]+):")
JUMP_RE = re.compile(r"^\s*j[a-z]+\s+([.\w$]+)\s*$")


def default_sources() -> list:
    """benchmarks/c/mca_*.c (loops kept for comparison) and every core source that marks
    a loop with MF_MCA_BEGIN (csrc/core/mca_mark.h: the shipped loops themselves)."""
    core = [p for p in sorted((ROOT / "csrc" / "core").glob("*.c"))
            if "MF_MCA_BEGIN(" in p.read_text()]
    return sorted((ROOT / "benchmarks" / "c").glob("mca_*.c")) + core


def find_llvm_mca(explicit: str | None = None) -> str | None:
    """The llvm-mca to use: the one given, else the highest llvm-mca-NN on PATH, else
    plain llvm-mca."""
    if explicit:
        return shutil.which(explicit) or (explicit if Path(explicit).is_file() else None)
    best, best_ver = None, -1
    for d in os.environ.get("PATH", "").split(os.pathsep):
        try:
            names = os.listdir(d)
        except OSError:
            continue
        for name in names:
            m = re.fullmatch(r"llvm-mca-(\d+)", name)
            if m and int(m.group(1)) > best_ver and os.access(os.path.join(d, name), os.X_OK):
                best, best_ver = os.path.join(d, name), int(m.group(1))
    return best or shutil.which("llvm-mca")


def llvm_mca_version(mca: str) -> str:
    out = subprocess.run([mca, "--version"], capture_output=True, text=True).stdout
    m = re.search(r"LLVM version (\S+)", out)
    return m.group(1) if m else "unknown"


def compile_to_asm(source: Path, cflags: str, cc: str = "gcc") -> str:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "kernels.s"
        cmd = [cc, "-S", "-DMEMFIT_MCA", *shlex.split(cflags),
               *[f"-I{d}" for d in INCLUDE_DIRS], str(source), "-o", str(out)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise SystemExit(f"mca_model: compiling failed:\n{' '.join(cmd)}\n{r.stderr}")
        return out.read_text()


def parse_spec(spec: str) -> dict:
    """'name elems=8 isa=avx2' -> {'name': ..., 'elems': 8, 'isa': 'avx2'}."""
    parts = spec.split()
    info = {"name": parts[0], "elems": None, "isa": None}
    for p in parts[1:]:
        key, _, val = p.partition("=")
        if key == "elems":
            info["elems"] = int(val)
        elif key == "isa":
            if val not in ISAS:
                raise SystemExit(f"mca_model: region {parts[0]}: isa must be one of {ISAS}, got {val!r}")
            info["isa"] = val
    return info


def is_instruction(line: str) -> bool:
    s = line.strip()
    return bool(s) and not s.startswith((".", "#")) and not LABEL_RE.match(s)


def extract_loop(lines: list) -> list:
    """The hot loop of a region: from the label that the region's last backward branch
    targets to that branch (the whole region when it has no loop). Directives and
    comments go; labels stay (llvm-mca ignores them, they keep the listing readable)."""
    labels = {}
    loop = None
    for i, line in enumerate(lines):
        m = LABEL_RE.match(line)
        if m:
            labels[m.group(1)] = i
            continue
        j = JUMP_RE.match(line)
        if j and j.group(1) in labels:
            loop = (labels[j.group(1)], i)
    body = lines[loop[0]:loop[1] + 1] if loop else lines
    return [ln.rstrip() for ln in body if is_instruction(ln) or LABEL_RE.match(ln)]


def extract_regions(asm: str) -> list:
    """Every BEGIN/END region of the assembly, in order; a region that gcc emitted more
    than once (inlined into two callers) keeps its first copy."""
    regions, seen, cur = [], set(), None
    for line in asm.splitlines():
        if cur is None:
            m = BEGIN_RE.search(line)
            if m:
                cur = dict(parse_spec(m.group(1)), lines=[])
            continue
        if END_RE.search(line):
            if cur["name"] not in seen:
                seen.add(cur["name"])
                cur["loop"] = extract_loop(cur.pop("lines"))
                if cur["isa"] is None:
                    text = "\n".join(cur["loop"])
                    cur["isa"] = "avx512" if "%zmm" in text or re.search(r"%k[1-7]", text) else "avx2"
                regions.append(cur)
            cur = None
            continue
        cur["lines"].append(line)
    return regions


def run_mca(mca: str, cpu: str, loop: list, iterations: int) -> dict:
    """llvm-mca's summary for one loop on one CPU: cycles per iteration (total cycles /
    iterations), block reciprocal throughput, uops per iteration; or {'error': ...}."""
    with tempfile.NamedTemporaryFile("w", suffix=".s", delete=False) as f:
        f.write("\n".join(loop) + "\n")
        path = f.name
    try:
        r = subprocess.run([mca, f"-mcpu={cpu}", f"-iterations={iterations}", path],
                           capture_output=True, text=True)
    finally:
        os.unlink(path)
    if "not a recognized processor" in r.stderr:
        return {"error": "cpu unknown to this llvm-mca"}
    if r.returncode != 0:
        return {"error": (r.stderr.strip().splitlines() or ["llvm-mca failed"])[0]}

    def num(label):
        m = re.search(rf"^{label}:\s+([\d.]+)", r.stdout, re.M)
        return float(m.group(1)) if m else None

    total, iters = num("Total Cycles"), num("Iterations")
    if not total or not iters:
        return {"error": "could not parse llvm-mca output"}
    return {"cycles_per_iter": total / iters, "block_rthroughput": num("Block RThroughput"),
            "uops_per_iter": (num("Total uOps") or 0) / iters, "ipc": num("IPC")}


def model(sources: list, cflags: str, cpus: list, regions: list | None, iterations: int,
          mca: str) -> dict:
    found = []
    for src in sources:
        for reg in extract_regions(compile_to_asm(src, cflags)):
            if any(r["name"] == reg["name"] for r in found):
                raise SystemExit(f"mca_model: region {reg['name']} is marked twice ({src})")
            found.append(dict(reg, source=str(Path(src).resolve().relative_to(ROOT))
                              if Path(src).resolve().is_relative_to(ROOT) else str(src)))
    if regions:
        missing = set(regions) - {r["name"] for r in found}
        if missing:
            raise SystemExit(f"mca_model: no region named {sorted(missing)} in {sources}")
        found = [r for r in found if r["name"] in regions]
    if not found:
        raise SystemExit(f"mca_model: no LLVM-MCA-BEGIN/END regions in {sources}")
    for reg in found:
        reg["results"] = {}
        for cpu in cpus:
            if reg["isa"] not in CPU_ISAS.get(cpu, set(ISAS)):
                reg["results"][cpu] = {"skipped": f"{cpu} has no {reg['isa']}"}
            else:
                reg["results"][cpu] = run_mca(mca, cpu, reg["loop"], iterations)
    return {"sources": [str(s) for s in sources], "cflags": cflags, "llvm_mca": mca,
            "llvm_version": llvm_mca_version(mca), "iterations": iterations, "regions": found}


def cell(res: dict, elems: int | None, per: int | None) -> str:
    if "cycles_per_iter" not in res:
        return "-" if "skipped" in res else "n/a"
    c = res["cycles_per_iter"]
    if per and elems:
        return f"{c * per / elems:.2f}"
    return f"{c:.2f}"


def table(result: dict, cpus: list, per: int | None) -> str:
    """Regions x CPUs: cycles per loop iteration (per=None) or per `per` elements."""
    head = ["region", "isa", "elems/iter"] + cpus
    rows = [[reg["name"], reg["isa"], reg["elems"] or "?"]
            + [cell(reg["results"][c], reg["elems"], per) for c in cpus]
            for reg in result["regions"]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(str(x) for x in r) + " |" for r in rows]
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--source", type=Path, nargs="+", default=None,
                   help="C files (default: benchmarks/c/mca_*.c and the marked csrc/core/*.c)")
    p.add_argument("--cflags", default="", help=f"added to the defaults: {DEFAULT_CFLAGS}")
    p.add_argument("--cpus", nargs="+", default=list(CPU_ISAS))
    p.add_argument("--regions", nargs="+", default=None, help="only these regions")
    p.add_argument("--iterations", type=int, default=200)
    p.add_argument("--llvm-mca", default=None, help="path or name (default: newest on PATH)")
    p.add_argument("--json", type=Path, default=None,
                   help="default benchmarks/out/mca_model.json")
    p.add_argument("--per", type=int, default=16, help="elements for the second table (8 or 16)")
    p.add_argument("--show-asm", action="store_true", help="print each modelled loop")
    args = p.parse_args(argv)

    mca = find_llvm_mca(args.llvm_mca)
    if not mca:
        raise SystemExit("mca_model: llvm-mca not found (Debian/Ubuntu: apt-get install llvm)")
    cflags = f"{DEFAULT_CFLAGS} {args.cflags}".strip()
    sources = args.source or default_sources()
    result = model(sources, cflags, args.cpus, args.regions, args.iterations, mca)
    result["cpus"] = args.cpus

    print(f"llvm-mca {result['llvm_version']} ({mca}); gcc {cflags}; sources {' '.join(str(s) for s in sources)}")
    print("modelled, not measured: steady-state cycles of the loop with every load in L1; "
          "'-' = CPU lacks the region's ISA, n/a = llvm-mca error (see JSON)")
    if args.show_asm:
        for reg in result["regions"]:
            print(f"\n## {reg['name']} ({len(reg['loop'])} lines)\n" + "\n".join(reg["loop"]))
    print("\ncycles per loop iteration")
    print(table(result, args.cpus, None))
    print(f"\ncycles per {args.per} elements")
    print(table(result, args.cpus, args.per))
    out = args.json
    if out is None:
        out = ROOT / "benchmarks" / "out" / "mca_model.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {out}")
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
