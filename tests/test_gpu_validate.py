"""benchmarks/gpu_validate.sh, the runner of issue 18's GPU checks: it only ever runs
where a GPU is lent, so its syntax, its argument checks and its stop after a failed build
are checked here, where a mistake would otherwise surface in the middle of a device
session."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_validate.sh"

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def run(*args, out, **env):
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True,
                          env={**os.environ, "OUT": str(out), **env}, timeout=300)


def test_parses():
    r = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_usage_without_stages(tmp_path):
    r = run(out=tmp_path)
    assert r.returncode == 2
    assert "gpu_validate.sh build tests" in r.stdout and "sanitize" in r.stdout and "build perf" in r.stdout


def test_unknown_stage_runs_nothing(tmp_path):
    r = run("build", "tset", out=tmp_path)
    assert r.returncode == 2
    assert "unknown stage: tset" in r.stderr
    assert not any(tmp_path.iterdir()), "no stage may run before every name is checked"


def test_stops_after_a_build_that_cannot_run(tmp_path):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the build stage would build")
    env = {k: v for k, v in os.environ.items() if k != "MEMFIT_CUDA_ARCHS"}
    r = subprocess.run(["bash", str(SCRIPT), "build", "tests"], capture_output=True, text=True,
                       env={**env, "OUT": str(tmp_path)}, timeout=300)
    assert r.returncode == 1
    assert "| build | FAILED (no GPU) |" in r.stdout
    assert not (tmp_path / "tests.log").exists(), "tests must not run on a failed build"


@pytest.mark.slow
def test_perf_stage_dry_run(tmp_path):
    """The perf stage (issue 39) end to end on the CPU: gpu_perf.py --dry-run checks every
    memfit kernel it times bit for bit (CPU against CPU here), times the rows, prints the
    table last and writes the JSON the GPU run will write."""
    pytest.importorskip("torch")
    import json
    import sys

    import memfit

    # memfit where this process found it: the source tree with its build, or site-packages
    found = str(Path(memfit.__file__).resolve().parent.parent)
    env = {"GPU_PERF_DRY_RUN": "1", "PYTHON": sys.executable,
           "PYTHONPATH": os.pathsep.join([found, os.environ.get("PYTHONPATH", "")])}
    r = run("perf", out=tmp_path, **env)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert "| row | ms | GB/s | % of copy | x torch fused |" in r.stdout
    assert "| gpu_perf --dry-run | ok |" in r.stdout
    result = json.loads((tmp_path / "gpu_perf.json").read_text())
    assert result["meta"]["dry_run"] is True and result["checks"]
    assert all(result["checks"].values()), result["checks"]
    rows = {x["row"]: x for x in result["rows"]}
    for name in ("copy D2D (16 B/param)", "memfit AdamW8bit fp32", "memfit AdamW4bit bf16 SR",
                 "memfit Lion8bit fp32", "memfit Muon8bit momentum fp32", "memfit AdamW8bit fp32 model layout",
                 "torch AdamW fused fp32", "quantize block 4096", "dequantize block 256"):
        assert rows[name]["ms"] > 0 and rows[name]["GB_per_s"] > 0, name
    assert rows["copy D2D (16 B/param)"]["fraction_of_copy"] == 1.0
    assert rows["memfit AdamW8bit fp32"]["x_torch_fused"] > 0
    assert not (tmp_path / "gpu_perf_ncu.ncu-rep").exists()  # no profile in a dry run
