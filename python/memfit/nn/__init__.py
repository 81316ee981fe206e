"""memfit.nn: matrix products and the torch modules built on them.

* :func:`matmul`, :func:`gemm_backend`, :func:`set_gemm_backend` (``gemm.py``): products
  with float32 accumulation on torch, NumPy, CuPy or JAX arrays, and which CUDA backend
  runs them. Also importable under their old names ``memfit.amp.matmul`` (etc.) and
  ``memfit._matmul``.
* :mod:`memfit.nn.functional`: ``linear`` with a fused activation, differentiable.
* :class:`Linear` (``linear.py``): a drop-in ``torch.nn.Linear`` on those kernels.

Only ``Linear`` (loaded on first use) and ``functional.linear`` import torch, so the
products work for NumPy, CuPy and JAX users without it.
"""

from memfit.nn import functional
from memfit.nn.gemm import gemm_backend, matmul, set_gemm_backend

__all__ = ["Linear", "functional", "gemm_backend", "matmul", "set_gemm_backend"]


def __getattr__(name):
    if name == "Linear":  # a torch.nn.Module subclass: importing it imports torch
        from memfit.nn.linear import Linear

        return Linear
    raise AttributeError(f"module 'memfit.nn' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | {"Linear"})
