"""Every CUDA kernel executed on the CPU and compared bit for bit with the C core.

The kernels of cuda/*.cu, unchanged, run on mfemu (cuda/emulate: one fiber per CUDA
thread, seeded schedules, warp-scoped shuffles, poisoned shared memory); the cases are
in emulated_cases.py, the build in emulated_util.py. Which kernels each test executes:

* quant: quantize_kernel<BS> for every block size, dequantize_kernel (quant.cu)
* optim: optim_quant_kernel<BS, 8/4> for every block size, optim_warp_kernel (8-bit
  blocks of 256, 4-bit of 128, with and without its code slices), optim_fp32_kernel,
  optim_count_kernel (optim.cu)
* unscale: unscale_grads_kernel, grad_norm_partial_kernel, grad_norm_finish_kernel,
  clip_grads_kernel (unscale.cu)
* cast: cast_kernel and the same-dtype copy (cast.cu)
* scaler: scaler_update_kernel (scaler.cu)
* gemm: gemm_tiled_kernel after cuBLASLt declines (gemm.cu, gemm_cublaslt.cu's loader),
  act_forward_kernel, act_backward_kernel (gemm.cu)
* device queries: device.cu
* the host queue's copies with a CUDA side and its event wait (host_queue.cu)

What this cannot check (nvcc's code generation, warp lockstep, the GPU memory model,
cuBLASLt, speed) is listed in docs/architecture.md; benchmarks/gpu_validate.sh checks
it on a GPU.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import emulated_util as eu  # noqa: E402

pytestmark = pytest.mark.cuda_emulated

GROUPS = ("quant", "optim", "unscale", "cast", "scaler", "gemm", "host_queue")


@pytest.fixture(scope="session")
def emulated():
    if not (eu.ROOT / "cuda" / "emulate" / "runtime.cpp").exists():
        pytest.skip("needs the source tree")
    return eu.build("emulated")


@pytest.mark.parametrize("group", GROUPS)
def test_kernels_match_the_c_core(emulated, group):
    run = eu.run_cases(emulated, group)
    assert run.returncode == 0 and " 0 mismatches" in run.stdout, eu.explain(run)


@pytest.mark.parametrize("seed", [1, 2, 0xC0FFEE])
def test_kernels_match_under_random_schedules(emulated, seed):
    """The threads of a block run in a seeded random order between barriers (odd seeds:
    warp by warp in a random priority; even: thread by thread): shared memory read
    without a barrier shows up as a mismatch (the seed is in the report)."""
    run = eu.run_cases(emulated, "quant", "optim-small", "unscale", "gemm", seed=seed)
    assert run.returncode == 0 and " 0 mismatches" in run.stdout, f"MFEMU_SEED={seed}\n" + eu.explain(run)


def test_kernels_with_code_slices(emulated):
    """optim_warp_kernel (8-bit blocks of 256, 4-bit of 128; AdamW, Adam, Lion, SGD, Muon)
    and quantize_kernel with their code slices (cuda/code_slice.cuh) built in every launch:
    by default only launches of MEMFIT_CUDA_SLICE_MIN = 2^24 elements and more build them,
    larger than any case here, so the other tests run the binary-search form. Under a
    random schedule (seed 3), as the slices are built by all threads before a barrier."""
    run = eu.run_cases(emulated, "quant", "optim", seed=3, env={"MEMFIT_CUDA_SLICE_MIN": "0"})
    assert run.returncode == 0 and " 0 mismatches" in run.stdout, eu.explain(run)


def test_code_slice_is_the_binary_search(tmp_path):
    """The slice's lookup gives mf_optim_quantize's index for memfit's four codes, nearest
    and keep_positive: every position of every bucket where the index steps, both ends
    and inner points of every other bucket, +-0, tiny, huge and non-finite values, and
    random floats (tests/emulate/code_slice_check.cpp); for the 25-binade slice and the
    T4's 12-binade one."""
    cxx = shutil.which("g++")
    if cxx is None:
        pytest.skip("needs g++")
    from memfit.optim import _core

    files = []
    for bits in (8, 4):
        for signed in (True, False):
            f = tmp_path / f"code{bits}{'s' if signed else 'u'}.bin"
            f.write_bytes(_core.code_table(bits, signed).astype("<f4").tobytes())
            files.append(str(f))
    for binades in (25, 12):  # the form of sm_80 and later, and the T4's
        exe = tmp_path / f"code_slice_check{binades}"
        build = subprocess.run([cxx, "-std=c++17", "-O2", "-ffp-contract=off", f"-DMF_CODE_SLICE_BINADES={binades}",
                                f"-I{eu.ROOT / 'cuda' / 'emulate'}", f"-I{eu.ROOT / 'cuda'}",
                                f"-I{eu.ROOT / 'csrc' / 'include'}",
                                str(eu.ROOT / "tests" / "emulate" / "code_slice_check.cpp"), "-o", str(exe)],
                               capture_output=True, text=True)
        assert build.returncode == 0, build.stderr
        run = subprocess.run([str(exe), *files], capture_output=True, text=True, timeout=600)
        assert run.returncode == 0 and "code slice ok" in run.stdout, f"{binades} binades\n" + run.stdout + run.stderr


def _query(emulated, code, **env):
    e = dict(os.environ, PYTHONPATH=str(emulated / "py"), **env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=e, cwd=str(emulated))


@pytest.mark.parametrize("device,name,capability", [("t4", "Tesla T4", "(7, 5)"), ("h100", "H100", "(9, 0)")])
def test_device_queries(emulated, device, name, capability):
    run = _query(emulated, "from memfit import _C; print(_C.cuda_device_count(), _C.cuda_device_info(0), "
                           "_C.cuda_unavailable())", MFEMU_DEVICE=device)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("1 ") and name in run.stdout and capability in run.stdout, run.stdout
    assert run.stdout.strip().endswith("None"), run.stdout


# ---- the errors a rebuild fixes: the one-line hint at import, in doctor, at the first call ---
_FIRST_CALL = """
import sys, warnings
sys.path.insert(0, {tests!r})
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import memfit
import numpy as np
from memfit import _C
from emulated_cases import Dev
for w in caught:
    print("WARNING", w.category.__name__, str(w.message).replace(chr(10), " NEWLINE "))
print("COUNT", _C.cuda_device_count())
print("UNAVAILABLE", _C.cuda_unavailable())
code = np.empty(256, np.float32)
_C.dynamic_map(code, True, 8, 7)
x = np.linspace(-1, 1, 256, dtype=np.float32)
try:
    _C.quantize_blockwise(Dev(x), Dev(code), Dev(np.empty(256, np.uint8)), Dev(np.empty(1, np.float32)), 256, False, 0, 0)
    print("CALL ok")
except memfit.CudaError as e:
    print("CALL", str(e).replace(chr(10), " NEWLINE "))
"""


def _first_call(emulated, **env):
    run = _query(emulated, _FIRST_CALL.format(tests=str(Path(__file__).resolve().parent)),
                 MEMFIT_CUBLASLT=eu.NO_CUBLASLT, **env)
    assert run.returncode == 0, run.stderr
    return {k: v for k, v in (line.split(" ", 1) for line in run.stdout.splitlines())}, run.stdout


def test_driver_older_than_the_build_is_named_once_everywhere(emulated):
    """mfemu's CUDA 13.0 runtime on a driver for CUDA 12.4 (Colab's 550), as an nvcc 13
    build on Colab: import memfit warns in one line, doctor's reason and the first CUDA
    call's error carry the same line."""
    out, text = _first_call(emulated, MFEMU_DRIVER="12040")
    hint = ("the NVIDIA driver supports CUDA 12.4, but this memfit was built with CUDA 13.0, "
            "which needs driver >= 580: rebuild memfit with an nvcc no newer than 12.4")
    assert out["WARNING"].startswith("RuntimeWarning memfit's CUDA kernels cannot run here: " + hint), text
    assert "NEWLINE" not in text and text.count("WARNING") == 1, text
    assert out["COUNT"] == "0" and out["UNAVAILABLE"].startswith(hint), text
    assert "cudaErrorInsufficientDriver" in out["CALL"] and hint in out["CALL"], text


def test_no_driver_is_not_a_warning(emulated):
    out, text = _first_call(emulated, MFEMU_DRIVER="0")
    assert "WARNING" not in out, text  # a CPU machine with a CUDA build: nothing to fix
    assert out["UNAVAILABLE"] == "no NVIDIA driver is installed (libcuda.so.1 not found)", text


def test_gpu_without_kernels_is_named_at_the_first_call(emulated):
    out, text = _first_call(emulated, MFEMU_NO_KERNEL_IMAGE="1", MFEMU_DEVICE="t4")
    assert "WARNING" not in out and out["COUNT"] == "1" and out["UNAVAILABLE"] == "None", text
    assert "cudaErrorNoKernelImageForDevice" in out["CALL"], text
    assert "this GPU (compute capability 7.5) has no kernels in this memfit build" in out["CALL"], text
    assert "MEMFIT_CUDA_ARCHS=75 pip install" in out["CALL"], text


def test_without_injected_errors_the_call_runs(emulated):
    out, text = _first_call(emulated)
    assert "WARNING" not in out and out["CALL"] == "ok", text


# ---- the runtime itself ---------------------------------------------------------------
def _selftest(tmp_path, cxx, *extra, runner=()):
    cpp = tmp_path / "selftest.cpp"
    subprocess.run([sys.executable, str(eu.ROOT / "cuda" / "emulate" / "rewrite_launches.py"),
                    str(eu.ROOT / "tests" / "emulate" / "mfemu_selftest.cu"), str(cpp)], check=True)
    exe = tmp_path / "selftest"
    build = subprocess.run([cxx, "-std=c++17", "-O1", "-Wall", "-Wno-unknown-pragmas",
                            f"-I{eu.ROOT / 'cuda' / 'emulate'}", str(cpp),
                            str(eu.ROOT / "cuda" / "emulate" / "runtime.cpp"), "-o", str(exe), *extra],
                           capture_output=True, text=True)
    assert build.returncode == 0, build.stderr
    run = subprocess.run([*runner, str(exe)], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, ASAN_OPTIONS="detect_leaks=0"))
    assert run.returncode == 0 and "mfemu selftest ok" in run.stdout, run.stdout + run.stderr
    return run


def test_runtime_selftest(tmp_path):
    """Shuffles, ballots and barrier reductions give CUDA's values; shared memory is
    poisoned between blocks; a deadlock, threads at different barriers, a mask naming a
    missing or exited lane and a bad configuration fail the launch (not the process);
    seeded schedules reorder warps. Under AddressSanitizer + UBSan too."""
    cxx = shutil.which("g++")
    if cxx is None:
        pytest.skip("needs g++")
    run = _selftest(tmp_path, cxx)
    assert "deadlock" in run.stderr and "MFEMU_SEED=" in run.stderr  # the reports go to stderr
    _selftest(tmp_path, cxx, "-fsanitize=address,undefined", "-fno-sanitize-recover=all")


def test_runtime_selftest_aarch64(tmp_path):
    """The aarch64 context switch, under qemu-aarch64 (as tests/test_aarch64.py)."""
    tools = {n: shutil.which(n) for n in ("aarch64-linux-gnu-g++", "qemu-aarch64")}
    missing = [n for n, p in tools.items() if p is None]
    if missing:
        msg = "missing " + ", ".join(missing)
        if os.environ.get("CI"):
            pytest.fail(f"{msg}: required in CI (.ci/run installs g++-aarch64-linux-gnu and qemu-user)")
        pytest.skip(msg)
    _selftest(tmp_path, tools["aarch64-linux-gnu-g++"], "-static", runner=(tools["qemu-aarch64"],))


# ---- sanitizers -------------------------------------------------------------------------
@pytest.mark.slow
def test_kernels_under_sanitizers():
    """A representative comparison with the runtime, the kernels and the core built with
    -fsanitize=address,undefined (MEMFIT_SANITIZE), libasan preloaded into Python."""
    libasan = subprocess.run(["g++", "-print-file-name=libasan.so"], capture_output=True, text=True).stdout.strip()
    if not os.path.isabs(libasan):
        pytest.skip("no libasan")
    build = eu.build("emulated-asan", "MEMFIT_SANITIZE=ON")
    env = {"LD_PRELOAD": libasan, "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=0",
           "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1"}
    # (the optimizer cases, three quarters of the time, once: their memory accesses do not
    # depend on the schedule, and test_kernels_match_under_random_schedules varies that)
    for seed, groups in ((0, ("quant", "optim-small", "unscale", "cast", "scaler", "gemm")),
                         (5, ("quant", "unscale", "cast", "scaler", "gemm"))):
        run = eu.run_cases(build, *groups, seed=seed, env=env)
        assert run.returncode == 0 and " 0 mismatches" in run.stdout, f"MFEMU_SEED={seed}\n" + eu.explain(run)
        assert "runtime error" not in run.stderr and "AddressSanitizer" not in run.stderr, run.stderr[-6000:]


# ---- the comparison can fail ------------------------------------------------------------
# (file, text, replacement, group): small bugs of the kinds a kernel change can bring
MUTANTS = [
    ("quant.cu", "m = mf_absmax_combine(m, __shfl_xor_sync(0xffffffffu, m, off));",
     "m = mf_absmax_combine(m, __shfl_xor_sync(0xffffffffu, m, off > 1 ? off : 0));", "quant"),
    ("quant.cu", "  __syncthreads();\n  const int64_t stride", "  const int64_t stride", "quant"),
    ("optim.cu", "red1[parity]", "red1[0]", "optim-small"),  # no double buffer: a race
    ("optim.cu", "const int lead = warp & ~(WARPS - 1);", "const int lead = warp / WARPS;", "optim-small"),
    # the warp kernel (8-bit blocks of 256: sgd8, adamw8 bs=256): half a block's absmax
    ("optim.cu", "m1 = group_max_u32<LANES>(m1);", "m1 = group_max_u32<LANES / 2>(m1);", "optim-small"),
    ("optim.cu", "t.p = (char *)t.p + at.elem * esize;", "t.p = (char *)t.p + (at.elem + 1) * esize;",
     "optim-small"),
    ("unscale.cu", "for (int off = 16; off > 0; off >>= 1) v = max(",
     "for (int off = 16; off > 1; off >>= 1) v = max(", "unscale"),
    ("unscale.cu", "  if (threadIdx.x % 32 == 0) s[threadIdx.x / 32] = v;\n  __syncthreads();\n  T r = 0;",
     "  if (threadIdx.x % 32 == 0) s[threadIdx.x / 32] = v;\n  T r = 0;", "unscale"),
    ("cast.cu", "for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;",
     "for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x + 1; i < n;", "cast"),
    ("scaler.cu", "for (int i = 0; i < n; i++) any", "for (int i = 1; i < n; i++) any", "scaler"),
    ("gemm.cu", "    __syncthreads();\n  }\n#pragma unroll", "  }\n#pragma unroll", "gemm"),
]


@pytest.mark.slow
def test_planted_bugs_are_caught():
    """Each mutant of MUTANTS, built from a copy of cuda/, fails the comparison under
    seed 0 or a random schedule (3: warp-priority, 4: uniform; see runtime.cpp, pick):
    mismatches, a failed launch, or (the row offset, which writes past the last row) a
    crash of the subprocess. The seeds are tried in that order up to the first that
    catches it (most mutants fail under seed 0; the race on red1 needs seed 3)."""
    src = eu.ROOT / "build" / "emulated-mutant-src" / "cuda"
    if src.exists():
        shutil.rmtree(src)
    shutil.copytree(eu.ROOT / "cuda", src)
    build = eu.build("emulated-mutant", f"MEMFIT_CUDA_SOURCE_DIR={src}")
    missed = []
    for file, old, new, group in MUTANTS:
        text = (eu.ROOT / "cuda" / file).read_text()
        assert text.count(old) >= 1, f"{file}: the mutant's text is gone: {old!r}"
        (src / file).write_text(text.replace(old, new))
        try:
            eu.build("emulated-mutant", f"MEMFIT_CUDA_SOURCE_DIR={src}")
            caught = None
            for seed in (0, 3, 4):
                run = eu.run_cases(build, group, seed=seed)
                if run.returncode != 0:  # mismatches, a failed launch, or a crash
                    why = run.stdout.splitlines()[-1] if "MISMATCH" in run.stdout else run.stderr.strip()[-200:]
                    caught = (seed, why or f"exit status {run.returncode}")
                    break
            if caught is None:
                missed.append(f"{file}: {old!r} -> {new!r}")
            print(f"{file}: {new.strip()[:60]!r}: " +
                  (f"caught under seed {caught[0]}: {caught[1]}" if caught else "missed"))
        finally:
            (src / file).write_text(text)
    assert not missed, "planted bugs the comparison did not catch:\n" + "\n".join(missed)
