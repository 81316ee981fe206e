"""The CUDA GEMM backends (cuBLASLt loaded at run time, memfit's portable kernel) and
the tanh-approximate GELU.

Without a GPU (here and in CI): gelu_tanh against torch on the CPU kernel, the backend
query and its errors, the library search, and the hand-written cuBLASLt declarations
against NVIDIA's header and against a real libcublasLt whenever either can be found
(MEMFIT_CUBLASLT_INCLUDE / MEMFIT_CUBLASLT or pip's nvidia wheels).

Marked cuda (skipped without a GPU): cuBLASLt against float64 references and against
the portable kernel, every epilogue and saved pre-activation, transposes, the cases
that fall back, streams, and memfit.nn.Linear against torch. When these were written
no GPU was available: none of the cuda tests below has run yet.
"""

import contextlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import memfit
from memfit import _matmul as mm

torch = pytest.importorskip("torch")
import memfit.amp  # noqa: E402
import memfit.nn as mnn  # noqa: E402
import memfit.nn.functional as MF  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
F = torch.nn.functional


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def gelu_tanh(x):
    return F.gelu(x, approximate="tanh")


# ---- gelu_tanh on the CPU kernel --------------------------------------------------------


def test_gelu_tanh_forward_and_saved_input_match_torch():
    g = torch.Generator().manual_seed(3)
    x, w, b = torch.randn(37, 64, generator=g), torch.randn(48, 64, generator=g) / 8, torch.randn(48, generator=g)
    y, pre = mm.gemm(x, w, trans_b=True, bias=b, activation="gelu_tanh", save_pre=True)
    ref_pre = F.linear(x, w, b)
    torch.testing.assert_close(pre, ref_pre, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y, gelu_tanh(ref_pre), rtol=1e-5, atol=1e-5)
    # it is the tanh form, not the exact one: the two differ by up to ~5e-4 here
    assert (y - F.gelu(ref_pre)).abs().max() > 1e-4


def test_gelu_tanh_derivative_matches_torch_over_a_wide_range():
    x = torch.cat([torch.linspace(-12, 12, 4001), torch.tensor([0.0, -0.0, 1e-30, -1e-30, 30.0, -30.0])])
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(0))
    got = mm.activation_backward(dy, x, "gelu_tanh")
    for dt in (torch.float32, torch.float64):
        xr = x.detach().to(dt).requires_grad_()
        gelu_tanh(xr).backward(dy.to(dt))
        # atol: for x < -4, 1 + tanh(u) and 1 - tanh(u)^2 cancel in float32, so one
        # ulp of tanhf (libm's vs torch's vectorised one) is ~1e-6 of the gradient
        torch.testing.assert_close(got.to(dt), xr.grad, rtol=1e-5, atol=5e-6)
    torch.testing.assert_close(mm.gemm(x[:, None], torch.ones(1, 1), activation="gelu_tanh")[0][:, 0],
                               gelu_tanh(x), rtol=1e-6, atol=5e-7)  # same cancellation


def test_linear_module_gelu_tanh_and_bf16():
    torch.manual_seed(1)
    layer = mnn.Linear(32, 24, activation="gelu_tanh")
    ref = torch.nn.Linear(32, 24)
    ref.load_state_dict(layer.state_dict())
    x = torch.randn(6, 32)
    y, r = layer(x), gelu_tanh(ref(x))
    torch.testing.assert_close(y, r, rtol=1e-5, atol=1e-5)
    y.sum().backward()
    r.sum().backward()
    torch.testing.assert_close(layer.weight.grad, ref.weight.grad, rtol=1e-4, atol=1e-4)
    assert "activation='gelu_tanh'" in repr(layer)
    xb = torch.randn(8, 32, dtype=torch.bfloat16)
    lb = mnn.Linear(32, 24, activation="gelu_tanh", dtype=torch.bfloat16)
    assert rel(lb(xb), gelu_tanh(F.linear(xb.double(), lb.weight.double(), lb.bias.double()))) < 1e-2


def test_relu_linear_keeps_its_output_not_a_second_tensor():
    """relu'(pre) == relu'(y): the autograd Function saves y, so no extra m x n tensor."""
    x = torch.randn(16, 8, requires_grad=True)
    w = torch.randn(12, 8, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = MF.linear(x, w, None, "relu")
    big = [t for t in saved if tuple(t.shape) == (16, 12)]
    assert len(big) == 1 and big[0].data_ptr() == y.data_ptr()
    y.backward(torch.ones_like(y))
    x2, w2 = x.detach().requires_grad_(), w.detach().requires_grad_()
    torch.relu(F.linear(x2, w2)).backward(torch.ones_like(y))
    torch.testing.assert_close(x.grad, x2.grad)
    torch.testing.assert_close(w.grad, w2.grad)


# ---- backend choice and queries (no GPU needed) --------------------------------------------


def test_backend_query_on_cpu():
    mm.matmul(torch.randn(3, 4), torch.randn(4, 5))
    info = memfit.amp.gemm_backend("cpu")
    assert info["device"] == "cpu" and info["backend"] == "cpu" and info["reason"] == ""
    assert info["mode"] in mm.BACKENDS
    assert info["last"] == {"backend": "cpu", "reason": ""}
    assert set(info["cublaslt"]) == {"loaded", "version", "path", "reason"}


@pytest.mark.skipif(memfit.cuda_device_count() > 0, reason="checks the answer on a machine without a GPU")
def test_backend_query_for_cuda_without_gpu_is_clean():
    info = memfit.amp.gemm_backend("cuda")
    assert info["device"] == "cuda:0" and info["backend"] in ("portable", None)
    assert info["reason"], "it must say why cuBLASLt is not used"
    if not memfit.build_info()["cuda"]:
        assert "built without CUDA" in info["reason"]
        assert not info["cublaslt"]["loaded"]
    else:
        lt = info["cublaslt"]
        # loaded (a library was found) or not, with the reason: either way no GPU
        assert lt["loaded"] or "not found" in lt["reason"] or "MEMFIT_CUBLASLT" in lt["reason"]
        assert info["reason"] in ("no CUDA device is visible", lt["reason"])


def test_set_gemm_backend_round_trip_and_errors():
    prev = memfit.amp.gemm_backend("cpu")["mode"]
    try:
        memfit.amp.set_gemm_backend("portable")
        assert memfit.amp.gemm_backend("cpu")["mode"] == "portable"
        memfit.amp.set_gemm_backend("cublaslt")
        assert memfit.amp.gemm_backend("cpu")["mode"] == "cublaslt"
        # the CPU kernel is used whatever the CUDA backend
        assert torch.equal(mm.matmul(torch.eye(3), torch.eye(3)), torch.eye(3))
    finally:
        memfit.amp.set_gemm_backend(prev)
    with pytest.raises(ValueError, match="backend: expected one of 'auto', 'portable', 'cublaslt'"):
        memfit.amp.set_gemm_backend("cublas")
    with pytest.raises(ValueError, match="device: expected 'cpu', 'cuda', 'cuda:N' or an int"):
        memfit.amp.gemm_backend("tpu")


def _run(code, **env):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          env={**os.environ, **env}).stdout


def test_environment_variable_chooses_the_backend():
    code = "import memfit.amp as a; i = a.gemm_backend('cpu'); print(i['mode'], i.get('warning', ''))"
    assert _run(code, MEMFIT_GEMM_BACKEND="portable").split()[0] == "portable"
    out = _run(code, MEMFIT_GEMM_BACKEND="fast")
    assert out.startswith("auto") and "MEMFIT_GEMM_BACKEND='fast' is not one of" in out


def test_pip_wheel_libraries_are_found_newest_first(tmp_path, monkeypatch):
    for sub, name in [("cublas", "libcublasLt.so.12"), ("cu13", "libcublasLt.so.13"), ("cu13", "libcublasLt.so")]:
        (tmp_path / "nvidia" / sub / "lib").mkdir(parents=True, exist_ok=True)
        (tmp_path / "nvidia" / sub / "lib" / name).write_bytes(b"")
    monkeypatch.setattr(sys, "path", [str(tmp_path), str(tmp_path)])
    assert mm.cublaslt_candidates() == [str(tmp_path / "nvidia/cu13/lib/libcublasLt.so.13"),
                                        str(tmp_path / "nvidia/cublas/lib/libcublasLt.so.12")]


def test_missing_library_is_reported_not_raised():
    if not memfit.build_info()["cuda"]:
        pytest.skip("a CPU-only build never loads cuBLASLt")
    out = _run("import memfit._C as C; i = C.cublaslt_info(True); print(i['loaded'], '|', i['reason'])",
               MEMFIT_CUBLASLT="/nonexistent/libcublasLt.so.13")
    assert out.startswith("False |") and "MEMFIT_CUBLASLT=/nonexistent/libcublasLt.so.13 did not load" in out


# ---- our cuBLASLt declarations against NVIDIA's header and library -----------------------


def _headers():
    """Directories holding a cublasLt.h: MEMFIT_CUBLASLT_INCLUDE (os.pathsep list), the
    CUDA toolkit, pip's nvidia wheels."""
    dirs = [d for d in os.environ.get("MEMFIT_CUBLASLT_INCLUDE", "").split(os.pathsep) if d]
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    dirs.append(os.path.join(cuda_home, "include"))
    for root in sys.path:
        dirs += [str(p.parent) for p in Path(root).glob("nvidia/*/include/cublasLt.h")] if os.path.isdir(root) else []
    return [d for d in dict.fromkeys(dirs) if os.path.isfile(os.path.join(d, "cublasLt.h"))]


def _cuda_runtime_includes():
    """Where cuda_runtime_api.h and library_types.h (which cublasLt.h includes) live."""
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    dirs = [os.path.join(cuda_home, "include")]
    for root in sys.path:
        dirs += [str(p.parent) for p in Path(root).glob("nvidia/*/include/cuda_runtime_api.h")] if os.path.isdir(root) else []
    return [d for d in dirs if os.path.isfile(os.path.join(d, "library_types.h"))][:1]


@pytest.mark.parametrize("include", _headers() or [None])
def test_cublaslt_declarations_match_header(include):
    cxx = shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++") or shutil.which("clang++")
    if include is None:
        pytest.skip("no cublasLt.h found (set MEMFIT_CUBLASLT_INCLUDE to check against one)")
    if cxx is None or not _cuda_runtime_includes():
        pytest.skip("needs a C++ compiler and the CUDA runtime headers")
    out = subprocess.run([cxx, "-std=c++17", "-fsyntax-only", f"-I{include}",
                          *[f"-I{d}" for d in _cuda_runtime_includes()], f"-I{ROOT / 'cuda'}",
                          str(ROOT / "tests" / "cublaslt_abi_check.cpp")], capture_output=True, text=True)
    assert out.returncode == 0, f"cuda/cublaslt_abi.h disagrees with {include}/cublasLt.h:\n{out.stderr[-3000:]}"


def _libraries():
    env = os.environ.get("MEMFIT_CUBLASLT")
    return list(dict.fromkeys(([env] if env else []) + mm.cublaslt_candidates()))


@pytest.mark.skipif(not memfit.build_info()["cuda"], reason="memfit was built without CUDA")
@pytest.mark.parametrize("library", _libraries() or [None])
def test_cublaslt_library_accepts_our_descriptors(library):
    """Loads the library in a fresh process and builds every descriptor memfit uses:
    cuBLASLt checks each attribute's size, so a wrong declaration fails here, GPU or not."""
    if library is None:
        pytest.skip("no libcublasLt found (set MEMFIT_CUBLASLT to check against one)")
    out = _run("import memfit._C as C\ni = C.cublaslt_info(True)\nassert i['loaded'], i['reason']\n"
               "C.cublaslt_selfcheck()\nprint(i['version'], i['path'])", MEMFIT_CUBLASLT=library)
    version, path = out.split(maxsplit=1)
    assert int(version) >= 110000 and os.path.samefile(path.strip(), library)


# ---- on a GPU ---------------------------------------------------------------------------------

DTYPES = [torch.float16, torch.bfloat16]
HALF_TOL = {torch.float16: 1e-3, torch.bfloat16: 8e-3, torch.float32: 1e-5}


@pytest.fixture
def cublaslt():
    """cuBLASLt as the required backend (an error instead of a silent fallback) for the
    test. Skips only where no libcublasLt exists in the process or in pip's wheels."""
    info = memfit.amp.gemm_backend("cuda")
    if info["backend"] != "cublaslt":
        maps = Path("/proc/self/maps").read_text() if os.path.exists("/proc/self/maps") else ""
        if "libcublasLt" in maps or mm.cublaslt_candidates():
            pytest.fail(f"a libcublasLt is present but memfit does not use it: {info}")
        pytest.skip(f"no cuBLASLt: {info['reason']}")
    with backend("cublaslt"):
        yield info


@contextlib.contextmanager
def backend(name):
    prev = memfit.amp.gemm_backend("cpu")["mode"]
    memfit.amp.set_gemm_backend(name)
    try:
        yield
    finally:
        memfit.amp.set_gemm_backend(prev)


def last():
    return memfit.amp.gemm_backend("cpu")["last"]


def randn(*shape, dtype=torch.float32, scale=1.0, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(*shape, generator=g, device="cuda") * scale).to(dtype)


@pytest.mark.cuda
def test_gemm_backend_reports_cublaslt(cublaslt):
    lt = cublaslt["cublaslt"]
    assert lt["loaded"] and lt["version"] and os.path.exists(lt["path"])
    mm.matmul(randn(64, 64, dtype=torch.bfloat16), randn(64, 64, dtype=torch.bfloat16))
    assert last() == {"backend": "cublaslt", "reason": ""}


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES + [torch.float32])
@pytest.mark.parametrize("m,k,n", [(256, 768, 3072), (128, 64, 96), (8, 4096, 1024)])
@pytest.mark.parametrize("out_f32", [True, False])
def test_cublaslt_matches_float64(cublaslt, dtype, m, k, n, out_f32):
    a, b = randn(m, k, dtype=dtype, seed=1), randn(k, n, dtype=dtype, seed=2)
    if dtype == torch.float32 and not out_f32:
        pytest.skip("float32 inputs have float32 outputs only")
    out = mm.matmul(a, b, out_dtype=torch.float32 if out_f32 else None)
    ref = a.double() @ b.double()  # exact products of the rounded inputs
    # float32 output: only float32 accumulation error (and for float32 inputs this
    # fails if TF32 were used: its error is ~1e-3)
    assert rel(out, ref) < (1e-5 if out_f32 or dtype == torch.float32 else HALF_TOL[dtype])
    assert last()["backend"] == "cublaslt"


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("trans_a,trans_b", [(False, False), (False, True), (True, False), (True, True)])
def test_cublaslt_transposes(cublaslt, dtype, trans_a, trans_b):
    m, k, n = 96, 200, 136
    a, b = randn(m, k, dtype=dtype, seed=3), randn(k, n, dtype=dtype, seed=4)
    a_in = a.t().contiguous() if trans_a else a
    b_in = b.t().contiguous() if trans_b else b
    out, _ = mm.gemm(a_in, b_in, trans_a=trans_a, trans_b=trans_b, out_dtype=torch.float32)
    assert rel(out, a.double() @ b.double()) < 1e-5
    assert last()["backend"] == "cublaslt"


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES + [torch.float32])
def test_cublaslt_matches_portable_kernel(cublaslt, dtype):
    x, w, b = randn(300, 256, dtype=dtype, seed=5), randn(512, 256, dtype=dtype, seed=6, scale=1 / 16), randn(512, dtype=dtype, seed=7)
    lt, lt_pre = mm.gemm(x, w, trans_b=True, bias=b, activation="gelu", save_pre=True)
    with backend("portable"):
        pt, pt_pre = mm.gemm(x, w, trans_b=True, bias=b, activation="gelu", save_pre=True)
        assert last()["backend"] == "portable"
    tol = HALF_TOL[dtype] if dtype != torch.float32 else 1e-5
    assert rel(lt, pt) < tol and rel(lt_pre, pt_pre) < tol


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", [None, "relu", "gelu", "gelu_tanh"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("save_pre", [True, False])
@pytest.mark.parametrize("n", [256, 100])  # n % 8 != 0: gelu_tanh's aux buffer cannot be used
def test_cublaslt_epilogues_and_saved_preactivation(cublaslt, dtype, activation, bias, save_pre, n):
    m, k = 64, 128
    x, w = randn(m, k, dtype=dtype, seed=8), randn(n, k, dtype=dtype, seed=9, scale=k**-0.5)
    b = randn(n, dtype=dtype, seed=10) if bias else None
    y, pre = mm.gemm(x, w, trans_b=True, bias=b, activation=activation, save_pre=save_pre)
    ref_pre = x.double() @ w.double().t() + (b.double() if bias else 0)
    act = {None: lambda t: t, "relu": torch.relu, "gelu": F.gelu, "gelu_tanh": gelu_tanh}[activation]
    assert y.dtype == dtype and rel(y, act(ref_pre)) < 2 * HALF_TOL[dtype]
    if save_pre and activation:
        assert rel(pre, ref_pre) < HALF_TOL[dtype]
    else:
        assert pre is None
    assert last()["backend"] == "cublaslt"


@pytest.mark.cuda
def test_cublaslt_gelu_epilogue_is_the_tanh_form(cublaslt):
    """cuBLASLt's GELU epilogue serves "gelu_tanh" only: with float32 outputs it must be
    much closer to torch's approximate="tanh" than to the exact GELU."""
    m, k, n = 256, 512, 512
    x, w = randn(m, k, dtype=torch.bfloat16, seed=11), randn(n, k, dtype=torch.bfloat16, seed=12, scale=2 * k**-0.5)
    b = randn(n, seed=13)
    y, pre = mm.gemm(x, w, trans_b=True, bias=b, activation="gelu_tanh", save_pre=True, out_dtype=torch.float32)
    ref = x.double() @ w.double().t() + b.double()
    err_tanh = (y.double() - gelu_tanh(ref)).abs().mean().item()
    err_erf = (y.double() - F.gelu(ref)).abs().mean().item()
    assert err_tanh < err_erf / 4, (err_tanh, err_erf)
    assert (y.double() - gelu_tanh(ref)).abs().max().item() < 1e-3
    assert rel(pre, ref) < 1e-5
    y2, _ = mm.gemm(x, w, trans_b=True, bias=b, activation="gelu", out_dtype=torch.float32)
    assert (y2.double() - F.gelu(ref)).abs().max().item() < 1e-5, "exact gelu must stay exact"


@pytest.mark.cuda
@backend("auto")
def test_cases_cublaslt_declines_fall_back_and_say_why():
    """Under "auto" these run in the portable kernel, correctly, and say why."""
    a16, b16 = randn(32, 48, dtype=torch.float16, seed=14), randn(48, 40, dtype=torch.float16, seed=15)
    out = mm.matmul(a16, b16, out_dtype=torch.bfloat16)  # cuBLASLt has no f16 x f16 -> bf16
    assert rel(out, a16.double() @ b16.double()) < 8e-3
    assert last()["backend"] == "portable" and "float16 x float16 -> bfloat16" in last()["reason"]
    bias16 = randn(40, dtype=torch.float16, seed=16)
    out, _ = mm.gemm(a16, b16, bias=bias16, out_dtype=torch.float32)  # bias dtype != output dtype
    assert rel(out, a16.double() @ b16.double() + bias16.double()) < 1e-5
    assert last()["backend"] == "portable" and "bias" in last()["reason"]
    empty, _ = mm.gemm(randn(5, 0, dtype=torch.bfloat16), randn(0, 7, dtype=torch.bfloat16),
                       bias=randn(7, dtype=torch.bfloat16, seed=17), activation="relu")
    assert last()["backend"] == "portable" and "k == 0" in last()["reason"]
    assert rel(empty, torch.relu(randn(7, dtype=torch.bfloat16, seed=17).double()).expand(5, 7)) == 0
    with backend("cublaslt"), pytest.raises(memfit.CudaError,
                                            match="cannot run this product.*float16 x float16 -> bfloat16"):
        mm.matmul(a16, b16, out_dtype=torch.bfloat16)


@pytest.mark.cuda
@pytest.mark.parametrize("m,k,n", [(1, 1, 1), (7, 13, 5), (33, 70, 50), (65, 257, 33)])
@pytest.mark.parametrize("offset", [0, 1])
@backend("auto")
def test_odd_shapes_and_offsets_are_right_whichever_backend_runs(m, k, n, offset):
    """Odd sizes and views that start one element into their storage (2-byte aligned):
    cuBLASLt may take them or leave them to the portable kernel; the result is right
    either way and the backend says which."""
    a = randn(m * k + offset, dtype=torch.bfloat16, seed=18)[offset:].view(m, k)
    w = randn(n * k + offset, dtype=torch.bfloat16, seed=19, scale=k**-0.5)[offset:].view(n, k)
    b = randn(n, dtype=torch.bfloat16, seed=20)
    y, pre = mm.gemm(a, w, trans_b=True, bias=b, activation="gelu_tanh", save_pre=True)
    ref = a.double() @ w.double().t() + b.double()
    # bf16 outputs; the pre-activation may be rounded to bf16 before the activation
    torch.testing.assert_close(pre.double(), ref, rtol=8e-3, atol=8e-3)
    torch.testing.assert_close(y.double(), gelu_tanh(ref), rtol=2e-2, atol=2e-2)
    info = last()
    assert info["backend"] in ("cublaslt", "portable")
    assert (info["backend"] == "portable") == bool(info["reason"])


@pytest.mark.cuda
def test_cublaslt_runs_on_the_callers_streams(cublaslt):
    """Products on two side streams at once (each has its own workspace) give the same
    results as on the default stream."""
    a = [randn(512, 1024, dtype=torch.bfloat16, seed=21 + i) for i in range(2)]
    b = [randn(1024, 768, dtype=torch.bfloat16, seed=23 + i) for i in range(2)]
    expect = [mm.matmul(a[i], b[i], out_dtype=torch.float32) for i in range(2)]
    torch.cuda.synchronize()
    streams = [torch.cuda.Stream() for _ in range(2)]
    outs = [None, None]
    for _ in range(3):
        for i, s in enumerate(streams):
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                outs[i] = mm.matmul(a[i], b[i], out_dtype=torch.float32)
    for s in streams:
        s.synchronize()
    for i in range(2):
        assert torch.equal(outs[i], expect[i]) or rel(outs[i], expect[i]) < 1e-6


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", [None, "relu", "gelu", "gelu_tanh"])
def test_linear_forward_backward_match_torch_on_cublaslt(cublaslt, dtype, activation):
    torch.manual_seed(0)
    ref = torch.nn.Linear(256, 512, device="cuda", dtype=dtype)
    layer = mnn.Linear(256, 512, device="cuda", dtype=dtype, activation=activation)
    layer.load_state_dict(ref.state_dict())
    x = torch.randn(4, 64, 256, device="cuda", dtype=dtype)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    act = {None: lambda t: t, "relu": torch.relu, "gelu": F.gelu, "gelu_tanh": gelu_tanh}[activation]
    y, r = layer(x1), act(ref(x2))
    gy = torch.randn_like(y)
    y.backward(gy)
    r.backward(gy)
    tol = 2 * HALF_TOL[dtype]
    assert rel(y, r) < tol
    for got, want in [(x1.grad, x2.grad), (layer.weight.grad, ref.weight.grad), (layer.bias.grad, ref.bias.grad)]:
        assert rel(got, want) < 2 * tol
    assert last()["backend"] == "cublaslt"


@pytest.mark.cuda
def test_a_library_torch_already_loaded_is_reused():
    code = ("import torch, memfit.amp\n"
            "torch.ones(8, 8, device='cuda') @ torch.ones(8, 8, device='cuda')\n"
            "lt = memfit.amp.gemm_backend('cuda')['cublaslt']\n"
            "maps = {l.split()[-1] for l in open('/proc/self/maps') if 'libcublasLt' in l}\n"
            "print(lt['path'], '|', ' '.join(sorted(maps)))")
    path, maps = _run(code).split("|")
    if not maps.split():
        pytest.skip("this torch build does not load libcublasLt")
    assert len(maps.split()) == 1, "a second libcublasLt was loaded"
    assert os.path.realpath(path.strip()) == os.path.realpath(maps.split()[0])
