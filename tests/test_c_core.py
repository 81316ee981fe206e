"""Builds the C core's own tests (tests/c/test_*.c, no Python involved) and the C
optimizer benchmark ONCE with CMake, under AddressSanitizer + UndefinedBehaviorSanitizer,
and runs the tests with ctest: those linked with the CPU kernel selection once for every
CPU kernel variant, the others once; and the benchmark tooling at tiny sizes against
that same build.

The core is compiled CPU-only here: the sanitizers instrument C code; the CUDA
kernels are covered by the `cuda`-marked tests on a GPU machine."""

import json
import os
import shutil
import statistics
import sys
from pathlib import Path

import pytest

import proc_util

ROOT = Path(__file__).resolve().parents[1]

# The CPU kernel variants MEMFIT_CPU_ISA selects (the ones this CPU lacks fall back to
# the widest it has): the C tests run once per variant, so the table search is checked
# against the binary search in each of its vector forms.
CPU_VARIANTS = ("avx512vbmi", "avx512", "avx2", "generic")

pytestmark = pytest.mark.skipif(not (ROOT / "CMakeLists.txt").exists(), reason="needs the source tree")


def _tool(name):
    path = shutil.which(name)
    if path is None:
        if os.environ.get("CI"):
            pytest.fail(f"{name} is required in CI (pip install -r requirements-test.txt)")
        pytest.skip(f"{name} not installed")
    return path


@pytest.fixture(scope="module")
def core_build(tmp_path_factory):
    """One sanitized Debug build of the core, its C tests and its C benchmark. Debug
    info is line tables only (-g1): the sanitizers' reports still name file and line,
    and full -g takes the vector kernels' compile time up by two thirds."""
    cmake = _tool("cmake")
    out = tmp_path_factory.mktemp("core_build")
    configure = [cmake, "-S", str(ROOT), "-B", str(out), "-DMEMFIT_PYTHON=OFF",
                 "-DMEMFIT_CUDA=OFF", "-DMEMFIT_BUILD_TESTS=ON", "-DMEMFIT_BUILD_BENCHMARKS=ON",
                 "-DMEMFIT_SANITIZE=ON", "-DCMAKE_BUILD_TYPE=Debug", "-DCMAKE_C_FLAGS_DEBUG=-g1"]
    if shutil.which("ninja"):
        configure += ["-G", "Ninja"]
    proc_util.run(configure, check=True, capture_output=True, text=True)
    build = proc_util.run([cmake, "--build", str(out), "-j2"], capture_output=True, text=True)
    assert build.returncode == 0, build.stdout + build.stderr
    return out


SANITIZER_ENV = {"ASAN_OPTIONS": "detect_leaks=1:abort_on_error=0",
                 "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1"}


def _variant_run(isa):
    """The variant the core picks on this CPU when asked for `isa` (memfit.cpu_kernels()
    of the installed module, the same selection code)."""
    code = "import memfit; print(memfit.cpu_kernels())"
    r = proc_util.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env=dict(os.environ, MEMFIT_CPU_ISA=isa))
    return r.stdout.strip() if r.returncode == 0 else None


C_TESTS = sorted(p.stem for p in (ROOT / "tests" / "c").glob("test_*.c"))


@pytest.fixture(scope="module")
def isa_tests(core_build):
    """The C tests that MEMFIT_CPU_ISA can change: those whose executable links the
    core's CPU kernel selection (cpu_isa.c, the only reader of MEMFIT_CPU_ISA; the core
    is a static library, so an executable holds only the objects it calls into). The
    others run the same code under every variant: they run once. Without nm, all of
    them are taken."""
    nm = shutil.which("nm")
    if nm is None:
        return C_TESTS
    linked = []
    for name in C_TESTS:
        symbols = proc_util.run([nm, "--defined-only", str(core_build / name)], capture_output=True,
                                 text=True, check=True).stdout.split()
        if "mf_cpu_isa" in symbols:
            linked.append(name)
    # the optimizer's and the quantizer's tests are the ones the variants exist for
    assert {"test_optim", "test_quant"} <= set(linked), linked
    return linked


def _ctest(core_build, names, **env):
    ctest = _tool("ctest")
    env = dict(os.environ, **SANITIZER_ENV, OMP_NUM_THREADS="2", **env)
    regex = "^(" + "|".join(names) + ")$"
    run = proc_util.run([ctest, "--output-on-failure", "-R", regex], cwd=core_build,
                         capture_output=True, text=True, env=env)
    assert run.returncode == 0, f"{env.get('MEMFIT_CPU_ISA')}\n" + run.stdout + run.stderr
    assert "100% tests passed" in run.stdout
    assert f"out of {len(names)}" in run.stdout, run.stdout  # every named test ran


@pytest.mark.parametrize("isa", CPU_VARIANTS)
def test_c_core_under_sanitizers(core_build, isa_tests, isa):
    ran = _variant_run(isa)
    if ran != isa and ran in CPU_VARIANTS:  # falls back to a variant that has its own run
        pytest.skip(f"this CPU runs the {ran} kernels for MEMFIT_CPU_ISA={isa}: covered there")
    _ctest(core_build, isa_tests, MEMFIT_CPU_ISA=isa)


def test_c_core_under_sanitizers_isa_independent(core_build, isa_tests):
    """The C tests that do not link the CPU kernel selection, once."""
    rest = [name for name in C_TESTS if name not in isa_tests]
    if not rest:
        pytest.skip("every C test links the CPU kernel selection: run per variant above")
    _ctest(core_build, rest)


def test_c_optimizer_benchmark_builds_and_runs(core_build):
    """benchmarks/c/bench_optim_step.c (driven by benchmarks/bench_optim_core.py) builds
    against the core and reports consistent timings for 8- and 4-bit states; bad
    arguments get a usage error, not a crash."""
    exe = str(core_build / "bench_optim_step")
    env = dict(os.environ, **SANITIZER_ENV)
    for bits in (32, 8, 4):
        out = proc_util.run([exe, "9000", "2", "2", "3", str(bits)], capture_output=True,
                             text=True, check=True, env=env).stdout
        r = json.loads(out)
        assert (r["numel"], r["threads"], r["bits"]) == (9000, 2, bits)
        assert 0 < r["best_ms"] <= r["median_ms"]
    bad = proc_util.run([exe, "9000", "2", "2", "3", "5"], capture_output=True, text=True, env=env)
    assert bad.returncode == 2 and "BITS 32, 8 or 4" in bad.stderr
    assert proc_util.run([exe], capture_output=True, text=True, env=env).returncode == 2


def test_c_optimizer_benchmark_against_a_revision(core_build, tmp_path, monkeypatch):
    """bench_optim_core.py --against REV exports REV's tree with this tree's benchmark
    driver in it, runs both builds round by round and reports, per build, the median
    over rounds of its best time over REV's best in the same round. The CMake build of
    each tree is replaced by the one shared build here (tests/test_c_core.py builds it;
    the tool's own build is the same CMake call); REV is HEAD. A name that is not a
    commit is refused before anything is built."""
    monkeypatch.setenv("ASAN_OPTIONS", SANITIZER_ENV["ASAN_OPTIONS"])
    if shutil.which("git") is None or proc_util.run(
            ["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True).returncode:
        pytest.skip("not a git checkout")
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import _common
    import bench_optim_core

    built = []

    def shared_build(src=ROOT, out=None):
        built.append(Path(src))
        return core_build / "bench_optim_step"

    monkeypatch.setattr(_common, "OUT_DIR", tmp_path)
    monkeypatch.setattr(bench_optim_core, "OUT_DIR", tmp_path)
    monkeypatch.setattr(bench_optim_core, "build", shared_build)
    monkeypatch.setattr(bench_optim_core, "core_speeds", lambda exe: {})
    with pytest.raises(SystemExit, match="not a commit"):
        bench_optim_core.main(["--against", "no-such-revision-7f3e"])
    assert built == []
    bench_optim_core.main(["--against", "HEAD", "--numel", "5000", "--threads", "1",
                           "--rounds", "3", "--reps", "1", "--steps", "2"])
    # this tree, then REV's exported tree, which carries this tree's benchmark driver
    assert built[0] == ROOT and len(built) == 2
    assert (built[1] / "CMakeLists.txt").exists()
    assert ((built[1] / "benchmarks" / "c" / "bench_optim_step.c").read_bytes()
            == (ROOT / "benchmarks" / "c" / "bench_optim_step.c").read_bytes())
    builds = json.loads((tmp_path / "bench_optim_core.json").read_text())["builds"]
    assert len(builds) == 2
    (this,) = [v for k, v in builds.items() if k.startswith("this tree")]
    (rev,) = [v for k, v in builds.items() if not k.startswith("this tree")]
    assert rev["ratio_vs_against"] == {"median": 1.0, "q1": 1.0, "q3": 1.0}
    # the ratio pairs the two builds' runs of the same round
    ratios = [a["best_ms"] / b["best_ms"] for a, b in zip(this["rounds"], rev["rounds"])]
    assert this["ratio_vs_against"]["median"] == statistics.median(ratios)
    q = statistics.quantiles(ratios, n=4)
    assert (this["ratio_vs_against"]["q1"], this["ratio_vs_against"]["q3"]) == (q[0], q[2])
    for b in (this, rev):
        assert len(b["rounds"]) == 3 and 0 < b["best_ms"] <= b["median_of_medians_ms"]
        assert b["best_ms"] == min(r["best_ms"] for r in b["rounds"])
