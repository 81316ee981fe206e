"""Matrix products with float32 accumulation (memfit.amp.matmul, memfit.nn.functional.linear).

Framework-neutral: takes torch, NumPy (bfloat16 via ml_dtypes), CuPy or JAX arrays and
returns results in the same framework on the same device. On the CPU the product runs
in memfit's blocked C kernel; on CUDA in memfit's tiled kernel.
"""

from __future__ import annotations

from memfit import _C, _arrays
from memfit._C import MemfitTypeError, MemfitValueError

ACTIVATIONS = {None: 0, "none": 0, "relu": 1, "gelu": 2}
_FLOATS = ("float32", "float16", "bfloat16")


def activation_code(activation) -> int:
    try:
        return ACTIVATIONS[activation]
    except (KeyError, TypeError):
        raise MemfitValueError(f"activation: expected None, 'relu' or 'gelu', got {activation!r}") from None


def _out_dtype(out_dtype, like_name: str) -> str:
    if out_dtype is None:
        return like_name
    name = out_dtype if isinstance(out_dtype, str) else _arrays.dtype_name(out_dtype)
    if name not in _FLOATS:
        raise MemfitTypeError(f"out_dtype: expected float32, float16 or bfloat16, got {out_dtype}")
    return name


def gemm(a, b, *, trans_a=False, trans_b=False, bias=None, activation=None, out_dtype=None,
         save_pre=False):
    """op(a)[m, k] @ op(b)[k, n] (+ bias) (-> activation), float32 accumulation.

    ``a`` may have leading batch dimensions when not transposed (they are flattened
    into m). Returns ``(out, pre)`` where ``pre`` is the pre-activation (or None)."""
    act = activation_code(activation)
    _arrays.framework(a)
    _arrays.framework(b)
    if len(b.shape) != 2:
        raise MemfitValueError(f"b: expected a 2-D array, got shape {tuple(b.shape)}")
    if trans_a and len(a.shape) != 2:
        raise MemfitValueError(f"a: a transposed operand must be 2-D, got shape {tuple(a.shape)}")
    if len(a.shape) < 1:
        raise MemfitValueError("a: expected at least 1 dimension")
    if trans_a:
        k, m = a.shape
        lead = (m,)
    else:
        k = a.shape[-1]
        lead = tuple(a.shape[:-1])
        m = 1
        for s in lead:
            m *= int(s)
    kb, n = (b.shape[1], b.shape[0]) if trans_b else (b.shape[0], b.shape[1])
    if kb != k:
        raise MemfitValueError(
            f"a and b: inner dimensions differ ({k} vs {kb}) for shapes {tuple(a.shape)} and {tuple(b.shape)}"
            + (" (b is used transposed)" if trans_b else ""))
    if bias is not None and tuple(bias.shape) != (n,):
        raise MemfitValueError(f"bias: expected shape ({n},), got {tuple(bias.shape)}")
    src_a, src_b = _arrays.as_input(a), _arrays.as_input(b)
    name = _out_dtype(out_dtype, _arrays.dtype_name(a.dtype))
    out = _arrays.empty(src_a, lead + (n,), name)
    pre = _arrays.empty(src_a, lead + (n,), name) if save_pre and act else None
    _C.gemm(src_a, bool(trans_a), src_b, bool(trans_b), out, int(m), int(n), int(k),
            None if bias is None else _arrays.as_input(bias), act, pre, _arrays.stream_of(src_a))
    return _arrays.finish(out, a), (None if pre is None else _arrays.finish(pre, a))


def matmul(a, b, out_dtype=None):
    """``a @ b`` with float16/bfloat16 (or float32) inputs and float32 accumulation.

    Args:
        a: array of shape ``[..., k]`` (leading dimensions are batch).
        b: array of shape ``[k, n]``, same dtype and device as ``a``.
        out_dtype: dtype of the result (default: the inputs' dtype).

    >>> import torch, memfit.amp  # doctest: +SKIP
    >>> memfit.amp.matmul(torch.randn(8, 64, dtype=torch.bfloat16),
    ...                   torch.randn(64, 32, dtype=torch.bfloat16)).shape  # doctest: +SKIP
    torch.Size([8, 32])
    """
    return gemm(a, b, out_dtype=out_dtype)[0]


def activation_backward(grad_output, pre, activation, out_dtype=None):
    """grad_output * activation'(pre), elementwise."""
    act = activation_code(activation)
    src = _arrays.as_input(grad_output)
    out = _arrays.empty(src, tuple(grad_output.shape), _out_dtype(out_dtype, _arrays.dtype_name(grad_output.dtype)))
    _C.act_backward(src, _arrays.as_input(pre), out, act, _arrays.stream_of(src))
    return _arrays.finish(out, grad_output)
