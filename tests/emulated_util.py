"""Builds memfit with its CUDA kernels on mfemu (cmake -DMEMFIT_CUDA=EMULATE, see
cuda/emulate) from the source tree these tests sit in, and runs emulated_cases.py
against it in a subprocess, so the test process keeps the normal memfit.

The build goes to <repo>/build/emulated* and is incremental: a change to a .cu file
rebuilds that file and relinks; a cold build compiles the C core once more (with
MEMFIT_WITH_CUDA it is a different library). Under pytest-xdist several worker
processes may ask for the same build at once: a lock file beside the folder makes the
second wait for the first and then find it up to date (a no-op ninja run), so each
build is made once per run and never by two compilers into one folder."""
from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CASES = Path(__file__).resolve().parent / "emulated_cases.py"
# cuBLASLt must decline (it would run on the host pointers): naming a file that does
# not exist is the documented way to make it (cuda/gemm_cublaslt.cu, load_locked)
NO_CUBLASLT = "/nonexistent/mfemu-has-no-libcublasLt.so"


@contextlib.contextmanager
def locked(build_dir: Path):
    """Holds <build_dir>.lock (an OS file lock, released when the holder exits, even
    killed) while the caller writes into build_dir, so that the tests of other xdist
    workers, or another pytest run on the same tree, wait instead of building beside it."""
    build_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(build_dir.parent / f"{build_dir.name}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def build(name: str = "emulated", *defines: str) -> Path:
    """Configures (once) and builds <repo>/build/<name>; returns the folder."""
    build_dir = ROOT / "build" / name
    cmake = shutil.which("cmake")
    if cmake is None:
        raise RuntimeError("cmake is needed to build the emulated kernels")
    with locked(build_dir):
        return _build(cmake, build_dir, defines)


def _compiler_cache() -> tuple[list, dict]:
    """ccache, where installed (.ci/run installs it): the configure arguments and the
    build's environment. The plain and the planted-bug builds compile the same C core
    with the same flags (four fifths of a cold build), and the planted-bug test puts
    each .cu file back as it was after its bug: with a compiler cache those are looked
    up, not compiled again. The cache lives in <repo>/build/ccache, so the first run of
    a fresh clone gains too and nothing outside the tree is written."""
    ccache = shutil.which("ccache")
    if ccache is None:
        return ["-DCMAKE_C_COMPILER_LAUNCHER=", "-DCMAKE_CXX_COMPILER_LAUNCHER="], {}
    env = dict(os.environ, CCACHE_DIR=str(ROOT / "build" / "ccache"), CCACHE_MAXSIZE="2G")
    return [f"-DCMAKE_C_COMPILER_LAUNCHER={ccache}", f"-DCMAKE_CXX_COMPILER_LAUNCHER={ccache}"], env


def _build(cmake: str, build_dir: Path, defines: tuple) -> Path:
    launchers, env = _compiler_cache()
    wanted = [f"-D{d}" for d in ("MEMFIT_CUDA=EMULATE", "MEMFIT_BUILD_TESTS=OFF", *defines)] + launchers
    stamp = build_dir / "mfemu-configure-args"
    if not (build_dir / "CMakeCache.txt").exists() or not stamp.exists() or stamp.read_text() != repr(wanted):
        cmd = [cmake, "-S", str(ROOT), "-B", str(build_dir), f"-DPython_EXECUTABLE={sys.executable}",
               "-DCMAKE_BUILD_TYPE=Release", *wanted]
        if shutil.which("ninja"):
            cmd += ["-G", "Ninja"]
        if (build_dir / "CMakeCache.txt").exists():
            cmd = [c for c in cmd if c not in ("-G", "Ninja")]  # the generator is fixed
        run = subprocess.run(cmd, capture_output=True, text=True)
        if run.returncode:
            raise RuntimeError(f"configure failed:\n{run.stdout}\n{run.stderr}")
        stamp.write_text(repr(wanted))
    run = subprocess.run([cmake, "--build", str(build_dir), "-j", str(os.cpu_count() or 2)],
                         capture_output=True, text=True, env=env or None)
    if run.returncode:
        raise RuntimeError(f"build failed:\n{run.stdout[-20000:]}\n{run.stderr[-5000:]}")
    _package(build_dir)
    return build_dir


def _package(build_dir: Path) -> None:
    """<build>/py/memfit: links to python/memfit's files plus the emulated _C."""
    pkg = build_dir / "py" / "memfit"
    pkg.mkdir(parents=True, exist_ok=True)
    for entry in pkg.iterdir():
        if entry.is_symlink():
            entry.unlink()
    for src in (ROOT / "python" / "memfit").iterdir():
        if src.name.startswith("_C.") or src.name == "__pycache__":
            continue
        (pkg / src.name).symlink_to(src)
    (so,) = build_dir.glob("_C.*.so")
    (pkg / so.name).symlink_to(so)


def run_cases(build_dir: Path, *groups: str, seed: int = 0, env: dict | None = None,
              timeout: float = 600) -> subprocess.CompletedProcess:
    """emulated_cases.py GROUPS... on the build, under schedule seed `seed`."""
    e = dict(os.environ)
    e.update({"PYTHONPATH": str(build_dir / "py"), "MFEMU_SEED": str(seed), "MEMFIT_CUBLASLT": NO_CUBLASLT,
              "OMP_NUM_THREADS": "1"})
    e.update(env or {})
    return subprocess.run([sys.executable, str(CASES), *groups], capture_output=True, text=True, env=e,
                          timeout=timeout, cwd=str(build_dir))


def explain(run: subprocess.CompletedProcess) -> str:
    return f"exit {run.returncode}\n--- stdout\n{run.stdout[-6000:]}\n--- stderr\n{run.stderr[-6000:]}"
