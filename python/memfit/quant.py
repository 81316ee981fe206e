"""Blockwise dynamic quantization (the storage format of memfit's 8-bit optimizers).

An array is cut into blocks of ``block_size`` elements. Each block keeps its absolute
maximum (float32) and each element the uint8 index of the nearest value of a
256-entry *code* after dividing by that absmax. With the dynamic (tree) map of
Dettmers et al. (2022) the code is dense near zero, which is where optimizer states
live, so 8 bits lose little.

    >>> import numpy as np, memfit.quant as q
    >>> x = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    >>> state = q.quantize_blockwise(x, block_size=256)
    >>> y = q.dequantize_blockwise(state)
    >>> float(np.abs(x - y).mean()) < 0.011
    True

Works the same on torch tensors (CPU or CUDA: results stay on the input's device), on
NumPy arrays (``ml_dtypes.bfloat16`` included), CuPy and JAX arrays.

Non-finite input: a block that contains NaN or +-Inf gets ``absmax = NaN`` and every
element of that block dequantizes to NaN; other blocks are unaffected. Nothing is
silently replaced and no device-to-host sync is needed to find out: check
``isnan(state.absmax)``.
"""

from __future__ import annotations

import secrets
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

from memfit import _C, _arrays
from memfit._C import MemfitTypeError, MemfitValueError

__all__ = [
    "BLOCK_SIZES",
    "QuantState",
    "dequantize_blockwise",
    "dynamic_map",
    "linear_map",
    "quantize_blockwise",
]

BLOCK_SIZES = _C.quant_block_sizes()  # 64, 128, ..., 4096 (csrc/include/memfit/quant.h)


def dynamic_map(signed: bool = True, total_bits: int = 8, max_exponent_bits: int = 7) -> np.ndarray:
    """The dynamic (tree) quantization code of Dettmers et al. 2022, as a sorted
    float32 NumPy array of ``2**total_bits`` values in [-1, 1].

    Construction: each value is ``10**e * f``. For exponent index ``i = 0 ..
    max_exponent_bits - 1`` the exponent is ``e = i - (max_exponent_bits - 1)`` (so
    1e-6 .. 1 for 8 bits) and the fractions ``f`` are the midpoints of ``F_i + 1``
    evenly spaced points in [0.1, 1], with ``F_i = 2**(i + S - E)`` signed and
    ``2**(i + S - E + 1)`` unsigned (``S = total_bits - 1``, ``E =
    max_exponent_bits``): larger exponents get more fractions. Signed codes take every
    value with both signs; unsigned codes spend the sign bit on one more fraction
    bit. ``2**(S - E) - 1`` extra fractions go to the top exponent, then 0 and 1.0 are
    added and zeros pad the table to ``2**total_bits`` entries.

    For 8 bits: signed has 127 positive and 127 negative tree values plus 0 and 1.0;
    unsigned has 254 positive values plus 0 and 1.0.

    >>> code = dynamic_map(signed=True)
    >>> code.shape, bool(code.min() < -0.99), float(code.max())
    ((256,), True, 1.0)
    """
    out = _map_buffer(total_bits)
    _C.dynamic_map(out, bool(signed), int(total_bits), _int_arg(max_exponent_bits, "max_exponent_bits"))
    return out


def linear_map(signed: bool = True, total_bits: int = 8) -> np.ndarray:
    """Evenly spaced code: signed spans [-1, 1] with an exact 0 (255 distinct values
    and a spare 0), unsigned spans [0, 1]. Sorted float32 NumPy array."""
    out = _map_buffer(total_bits)
    _C.linear_map(out, bool(signed), int(total_bits))
    return out


def _map_buffer(total_bits) -> np.ndarray:
    # An out-of-range total_bits gets an empty buffer; the core then names the
    # argument and its valid range.
    bits = _int_arg(total_bits, "total_bits")
    return np.empty(1 << bits if 2 <= bits <= 8 else 0, dtype=np.float32)


def _int_arg(v, name: str) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise MemfitTypeError(f"{name}: expected an int, got {type(v).__name__}")
    return int(v)


@dataclass
class QuantState:
    """A blockwise-quantized array.

    Attributes:
        codes: uint8 array of the original shape (one code index per element).
        absmax: float32 array with one absolute maximum per block.
        code: the 256-entry float32 code table the indices refer to.
        block_size: elements per block (the last block may be partial).
        shape: the original shape.
        dtype: the original dtype (in the original framework).
    """

    codes: Any
    absmax: Any
    code: Any
    block_size: int
    shape: tuple
    dtype: Any

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= int(s)
        return n

    @property
    def nbytes(self) -> int:
        """Bytes held by the codes and the absmax (the code table is shared)."""
        return self.numel + 4 * _num_blocks(self.numel, self.block_size)


def _num_blocks(numel: int, block_size: int) -> int:
    return (numel + block_size - 1) // block_size


_code_cache: dict = {}
_code_lock = threading.Lock()


def _default_code(like, signed: bool = True):
    """The 8-bit dynamic map in `like`'s framework and device, built once per device."""
    key = (_arrays.device_key(like), signed)
    with _code_lock:
        code = _code_cache.get(key)
        if code is None:
            code = _arrays.to_like(dynamic_map(signed=signed), like)
            _code_cache[key] = code
    return code


def quantize_blockwise(x, block_size: int = 256, code=None, rounding: str = "nearest",
                       seed: int | None = None) -> QuantState:
    """Quantize ``x`` blockwise to uint8 codes plus one float32 absmax per block.

    Args:
        x: float32, float16 or bfloat16 array (torch, NumPy, CuPy, JAX), contiguous,
            non-empty, any shape; the last block may be partial.
        block_size: 64, 128, 256, 512, 1024, 2048 or 4096.
        code: sorted float32 table of 256 values in [-1, 1] on x's device; default:
            the signed dynamic map (:func:`dynamic_map`).
        rounding: ``"nearest"`` (nearest code value, ties to the lower) or
            ``"stochastic"`` (rounds up with probability proportional to the distance,
            so the expected dequantized value equals x).
        seed: seed for stochastic rounding (reproducible); random when None.

    Returns:
        A :class:`QuantState` whose arrays live in x's framework and device.

    Raises:
        TypeError: x is not an array, or has an unsupported dtype.
        ValueError: empty or non-contiguous x, bad block size, bad code, mixed devices.

    >>> import torch  # doctest: +SKIP
    >>> s = quantize_blockwise(torch.randn(4096), block_size=128)  # doctest: +SKIP
    >>> s.codes.dtype, s.absmax.shape  # doctest: +SKIP
    (torch.uint8, torch.Size([32]))
    """
    block_size = _int_arg(block_size, "block_size")
    if rounding not in ("nearest", "stochastic"):
        raise MemfitValueError(f"rounding: expected 'nearest' or 'stochastic', got {rounding!r}")
    if seed is None:
        seed = secrets.randbits(63)
    else:
        seed = _int_arg(seed, "seed") & ((1 << 64) - 1)
    _arrays.framework(x)  # TypeError for non-arrays, before anything is allocated
    src = _arrays.as_input(x)
    if code is None:
        code = _default_code(src)
    shape = tuple(x.shape)
    numel = int(np.prod(shape, dtype=np.int64)) if shape else 1
    if block_size not in BLOCK_SIZES:
        # the core checks too; checking here avoids allocating for a doomed call
        raise MemfitValueError(f"block_size: must be one of {', '.join(map(str, BLOCK_SIZES))}, got {block_size}")
    codes = _arrays.empty(src, shape, "uint8")
    absmax = _arrays.empty(src, (_num_blocks(numel, block_size),), "float32")
    _C.quantize_blockwise(src, code, codes, absmax, block_size, rounding == "stochastic",
                          seed, _arrays.stream_of(src))
    return QuantState(
        codes=_arrays.finish(codes, x),
        absmax=_arrays.finish(absmax, x),
        code=code,
        block_size=block_size,
        shape=shape,
        dtype=x.dtype,
    )


def dequantize_blockwise(state: QuantState, out=None):
    """Reconstruct the array a :class:`QuantState` was made from.

    Each element becomes ``code[codes[i]] * absmax[i // block_size]``, converted to
    the original dtype (round to nearest even for float16/bfloat16).

    Args:
        state: what :func:`quantize_blockwise` returned.
        out: optional preallocated array of ``state.shape`` (float32, float16 or
            bfloat16, contiguous, on the state's device) to write into.

    Returns:
        ``out`` if given, else a new array of the original shape and dtype, in the
        state's framework and on its device.
    """
    if not isinstance(state, QuantState):
        raise MemfitTypeError(f"state: expected a QuantState, got {type(state).__name__}")
    codes = _arrays.as_input(state.codes)
    if out is None:
        result = _arrays.empty(codes, state.shape, _arrays.dtype_name(state.dtype))
    else:
        _arrays.framework(out)
        _arrays.check_out_grad(out, "dequantize_blockwise")
        if tuple(out.shape) != tuple(state.shape):
            raise MemfitValueError(f"out: expected shape {tuple(state.shape)}, got {tuple(out.shape)}")
        result = out
    _C.dequantize_blockwise(codes, _arrays.as_input(state.absmax), _arrays.as_input(state.code),
                            _arrays.as_input(result), state.block_size, _arrays.stream_of(codes))
    return result if out is not None else _arrays.finish(result, state.codes)
