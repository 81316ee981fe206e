"""Builds the C core's own tests (tests/c/test_*.c, no Python involved) with CMake
under AddressSanitizer + UndefinedBehaviorSanitizer and runs them with ctest.

The core is compiled CPU-only here: the sanitizers instrument C code; the CUDA
kernels are covered by the `cuda`-marked tests on a GPU machine."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _tool(name):
    path = shutil.which(name)
    if path is None:
        if os.environ.get("CI"):
            pytest.fail(f"{name} is required in CI (pip install -r requirements-test.txt)")
        pytest.skip(f"{name} not installed")
    return path


@pytest.mark.skipif(not (ROOT / "CMakeLists.txt").exists(), reason="needs the source tree")
def test_c_core_under_sanitizers(tmp_path):
    cmake, ctest = _tool("cmake"), _tool("ctest")
    configure = [cmake, "-S", str(ROOT), "-B", str(tmp_path), "-DMEMFIT_PYTHON=OFF",
                 "-DMEMFIT_CUDA=OFF", "-DMEMFIT_BUILD_TESTS=ON", "-DMEMFIT_SANITIZE=ON",
                 "-DCMAKE_BUILD_TYPE=Debug"]
    if shutil.which("ninja"):
        configure += ["-G", "Ninja"]
    subprocess.run(configure, check=True, capture_output=True, text=True)
    build = subprocess.run([cmake, "--build", str(tmp_path), "-j2"], capture_output=True, text=True)
    assert build.returncode == 0, build.stdout + build.stderr
    # once per CPU variant (the ones this CPU lacks fall back to the widest it has): the
    # table search is checked against the binary search in each of its vector forms
    for isa in ("avx512vbmi", "avx512", "avx2", "generic"):
        env = dict(os.environ, ASAN_OPTIONS="detect_leaks=1:abort_on_error=0",
                   UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1", OMP_NUM_THREADS="2",
                   MEMFIT_CPU_ISA=isa)
        run = subprocess.run([ctest, "--output-on-failure"], cwd=tmp_path, capture_output=True,
                             text=True, env=env)
        assert run.returncode == 0, f"MEMFIT_CPU_ISA={isa}\n" + run.stdout + run.stderr
        assert "tests passed" in run.stdout


@pytest.mark.skipif(not (ROOT / "CMakeLists.txt").exists(), reason="needs the source tree")
def test_c_optimizer_benchmark_builds_and_runs(tmp_path):
    """benchmarks/c/bench_optim_step.c (driven by benchmarks/bench_optim_core.py) builds
    against the core and reports sane timings for 8- and 4-bit states; bad arguments
    get a usage error, not a crash."""
    import json

    cmake = _tool("cmake")
    configure = [cmake, "-S", str(ROOT), "-B", str(tmp_path), "-DMEMFIT_PYTHON=OFF",
                 "-DMEMFIT_CUDA=OFF", "-DMEMFIT_BUILD_BENCHMARKS=ON", "-DCMAKE_BUILD_TYPE=Release"]
    if shutil.which("ninja"):
        configure += ["-G", "Ninja"]
    subprocess.run(configure, check=True, capture_output=True, text=True)
    build = subprocess.run([cmake, "--build", str(tmp_path), "--target", "bench_optim_step", "-j2"],
                           capture_output=True, text=True)
    assert build.returncode == 0, build.stdout + build.stderr
    exe = str(tmp_path / "bench_optim_step")
    for bits in (8, 4):
        out = subprocess.run([exe, "70000", "2", "2", "3", str(bits)], capture_output=True,
                             text=True, check=True).stdout
        r = json.loads(out)
        assert (r["numel"], r["threads"], r["bits"]) == (70000, 2, bits)
        assert 0 < r["best_ms"] <= r["median_ms"]
    bad = subprocess.run([exe, "70000", "2", "2", "3", "5"], capture_output=True, text=True)
    assert bad.returncode == 2 and "BITS 8 or 4" in bad.stderr
    assert subprocess.run([exe], capture_output=True, text=True).returncode == 2


def test_c_optimizer_benchmark_against_a_revision(tmp_path, monkeypatch):
    """bench_optim_core.py --against REV builds the core of REV too and compares the two
    round by round: here REV is HEAD, so both builds run and REV's own ratio is 1; a
    name that is not a commit is refused before anything is built."""
    import json

    _tool("cmake")
    if shutil.which("git") is None or subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True).returncode:
        pytest.skip("not a git checkout")
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import _common
    import bench_optim_core

    monkeypatch.setattr(_common, "OUT_DIR", tmp_path)
    monkeypatch.setattr(bench_optim_core, "OUT_DIR", tmp_path)
    with pytest.raises(SystemExit, match="not a commit"):
        bench_optim_core.main(["--against", "no-such-revision-7f3e"])
    bench_optim_core.main(["--against", "HEAD", "--numel", "70000", "--threads", "1",
                           "--rounds", "2", "--reps", "1", "--steps", "2"])
    builds = json.loads((tmp_path / "bench_optim_core.json").read_text())["builds"]
    assert len(builds) == 2
    (this,) = [v for k, v in builds.items() if k.startswith("this tree")]
    (rev,) = [v for k, v in builds.items() if not k.startswith("this tree")]
    assert rev["ratio_vs_against"] == {"median": 1.0, "q1": 1.0, "q3": 1.0}
    assert 0 < this["ratio_vs_against"]["median"] < 100
    for b in (this, rev):
        assert len(b["rounds"]) == 2 and 0 < b["best_ms"] <= b["median_of_medians_ms"]
