"""The package itself: build info, doctor, the console script, import hygiene."""

import json
import os
import sys

import pytest

import proc_util

import memfit


def test_build_info_fields():
    info = memfit.build_info()
    assert set(info) == {"version", "cuda", "cuda_archs", "openmp", "compiler"}
    assert info["version"] == memfit.__version__
    assert isinstance(info["cuda"], bool) and isinstance(info["openmp"], bool)
    if info["cuda"]:
        assert info["cuda_archs"], "a CUDA build must say which archs it targets"
    assert info["compiler"].split()[0] in ("gcc", "clang", "msvc")


def test_import_does_not_import_torch():
    # the C-only capabilities (quantization, the checkpoint planner) work without torch
    code = ("import sys, memfit, memfit.quant, memfit.checkpoint as mc\n"
            "assert mc.plan([1, 1], [4, 4], None, 6).memory_bytes <= 6\n"
            "print('torch' in sys.modules)")
    out = proc_util.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_doctor_json_is_truthful():
    out = proc_util.run([sys.executable, "-m", "memfit", "doctor", "--json"],
                         capture_output=True, text=True, check=True)
    info = json.loads(out.stdout)
    assert info["build"] == memfit.build_info()
    # the threads a fresh process of the same environment uses (this one's may differ:
    # pytest-xdist workers give torch, and so OpenMP's default, a share of the CPUs)
    threads = proc_util.run([sys.executable, "-c", "import memfit; print(memfit.get_num_threads())"],
                            capture_output=True, text=True, check=True)
    assert info["runtime"]["threads"] == int(threads.stdout)
    assert len(info["runtime"]["gpus"]) == memfit.cuda_device_count()
    for gpu in info["runtime"]["gpus"]:
        assert gpu["bf16_native"] == (float(gpu["capability"]) >= 8.0)


def test_doctor_reports_cpu_kernels_and_their_cap():
    """The CPU kernel variant in use, capped by MEMFIT_CPU_ISA (a cap above what the CPU
    has falls back to the widest it has)."""
    order = ["generic", "avx2", "avx512", "avx512-vbmi"]
    seen = {}
    for cap in ("generic", "avx2", "avx512", None):
        env = {k: v for k, v in os.environ.items() if k != "MEMFIT_CPU_ISA"}
        if cap:
            env["MEMFIT_CPU_ISA"] = cap
        out = proc_util.run([sys.executable, "-m", "memfit", "doctor", "--json"], env=env,
                             capture_output=True, text=True, check=True)
        seen[cap] = json.loads(out.stdout)["runtime"]["cpu_kernels"]
        assert seen[cap] in order
    assert seen["generic"] == "generic"
    assert order.index(seen["avx2"]) <= order.index("avx2")
    assert order.index(seen["avx512"]) <= order.index("avx512")
    assert order.index(seen["avx2"]) <= order.index(seen["avx512"]) <= order.index(seen[None])
    out = proc_util.run([sys.executable, "-m", "memfit", "doctor"], capture_output=True,
                         text=True, check=True)
    assert f"CPU kernels  : {seen[None]}" in out.stdout
    if "MEMFIT_CPU_ISA" not in os.environ:
        assert memfit.cpu_kernels() == seen[None]


def test_doctor_text_and_console_script():
    out = proc_util.run([sys.executable, "-m", "memfit", "doctor"], capture_output=True,
                         text=True, check=True)
    assert out.stdout.startswith(f"memfit {memfit.__version__}")
    assert "CPU threads" in out.stdout


def test_cli_rejects_unknown_command():
    out = proc_util.run([sys.executable, "-m", "memfit", "no-such-command"],
                         capture_output=True, text=True)
    assert out.returncode == 2
    assert "invalid choice" in out.stderr


def test_num_threads_round_trip():
    before = memfit.get_num_threads()
    try:
        memfit.set_num_threads(1)
        assert memfit.get_num_threads() == 1
        with pytest.raises(ValueError, match="n: must be >= 0"):
            memfit.set_num_threads(-1)
        with pytest.raises(TypeError, match="n: expected an int"):
            memfit.set_num_threads(1.5)
    finally:
        memfit.set_num_threads(0)
    assert memfit.get_num_threads() == before


def test_exception_hierarchy():
    assert issubclass(memfit.MemfitTypeError, TypeError)
    assert issubclass(memfit.MemfitValueError, ValueError)
    assert issubclass(memfit.CudaError, RuntimeError)
    for cls in (memfit.MemfitTypeError, memfit.MemfitValueError, memfit.CudaError):
        assert issubclass(cls, memfit.Error)


@pytest.mark.skipif(memfit.cuda_device_count() > 0, reason="checks the error on a machine without a GPU")
def test_cuda_query_without_gpu_raises_clearly():
    # A CPU-only build says it has no CUDA; a CUDA build on a GPU-less machine
    # imports fine, counts 0 devices and reports CUDA's own reason.
    match = "CUDA error" if memfit.build_info()["cuda"] else "without CUDA"
    with pytest.raises(memfit.CudaError, match=match):
        memfit._C.cuda_device_info(0)
