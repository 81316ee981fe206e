"""The fused gradient passes (unscale + non-finite check, global norm, clip) against
torch's kernels and a float64 reference, and their bad-input errors."""

import numpy as np
import pytest
import torch

import memfit
import memfit.amp as amp
from memfit import _C

HAVE_CUDA = torch.cuda.is_available() and memfit.build_info()["cuda"]
cuda = [pytest.mark.cuda]  # tests/conftest.py skips these, with the reason, without a GPU
DEVICES = ["cpu", pytest.param("cuda", marks=cuda)]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
CHUNK = _C.scaler_layout()["chunk"]


def torch_unscale(grads, scale):
    found = torch.zeros((), device=grads[0].device)
    inv = torch.full((), scale, device=grads[0].device).double().reciprocal().float()
    try:
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv)
    except NotImplementedError:
        # torch before 2.12 has no bfloat16 CUDA kernel for this (seen with 2.11 on an
        # H200): its CPU kernel, the same float32 product and cast, is the reference then
        host = [g.cpu() for g in grads]
        found_host = torch.zeros(())
        torch._amp_foreach_non_finite_check_and_unscale_(host, found_host, inv.cpu())
        for g, h in zip(grads, host):
            g.copy_(h)
        found.copy_(found_host)
    return found


def memfit_unscale(grads, scale):
    found = torch.zeros((), device=grads[0].device)
    s = None if scale is None else torch.full((), scale, device=grads[0].device)
    _C.unscale_grads(grads, s, found, 0)
    return found


def random_grads(sizes, dtype, device, gen):
    return [(torch.randn(n, generator=gen) * 1000).to(dtype).to(device) for n in sizes]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_unscale_bitwise_equal_to_torch(device, dtype):
    gen = torch.Generator().manual_seed(0)
    # small, odd, one chunk exactly, several chunks: exercises the chunk table and threads
    sizes = [1, 7, 1000, CHUNK, CHUNK + 3, 3 * CHUNK + 17, 0, 5]
    ours = random_grads(sizes, dtype, device, gen)
    ref = [g.clone() for g in ours]
    for scale in (65536.0, 3.0, 0.37):
        f_ours = memfit_unscale(ours, scale)
        f_ref = torch_unscale(ref, scale)
        assert f_ours.item() == f_ref.item() == 0.0
        for a, b in zip(ours, ref):
            assert torch.equal(a.view(torch.int16 if dtype != torch.float32 else torch.int32),
                               b.view(torch.int16 if dtype != torch.float32 else torch.int32))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("where", [0, CHUNK - 1, 2 * CHUNK + 5])
def test_unscale_finds_nonfinite_anywhere(device, dtype, bad, where):
    grads = [torch.ones(10, dtype=dtype, device=device),
             torch.ones(3 * CHUNK, dtype=dtype, device=device)]
    grads[1][where] = bad
    found = memfit_unscale(grads, 2.0)
    assert found.item() == 1.0
    assert torch.all(grads[0] == 0.5)  # finite values are still unscaled (as torch)
    other = torch.ones(3 * CHUNK, dtype=torch.bool)
    other[where] = False
    assert torch.all(grads[1].cpu()[other] == 0.5)


def test_unscale_mixed_dtypes_one_call_and_sticky_flag():
    grads = [torch.full((300,), 4.0, dtype=d) for d in DTYPES]
    found = torch.ones(())  # already set: never cleared
    _C.unscale_grads(grads, torch.tensor(4.0), found, 0)
    assert found.item() == 1.0
    assert all(torch.all(g == 1.0) for g in grads)


def test_check_only_does_not_write():
    g = torch.randn(1000)
    g[10] = float("nan")
    before = g.clone()
    found = torch.zeros(())
    _C.unscale_grads([g], None, found, 0)
    assert found.item() == 1.0
    assert torch.equal(g.view(torch.int32), before.view(torch.int32))


def test_unscale_numpy_and_bfloat16_numpy():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    a = np.full(100, 8.0, dtype=np.float32)
    b = np.full(50, 8.0, dtype=ml_dtypes.bfloat16)
    found = np.zeros(1, dtype=np.float32)
    _C.unscale_grads([a, b], np.array([2.0], dtype=np.float32), found, 0)
    assert found[0] == 0 and np.all(a == 4.0) and np.all(b.astype(np.float32) == 4.0)


# torch's test_grad_scaling_unscale cases, through the scaler: contiguous, transposed
# (dense, not contiguous) and sliced (gaps) gradients, with and without inf/NaN.
@pytest.mark.parametrize("device", DEVICES)
def test_scaler_unscale_contiguous_transposed_sliced(device):
    g = torch.full((20, 20), 4.0, device=device)
    ginf, gnan = g.clone(), g.clone()
    ginf[2, 2] = float("inf")
    gnan[2, 2] = float("nan")
    cases = (
        ([g.clone(), g.clone()], False),
        ([g.clone(), g.clone().t()], False),
        ([g.clone(), g.clone()[:, :5]], False),
        ([g.clone()[:, :5], g.clone()[:, :5]], False),
        ([g.clone(), ginf.clone()], True),
        ([g.clone(), gnan.clone()], True),
        ([g.clone(), ginf.clone()[:, :5]], True),
        ([g.clone(), gnan.clone()[:, :5]], True),
        ([ginf.clone(), g.clone()[:, :5]], True),
        ([ginf.clone()[:, :5], g.clone()[:, :5]], True),
        ([g.clone().t()[:, 3:], gnan.clone().t()], True),
    )
    for grads, has_inf in cases:
        params = [torch.nn.Parameter(torch.zeros_like(x)) for x in grads]
        for p, x in zip(params, grads):
            p.grad = x
        opt = torch.optim.SGD(params, lr=0.1)
        s = amp.GradScaler(device=device, init_scale=4.0)
        s.scale(torch.ones((), device=device))
        s.unscale_(opt)
        found = sum(v.item() for v in s._found_inf_per_device(opt).values())
        assert found == (1.0 if has_inf else 0.0)
        if not has_inf:
            for p, x in zip(params, grads):
                assert p.grad is x  # unscaled in place, the same tensor
                torch.testing.assert_close(x, torch.ones_like(x), rtol=1e-5, atol=1e-7)


def test_scaler_unscale_sparse_and_float64_grads():
    i = torch.tensor([[0, 1, 1], [2, 0, 2]])
    v = torch.tensor([16.0, 32.0, 48.0])
    ps = torch.nn.Parameter(torch.zeros(2, 3))
    ps.grad = torch.sparse_coo_tensor(i, v, (2, 3)).coalesce()
    pd = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))
    pd.grad = torch.full((3,), 8.0, dtype=torch.float64)
    opt = torch.optim.SGD([ps, pd], lr=0.1)
    s = amp.GradScaler(device="cpu", init_scale=8.0)
    s.scale(torch.ones(()))
    s.unscale_(opt)
    torch.testing.assert_close(ps.grad.to_dense(),
                               torch.tensor([[0, 0, 2.0], [4.0, 0, 6.0]]))
    torch.testing.assert_close(pd.grad, torch.ones(3, dtype=torch.float64))


def test_unscale_bad_input():
    ok = [torch.ones(4)]
    found = torch.zeros(())
    with pytest.raises(TypeError, match=r"grads\[1\].*dtype"):
        _C.unscale_grads([torch.ones(4), torch.ones(4, dtype=torch.float64)], None, found, 0)
    with pytest.raises(TypeError, match=r"grads\[0\]"):
        _C.unscale_grads([torch.ones(4, dtype=torch.int32)], None, found, 0)
    with pytest.raises(ValueError, match=r"grads\[0\].*contiguous"):
        _C.unscale_grads([torch.ones(4, 4)[:, :2]], None, found, 0)
    with pytest.raises(TypeError, match="list or tuple"):
        _C.unscale_grads(torch.ones(4), None, found, 0)
    with pytest.raises(TypeError, match=r"grads\[0\].*expected an array"):
        _C.unscale_grads([3.0], None, found, 0)
    with pytest.raises(TypeError, match="found_inf"):
        _C.unscale_grads(ok, None, torch.zeros((), dtype=torch.float64), 0)
    with pytest.raises(ValueError, match="found_inf"):
        _C.unscale_grads(ok, None, torch.zeros(2), 0)
    with pytest.raises(ValueError, match="scale"):
        _C.unscale_grads(ok, torch.ones(3), found, 0)
    with pytest.raises(ValueError, match="found_inf.*read-only"):
        ro = np.zeros(1, dtype=np.float32)
        ro.flags.writeable = False
        _C.unscale_grads([np.ones(3, np.float32)], None, ro, 0)
    with pytest.raises(ValueError, match=r"grads\[0\].*sparse"):
        _C.unscale_grads([torch.ones(3).to_sparse()], None, found, 0)
    _C.unscale_grads([], torch.ones(()), found, 0)  # nothing to do is fine
    assert found.item() == 0.0


@pytest.mark.cuda
def test_unscale_mixed_devices_rejected():
    with pytest.raises(ValueError, match="one device"):
        _C.unscale_grads([torch.ones(3), torch.ones(3, device="cuda")], None, torch.zeros(()), 0)
    with pytest.raises(ValueError, match="found_inf"):
        _C.unscale_grads([torch.ones(3, device="cuda")], None, torch.zeros(()), 0)


def test_failed_dlpack_export_names_the_element():
    class Unexportable:  # reports a CUDA device, then refuses to export
        def __dlpack_device__(self):
            return (2, 0)

        def __dlpack__(self, **kw):
            raise BufferError("no GPU here")

    with pytest.raises(TypeError, match=r"grads\[1\].*DLPack"):
        _C.unscale_grads([torch.ones(2), Unexportable()], None, torch.zeros(()), 0)


# ---- norm and clip ----------------------------------------------------------------------


def ref_norm(grads, p):
    flat = torch.cat([g.detach().double().flatten().cpu() for g in grads])
    return torch.linalg.vector_norm(flat, p).item()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("p", [2.0, 1.0, float("inf"), 3.0])
def test_grad_norm_matches_float64(device, dtype, p):
    gen = torch.Generator().manual_seed(1)
    grads = random_grads([5, 300, CHUNK + 11, 2 * CHUNK], dtype, device, gen)
    out = torch.empty((), device=device)
    ws = (torch.empty(_C.mt_num_chunks([g.numel() for g in grads]), device=device)
          if device == "cuda" else None)
    _C.grad_norm(grads, p, ws, out, 0)
    assert out.item() == pytest.approx(ref_norm(grads, p), rel=2e-6 if p != 3.0 else 1e-5)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_grad_norm_nonfinite(bad):
    grads = [torch.ones(10), torch.ones(CHUNK + 5)]
    grads[1][CHUNK + 1] = bad
    out = torch.empty(())
    for p in (2.0, 1.0, float("inf")):
        _C.grad_norm(grads, p, None, out, 0)
        v = out.item()
        assert (v != v) if bad != bad else v == float("inf")


def test_grad_norm_thread_count_does_not_change_result():
    gen = torch.Generator().manual_seed(3)
    grads = random_grads([4 * CHUNK + 9, 77], torch.float32, "cpu", gen)
    out = torch.empty(())
    results = []
    old = memfit.get_num_threads()
    try:
        for n in (1, 2, 3):
            memfit.set_num_threads(n)
            _C.grad_norm(grads, 2.0, None, out, 0)
            results.append(out.item())
    finally:
        memfit.set_num_threads(0 if old == 0 else old)
    assert results[0] == results[1] == results[2]


def test_grad_norm_bad_input():
    out = torch.empty(())
    for p in (0.0, -1.0, float("-inf"), float("nan")):
        with pytest.raises(ValueError, match="norm_type"):
            _C.grad_norm([torch.ones(3)], p, None, out, 0)
    with pytest.raises(TypeError, match="out"):
        _C.grad_norm([torch.ones(3)], 2.0, None, torch.empty((), dtype=torch.float16), 0)
    _C.grad_norm([], 2.0, None, out, 0)
    assert out.item() == 0.0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("p", [2.0, 1.0, float("inf")])
@pytest.mark.parametrize("max_norm", [0.5, 1e9])
def test_clip_grad_norm_agrees_with_torch(device, p, max_norm):
    torch.manual_seed(4)
    shapes = [(30, 20), (20,), (CHUNK + 3,), (7, 9)]
    ours = [torch.nn.Parameter(torch.zeros(s, device=device)) for s in shapes]
    ref = [torch.nn.Parameter(torch.zeros(s, device=device)) for s in shapes]
    for a, b in zip(ours, ref):
        g = torch.randn(a.shape, device=device)
        a.grad, b.grad = g.clone(), g.clone()
    ours[0].grad = ours[0].grad.t().contiguous().t()  # transposed (dense) gradient
    ref[0].grad = ref[0].grad.t().contiguous().t()
    exact = ref_norm([b.grad for b in ref], p)
    n_ours = amp.clip_grad_norm_(ours, max_norm, p)
    n_ref = torch.nn.utils.clip_grad_norm_(ref, max_norm, p)
    assert n_ours.dtype == torch.float32 and n_ours.device.type == device
    # torch sums in float32; memfit adds float32 partials of 256 elements in float64, so
    # it is at least as close to the float64 norm (checked) and within 1e-5 of torch
    assert abs(n_ours.item() - exact) <= abs(n_ref.item() - exact) + 1e-6 * exact
    torch.testing.assert_close(n_ours, n_ref, rtol=1e-5, atol=0)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a.grad, b.grad, rtol=2e-6, atol=1e-7)


def test_clip_grad_norm_sliced_grads_written_back():
    w = torch.nn.Parameter(torch.zeros(10, 4))
    full = torch.randn(10, 8) * 10
    w.grad = full[:, :4]  # gaps: goes through a contiguous copy and back
    expected = full[:, :4].norm().item()
    n = amp.clip_grad_norm_([w], 1.0)
    assert n.item() == pytest.approx(expected, rel=1e-6)
    assert w.grad.norm().item() == pytest.approx(1.0, rel=1e-4)
    assert w.grad.data_ptr() == full.data_ptr()


def test_clip_grad_norm_half_grads_and_edge_cases():
    p16 = torch.nn.Parameter(torch.zeros(100, dtype=torch.bfloat16))
    p16.grad = torch.randn(100).to(torch.bfloat16) * 5
    ref = p16.grad.float().clone()
    n = amp.clip_grad_norm_([p16], 1.0)
    assert n.item() == pytest.approx(ref.double().norm().item(), rel=1e-6)
    coef = min(1.0, 1.0 / (n.item() + 1e-6))
    torch.testing.assert_close(p16.grad, (ref * coef).to(torch.bfloat16))
    # no gradients: 0, as torch
    assert amp.clip_grad_norm_([torch.nn.Parameter(torch.zeros(2))], 1.0).item() == 0.0
    # float64: handed to torch
    pd = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))
    pd.grad = torch.tensor([3.0, 4.0, 0.0], dtype=torch.float64)
    assert amp.clip_grad_norm_(pd, 1.0).item() == pytest.approx(5.0)
    # error_if_nonfinite
    pn = torch.nn.Parameter(torch.zeros(3))
    pn.grad = torch.tensor([1.0, float("nan"), 0.0])
    with pytest.raises(RuntimeError, match="non-finite"):
        amp.clip_grad_norm_([pn], 1.0, error_if_nonfinite=True)
    with pytest.raises(TypeError, match="max_norm"):
        amp.clip_grad_norm_([pn], "1.0")


def test_clip_with_scaler_and_optimizer_unscales_once():
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.1)
    s = amp.GradScaler("cpu", init_scale=4.0)
    s.scale(p.sum()).backward()
    # the optimizer as `parameters`: unscaled once, step does not unscale again
    n = amp.clip_grad_norm_(opt, 100.0, scaler=s)
    assert n.item() == pytest.approx(3**0.5)
    with pytest.raises(RuntimeError, match="already been called"):
        s.unscale_(opt)
    s.step(opt)
    s.update()
    torch.testing.assert_close(p.detach(), torch.full((3,), 0.9))


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("inf", [False, True])
def test_clip_with_scaler_only(fused, inf):
    # clip_grad_norm_(params, max_norm, scaler=s) without the optimizer: the scaler
    # records the unscaled gradients; step() neither unscales them again nor loses
    # their inf; a fused optimizer then gets grad_scale=None
    torch.manual_seed(7)
    ref = torch.nn.Linear(4, 3)
    model = torch.nn.Linear(4, 3)
    model.load_state_dict(ref.state_dict())
    kw = {"lr": 0.1, "fused": True} if fused else {"lr": 0.1}
    opt, ropt = torch.optim.AdamW(model.parameters(), **kw), torch.optim.AdamW(ref.parameters(), **kw)
    s = amp.GradScaler("cpu", init_scale=256.0)
    x = torch.randn(5, 4)
    s.scale(model(x).pow(2).sum()).backward()
    ref(x).pow(2).sum().backward()
    if inf:
        with torch.no_grad():
            model.weight.grad[0, 0] = float("inf")
    n = amp.clip_grad_norm_(model.parameters(), 0.5, scaler=s)
    rn = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
    s.unscale_(opt)  # legal, and must not unscale the clipped gradients again
    s.step(opt)
    s.update()
    if inf:
        assert s.get_scale() == 128.0
        torch.testing.assert_close(model.bias.detach(), ref.bias.detach())  # skipped
        return
    ropt.step()
    torch.testing.assert_close(n, rn, rtol=1e-5, atol=0)
    assert s.get_scale() == 256.0
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fused", [False, True])
def test_clip_with_scaler_only_then_fused_step_without_unscale(fused):
    torch.manual_seed(8)
    ref = torch.nn.Linear(4, 3)
    model = torch.nn.Linear(4, 3)
    model.load_state_dict(ref.state_dict())
    kw = {"lr": 0.1, "fused": fused}
    opt, ropt = torch.optim.AdamW(model.parameters(), **kw), torch.optim.AdamW(ref.parameters(), **kw)
    s = amp.GradScaler("cpu", init_scale=64.0)
    x = torch.randn(5, 4)
    s.scale(model(x).pow(2).sum()).backward()
    ref(x).pow(2).sum().backward()
    amp.clip_grad_norm_([model.weight], 0.5, scaler=s)  # only some gradients
    torch.nn.utils.clip_grad_norm_([ref.weight], 0.5)
    s.step(opt)
    s.update()
    ropt.step()
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    with pytest.raises(AssertionError):  # before scale(): as unscale_ would
        amp.clip_grad_norm_([model.weight], 0.5, scaler=amp.GradScaler("cpu"))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cuda_unscale_and_norm_across_launch_boundaries(dtype):
    # 300 tensors (> 96 per launch), then one of 400 chunks in the last launch
    gen = torch.Generator().manual_seed(9)
    sizes = [int(s) for s in torch.randint(1, 5000, (300,), generator=gen)] + [400 * CHUNK - 7]
    ours = random_grads(sizes, dtype, "cuda", gen)
    ref = [g.clone() for g in ours]
    assert memfit_unscale(ours, 1024.0).item() == torch_unscale(ref, 1024.0).item() == 0.0
    for a, b in zip(ours, ref):
        assert torch.equal(a, b)
    ours[150][3] = float("nan")
    assert memfit_unscale(ours, 2.0).item() == 1.0
    ours[150][3] = 0.0
    out = torch.empty((), device="cuda")
    ws = torch.empty(_C.mt_num_chunks([g.numel() for g in ours]), device="cuda")
    for p in (2.0, float("inf")):
        _C.grad_norm(ours, p, ws, out, 0)
        assert out.item() == pytest.approx(ref_norm(ours, p), rel=2e-6)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cuda_p_norm_large_p_agrees_with_cpu(dtype):
    """|x|^p summed in float64 on both devices: v = 10, p = 40 (10^40 overflows float32,
    which made the GPU norm inf and clipping zero every gradient)."""
    grads = [torch.full((n,), 10.0, dtype=dtype) for n in (3, CHUNK + 5)]
    exact = ref_norm(grads, 40.0)
    assert exact == pytest.approx(10.0 * (3 + CHUNK + 5) ** (1 / 40), rel=1e-12)  # about 13.2
    norms = {}
    for device in ("cpu", "cuda"):
        gs = [g.to(device) for g in grads]
        out = torch.empty((), device=device)
        ws = torch.empty(_C.mt_num_chunks([g.numel() for g in gs]), device=device) if device == "cuda" else None
        _C.grad_norm(gs, 40.0, ws, out, 0)
        norms[device] = out.item()
        ps = [torch.nn.Parameter(torch.zeros_like(g)) for g in gs]
        for p, g in zip(ps, gs):
            p.grad = g.clone()
        amp.clip_grad_norm_(ps, 1.0, 40.0)
        coef = 1.0 / (exact + 1e-6)
        for p in ps:  # clipped to about 10 / 10.x, not zeroed
            assert torch.allclose(p.grad.float().cpu(), torch.full(p.shape, 10.0 * coef), rtol=1e-2)
    assert norms["cpu"] == pytest.approx(exact, rel=1e-6)
    assert norms["cuda"] == pytest.approx(norms["cpu"], rel=1e-6)


def test_unscale_then_clip_with_scaler_only_does_not_unscale_twice():
    torch.manual_seed(10)
    ref = torch.nn.Linear(4, 3)
    model = torch.nn.Linear(4, 3)
    model.load_state_dict(ref.state_dict())
    opt, ropt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    s = amp.GradScaler("cpu", init_scale=512.0)
    x = torch.randn(5, 4)
    s.scale(model(x).pow(2).sum()).backward()
    ref(x).pow(2).sum().backward()
    s.unscale_(opt)
    n = amp.clip_grad_norm_(model.parameters(), 0.5, scaler=s)
    rn = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
    torch.testing.assert_close(n, rn, rtol=1e-5, atol=0)
    s.step(opt)
    s.update()
    ropt.step()
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
