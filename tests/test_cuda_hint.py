"""The one-line fixes for the CUDA errors a rebuild fixes (csrc/core/cuda_hint.c): a driver
older than the build's CUDA, no kernel for this GPU, PTX the driver cannot compile. The
formatter and the architecture check are C that every build has, so they are tested here
without a GPU; tests/test_cuda_emulated.py drives the same words through import memfit,
memfit doctor and a CUDA call on the emulated runtime."""

import pytest

from memfit import _C

INSUFFICIENT_DRIVER, NO_KERNEL_IMAGE, UNSUPPORTED_PTX = 35, 209, 222
DEFAULT = "75-real,80-real,86-real,89-real,90"


def test_driver_older_than_the_build():
    # an nvcc 13 build on Colab (driver 550: CUDA 12.4)
    h = _C.cuda_hint(INSUFFICIENT_DRIVER, 12040, 13000, DEFAULT, 0, 0)
    assert "\n" not in h
    assert "the NVIDIA driver supports CUDA 12.4" in h and "built with CUDA 13.0" in h
    assert "needs driver >= 580" in h
    assert "nvcc no newer than 12.4" in h and "CUDACXX=/usr/local/cuda-12.4/bin/nvcc" in h
    assert "pip install --no-cache-dir --force-reinstall" in h and "update the driver" in h


def test_cuda_12_build_on_a_cuda_11_driver():
    h = _C.cuda_hint(INSUFFICIENT_DRIVER, 11080, 12040, DEFAULT, 0, 0)
    assert "supports CUDA 11.8" in h and "built with CUDA 12.4, which needs driver >= 525" in h


def test_no_driver():
    assert _C.cuda_hint(INSUFFICIENT_DRIVER, 0, 13000, DEFAULT, 0, 0) == \
        "no NVIDIA driver is installed (libcuda.so.1 not found)"


def test_no_kernel_for_this_gpu():
    h = _C.cuda_hint(NO_KERNEL_IMAGE, 12040, 12040, "80-real,90-real", 7, 5)
    assert "\n" not in h
    assert h.startswith("this GPU (compute capability 7.5) has no kernels in this memfit build "
                        "(architectures 80-real,90-real)")
    assert "MEMFIT_CUDA_ARCHS unset" in h and "MEMFIT_CUDA_ARCHS=75 pip install" in h


def test_no_kernel_for_a_gpu_of_unknown_capability():
    h = _C.cuda_hint(NO_KERNEL_IMAGE, 12040, 12040, "80-real", 0, 0)
    assert h.startswith("this GPU has no kernels") and "nvidia-smi --query-gpu=compute_cap" in h


def test_ptx_newer_than_the_driver():
    # an nvcc 12.5 build whose only code for an RTX 50xx is compute_90 PTX, on a 12.4 driver
    h = _C.cuda_hint(UNSUPPORTED_PTX, 12040, 12050, DEFAULT, 12, 0)
    assert "compute capability 12.0" in h and "PTX of CUDA 12.5" in h and "driver (CUDA 12.4)" in h
    assert "MEMFIT_CUDA_ARCHS=120" in h and "nvcc no newer than 12.4" in h


@pytest.mark.parametrize("err", [0, 1, 2, 100, 719])
def test_other_errors_have_no_hint(err):
    assert _C.cuda_hint(err, 12040, 13000, DEFAULT, 7, 5) is None


@pytest.mark.parametrize("archs, cc, runs", [
    (DEFAULT, (7, 5), True),    # T4
    (DEFAULT, (8, 0), True),    # A100
    (DEFAULT, (8, 7), True),    # Orin: sm_86 SASS runs on 8.7
    (DEFAULT, (9, 0), True),    # H100
    (DEFAULT, (10, 0), True),   # B200: compute_90 PTX, JIT-compiled
    (DEFAULT, (12, 0), True),   # RTX 50xx: the same PTX
    (DEFAULT, (7, 0), False),   # V100: nothing at or below 7.0
    ("75-real,80-real,86-real,89-real,90-real", (10, 0), False),  # no PTX: nothing for newer
    ("75-real", (8, 0), False),  # SASS runs within its major only
    ("86-real", (8, 0), False),  # ... and on a minor no lower
    ("80-real", (8, 9), True),
    ("90a-real", (9, 0), True),
    ("90a", (10, 0), False),    # arch-specific code and PTX: the same GPU only
    ("80-virtual", (8, 6), True),
    ("80-virtual", (7, 5), False),
    ("75", (7, 5), True),
    ("120-real", (12, 0), True),
    ("120-real", (12, 1), True),
    ("emulated", (7, 5), True),
    ("", (7, 5), False),
])
def test_archs_run_on(archs, cc, runs):
    assert _C.cuda_archs_run_on(archs, *cc) is runs


def test_the_cpu_build_reports_no_driver_problem():
    if _C.build_info()["cuda"]:
        pytest.skip("a CUDA build: tests/test_cuda_emulated.py covers it")
    assert _C.cuda_driver_hint() is None


class _OneT4:
    """memfit._C as doctor sees it on a T4 with a build for 80/90 only: the device facts
    are injected, the architecture check and the hint are the real C functions."""
    def __getattr__(self, name):
        return getattr(_C, name)

    def build_info(self):
        return {**_C.build_info(), "cuda": True, "cuda_archs": "80-real,90"}

    def cuda_device_count(self):
        return 1

    def cuda_device_info(self, i):
        return {"name": "Tesla T4", "capability": (7, 5), "total_memory": 15 * 2**30,
                "driver_version": 12040, "runtime_version": 12040}

    def cuda_unavailable(self):
        return None


def test_doctor_names_a_gpu_without_kernels(monkeypatch):
    import memfit.doctor as doctor
    import memfit.nn.gemm as gemm

    monkeypatch.setattr(doctor, "_C", _OneT4())
    monkeypatch.setattr(gemm, "gemm_backend", lambda device: {
        "backend": "tiled", "reason": "", "cublaslt": {"loaded": False, "version": None, "path": None, "reason": ""}})
    info = doctor.report()
    (gpu,) = info["runtime"]["gpus"]
    assert gpu["kernels"] is False and "MEMFIT_CUDA_ARCHS=75" in gpu["fix"]
    line = next(l for l in doctor.format_report(info).splitlines() if l.lstrip().startswith("GPU 0"))
    assert "Tesla T4" in line and "NO KERNELS for it: this GPU (compute capability 7.5)" in line


def test_doctor_on_a_gpu_the_build_covers(monkeypatch):
    import memfit.doctor as doctor
    import memfit.nn.gemm as gemm

    t4 = _OneT4()
    t4.build_info = lambda: {**_C.build_info(), "cuda": True, "cuda_archs": DEFAULT}
    monkeypatch.setattr(doctor, "_C", t4)
    monkeypatch.setattr(gemm, "gemm_backend", lambda device: {
        "backend": "tiled", "reason": "", "cublaslt": {"loaded": False, "version": None, "path": None, "reason": ""}})
    info = doctor.report()
    assert info["runtime"]["gpus"][0]["kernels"] is True and info["runtime"]["gpus"][0]["fix"] is None
    assert "NO KERNELS" not in doctor.format_report(info)
