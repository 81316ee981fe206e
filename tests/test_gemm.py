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
