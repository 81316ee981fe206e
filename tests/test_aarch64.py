"""The C core on aarch64 (NVIDIA Grace, AWS Graviton): cross-compiled with Debian's
gcc-aarch64-linux-gnu through cmake/aarch64-linux-gnu.cmake, and every C test of the
core (tests/c/test_*.c) run under qemu-aarch64 (qemu-user).

That the core compiles for aarch64 at all is the check that no x86 intrinsic leaks out of
the x86-only code (immintrin.h, AVX2/AVX-512 kernels, CPUID). qemu's timings mean nothing
for speed, so nothing here is timed. Skipped where the tools are missing, except in CI
(.ci/run installs them), where that is a failure."""

import os
import shutil
from pathlib import Path

import pytest

import proc_util

ROOT = Path(__file__).resolve().parents[1]
TOOLCHAIN = ROOT / "cmake" / "aarch64-linux-gnu.cmake"
SYSROOT = "/usr/aarch64-linux-gnu"
C_TESTS = sorted(p.stem for p in (ROOT / "tests" / "c").glob("test_*.c"))
EM_AARCH64 = 183  # ELF e_machine of aarch64


def _tools() -> dict:
    tools = {name: shutil.which(name) for name in ("cmake", "aarch64-linux-gnu-gcc", "qemu-aarch64")}
    missing = [name for name, path in tools.items() if path is None]
    if not Path(SYSROOT, "lib").is_dir():
        missing.append(f"the aarch64 C library under {SYSROOT} (libc6-dev-arm64-cross)")
    if missing:
        msg = "missing " + ", ".join(missing)
        if os.environ.get("CI"):
            pytest.fail(f"{msg}: required in CI (.ci/run installs gcc-aarch64-linux-gnu and qemu-user)")
        pytest.skip(msg)
    return tools


@pytest.fixture(scope="module")
def arm_build(tmp_path_factory):
    if not TOOLCHAIN.exists():
        pytest.skip("needs the source tree")
    tools = _tools()
    build = tmp_path_factory.mktemp("aarch64")
    configure = [tools["cmake"], "-S", str(ROOT), "-B", str(build), f"-DCMAKE_TOOLCHAIN_FILE={TOOLCHAIN}",
                 "-DMEMFIT_PYTHON=OFF", "-DMEMFIT_CUDA=OFF", "-DMEMFIT_BUILD_TESTS=ON",
                 "-DCMAKE_BUILD_TYPE=Release"]
    if shutil.which("ninja"):
        configure += ["-G", "Ninja"]
    run = proc_util.run(configure, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    run = proc_util.run([tools["cmake"], "--build", str(build), "-j2"], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    return build


def elf_machine(path: Path) -> int:
    head = path.read_bytes()[:20]
    assert head[:4] == b"\x7fELF", f"{path} is not an ELF file"
    return int.from_bytes(head[18:20], "little")


def test_the_core_library_is_aarch64(arm_build):
    lib = arm_build / "libmemfit_core.a"
    assert lib.exists()
    ar = shutil.which("aarch64-linux-gnu-ar") or "ar"
    objects = proc_util.run([ar, "t", str(lib)], capture_output=True, text=True, check=True).stdout.split()
    assert "optim.c.o" in objects and "cpu_isa.c.o" in objects
    # the x86-only kernel files are left out of a non-x86 build altogether
    assert not [o for o in objects if "_avx" in o], objects


@pytest.mark.parametrize("name", C_TESTS)
def test_c_test_passes_under_qemu(arm_build, name):
    exe = arm_build / name
    assert elf_machine(exe) == EM_AARCH64, f"{name} was not built for aarch64"
    env = dict(os.environ, OMP_NUM_THREADS="2")
    run = proc_util.run(["qemu-aarch64", "-L", SYSROOT, str(exe)], capture_output=True, text=True,
                         env=env, timeout=900)
    assert run.returncode == 0, f"{name} failed under qemu-aarch64:\n{run.stdout[-4000:]}\n{run.stderr[-4000:]}"
