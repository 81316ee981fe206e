"""torch's generic optimizer contract, held against every memfit optimizer (issue 30 §5).

A port, from the ideas, of the device-agnostic tests of ``TestOptimRenewed`` in torch's
test/test_optim.py and of the error inputs of torch/testing/_internal/common_optimizers.py:
what a torch training loop does with any optimizer (param groups, closures, schedulers,
hooks, state dicts, deepcopy, pickle, SWA) must work with a memfit optimizer in its place.

Every test runs over ``CASES``: each memfit class, and torch's own optimizers of the same
math (ids ``torch-*``) as a reference mode. A test that fails for a ``memfit-*`` case and
passes for the ``torch-*`` cases shows a broken promise of memfit, not of the test.
Assertions that only memfit makes (quantized states, its refusals) say so and are
skipped for torch's optimizers.

Parameters are an ``nn.Linear(128, 64)``: its (64, 128) weight is large and 2-D enough
for the 8-bit and 4-bit states (>= min_8bit_size elements), its (64,) bias keeps float32
states in every memfit class. Steps are few and tensors small: the file runs in seconds.

Muon (torch.optim.Muon takes matrices only) runs in two forms: "matrices", the same model
with its bias held as a (1, 64) row (torch.optim.Muon is its reference mode), and
"mixed", memfit's: the (64,) bias in a use_muon=False (AdamW) group of the same optimizer.
"""

from __future__ import annotations

import copy
import inspect
import io
import math
import pickle
import re
from dataclasses import dataclass, field

import pytest
import torch
from torch.optim import lr_scheduler
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.optim.swa_utils import SWALR, AveragedModel

import memfit.optim as mo
from memfit import MemfitValueError
from memfit.optim import bnb, muon
from test_optim_gradient_patterns import AdEMAMix64

# torch's constructor flags that memfit accepts for a one-line swap (issue 30 §4), and the
# group flags an older state dict may lack (torch's test_can_load_older_state_dict)
_NEW_FLAGS = ("maximize", "foreach", "fused", "differentiable", "capturable")


@dataclass(frozen=True)
class Case:
    """One optimizer under test: ``cls(params, **kwargs)``."""

    id: str
    impl: str  # "memfit" or "torch" (the reference mode)
    family: str  # the update rule: "adamw", "adam", "lion", "sgd", "rmsprop", "adagrad", "lamb",
    # "lars", "muon"
    cls: type
    kwargs: dict = field(default_factory=dict)
    bits: int = 32  # state format of the (64, 128) weight
    # torch's flags it takes (bitsandbytes' signature: none; torch.optim.Muon's: none,
    # memfit's Muon all but maximize: see _muon_case)
    keywords: tuple = _NEW_FLAGS
    # Muon's own form: "matrices" (every parameter 2-D: the bias is a (1, 64) row, as
    # torch.optim.Muon takes only matrices) or "mixed" (the (64,) bias in a
    # use_muon=False group, as muon_param_groups puts it: see _muon_groups)
    muon: str = ""

    def make(self, params, **kw):
        if self.muon == "mixed":
            params = _muon_groups(params)
        return self.cls(params, **{**self.kwargs, **kw})

    def linear(self, seed=0, dtype=torch.float32):
        """The model of the tests: ``nn.Linear(128, 64)``, its bias a (1, 64) row for the
        "matrices" form (the same values)."""
        model = _linear(seed, dtype)
        if self.muon == "matrices":
            model = _RowBiasLinear(model)
        return model

    @property
    def bias_shape(self) -> tuple:
        return (1, 64) if self.muon == "matrices" else (64,)

    @property
    def memfit(self) -> bool:
        return self.impl == "memfit"


_LR = {"adamw": 1e-2, "adam": 1e-2, "lion": 1e-3, "sgd": 1e-2, "rmsprop": 1e-4, "adagrad": 1e-2,
       "lamb": 1e-2, "lars": 1e-2, "muon": 1e-2, "ademamix": 1e-2}


def _case(impl, family, cls, bits=32, tag="", **kw):
    shim = cls.__module__ == bnb.__name__
    return Case(f"{impl}-{'bnb.' if shim else ''}{cls.__name__}{tag}", impl, family, cls,
                dict(lr=_LR[family], **kw), bits, keywords=() if shim else _NEW_FLAGS)


def _muon_case(impl, cls, bits=32, muon="matrices"):
    # memfit's Muon takes fused/foreach/capturable/differentiable as the other classes
    # (and keeps none in its groups, as torch.optim.Muon); maximize is not taken, as
    # torch.optim.Muon takes none of them
    keywords = tuple(k for k in _NEW_FLAGS if k != "maximize") if impl == "memfit" else ()
    tag = "" if muon == "matrices" else f"-{muon}"
    return Case(f"{impl}-{cls.__name__}{tag}", impl, "muon", cls, dict(lr=_LR["muon"]), bits,
                keywords=keywords, muon=muon)


_TORCH_MUON = getattr(torch.optim, "Muon", None)  # torch >= 2.9

CASES = [
    _case("memfit", "adamw", mo.AdamW8bit, 8),
    _case("memfit", "adam", mo.Adam8bit, 8),
    _case("memfit", "adamw", mo.AdamW4bit, 4),
    _case("memfit", "adamw", mo.AdamW),
    _case("memfit", "adam", mo.Adam),
    _case("memfit", "lion", mo.Lion8bit, 8),
    _case("memfit", "sgd", mo.SGD8bit, 8, "-m0"),
    _case("memfit", "sgd", mo.SGD8bit, 8, "-m0.9", momentum=0.9),
    _case("memfit", "rmsprop", mo.RMSprop8bit, 8, "-m0"),
    _case("memfit", "rmsprop", mo.RMSprop8bit, 8, "-m0.9", momentum=0.9),
    _muon_case("memfit", mo.Muon8bit, 8),
    _muon_case("memfit", mo.Muon),
    _muon_case("memfit", mo.Muon8bit, 8, muon="mixed"),
    _muon_case("memfit", mo.Muon, muon="mixed"),
    _case("memfit", "adagrad", mo.Adagrad8bit, 8),
    _case("memfit", "adagrad", mo.Adagrad, tag="-decay", lr_decay=0.1, initial_accumulator_value=0.5),
    _case("memfit", "ademamix", mo.AdEMAMix8bit, 8, t_alpha=3, t_beta3=4),
    _case("memfit", "ademamix", mo.AdEMAMix),
    # bitsandbytes' signatures on the same optimizers (no maximize/fused keywords)
    _case("memfit", "adamw", bnb.AdamW8bit, 8),
    _case("memfit", "lion", bnb.Lion8bit, 8),
    _case("memfit", "adagrad", bnb.Adagrad8bit, 8),
    # the trust ratio (LAMB, LARS; their bnb forms)
    _case("memfit", "lamb", mo.LAMB8bit, 8),
    _case("memfit", "lamb", mo.LAMB),
    # (LARS at max_unorm 0.2, not 0.02: steps of 0.2% of the weight, whose float32
    # rounding the 1e-5 bound of float32 states would otherwise not cover)
    _case("memfit", "lars", mo.LARS8bit, 8, momentum=0.9, max_unorm=0.2),
    _case("memfit", "lars", mo.LARS, momentum=0.9, max_unorm=0.2),
    _case("memfit", "lamb", bnb.LAMB8bit, 8),
    _case("memfit", "lars", bnb.LARS8bit, 8, momentum=0.9, max_unorm=0.2),
    # the reference mode: torch's own (torch has no Lion)
    _case("torch", "adamw", torch.optim.AdamW),
    _case("torch", "adam", torch.optim.Adam),
    _case("torch", "sgd", torch.optim.SGD, tag="-m0"),
    _case("torch", "sgd", torch.optim.SGD, tag="-m0.9", momentum=0.9),
    _case("torch", "rmsprop", torch.optim.RMSprop, tag="-m0"),
    _case("torch", "rmsprop", torch.optim.RMSprop, tag="-m0.9", momentum=0.9),
    _case("torch", "adagrad", torch.optim.Adagrad),
    _case("torch", "adagrad", torch.optim.Adagrad, tag="-decay", lr_decay=0.1,
          initial_accumulator_value=0.5),
] + ([_muon_case("torch", _TORCH_MUON)] if _TORCH_MUON is not None else [])
TORCH_KEYWORD_CASES = [c for c in CASES if c.keywords]


def _muon_groups(params):
    """The "mixed" form: a flat list of parameters (or of (name, parameter)) split as
    muon_param_groups splits a model: matrices in a Muon group, the rest in a
    use_muon=False (AdamW) group (an empty group is left out). A list of group dicts is
    kept as it is, its indices too (tests name ``param_groups[g]``): a group holding
    anything but matrices becomes a use_muon=False group."""
    params = list(params) if not isinstance(params, (torch.Tensor, dict)) else params
    if not isinstance(params, list) or not params:
        return params  # what the constructor refuses, left for it to refuse
    if all(isinstance(g, dict) for g in params):
        return [g if "use_muon" in g or all(p.dim() == 2 for p in _group_params(g))
                else {**g, "use_muon": False} for g in params]
    muon = [x for x in params if _tensor(x).dim() == 2]
    other = [x for x in params if _tensor(x).dim() != 2]
    return [g for g in ({"params": muon}, {"params": other, "use_muon": False}) if g["params"]]


def _group_params(group):
    ps = group["params"]
    return [ps] if isinstance(ps, torch.Tensor) else [_tensor(x) for x in ps]


def _tensor(x):
    """The parameter of an entry of a params list: a tensor or (name, tensor)."""
    return x[1] if isinstance(x, tuple) else x


def cases(selection=CASES):
    return pytest.mark.parametrize("case", selection, ids=[c.id for c in selection])


def _memfit_only(case):
    if not case.memfit:
        pytest.skip("memfit-specific: torch's optimizers make no such promise")


def _takes(case, keyword):
    """Skips a class that has no such torch keyword: torch's (SGD: capturable; RMSprop:
    fused; Muon: all), and memfit's Muon (maximize, as torch.optim.Muon). Every other
    memfit class takes them all."""
    if case.memfit and keyword not in case.keywords:
        pytest.skip(f"{case.cls.__name__} takes no {keyword} keyword, as torch.optim.Muon")
    if not case.memfit and keyword not in inspect.signature(case.cls).parameters:
        pytest.skip(f"torch's {case.cls.__name__} has no {keyword} keyword")


# -- models, gradients, runs -----------------------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    """Tensors this small gain nothing from torch's threads, and on a busy 2-core machine
    their spinning made each forward/backward 50x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)



def _linear(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    return torch.nn.Linear(128, 64).to(dtype)


class _RowBiasLinear(torch.nn.Module):
    """``linear`` with its bias held as a (1, 64) matrix: the same function and values,
    every parameter 2-D (torch.optim.Muon refuses anything else)."""

    def __init__(self, linear):
        super().__init__()
        self.weight = linear.weight
        self.bias = torch.nn.Parameter(linear.bias.detach().reshape(1, -1).clone())

    def forward(self, x):
        return x @ self.weight.T + self.bias


def _input(seed=1):
    return torch.randn(16, 128, generator=torch.Generator().manual_seed(seed))


def _loss(model, x):
    return model(x).pow(2).mean()


def _grads(params, steps, seed=2):
    """``steps`` lists of fresh random gradients (never zeros), one per parameter."""
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(p.shape, generator=g, dtype=p.dtype) for p in params]
            for _ in range(steps)]


def _run(opt, params, grads):
    for gs in grads:
        for p, g in zip(params, gs):
            p.grad = None if g is None else g.clone()
        opt.step()


def _clone(params):
    return [p.detach().clone() for p in params]


def _assert_bits_equal(actual, expected, what="parameter"):
    for i, (a, e) in enumerate(zip(actual, expected)):
        assert a.dtype == e.dtype and a.shape == e.shape, (what, i)
        # bits, not values: -0.0 vs 0.0 and NaN payloads count
        assert torch.equal(a.reshape(-1).view(torch.uint8), e.reshape(-1).view(torch.uint8)), (
            f"{what} {i} differs: max |diff| {(a.double() - e.double()).abs().max().item()}")


def _all_params(opt):
    """ids of the optimizer's parameters, over its groups in order."""
    return [id(p) for g in opt.param_groups for p in g["params"]]


def _names(opt_or_state_dict):
    """The parameter names over the groups in order (the "mixed" Muon form splits one
    list into two groups)."""
    groups = (opt_or_state_dict["param_groups"] if isinstance(opt_or_state_dict, dict)
              else opt_or_state_dict.param_groups)
    return [n for g in groups for n in g["param_names"]]


def _state_tensors(opt):
    """Every tensor in the optimizer's state, keyed by (param index, state name)."""
    index = {id(p): i for i, p in enumerate(p for g in opt.param_groups for p in g["params"])}
    return {(index[id(p)], k): v.detach().clone() for p, st in opt.state.items()
            for k, v in st.items() if torch.is_tensor(v)}


# -- construction errors (common_optimizers.py's error inputs) ---------------------------

_P = lambda: torch.nn.Parameter(torch.randn(1, 1))  # noqa: E731

# (kwargs, error type, torch's message, memfit's message: it names the argument).
# ValueError for values out of range, as torch.
_RANGE_ERRORS = {
    "all": [
        (dict(lr=-1.0), ValueError, "Invalid learning rate", "lr"),
        (dict(weight_decay=-1.0), ValueError, "Invalid weight_decay value: -1", "weight_decay"),
        (dict(lr=torch.tensor([1e-3, 1e-3])), ValueError, "Tensor lr must be 1-element", "lr"),
    ],
    "adam": [
        (dict(betas=(1.0, 0.0)), ValueError, "Invalid beta parameter at index 0: 1.0", "betas"),
        (dict(betas=(0.9, 1.0)), ValueError, "Invalid beta parameter at index 1: 1.0", "betas"),
        (dict(betas=(-0.1, 0.9)), ValueError, "Invalid beta parameter at index 0", "betas"),
        (dict(eps=-1.0), ValueError, "Invalid epsilon value", "eps"),
        (dict(betas=(0.9, torch.tensor(0.99))), ValueError,
         "betas must be either both floats or both Tensors", "betas"),
        (dict(betas=(torch.tensor(0.9), 0.99)), ValueError,
         "betas must be either both floats or both Tensors", "betas"),
    ],
    "lion": [  # no torch counterpart: memfit's own ranges
        (dict(betas=(1.5, 0.9)), ValueError, None, "betas"),
        (dict(betas=(0.9, -0.1)), ValueError, None, "betas"),
    ],
    "sgd": [
        (dict(momentum=-0.5), ValueError, "Invalid momentum value: -0.5", "momentum"),
        (dict(momentum=0.9, dampening=0.5, nesterov=True), ValueError,
         "Nesterov momentum requires a momentum and zero dampening", "nesterov"),
    ],
    "ademamix": [  # no torch counterpart: memfit's own ranges
        (dict(betas=(1.0, 0.9, 0.99)), ValueError, None, "betas"),
        (dict(betas=(0.9, 0.99)), ValueError, None, "betas"),
        (dict(alpha=-1.0), ValueError, None, "alpha"),
        (dict(t_beta3=0), ValueError, None, "t_beta3"),
    ],
    "rmsprop": [
        (dict(momentum=-1.0), ValueError, "Invalid momentum value: -1.0", "momentum"),
        (dict(alpha=-1.0), ValueError, "Invalid alpha value", "alpha"),
        (dict(eps=-1.0), ValueError, "Invalid epsilon value", "eps"),
    ],
    "adagrad": [
        (dict(lr_decay=-1.0), ValueError, "Invalid lr_decay value: -1.0", "lr_decay"),
        (dict(initial_accumulator_value=-1.0), ValueError,
         "Invalid initial_accumulator_value value: -1.0", "initial_accumulator_value"),
        (dict(eps=-1.0), ValueError, "Invalid epsilon value", "eps"),
    ],
}
_RANGE_ERRORS["adamw"] = _RANGE_ERRORS["adam"]
# torch.optim.Muon words the common refusals its own way, and checks no more than these
_RANGE_ERRORS["muon"] = [
    (dict(lr=-1.0), ValueError, "Learning rate should be >= 0 but is: -1.0", "lr"),
    (dict(weight_decay=-1.0), ValueError, "weight decay should be >= 0 but is: -1.0",
     "weight_decay"),
    (dict(lr=torch.tensor([1e-3, 1e-3])), ValueError, "Tensor lr must be 1-element", "lr"),
    (dict(momentum=-0.5), ValueError, "momentum should be >= 0 but is: -0.5", "momentum"),
    (dict(adjust_lr_fn="sqrt"), ValueError, "Adjust learning rate function sqrt is not "
     "supported", "adjust_lr_fn"),
]
_MAX_UNORM = [(dict(max_unorm=-1.0), ValueError, None, "max_unorm")]
_RANGE_ERRORS["lamb"] = _RANGE_ERRORS["adam"] + _MAX_UNORM
_RANGE_ERRORS["lars"] = _RANGE_ERRORS["sgd"] + _MAX_UNORM


def _range_error_cases():
    out = []
    for c in CASES:
        common = _RANGE_ERRORS["all"] if c.family != "muon" else []
        for kw, err, torch_msg, memfit_msg in common + _RANGE_ERRORS[c.family]:
            if c.impl == "torch" and torch_msg is None:
                continue
            if not c.keywords and "nesterov" in kw:
                continue
            key = ",".join(f"{k}={v}" for k, v in kw.items()).replace("tensor", "Tensor")
            key = key.replace("Tensor([0.0010, 0.0010])", "Tensor[2]")
            out.append(pytest.param(c, kw, err, torch_msg if c.impl == "torch" else memfit_msg,
                                    id=f"{c.id}-{key}"))
    return out


@pytest.mark.parametrize("case,kwargs,error,message", _range_error_cases())
def test_construction_refuses_out_of_range_hyperparameters(case, kwargs, error, message):
    with pytest.raises(error, match=message):
        case.make([_P()], **kwargs)


@cases()
def test_construction_refuses_bad_types(case):
    # torch raises TypeError from a comparison; memfit may say ValueError: either names it
    with pytest.raises((TypeError, ValueError)):
        case.make([_P()], lr="fast")
    with pytest.raises((TypeError, ValueError)):
        case.make([_P()], weight_decay=None)


@cases()
def test_construction_refuses_bad_params(case):
    p, p2 = _P(), _P()
    with pytest.raises(TypeError, match="should be an iterable of Tensors or dicts"):
        case.make(p)
    with pytest.raises(ValueError, match="some parameters appear in more than one parameter group"):
        case.make([{"params": p}, {"params": p}])
    with pytest.raises(ValueError, match="all optimizer params should be with/without names"):
        case.make([("weight", p), p2])
    with pytest.raises(ValueError, match="all optimizer param groups should be with/without names"):
        case.make([{"params": [p], "lr": 1e-2}, {"params": [("weight", p2)]}])
    with pytest.warns(UserWarning, match="a parameter group with duplicate parameters"):
        case.make([p, p])
    repr(case.make([p, p2]))  # printable


@cases()
def test_add_param_group_refuses_duplicates_and_changes_nothing(case):
    a, b = _P(), _P()
    opt = case.make([a])
    with pytest.raises(ValueError, match="some parameters appear in more than one parameter group"):
        opt.add_param_group({"params": [b, a]})
    assert len(opt.param_groups) == 1
    opt.add_param_group({"params": [b], "lr": 0.5})
    assert opt.param_groups[1]["lr"] == 0.5 and opt.param_groups[1]["params"][0] is b


@cases()
def test_add_param_group_refuses_bad_hyperparameters(case):
    _memfit_only(case)  # torch checks only the constructor's defaults
    opt = case.make([_P()])
    with pytest.raises(ValueError, match="lr"):
        opt.add_param_group({"params": [_P()], "lr": -1.0})
    assert len(opt.param_groups) == 1


@cases()
def test_lr_beyond_float32_is_refused_naming_it(case):
    """lr=1e39 would be Inf in the kernels' float32 (training frozen or NaN, silently):
    every class refuses it naming lr, at construction and in a group edit at step, with
    nothing changed (issue 38, item 15)."""
    _memfit_only(case)
    with pytest.raises(MemfitValueError, match="lr: 1e\\+39 is beyond float32's range"):
        case.make([_P()], lr=1e39)
    p = _P()
    opt = case.make([p])
    p.grad = torch.ones_like(p)
    before = p.detach().clone()
    opt.param_groups[0]["lr"] = 1e39
    with pytest.raises(MemfitValueError, match="lr: 1e\\+39"):
        opt.step()
    assert torch.equal(p, before) and not opt.state[p]


# -- constructor keywords of a one-line swap from torch (issue 30 §4) ----------------------


@cases(TORCH_KEYWORD_CASES)
@pytest.mark.parametrize("keywords", [dict(fused=True), dict(fused=None), dict(fused=False),
                                      dict(foreach=False), dict(foreach=None),
                                      dict(capturable=False), dict(differentiable=False)],
                         ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_torch_keywords_accepted(case, keywords):
    """torch.optim.AdamW(params, lr, fused=True) becomes memfit.optim.AdamW8bit(params, lr,
    fused=True): the keyword is accepted and the step is the one without it (memfit is
    always fused; foreach has no effect)."""
    _takes(case, *keywords)
    model, ref = case.linear(), case.linear()
    grads = _grads(list(model.parameters()), 3)
    opt = case.make(model.parameters(), **keywords)
    _run(opt, list(model.parameters()), grads)
    _run(case.make(ref.parameters()), list(ref.parameters()), grads)
    if case.memfit:
        _assert_bits_equal(_clone(model.parameters()), _clone(ref.parameters()))
    else:  # torch's fused and for-loop kernels round differently
        torch.testing.assert_close(_clone(model.parameters()), _clone(ref.parameters()))


@cases(TORCH_KEYWORD_CASES)
@pytest.mark.parametrize("flag", ["capturable", "differentiable"])
def test_capturable_differentiable_true_work_or_raise_value_error(case, flag):
    """Either accepted, or refused with a ValueError that names the keyword (issue 30 §4)."""
    _takes(case, flag)
    try:
        opt = case.make([_P()], **{flag: True})
    except ValueError as e:
        assert flag in str(e)
    else:
        assert opt.param_groups[0][flag] is True


# -- the step ------------------------------------------------------------------------------


@cases(TORCH_KEYWORD_CASES)
@pytest.mark.parametrize("maximize", [False, True])
def test_goes_right_direction(case, maximize):
    """torch's test_forloop_goes_right_direction: 20 steps with a closure lower the loss
    (raise it with maximize=True)."""
    _takes(case, "maximize")
    model, x = case.linear(), _input()
    opt = case.make(model.parameters(), maximize=maximize)

    def closure():
        opt.zero_grad()
        loss = _loss(model, x)
        loss.backward()
        return loss

    initial = closure().item()
    for _ in range(20):
        opt.step(closure)
    final = _loss(model, x).item()
    assert (final > initial) if maximize else (final < initial), (initial, final)


@cases(TORCH_KEYWORD_CASES)
def test_maximize_is_the_step_of_the_negated_gradient(case):
    _takes(case, "maximize")
    model, ref = case.linear(), case.linear()
    params, rparams = list(model.parameters()), list(ref.parameters())
    grads = _grads(params, 4)
    _run(case.make(params, maximize=True, weight_decay=0.1), params, grads)
    _run(case.make(rparams, weight_decay=0.1), rparams, [[-g for g in gs] for gs in grads])
    _assert_bits_equal(_clone(params), _clone(rparams))


@cases()
def test_non_contiguous_parameters(case):
    """torch steps slices as it steps any tensor; memfit refuses them (its kernels run
    over a tensor's storage) with a ValueError that says what to do, changing nothing."""
    w = torch.nn.Parameter(torch.randn(64, 128, 2)[..., 0])
    b = torch.nn.Parameter(torch.randn(*case.bias_shape, 2)[..., 0])
    opt = case.make([w, b])
    before = _clone([w, b])
    for p in (w, b):
        p.grad = torch.randn_like(p)
    if case.memfit:
        with pytest.raises(ValueError, match="contiguous"):
            opt.step()
        _assert_bits_equal(_clone([w, b]), before)
        assert not any(opt.state.values())
    else:
        opt.step()
        assert not torch.equal(w, before[0])


@cases()
def test_step_with_closure_calls_it_once_and_returns_its_value(case):
    model, x = case.linear(), _input()
    opt = case.make(model.parameters())
    calls, marker = [], object()

    def closure():
        calls.append(torch.is_grad_enabled())
        opt.zero_grad()
        _loss(model, x).backward()
        return marker

    assert opt.step(closure) is marker
    assert calls == [True]  # called once, with autograd enabled
    assert opt.step() is None


@cases()
def test_matches_float64_reference(case):
    """Five steps against the same math in float64 (torch's optimizer; Lion written out
    below): 32-bit states within float32 rounding, quantized states within what their
    codes explain. Parameters with float32 states (the 1-D bias) step exactly as in a
    ``bits=32`` group of the same memfit class."""
    model = case.linear()
    params = list(model.parameters())
    p64 = [torch.nn.Parameter(p.detach().double()) for p in params]
    grads = _grads(params, 5)
    opt = case.make(params, weight_decay=0.05)
    _run(opt, params, grads)
    _run(_reference(case, p64, weight_decay=0.05), p64, [[g.double() for g in gs] for gs in grads])
    start = [p.detach().double() for p in case.linear().parameters()]
    for p, r, s in zip(params, p64, start):
        moved = (r.detach() - s).norm()
        err = (p.detach().double() - r.detach()).norm() / moved
        fmt = case.bits if p.dim() == 2 and p.numel() >= 4096 else 32
        # relative to how far the parameter moved: float32 rounding for float32 states;
        # 8-bit codes hold each state within ~1% of its block's scale (measured 0.3-0.9%
        # here; Muon8bit's momentum through Newton-Schulz: 1.3%), but a Lion element whose quantized momentum changes sign moves 2 lr the
        # other way (4%); 4-bit codes: 16%
        tol = {32: 1e-5, 8: 0.06 if case.family == "lion" else 0.02, 4: 0.25}[fmt]
        assert err < tol, (tuple(p.shape), fmt, err.item())
    if case.memfit and case.bits != 32:
        sparams = list(case.linear().parameters())
        _run(case.make([{"params": sparams, "bits": 32}], weight_decay=0.05), sparams, grads)
        _assert_bits_equal([params[1].detach()], [sparams[1].detach()], "bias")
        if case.family == "sgd" and not case.kwargs.get("momentum"):  # no state to quantize
            _assert_bits_equal([params[0].detach()], [sparams[0].detach()], "weight")


class _AdEMAMixReference:
    """AdEMAMix in float64, a parameter at a time (test_optim_gradient_patterns.AdEMAMix64)."""

    def __init__(self, params, lr, weight_decay=0.01, betas=(0.9, 0.999, 0.9999), alpha=5.0,
                 t_alpha=None, t_beta3=None, eps=1e-8):
        hp = dict(lr=lr, betas=betas, alpha=alpha, t_alpha=t_alpha, t_beta3=t_beta3, eps=eps,
                  wd=weight_decay)
        self.each = [AdEMAMix64([p], **hp) for p in params]

    def step(self):
        for opt in self.each:
            opt.step()


class _LionReference(torch.optim.Optimizer):
    """Lion as published (Chen et al. 2023), for float64 comparisons."""

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                m = self.state[p].setdefault("exp_avg", torch.zeros_like(p))
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(torch.sign(b1 * m + (1 - b1) * p.grad), alpha=-group["lr"])
                m.mul_(b2).add_(p.grad, alpha=1 - b2)


class _TrustReference(torch.optim.Optimizer):
    """LAMB (bitsandbytes' LAMB math) and LARS (bitsandbytes' PytorchLARS), float64
    comparisons: the update of each tensor scaled by max_unorm ||p|| / ||u|| where
    ||u|| > max_unorm ||p||."""

    lamb = True

    def __init__(self, params, lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 momentum=0.0, max_unorm=None):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                      momentum=momentum,
                                      max_unorm=max_unorm or (1.0 if self.lamb else 0.02)))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            lr, wd = group["lr"], group["weight_decay"]
            for p in group["params"]:
                st = self.state[p]
                t = st["t"] = st.get("t", 0) + 1
                g = p.grad
                if self.lamb:
                    b1, b2 = group["betas"]
                    m = st["m"] = b1 * st.get("m", 0) + (1 - b1) * g
                    v = st["v"] = b2 * st.get("v", 0) + (1 - b2) * g * g
                    u = (m / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt() + group["eps"])
                else:
                    g = g + wd * p
                    u = st["m"] = g.clone() if t == 1 else group["momentum"] * st["m"] + g
                limit = group["max_unorm"] * p.norm()
                scale = limit / u.norm() if u.norm() > limit else 1.0
                if self.lamb:
                    p.mul_(1 - lr * wd)
                p.sub_(lr * scale * u)


class _LarsReference(_TrustReference):
    lamb = False


_REFERENCE = {"lion": _LionReference, "lamb": _TrustReference, "lars": _LarsReference,
              "ademamix": _AdEMAMixReference}

_TORCH_CLASS = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "sgd": torch.optim.SGD,
                "rmsprop": torch.optim.RMSprop, "adagrad": torch.optim.Adagrad}


def _reference(case, params, **kw):
    """The case's math as torch's optimizer (Lion, LAMB, LARS, AdEMAMix: _REFERENCE) over
    ``params``. Muon: torch.optim.Muon for the matrices, torch.optim.AdamW with memfit's defaults of a
    use_muon=False group (lr and weight_decay: Muon's) for the rest."""
    kw = dict(case.kwargs, **kw)
    if case.family in _REFERENCE:  # Lion, LAMB, LARS, AdEMAMix: torch has none
        return _REFERENCE[case.family](params, **kw)
    if case.family != "muon":
        return _TORCH_CLASS[case.family](params, **kw)
    if _TORCH_MUON is None:
        pytest.skip("torch < 2.9 has no torch.optim.Muon to compare with")
    matrices = [p for p in params if p.dim() == 2]
    others = [p for p in params if p.dim() != 2]
    refs = [_TORCH_MUON(matrices, **kw)]
    if others:
        refs.append(torch.optim.AdamW(others, betas=muon.ADAMW_BETAS, eps=muon.ADAMW_EPS, **kw))
    return _Steps(refs)


class _Steps:
    """Several optimizers stepped as one."""

    def __init__(self, optimizers):
        self.optimizers = optimizers

    def step(self):
        for o in self.optimizers:
            o.step()


@cases()
def test_param_groups_step_as_their_own_optimizers(case):
    """torch's test_param_groups_lr / _weight_decay: each group uses its own lr and
    weight_decay. Here, to the bit: a group steps as a one-group optimizer with its
    settings would; a group at lr=1e-28 leaves its parameters as they were."""
    model, ref_w, ref_b = case.linear(), case.linear(), case.linear()
    irrelevant = torch.nn.Parameter(torch.randn(64, 128))
    w, b = model.weight, model.bias
    irrelevant0 = irrelevant.detach().clone()
    opt = case.make([{"params": [w], "weight_decay": 0.1}, {"params": [b], "lr": 3e-3,
                                                           "weight_decay": 0.0},
                     {"params": [irrelevant], "lr": 1e-28}])
    grads = _grads([w, b, irrelevant], 3)
    _run(opt, [w, b, irrelevant], grads)
    _run(case.make([ref_w.weight], weight_decay=0.1), [ref_w.weight], [[g[0]] for g in grads])
    _run(case.make([ref_b.bias], lr=3e-3, weight_decay=0.0), [ref_b.bias], [[g[1]] for g in grads])
    _assert_bits_equal([w.detach(), b.detach()], [ref_w.weight.detach(), ref_b.bias.detach()])
    _assert_bits_equal([irrelevant.detach()], [irrelevant0], "irrelevant parameter")


@cases()
def test_tensor_lr(case):
    """lr as a 0-d Tensor steps as the float does; changing it in place takes effect at
    the next step (a scheduler does that)."""
    model, ref = case.linear(), case.linear()
    params, rparams = list(model.parameters()), list(ref.parameters())
    grads = _grads(params, 3)
    lr = torch.tensor(case.kwargs["lr"])
    opt = case.make(params, lr=lr)
    _run(opt, params, grads)
    _run(case.make(rparams), rparams, grads)
    torch.testing.assert_close(_clone(params), _clone(rparams), rtol=1e-6, atol=1e-7)
    lr.fill_(0.0)
    before = _clone(params)
    _run(opt, params, _grads(params, 1, seed=9))  # weight decay is scaled by lr too
    _assert_bits_equal(_clone(params), before)


@cases()
def test_zero_grad_and_params_without_grads(case):
    """zero_grad(set_to_none=True) drops the gradients, False zeroes them; parameters
    without a gradient are not touched and get no state, beside ones that are stepped."""
    model = case.linear()
    other = torch.nn.Parameter(torch.randn(64, 128))
    opt = case.make([{"params": list(model.parameters())}, {"params": [other]}])
    other0 = other.detach().clone()
    _loss(model, _input()).backward()
    opt.zero_grad(set_to_none=False)
    assert all(torch.equal(p.grad, torch.zeros_like(p)) for p in model.parameters())
    opt.zero_grad()  # set_to_none=True is the default
    assert all(p.grad is None for p in model.parameters())
    before = _clone(model.parameters())
    opt.step()  # nothing has a gradient: a no-op
    _assert_bits_equal(_clone(model.parameters()), before)
    # (torch's Adagrad makes every state in its constructor; memfit's, at the first step)
    eager = case.family == "adagrad" and not case.memfit
    assert eager or not any(opt.state.values())
    model.weight.grad = torch.randn_like(model.weight)
    opt.step()
    assert not torch.equal(model.weight, before[0])
    _assert_bits_equal([model.bias.detach(), other.detach()], [before[1], other0])
    assert eager or (not opt.state.get(model.bias) and not opt.state.get(other))


@cases()
def test_zero_gradients_move_nothing(case):
    """torch's test_step_is_noop_for_zero_grads (without weight decay)."""
    model = case.linear()
    params = list(model.parameters())
    opt = case.make(params, weight_decay=0.0)
    before = _clone(params)
    _run(opt, params, [[torch.zeros_like(p) for p in params]] * 2)
    _assert_bits_equal(_clone(params), before)


@cases()
@pytest.mark.parametrize("placement", ["other group", "same group"])
@pytest.mark.parametrize("bad_dtype", [torch.float64, torch.complex64], ids=str)
def test_a_failed_step_changes_nothing(case, placement, bad_dtype):
    """memfit-specific (torch steps float64 and complex): a parameter memfit does not
    take, beside ones it does, fails the step before anything is written, and the error
    names it as the user knows it. Its dtype is changed after construction, as
    ``model.double()`` would (the constructor may refuse such dtypes earlier)."""
    _memfit_only(case)
    model = case.linear()
    bad = torch.nn.Parameter(torch.randn(8, 8))
    if placement == "other group":
        groups, where = [{"params": list(model.parameters())}, {"params": [bad]}], r"param_groups\[1\]\['params'\]\[0\]"
    else:
        groups, where = [{"params": list(model.parameters()) + [bad]}], r"param_groups\[0\]\['params'\]\[2\]"
    opt = case.make(groups)
    params = list(model.parameters())
    _run(opt, params + [bad], _grads(params + [bad], 1))  # states exist
    bad.data = bad.data.to(bad_dtype)
    before, states = _clone(params), _state_tensors(opt)
    for p, g in zip(params + [bad], _grads(params + [bad], 1, seed=5)[0]):
        p.grad = g.to(p.dtype)
    with pytest.raises((TypeError, ValueError)) as raised:
        opt.step()
    _assert_bits_equal(_clone(params), before)
    after = _state_tensors(opt)
    assert after.keys() == states.keys()
    for k in states:
        _assert_bits_equal([after[k]], [states[k]], f"state {k}")
    assert re.search(where, str(raised.value)), str(raised.value)


# -- schedulers and SWA ------------------------------------------------------------------

# each takes the optimizer and its base lr
_SCHEDULERS = {
    "StepLR": lambda o, lr: lr_scheduler.StepLR(o, step_size=2, gamma=0.5),
    "OneCycleLR": lambda o, lr: lr_scheduler.OneCycleLR(  # Adagrad has no momentum to cycle
        o, max_lr=2 * lr, total_steps=8, cycle_momentum="lr_decay" not in o.defaults),
    "CosineAnnealingLR": lambda o, lr: lr_scheduler.CosineAnnealingLR(o, T_max=6),
    "ReduceLROnPlateau": lambda o, lr: lr_scheduler.ReduceLROnPlateau(o, patience=0, factor=0.5),
    "LambdaLR": lambda o, lr: lr_scheduler.LambdaLR(o, lambda e: 0.8 ** e),
    "ExponentialLR": lambda o, lr: lr_scheduler.ExponentialLR(o, gamma=0.9),
    "CosineAnnealingWarmRestarts": lambda o, lr: lr_scheduler.CosineAnnealingWarmRestarts(o, T_0=3),
    "LinearLR": lambda o, lr: lr_scheduler.LinearLR(o, start_factor=0.3, total_iters=4),
    "CyclicLR": lambda o, lr: lr_scheduler.CyclicLR(o, lr / 10, lr, step_size_up=2,
                                                cycle_momentum=False),
    "SequentialLR": lambda o, lr: lr_scheduler.SequentialLR(
        o, [lr_scheduler.ConstantLR(o, factor=0.5, total_iters=2),
            lr_scheduler.ExponentialLR(o, gamma=0.9)], milestones=[2]),
}


@cases()
@pytest.mark.parametrize("name", sorted(_SCHEDULERS))
def test_lr_scheduler(case, name):
    """The scheduler drives the groups' hyperparameters exactly as it drives those of a
    torch.optim.SGD beside it (lr, and beta1 or momentum where it cycles them), and
    training with them lowers the loss. (test_tensor_lr and test_lr_scheduler_with_tensor_lr
    show that a step reads the group's current lr.)"""
    model, x = case.linear(), _input()
    lr = case.kwargs["lr"]
    opt = case.make(model.parameters())
    sched = _SCHEDULERS[name](opt, lr)
    shadow = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr,
                             momentum=opt.defaults.get("momentum", 0.0))
    if "betas" in opt.defaults:  # schedulers that cycle momentum cycle Adam's and Lion's beta1
        shadow.param_groups[0]["betas"] = opt.param_groups[0]["betas"]
        shadow.defaults["betas"] = opt.defaults["betas"]
    shadow_sched = _SCHEDULERS[name](shadow, lr)
    for i in range(6):
        opt.zero_grad()
        _loss(model, x).backward()
        opt.step()
        shadow.step()  # no gradient: a no-op that keeps the scheduler's order check quiet
        metric = [1.0, 1.0, 1.0, 0.5, 0.5, 0.5][i]  # plateaus for ReduceLROnPlateau
        for s in (sched, shadow_sched):
            s.step(metric) if isinstance(s, lr_scheduler.ReduceLROnPlateau) else s.step()
        assert float(opt.param_groups[0]["lr"]) == float(shadow.param_groups[0]["lr"]), i
        for key in ("betas", "momentum"):
            if key in opt.param_groups[0] and key in shadow.param_groups[0]:
                assert opt.param_groups[0][key] == shadow.param_groups[0][key], (i, key)
    assert _loss(model, x).item() < _loss(case.linear(), x).item()


@cases()
def test_lr_scheduler_with_tensor_lr(case):
    """A Tensor lr stays the same Tensor under a scheduler (filled in place, as torch
    does) and the step reads its current value: at lr 0 nothing moves."""
    model = case.linear()
    params = list(model.parameters())
    lr = torch.tensor(case.kwargs["lr"])
    opt = case.make(params, lr=lr)
    sched = lr_scheduler.LambdaLR(opt, lambda e: [1.0, 0.5, 0.0][min(e, 2)])
    for expected in (0.5, 0.0):
        _run(opt, params, _grads(params, 1))
        sched.step()
        assert opt.param_groups[0]["lr"] is lr
        assert lr.item() == pytest.approx(case.kwargs["lr"] * expected)
    before = _clone(params)
    _run(opt, params, _grads(params, 1, seed=7))
    _assert_bits_equal(_clone(params), before)


@cases()
def test_swa(case):
    """AveragedModel + SWALR: SWALR anneals the groups' lr to swa_lr, and the averaged
    model holds the mean of the snapshots it was given."""
    model, x = case.linear(), _input()
    swa = AveragedModel(model)
    opt = case.make(model.parameters())
    sched = SWALR(opt, swa_lr=case.kwargs["lr"] / 10, anneal_epochs=2)
    snapshots = []
    for _ in range(4):
        opt.zero_grad()
        _loss(model, x).backward()
        opt.step()
        sched.step()
        swa.update_parameters(model)
        snapshots.append(_clone(model.parameters()))
    assert float(opt.param_groups[0]["lr"]) == pytest.approx(case.kwargs["lr"] / 10)
    for i, p in enumerate(swa.module.parameters()):
        mean = torch.stack([s[i] for s in snapshots]).mean(0)
        torch.testing.assert_close(p.detach(), mean, rtol=1e-5, atol=1e-6)


# -- hooks -------------------------------------------------------------------------------


@cases()
def test_step_hooks(case):
    model = case.linear()
    params = list(model.parameters())
    opt = case.make(params)
    seen = []

    def pre(o, args, kwargs):
        seen.append(("pre", o is opt, torch.equal(params[0], w0)))

    def post(o, args, kwargs):
        seen.append(("post", o is opt, torch.equal(params[0], w0)))

    w0 = params[0].detach().clone()
    handles = [opt.register_step_pre_hook(pre), opt.register_step_post_hook(post)]
    global_handle = register_optimizer_step_pre_hook(
        lambda o, a, k: seen.append(("global", o is opt, True)))
    try:
        _run(opt, params, _grads(params, 1))
    finally:
        global_handle.remove()
    assert seen == [("global", True, True), ("pre", True, True), ("post", True, False)]
    for h in handles:
        h.remove()
    _run(opt, params, _grads(params, 1))
    assert len(seen) == 3


@cases()
def test_state_dict_hooks(case):
    """The pre-hook runs before, the post-hook after the dict is made: it sees the whole
    dict (memfit's has its "memfit" format record too), and what it returns is what
    state_dict() returns; the optimizer's own groups are not changed."""
    model = case.linear()
    params = list(model.parameters())
    opt = case.make(params)
    _run(opt, params, _grads(params, 1))
    seen = []
    opt.register_state_dict_pre_hook(lambda o: seen.append(("pre", o is opt)))

    def post(o, sd):
        seen.append(("post", o is opt, sorted(sd)))
        sd["param_groups"][0]["note"] = "from the post-hook"
        return {**sd, "extra": 1}

    opt.register_state_dict_post_hook(post)
    sd = opt.state_dict()
    keys = sorted(["param_groups", "state"] + (["memfit"] if case.memfit else []))
    assert seen == [("pre", True), ("post", True, keys)]
    assert sd["extra"] == 1 and sd["param_groups"][0]["note"] == "from the post-hook"
    assert "note" not in opt.param_groups[0]


@cases()
def test_load_state_dict_hooks(case):
    """Pre-hooks run in order (prepend=True first) with the state dict; one may return a
    replacement, which the later hooks get and which is the one loaded (every group);
    post-hooks run after the load; the caller's dict is not changed (issue 30 §2)."""
    def groups(model):  # two groups (the mixed Muon form: a Muon and an AdamW one)
        return [{"params": [model.weight]}, {"params": [model.bias]}]

    model = case.linear()
    params = list(model.parameters())
    opt = case.make(groups(model))
    _run(opt, params, _grads(params, 2))
    sd = opt.state_dict()
    target = case.make(groups(case.linear()))
    seen = []

    def lrs(groups):
        return [g["lr"] for g in groups]

    def replace(o, state_dict):
        seen.append(("replace", o is target, lrs(state_dict["param_groups"])))
        new = copy.deepcopy(state_dict)
        for g in new["param_groups"]:
            g["lr"] = 0.125
        return new

    def after(o, state_dict):
        seen.append(("after", o is target, lrs(state_dict["param_groups"])))

    def post(o):
        seen.append(("post", o is target, lrs(o.param_groups)))

    target.register_load_state_dict_pre_hook(after)
    target.register_load_state_dict_pre_hook(replace, prepend=True)
    target.register_load_state_dict_post_hook(post)
    target.load_state_dict(sd)
    lr = case.kwargs["lr"]
    assert seen == [("replace", True, [lr, lr]), ("after", True, [0.125, 0.125]),
                    ("post", True, [0.125, 0.125])]
    assert lrs(sd["param_groups"]) == [lr, lr]  # the caller's dict is not changed


# -- state dicts ---------------------------------------------------------------------------


def _resume(case, save, after_load=None, steps_before=3, steps_after=3):
    """Steps a model ``steps_before`` times, saves its optimizer with ``save(opt) -> state
    dict`` (the transformation under test), loads that into a fresh optimizer of a copy
    of the parameters (then calls ``after_load(state dict)``), and steps both on the same
    gradients. Returns (optimizer, resumed optimizer) after asserting that the
    parameters stayed equal to the bit."""
    model = case.linear()
    params = list(model.parameters())
    opt = case.make(params)
    grads = _grads(params, steps_before + steps_after)
    _run(opt, params, grads[:steps_before])
    copy_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    resumed = case.make(copy_params)
    sd = save(opt)
    resumed.load_state_dict(sd)
    if after_load is not None:
        after_load(sd)
    _run(opt, params, grads[steps_before:])
    _run(resumed, copy_params, grads[steps_before:])
    _assert_bits_equal(_clone(copy_params), _clone(params))
    return opt, resumed


def _assert_state_dicts_equal(a, b):
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for k in a["state"]:
        assert a["state"][k].keys() == b["state"][k].keys()
        for name, v in a["state"][k].items():
            w = b["state"][k][name]
            if torch.is_tensor(v):
                _assert_bits_equal([v], [w], f"state {k} {name}")
            else:
                assert v == w


@cases()
def test_state_dict_round_trip_resumes_bit_exactly(case):
    """torch's test_state_dict_deterministic: a loaded optimizer continues as the
    original, the dict given to load_state_dict is not changed, and both optimizers'
    state dicts stay equal."""
    kept = {}

    def save(opt):
        kept["copy"] = copy.deepcopy(opt.state_dict())
        return copy.deepcopy(opt.state_dict())

    # checked right after the load: torch's loaded state may share tensors with the dict
    opt, resumed = _resume(case, save, lambda sd: _assert_state_dicts_equal(sd, kept["copy"]))
    _assert_state_dicts_equal(opt.state_dict(), resumed.state_dict())
    # repeated parameters have identical representations (torch's #36831)
    resumed.param_groups.extend(resumed.param_groups)
    assert opt.state_dict()["param_groups"][-1] == resumed.state_dict()["param_groups"][-1]


@cases()
def test_torch_save_and_load_weights_only(case):
    def save(opt):
        buf = io.BytesIO()
        torch.save(opt.state_dict(), buf)
        buf.seek(0)
        return torch.load(buf, weights_only=True)

    _resume(case, save)


@cases()
def test_deepcopy_and_pickle(case):
    """An optimizer copied (deepcopy, or pickled and unpickled) with its parameters steps
    as the original, and keeps every public attribute."""
    model = case.linear()
    params = list(model.parameters())
    opt = case.make(params)
    grads = _grads(params, 5)
    _run(opt, params, grads[:3])
    copies = [copy.deepcopy((params, opt)), pickle.loads(pickle.dumps((params, opt)))]
    _run(opt, params, grads[3:])
    public = {k for k in opt.__dict__ if not k.startswith("_")}
    for cparams, copt in copies:
        assert {k for k in copt.__dict__ if not k.startswith("_")} == public
        assert _all_params(copt) == [id(p) for p in cparams]
        _run(copt, cparams, grads[3:])
        _assert_bits_equal(_clone(cparams), _clone(params))


@cases(TORCH_KEYWORD_CASES)
def test_load_older_state_dict_without_new_flags(case):
    """torch's test_can_load_older_state_dict: a dict saved before maximize, foreach,
    fused, differentiable and capturable existed loads, gets the defaults, and steps."""
    if case.family == "muon":
        pytest.skip("torch.optim.Muon keeps none of these flags in its param groups (nor does "
                    "memfit's Muon, whose state dicts are torch's): no older form to load")

    def save(opt):
        sd = copy.deepcopy(opt.state_dict())
        for group in sd["param_groups"]:
            for flag in _NEW_FLAGS:
                group.pop(flag, None)
        return sd

    _, resumed = _resume(case, save)
    assert resumed.param_groups[0]["maximize"] is False


@cases()
def test_load_step_stored_as_python_number(case):
    """torch's test_load_nontensor_step: ``step`` as a Python int or float (older torch,
    hand-edited dicts) loads and resumes bit-exactly."""
    for kind in (float, int):
        def save(opt):
            sd = copy.deepcopy(opt.state_dict())
            for st in sd["state"].values():
                if torch.is_tensor(st.get("step")):
                    st["step"] = kind(st["step"].item())
            return sd

        _resume(case, save)


@cases()
@pytest.mark.parametrize("step", [-1.0, 2.5, math.nan, math.inf])
def test_load_refuses_impossible_python_step(case, step):
    """memfit-specific: a step that no run can have reached (negative, fractional, NaN,
    Inf) is refused with a ValueError that says so, and nothing is loaded."""
    _memfit_only(case)
    model = case.linear()
    params = list(model.parameters())
    opt = case.make(params)
    _run(opt, params, _grads(params, 2))
    sd = copy.deepcopy(opt.state_dict())
    before = _state_tensors(opt)
    for st in sd["state"].values():
        st["step"] = step
    with pytest.raises(ValueError, match="step"):
        opt.load_state_dict(sd)
    after = _state_tensors(opt)
    for k in before:
        _assert_bits_equal([after[k]], [before[k]], f"state {k}")


@cases()
def test_param_names(case):
    """An optimizer built from named_parameters() keeps the names in its groups and its
    state dict; loading an unnamed state dict keeps its own names (as torch does)."""
    model = case.linear()
    opt = case.make(model.named_parameters())
    assert _names(opt) == ["weight", "bias"]
    params = list(model.parameters())
    _run(opt, params, _grads(params, 2))
    assert _names(opt.state_dict()) == ["weight", "bias"]
    unnamed = case.make(list(case.linear().parameters()))
    uparams = [p for g in unnamed.param_groups for p in g["params"]]
    _run(unnamed, uparams, _grads(uparams, 2))
    opt.load_state_dict(unnamed.state_dict())
    assert _names(opt) == ["weight", "bias"]
    named_again = case.make(case.linear().named_parameters())
    named_again.load_state_dict(opt.state_dict())
    assert _names(named_again.state_dict()) == ["weight", "bias"]


@cases()
def test_non_parameter_keys_in_state_are_kept(case):
    """torch keeps entries of ``state`` that name no parameter (a training loop's own
    bookkeeping) through load_state_dict and state_dict."""
    model = case.linear()
    params = list(model.parameters())
    opt = case.make(params)
    _run(opt, params, _grads(params, 1))
    sd = copy.deepcopy(opt.state_dict())
    sd["state"]["loop"] = {"epoch": 3}
    fresh = case.make(list(case.linear().parameters()))
    fresh.load_state_dict(sd)
    assert fresh.state["loop"] == {"epoch": 3}
    assert fresh.state_dict()["state"]["loop"] == {"epoch": 3}
