"""quantize_blockwise on blocks whose absmax is tiny: subnormal blocks, the smallest
subnormal, zeros beside a subnormal. 1/absmax overflows to +Inf below absmax 2^-128
(about 2.9e-39): memfit used to return +-absmax for every element and -absmax for
zeros. Blocks below 2^-64 are now brought to [-1, 1] in two exact products
(csrc/include/memfit/quant.h, mf_absmax_scale), so they round trip within the code's
radius like any other block. The same function serves the optimizers' requantization
(tested against torch in test_optim_gradient_patterns.py, denormal pattern, and bit for
bit across the CPU kernels in tests/c/test_optim.c)."""

import numpy as np
import pytest
import torch

import memfit.optim as mo
import memfit.quant as q
from memfit.optim import _core

SMALLEST_SUBNORMAL = np.float32(2.0**-149)


def code_radius(code, signed=True):
    """The largest distance from a point of [-1, 1] (signed) or [0, 1] to the nearest
    entry of ``code``: the quantization error bound, in units of the block's absmax."""
    c = np.sort(np.asarray(code, np.float64))
    return max(np.diff(c).max() / 2, c[0] - (-1.0 if signed else 0.0), 1.0 - c[-1])


def round_trip(x, block_size, code=None):
    s = q.quantize_blockwise(torch.from_numpy(x), block_size=block_size, code=code)
    y = torch.empty(x.size, dtype=torch.float32)
    q.dequantize_blockwise(s, out=y)
    return s, y.numpy()


# numel 512: the binary search; 40960: the CPU's lookup tables (>= 32768 elements)
@pytest.mark.parametrize("numel", [512, 40960])
@pytest.mark.parametrize("scale", [1e-39, 1e-41, 1e-44, 3e-20])
def test_tiny_blocks_round_trip_within_the_code_radius(numel, scale):
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(numel) * scale).astype(np.float32)
    x[::5] = 0.0
    s, y = round_trip(x, 64)
    absmax = s.absmax.numpy()
    want = np.abs(x.reshape(-1, 64)).max(axis=1)
    assert np.array_equal(absmax, want)
    # the radius, plus float32 rounding of x * inv and of code * absmax, plus the
    # rounding of a subnormal product (2^-150, rounded up)
    bound = (code_radius(q.dynamic_map(True)) + 2.0**-22) * np.repeat(absmax, 64).astype(np.float64) + 2.0**-149
    err = np.abs(y.astype(np.float64) - x.astype(np.float64))
    assert (err <= bound).all(), f"max error {err.max():.3g} over a bound of {bound.max():.3g}"
    assert (y[x == 0] == 0).all()  # zeros stay zeros (the signed map has an exact 0)
    assert (np.sign(y) == np.sign(x))[np.abs(x) > bound].all()


def test_smallest_subnormal_block_is_exact():
    """absmax = 2^-149: every element is 0 or +-2^-149, and comes back exactly (it was
    +-absmax for every element, -absmax for the zeros)."""
    x = np.zeros(256, np.float32)
    x[::3] = SMALLEST_SUBNORMAL
    x[1::3] = -SMALLEST_SUBNORMAL
    s, y = round_trip(x, 128)
    assert np.array_equal(s.absmax.numpy(), np.full(2, SMALLEST_SUBNORMAL))
    assert np.array_equal(y, x)
    code = q.dynamic_map(True)
    codes = s.codes.numpy()
    assert (code[codes[x == 0]] == 0).all()
    assert (code[codes[x > 0]] == 1.0).all()


@pytest.mark.parametrize("numel", [512, 40960])
def test_zeros_beside_one_subnormal(numel):
    """A block of zeros and one subnormal: the subnormal is the absmax and comes back
    exactly, the zeros stay 0 (they came back as -absmax)."""
    x = np.zeros(numel, np.float32)
    x[7::64] = np.float32(3e-42)
    x[40::64] = np.float32(-1e-45)  # and a smaller one of the other sign in every block
    s, y = round_trip(x, 64)
    assert (y[x == 0] == 0).all()
    assert np.array_equal(y[7::64], x[7::64])
    assert (y[40::64] <= 0).all() and (np.abs(y[40::64]) <= 2e-45).all()


def test_tiny_blocks_in_bfloat16_and_stochastic_rounding():
    """bfloat16 has float32's exponent range, so its subnormal blocks take the same
    path; stochastic rounding lands on one of the two code values around x / absmax."""
    rng = np.random.default_rng(1)
    x = (rng.standard_normal(1024) * 1e-40).astype(np.float32)
    xb = torch.from_numpy(x).to(torch.bfloat16)
    s = q.quantize_blockwise(xb, block_size=64)
    y = torch.empty(1024, dtype=torch.float32)
    q.dequantize_blockwise(s, out=y)
    xf = xb.float().numpy().astype(np.float64)
    bound = (code_radius(q.dynamic_map(True)) + 2.0**-22) * np.repeat(s.absmax.numpy(), 64) + 2.0**-149
    assert (np.abs(y.numpy() - xf) <= bound).all()
    st = q.quantize_blockwise(torch.from_numpy(x), block_size=64, rounding="stochastic", seed=3)
    q.dequantize_blockwise(st, out=y)
    gap = 2 * code_radius(q.dynamic_map(True)) * np.repeat(st.absmax.numpy(), 64) + 2.0**-149
    assert (np.abs(y.numpy() - x) <= gap).all()


@pytest.mark.parametrize("cls", [mo.AdamW8bit, mo.AdamW4bit, mo.Lion8bit])
def test_optimizer_requantizes_tiny_states(cls):
    """One step on tiny gradients (first moments ~1e-41; second moments subnormal, or 0
    beside them): the states are stored within their code's radius of the float32
    values the step computed, (1 - beta) g and (1 - beta2) g^2, as for any block."""
    gen = torch.Generator().manual_seed(4)
    w = torch.nn.Parameter(torch.randn(8, 512, generator=gen))
    opt = cls([w], min_8bit_size=0)
    g = torch.randn(8, 512, generator=gen) * 1e-40
    g[:, ::4] = 0.0
    g[4:] = torch.randn(4, 512, generator=gen) * 1e-20  # v = 1e-3 g^2 is subnormal
    w.grad = g.clone()
    opt.step()
    st = mo.dequantized_state(opt, w)
    bits = 4 if cls is mo.AdamW4bit else 8
    block = 128 if bits == 4 else 256
    lion = cls is mo.Lion8bit
    beta1, beta2 = opt.defaults["betas"]
    want = {"exp_avg": g * np.float32(1 - (beta2 if lion else beta1))}
    if not lion:
        want["exp_avg_sq"] = (g * g) * np.float32(1 - beta2)
    for name, v in want.items():
        signed = name == "exp_avg"
        code = _core.code_table(bits, signed)
        r = code_radius(code, signed)
        absmax = v.abs().view(8, -1, block).amax(dim=2, keepdim=True).expand(8, -1, block).reshape(8, 512)
        err = (st[name].double() - v.double()).abs()
        assert (err <= (r + 2.0**-22) * absmax.double() + 2.0**-149).all(), name
        if (code == 0).any():  # (the 4-bit second-moment code has no 0)
            assert (st[name][v == 0] == 0).all(), name
    assert torch.isfinite(w).all()
