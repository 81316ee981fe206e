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
    assert "gpu_validate.sh build tests" in r.stdout and "sanitize" in r.stdout


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
