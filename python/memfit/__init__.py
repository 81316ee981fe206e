"""memfit: train bigger models in less GPU memory.

A C core with CUDA kernels for blockwise quantization, 8-bit optimizers, a GradScaler
state machine, mixed-precision kernels and planned checkpointing. The core takes any
array through DLPack (torch, NumPy, CuPy, JAX); torch is imported only by the torch
adapters, so ``import memfit`` stays light.

    >>> import memfit
    >>> memfit.build_info()["version"]  # doctest: +SKIP
    '0.1.0'
"""

from memfit import _C
from memfit._C import CudaError, Error, MemfitTypeError, MemfitValueError

__version__ = _C.build_info()["version"]


def _warn_if_the_driver_is_too_old() -> None:
    # One line at import when the NVIDIA driver is older than the CUDA this build linked
    # (e.g. an nvcc 13 build on Colab's driver 550): the CUDA kernels cannot run, and the
    # line says which toolkit to rebuild with. Reads the driver's version only: CUDA is
    # not initialized, so processes forked after `import memfit` can still use it. A GPU
    # the build has no code for is reported by `memfit doctor` and the first CUDA call.
    if _C.build_info()["cuda"]:
        hint = _C.cuda_driver_hint()
        if hint:
            import warnings

            warnings.warn(f"memfit's CUDA kernels cannot run here: {hint}", RuntimeWarning, stacklevel=2)


_warn_if_the_driver_is_too_old()

__all__ = [
    "CudaError",
    "Error",
    "MemfitTypeError",
    "MemfitValueError",
    "amp",
    "build_info",
    "cast",
    "checkpoint",
    "cpu_kernels",
    "optim_kernel",
    "cuda_device_count",
    "get_num_threads",
    "optim",
    "quant",
    "set_num_threads",
]


def build_info() -> dict:
    """What this build of memfit was compiled with.

    Returns a dict with ``version``, ``cuda`` (True when the CUDA kernels were built),
    ``cuda_archs`` (the GPU architectures compiled for), ``openmp`` and ``compiler``.

    >>> sorted(memfit.build_info())  # doctest: +SKIP
    ['compiler', 'cuda', 'cuda_archs', 'openmp', 'version']
    """
    return dict(_C.build_info())


def cuda_device_count() -> int:
    """Number of CUDA devices memfit can use (0 on a CPU-only build or machine)."""
    return _C.cuda_device_count()


def set_num_threads(n: int) -> None:
    """Set the number of CPU threads memfit's kernels use; 0 restores the default
    (``OMP_NUM_THREADS``, else one per core). Match ``torch.get_num_threads()`` when
    torch runs work beside memfit, so the two do not oversubscribe the cores."""
    if isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(f"n: expected an int, got {type(n).__name__}")
    _C.set_num_threads(n)


def get_num_threads() -> int:
    """Number of CPU threads memfit's kernels use."""
    return _C.get_num_threads()


def cpu_kernels() -> str:
    """Which vector form memfit's CPU kernels run on this machine: ``"avx512-vbmi"``,
    ``"avx512"``, ``"avx2"`` or ``"generic"`` (the widest the CPU has; the environment
    variable ``MEMFIT_CPU_ISA=generic|avx2|avx512|avx512vbmi`` caps it, read once)."""
    return _C.cpu_kernels()


def optim_kernel() -> str:
    """The CPU kernel memfit's 8-bit/4-bit optimizer steps run on this machine:
    ``"avx512-vbmi"``, ``"avx512-gather"``, ``"avx2-gather"``, ``"avx2-scalar"`` or
    ``"generic"``. Where CPUID cannot tell which code search is faster (8-bit: gathers or
    scalar loads on AVX2, gathers or arithmetic on AVX-512; 4-bit: the table or a threshold
    tree), the first step times both (well under a millisecond, once per process);
    ``MEMFIT_OPTIM_KERNEL``, a comma-separated list of ``avx2-gather|avx2-scalar``,
    ``avx2-table4|avx2-tree4``, ``avx512-table|avx512-arith``, ``avx512-table4|avx512-tree4``,
    forces them. Every form gives the same bytes."""
    return _C.optim_kernel()


def cast(x, dtype, rounding="nearest", seed=None, out=None):
    """Cast between float32/float16/bfloat16 with nearest-even or stochastic
    rounding; see :func:`memfit._cast.cast`."""
    from memfit._cast import cast as _cast

    return _cast(x, dtype, rounding=rounding, seed=seed, out=out)


def __getattr__(name):
    # Submodules load on first use so `import memfit` stays cheap.
    if name in ("quant", "checkpoint", "optim", "amp", "cli", "doctor", "nn"):
        import importlib

        return importlib.import_module(f"memfit.{name}")
    raise AttributeError(f"module 'memfit' has no attribute {name!r}")
