"""Float casts: nearest-even bit-identical to torch over widely sampled and edge-case
bit patterns; stochastic rounding reproducible, neighbour-only and unbiased; range
rules; bad input."""

import numpy as np
import pytest

import memfit

torch = pytest.importorskip("torch")
ml_dtypes = pytest.importorskip("ml_dtypes")


def f32_from_bits(bits):
    return torch.from_numpy(np.asarray(bits, dtype=np.uint32).view(np.float32).copy())


def wide_sample(n=1 << 21, seed=0):
    """Random bit patterns over the whole float32 range, plus every bf16-upper-half
    combined with the low halves that decide rounding (ties, just below/above)."""
    g = np.random.default_rng(seed)
    rand = g.integers(0, 1 << 32, size=n, dtype=np.uint64).astype(np.uint32)
    hi = np.arange(1 << 16, dtype=np.uint32) << 16
    lows = np.array([0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF], dtype=np.uint32)
    return np.concatenate([rand, (hi[:, None] | lows[None, :]).ravel()])


def f16_boundaries():
    """For every float16 value: the float32 midpoint to the next one, and 1 ulp either
    side, plus hand-picked edge cases (subnormals, max, overflow threshold, inf, NaN)."""
    h = np.arange(0x7C00, dtype=np.uint16)  # all finite non-negative float16
    v = h.view(np.float16).astype(np.float64)
    nxt = np.append(v[1:], 65536.0)
    mid = ((v + nxt) / 2).astype(np.float32).view(np.uint32)
    pts = np.concatenate([mid - 1, mid, mid + 1, v.astype(np.float32).view(np.uint32)])
    edge = np.array([0.0, -0.0, 2**-24, 2**-25, 2**-25 * 1.0000001, 3 * 2**-26, 2**-14, 2**-14 * (1 - 2**-11),
                     65504.0, 65519.996, 65520.0, 65536.0, 1e10, np.inf, -np.inf, np.nan, 1e-45, -1e-45],
                    dtype=np.float32).view(np.uint32)
    pts = np.concatenate([pts, edge])
    return np.concatenate([pts, pts | np.uint32(0x80000000)])


def assert_same_bits(a, b):
    a_bits = a.view(torch.int16).numpy() if a.element_size() == 2 else a.view(torch.int32).numpy()
    b_bits = b.view(torch.int16).numpy() if b.element_size() == 2 else b.view(torch.int32).numpy()
    nan = torch.isnan(a.float()).numpy()
    assert np.array_equal(nan, torch.isnan(b.float()).numpy()), "NaN positions differ"
    diff = np.nonzero((a_bits != b_bits) & ~nan)[0]
    assert diff.size == 0, f"{diff.size} elements differ, first at {diff[:5]}"


@pytest.mark.parametrize("target", ["bfloat16", "float16"])
def test_nearest_even_matches_torch_bit_for_bit(target):
    bits = np.concatenate([wide_sample(), f16_boundaries()])
    x = f32_from_bits(bits)
    tdt = getattr(torch, target)
    assert_same_bits(memfit.cast(x, tdt), x.to(tdt))


@pytest.mark.parametrize("source", ["bfloat16", "float16"])
def test_widening_is_exact_for_every_pattern(source):
    h = torch.from_numpy(np.arange(1 << 16, dtype=np.uint16).view(np.int16)).view(getattr(torch, source))
    assert_same_bits(memfit.cast(h, torch.float32), h.float())


def test_cast_between_half_types_goes_through_float32():
    h = torch.from_numpy(np.arange(1 << 16, dtype=np.uint16).view(np.int16)).view(torch.float16)
    assert_same_bits(memfit.cast(h, torch.bfloat16), h.float().to(torch.bfloat16))


def neighbours(x, tdt):
    """The representable values of tdt just below and just above each x (equal when x
    is representable), from a sorted table of every finite value of the type."""
    allv = torch.from_numpy(np.arange(1 << 16, dtype=np.uint16).view(np.int16)).view(tdt).double()
    allv = torch.unique(allv[torch.isfinite(allv)])  # sorted
    xd = x.double()
    hi_idx = torch.searchsorted(allv, xd)  # first value >= x
    up = allv[hi_idx]
    down = torch.where(up == xd, up, allv[(hi_idx - 1).clamp_min(0)])
    return down, up


@pytest.mark.parametrize("target,scale", [("bfloat16", 1.0), ("float16", 1.0), ("float16", 2**-20)])
def test_stochastic_is_unbiased_reproducible_and_neighbour_only(target, scale):
    tdt = getattr(torch, target)
    g = torch.Generator().manual_seed(1)
    x = (torch.rand(2048, generator=g) * 2 - 1) * scale
    draws = torch.stack([memfit.cast(x, tdt, rounding="stochastic", seed=s).double() for s in range(1000)])
    down, up = neighbours(x, tdt)
    assert torch.all((draws == down) | (draws == up)), "a draw is not a neighbour of x"
    # unbiased: the mean of the draws is within 4 standard errors of x almost everywhere
    err = (draws.mean(0) - x.double()).abs()
    se = (up - down) * 0.5 / np.sqrt(draws.shape[0]) + 1e-300
    assert (err <= 4 * se).double().mean() > 0.995
    # and the probability of rounding up is the distance fraction: check in aggregate
    p_up = (draws == up).double().mean(0)
    frac = torch.where(up > down, (x.double() - down) / (up - down), torch.zeros_like(up))
    assert (p_up - frac).abs().mean() < 0.02
    # reproducible by seed, different across seeds
    a = memfit.cast(x, tdt, rounding="stochastic", seed=5)
    assert torch.equal(a.view(torch.int16), memfit.cast(x, tdt, rounding="stochastic", seed=5).view(torch.int16))
    assert not torch.equal(a.view(torch.int16), memfit.cast(x, tdt, rounding="stochastic", seed=6).view(torch.int16))


def test_stochastic_keeps_small_updates_on_average():
    # the reason stochastic rounding exists: w + tiny update, cast to bf16, loses the update
    w = torch.ones(100_000)
    upd = w + 1e-4  # far below half a bf16 ulp at 1.0 (2^-8)
    assert memfit.cast(upd, torch.bfloat16).float().mean().item() == 1.0
    sr = memfit.cast(upd, torch.bfloat16, rounding="stochastic", seed=3).float().mean().item()
    assert abs(sr - (1 + 1e-4)) < 2e-5


def test_stochastic_float16_subnormals_and_range_rules():
    tiny = torch.full((200_000,), 0.3 * 2**-24)
    m = memfit.cast(tiny, torch.float16, rounding="stochastic", seed=0).float().mean().item()
    assert abs(m - 0.3 * 2**-24) < 0.01 * 2**-24
    x = torch.tensor([65510.0, -65510.0, 65519.0, 65520.0, 70000.0, float("inf"), -float("inf"), float("nan")])
    y = memfit.cast(x, torch.float16, rounding="stochastic", seed=0).float()
    assert y[:3].tolist() == [65504.0, -65504.0, 65504.0]  # never rounds up to inf
    assert y[3:7].tolist() == [float("inf"), float("inf"), float("inf"), -float("inf")]
    assert torch.isnan(y[7])
    big = torch.tensor([3.3961e38, 3.4e38, float("nan")])
    yb = memfit.cast(big, torch.bfloat16, rounding="stochastic", seed=0).float()
    assert torch.isfinite(yb[0]) and yb[1] == float("inf") and torch.isnan(yb[2])


def test_numpy_bfloat16_target():
    x = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    y = memfit.cast(x, "bfloat16")
    assert y.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(y.view(np.uint16), x.astype(ml_dtypes.bfloat16).view(np.uint16))


def test_out_argument_and_errors():
    x = torch.randn(100)
    out = torch.empty(100, dtype=torch.bfloat16)
    assert memfit.cast(x, torch.bfloat16, out=out) is out
    with pytest.raises(TypeError, match="dtype: expected float32, float16 or bfloat16"):
        memfit.cast(x, torch.int32)
    with pytest.raises(TypeError, match="x: unsupported dtype"):
        memfit.cast(torch.arange(10), torch.float16)
    with pytest.raises(ValueError, match="out: expected shape"):
        memfit.cast(x, torch.bfloat16, out=torch.empty(10, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="out: expected dtype bfloat16"):
        memfit.cast(x, torch.bfloat16, out=torch.empty(100, dtype=torch.float16))
    with pytest.raises(ValueError, match="x: must be contiguous"):
        memfit.cast(torch.randn(10, 10).t(), torch.float16)
    with pytest.raises(ValueError, match="rounding: expected"):
        memfit.cast(x, torch.float16, rounding="down")
    assert memfit.cast(torch.empty(0), torch.float16).shape == (0,)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_cuda_same_dtype_cast_keeps_nan_payloads(dtype):
    """A same-dtype cast is a byte copy on both devices (cudaMemcpyAsync on the GPU), so
    NaN payloads and signs survive bit for bit, as on the CPU; in place is a no-op."""
    tdt = getattr(torch, dtype)
    bits = {"float32": [0x7FC00001, 0xFFBFFFFF, 0x7F800001, 0x7F800000, 0x3F800000, 0x80000000],
            "float16": [0x7E01, 0xFDFF, 0x7C01, 0x7C00, 0x3C00, 0x8000],
            "bfloat16": [0x7FC1, 0xFFBF, 0x7F81, 0x7F80, 0x3F80, 0x8000]}[dtype]
    itype = torch.int32 if dtype == "float32" else torch.int16
    raw = torch.tensor([b - (1 << 32) if itype == torch.int32 and b >= 1 << 31
                        else b - (1 << 16) if itype == torch.int16 and b >= 1 << 15 else b
                        for b in bits], dtype=itype)
    x = raw.view(tdt).repeat(1000)
    cpu = memfit.cast(x, tdt)
    gpu = memfit.cast(x.cuda(), tdt)
    assert torch.equal(cpu.view(itype), x.view(itype))
    assert torch.equal(gpu.cpu().view(itype), x.view(itype))
    xc = x.cuda()
    memfit.cast(xc, tdt, out=xc)
    assert torch.equal(xc.cpu().view(itype), x.view(itype))


@pytest.mark.cuda
@pytest.mark.parametrize("target", ["bfloat16", "float16"])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_cuda_matches_cpu(target, rounding):
    tdt = getattr(torch, target)
    x = f32_from_bits(np.concatenate([wide_sample(1 << 20), f16_boundaries()]))
    cpu = memfit.cast(x, tdt, rounding=rounding, seed=9)
    gpu = memfit.cast(x.cuda(), tdt, rounding=rounding, seed=9)
    assert gpu.is_cuda
    assert_same_bits(gpu.cpu(), cpu)
    if rounding == "nearest":
        assert_same_bits(gpu.cpu(), x.cuda().to(tdt).cpu())
