"""Casts between float32, float16 and bfloat16 with nearest or stochastic rounding.

Round-to-nearest-even is bit-identical to torch's ``.to()``. Stochastic rounding
picks one of the two neighbouring representable values with probabilities that make
the expected result equal the input, which is what keeps tiny weight updates from
vanishing when bf16 weights are updated without an fp32 master copy.

    >>> import torch, memfit
    >>> x = torch.full((100_000,), 1.0 + 2**-10)            # between two bf16 values
    >>> memfit.cast(x, torch.bfloat16).float().mean().item()   # nearest: always 1.0
    1.0
    >>> y = memfit.cast(x, torch.bfloat16, rounding="stochastic", seed=0)
    >>> abs(y.float().mean().item() - (1 + 2**-10)) < 1e-4     # unbiased on average
    True

Range behaviour (both rounding modes): NaN stays NaN, +-Inf stays +-Inf, a value that
nearest rounding would overflow to Inf (|x| >= 65520 for float16) overflows the same
way; stochastic rounding never rounds a smaller finite value up to Inf (it stays at
the largest finite value). float16 subnormals are kept, never flushed to zero.
"""

from __future__ import annotations

import secrets

from memfit import _C, _arrays
from memfit._C import MemfitTypeError, MemfitValueError

__all__ = ["cast"]

_FLOATS = ("float32", "float16", "bfloat16")


def _dtype_arg(dtype) -> str:
    name = _arrays.dtype_name(dtype)
    if name not in _FLOATS:
        raise MemfitTypeError(f"dtype: expected float32, float16 or bfloat16 (a name, a torch "
                              f"or NumPy dtype, ml_dtypes.bfloat16), got {dtype!r}")
    return name


def cast(x, dtype, rounding: str = "nearest", seed: int | None = None, out=None):
    """Cast a float array to another float dtype.

    Args:
        x: float32, float16 or bfloat16 array (torch, NumPy, CuPy, JAX), contiguous.
        dtype: target dtype: a torch dtype, a NumPy dtype or scalar type (``np.float16``),
            ``ml_dtypes.bfloat16``, or "float32"/"float16"/"bfloat16".
        rounding: "nearest" (ties to even, as torch) or "stochastic" (unbiased).
        seed: seed for stochastic rounding; the same seed gives the same bits on CPU
            and GPU; random when None.
        out: optional preallocated array of x's shape and the target dtype (a torch
            tensor that requires grad is refused while grad mode is on, as torch's
            ``out=`` operators refuse it).

    Returns:
        A new array (or ``out``) in x's framework, on x's device.
    """
    name = _dtype_arg(dtype)
    if rounding not in ("nearest", "stochastic"):
        raise MemfitValueError(f"rounding: expected 'nearest' or 'stochastic', got {rounding!r}")
    if seed is None:
        seed = secrets.randbits(63)
    elif isinstance(seed, bool) or not isinstance(seed, int):
        raise MemfitTypeError(f"seed: expected an int, got {type(seed).__name__}")
    _arrays.framework(x)
    src = _arrays.as_input(x)
    if out is None:
        result = _arrays.empty(src, tuple(x.shape), name)
    else:
        _arrays.framework(out)
        _arrays.check_out_grad(out, "memfit.cast")
        if tuple(out.shape) != tuple(x.shape):
            raise MemfitValueError(f"out: expected shape {tuple(x.shape)}, got {tuple(out.shape)}")
        if _arrays.dtype_name(out.dtype) != name:
            raise MemfitTypeError(f"out: expected dtype {name}, got {_arrays.dtype_name(out.dtype)}")
        result = out
    _C.cast(src, _arrays.as_input(result), rounding == "stochastic", seed & ((1 << 64) - 1),
            _arrays.stream_of(src))
    return result if out is not None else _arrays.finish(result, x)
