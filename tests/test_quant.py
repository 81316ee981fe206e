"""Blockwise quantization: accuracy bounds, exactness against a NumPy reference,
round trips across dtypes, frameworks and block sizes, stochastic rounding, non-finite
input, and a table of bad inputs that must raise the right exception with a message
naming the argument."""

import numpy as np
import pytest

import memfit
import memfit.quant as q
from quant_reference import dynamic_map_reference, reference_dequantize, reference_quantize

torch = pytest.importorskip("torch")
ml_dtypes = pytest.importorskip("ml_dtypes")

BLOCK_SIZES = [64, 128, 256, 512, 1024, 2048, 4096]
DTYPES = ["float32", "float16", "bfloat16"]


def rng(seed=0):
    return np.random.default_rng(seed)


def np_dtype(name):
    return ml_dtypes.bfloat16 if name == "bfloat16" else np.dtype(name)


# ---- code tables -----------------------------------------------------------------

@pytest.mark.parametrize("signed", [True, False])
def test_dynamic_map_matches_paper_construction(signed):
    code = q.dynamic_map(signed=signed)
    assert code.dtype == np.float32 and code.shape == (256,)
    np.testing.assert_allclose(code, dynamic_map_reference(signed), rtol=1e-6, atol=0)
    assert np.all(np.diff(code) >= 0)
    assert 0.0 in code and code.max() == 1.0
    if signed:
        assert (code < 0).sum() == 127 and (code > 0).sum() == 128  # 127 tree values + 1.0
    else:
        assert code.min() == 0.0 and (code > 0).sum() == 255  # 254 tree values + 1.0


def test_dynamic_map_smaller_codes():
    code = q.dynamic_map(signed=True, total_bits=4, max_exponent_bits=3)
    assert code.shape == (16,)
    np.testing.assert_allclose(code, dynamic_map_reference(True, 4, 3), rtol=1e-6)


def test_dynamic_map_bad_arguments():
    with pytest.raises(ValueError, match="total_bits: must be between 2 and 8"):
        q.dynamic_map(total_bits=9)
    with pytest.raises(ValueError, match="max_exponent_bits: must be between 1 and"):
        q.dynamic_map(max_exponent_bits=8)
    with pytest.raises(TypeError, match="total_bits: expected an int"):
        q.dynamic_map(total_bits=8.0)


def test_linear_map():
    s, u = q.linear_map(True), q.linear_map(False)
    assert s[0] == -1 and s[-1] == 1 and 0.0 in s and np.all(np.diff(s) >= 0)
    np.testing.assert_allclose(u, np.linspace(0, 1, 256), atol=1e-7)


# ---- accuracy bounds (issue: 1024x1024, every block size, mean over draws) ------------

CASES = [  # distribution, signed map, abserr bound, relerr bound
    ("normal", True, 0.011, 0.018),
    ("uniform", True, 0.0036, 0.015),
    ("uniform", False, 0.0023, 0.012),
]


@pytest.mark.parametrize("dist,signed,abs_bound,rel_bound", CASES)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_accuracy_bounds(dist, signed, abs_bound, rel_bound, block_size):
    code = q.dynamic_map(signed=signed)
    abserr, relerr = [], []
    for seed in range(3):
        g = rng(seed)
        x = (g.standard_normal((1024, 1024)) if dist == "normal" else g.random((1024, 1024))).astype(np.float32)
        y = q.dequantize_blockwise(q.quantize_blockwise(x, block_size=block_size, code=code))
        d = np.abs(x.astype(np.float64) - y)
        abserr.append(d.mean())
        relerr.append((d / (np.abs(x) + 1e-8)).mean())
    assert np.mean(abserr) < abs_bound, np.mean(abserr)
    assert np.mean(relerr) < rel_bound, np.mean(relerr)


# ---- exactness against the NumPy reference ---------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [64, 256, 4096])
@pytest.mark.parametrize("numel", [1, 63, 65, 1000, 9000, 70001])  # the last uses the CPU lookup table
def test_codes_and_absmax_match_reference(dtype, block_size, numel):
    x = (rng(numel).standard_normal(numel) * 3).astype(np_dtype(dtype))
    code = q.dynamic_map()
    s = q.quantize_blockwise(x, block_size=block_size)
    ref_codes, ref_absmax, ties = reference_quantize(x, code, block_size)
    np.testing.assert_array_equal(s.absmax, ref_absmax)
    assert np.array_equal(s.codes.ravel()[~ties], ref_codes[~ties])
    assert s.codes.shape == x.shape and s.absmax.shape == (-(-numel // block_size),)
    y = q.dequantize_blockwise(s)
    assert y.dtype == x.dtype and y.shape == x.shape
    want = reference_dequantize(s.codes, s.absmax, code, block_size).astype(np_dtype(dtype))
    np.testing.assert_array_equal(y.astype(np.float32), want.astype(np.float32))


def test_zero_blocks_round_trip_to_zero():
    x = np.zeros(1000, np.float32)
    x[600:] = rng().standard_normal(400)
    s = q.quantize_blockwise(x, block_size=256)
    assert s.absmax[0] == 0 and s.absmax[1] == 0
    y = q.dequantize_blockwise(s)
    assert np.all(y[:512] == 0)


# ---- round trips across frameworks, shapes, dtypes, block sizes -------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_torch_round_trip(dtype, block_size):
    tdt = getattr(torch, dtype)
    x = torch.randn(37, 301, generator=torch.Generator().manual_seed(block_size)).to(tdt)
    s = q.quantize_blockwise(x, block_size=block_size)
    assert isinstance(s.codes, torch.Tensor) and s.codes.dtype == torch.uint8
    assert s.codes.shape == x.shape and s.absmax.dtype == torch.float32
    assert s.dtype == tdt and s.shape == (37, 301)
    y = q.dequantize_blockwise(s)
    assert isinstance(y, torch.Tensor) and y.dtype == tdt and y.shape == x.shape
    err = (y.float() - x.float()).abs().mean().item()
    assert err < 0.011 * 1.05, err
    # the torch and NumPy paths are the same kernel: identical results
    s_np = q.quantize_blockwise(x.float().numpy().astype(np_dtype(dtype)), block_size=block_size)
    np.testing.assert_array_equal(s.codes.numpy(), s_np.codes)
    np.testing.assert_array_equal(s.absmax.numpy(), s_np.absmax)


def test_numpy_bfloat16_in_numpy_out():
    x = rng(1).standard_normal((64, 65)).astype(ml_dtypes.bfloat16)
    s = q.quantize_blockwise(x, block_size=128)
    assert isinstance(s.codes, np.ndarray) and s.codes.dtype == np.uint8
    y = q.dequantize_blockwise(s)
    assert isinstance(y, np.ndarray) and y.dtype == ml_dtypes.bfloat16 and y.shape == (64, 65)


def test_tensor_requiring_grad_is_accepted_without_copy():
    w = torch.nn.Parameter(torch.randn(512))
    s = q.quantize_blockwise(w, block_size=64)
    y = q.dequantize_blockwise(s)
    assert not y.requires_grad
    assert (y - w.detach()).abs().max().item() < 0.05 * w.detach().abs().max().item()


def test_generic_dlpack_producer_gets_numpy_out():
    class OnlyDLPack:
        def __init__(self, t):
            self.t, self.shape, self.dtype = t, tuple(t.shape), "float32"

        def __dlpack__(self, **kw):
            return self.t.__dlpack__(**kw)

        def __dlpack_device__(self):
            return self.t.__dlpack_device__()

    x = torch.randn(700)
    s = q.quantize_blockwise(OnlyDLPack(x), block_size=64)
    assert isinstance(s.codes, np.ndarray)
    np.testing.assert_array_equal(s.codes, q.quantize_blockwise(x, block_size=64).codes.numpy())


def test_out_argument():
    x = torch.randn(3000)
    s = q.quantize_blockwise(x)
    out = torch.full_like(x, float("nan"))
    res = q.dequantize_blockwise(s, out=out)
    assert res is out
    torch.testing.assert_close(out, q.dequantize_blockwise(s), rtol=0, atol=0)
    out16 = torch.empty(3000, dtype=torch.float16)
    q.dequantize_blockwise(s, out=out16)  # another float dtype is allowed: rounded on store
    torch.testing.assert_close(out16, out.half(), rtol=0, atol=0)


def test_partial_last_block_is_independent():
    x = rng(3).standard_normal(256 + 5).astype(np.float32)
    x[256:] *= 100  # a loud tail must not change the first block
    s = q.quantize_blockwise(x, block_size=256)
    s_head = q.quantize_blockwise(x[:256].copy(), block_size=256)
    np.testing.assert_array_equal(s.codes[:256], s_head.codes)
    assert s.absmax[1] == np.abs(x[256:]).max()


# ---- stochastic rounding ------------------------------------------------------------------

def test_stochastic_rounding_is_reproducible_and_seeded():
    x = rng(4).standard_normal(5000).astype(np.float32)
    a = q.quantize_blockwise(x, rounding="stochastic", seed=7)
    b = q.quantize_blockwise(x, rounding="stochastic", seed=7)
    c = q.quantize_blockwise(x, rounding="stochastic", seed=8)
    np.testing.assert_array_equal(a.codes, b.codes)
    assert (a.codes != c.codes).mean() > 0.1
    np.testing.assert_array_equal(a.absmax, c.absmax)


def test_stochastic_rounding_picks_a_neighbour_and_is_unbiased():
    code = q.dynamic_map()
    x = rng(5).standard_normal(4096).astype(np.float32)
    nearest = q.quantize_blockwise(x, block_size=4096)
    xn = (x * (np.float32(1) / nearest.absmax[0])).astype(np.float32)
    lo = np.clip(np.searchsorted(code, xn, side="right") - 1, 0, 255)
    hi = np.minimum(lo + 1, 255)
    draws = np.stack([q.dequantize_blockwise(q.quantize_blockwise(x, block_size=4096, rounding="stochastic", seed=s))
                      for s in range(400)])
    codes = [q.quantize_blockwise(x, block_size=4096, rounding="stochastic", seed=s).codes for s in range(3)]
    for c in codes:
        assert np.all((c == lo) | (c == hi))
    # unbiased: the mean of many draws converges to x, far closer than one nearest-rounded copy
    bias = np.abs(draws.mean(axis=0) - x).mean()
    one_copy = np.abs(q.dequantize_blockwise(nearest) - x).mean()
    assert bias < one_copy / 4, (bias, one_copy)
    spacing = (code[hi] - code[lo]) * nearest.absmax[0]
    # per-element: within 5 standard errors of a Bernoulli mean
    se = spacing * 0.5 / np.sqrt(len(draws)) + 1e-12
    assert np.mean(np.abs(draws.mean(axis=0) - x) < 5 * se) > 0.999


# ---- non-finite input (documented behaviour) ---------------------------------------------------

@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_poisons_only_its_block(bad):
    x = rng(6).standard_normal(1000).astype(np.float32)
    x[300] = bad
    s = q.quantize_blockwise(x, block_size=256)
    assert np.isnan(s.absmax[1]) and np.all(np.isfinite(s.absmax[[0, 2, 3]]))
    y = q.dequantize_blockwise(s)
    assert np.all(np.isnan(y[256:512]))
    assert np.all(np.isfinite(y[:256])) and np.all(np.isfinite(y[512:]))


# ---- bad input: exception type and message ---------------------------------------------------------

def _x():
    return torch.randn(1024)


BAD_INPUTS = [
    ("int64 dtype", lambda: q.quantize_blockwise(torch.arange(1024)), TypeError, "x: unsupported dtype"),
    ("float64 dtype", lambda: q.quantize_blockwise(np.zeros(1024)), TypeError, "x: unsupported dtype float64"),
    ("uint8 input", lambda: q.quantize_blockwise(np.zeros(1024, np.uint8)), TypeError, "x: expected dtype float32, float16 or bfloat16"),
    ("not an array", lambda: q.quantize_blockwise([1.0, 2.0]), TypeError, "expected an array"),
    ("non-contiguous torch", lambda: q.quantize_blockwise(torch.randn(64, 64).t()), ValueError, "x: must be contiguous"),
    ("non-contiguous numpy", lambda: q.quantize_blockwise(np.ones((64, 64), np.float32)[:, ::2]), ValueError, "x: must be contiguous"),
    ("empty", lambda: q.quantize_blockwise(torch.empty(0)), ValueError, "x: empty arrays cannot be quantized"),
    ("block size 100", lambda: q.quantize_blockwise(_x(), block_size=100), ValueError, "block_size: must be one of"),
    ("block size 8192", lambda: q.quantize_blockwise(_x(), block_size=8192), ValueError, "block_size: must be one of"),
    ("block size str", lambda: q.quantize_blockwise(_x(), block_size="256"), TypeError, "block_size: expected an int"),
    ("code too short", lambda: q.quantize_blockwise(_x(), code=torch.linspace(-1, 1, 100)), ValueError, "code: expected 256 elements, got 100"),
    ("code float64", lambda: q.quantize_blockwise(_x(), code=np.linspace(-1, 1, 256)), TypeError, "code: unsupported dtype float64"),
    ("code unsorted", lambda: q.quantize_blockwise(_x(), code=torch.linspace(1, -1, 256)), ValueError, "code: must be sorted"),
    ("code outside [-1,1]", lambda: q.quantize_blockwise(_x(), code=torch.linspace(-2, 2, 256)), ValueError, r"code: values must lie in \[-1, 1\]"),
    ("rounding", lambda: q.quantize_blockwise(_x(), rounding="up"), ValueError, "rounding: expected 'nearest' or 'stochastic'"),
    ("seed", lambda: q.quantize_blockwise(_x(), rounding="stochastic", seed="x"), TypeError, "seed: expected an int"),
    ("state type", lambda: q.dequantize_blockwise({"codes": 1}), TypeError, "state: expected a QuantState"),
    ("out shape", lambda: q.dequantize_blockwise(q.quantize_blockwise(_x()), out=torch.empty(10)), ValueError, "out: expected shape"),
    ("out dtype", lambda: q.dequantize_blockwise(q.quantize_blockwise(_x()), out=torch.empty(1024, dtype=torch.uint8)), TypeError, "out: expected dtype float32, float16 or bfloat16"),
    ("out read-only", lambda: q.dequantize_blockwise(q.quantize_blockwise(np.ones(1024, np.float32)), out=_readonly()), ValueError, "out: array is read-only"),
]


def _readonly():
    a = np.ones(1024, np.float32)
    a.flags.writeable = False
    return a


@pytest.mark.parametrize("name,call,exc,msg", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input(name, call, exc, msg):
    with pytest.raises(exc, match=msg) as info:
        call()
    if exc is not TypeError or "expected an array" not in msg:
        assert isinstance(info.value, memfit.Error), "memfit's errors derive from memfit.Error"


def test_codes_array_too_short_in_state():
    s = q.quantize_blockwise(torch.randn(1024))
    s.codes = s.codes[:1000]
    with pytest.raises(ValueError, match="codes: expected 1024 elements, got 1000"):
        q.dequantize_blockwise(s)


def test_failed_call_leaves_out_untouched():
    s = q.quantize_blockwise(torch.randn(1024))
    s.absmax = s.absmax[:2]
    out = torch.full((1024,), 7.0)
    with pytest.raises(ValueError, match="absmax: expected 4 elements, got 2"):
        q.dequantize_blockwise(s, out=out)
    assert torch.all(out == 7.0)


def test_jax_arrays_round_trip():
    jnp = pytest.importorskip("jax.numpy")
    x = jnp.asarray(rng(9).standard_normal(3000).astype(np.float32))
    s = q.quantize_blockwise(x)
    y = q.dequantize_blockwise(s)
    assert type(y).__module__.split(".")[0] in ("jax", "jaxlib")
    assert float(jnp.abs(y - x).mean()) < 0.011


# ---- CUDA: identical to the CPU, bit for bit ----------------------------------------------------

@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_cuda_matches_cpu(dtype, block_size, rounding):
    tdt = getattr(torch, dtype)
    x = (torch.randn(1000, 333, generator=torch.Generator().manual_seed(block_size)) * 5).to(tdt)
    x[3, 3] = float("nan")
    cpu = q.quantize_blockwise(x, block_size=block_size, rounding=rounding, seed=11)
    gpu = q.quantize_blockwise(x.cuda(), block_size=block_size, rounding=rounding, seed=11)
    assert gpu.codes.is_cuda and gpu.absmax.is_cuda
    assert torch.equal(gpu.codes.cpu(), cpu.codes)
    assert torch.equal(gpu.absmax.cpu().nan_to_num(-1), cpu.absmax.nan_to_num(-1))
    y_cpu, y_gpu = q.dequantize_blockwise(cpu), q.dequantize_blockwise(gpu)
    assert y_gpu.is_cuda and y_gpu.dtype == tdt
    assert torch.equal(y_gpu.cpu().float().nan_to_num(-9), y_cpu.float().nan_to_num(-9))


@pytest.mark.cuda
def test_cuda_mixed_devices_rejected():
    x = torch.randn(1024, device="cuda")
    with pytest.raises(ValueError, match="x and code must be on the same device"):
        q.quantize_blockwise(x, code=torch.from_numpy(q.dynamic_map()))


@pytest.mark.cuda
def test_cuda_runs_on_current_stream():
    x = torch.randn(1 << 20, device="cuda")
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        st = q.quantize_blockwise(x)
        y = q.dequantize_blockwise(st)
    s.synchronize()
    assert (y - x).abs().mean().item() < 0.011


_ISA_CASES = """
import hashlib, sys, numpy as np, memfit.quant as q
rng = np.random.default_rng(7)
# normal values; exact code values and their float neighbours (the decision points);
# tiny, subnormal, huge, +-0, +-Inf and NaN (a non-finite block, see above)
parts = [rng.standard_normal(40000).astype(np.float32)]
for code in (q.dynamic_map(True), q.dynamic_map(False), q.linear_map(True)):
    c = np.asarray(code, np.float32)
    mids = ((c[1:].astype(np.float64) + c[:-1]) / 2).astype(np.float32)
    for v in (c, mids):
        parts += [v, np.nextafter(v, np.float32(np.inf)), np.nextafter(v, np.float32(-np.inf))]
parts.append(np.array([1e-30, -1e-30, 1e-42, -1e-42, 0.0, -0.0, 3e38, -3e38], np.float32))
x = np.concatenate(parts)
x = np.concatenate([x, np.zeros((-len(x)) % 64, np.float32)])
out = []
for code in (None, q.dynamic_map(False), q.linear_map(True)):
    for bs in (64, 256, 4096):
        s = q.quantize_blockwise(x, block_size=bs, code=code)
        out += [np.asarray(s.codes).tobytes(), np.asarray(s.absmax).tobytes()]
bad = x[:256].copy(); bad[5] = np.inf; bad[77] = np.nan; bad[200] = -np.inf
s = q.quantize_blockwise(bad, block_size=64)
out += [np.asarray(s.codes).tobytes(), np.asarray(s.absmax).tobytes()]
sys.stdout.write(hashlib.sha256(b"".join(out)).hexdigest())
"""


def test_cpu_isa_variants_quantize_bitwise():
    """The plain, AVX2 and AVX-512 forms of the nearest-code search (code_lut.c) give the
    same codes, on normal values, on every code value and midpoint and their float
    neighbours, on tiny/subnormal/huge values and on a non-finite block, for the signed
    and unsigned dynamic maps and the linear map."""
    import os
    import subprocess
    import sys

    digests = {}
    for isa in ("generic", "avx2", "avx512"):
        env = {**os.environ, "MEMFIT_CPU_ISA": isa}
        r = subprocess.run([sys.executable, "-c", _ISA_CASES], env=env, capture_output=True,
                           text=True, check=True)
        digests[isa] = r.stdout
    assert len(set(digests.values())) == 1, digests
