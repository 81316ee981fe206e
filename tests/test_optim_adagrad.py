"""memfit.optim.Adagrad8bit and Adagrad: torch.optim.Adagrad's update (lr_decay, L2
weight decay, initial_accumulator_value, maximize) against a float64 NumPy reference
and torch's own class, the initial state, state dicts (memfit's and torch's) and
argument checks."""

import math

import numpy as np
import pytest
import torch

import memfit.optim as mo
from memfit.optim import _core

SHAPE = (48, 300)  # rows of 300: a whole and a partial 256-block per row
HP = dict(lr=0.05, lr_decay=0.2, weight_decay=0.03, initial_accumulator_value=0.4, eps=1e-10)


def reference(p0, grads, lr, lr_decay, weight_decay, initial_accumulator_value, eps,
              maximize=False, round_to=None):
    """torch.optim.Adagrad's update in float64 (its _single_tensor_adagrad);
    ``round_to``: a dtype the parameter is rounded to after each step (as a bfloat16
    parameter is stored). Returns (parameter, sum)."""
    p = p0.astype(np.float64)
    s = np.full_like(p, initial_accumulator_value)
    for t, g in enumerate(grads, start=1):
        g = -g if maximize else g
        g = g + weight_decay * p
        clr = lr / (1 + (t - 1) * lr_decay)
        s = s + g * g
        p = p - clr * g / (np.sqrt(s) + eps)
        if round_to is not None:
            p = torch.from_numpy(p).to(round_to).double().numpy()
    return p, s


def _grads(n, seed=0, shape=SHAPE):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen) * 0.1 for _ in range(n)]


def _run(opt, p, grads):
    for g in grads:
        p.grad = g.to(p.dtype)
        opt.step()


@pytest.mark.parametrize("maximize", [False, True])
def test_adagrad_fp32_matches_float64_reference(maximize):
    """32-bit states: float32 arithmetic, within a few float32 ulps of the parameter and
    a small fraction of its path."""
    gen = torch.Generator().manual_seed(1)
    p0 = torch.randn(SHAPE, generator=gen)
    grads = _grads(6)
    p = torch.nn.Parameter(p0.clone())
    opt = mo.Adagrad([p], maximize=maximize, **HP)
    _run(opt, p, grads)
    want_p, want_s = reference(p0.numpy(), [g.double().numpy() for g in grads], maximize=maximize,
                               **HP)
    moved = np.abs(want_p - p0.numpy()).max()
    assert moved > 0.05
    np.testing.assert_allclose(p.detach().numpy(), want_p, rtol=5e-7, atol=1e-5 * moved)
    np.testing.assert_allclose(opt.state[p]["state1"].numpy(), want_s, rtol=1e-6)
    assert opt.state[p]["step"].item() == 6.0


def test_lr_decay_is_torch_schedule():
    """With a constant gradient and sum kept huge, step t moves p by clr_t * g / sqrt(sum):
    the ratio of consecutive moves is (1 + (t-2) d) / (1 + (t-1) d), as torch's clr."""
    p = torch.nn.Parameter(torch.zeros(4, 64, dtype=torch.float32))
    opt = mo.Adagrad([p], lr=1.0, lr_decay=0.5, initial_accumulator_value=1e12)
    moves, prev = [], p.detach().clone()
    for _ in range(4):
        p.grad = torch.ones_like(p)
        opt.step()
        moves.append((prev - p.detach()).double().mean().item())
        prev = p.detach().clone()
    for t in range(2, 5):
        want = (1 + (t - 2) * 0.5) / (1 + (t - 1) * 0.5)
        assert moves[t - 1] / moves[t - 2] == pytest.approx(want, rel=1e-5)


def test_adagrad_bf16_params_match_float64_reference():
    """bfloat16 parameters (nearest rounding after each step): within one bfloat16 ulp
    of a float64 reference that rounds the same way (float32 arithmetic can land a value
    on the other side of a rounding boundary)."""
    gen = torch.Generator().manual_seed(2)
    p0 = torch.randn(SHAPE, generator=gen).bfloat16()
    grads = [g.bfloat16() for g in _grads(5, seed=3)]
    p = torch.nn.Parameter(p0.clone())
    opt = mo.Adagrad([p], bf16_stochastic_round=False, **HP)
    _run(opt, p, grads)
    want, _ = reference(p0.double().numpy(), [g.double().numpy() for g in grads],
                        round_to=torch.bfloat16, **HP)
    got = p.detach().double().numpy()
    ulp = 2.0 ** (np.floor(np.log2(np.abs(want) + 1e-30)) - 7)
    assert np.all(np.abs(got - want) <= ulp)
    assert np.mean(got != want) < 0.01


@pytest.mark.parametrize("kw", [{}, dict(HP, maximize=True)], ids=["defaults", "all-options"])
def test_adagrad_matches_torch(kw):
    """Against torch.optim.Adagrad on float32: not bit for bit (torch's CPU sqrt is not
    always correctly rounded), within a few float32 ulps."""
    gen = torch.Generator().manual_seed(4)
    p0 = torch.randn(SHAPE, generator=gen)
    a, b = torch.nn.Parameter(p0.clone()), torch.nn.Parameter(p0.clone())
    ours, theirs = mo.Adagrad([a], **kw), torch.optim.Adagrad([b], **kw)
    grads = _grads(8, seed=5)
    _run(ours, a, grads)
    _run(theirs, b, grads)
    moved = (b.detach() - p0).abs().max().item()
    torch.testing.assert_close(a.detach(), b.detach(), rtol=5e-7, atol=1e-5 * moved)
    torch.testing.assert_close(ours.state[a]["state1"], theirs.state[b]["sum"], rtol=1e-6, atol=0)
    assert ours.state[a]["step"].item() == theirs.state[b]["step"].item()


def test_adagrad8bit_within_bound_of_float64_reference():
    """8-bit sum: each requantization moves a value by at most half the widest gap of
    the unsigned code (0.7% of the block absmax), so after 10 steps the sum is within
    10 such half gaps of the float64 one (measured: 1.7% of the largest sum); the update
    divides by sqrt(sum), which halves the relative error. Measured: 0.17% of the path;
    bound 2%, as the contract tests give every 8-bit state."""
    gen = torch.Generator().manual_seed(6)
    p0 = torch.randn(SHAPE, generator=gen)
    grads = _grads(10, seed=7)
    p = torch.nn.Parameter(p0.clone())
    opt = mo.Adagrad8bit([p], **HP)
    _run(opt, p, grads)
    assert opt.state[p]["state1"].dtype == torch.uint8
    want_p, want_s = reference(p0.numpy(), [g.double().numpy() for g in grads], **HP)
    path = np.linalg.norm(want_p - p0.numpy())
    assert np.linalg.norm(p.detach().numpy() - want_p) <= 0.02 * path
    s = mo.dequantized_state(opt, p)["sum"].double().numpy()
    assert np.all(s > 0)
    gap = np.diff(_core.code_table(8, False).astype(np.float64)).max()
    assert np.abs(s - want_s).max() <= len(grads) * gap / 2 * want_s.max()


@pytest.mark.parametrize("bits", [8, 4, 32])
@pytest.mark.parametrize("shape", [(16, 300), (9, 129)], ids=["even-rows", "odd-rows"])
def test_initial_accumulator_value_is_exact(bits, shape):
    """sum starts at initial_accumulator_value exactly, in every state format (8-bit and
    4-bit: every code at 1.0, absmax = the value; odd rows of 4-bit codes keep the high
    nibble of their last byte 0): a zero-gradient step keeps it and moves nothing."""
    p = torch.nn.Parameter(torch.randn(shape))
    opt = mo.Adagrad8bit([{"params": [p], "bits": bits}], initial_accumulator_value=0.3,
                         min_8bit_size=0)
    p.grad = torch.zeros_like(p)
    before = p.detach().clone()
    opt.step()
    assert torch.equal(p.detach(), before)
    st = opt.state[p]
    assert st["state1"].dtype == (torch.float32 if bits == 32 else torch.uint8)
    assert torch.equal(mo.dequantized_state(opt, p)["sum"], torch.full(shape, 0.3))
    if bits == 4 and shape[1] % 2:
        assert (st["state1"][:, -1] >> 4 == 0).all()
    # and the first real step is torch's
    q = torch.nn.Parameter(before.clone())
    ref = torch.optim.Adagrad([q], initial_accumulator_value=0.3)
    g = torch.randn(shape) * 0.1
    p.grad, q.grad = g.clone(), g.clone()
    opt.step()
    ref.step()
    tol = {32: 1e-5, 8: 0.01, 4: 0.1}[bits]
    moved = (q.detach() - before).abs().max().item()
    torch.testing.assert_close(p.detach(), q.detach(), rtol=5e-7, atol=tol * moved)


def test_nonfinite_gradient_elements_are_skipped():
    p = torch.nn.Parameter(torch.randn(SHAPE))
    opt = mo.Adagrad8bit([p], initial_accumulator_value=0.2)
    g = torch.randn(SHAPE) * 0.1
    g[0, 0], g[1, 5], g[2, 7] = float("nan"), float("inf"), 3e19  # 3e19^2 overflows
    before = p.detach().clone()
    p.grad = g
    opt.step()
    s = mo.dequantized_state(opt, p)["sum"]
    assert torch.isfinite(p).all() and torch.isfinite(s).all()
    for i, j in ((0, 0), (1, 5), (2, 7)):
        assert p[i, j].item() == before[i, j].item()
        assert s[i, j].item() == pytest.approx(0.2, rel=0.01)  # its old value, dequantized
    assert (p.detach() != before).float().mean() > 0.99


@pytest.mark.parametrize("cls", [mo.Adagrad8bit, mo.Adagrad])
def test_state_dict_round_trip_resumes_bit_exactly(cls):
    def fresh():
        return torch.nn.Parameter(torch.randn(SHAPE, generator=torch.Generator().manual_seed(8)))

    grads = _grads(6, seed=9)
    p = fresh()
    opt = cls([p], **HP)
    _run(opt, p, grads)
    q = fresh()
    o1 = cls([q], **HP)
    _run(o1, q, grads[:3])
    sd = o1.state_dict()
    assert set(sd["state"][0]) == ({"step", "state1", "absmax1"} if cls is mo.Adagrad8bit
                                   else {"step", "state1"})
    o2 = cls([q], lr=1.0)  # the group's values come from the state dict
    o2.load_state_dict(sd)
    assert o2.param_groups[0]["lr_decay"] == HP["lr_decay"]
    _run(o2, q, grads[3:])
    assert torch.equal(p, q)
    for k, v in opt.state[p].items():
        assert torch.equal(v, o2.state[q][k]), k


def test_torch_state_dict_in_and_out():
    """torch.optim.Adagrad's state dict loads into Adagrad8bit (sum quantized, step and
    lr_decay/initial_accumulator_value taken over); to_torch_state_dict goes back, and a
    parameter never stepped exports torch's initial state (torch's step needs one)."""
    gen = torch.Generator().manual_seed(10)
    w, b = torch.nn.Parameter(torch.randn(SHAPE, generator=gen)), torch.nn.Parameter(torch.randn(7))
    unused = torch.nn.Parameter(torch.randn(3, 5))
    t = torch.optim.Adagrad([w, b, unused], **HP)
    for g in _grads(3, seed=11):
        w.grad, b.grad = g, g[0, :7]
        t.step()
    opt = mo.Adagrad8bit([w, b, unused], lr=1.0)
    opt.load_state_dict(t.state_dict())
    g0 = opt.param_groups[0]
    assert (g0["lr"], g0["lr_decay"], g0["initial_accumulator_value"]) == (
        HP["lr"], HP["lr_decay"], HP["initial_accumulator_value"])
    assert opt.state[w]["state1"].dtype == torch.uint8 and opt.state[b]["state1"].dtype == torch.float32
    assert opt.state[w]["step"].item() == 3.0
    s = mo.dequantized_state(opt, w)["sum"]
    assert (s - t.state[w]["sum"]).abs().max() <= 0.005 * t.state[w]["sum"].max()
    assert torch.equal(opt.state[b]["state1"], t.state[b]["sum"])
    # torch's never-stepped parameter: step 0, sum at the initial value
    assert opt.state[unused]["step"].item() == 0.0
    assert torch.equal(mo.dequantized_state(opt, unused)["sum"], torch.full((3, 5), 0.4))

    out = mo.to_torch_state_dict(opt)
    assert set(out["param_groups"][0]) >= {"lr", "lr_decay", "eps", "weight_decay",
                                           "initial_accumulator_value", "foreach", "maximize",
                                           "differentiable", "fused"}
    assert "bits" not in out["param_groups"][0]
    back = torch.optim.Adagrad([w, b, unused])
    back.load_state_dict(out)
    assert torch.equal(back.state[w]["sum"], s)
    assert torch.equal(back.state[b]["sum"], t.state[b]["sum"])

    fresh = mo.Adagrad([w, unused], initial_accumulator_value=0.7)
    w.grad = torch.ones_like(w)
    fresh.step()  # `unused` has no gradient: no state
    tt = torch.optim.Adagrad([w, unused])
    tt.load_state_dict(mo.to_torch_state_dict(fresh))
    assert tt.state[unused]["step"].item() == 0.0
    assert torch.equal(tt.state[unused]["sum"], torch.full((3, 5), 0.7))
    unused.grad = torch.ones_like(unused)
    tt.step()  # torch steps it from there
    assert tt.state[unused]["sum"][0, 0].item() == pytest.approx(1.7)


def test_torch_state_dict_negative_sum_refused():
    w = torch.nn.Parameter(torch.randn(SHAPE))
    t = torch.optim.Adagrad([w])
    w.grad = torch.randn(SHAPE)
    t.step()
    sd = t.state_dict()
    sd["state"][0]["sum"] = -sd["state"][0]["sum"]
    opt = mo.Adagrad8bit([w])
    with pytest.raises(ValueError, match="'sum' holds negative values"):
        opt.load_state_dict(sd)
    assert not opt.state[w]


@pytest.mark.parametrize("cls", [mo.Adagrad8bit, mo.Adagrad])
@pytest.mark.parametrize("kw,name", [
    (dict(lr=-1.0), "lr"), (dict(lr_decay=-0.1), "lr_decay"), (dict(weight_decay=-1e-3), "weight_decay"),
    (dict(initial_accumulator_value=-0.5), "initial_accumulator_value"),
    (dict(initial_accumulator_value=math.inf), "initial_accumulator_value"),
    (dict(initial_accumulator_value=math.nan), "initial_accumulator_value"),
    (dict(eps=-1e-10), "eps")])
def test_bad_arguments_name_the_argument(cls, kw, name):
    with pytest.raises(ValueError, match=rf"\b{name}\b"):
        cls([torch.nn.Parameter(torch.randn(4, 4))], **kw)


def test_refused_step_changes_nothing():
    """A group value made bad after construction refuses the step before any write."""
    ps = [torch.nn.Parameter(torch.randn(SHAPE)), torch.nn.Parameter(torch.randn(SHAPE))]
    opt = mo.Adagrad8bit([{"params": ps[:1]}, {"params": ps[1:]}], initial_accumulator_value=0.1)
    for p in ps:
        p.grad = torch.randn(SHAPE)
    opt.step()
    before = [p.detach().clone() for p in ps]
    states = [{k: v.clone() for k, v in opt.state[p].items()} for p in ps]
    for key in ("lr_decay", "initial_accumulator_value"):
        old = opt.param_groups[1][key]
        opt.param_groups[1][key] = -1.0
        with pytest.raises(ValueError, match=key):
            opt.step()
        opt.param_groups[1][key] = old
        for p, b, st in zip(ps, before, states):
            assert torch.equal(p.detach(), b)
            assert all(torch.equal(v, opt.state[p][k]) for k, v in st.items())


def test_torch_flags_and_signature():
    import inspect

    ours = inspect.signature(mo.Adagrad8bit)
    theirs = inspect.signature(torch.optim.Adagrad)
    for name, param in theirs.parameters.items():
        assert ours.parameters[name].default == param.default, name
        assert ours.parameters[name].kind == param.kind, name
    p = torch.nn.Parameter(torch.randn(4, 4))
    group = mo.Adagrad([p], foreach=False, fused=True).param_groups[0]
    assert {k: group[k] for k in ("foreach", "fused", "differentiable", "maximize")} == {
        "foreach": False, "fused": True, "differentiable": False, "maximize": False}
    assert "capturable" not in group  # torch.optim.Adagrad keeps none
    with pytest.raises(ValueError, match="differentiable"):
        mo.Adagrad([p], differentiable=True)
    with pytest.raises(RuntimeError, match="fused"):
        mo.Adagrad([p], foreach=True, fused=True)
    assert _core.state_layout(_core.ADAGRAD, 8, 256, 512)["signed"][0] is False


@pytest.mark.parametrize("cls", [mo.Adagrad8bit, mo.Adagrad])
def test_initial_accumulator_value_beyond_float32_is_refused(cls):
    """initial_accumulator_value=1e39 cannot start a float32 sum: refused at
    construction naming it (torch refuses it there too; issue 38, item 15), and in a
    group edit before anything changes; float32's largest value is taken."""
    from memfit import MemfitValueError

    p = torch.nn.Parameter(torch.randn(SHAPE))
    with pytest.raises(RuntimeError):
        torch.optim.Adagrad([p], initial_accumulator_value=1e39)
    with pytest.raises(MemfitValueError, match="initial_accumulator_value: 1e\\+39 is beyond float32"):
        cls([p], initial_accumulator_value=1e39)
    cls([p], initial_accumulator_value=_core.FLOAT32_MAX)
    opt = cls([p])
    p.grad = torch.randn_like(p)
    opt.param_groups[0]["initial_accumulator_value"] = 1e39
    before = p.detach().clone()
    with pytest.raises(MemfitValueError, match="initial_accumulator_value"):
        opt.step()
    assert torch.equal(p, before) and not opt.state[p]
