"""torch's optimizer contract in the corners issues 30 and 31 found broken: every check
before the first write (a refused step or load changes nothing, bit for bit), torch's
flags, older state dicts, and the error classes of refusals (the load/state-dict hooks:
tests/test_optim_contract.py).

Each test runs over every memfit class, with the parameters in one param group or two.
"""

from __future__ import annotations

import math
import re

import pytest

torch = pytest.importorskip("torch")

import memfit.optim as mo  # noqa: E402
from memfit import MemfitTypeError, MemfitValueError  # noqa: E402

CLASSES = {
    "AdamW8bit": lambda groups, **kw: mo.AdamW8bit(groups, lr=1e-2, **kw),
    "Adam8bit": lambda groups, **kw: mo.Adam8bit(groups, lr=1e-2, **kw),
    "AdamW4bit": lambda groups, **kw: mo.AdamW4bit(groups, lr=1e-2, **kw),
    "AdamW": lambda groups, **kw: mo.AdamW(groups, lr=1e-2, **kw),
    "Adam": lambda groups, **kw: mo.Adam(groups, lr=1e-2, **kw),
    "Lion8bit": lambda groups, **kw: mo.Lion8bit(groups, lr=1e-3, **kw),
    "SGD8bit": lambda groups, **kw: mo.SGD8bit(groups, lr=1e-2, momentum=0.9, **kw),
    "RMSprop8bit": lambda groups, **kw: mo.RMSprop8bit(groups, lr=1e-3, **kw),
    "Muon8bit": lambda groups, **kw: mo.Muon8bit(groups, lr=1e-2, **kw),
    "Muon": lambda groups, **kw: mo.Muon(groups, lr=1e-2, **kw),
}
# torch's class of the same kind (None: torch has no Lion)
TORCH = {"AdamW8bit": torch.optim.AdamW, "Adam8bit": torch.optim.Adam,
         "AdamW4bit": torch.optim.AdamW, "AdamW": torch.optim.AdamW, "Adam": torch.optim.Adam,
         "Lion8bit": None, "SGD8bit": torch.optim.SGD, "RMSprop8bit": torch.optim.RMSprop,
         "Muon8bit": getattr(torch.optim, "Muon", None), "Muon": getattr(torch.optim, "Muon", None)}

all_classes = pytest.mark.parametrize("cls", list(CLASSES))
groups_1_2 = pytest.mark.parametrize("n_groups", [1, 2])


def make(cls, n_groups, extra=None, **kw):
    """An optimizer of ``cls`` over a quantized (32, 160) weight and a 1-D bias (a (1, 16)
    row for Muon, which takes matrices), and ``extra`` (another parameter) in the last
    group: the second group when there are two."""
    gen = torch.Generator().manual_seed(0)
    w = torch.nn.Parameter(torch.randn(32, 160, generator=gen))
    b = torch.nn.Parameter(torch.randn(16, generator=gen).reshape(
        (1, 16) if cls.startswith("Muon") else (16,)))
    w2 = torch.nn.Parameter(torch.randn(32, 160, generator=gen))
    last = [w2] + ([extra] if extra is not None else [])
    groups = ([{"params": [w, b] + last}] if n_groups == 1
              else [{"params": [w, b]}, {"params": last}])
    return CLASSES[cls](groups, **kw)


def step(opt, seed=1):
    gen = torch.Generator().manual_seed(seed)
    for g in opt.param_groups:
        for p in g["params"]:
            p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
    opt.step()


def snapshot(opt):
    params = [p.detach().clone() for g in opt.param_groups for p in g["params"]]
    state = {id(p): {k: v.clone() if torch.is_tensor(v) else v for k, v in st.items()}
             for p, st in opt.state.items()}
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    return params, state, groups


def assert_unchanged(opt, snap):
    params, state, groups = snap
    now = [p.detach() for g in opt.param_groups for p in g["params"]]
    assert len(now) == len(params)
    for a, b in zip(now, params):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert {id(p) for p in opt.state} == set(state)
    for p, st in opt.state.items():
        assert set(st) == set(state[id(p)])
        for k, v in st.items():
            old = state[id(p)][k]
            assert (torch.equal(v, old) and v.shape == old.shape) if torch.is_tensor(v) else v == old
    assert [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] == groups


# -- 1. every parameter checked before the first byte is written ----------------------------

@all_classes
@groups_1_2
@pytest.mark.parametrize("dtype", [torch.float64, torch.complex64])
def test_unsupported_parameter_refused_by_constructor_and_step(cls, n_groups, dtype):
    bad = torch.nn.Parameter(torch.randn(8, 8, dtype=dtype))
    last = n_groups - 1
    where = f"param_groups[{last}]['params'][{1 if n_groups == 2 else 3}]"
    with pytest.raises(MemfitTypeError) as e:
        make(cls, n_groups, extra=bad)
    msg = str(e.value)
    assert where in msg and "(8, 8)" in msg and str(dtype) in msg
    assert "float32, float16 and bfloat16" in msg and "uint8" not in msg
    # add_param_group refuses it and adds no group
    opt = make(cls, n_groups)
    with pytest.raises(MemfitTypeError, match=rf"param_groups\[{n_groups}\]\['params'\]\[0\]"):
        opt.add_param_group({"params": [bad]})
    assert len(opt.param_groups) == n_groups
    # a dtype changed after construction (model.double()): step refuses, nothing moves
    step(opt)
    victim = opt.param_groups[last]["params"][-1]
    victim.data = victim.data.to(dtype)
    where = f"param_groups[{last}]['params'][{len(opt.param_groups[last]['params']) - 1}]"
    snap = snapshot(opt)
    for g in opt.param_groups:
        for p in g["params"]:
            p.grad = torch.ones_like(p)
    with pytest.raises(MemfitTypeError, match=re.escape(where) + ".*unsupported dtype"):
        opt.step()
    assert_unchanged(opt, snap)


# -- 3. every group's values and every state's storage checked first -----------------------

@all_classes
@groups_1_2
def test_group_values_and_resized_states_refused_before_any_write(cls, n_groups):
    opt = make(cls, n_groups)
    step(opt)
    last = opt.param_groups[-1]
    snap = snapshot(opt)
    for key, value in [("lr", -1.0), ("sr_seed", "abc"), ("sr_seed", math.nan),
                       ("sr_step", None), ("weight_decay", "x")]:
        if key == "sr_step":  # as a loaded state dict gives it: refused at the load
            sd, snap = opt.state_dict(), snapshot(opt)
            sd["param_groups"][-1]["sr_step"] = None
            with pytest.raises(MemfitValueError, match="sr_step"):
                opt.load_state_dict(sd)
            assert_unchanged(opt, snap)
        old = last.get(key)
        last[key] = value
        snap = snapshot(opt)
        with pytest.raises((ValueError, TypeError), match=rf"param_groups\[{n_groups - 1}\]"):
            step(opt, seed=2)
        assert_unchanged(opt, snap)
        last[key] = old
        if old is None:
            del last[key]
    # a state tensor resized in place keeps its identity: the cached check still sees it
    p = last["params"][0]
    st = opt.state[p]
    key = "state1" if "state1" in st else "step"
    snap = snapshot(opt)
    saved = st[key].clone()
    st[key].resize_(3)
    with pytest.raises(MemfitValueError, match="shape"):
        step(opt, seed=3)
    st[key].set_(saved)  # put back (same object, its old values), then compare
    assert_unchanged(opt, snap)
    step(opt, seed=3)  # and it steps again


@all_classes
def test_bad_sr_seed_refused_by_constructor(cls):
    for seed in ["abc", math.nan, None]:
        with pytest.raises(TypeError, match="sr_seed"):
            CLASSES[cls]([{"params": [torch.nn.Parameter(torch.randn(4, 4))], "sr_seed": seed}])


# -- 4. options memfit does not have, refused everywhere --------------------------------------

FIXED = {"AdamW8bit": {"amsgrad": True, "decoupled_weight_decay": False},
         "AdamW4bit": {"amsgrad": True, "decoupled_weight_decay": False},
         "AdamW": {"amsgrad": True, "decoupled_weight_decay": False},
         "Adam8bit": {"amsgrad": True, "decoupled_weight_decay": True},
         "Adam": {"amsgrad": True, "decoupled_weight_decay": True},
         "RMSprop8bit": {"centered": True}}


@pytest.mark.parametrize("cls", list(FIXED))
@groups_1_2
def test_unsupported_options_refused_in_groups(cls, n_groups):
    for key, value in FIXED[cls].items():
        advice = "AdamW8bit" if key == "decoupled_weight_decay" and value else None
        with pytest.raises(ValueError, match=rf"{key}={value}") as e:
            CLASSES[cls]([{"params": [torch.nn.Parameter(torch.randn(4, 4))], key: value}])
        if advice:
            assert advice in str(e.value)
        opt = make(cls, n_groups)
        with pytest.raises(ValueError, match=rf"param_groups\[{n_groups}\]: {key}="):
            opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(4))], key: value})
        assert len(opt.param_groups) == n_groups
        step(opt)
        sd = opt.state_dict()
        sd["param_groups"][-1][key] = value
        snap = snapshot(opt)
        with pytest.raises(MemfitValueError,
                           match=rf"load_state_dict: param_groups\[{n_groups - 1}\]"):
            opt.load_state_dict(sd)
        assert_unchanged(opt, snap)
    if cls.startswith("Adam"):  # torch.optim.Adam's keyword
        wanted = cls.startswith("AdamW")
        with pytest.raises(ValueError, match="decoupled_weight_decay"):
            CLASSES[cls]([torch.nn.Parameter(torch.randn(4))], decoupled_weight_decay=not wanted)


# -- 5. torch's constructor flags -----------------------------------------------------------------

@all_classes
def test_torch_flags_accepted_kept_like_torch_or_refused(cls):
    p = torch.nn.Parameter(torch.randn(4, 4))
    for kw in [dict(fused=True), dict(fused=None), dict(fused=False), dict(foreach=True),
               dict(foreach=False), dict(capturable=False), dict(differentiable=False)]:
        opt = CLASSES[cls]([p], **kw)
        step(opt)
    ref = TORCH[cls]
    flags = {"maximize", "foreach", "fused", "capturable", "differentiable"}
    mine = set(opt.defaults) & flags
    if cls.startswith("Muon"):  # torch.optim.Muon keeps none (and torch < 2.9 has no Muon)
        assert mine == set() and (ref is None or not set(ref([p]).defaults) & flags)
    else:
        assert mine == ({"maximize"} if ref is None else set(ref([p]).defaults) & flags)
    assert set(opt.state_dict()["param_groups"][0]) >= mine
    for kw, err in [(dict(capturable=True), ValueError), (dict(differentiable=True), ValueError),
                    (dict(fused=True, foreach=True), RuntimeError), (dict(fused="yes"), TypeError)]:
        with pytest.raises(err, match=next(iter(kw))):
            CLASSES[cls]([p], **kw)
    if cls.startswith(("Adam", "Lion")):  # the classes with betas
        for betas in [(torch.tensor(0.9), 0.99), (0.9, torch.tensor(0.99))]:
            with pytest.raises(ValueError, match="both floats or both Tensors"):
                CLASSES[cls]([p], betas=betas)
            if ref is not None:  # torch says the same
                with pytest.raises(ValueError, match="both floats or both Tensors"):
                    ref([p], betas=betas)
        CLASSES[cls]([p], betas=(torch.tensor(0.9), torch.tensor(0.99)))


# -- 6. load_state_dict and state_dict hooks: test_optim_contract.py (every class, two groups)


# -- 7. older and hand-edited state dicts --------------------------------------------------------------

@all_classes
@groups_1_2
def test_old_state_dicts_load_as_torch_loads_them(cls, n_groups):
    opt = make(cls, n_groups)
    step(opt)
    sd = opt.state_dict()
    flags = ("maximize", "foreach", "fused", "capturable", "differentiable")
    for g in sd["param_groups"]:
        for k in flags:
            g.pop(k, None)
    pid = sd["param_groups"][-1]["params"][0]
    sd["state"][pid]["step"] = 1  # as older torch saved it
    sd["state"]["note"] = {"epoch": 3}  # not a parameter's: kept, as torch keeps it
    opt2 = make(cls, n_groups)
    opt2.load_state_dict(sd)
    for g in opt2.param_groups:
        assert {k: g[k] for k in opt2._TORCH_FLAGS} == opt2._TORCH_FLAGS
    p = opt2.param_groups[-1]["params"][0]
    st = opt2.state[p]["step"]
    assert torch.is_tensor(st) and st.dtype == torch.float32 and st.shape == () and st.item() == 1
    assert opt2.state["note"] == {"epoch": 3}
    step(opt2)  # and it steps on
    opt.load_state_dict(opt.state_dict())
    for bad in [math.nan, -1, 1.5, math.inf]:
        sd["state"][pid]["step"] = bad
        snap = snapshot(opt)
        with pytest.raises(MemfitValueError, match="whole number >= 0"):
            opt.load_state_dict(sd)
        assert_unchanged(opt, snap)
    # a parameter's state under an id no group lists (shifted, or a string after JSON)
    sd["state"][pid]["step"] = 1
    sd["state"][str(pid)] = sd["state"].pop(pid)
    with pytest.raises(MemfitValueError, match="no param group lists the id"):
        opt.load_state_dict(sd)


@all_classes
def test_param_names_kept_like_torch(cls):
    named = list(torch.nn.Linear(16, 8).named_parameters())
    if cls.startswith("Muon"):  # it takes matrices: the bias as a (1, 8) row
        named[1] = ("bias", torch.nn.Parameter(named[1][1].detach().reshape(1, 8)))
    opt = CLASSES[cls](named)
    step(opt)
    sd = opt.state_dict()
    for g in sd["param_groups"]:
        g.pop("param_names")
    opt.load_state_dict(sd)
    assert opt.param_groups[0]["param_names"] == ["weight", "bias"]


# -- 8. refusals are MemfitValueErrors that say what is wrong ---------------------------------------

@all_classes
def test_refused_state_dicts_raise_memfit_value_error(cls):
    opt = make(cls, 1)
    step(opt)
    other = "Lion8bit" if cls != "Lion8bit" else "AdamW8bit"
    sd_other = make(other, 1)
    step(sd_other)
    snap = snapshot(opt)
    sd = opt.state_dict()
    p0 = sd["param_groups"][0]["params"][0]
    cases = [
        (sd_other.state_dict(), f"saved by memfit.optim.{other}"),
        ({**sd, "memfit": {"optimizer": cls, "format_version": 99}}, "unknown format_version 99"),
        ({**sd, "memfit": {"optimizer": cls}}, "unknown format_version None"),
        ({**sd, "state": list(sd["state"].values())}, "'state' is a list"),
        ({**sd, "state": {**sd["state"], p0: {**sd["state"][p0],
                                              "step": sd["state"][p0]["step"].to("meta")}}},
         "meta"),
        ({**sd, "state": {**sd["state"], p0: {**sd["state"][p0],
                                              "step": torch.ones(()).to_sparse()}}}, "sparse"),
    ]
    for bad, words in cases:
        with pytest.raises(MemfitValueError, match=words) as e:
            opt.load_state_dict(bad)
        assert "bitsandbytes" not in str(e.value)
        assert_unchanged(opt, snap)
