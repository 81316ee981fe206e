"""Property-based tests (Hypothesis) over the public API (issue 24 §7).

Each property draws what a caller can pass (dtypes, shapes from 0-d and empty to odd
sizes, C and Fortran order, negative and other strides, read-only arrays, NaN, +-Inf,
+-0, subnormals, huge values, valid and invalid block sizes and hyperparameters) and
asserts that memfit either matches a reference (torch, NumPy float64, the code map's
own nearest-value bound) or raises its documented error (TypeError / ValueError,
memfit.Error subclasses), never crashes, and changes nothing when it refuses a call.

Profiles (tests/conftest.py): "ci" (default: derandomized, 30 examples per property)
and "thorough" (MEMFIT_HYPOTHESIS_PROFILE=thorough: 2000 random examples).
"""

import math

import ml_dtypes
import numpy as np
import pytest
from hypothesis import Phase, assume, example, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import memfit
import memfit.quant as q
from memfit.checkpoint import parse_bytes
from memfit.optim import functional as F

torch = pytest.importorskip("torch")

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16), "bfloat16": BF16}
TORCH = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
INVALID_BLOCKS = [0, 1, 32, 63, 100, 8192, -64]
# the known bug of issue 24 §5a (fixed on branch math): blocks whose absmax is below
# about 2.9e-39 (1/absmax overflows float32)
TINY_ABSMAX = 2.9e-39

float32s = st.floats(width=32, allow_nan=True, allow_infinity=True, allow_subnormal=True)
shapes = hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=9)
layouts = st.sampled_from(["c", "fortran", "reversed", "strided", "readonly"])


def _arrange(x: np.ndarray, layout: str) -> np.ndarray:
    """x in the given memory layout (a view where NumPy makes one)."""
    if layout == "fortran":
        return np.asfortranarray(x)
    if layout == "reversed" and x.ndim:
        return x[::-1]
    if layout == "strided" and x.ndim:
        return x[::2]
    if layout == "readonly":
        x = x.copy()
        x.setflags(write=False)
    return x


@st.composite
def float_arrays(draw, dtypes=tuple(DTYPES), elements=float32s):
    name = draw(st.sampled_from(dtypes))
    base = draw(hnp.arrays(np.float32, draw(shapes), elements=elements))
    with np.errstate(over="ignore"):
        x = base.astype(DTYPES[name])  # float16/bfloat16 overflow to +-Inf, as casts do
    return name, _arrange(x, draw(layouts))


def _bits(a: np.ndarray) -> np.ndarray:
    # np.array(order="C"), not np.ascontiguousarray, which makes a 0-d array 1-d
    return np.array(a, order="C").view(np.uint32 if a.dtype.itemsize == 4 else np.uint16)


def _same_values(a: np.ndarray, b: np.ndarray) -> bool:
    """Bit for bit, except that any NaN equals any NaN (payloads may differ)."""
    a32, b32 = a.astype(np.float32), b.astype(np.float32)
    nan = np.isnan(a32)
    return bool(np.array_equal(nan, np.isnan(b32)) and np.array_equal(_bits(a)[~nan], _bits(b)[~nan]))


def _refused(call, *, errors=(TypeError, ValueError)):
    """Runs call(); True when it raised one of memfit's documented errors."""
    try:
        call()
    except errors as e:
        assert str(e), "an error without a message"
        return True
    return False


# ---- quantize_blockwise / dequantize_blockwise -----------------------------------------

def _check_round_trip(x: np.ndarray, block_size: int, state, y: np.ndarray):
    """dequantize(quantize(x)) against NumPy float64: per block, absmax = max |x| (NaN
    when the block holds NaN/Inf, and then every element NaN), and each element within
    the dynamic map's nearest-value distance of x / absmax (plus the float32 scaling's
    rounding, plus the output dtype's rounding, relative or, below its normal range,
    absolute)."""
    code = np.sort(np.asarray(q.dynamic_map(), np.float64))
    xf = x.astype(np.float64).ravel()
    yf = y.astype(np.float64).ravel()
    absmax = np.asarray(state.absmax, np.float64)
    out_eps = {2: 2.0**-8 if x.dtype == BF16 else 2.0**-11, 4: 0.0}[x.dtype.itemsize]
    # below the output dtype's normal range its spacing is absolute: half its smallest
    # subnormal (float32 2^-149, float16 2^-24, bfloat16 2^-133)
    out_tiny = {4: 2.0**-150, 2: 2.0**-134 if x.dtype == BF16 else 2.0**-25}[x.dtype.itemsize]
    for b in range(len(absmax)):
        xs, ys = xf[b * block_size:(b + 1) * block_size], yf[b * block_size:(b + 1) * block_size]
        if not np.all(np.isfinite(xs)):
            assert np.isnan(absmax[b]) and np.all(np.isnan(ys)), (b, xs, absmax[b])
            continue
        assert absmax[b] == np.abs(xs).max(), (b, absmax[b], np.abs(xs).max())
        if absmax[b] == 0:
            assert np.all(ys == 0)
            continue
        r = xs / absmax[b]
        i = np.clip(np.searchsorted(code, r), 1, len(code) - 1)
        nearest = np.minimum(np.abs(code[i] - r), np.abs(code[i - 1] - r))
        bound = absmax[b] * (nearest + 2.0**-20) + np.abs(xs) * out_eps * 1.01 + out_tiny
        assert np.all(np.abs(ys - xs) <= bound), (b, xs, ys, bound)


@given(arr=float_arrays(), block_size=st.sampled_from(list(q.BLOCK_SIZES) + INVALID_BLOCKS))
def test_quantize_round_trip_or_documented_error(arr, block_size):
    name, x = arr
    before = x.copy()
    if x.size and block_size in q.BLOCK_SIZES:  # the known tiny-absmax bug has its own test
        blocks = np.abs(np.nan_to_num(x.astype(np.float32).ravel(), posinf=0, neginf=0))
        pad = -len(blocks) % block_size
        amax = np.pad(blocks, (0, pad)).reshape(-1, block_size).max(1)
        assume(not np.any((amax > 0) & (amax < TINY_ABSMAX)))
    ok = x.size > 0 and x.flags.c_contiguous and block_size in q.BLOCK_SIZES
    if not ok:
        assert _refused(lambda: q.quantize_blockwise(x, block_size=block_size))
    else:
        state = q.quantize_blockwise(x, block_size=block_size)
        y = q.dequantize_blockwise(state)
        assert y.shape == x.shape and y.dtype == x.dtype
        _check_round_trip(np.array(x, order="C"), block_size, state, y)
    assert _same_values(x, before)  # the input is never written


@settings(phases=[Phase.explicit, Phase.reuse, Phase.generate])
@given(exponent=st.integers(-149, -128), values=hnp.arrays(np.float32, st.integers(1, 300),
                                                           elements=st.floats(-1, 1, width=32)))
def test_quantize_tiny_blocks_round_trip(exponent, values):
    x = (values * np.float32(2.0**exponent)).astype(np.float32)  # subnormal and tiny blocks
    assume(np.abs(x).max() > 0)
    state = q.quantize_blockwise(x, block_size=64)
    _check_round_trip(x, 64, state, q.dequantize_blockwise(state))


@given(shape=st.tuples(st.integers(2, 6), st.integers(2, 6)), block_size=st.sampled_from(q.BLOCK_SIZES))
def test_quantize_torch_layouts(shape, block_size):
    x = torch.randn(shape)
    assert _refused(lambda: q.quantize_blockwise(x.t(), block_size=block_size))  # not row-major
    s = q.quantize_blockwise(x, block_size=block_size)
    ref = q.quantize_blockwise(x.numpy(), block_size=block_size)
    assert torch.equal(s.codes, torch.from_numpy(ref.codes)) and torch.equal(s.absmax, torch.from_numpy(ref.absmax))


# ---- cast --------------------------------------------------------------------------------

@given(arr=float_arrays(), target=st.sampled_from(list(DTYPES)), with_out=st.booleans())
def test_cast_is_torchs_cast_bit_for_bit(arr, target, with_out):
    name, x = arr
    before = x.copy()
    out = np.full(x.shape, 7, DTYPES[target]) if with_out else None
    out_before = None if out is None else out.copy()
    call = lambda: memfit.cast(x, DTYPES[target], out=out)  # noqa: E731
    if not x.flags.c_contiguous and x.size:
        assert _refused(call)
        assert out is None or _same_values(out, out_before)  # untouched when refused
    else:
        y = call()
        ref = torch.from_numpy(_bits(x).copy())
        ref = ref.view(TORCH[name]).to(TORCH[target])
        ref = ref.view(torch.int16 if ref.element_size() == 2 else torch.int32).numpy().view(DTYPES[target])
        assert y.dtype == DTYPES[target] and y.shape == x.shape
        assert _same_values(y, ref)
        assert out is None or y is out
    assert _same_values(x, before)


@given(arr=float_arrays(dtypes=("float32",)), wrong=st.sampled_from(["shape", "dtype", "readonly"]))
def test_cast_refused_out_is_left_alone(arr, wrong):
    _, x = arr
    x = np.array(x, order="C")
    out = np.full(x.shape, 3, np.float16)
    if wrong == "shape":
        out = np.full(x.shape + (2,), 3, np.float16)
    elif wrong == "dtype":
        out = np.full(x.shape, 3, np.float32)
    else:
        out.setflags(write=False)
        assume(x.size > 0)
    before = out.copy()
    assert _refused(lambda: memfit.cast(x, np.float16, out=out))
    assert _same_values(out, before)


# ---- functional optimizers against torch.optim on a copy --------------------------------

_TORCH_OPT = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam}
lrs = st.one_of(st.floats(1e-5, 0.5), st.sampled_from([0.0, -1e-3, math.nan, math.inf]))
betas = st.one_of(st.floats(0.0, 0.999), st.sampled_from([1.0, -0.1, math.nan]))
epss = st.one_of(st.floats(1e-10, 1e-2), st.sampled_from([0.0, -1e-8, math.nan]))
decays = st.one_of(st.floats(0.0, 0.2), st.sampled_from([-0.01, math.nan]))
grads_mod = st.floats(-1e3, 1e3, width=32, allow_subnormal=True)


def _torch_step_skipping_nonfinite(opt, p):
    """torch's step with memfit's rule for undefined updates (docs/optim.md, "Non-finite
    values"): an element whose new parameter or state is NaN or Inf keeps its parameter
    and states (zero before the first step) and the step counts. torch writes them (eps=0
    with a zero gradient and zero states: 0/0, NaN; a subnormal gradient whose square is
    0: m/0, Inf); everywhere else this is torch's step, unchanged."""
    def tensors():  # the parameter and its element-wise states (not the step count)
        return {"param": p.detach(), **{k: v for k, v in opt.state[p].items() if k != "step"}}
    before = {k: v.clone() for k, v in tensors().items()}
    opt.step()
    now = tensors()
    bad = torch.zeros(p.shape, dtype=torch.bool)
    for v in now.values():
        bad |= ~torch.isfinite(v)
    with torch.no_grad():
        for k, v in now.items():
            v[bad] = before[k][bad] if k in before else 0.0


@given(kind=st.sampled_from(list(_TORCH_OPT)), n=st.integers(1, 40), steps=st.integers(1, 3),
       lr=lrs, b1=betas, b2=betas, eps=epss, wd=decays, maximize=st.booleans(), data=st.data())
def test_functional_32bit_step_matches_torch_or_refuses(kind, n, steps, lr, b1, b2, eps, wd, maximize, data):
    p0 = data.draw(hnp.arrays(np.float32, n, elements=st.floats(-10, 10, width=32)))
    gs = [data.draw(hnp.arrays(np.float32, n, elements=grads_mod)) for _ in range(steps)]
    hp = dict(lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd, maximize=maximize)
    try:
        ref_p = torch.nn.Parameter(torch.from_numpy(p0.copy()))
        opt = _TORCH_OPT[kind]([ref_p], **hp)
        torch_ok = math.isfinite(lr) and math.isfinite(eps)  # torch takes inf; memfit refuses it
    except ValueError:
        torch_ok = False
    p = p0.copy()
    state = F.init(kind, p, 32)
    step = getattr(F, f"{kind}_step")
    if not torch_ok:
        assert _refused(lambda: step(p, gs[0], state, **hp))
        assert np.array_equal(p, p0) and float(state["step"][0]) == 0  # nothing changed
        return
    for g in gs:
        ref_p.grad = torch.from_numpy(g.copy())
        _torch_step_skipping_nonfinite(opt, ref_p)
        step(p, g, state, **hp)
    ref = ref_p.detach().numpy()
    assert np.allclose(p, ref, rtol=2e-5, atol=1e-6 + 1e-5 * lr * steps), np.abs(p - ref).max()


def _adam_bound(lr, wd, p):
    # |update| of Adam with bias correction stays below about lr * (1 - b1) / sqrt(1 - b2)
    # (3.2 lr for the defaults); 10 lr leaves room for quantization
    return 10 * lr + lr * wd * np.abs(p) + 1e-7


@given(kind=st.sampled_from(["adamw", "adam"]), bits=st.sampled_from([8, 4]), n=st.integers(1, 600),
       lr=st.floats(1e-4, 1e-1), seed=st.integers(0, 2**32 - 1))
def test_lowbit_step_moves_like_adam(kind, bits, n, lr, seed):
    # gradients within a 100x range: no moment quantizes to zero (the zero-gradient case is the next test)
    rng = np.random.default_rng(seed)
    g = (rng.uniform(0.1, 10, n) * rng.choice([-1.0, 1.0], n)).astype(np.float32)
    p = np.ones(n, np.float32)
    state = F.init(kind, p, bits)
    for _ in range(3):
        before = p.copy()
        F.step(kind, p, g, state, lr=lr, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
        assert np.all(np.abs(p - before) <= _adam_bound(lr, 0.0, before))


@settings(phases=[Phase.explicit, Phase.reuse, Phase.generate])
@given(bits=st.sampled_from([8, 4]), n=st.integers(300, 600), seed=st.integers(0, 2**32 - 1))
def test_lowbit_step_after_a_zero_gradient_moves_like_adam(bits, n, seed):
    # issue 24 §1: a gradient that goes to zero (an embedding's unused tokens, dead units)
    g = np.random.default_rng(seed).uniform(-10, 10, n).astype(np.float32)
    p = np.ones(n, np.float32)
    state = F.init("adamw", p, bits)
    lr = 1e-2
    for grad in (g, np.zeros_like(g), np.zeros_like(g)):
        before = p.copy()
        F.step("adamw", p, grad, state, lr=lr, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
        assert np.all(np.abs(p - before) <= _adam_bound(lr, 0.0, before))


# ---- the scaler against torch.amp.GradScaler ---------------------------------------------

def _scale_reference(init, growth, backoff, interval, infs):
    """torch.amp.GradScaler's update rule in float32 arithmetic (what torch's CUDA kernel
    computes; its CPU kernel multiplies in double, which can differ in the last bit)."""
    f32 = np.float32
    scale, tracker, out = f32(init), 0, []
    for bad in infs:
        if bad:
            scale, tracker = f32(scale * f32(backoff)), 0
        else:
            tracker += 1
            if tracker == interval:
                grown = f32(scale * f32(growth))
                scale = grown if np.isfinite(grown) else scale
                tracker = 0
        out.append(float(scale))
    return out


@pytest.mark.filterwarnings("ignore::memfit.amp.report.ScalerWarning")  # a scale below 1: intended here
@given(init=st.floats(1.0, 2.0**20), growth=st.floats(1.01, 4.0), backoff=st.floats(0.05, 0.99),
       interval=st.integers(1, 4), infs=st.lists(st.booleans(), min_size=1, max_size=12))
def test_scaler_scale_follows_torch(init, growth, backoff, interval, infs):
    kw = dict(init_scale=init, growth_factor=growth, backoff_factor=backoff, growth_interval=interval)
    scalers = [memfit.amp.GradScaler("cpu", **kw), torch.amp.GradScaler("cpu", **kw)]
    ws = [torch.nn.Parameter(torch.ones(3)) for _ in scalers]
    opts = [torch.optim.SGD([w], lr=0.0) for w in ws]
    ref = _scale_reference(init, growth, backoff, interval, infs)
    for i, bad in enumerate(infs):
        for s, w, o in zip(scalers, ws, opts):
            s.scale(w.sum()).backward()
            if bad:
                w.grad[1] = math.inf
            s.step(o)
            s.update()
            o.zero_grad()
        assert scalers[0].get_scale() == ref[i]  # float32 arithmetic, bit for bit
        assert math.isclose(scalers[0].get_scale(), scalers[1].get_scale(), rel_tol=2.0**-23 * (i + 1))


@given(kw=st.dictionaries(st.sampled_from(["init_scale", "growth_factor", "backoff_factor", "min_scale",
                                           "max_scale"]),
                          st.floats(allow_nan=True, allow_infinity=True), max_size=3),
       ints=st.dictionaries(st.sampled_from(["growth_interval", "hysteresis"]),
                            st.integers(-2**40, 2**40), max_size=2))
def test_scaler_arguments_are_taken_or_refused_with_the_value(kw, ints):
    try:
        memfit.amp.GradScaler("cpu", **kw, **ints)
    except ValueError as e:
        name = str(e).split(":", 1)[0]
        given_values = {**kw, **ints}
        assert name in given_values, e
        if name != "min_scale" or "larger" not in str(e):
            assert repr(given_values[name]) in str(e) or str(given_values[name]) in str(e), e


# ---- parse_bytes ---------------------------------------------------------------------------

@given(value=st.one_of(st.integers(-2**70, 2**70), st.floats(), st.text(max_size=12),
                       st.builds(lambda x, u: f"{x}{u}", st.floats(), st.sampled_from(
                           ["", "B", "KB", "GB", "GiB", "T", "%", " MiB", "x"]))))
@example("1e400GB").via("issue 24 §6")
@example("1e300GB").via("issue 24 §6")
@example(float("nan")).via("issue 24 §6")
def test_parse_bytes_is_a_size_or_a_value_error(value):
    try:
        n = parse_bytes(value, total=10**9)
    except (ValueError, TypeError) as e:
        assert str(e).startswith("budget: "), e
        return
    assert isinstance(n, int) and n >= 0


# ---- linear against torch -------------------------------------------------------------------

@given(m=st.integers(1, 6), k=st.integers(1, 6), n=st.integers(1, 6), bias=st.booleans(),
       activation=st.sampled_from([None, "relu", "gelu", "gelu_tanh"]), seed=st.integers(0, 2**16))
def test_linear_matches_torch_with_gradients(m, k, n, bias, activation, seed):
    from memfit.nn import functional as MF

    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    act = {None: lambda t: t, "relu": torch.relu, "gelu": torch.nn.functional.gelu,
           "gelu_tanh": lambda t: torch.nn.functional.gelu(t, approximate="tanh")}[activation]
    outs = []
    for fn in (lambda *a: MF.linear(*a, activation=activation),
               lambda x, w, b: act(torch.nn.functional.linear(x, w, b))):
        xs, ws = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        y = fn(xs, ws, b)
        y.backward(torch.ones_like(y))
        outs.append((y.detach(), xs.grad, ws.grad))
    for a, r in zip(*outs):
        assert torch.allclose(a, r, rtol=1e-5, atol=1e-5)
