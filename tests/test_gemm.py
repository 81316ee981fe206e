"""Matrix products and memfit.nn.Linear: against float64 references and torch, in
forward and backward, with fused bias/activation, under autocast, and bad input."""

import numpy as np
import pytest

import memfit
from memfit import _matmul as mm

torch = pytest.importorskip("torch")
import memfit.nn as mnn  # noqa: E402
import memfit.nn.functional as MF  # noqa: E402

SHAPES = [(1, 1, 1), (7, 13, 5), (65, 257, 33), (128, 64, 300)]  # m, k, n


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


@pytest.mark.parametrize("m,k,n", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("trans_a,trans_b", [(False, False), (False, True), (True, False), (True, True)])
def test_gemm_accumulates_in_float32(m, k, n, dtype, trans_a, trans_b):
    g = torch.Generator().manual_seed(m * 1000 + n)
    a = torch.randn(m, k, generator=g).to(dtype)
    b = torch.randn(k, n, generator=g).to(dtype)
    a_in = a.t().contiguous() if trans_a else a
    b_in = b.t().contiguous() if trans_b else b
    out, _ = mm.gemm(a_in, b_in, trans_a=trans_a, trans_b=trans_b, out_dtype=torch.float32)
    ref = a.double() @ b.double()  # exact products of the (rounded) inputs
    assert out.dtype == torch.float32 and out.shape == (m, n)
    assert rel(out, ref) < 2e-6, "float32 accumulation of exact half-precision products"


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.float16, 1e-3), (torch.bfloat16, 8e-3)])
def test_matmul_output_rounding_and_batch_dims(dtype, tol):
    a = torch.randn(3, 5, 64).to(dtype)
    b = torch.randn(64, 40).to(dtype)
    out = memfit._matmul.matmul(a, b)
    assert out.dtype == dtype and out.shape == (3, 5, 40)
    assert rel(out, a.double() @ b.double()) < tol


def test_numpy_inputs():
    a = np.random.default_rng(0).standard_normal((20, 30)).astype(np.float32)
    b = np.random.default_rng(1).standard_normal((30, 10)).astype(np.float32)
    out = mm.matmul(a, b)
    assert isinstance(out, np.ndarray)
    np.testing.assert_allclose(out, a.astype(np.float64) @ b, rtol=1e-5, atol=1e-5)


ACT_REF = {None: lambda r: r, "relu": torch.relu, "gelu": torch.nn.functional.gelu,
           "gelu_tanh": lambda r: torch.nn.functional.gelu(r, approximate="tanh")}


@pytest.mark.parametrize("activation", list(ACT_REF))
def test_fused_bias_activation_matches_torch(activation):
    x, w, b = torch.randn(33, 70), torch.randn(50, 70), torch.randn(50)
    y, pre = mm.gemm(x, w, trans_b=True, bias=b, activation=activation, save_pre=True)
    ref_pre = torch.nn.functional.linear(x, w, b)
    ref = ACT_REF[activation](ref_pre)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    if activation:
        torch.testing.assert_close(pre, ref_pre, rtol=1e-5, atol=1e-5)
    else:
        assert pre is None


@pytest.mark.parametrize("activation", list(ACT_REF))
@pytest.mark.parametrize("bias", [True, False])
def test_linear_forward_backward_match_torch(activation, bias):
    torch.manual_seed(0)
    x = torch.randn(4, 9, 48, requires_grad=True)
    w = torch.randn(80, 48, requires_grad=True)
    b = torch.randn(80, requires_grad=True) if bias else None
    y = MF.linear(x, w, b, activation)
    gy = torch.randn_like(y)
    y.backward(gy)
    grads = [x.grad, w.grad] + ([b.grad] if bias else [])
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    b2 = b.detach().clone().requires_grad_() if bias else None
    r = torch.nn.functional.linear(x2, w2, b2)
    r = ACT_REF[activation](r)
    r.backward(gy)
    torch.testing.assert_close(y, r, rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, [x2.grad, w2.grad] + ([b2.grad] if bias else [])):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_linear_module_is_a_drop_in():
    ref = torch.nn.Linear(32, 16)
    layer = mnn.Linear(32, 16)
    assert list(layer.state_dict()) == list(ref.state_dict())
    layer.load_state_dict(ref.state_dict())
    x = torch.randn(10, 32)
    torch.testing.assert_close(layer(x), ref(x), rtol=1e-5, atol=1e-5)
    assert "activation='gelu'" in repr(mnn.Linear(4, 4, activation="gelu"))
    assert isinstance(layer, torch.nn.Linear)


def test_linear_under_autocast_bf16():
    layer = mnn.Linear(64, 32, activation="gelu")
    x = torch.randn(8, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ref = torch.nn.functional.gelu(torch.nn.functional.linear(x, layer.weight, layer.bias))
    assert y.dtype == torch.bfloat16
    assert rel(y, ref) < 1e-2
    y.float().sum().backward()
    assert layer.weight.grad is not None and layer.weight.grad.dtype == torch.float32


BAD = [
    ("inner dims", lambda: mm.matmul(torch.randn(3, 4), torch.randn(5, 6)), ValueError, "inner dimensions differ"),
    ("int dtype", lambda: mm.matmul(torch.ones(3, 4, dtype=torch.int32), torch.ones(4, 2, dtype=torch.int32)), TypeError, "a: unsupported dtype"),
    ("mixed dtypes", lambda: mm.matmul(torch.randn(3, 4), torch.randn(4, 2).half()), TypeError, "a and b must have the same dtype"),
    ("b not 2-D", lambda: mm.matmul(torch.randn(3, 4), torch.randn(4)), ValueError, "b: expected a 2-D array"),
    ("bias shape", lambda: mm.gemm(torch.randn(3, 4), torch.randn(4, 2), bias=torch.randn(3)), ValueError, r"bias: expected shape \(2,\)"),
    ("activation", lambda: MF.linear(torch.randn(3, 4), torch.randn(2, 4), activation="tanh"), ValueError, "activation: expected None, 'relu', 'gelu' or 'gelu_tanh'"),
    ("out dtype", lambda: mm.matmul(torch.randn(3, 4), torch.randn(4, 2), out_dtype=torch.int8), TypeError, "out_dtype: expected"),
    ("non-contiguous", lambda: mm.matmul(torch.randn(4, 3).t(), torch.randn(4, 2)), ValueError, "a: must be contiguous"),
    ("weight dtype", lambda: MF.linear(torch.randn(3, 4), torch.randn(2, 4).half()), TypeError, "w: expected dtype"),
]


@pytest.mark.parametrize("name,call,exc,msg", BAD, ids=[b[0] for b in BAD])
def test_bad_input(name, call, exc, msg):
    with pytest.raises(exc, match=msg):
        call()


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_cuda_matches_cpu(dtype):
    x, w, b = torch.randn(100, 70).to(dtype), torch.randn(60, 70).to(dtype), torch.randn(60).to(dtype)
    cpu, _ = mm.gemm(x, w, trans_b=True, bias=b, activation="gelu", out_dtype=torch.float32)
    gpu, _ = mm.gemm(x.cuda(), w.cuda(), trans_b=True, bias=b.cuda(), activation="gelu", out_dtype=torch.float32)
    assert gpu.is_cuda
    assert rel(gpu.cpu(), cpu) < 1e-5


def test_issue_api_names():
    import memfit.amp

    a, b = torch.randn(4, 8, dtype=torch.bfloat16), torch.randn(8, 3, dtype=torch.bfloat16)
    assert torch.equal(memfit.amp.matmul(a, b), mm.matmul(a, b))
    x = torch.randn(100)
    assert torch.equal(memfit.amp.cast(x, torch.float16), x.half())


# ---- double backward (issue 24 §5) and arguments that are not tensors (§6) ----------------

_ACTS = [None, "relu", "gelu", "gelu_tanh"]


def _torch_act(activation):
    F = torch.nn.functional
    return {None: lambda t: t, "relu": F.relu, "gelu": F.gelu,
            "gelu_tanh": lambda t: F.gelu(t, approximate="tanh")}[activation]


@pytest.mark.parametrize("activation", _ACTS)
def test_linear_second_derivatives_match_torch_float64(activation):
    # memfit's kernels take float32 at most: its first and second derivatives against
    # torch's float64 ones on the same values, within float32 rounding
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 7, generator=g)
    w = torch.randn(4, 7, generator=g) / 3
    b = torch.randn(4, generator=g)
    v = torch.randn(5, 4, generator=g)
    results = []
    for fn, dt in ((lambda *a: MF.linear(*a, activation=activation), torch.float32),
                   (lambda x, w, b: _torch_act(activation)(torch.nn.functional.linear(x, w, b)),
                    torch.float64)):
        xs, ws, bs = (t.to(dt).requires_grad_(True) for t in (x, w, b))
        y = fn(xs, ws, bs)
        gx, gw, gb = torch.autograd.grad(y, (xs, ws, bs), v.to(dt), create_graph=True)
        assert gx.requires_grad and gw.requires_grad  # a graph to differentiate
        second = torch.autograd.grad((gx ** 2).sum() + (gw * ws).sum() + gb.sum() ** 2,
                                     (xs, ws, bs), allow_unused=True, materialize_grads=True)
        results.append([t.double() for t in (y, gx, gw, gb, *second)])
    for a, r in zip(*results):
        assert torch.allclose(a, r, rtol=1e-4, atol=1e-4), (a - r).abs().max()


@pytest.mark.filterwarnings("ignore:Input #.* is not a double precision")
@pytest.mark.parametrize("activation", [None, "gelu"])
def test_linear_gradcheck_and_gradgradcheck(activation):
    # float32 (memfit's widest dtype) with a step where the finite differences of a
    # bilinear function are exact up to float32 rounding
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 4, generator=g, requires_grad=True)
    w = torch.randn(2, 4, generator=g, requires_grad=True)
    b = torch.randn(2, generator=g, requires_grad=True)
    fn = lambda *a: MF.linear(*a, activation=activation)  # noqa: E731
    kw = dict(eps=1e-2, atol=2e-2, rtol=2e-2, nondet_tol=1e-5)
    assert torch.autograd.gradcheck(fn, (x, w, b), **kw)
    assert torch.autograd.gradgradcheck(fn, (x, w, b), **kw)


def test_wgan_gp_penalty_gradient_matches_torch():
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.GELU(), torch.nn.Linear(16, 1))
    ours = torch.nn.Sequential(mnn.Linear(6, 16, activation="gelu"), mnn.Linear(16, 1))
    ours[0].load_state_dict(ref[0].state_dict())
    ours[1].load_state_dict(ref[2].state_dict())
    real, fake = torch.randn(8, 6), torch.randn(8, 6)
    eps = torch.rand(8, 1)
    grads = []
    for model in (ref, ours):
        model.zero_grad()
        xi = (eps * real + (1 - eps) * fake).requires_grad_(True)
        (gx,) = torch.autograd.grad(model(xi).sum(), xi, create_graph=True)
        penalty = ((gx.norm(2, dim=1) - 1) ** 2).mean()
        penalty.backward()
        grads.append([p.grad for p in model.parameters()])
    assert grads[0][-1] is None and grads[1][-1] is None  # the last bias: no gradient
    for a, r in zip(grads[0][:-1], grads[1][:-1]):
        assert r.abs().max() > 0  # the penalty moves the critic (it moved nothing before)
        assert torch.allclose(a, r, rtol=1e-4, atol=1e-6), (a - r).abs().max()


def test_linear_without_create_graph_stays_in_memfits_kernels():
    x = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(3, 8, requires_grad=True)
    (gx,) = torch.autograd.grad(MF.linear(x, w).sum(), x)
    assert not gx.requires_grad
    assert torch.allclose(gx, torch.ones(4, 3) @ w.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("which", ["x", "w", "b"])
def test_linear_names_an_argument_that_is_not_a_torch_tensor(which):
    args = {"x": torch.randn(2, 3), "w": torch.randn(4, 3), "b": torch.randn(4)}
    args[which] = args[which].numpy()
    with pytest.raises(TypeError, match=rf"{which}: memfit.nn.functional.linear takes torch "
                                        r"tensors .*numpy.ndarray.*memfit.nn.matmul"):
        MF.linear(args["x"], args["w"], args["b"])
