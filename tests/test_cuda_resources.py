"""The hot CUDA kernels' resources, read off nvcc without a GPU (issue 39).

cuda/optim.cu's optim_warp_kernel (every instantiation: the 8-bit and 4-bit steps people
run) and optim_fp32_kernel, and cuda/quant.cu's quantize and dequantize kernels, compiled
for sm_75 (the T4) and sm_90 (H100/H200) with the project's flags: none may spill to local
memory (a spill is a round trip to DRAM per element in a kernel meant to run at memory
speed), and each instantiation's registers per thread, shared memory and the resulting
blocks per SM are written to build/cuda-resources/<arch>.json and printed, so a change
that quietly costs occupancy shows in review.

Cost: the front end (nvcc -ptx) once per file and architecture, then ptxas on the hot
entries only (--entry), the two architectures in parallel: 75 s of CPU in all (measured
2026-11-28 on the 2-core development VM; 6 minutes of wall time there while other jobs
shared its cores, about 40 s on two free cores). Marked slow. Skips without nvcc.
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NVCC = shutil.which("nvcc")
pytestmark = pytest.mark.skipif(NVCC is None, reason="needs nvcc")

# the flags CMakeLists.txt gives these files (optim.cu: --fmad=false)
FLAGS = ["-O3", "--expt-relaxed-constexpr", "-std=c++17", f"-I{ROOT / 'csrc' / 'include'}", f"-I{ROOT / 'cuda'}"]
FILES = {"optim.cu": ["--fmad=false"], "quant.cu": []}
HOT = re.compile(r"optim_warp_kernel|optim_fp32_kernel|quantize_kernel|dequantize_kernel")
ARCHS = ("75", "90")
REGS_PER_SM = 65536


def _ptxas(arch: str, tmp: Path) -> list[dict]:
    ptxas = Path(NVCC).with_name("ptxas")
    rows = []
    for name, extra in FILES.items():
        ptx = tmp / f"{name}.{arch}.ptx"
        r = subprocess.run([NVCC, *FLAGS, *extra, f"-arch=compute_{arch}", "-ptx", str(ROOT / "cuda" / name),
                            "-o", str(ptx)], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr[-4000:]
        entries = [e for e in re.findall(r"^(?:\.visible\s+)?\.entry\s+(\w+)\(", ptx.read_text(), re.M) if HOT.search(e)]
        assert entries, f"{name}: no hot kernel found in the PTX"
        cmd = [str(ptxas), f"-arch=sm_{arch}", "-O3", "-v", str(ptx), "-o", str(tmp / f"{name}.{arch}.cubin")]
        for e in entries:
            cmd += ["-e", e]
        r = subprocess.run(cmd, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr[-4000:]
        rows += _parse(r.stderr + r.stdout, name, arch)
    return rows


def _parse(text: str, file: str, arch: str) -> list[dict]:
    rows, cur, spill = [], None, (0, 0)
    for line in text.splitlines():
        m = re.search(r"Compiling entry function '(\w+)'", line)
        if m:
            cur, spill = m.group(1), (0, 0)
            continue
        m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m and cur:
            spill = (int(m.group(1)), int(m.group(2)))
        m = re.search(r"Used (\d+) registers.*?(\d+) bytes smem", line)
        if m and cur:
            regs = int(m.group(1))
            rows.append({"file": file, "arch": f"sm_{arch}", "kernel": _demangle(cur), "registers": regs,
                         "smem_bytes": int(m.group(2)), "spill_stores": spill[0], "spill_loads": spill[1],
                         "blocks_per_sm_by_registers": REGS_PER_SM // (256 * regs) if regs else None})
            cur = None
    return rows


def _demangle(name: str) -> str:
    filt = shutil.which("c++filt")
    if filt is None:
        return name
    d = subprocess.run([filt, name], capture_output=True, text=True).stdout.strip() or name
    return re.sub(r"\(anonymous namespace\)::", "", d).split("(")[0].replace("void ", "")


@pytest.mark.slow
def test_hot_kernels_do_not_spill(tmp_path):
    with ThreadPoolExecutor(len(ARCHS)) as pool:
        per_arch = dict(zip(ARCHS, pool.map(lambda a: _ptxas(a, tmp_path), ARCHS)))
    out = ROOT / "build" / "cuda-resources"
    out.mkdir(parents=True, exist_ok=True)
    spilled = []
    for arch, rows in per_arch.items():
        (out / f"sm_{arch}.json").write_text(json.dumps(rows, indent=1))
        warp = [r for r in rows if "optim_warp_kernel" in r["kernel"]]
        assert len(warp) == 30, f"sm_{arch}: {len(warp)} optim_warp_kernel instantiations, expected 2 x 5 x 3"
        assert any("dequantize_kernel" in r["kernel"] for r in rows)
        for r in rows:
            print(f"sm_{arch} {r['kernel']:45s} {r['registers']:4d} regs {r['smem_bytes']:6d} B smem "
                  f"spills {r['spill_stores']}/{r['spill_loads']}")
            if r["spill_stores"] or r["spill_loads"]:
                spilled.append(f"sm_{arch} {r['kernel']}: {r['spill_stores']} B stored, {r['spill_loads']} B loaded")
    assert not spilled, "local-memory spills in hot kernels:\n" + "\n".join(spilled)
