"""The row-block codec (memfit.optim._blocks) against a NumPy reference, and state-dict
conversion (memfit.optim.convert): torch.optim <-> memfit, bitsandbytes -> memfit, and
memfit format_version 1 -> the current format."""

import os

import numpy as np
import pytest
import torch

import memfit.optim as mo
from memfit import _C
from memfit.optim import _blocks, _core, convert
from quant_reference import reference_dequantize, reference_quantize

DATA = os.path.join(os.path.dirname(__file__), "data")


# ---- the codec -------------------------------------------------------------------------

def _reference_rows(x, rows, bits, code, bs):
    """(codes, absmax, ties) of the row-block layout by the flat NumPy reference applied
    to each row (flat blocks within a row are the row's blocks); 4-bit codes packed."""
    flat = x.detach().cpu().float()
    flat = flat.view(-1) if flat.is_contiguous() else flat.as_strided((flat.numel(),), (1,))
    xs = flat.numpy().reshape(rows, -1)
    per_row = [reference_quantize(r, code, bs) for r in xs]
    idx = np.stack([c for c, _, _ in per_row])
    absmax = np.stack([a for _, a, _ in per_row]).astype(np.float32)
    ties = np.stack([t for _, _, t in per_row])
    if bits == 4:
        even = np.zeros((rows, idx.shape[1] + idx.shape[1] % 2), np.uint8)
        even[:, :idx.shape[1]] = idx
        return even[:, 0::2] | (even[:, 1::2] << 4), absmax, ties, idx
    return idx, absmax, ties, idx


def code_radius(code, signed):
    """The largest distance from a point of [-1, 1] (signed) or [0, 1] to the nearest
    entry of ``code``: the quantization error bound, in units of the block's absmax."""
    c = np.sort(code.astype(np.float64))
    return max(np.diff(c).max() / 2, c[0] - (-1.0 if signed else 0.0), 1.0 - c[-1])


def _indices(codes, bits, length):
    """One code index per element, (rows, length), of 8- or 4-bit codes."""
    return codes.numpy() if bits == 8 else _unpack4(codes, length)


def _unpack4(codes, length):
    c = codes.numpy()
    return np.stack((c & 15, c >> 4), axis=2).reshape(c.shape[0], -1)[:, :length]


CASES = [  # (shape, block_size, channels_last)
    ((3, 100), 64, False),     # rows not a multiple of the block size
    ((5, 129), 64, False),     # odd rows (4 bits: a last high nibble of 0)
    ((1, 300), 128, False),    # one row
    ((301,), 64, False),       # 1-D: one row, odd length
    ((4, 256), 128, False),    # rows of whole blocks
    ((4, 3, 5, 7), 64, False),
    ((4, 3, 5, 7), 64, True),  # channels_last: rows are still dim 0
]


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("signed", [True, False])
@pytest.mark.parametrize("shape,bs,cl", CASES)
def test_codec_matches_numpy_reference(bits, signed, shape, bs, cl):
    gen = torch.Generator().manual_seed(hash((bits, signed, shape, bs, cl)) % 2**31)
    x = torch.randn(shape, generator=gen) * torch.logspace(-3, 2, shape[-1])
    if not signed:
        x = x.abs()
    if x.dim() >= 2 and shape[0] > 2:
        x[1] = 0  # an all-zero row: absmax 0, inv 0, every code the one nearest 0
    if cl:
        x = x.contiguous(memory_format=torch.channels_last)
    code = _core.code_table(bits, signed)
    rows = _blocks.state_rows(x)
    assert rows == (shape[0] if len(shape) >= 2 else 1)
    length = x.numel() // rows
    codes, absmax = _blocks.quantize_state(x, bits, code, bs, rows)
    ref_codes, ref_absmax, ties, ref_idx = _reference_rows(x, rows, bits, code, bs)
    assert absmax.shape == (rows, -(-length // bs)) and absmax.dtype == torch.float32
    assert np.array_equal(absmax.numpy(), ref_absmax)
    if bits == 8:
        assert codes.shape == x.shape and codes.stride() == x.stride()
        got_idx = _blocks._storage(codes).view(rows, length).numpy()
    else:
        assert codes.shape == (rows, (length + 1) // 2)
        got_idx = _unpack4(codes, length)
        if length % 2:
            assert not (codes[:, -1] >> 4).any()  # an odd row's last high nibble is 0
    # the kernel's float32 search and the float64 reference may differ only at exact ties
    assert np.array_equal(got_idx[~ties], ref_idx[~ties])
    assert ties.mean() < 0.01
    # dequantized: code[index] * absmax, one float32 product (exact in float64, rounded once)
    y = _blocks.dequantize_state(codes, absmax, bits, code, bs, like=x)
    assert y.shape == x.shape and y.stride() == x.stride() and y.dtype == torch.float32
    ref_y = np.stack([reference_dequantize(got_idx[r], absmax[r].numpy(), code, bs)
                      for r in range(rows)])
    assert np.array_equal(_blocks._storage(y).view(rows, length).numpy(), ref_y)
    # every value within the code's worst rounding distance times its block's absmax
    blk_absmax = np.repeat(absmax.numpy().astype(np.float64), bs, axis=1)[:, :length]
    err = np.abs(_blocks._storage(y).view(rows, length).numpy().astype(np.float64)
                 - _blocks._storage(x).view(rows, length).numpy())
    # (plus float32 rounding of x * (1/absmax) and of the product: a few ulp of absmax)
    assert (err <= blk_absmax * (code_radius(code, signed) + 2.0**-21)).all()


@pytest.mark.parametrize("bits", [8, 4])
def test_codec_round_trip_and_empty(bits):
    code = _core.code_table(bits, True)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(7, 333, generator=gen)
    codes, absmax = _blocks.quantize_state(x, bits, code, 64, 7)
    y = _blocks.dequantize_state(codes, absmax, bits, code, 64, like=x)
    codes2, absmax2 = _blocks.quantize_state(y, bits, code, 64, 7)
    y2 = _blocks.dequantize_state(codes2, absmax2, bits, code, 64, like=x)
    # a block whose largest |x| is positive dequantizes its maximum to absmax * 1.0:
    # requantizing it gives the same bytes; one whose largest is negative shrinks to
    # absmax * code[0] (the signed codes have no -1), and stays within its error
    same = (absmax2 == absmax)
    assert same.float().mean() > 0.3
    elems = same.repeat_interleave(64, dim=1)[:, :333].numpy()
    assert np.array_equal(_indices(codes2, bits, 333)[elems], _indices(codes, bits, 333)[elems])
    assert torch.equal(y2[elems], y[elems])
    bound = absmax.repeat_interleave(64, dim=1)[:, :333] * (code_radius(code, True) + 2.0**-21)
    assert ((y2 - y).abs() <= bound).all()
    # an empty tensor: no blocks
    e = torch.empty(0, 5)
    c, a = _blocks.quantize_state(e, bits, code, 64, 0)
    assert a.shape == (0, 0) and c.numel() == 0
    assert _blocks.dequantize_state(c, a, bits, code, 64, like=e).shape == (0, 5)


def test_codec_refuses_bad_arguments():
    code8, code4 = _core.code_table(8, True), _core.code_table(4, True)
    x = torch.randn(4, 10)
    with pytest.raises(ValueError, match="values: expected a float32"):
        _blocks.quantize_state(x.double(), 8, code8, 64, 4)
    with pytest.raises(ValueError, match="bits: expected 8 or 4"):
        _blocks.quantize_state(x, 2, code8, 64, 4)
    with pytest.raises(ValueError, match="code: 4-bit states need a code of 16"):
        _blocks.quantize_state(x, 4, code8, 64, 4)
    with pytest.raises(ValueError, match="rows: 3 does not divide"):
        _blocks.quantize_state(x, 8, code8, 64, 3)
    codes, absmax = _blocks.quantize_state(x, 4, code4, 64, 4)
    with pytest.raises(ValueError, match="absmax: expected float32"):
        _blocks.dequantize_state(codes, absmax[:2], 4, code4, 64, like=x)
    with pytest.raises(ValueError, match="codes: expected 4-bit codes"):
        _blocks.dequantize_state(codes[:, :2].contiguous(), absmax, 4, code4, 64, like=x)
    c8, a8 = _blocks.quantize_state(x, 8, code8, 64, 4)
    with pytest.raises(ValueError, match="codes: expected 8-bit codes of the shape"):
        _blocks.dequantize_state(c8.t(), a8, 8, code8, 64, like=x)


def test_code_quantize_binding_checks_arguments():
    code = _core.code_table(4, False)
    x = np.linspace(-0.2, 1.2, 101, dtype=np.float32)
    out = np.empty(101, np.uint8)
    _C.code_quantize(code, x, out)
    # nearest entry of k/16, k = 1..16: below 1/16 -> 0, above 1 -> 15, ties to the lower
    want = np.array([int(np.argmin(np.abs(code.astype(np.float64) - v))) for v in x])
    assert np.array_equal(out, want)
    with pytest.raises(ValueError, match="code: expected 16 or 256 float32 values"):
        _C.code_quantize(code[:15].copy(), x, out)
    with pytest.raises(TypeError, match="x: "):
        _C.code_quantize(code, x.astype(np.float64), out)
    with pytest.raises(ValueError, match="out: expected 101 elements"):
        _C.code_quantize(code, x, out[:100])
    with pytest.raises(TypeError, match="out: expected uint8"):
        _C.code_quantize(code, x, np.empty(101, np.float32))
    with pytest.raises(ValueError, match="x: must be contiguous"):
        _C.code_quantize(code, x[::2], out[:51])
