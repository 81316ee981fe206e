"""What the torch optimizers refuse without changing anything: state dicts that are
incomplete or corrupt (load_state_dict checks everything, then loads), and steps with a
gradient or state the kernels cannot take (step checks every group, then steps). Errors
name the parameter as ``param_groups[g]['params'][i]`` with its shape, and the state or
gradient at fault. Also the functional API's gradient-shape check."""

import copy
import io
import math
import re

import numpy as np
import pytest
import torch

import memfit
import memfit.optim as mo
from memfit.optim import functional as F


ALL = [mo.AdamW8bit, mo.Adam8bit, mo.Lion8bit, mo.SGD8bit, mo.RMSprop8bit, mo.AdamW4bit,
       mo.AdamW, mo.Adam, mo.Adagrad8bit, mo.Adagrad, mo.LAMB8bit, mo.LAMB, mo.LARS8bit, mo.LARS,
       mo.AdEMAMix8bit, mo.AdEMAMix]


def _params(seed=0):
    """Two groups: [8-bit-state weight (24, 40), float32-state bias (40,)] and
    [weight (16, 24) of another block layout, bias (24,)], so that each group has two
    buckets (state formats) with min_8bit_size=0."""
    gen = torch.Generator().manual_seed(seed)
    shapes = [(24, 40), (40,), (16, 24), (24,)]
    return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]


def _opt(cls, ps, **kw):
    if cls in (mo.SGD8bit, mo.LARS8bit, mo.LARS):
        kw.setdefault("momentum", 0.9)
    if cls is mo.RMSprop8bit:
        kw.setdefault("momentum", 0.5)
    if cls in (mo.Adagrad8bit, mo.Adagrad):  # the state starts at a constant, not 0
        kw.setdefault("initial_accumulator_value", 0.1)
    return cls([{"params": ps[:2]}, {"params": ps[2:], "lr": 3e-3}], lr=1e-2, min_8bit_size=0,
               **kw)


def _grads(ps, seed):
    gen = torch.Generator().manual_seed(seed)
    for p in ps:
        p.grad = torch.randn(p.shape, generator=gen)


def _trained(cls, steps=2, **kw):
    ps = _params()
    opt = _opt(cls, ps, **kw)
    for s in range(steps):
        _grads(ps, s)
        opt.step()
    return ps, opt


def _snapshot(ps, opt):
    """Everything a step or a load could change, cloned."""
    return ([p.detach().clone() for p in ps],
            {id(p): {k: v.clone() for k, v in opt.state[p].items()} for p in ps if p in opt.state},
            [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups])


def _assert_unchanged(before, ps, opt):
    params, states, groups = _snapshot(ps, opt)
    for a, b in zip(before[0], params):
        assert torch.equal(a, b)
    assert states.keys() == before[1].keys()
    for pid, st in states.items():
        assert st.keys() == before[1][pid].keys()
        for k, v in st.items():
            old = before[1][pid][k]
            assert v.dtype == old.dtype and torch.equal(v, old), k
    assert groups == before[2]


def _where(g, i, shape):
    return re.escape(f"param_groups[{g}]['params'][{i}] (shape {shape})")


def _saved_copy(opt):
    """A deep copy of opt.state_dict() (its state dicts are the optimizer's own)."""
    return copy.deepcopy(opt.state_dict())


# ---- load_state_dict: incomplete state dicts --------------------------------------------


@pytest.mark.parametrize("cls", ALL, ids=lambda c: c.__name__)
def test_load_refuses_a_missing_state_and_changes_nothing(cls):
    """Every state a parameter needs, deleted from a saved state dict, is refused by
    name (the next step would otherwise recreate it as zeros and move the weights by
    up to lr / eps * |exp_avg|); the optimizer keeps what it had."""
    ps, opt = _trained(cls)
    sd = _saved_copy(opt)
    # the (16, 24) weight: param_groups[1]['params'][0], saved id 2
    keys = sorted(sd["state"][2])
    assert "step" in keys and "state1" in keys
    for key in keys:
        bad = _saved_copy(opt)
        del bad["state"][2][key]
        before = _snapshot(ps, opt)
        with pytest.raises(memfit.MemfitValueError,
                           match=_where(1, 0, (16, 24)) + f": has no state '{key}'.*incomplete"):
            opt.load_state_dict(bad)
        _assert_unchanged(before, ps, opt)
    opt.load_state_dict(sd)  # the intact one loads


def test_load_takes_an_empty_state_as_never_stepped_and_a_missing_kahan_buffer_as_zero():
    """As torch: a parameter saved with {} (never stepped) starts fresh. A Kahan buffer
    that is missing starts at zero (the parameter's value as it is)."""
    ps, opt = _trained(mo.AdamW8bit)
    sd = _saved_copy(opt)
    sd["state"][1] = {}
    fresh = _opt(mo.AdamW8bit, ps)
    fresh.load_state_dict(sd)
    assert ps[1] not in fresh.state or not fresh.state[ps[1]]
    w = torch.nn.Parameter(torch.randn(8, 64).bfloat16())
    k = mo.AdamW8bit([w], min_8bit_size=0, kahan=True)
    w.grad = torch.randn(8, 64).bfloat16()
    k.step()
    sd = _saved_copy(k)
    del sd["state"][0]["kahan_comp"]
    k2 = mo.AdamW8bit([w], min_8bit_size=0, kahan=True)
    k2.load_state_dict(sd)
    k2.step()
    assert k2.state[w]["kahan_comp"].shape == w.shape


# ---- load_state_dict: corrupt values ----------------------------------------------------


def _nan_at(v):
    v = v.clone()
    v.view(-1)[v.numel() // 2] = math.nan
    return v


def _set(value):
    return lambda v: torch.full_like(v, value)


# (class, saved id, key, corruption, what the message says)
_CORRUPT = [
    (mo.AdamW8bit, 0, "absmax1", _nan_at, "NaN, Inf or negative block scales"),
    (mo.AdamW8bit, 0, "absmax2", _set(math.inf), "NaN, Inf or negative block scales"),
    (mo.AdamW4bit, 2, "absmax1", lambda v: -v, "NaN, Inf or negative block scales"),
    (mo.AdamW8bit, 0, "step", _set(-1.0), r"\(-1.0\) is not a whole number of steps >= 0"),
    (mo.AdamW8bit, 1, "step", _set(1.5), r"\(1.5\) is not a whole number of steps >= 0"),
    (mo.AdamW, 0, "step", _set(math.nan), r"\(nan\) is not a whole number of steps >= 0"),
    (mo.AdamW, 0, "step", _set(math.inf), r"\(inf\) is not a whole number of steps >= 0"),
    (mo.AdamW8bit, 1, "state1", _nan_at, "NaN or Inf values"),
    (mo.AdamW, 2, "state2", _set(math.inf), "NaN or Inf values"),
    (mo.AdamW, 0, "state2", lambda v: -v - 1, "negative values, but it is a second moment"),
    (mo.RMSprop8bit, 1, "state1", lambda v: -v - 1, "negative values, but it is a second moment"),
    (mo.Adagrad, 1, "state1", lambda v: -v - 1, "negative values, but it is a second moment"),
    (mo.AdamW8bit, 0, "state1", lambda v: v.to(torch.int8), r"is torch.int8 \(24, 40\), but needs "
                                                            r"torch.uint8 \(24, 40\)"),
    (mo.AdamW8bit, 0, "state2", lambda v: v.float(), "is torch.float32 .* needs torch.uint8"),
    (mo.AdamW8bit, 0, "state1", lambda v: v.reshape(-1)[:-5].clone(), r"is torch.uint8 \(955,\)"),
    (mo.AdamW8bit, 0, "state1", lambda v: v.reshape(40, 24).clone(), r"is torch.uint8 \(40, 24\)"),
    (mo.AdamW4bit, 0, "state2", lambda v: v[:, :-1].clone(), "truncated"),
    (mo.AdamW8bit, 0, "absmax1", lambda v: v.double(), "is torch.float64"),
    # 8-bit codes in another memory order: their blocks would be other elements'
    (mo.AdamW8bit, 0, "state1", lambda v: v.t().contiguous().t(), "another memory order"),
]


@pytest.mark.parametrize("cls,pid,key,corrupt,what", _CORRUPT,
                         ids=[f"{c.__name__}-{p}-{k}-{i}" for i, (c, p, k, *_) in enumerate(_CORRUPT)])
def test_load_refuses_corrupt_values_and_changes_nothing(cls, pid, key, corrupt, what):
    ps, opt = _trained(cls)
    sd = _saved_copy(opt)
    sd["state"][pid][key] = corrupt(sd["state"][pid][key])
    g, i = divmod(pid, 2)
    before = _snapshot(ps, opt)
    with pytest.raises(memfit.MemfitValueError,
                       match=_where(g, i, tuple(ps[pid].shape)) + f": state '{key}'.*{what}"):
        opt.load_state_dict(sd)
    _assert_unchanged(before, ps, opt)


def test_truncated_code_tensor_through_torch_save_is_refused():
    """A checkpoint whose code tensor lost elements (a truncated or corrupt file written
    with torch.save) is refused on load, naming the parameter and the state."""
    ps, opt = _trained(mo.AdamW8bit)
    sd = _saved_copy(opt)
    sd["state"][2]["state1"] = sd["state"][2]["state1"].reshape(-1)[:-7].clone()
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    with pytest.raises(ValueError, match=_where(1, 0, (16, 24)) + r": state 'state1' is "
                       r"torch.uint8 \(377,\), but needs torch.uint8 \(16, 24\).*truncated"):
        _opt(mo.AdamW8bit, _params()).load_state_dict(loaded)


@pytest.mark.parametrize("cls", [mo.AdamW8bit, mo.AdamW4bit, mo.AdamW], ids=lambda c: c.__name__)
def test_load_repairs_states_in_another_layout_exactly(cls):
    """States whose values do not depend on their memory layout (float32 states,
    absmax, 4-bit codes, 8-bit codes stored in the parameter's order, e.g. a slice of a
    wider tensor) are copied into the layout the kernels need: training then goes on
    bit-identically, where before every later step failed."""
    ps, opt = _trained(cls)
    sd = _saved_copy(opt)
    for st in sd["state"].values():
        for key, v in list(st.items()):
            if key == "step":
                continue
            if v.dtype == torch.uint8 and v.dim() == 2 and key.startswith("state") \
                    and cls is mo.AdamW8bit:
                wide = torch.zeros(v.shape[0], v.shape[1] * 2, dtype=v.dtype)
                wide[:, :v.shape[1]] = v
                st[key] = wide[:, :v.shape[1]]  # same order, other strides
            elif v.dim() == 2 and min(v.shape) > 1:
                st[key] = v.t().contiguous().t()  # column-major
            else:
                st[key] = torch.stack([v, v], dim=-1)[..., 0]  # every other element
            assert not st[key].is_contiguous()
    ps2 = _params()
    for a, b in zip(ps2, ps):
        a.data.copy_(b.detach())
    opt2 = _opt(cls, ps2)
    opt2.load_state_dict(sd)
    for s in range(2, 5):
        _grads(ps, s)
        _grads(ps2, s)
        opt.step()
        opt2.step()
    for a, b in zip(ps, ps2):
        assert torch.equal(a, b)
        for k, v in opt.state[a].items():
            assert torch.equal(v, opt2.state[b][k]), k


# ---- step: check everything, then step ---------------------------------------------------


def _bad_dtype(p):
    p.grad.data = p.grad.data.double()


def _bad_shape(p):  # the (in, out) layout of a framework that stores weights transposed
    p.grad.data = p.grad.data.t().contiguous()


def _bad_state(opt, p):
    opt.state[p]["state1"] = opt.state[p]["state1"].float() \
        if opt.state[p]["state1"].dtype == torch.uint8 else opt.state[p]["state1"].half()


# (a gradient on another device cannot be made on a CPU-only machine: torch refuses it)
_BAD = [
    ("dtype", _bad_dtype, memfit.MemfitTypeError,
     r": its gradient is torch.float64 and the parameter torch.float32"),
    ("shape", _bad_shape, memfit.MemfitValueError,
     r": its gradient has shape \(24, 16\); a gradient must have its parameter's shape"),
]


@pytest.mark.parametrize("cls", [mo.AdamW8bit, mo.AdamW4bit, mo.AdamW, mo.Lion8bit],
                         ids=lambda c: c.__name__)
@pytest.mark.parametrize("name,spoil,exc,what", _BAD, ids=[b[0] for b in _BAD])
@pytest.mark.parametrize("first_step", [False, True], ids=["later", "first"])
def test_a_step_that_fails_changes_nothing(cls, name, spoil, exc, what, first_step):
    """A bad gradient in the second group (after a group of two buckets that would be
    stepped first): nothing is updated, parameters, states, step counters and the
    groups' counters are bit-identical, and on the first step no state is made."""
    ps, opt = _trained(cls, steps=0 if first_step else 2)
    _grads(ps, 7)
    spoil(ps[2])
    before = _snapshot(ps, opt)
    with pytest.raises(exc, match=_where(1, 0, (16, 24)) + what + ".*nothing was updated"):
        opt.step()
    _assert_unchanged(before, ps, opt)
    if first_step:
        assert not any(opt.state.get(p) for p in ps)
    # a good gradient again: the step goes on, as if nothing had happened
    _grads(ps, 7)
    opt.step()
    ref_ps, ref = _trained(cls, steps=0 if first_step else 2)
    _grads(ref_ps, 7)
    ref.step()
    for a, b in zip(ps, ref_ps):
        assert torch.equal(a, b)


def test_a_step_with_a_replaced_state_or_a_layout_it_cannot_take_changes_nothing():
    """A state of another dtype put into a later group's state, and a channels_last
    parameter with a row-major gradient: refused before the first group is stepped."""
    ps, opt = _trained(mo.AdamW8bit)
    _grads(ps, 7)
    _bad_state(opt, ps[3])
    before = _snapshot(ps, opt)
    with pytest.raises(memfit.MemfitTypeError, match=_where(1, 1, (24,)) + r": state 'state1' is "
                       r"torch.float16, but needs torch.float32"):
        opt.step()
    _assert_unchanged(before, ps, opt)

    conv = torch.nn.Parameter(torch.randn(8, 3, 4, 4).contiguous(memory_format=torch.channels_last))
    ps = _params() + [conv]
    opt = mo.AdamW8bit([{"params": ps[:2]}, {"params": ps[2:]}], min_8bit_size=0)
    _grads(ps, 1)
    conv.grad = torch.randn(8, 3, 4, 4)  # row-major: other strides than the parameter's
    before = _snapshot(ps, opt)
    with pytest.raises(memfit.MemfitValueError, match=_where(1, 2, (8, 3, 4, 4)) + ": must be "
                       r"contiguous \(row-major\), or dense with a gradient of the same strides"):
        opt.step()
    _assert_unchanged(before, ps, opt)


# ---- the functional API: gradients of another shape ----------------------------------


@pytest.mark.parametrize("make", [np.zeros, torch.zeros], ids=["numpy", "torch"])
def test_functional_refuses_a_gradient_of_another_shape(make):
    p = make((64, 96), dtype=np.float32 if make is np.zeros else torch.float32) + 1
    st = F.adamw8bit_init(p)
    g_ok = p * 0 + 0.5
    g = g_ok.T.copy() if make is np.zeros else g_ok.t().contiguous()  # JAX's (in, out) layout
    p0, s0 = p.copy() if make is np.zeros else p.clone(), {k: v for k, v in st.items()}
    s0 = {k: (v.copy() if make is np.zeros else v.clone()) if hasattr(v, "shape") else v
          for k, v in st.items()}
    with pytest.raises(memfit.MemfitValueError,
                       match=r"grad: has shape \(96, 64\), but param has shape \(64, 96\)"):
        F.adamw8bit_step(p, g, st)
    with pytest.raises(ValueError, match=r"grad: has shape \(6144,\), but param has shape"):
        F.adamw_step(p, g_ok.reshape(-1), F.adamw_init(p))
    assert (p == p0).all()
    for k, v in st.items():
        if hasattr(v, "shape"):
            assert (v == s0[k]).all(), k
    F.adamw8bit_step(p, g_ok, st)  # the right shape steps
    assert not (p == p0).all()
