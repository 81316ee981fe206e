"""LAMB8bit / LAMB and LARS8bit / LARS (memfit.optim.trust): the trust ratio.

Reference: the updates in float64 NumPy (LAMB: bitsandbytes' LAMB math, csrc's
optim.h "trust ratio"; LARS: bitsandbytes' PytorchLARS, re-implemented here in torch
float64). 32-bit states: within float32 rounding of the reference. 8-bit states: the
whole update within 5% (relative, in norm) of the reference's, the error of 8-bit
moments over a few steps.
"""

import copy

import numpy as np
import pytest
import torch

import memfit.optim as mo
from memfit import MemfitValueError
from memfit.optim import _core

LAMB_CLASSES = (mo.LAMB, mo.LAMB8bit)
LARS_CLASSES = (mo.LARS, mo.LARS8bit)


def lamb_reference(p, grads, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                   adam_w_mode=True, bias_correction=True, max_unorm=1.0, maximize=False,
                   scales=None):
    """float64 LAMB over the gradients; appends each step's trust scale to ``scales``.
    An element with a non-finite gradient is skipped as memfit skips it (no move, old
    states, 0 in ||u||)."""
    p = p.astype(np.float64).copy()
    m, v = np.zeros_like(p), np.zeros_like(p)
    b1, b2 = betas
    for t, g in enumerate(grads, 1):
        g = -g.astype(np.float64) if maximize else g.astype(np.float64)
        ok = np.isfinite(g)
        g = np.where(ok, g, 0.0)
        if not adam_w_mode:
            g = g + weight_decay * p
        mn = np.where(ok, b1 * m + (1 - b1) * g, m)
        vn = np.where(ok, b2 * v + (1 - b2) * g * g, v)
        bc1, bc2 = (1 - b1 ** t, 1 - b2 ** t) if bias_correction else (1.0, 1.0)
        u = np.where(ok, (mn / bc1) / (np.sqrt(vn / bc2) + eps), 0.0)
        pn, un = np.linalg.norm(p), np.linalg.norm(u)
        scale = max_unorm * pn / un if max_unorm > 0 and un > max_unorm * pn else 1.0
        if scales is not None:
            scales.append(scale)
        decay = 1 - lr * weight_decay if adam_w_mode else 1.0
        p = np.where(ok, p * decay - lr * scale * u, p)
        m, v = mn, vn
    return p


def pytorch_lars(p, grads, lr, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False,
                 max_unorm=0.02, maximize=False, scales=None):
    """bitsandbytes' PytorchLARS.step, in torch float64 (maximize: the gradient negated)."""
    p = torch.tensor(p, dtype=torch.float64)
    buf = None
    for g in grads:
        d_p = torch.tensor(g, dtype=torch.float64)
        if maximize:
            d_p = -d_p
        if weight_decay != 0:
            d_p = d_p.add(p, alpha=weight_decay)
        if buf is None:
            buf = torch.clone(d_p)
        else:
            buf.mul_(momentum).add_(d_p, alpha=1 - dampening)
        update = d_p + buf * momentum if nesterov else buf
        update_scale = 1.0
        if max_unorm > 0.0:
            pnorm, unorm = torch.norm(p), torch.norm(update)
            if unorm > max_unorm * pnorm:
                update_scale = float(max_unorm * pnorm / unorm)
        if scales is not None:
            scales.append(update_scale)
        p.add_(update, alpha=-lr * update_scale)
    return p.numpy()


def _run(cls, p0, grads, dtype=torch.float32, bits=None, **kw):
    p = torch.nn.Parameter(torch.tensor(p0, dtype=dtype))
    opt = cls([{"params": [p]} if bits is None else {"params": [p], "bits": bits}],
              min_8bit_size=0, **kw)
    for g in grads:
        p.grad = torch.tensor(g, dtype=dtype)
        opt.step()
    return p.detach().double().numpy(), opt, p


def _check(cls, got, ref, p0):
    if cls._bits == 32:
        np.testing.assert_allclose(got, ref, rtol=2e-5, atol=1e-6)
    else:
        moved = np.linalg.norm(ref - p0)
        assert moved > 0
        assert np.linalg.norm(got - ref) <= 0.05 * moved, (np.linalg.norm(got - ref), moved)


def _data(seed, shape, scale, steps=4):
    rng = np.random.default_rng(seed)
    p0 = (rng.standard_normal(shape) * scale).astype(np.float32)
    grads = [(rng.standard_normal(shape) * 0.1).astype(np.float32) for _ in range(steps)]
    return p0, grads


def _clipped(scales, expect):
    """The case does what it says: the ratio clips at every step, at none, or at some."""
    clipped = [s < 1 for s in scales]
    return {"all": all(clipped), "none": not any(clipped),
            "some": any(clipped) and not all(clipped)}[expect]


LAMB_CASES = [  # (parameter scale, clipped steps, options)
    (0.01, "all", dict(lr=1e-2, weight_decay=0.1)),
    (10.0, "none", dict(lr=1e-2, weight_decay=0.1)),
    (0.05, "some", dict(lr=1e-2, max_unorm=10.0)),
    (0.01, "all", dict(lr=1e-2, weight_decay=0.1, adam_w_mode=False)),
    (0.01, "all", dict(lr=1e-2, bias_correction=False, max_unorm=2.0)),
    (0.05, "all", dict(lr=1e-2, maximize=True, betas=(0.8, 0.99))),
]


@pytest.mark.parametrize("cls", LAMB_CLASSES)
@pytest.mark.parametrize("scale,expect,kw", LAMB_CASES)
def test_lamb_matches_float64_reference(cls, scale, expect, kw):
    p0, grads = _data(1, (33, 300), scale)
    scales = []
    ref = lamb_reference(p0, grads, scales=scales, **kw)
    assert _clipped(scales, expect), scales
    got, *_ = _run(cls, p0, grads, **kw)
    _check(cls, got, ref, p0)


LARS_CASES = [
    ("all", dict(lr=0.1, momentum=0.9)),
    ("none", dict(lr=0.1, momentum=0.9, max_unorm=100.0)),
    ("all", dict(lr=0.1, momentum=0.9, weight_decay=0.01, nesterov=True)),
    ("all", dict(lr=0.1, momentum=0.5, dampening=0.3, maximize=True)),
    ("some", dict(lr=0.1, momentum=0.9, max_unorm=0.2, weight_decay=0.05)),
]


@pytest.mark.parametrize("cls", LARS_CLASSES)
@pytest.mark.parametrize("expect,kw", LARS_CASES)
def test_lars_matches_pytorch_lars(cls, expect, kw):
    p0, grads = _data(2, (33, 300), 1.0)
    scales = []
    ref = pytorch_lars(p0, grads, scales=scales, **kw)
    assert _clipped(scales, expect), scales
    got, *_ = _run(cls, p0, grads, **kw)
    _check(cls, got, ref, p0)


@pytest.mark.parametrize("cls", LAMB_CLASSES + LARS_CLASSES)
def test_bf16_params(cls):
    p0, grads = _data(3, (16, 512), 0.05)
    kw = dict(lr=1e-2, weight_decay=0.1) if cls in LAMB_CLASSES else dict(lr=0.1, momentum=0.9)
    ref = (lamb_reference if cls in LAMB_CLASSES else pytorch_lars)(
        torch.tensor(p0).bfloat16().double().numpy(), grads, **kw)
    _, opt, p = _run(cls, p0, grads, dtype=torch.bfloat16, kahan=True, **kw)
    # the parameter's value: p + its Kahan compensation
    got = p.detach().double().numpy() + opt.state[p]["kahan_comp"].double().numpy()
    moved = np.linalg.norm(ref - torch.tensor(p0).bfloat16().double().numpy())
    assert np.linalg.norm(got - ref) <= 0.05 * moved


@pytest.mark.parametrize("bits", [8, 32])
def test_max_unorm_zero_is_adamw_and_sgd(bits):
    p0, grads = _data(4, (40, 200), 0.01)
    lamb = mo.LAMB8bit if bits == 8 else mo.LAMB
    adamw = mo.AdamW8bit if bits == 8 else mo.AdamW
    sgd = mo.SGD8bit
    a, *_ = _run(lamb, p0, grads, lr=1e-2, weight_decay=0.1, max_unorm=0.0)
    b, *_ = _run(adamw, p0, grads, lr=1e-2, weight_decay=0.1)
    assert np.array_equal(a, b)
    # a ratio that never clips leaves the bits too (scale 1 exactly)
    c, *_ = _run(lamb, p0, grads, lr=1e-2, weight_decay=0.1, max_unorm=1e6)
    assert np.array_equal(c, b)
    lars = mo.LARS8bit if bits == 8 else mo.LARS
    d, *_ = _run(lars, p0, grads, lr=0.1, momentum=0.9, nesterov=True, max_unorm=0.0)
    e, *_ = _run(sgd, p0, grads, lr=0.1, momentum=0.9, nesterov=True, bits=bits)
    assert np.array_equal(d, e)


@pytest.mark.parametrize("cls", LAMB_CLASSES + LARS_CLASSES)
def test_zero_parameters_do_not_move(cls):
    """||p|| = 0: scale = 0 (bitsandbytes' formula), so a zero tensor stays zero while its
    states follow the gradients."""
    _, grads = _data(5, (8, 600), 1.0, steps=2)
    p0 = np.zeros((8, 600), np.float32)
    kw = dict(lr=1e-2, weight_decay=0.1) if cls in LAMB_CLASSES else dict(lr=0.1, momentum=0.9)
    got, opt, p = _run(cls, p0, grads, **kw)
    assert np.array_equal(got, p0)
    ref = (lamb_reference if cls in LAMB_CLASSES else pytorch_lars)(p0, grads, **kw)
    assert np.array_equal(ref, p0)
    first = mo.dequantized_state(opt, p)["exp_avg" if cls in LAMB_CLASSES else "momentum_buffer"]
    assert float(first.abs().max()) > 0


@pytest.mark.parametrize("cls", LAMB_CLASSES + LARS_CLASSES)
def test_zero_gradients(cls):
    p0, grads = _data(6, (8, 600), 0.01, steps=3)
    grads = [np.zeros_like(g) for g in grads]
    kw = dict(lr=1e-2, weight_decay=0.1) if cls in LAMB_CLASSES else dict(lr=0.1, momentum=0.9,
                                                                         weight_decay=0.01)
    ref = (lamb_reference if cls in LAMB_CLASSES else pytorch_lars)(p0, grads, **kw)
    got, *_ = _run(cls, p0, grads, **kw)
    _check(cls, got, ref, p0)  # (the decay moved it)


@pytest.mark.parametrize("cls", LAMB_CLASSES)
def test_nan_gradient_is_skipped(cls):
    p0, grads = _data(7, (8, 600), 0.01, steps=3)
    grads[1][3, 17] = np.nan
    kw = dict(lr=1e-2, weight_decay=0.1)
    ref = lamb_reference(p0, grads, **kw)
    got, *_ = _run(cls, p0, grads, **kw)
    assert np.isfinite(got).all()
    _check(cls, got, ref, p0)


@pytest.mark.parametrize("cls", LAMB_CLASSES + LARS_CLASSES)
def test_state_dict_round_trip_resumes_bit_exactly(cls):
    p0, grads = _data(8, (20, 300), 0.05, steps=4)
    kw = dict(lr=1e-2, weight_decay=0.1) if cls in LAMB_CLASSES else dict(lr=0.1, momentum=0.9)
    _, opt, p = _run(cls, p0, grads[:2], **kw)
    names = _core.STATE_NAMES[opt._group_kind(opt.param_groups[0])]
    assert set(names) <= set(mo.dequantized_state(opt, p))
    q = torch.nn.Parameter(p.detach().clone())
    opt2 = cls([q], min_8bit_size=0, **kw)
    opt2.load_state_dict(opt.state_dict())
    for g in grads[2:]:
        for o, x in ((opt, p), (opt2, q)):
            x.grad = torch.tensor(g)
            o.step()
    assert torch.equal(p, q)


def test_offloaded_lamb_steps_as_lamb():
    p0, grads = _data(9, (16, 512), 0.01, steps=3)
    direct, *_ = _run(mo.LAMB8bit, p0, grads, lr=1e-2, weight_decay=0.1)
    p = torch.nn.Parameter(torch.tensor(p0))
    opt = mo.CPUOffloadOptimizer([p], mo.LAMB8bit, lr=1e-2, weight_decay=0.1, min_8bit_size=0)
    for g in grads:
        p.grad = torch.tensor(g)
        opt.step()
    assert np.array_equal(p.detach().double().numpy(), direct)


def test_bad_arguments():
    p = torch.nn.Parameter(torch.zeros(4, 4))
    with pytest.raises(NotImplementedError, match="LARS without momentum"):
        mo.LARS8bit([p], lr=0.1)
    with pytest.raises(TypeError):
        mo.LARS([p])  # lr is required, as in bitsandbytes
    with pytest.raises(ValueError, match="amsgrad"):
        mo.LAMB8bit([p], amsgrad=True)
    with pytest.raises(ValueError, match="max_unorm"):
        mo.LAMB([p], max_unorm=-1.0)
    with pytest.raises(ValueError, match="max_unorm"):
        mo.LARS([p], lr=0.1, momentum=0.9, max_unorm=float("nan"))
    # a bad value set later is refused at the step, before anything changes
    opt = mo.LAMB8bit([p], lr=1e-2)
    p.grad = torch.ones_like(p)
    opt.param_groups[0]["max_unorm"] = -2.0
    before = p.detach().clone()
    with pytest.raises(ValueError, match="max_unorm"):
        opt.step()
    assert torch.equal(p, before) and not opt.state[p]


def test_core_refuses_missing_or_bad_scratch():
    """The C API checks the scratch (named trust[i]) and the kinds max_unorm is for."""
    p = np.ones(5000, np.float32)
    g = np.ones(5000, np.float32)
    s1, s2, step = np.zeros(5000, np.float32), np.zeros(5000, np.float32), np.zeros(1, np.float32)
    hp = _core.hparams(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, max_unorm=1.0)
    args = (_core.ADAMW, 32, 256, hp, [p], [g], [s1], None, [s2], None, [step])
    with pytest.raises(ValueError, match=r"trust\[0\]"):
        _core.step(*args)
    with pytest.raises(ValueError, match=r"trust\[0\]"):
        _core.step(*args, trust=[np.zeros(_core.trust_numel(5000) - 2, np.float32)])
    with pytest.raises(ValueError, match=r"trust\[0\].*aligned"):
        _core.step(*args, trust=[np.zeros(_core.trust_numel(5000) + 1, np.float32)[1:]])
    assert np.array_equal(p, np.ones(5000, np.float32)) and step[0] == 0
    with pytest.raises(ValueError, match="max_unorm.*Lion"):
        _core.check(_core.LION, _core.hparams(lr=1e-3, beta1=0.9, beta2=0.99, max_unorm=1.0))
    trust = np.zeros(_core.trust_numel(5000) // 2).view(np.float32)
    _core.step(*args, trust=[trust])
    sums = trust.view(np.float64)[-2:]
    assert sums[1] == 5000.0  # sum p^2 of the ones, before the step
    # m / (sqrt(v) / sqrt(1 - beta2) + eps) = 0.1 / (1 + 1e-8) per element (the first
    # moment's bias correction is applied to the norm later: mf_optim_trust_scale)
    assert abs(sums[0] - 5000.0 * (0.1 / (1 + 1e-8)) ** 2) < 1e-5 * 50


_DTENSOR_SCRIPT = r"""
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
import memfit.optim as mo
from memfit import MemfitValueError
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,))
p = torch.nn.Parameter(distribute_tensor(torch.randn(8, 16), mesh, [Shard(0)]))
for make in (lambda: mo.LAMB8bit([p]), lambda: mo.LARS([p], lr=0.1, momentum=0.9)):
    try:
        make()
    except ValueError as e:
        print("REFUSED", e)
dist.destroy_process_group()
"""


def test_sharded_parameters_are_refused_naming_them():
    """The norms need the whole tensor: a DTensor parameter is refused, saying why (in a
    subprocess: the one-rank process group is global state)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("torch.distributed.tensor")
    env = dict(os.environ, PYTHONPATH=str(Path(mo.__file__).resolve().parents[2]))
    run = subprocess.run([sys.executable, "-c", _DTENSOR_SCRIPT], capture_output=True, text=True,
                         env=env, timeout=300)
    assert run.returncode == 0, run.stderr
    lines = [x for x in run.stdout.splitlines() if x.startswith("REFUSED")]
    assert len(lines) == 2, run.stdout
    for line in lines:
        assert "param_groups[0]['params'][0]" in line and "whole tensor" in line, line


def test_functional_step_takes_max_unorm():
    """memfit.optim.functional.step with max_unorm (NumPy arrays) is LAMB's step."""
    from memfit.optim import functional as F

    p0, grads = _data(10, (16, 300), 0.01, steps=3)
    want, *_ = _run(mo.LAMB, p0, grads, lr=1e-2, weight_decay=0.1, max_unorm=0.5)
    p = p0.copy()
    st = F.init("adamw", p, bits=32)
    for g in grads:
        F.step("adamw", p, g, st, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1,
               max_unorm=0.5)
    assert np.array_equal(p.astype(np.float64), want)


def test_adamw_and_sgd_state_dicts_continue_as_lamb_and_lars():
    """Their states are LAMB's and LARS' own; the groups lack the trust keys, which take
    the loading optimizer's values (and are saved from then on). With a ratio that never
    clips, the loaded optimizer steps on exactly as the one that saved the dict."""
    p0, grads = _data(11, (16, 300), 0.01, steps=3)
    for first, second, kw in ((mo.AdamW8bit, mo.LAMB8bit, dict(lr=1e-2, weight_decay=0.1)),
                              (mo.SGD8bit, mo.LARS8bit, dict(lr=0.1, momentum=0.9))):
        _, a, p = _run(first, p0, grads[:1], **kw)
        q = torch.nn.Parameter(p.detach().clone())
        b = second([q], min_8bit_size=0, max_unorm=1e9, **kw)
        b.load_state_dict(a.state_dict())
        assert b.param_groups[0]["max_unorm"] == 1e9
        for g in grads[1:]:
            for o, x in ((a, p), (b, q)):
                x.grad = torch.tensor(g)
                o.step()
        assert torch.equal(p, q)
        assert b.state_dict()["param_groups"][0]["max_unorm"] == 1e9


def test_lamb_and_lars_state_dicts_refused_where_the_math_would_change():
    """The other way round, a LAMB/LARS dict whose groups use what AdamW/Adam/SGD do not
    apply (a trust ratio, no bias correction, L2 decay in LAMB) is refused, naming the
    key, and nothing loads; with those at AdamW's and SGD's values it loads and steps on
    bit for bit."""
    p0, grads = _data(12, (16, 300), 0.01, steps=3)
    cases = ((mo.LAMB8bit, mo.AdamW8bit, dict(lr=1e-2), {}, "max_unorm=1.0"),
             (mo.LAMB, mo.AdamW, dict(lr=1e-2), dict(max_unorm=0.0, bias_correction=False),
              "bias_correction=False"),
             (mo.LARS8bit, mo.SGD8bit, dict(lr=0.1, momentum=0.9), {}, "max_unorm=0.02"))
    for first, second, kw, extra, key in cases:
        _, a, _ = _run(first, p0, grads[:1], **kw, **extra)
        q = torch.nn.Parameter(torch.tensor(p0))
        b = second([q], min_8bit_size=0, **kw)
        before = copy.deepcopy(b.state_dict())
        with pytest.raises(MemfitValueError, match=f"saved by memfit.optim.{first.__name__} with {key}"):
            b.load_state_dict(a.state_dict())
        assert b.state_dict() == before
    for first, second, kw in ((mo.LAMB8bit, mo.AdamW8bit, dict(lr=1e-2, weight_decay=0.1)),
                              (mo.LARS8bit, mo.SGD8bit, dict(lr=0.1, momentum=0.9))):
        _, a, p = _run(first, p0, grads[:1], max_unorm=0.0, **kw)
        q = torch.nn.Parameter(p.detach().clone())
        b = second([q], min_8bit_size=0, **kw)
        b.load_state_dict(a.state_dict())
        for g in grads[1:]:
            for o, x in ((a, p), (b, q)):
                x.grad = torch.tensor(g)
                o.step()
        assert torch.equal(p, q)


def _stepped(opt, params, seed, steps=2):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    return opt


@pytest.mark.parametrize("cls", LAMB_CLASSES)
def test_lamb_l2_mode_converts_as_adam(cls):
    """LAMB with adam_w_mode=False decays as L2, as torch.optim.Adam (issue 38, item 13):
    an Adam dict loads (and, with max_unorm=0, LAMB goes on as Adam does), an AdamW dict
    (decoupled decay: another meaning) is refused naming adam_w_mode with nothing
    loaded, and to_torch_state_dict exports an Adam dict that torch.optim.Adam loads.
    memfit's own dicts alike: Adam8bit's loads, AdamW8bit's is refused."""
    init = torch.randn(64, 128, generator=torch.Generator().manual_seed(40))
    a, b = (init.clone().requires_grad_() for _ in range(2))
    kw = dict(lr=1e-2, weight_decay=0.1)
    adam = _stepped(torch.optim.Adam([a], **kw), [a], 41)
    lamb = cls([b], adam_w_mode=False, max_unorm=0.0, min_8bit_size=0, **kw)
    lamb.load_state_dict(adam.state_dict())
    b.data.copy_(a.detach())
    _stepped(adam, [a], 42)
    _stepped(lamb, [b], 42)
    tol = dict(rtol=0, atol=1e-6) if cls is mo.LAMB else dict(rtol=0, atol=2e-3)
    torch.testing.assert_close(b, a, **tol)
    assert not torch.equal(a, init)

    w = init.clone().requires_grad_()
    adamw = _stepped(torch.optim.AdamW([w], **kw), [w], 43)
    fresh = cls([init.clone().requires_grad_()], adam_w_mode=False, **kw)
    with pytest.raises(MemfitValueError, match="AdamW with weight decay.*as L2.*adam_w_mode=True"):
        fresh.load_state_dict(adamw.state_dict())
    assert not fresh.state
    cls([init.clone().requires_grad_()], adam_w_mode=True, **kw).load_state_dict(adamw.state_dict())

    sd = mo.to_torch_state_dict(lamb)
    assert sd["param_groups"][0]["decoupled_weight_decay"] is False
    c = init.clone().requires_grad_()
    back = torch.optim.Adam([c], **kw)
    back.load_state_dict(sd)
    assert torch.equal(back.state[c]["exp_avg"], mo.dequantized_state(lamb, b)["exp_avg"])

    eight = cls is mo.LAMB8bit
    for src, ok in (((mo.Adam8bit if eight else mo.Adam), True),
                    ((mo.AdamW8bit if eight else mo.AdamW), False)):
        p = init.clone().requires_grad_()
        saved = _stepped(src([p], min_8bit_size=0, **kw), [p], 44).state_dict()
        into = cls([init.clone().requires_grad_()], adam_w_mode=False, min_8bit_size=0, **kw)
        if ok:
            into.load_state_dict(saved)
        else:
            with pytest.raises(MemfitValueError, match="adam_w_mode=True"):
                into.load_state_dict(saved)
