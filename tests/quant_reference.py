"""NumPy references for blockwise quantization, written independently of the C code.

`reference_quantize` replays the kernel's float32 arithmetic (absmax, 1/absmax, x*inv)
with NumPy and picks the nearest code value by exhaustive search in float64, so the
only freedom left to the kernel is an exact tie between two code values.
"""

import numpy as np


def dynamic_map_reference(signed=True, total_bits=8, max_exponent_bits=7):
    """Straight from the paper's description, in float64."""
    values = []
    s = total_bits - 1
    e = max_exponent_bits
    for i in range(e):
        n = 2 ** (i + s - e) if signed else 2 ** (i + s - e + 1)
        pts = np.linspace(0.1, 1.0, n + 1)
        mids = (pts[:-1] + pts[1:]) / 2 * 10.0 ** (i - (e - 1))
        values += list(mids)
        if signed:
            values += list(-mids)
    extra = 2 ** (s - e) - 1
    if extra > 0:
        pts = np.linspace(0.1, 1.0, extra + 1)
        mids = (pts[:-1] + pts[1:]) / 2
        values += list(mids) + (list(-mids) if signed else [])
    values += [0.0, 1.0]
    values += [0.0] * (2**total_bits - len(values))
    return np.sort(np.array(values, dtype=np.float64))


def block_absmax(x32, block_size):
    n = x32.size
    nb = -(-n // block_size)
    pad = np.zeros(nb * block_size, dtype=np.float32)
    pad[:n] = np.abs(x32.ravel())
    return pad.reshape(nb, block_size).max(axis=1)


def reference_quantize(x, code, block_size):
    """(codes, absmax, ties) for a float array x; `ties` marks elements where two code
    values are exactly equally near (either answer is right)."""
    x32 = np.asarray(x, dtype=np.float32).ravel()
    absmax = block_absmax(x32, block_size)
    inv = np.where(absmax > 0, np.float32(1.0) / np.maximum(absmax, np.float32(1e-38)), np.float32(0))
    inv = inv.astype(np.float32)
    xn = (x32 * np.repeat(inv, block_size)[: x32.size]).astype(np.float32)
    codes = np.empty(xn.size, np.uint8)
    ties = np.empty(xn.size, bool)
    c64 = code.astype(np.float32).astype(np.float64)[None, :]
    for start in range(0, xn.size, 4096):  # chunks keep the distance matrix small
        dist = np.abs(xn[start:start + 4096].astype(np.float64)[:, None] - c64)
        rows = np.arange(dist.shape[0])
        best_idx = dist.argmin(axis=1)
        best = dist[rows, best_idx]
        dist[rows, best_idx] = np.inf
        codes[start:start + 4096] = best_idx
        ties[start:start + 4096] = dist.min(axis=1) == best
    return codes, absmax, ties


def reference_dequantize(codes, absmax, code, block_size):
    c = np.asarray(code, dtype=np.float32)[np.asarray(codes).ravel()]
    return (c * np.repeat(np.asarray(absmax, np.float32), block_size)[: c.size]).astype(np.float32)
