"""The quantized-state layout of memfit's torch optimizers (ROWBLOCKS, format_version 2),
in torch: the one Python definition of which elements share a block and how a value
becomes a code, bit for bit as the C kernels do it.

For a parameter ``p`` of ``n`` elements there are ``rows = p.shape[0]`` rows when
``p.dim() >= 2`` (and dim 0 is outermost in memory), else one, of ``L = n // rows``
elements each, in storage (memory) order. A row is cut into ``bpr = ceil(L / block_size)`` blocks (the last one may be
partial): blocks never cross a row, so sharding ``p`` along dim 0 shards every state
and absmax the same way.

- absmax: float32 ``(rows, bpr)``, the largest ``|x|`` of each block.
- 8-bit codes: uint8 of ``p``'s shape and memory layout, one code index per element.
- 4-bit codes: uint8 ``(rows, ceil(L / 2))``: element ``c`` of row ``r`` in byte
  ``[r, c // 2]``, the low nibble for even ``c``; an odd row's last high nibble is 0.
- An element ``x`` of block ``(r, j)`` is stored as the index of the code entry nearest
  to ``(x * pre) * inv`` with ``inv = 1 / (absmax[r, j] * pre)`` in float32 (0 for an
  all-zero block) and ``pre = 2**64`` for blocks with absmax below ``2**-64`` (where
  ``1 / absmax`` may overflow), else 1; ties to the lower index. A non-negative state
  (second moments) never stores a positive ``x`` as an entry ``<= 0``: it takes the
  smallest positive entry instead (``keep_positive``; docs/optim.md). It reads back as
  ``code[index] * absmax[r, j]``.

Format 1 (flat blocks over the whole storage, absmax ``(ceil(n / block_size),)``,
4-bit codes ``(ceil(n / 2),)``) is this layout with one row: ``rows=1``.

    >>> import torch  # doctest: +SKIP
    >>> from memfit.optim import _core, _blocks  # doctest: +SKIP
    >>> x = torch.randn(3, 1000)  # doctest: +SKIP
    >>> code = _core.code_table(8, signed=True)  # doctest: +SKIP
    >>> codes, absmax = _blocks.quantize_state(x, 8, code, 256, rows=3)  # doctest: +SKIP
    >>> absmax.shape  # doctest: +SKIP
    torch.Size([3, 4])
    >>> y = _blocks.dequantize_state(codes, absmax, 8, code, 256, like=x)  # doctest: +SKIP
"""

from __future__ import annotations

import numpy as np
import torch

from memfit import _arrays, _C

__all__ = ["dequantize_state", "quantize_state", "row_length", "state_rows"]


def state_rows(p) -> int:
    """Rows of ``p``'s quantized states (blocks never cross one): ``p.shape[0]`` for a
    tensor of two or more dimensions whose dim 0 is the outermost in memory (row-major
    or channels_last: a row is then a contiguous run of the storage), else 1."""
    if p.dim() < 2:
        return 1
    dense_rows = p.is_contiguous() \
        or (p.dim() == 4 and p.is_contiguous(memory_format=torch.channels_last)) \
        or (p.dim() == 5 and p.is_contiguous(memory_format=torch.channels_last_3d))
    return max(int(p.shape[0]), 1) if dense_rows else 1


def row_length(numel: int, rows: int) -> int:
    """Elements per row (0 for an empty tensor)."""
    return numel // rows if rows else 0


def _blocks_per_row(length: int, block_size: int) -> int:
    return -(-length // block_size)


def _storage(t):
    """A dense tensor's storage as a flat tensor, in memory order (a view, never a
    copy: the order the kernels run over; for row-major tensors the usual flat view)."""
    if t.is_contiguous():
        return t.view(-1)
    expected = 1  # dense: the strides, sorted, are the running products of the sizes
    for stride, size in sorted((st, sz) for st, sz in zip(t.stride(), t.shape) if sz != 1):
        if stride != expected:
            raise ValueError(f"expected a dense tensor, got one of shape {tuple(t.shape)} and "
                             f"strides {tuple(t.stride())}")
        expected *= size
    return t.as_strided((t.numel(),), (1,))


def _code_tensor(code, device) -> torch.Tensor:
    if isinstance(code, np.ndarray):
        code = torch.from_numpy(np.ascontiguousarray(code, dtype=np.float32))
    if not torch.is_tensor(code) or code.dtype != torch.float32 or code.dim() != 1 \
            or code.numel() not in (16, 256):
        raise ValueError("code: expected a sorted float32 table of 16 or 256 values")
    return code.to(device)


def _check_bits(bits, code) -> None:
    if bits not in (4, 8):
        raise ValueError(f"bits: expected 8 or 4, got {bits!r}")
    if code.numel() != (1 << bits):
        raise ValueError(f"code: {bits}-bit states need a code of {1 << bits} values, "
                         f"got {code.numel()}")


def _pad_rows(x, width):
    """x (rows, L) widened to (rows, width) with zeros (a zero changes no absmax)."""
    if x.shape[1] == width:
        return x.contiguous()
    out = torch.zeros((x.shape[0], width), dtype=x.dtype, device=x.device)
    out[:, :x.shape[1]] = x
    return out


def quantize_state(values, bits: int, code, block_size: int, rows: int,
                   keep_positive: bool = False):
    """Quantizes float32 ``values`` (a dense tensor of a parameter's shape and memory
    layout, ``rows`` rows as :func:`state_rows` gives them) into ``(codes, absmax)`` of
    the layout above, with the bits an optimizer step's requantization gives them.

    Args:
        values: float32 tensor, dense (row-major or another dense layout), finite.
        bits: 8 or 4.
        code: the sorted float32 code table (256 or 16 values; NumPy or torch).
        block_size: elements per block, one of memfit.quant.BLOCK_SIZES.
        rows: rows of the layout (``state_rows(param)``; 1 for format 1).
        keep_positive: the values are a non-negative state (a second moment): a
            positive value never takes a code entry ``<= 0`` (the kernels' rule for
            such states).

    Returns:
        ``codes`` (uint8: ``values``' shape and layout for 8 bits, ``(rows, ceil(L/2))``
        for 4) and ``absmax`` (float32 ``(rows, ceil(L / block_size))``), on values'
        device. 4-bit codes of CUDA values are searched on the CPU (one copy each way):
        the code search is the CPU kernel's own (memfit._C.code_quantize).
    """
    if not torch.is_tensor(values) or values.dtype != torch.float32:
        raise ValueError(f"values: expected a float32 tensor, got "
                         f"{values.dtype if torch.is_tensor(values) else type(values).__name__}")
    code_t = _code_tensor(code, values.device)
    _check_bits(bits, code_t)
    n = values.numel()
    rows = int(rows)
    if rows < 0 or (n and (rows == 0 or n % rows)):
        raise ValueError(f"rows: {rows} does not divide the {n} elements of values")
    length = row_length(n, rows)
    bpr = _blocks_per_row(length, block_size)
    absmax = torch.zeros((rows, bpr), dtype=torch.float32, device=values.device)
    if bits == 8:
        codes = torch.empty_like(values, dtype=torch.uint8)
    else:
        codes = torch.zeros((rows, (length + 1) // 2), dtype=torch.uint8, device=values.device)
    if n == 0:
        return codes, absmax
    x = _pad_rows(_storage(values).view(rows, length), bpr * block_size)
    if bits == 8:
        # the C blockwise quantizer over the padded rows: flat blocks of block_size are
        # then exactly the row blocks (its absmax, 1/absmax and code search are the
        # kernel's: csrc/include/memfit/quant.h)
        padded = torch.empty_like(x, dtype=torch.uint8)
        _C.quantize_blockwise(x, code_t, padded, absmax, block_size, False, 0,
                              _arrays.stream_of(x))
        if keep_positive:  # nearest, then mf_quantize_keep_positive_n's correction
            first_positive = int(torch.searchsorted(code_t.cpu(), torch.tensor(0.0), right=True))
            if first_positive < code_t.numel():
                moved = (x > 0) & (code_t[padded.long()] <= 0)
                padded[moved] = first_positive
        _storage(codes).view(rows, length).copy_(padded[:, :length])
        return codes, absmax
    blocks = x.view(rows, bpr, block_size)
    torch.amax(blocks.abs(), dim=2, out=absmax)
    # (x * pre) * inv in float32 as the kernel's mf_absmax_scale / mf_block_normalize:
    # inv = 1 / (absmax * pre), 0 for an all-zero block; pre = 2^64 below absmax 2^-64
    pre = torch.where(absmax < 2.0**-64, 2.0**64, 1.0).to(torch.float32)
    inv = torch.where(absmax > 0, torch.ones_like(absmax).div(absmax * pre),
                      torch.zeros_like(absmax))
    scaled = ((blocks * pre.unsqueeze(2)) * inv.unsqueeze(2)).view(rows, -1)[:, :length]
    host = scaled.contiguous().cpu()
    index = torch.empty_like(host, dtype=torch.uint8)
    _C.code_quantize(code_t.cpu(), host, index, bool(keep_positive))
    index = index.to(values.device)
    codes[:, :length // 2] = index[:, 0:length - 1:2] | (index[:, 1::2] << 4)
    if length % 2:
        codes[:, -1] = index[:, -1]
    return codes, absmax


def dequantize_state(codes, absmax, bits: int, code, block_size: int, like, rows=None):
    """float32 values of quantized states: a new tensor of ``like``'s shape, memory
    layout and device, element ``x`` of block ``(r, j)`` being ``code[index] *
    absmax[r, j]`` (one float32 product, as the kernels dequantize).

    Args:
        codes, absmax: as :func:`quantize_state` returns them (4-bit codes and absmax
            may also be flat, as format 1 keeps them).
        bits: 8 or 4.
        code: the code table the states were quantized with.
        block_size: elements per block.
        like: the parameter (or any tensor of its shape and layout).
        rows: rows of the layout; default ``state_rows(like)`` (1 for format 1 states).
    """
    code_t = _code_tensor(code, codes.device)
    _check_bits(bits, code_t)
    out = torch.empty_like(like, dtype=torch.float32, device=codes.device)
    n = out.numel()
    rows = state_rows(like) if rows is None else int(rows)
    length = row_length(n, rows)
    bpr = _blocks_per_row(length, block_size)
    if codes.dtype != torch.uint8:
        raise ValueError(f"codes: expected uint8, got {codes.dtype}")
    if bits == 8:
        if tuple(codes.shape) != tuple(out.shape) or any(
                a != b for a, b, s in zip(codes.stride(), out.stride(), out.shape) if s > 1):
            raise ValueError(f"codes: expected 8-bit codes of the shape {tuple(out.shape)} and "
                             f"strides {tuple(out.stride())} of like, got {tuple(codes.shape)} "
                             f"{tuple(codes.stride())}")
    elif codes.numel() != rows * ((length + 1) // 2) or not codes.is_contiguous():
        raise ValueError(f"codes: expected 4-bit codes ({rows}, {(length + 1) // 2}) for {rows} "
                         f"rows of {length} elements, got {tuple(codes.shape)}")
    if absmax.dtype != torch.float32 or absmax.numel() != rows * bpr:
        raise ValueError(f"absmax: expected float32 ({rows}, {bpr}) for {rows} rows of {length} "
                         f"elements in blocks of {block_size}, got {absmax.dtype} "
                         f"{tuple(absmax.shape)}")
    if n == 0:
        return out
    if bits == 8:
        index = _storage(codes).view(rows, length)
    else:
        codes = codes.reshape(rows, -1)
        index = torch.stack((codes & 15, codes >> 4), dim=2).view(rows, -1)[:, :length]
    index = _pad_rows(index.long(), bpr * block_size).view(rows, bpr, block_size)
    values = code_t[index] * absmax.reshape(rows, bpr, 1)
    _storage(out).view(rows, length).copy_(values.view(rows, -1)[:, :length])
    return out
