"""memfit.optim.Muon / Muon8bit against torch.optim.Muon (torch 2.14), AdamW8bit for
use_muon=False groups, the contract every memfit optimizer keeps (checks before any
write, the scaler's skip, bit-exact resume, torch state dicts in and out), and the
state bytes per parameter."""

import copy

import pytest
import torch

import memfit.optim as mo
from memfit._C import MemfitTypeError, MemfitValueError
from memfit.optim import _blocks, _core
from memfit.optim.muon import zeropower_via_newtonschulz

SHAPES = [(64, 96), (128, 64)]  # wide and tall (Newton-Schulz transposes a tall one)


def _params(seed, shapes=SHAPES, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).to(dtype) for s in shapes]


def _run(opt, params, grads):
    for p, g in zip(params, grads):
        p.grad = g.clone().to(p.dtype)
    opt.step()


def _grads(seed, params, steps):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(p.shape, generator=g) for p in params] for _ in range(steps)]


def _leaves(values):
    return [v.clone().requires_grad_() for v in values]


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("adjust_lr_fn", [None, "original", "match_rms_adamw", "spectral_unclamped"])
def test_muon_equals_torch_muon(nesterov, adjust_lr_fn):
    """Same parameters and momentum, bit for bit, over several steps: the fused pass is
    torch's lerp (one FMA), Newton-Schulz and the parameter ops are torch's."""
    init = _params(0)
    a, b = _leaves(init), _leaves(init)
    kw = dict(lr=0.02, weight_decay=0.1, nesterov=nesterov, adjust_lr_fn=adjust_lr_fn)
    ref, opt = torch.optim.Muon(a, **kw), mo.Muon(b, **kw)
    for gs in _grads(1, init, 4):
        _run(ref, a, gs)
        _run(opt, b, gs)
    for x, y in zip(a, b):
        assert not torch.equal(x, init[0]) if x.shape == init[0].shape else True
        assert torch.equal(x, y)
        assert torch.equal(ref.state[x]["momentum_buffer"], opt.state[y]["state1"])
        assert float(opt.state[y]["step"]) == 4.0


def test_conv_filters_are_flattened():
    """A 4-D conv filter steps as torch.optim.Muon steps its (out, in*kh*kw) matrix."""
    w = _params(2, [(16, 4, 3, 3)])[0]
    a, b = _leaves([w.reshape(16, -1)]), _leaves([w])
    ref, opt = torch.optim.Muon(a, lr=0.01), mo.Muon(b, lr=0.01)
    for (g,) in _grads(3, [w], 3):
        _run(ref, a, [g.reshape(16, -1)])
        _run(opt, b, [g])
    assert torch.equal(a[0].reshape(w.shape), b[0])


def _dequantized_momentum(opt, p):
    return mo.dequantized_state(opt, p)["momentum_buffer"]


def test_muon8bit_momentum_is_the_fp32_momentum_quantized_per_block():
    """Each step's 8-bit momentum is torch's update of the previous (dequantized)
    momentum, quantized per block of 256 by the signed dynamic map: the same codes and
    absmax as quantizing that float32 value; and the parameters stay close to the 32-bit
    optimizer's, as that quantization explains."""
    init = _params(4, [(96, 128), (128, 64)])  # >= min_8bit_size: 8-bit momentum
    a, b = _leaves(init), _leaves(init)
    o32, o8 = mo.Muon(a, lr=0.02), mo.Muon8bit(b, lr=0.02)
    code = _core.code_table(8, True)
    for step, gs in enumerate(_grads(5, init, 4)):
        prev = [_dequantized_momentum(o8, p) if step else torch.zeros_like(p) for p in b]
        _run(o32, a, gs)
        _run(o8, b, gs)
        for p, m, g in zip(b, prev, gs):
            want = m.lerp(g, 1 - 0.95)
            codes, absmax = _blocks.quantize_state(want, 8, code, 256, _blocks.state_rows(p))
            assert torch.equal(o8.state[p]["state1"], codes)
            assert torch.equal(o8.state[p]["absmax1"], absmax.reshape(o8.state[p]["absmax1"].shape))
    for x, y, p0 in zip(a, b, init):
        m32, m8 = o32.state[x]["state1"], _dequantized_momentum(o8, y)
        # the dynamic map's steps are at most 1/64 of the block's absmax near it
        assert (m8 - m32).abs().max() <= m32.abs().max() / 16
        rel = (y - x).norm() / (x - p0).norm()
        assert 0 < rel < 0.05, rel


def test_state_bytes_per_parameter():
    """About 1 byte per Muon parameter (codes + one float32 absmax per 256) against 4."""
    def nbytes(opt, p):
        return sum(t.numel() * t.element_size() for k, t in opt.state[p].items() if k != "step")
    p8, p32 = _leaves(_params(6, [(256, 1024)])), _leaves(_params(6, [(256, 1024)]))
    o8, o32 = mo.Muon8bit(p8), mo.Muon(p32)
    _run(o8, p8, _grads(7, p8, 1)[0])
    _run(o32, p32, _grads(7, p32, 1)[0])
    n = p8[0].numel()
    assert nbytes(o8, p8[0]) == n + 4 * n // 256  # 1.015625 B/param
    assert nbytes(o32, p32[0]) == 4 * n


def _mixed(cls, mats, others, **kw):
    return cls([{"params": mats}, {"params": others, "use_muon": False, "lr": 1e-3,
                                   "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.01}], **kw)


def test_use_muon_false_groups_are_adamw8bit_bit_for_bit():
    mats = _params(8, [(96, 128)])
    others = _params(9, [(1000, 64), (64,)])  # an embedding (8-bit states) and a bias
    a_m, a_o = _leaves(mats), _leaves(others)
    b_m, b_o = _leaves(mats), _leaves(others)
    opt = _mixed(mo.Muon8bit, a_m, a_o, lr=0.02)
    adamw = mo.AdamW8bit(b_o, lr=1e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01)
    muon = mo.Muon8bit(b_m, lr=0.02)
    for gs in _grads(10, mats + others, 3):
        _run(opt, a_m + a_o, gs)
        _run(adamw, b_o, gs[1:])
        _run(muon, b_m, gs[:1])
    for x, y in zip(a_m + a_o, b_m + b_o):
        assert torch.equal(x, y)
    for x, y in zip(a_o, b_o):
        for k, v in adamw.state[y].items():
            assert torch.equal(opt.state[x][k], v)
    assert set(opt.state[a_o[0]]) == {"step", "state1", "absmax1", "state2", "absmax2"}


def test_defaults_of_adamw_groups_and_muon_param_groups():
    from memfit.models import GPT, GPTConfig

    model = GPT(GPTConfig(vocab=50, d_model=32, n_layer=1, n_head=2, max_pos=16))
    groups = mo.muon_param_groups(model, lr=3e-4)
    names = {id(p): n for n, p in model.named_parameters()}
    muon = sorted(names[id(p)] for p in groups[0]["params"])
    assert muon == ["blocks.0.c_attn.weight", "blocks.0.c_fc.weight", "blocks.0.c_proj.weight",
                    "blocks.0.mlp_proj.weight"]
    assert groups[1]["use_muon"] is False and groups[1]["lr"] == 3e-4
    assert len(groups[0]["params"]) + len(groups[1]["params"]) == len(list(model.parameters()))
    opt = mo.Muon8bit(groups, lr=0.02, adamw_eps=1e-10)
    g0, g1 = opt.param_groups
    assert (g0["lr"], g0["eps"], g0["momentum"], g0["ns_steps"]) == (0.02, 1e-7, 0.95, 5)
    assert (g1["lr"], g1["eps"], g1["betas"], g1["weight_decay"]) == (3e-4, 1e-10, (0.9, 0.95), 0.1)
    loss = model(torch.randint(0, 50, (2, 8)), torch.randint(0, 50, (2, 8)))[1]
    loss.backward()
    opt.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("shape", [(64,), (4, 8, 8)])
def test_non_matrix_in_a_muon_group_is_refused(shape):
    with pytest.raises(MemfitValueError, match=r"param_groups\[0\]\['params'\]\[0\].*use_muon=False"):
        mo.Muon8bit([torch.zeros(shape, requires_grad=True)])


def test_bad_values_are_refused_naming_them():
    p = torch.zeros(8, 8, requires_grad=True)
    with pytest.raises(MemfitTypeError, match="float64"):
        mo.Muon8bit([torch.zeros(8, 8, dtype=torch.float64, requires_grad=True)])
    for kw, what in ((dict(momentum=-0.1), "momentum"), (dict(lr=-1.0), "lr"),
                     (dict(adjust_lr_fn="x"), "adjust_lr_fn"), (dict(ns_steps=100), "ns_steps"),
                     (dict(ns_coefficients=(1, 2)), "ns_coefficients")):
        with pytest.raises(ValueError, match=what):
            mo.Muon8bit([p], **kw)


def test_maximize_not_taken_as_torch():
    """torch.optim.Muon has no maximize, nor has memfit's (it takes torch's other flags
    as the other classes do: tests/test_optim_torch_contract_fixes.py)."""
    p = torch.zeros(8, 8, requires_grad=True)
    for cls in (mo.Muon8bit, mo.Muon, torch.optim.Muon):
        with pytest.raises(TypeError, match="maximize"):
            cls([p], maximize=True)


def test_refused_step_changes_nothing():
    """A bad value in group 1 (a schedule's negative lr) is found before group 0 (Muon)
    is stepped; a non-matrix slipped into a Muon group after construction too."""
    mats, others = _leaves(_params(11, [(96, 128)])), _leaves(_params(12, [(64,)]))
    opt = _mixed(mo.Muon8bit, mats, others)
    _run(opt, mats + others, _grads(13, mats + others, 1)[0])
    before = ({p: {k: v.clone() for k, v in opt.state[p].items()} for p in mats + others},
              [p.detach().clone() for p in mats + others])
    mats[0].grad = torch.randn(96, 128)
    others[0].grad = torch.randn(64)
    opt.param_groups[1]["lr"] = -1.0
    with pytest.raises(ValueError, match=r"param_groups\[1\]: lr"):
        opt.step()
    opt.param_groups[1]["lr"] = 1e-3
    opt.param_groups[0]["params"].append(torch.zeros(5, requires_grad=True))
    opt.param_groups[0]["params"][-1].grad = torch.ones(5)
    with pytest.raises(MemfitValueError, match=r"param_groups\[0\]\['params'\]\[1\]"):
        opt.step()
    for p, st in before[0].items():
        assert set(opt.state[p]) == set(st)
        assert all(torch.equal(opt.state[p][k], v) for k, v in st.items())
    assert all(torch.equal(p, q) for p, q in zip(mats + others, before[1]))


def test_scaler_skip_and_unscale():
    """found_inf set: nothing moves, the step does not count; grad_scale unscales."""
    init = _params(14, [(96, 128)])
    a, b = _leaves(init), _leaves(init)
    opt, ref = mo.Muon8bit(a), mo.Muon8bit(b)
    (g,) = _grads(15, init, 1)[0]
    _run(ref, b, [g])
    opt.grad_scale, opt.found_inf = torch.tensor(1024.0), torch.tensor(1.0)
    _run(opt, a, [g * 1024])
    assert torch.equal(a[0], init[0]) and not opt.state[a[0]]["step"]
    assert not opt.state[a[0]]["state1"].any()
    opt.found_inf = torch.tensor(0.0)
    _run(opt, a, [g * 1024])
    assert torch.equal(a[0], b[0])
    assert torch.equal(opt.state[a[0]]["state1"], ref.state[b[0]]["state1"])


def test_non_finite_gradient_element_keeps_its_momentum():
    a = _leaves(_params(16, [(96, 128)]))
    opt = mo.Muon(a)
    _run(opt, a, _grads(17, a, 1)[0])
    m = opt.state[a[0]]["state1"].clone()
    g = torch.randn(96, 128)
    g[3, 5] = float("nan")
    _run(opt, a, [g])
    assert opt.state[a[0]]["state1"][3, 5] == m[3, 5]
    assert not torch.equal(opt.state[a[0]]["state1"], m)
    assert torch.isfinite(a[0]).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_resume_from_state_dict_is_bit_exact(dtype):
    """Also for bfloat16 parameters written with stochastic rounding (the group's
    sr_step travels in the state dict) and an AdamW group."""
    mats, others = _params(18, [(96, 128)], dtype), _params(19, [(300, 20)], dtype)
    grads = _grads(20, mats + others, 4)
    a_m, a_o = _leaves(mats), _leaves(others)
    opt = _mixed(mo.Muon8bit, a_m, a_o)
    for gs in grads[:2]:
        _run(opt, a_m + a_o, gs)
    sd = copy.deepcopy(opt.state_dict())
    b_m, b_o = _leaves([p.detach() for p in a_m]), _leaves([p.detach() for p in a_o])
    for gs in grads[2:]:
        _run(opt, a_m + a_o, gs)
    opt2 = _mixed(mo.Muon8bit, b_m, b_o)
    opt2.load_state_dict(sd)
    for gs in grads[2:]:
        _run(opt2, b_m + b_o, gs)
    for x, y in zip(a_m + a_o, b_m + b_o):
        assert x.dtype == dtype and torch.equal(x, y)


def test_torch_muon_state_dict_in_and_out():
    init = _params(21)
    grads = _grads(22, init, 4)
    t, m = _leaves(init), _leaves(init)
    ref = torch.optim.Muon(t, lr=0.02, nesterov=False)
    for gs in grads[:2]:
        _run(ref, t, gs)
    opt = mo.Muon(m, lr=0.5)  # the loaded groups' hyperparameters are taken over
    with torch.no_grad():
        for x, y in zip(m, t):
            x.copy_(y)
    opt.load_state_dict(ref.state_dict())
    assert opt.param_groups[0]["lr"] == 0.02 and opt.param_groups[0]["nesterov"] is False
    for gs in grads[2:]:
        _run(ref, t, gs)
        _run(opt, m, gs)
    assert all(torch.equal(x, y) for x, y in zip(t, m))
    # back: torch.optim.Muon goes on from memfit's momentum
    back = _leaves([p.detach() for p in m])
    tb = torch.optim.Muon(back)
    tb.load_state_dict(mo.to_torch_state_dict(opt))
    g = _grads(23, init, 1)[0]
    _run(tb, back, g)
    _run(opt, m, g)
    assert all(torch.equal(x, y) for x, y in zip(back, m))
    # into 8-bit: the momentum quantized
    q = _leaves(init)
    o8 = mo.Muon8bit(q)
    o8.load_state_dict(ref.state_dict())
    for x, y in zip(q, t):
        want = ref.state[y]["momentum_buffer"]
        assert (_dequantized_momentum(o8, x) - want).abs().max() <= want.abs().max() / 16


def test_to_torch_refuses_adamw_groups():
    mats, others = _leaves(_params(24, [(8, 8)])), _leaves(_params(25, [(8,)]))
    opt = _mixed(mo.Muon, mats, others)
    with pytest.raises(MemfitValueError, match=r"param_groups\[1\].*use_muon=False"):
        mo.to_torch_state_dict(opt)


def test_newton_schulz_matches_torch():
    from torch.optim._muon import _zeropower_via_newtonschulz

    for shape in SHAPES:
        g = torch.randn(shape)
        ours = zeropower_via_newtonschulz(g, (3.4445, -4.7750, 2.0315), 5, 1e-7)
        assert torch.equal(ours, _zeropower_via_newtonschulz(g, (3.4445, -4.7750, 2.0315), 5, 1e-7))


@pytest.mark.parametrize("cls", [mo.Muon8bit, mo.Muon])
@pytest.mark.parametrize("flip", ["muon_to_adamw", "adamw_to_muon"])
def test_flipping_use_muon_after_a_step_is_refused_and_changes_nothing(cls, flip):
    """Flipping a stepped group's use_muon (either way) is refused by step and by
    state_dict, naming use_muon, with nothing changed (issue 38, item 11): the states
    are the other math's, and a dict saved so could be loaded by no Muon8bit. Set back,
    the optimizer steps and saves a dict that loads."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.LayerNorm(96))
    opt = cls(mo.muon_param_groups(m), lr=0.02)
    m(torch.randn(4, 64)).sum().backward()
    opt.step()
    params = [p.detach().clone() for p in m.parameters()]
    states = {p: {k: v.clone() for k, v in opt.state[p].items()} for p in m.parameters()}
    group = opt.param_groups[0 if flip == "muon_to_adamw" else 1]
    if flip == "muon_to_adamw":  # with AdamW's values, so that only the states are wrong
        group.update(betas=(0.9, 0.95), eps=1e-8)
    group["use_muon"] = flip == "adamw_to_muon"
    with pytest.raises(MemfitValueError, match=r"param_groups\[\d\]\['params'\]\[0\]: use_muon"):
        opt.step()
    with pytest.raises(MemfitValueError, match=r"use_muon.*nothing was saved"):
        opt.state_dict()
    with pytest.raises(MemfitValueError, match=r"use_muon"):
        mo.to_torch_state_dict(opt)
    assert all(torch.equal(p, q) for p, q in zip(m.parameters(), params))
    assert all(opt.state[p].keys() == st.keys() and all(torch.equal(opt.state[p][k], v)
                                                        for k, v in st.items())
               for p, st in states.items())
    group["use_muon"] = flip != "adamw_to_muon"
    opt.step()
    cls(mo.muon_param_groups(m), lr=0.02).load_state_dict(opt.state_dict())


def test_switching_a_muon_group_without_betas_to_adamw_is_refused():
    """A Muon group flipped to use_muon=False before any step, without AdamW's betas: the
    step refuses it (naming the group and what is missing) before anything is written."""
    m = torch.nn.Linear(64, 96)
    opt = mo.Muon8bit(mo.muon_param_groups(m), lr=0.02)
    m(torch.randn(4, 64)).sum().backward()
    before = [p.detach().clone() for p in m.parameters()]
    opt.param_groups[0]["use_muon"] = False
    with pytest.raises(MemfitValueError,
                       match=r"param_groups\[0\]: use_muon=False: the group has no betas"):
        opt.step()
    assert all(torch.equal(p, q) for p, q in zip(m.parameters(), before)) and not opt.state


def _conv_model(memory_format):
    torch.manual_seed(7)
    m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Conv2d(8, 64, 3),
                            torch.nn.Conv2d(64, 32, 1), torch.nn.Conv2d(32, 16, 3))
    return m.to(memory_format=memory_format)


@pytest.mark.parametrize("cls", [mo.Muon8bit, mo.Muon])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_channels_last_conv_filters_step_as_their_contiguous_copies(cls, dtype):
    """channels_last conv filters (muon_param_groups on a channels_last model) step bit
    for bit as the same model in contiguous memory: Muon's momentum is row-major
    whatever the filter's layout, so the 8-bit blocks, Newton-Schulz's matrix and the
    stochastic rounding's element numbers are the contiguous ones (issue 38, item 8).
    Their state dicts load into each other."""
    models = [_conv_model(f).to(dtype) for f in (torch.contiguous_format, torch.channels_last)]
    assert models[1][1].weight.is_contiguous(memory_format=torch.channels_last)
    opts = [cls(mo.muon_param_groups(m), lr=0.02) for m in models]
    gen = torch.Generator().manual_seed(8)
    for _ in range(3):
        grads = [torch.randn(p.shape, generator=gen).to(dtype) for p in models[0].parameters()]
        for m, opt in zip(models, opts):
            for p, g in zip(m.parameters(), grads):
                p.grad = g.clone(memory_format=torch.preserve_format).contiguous(
                    memory_format=torch.channels_last if p.dim() == 4 and m is models[1]
                    else torch.contiguous_format)
            opt.step()
    for p, q in zip(*(m.parameters() for m in models)):
        assert torch.equal(p, q)
        for key, value in opts[0].state[p].items():
            assert torch.equal(value, opts[1].state[q][key]), key
    assert any(opts[1].state[q]["state1"].dtype == (torch.uint8 if cls is mo.Muon8bit
                                                    else torch.float32)
               for q in models[1].parameters() if q.dim() == 4)
    for m, sd in zip(reversed(models), (opt.state_dict() for opt in opts)):
        cls(mo.muon_param_groups(m), lr=0.02).load_state_dict(sd)


def test_tensor_lr_as_torch_muon():
    """A one-element tensor lr (torch.optim.Muon takes it) steps as torch's, bit for bit,
    in both classes (issue 38, item 9: it raised in add_ after the momentum moved)."""
    init = _params(30)
    a, b, c = _leaves(init), _leaves(init), _leaves(init)
    ref = torch.optim.Muon(a, lr=torch.tensor([0.02]), weight_decay=0.1)
    opt = mo.Muon(b, lr=torch.tensor([0.02]), weight_decay=0.1)
    opt8 = mo.Muon8bit(c, lr=torch.tensor([0.02]), weight_decay=0.1, min_8bit_size=0)
    for gs in _grads(31, init, 3):
        for o, ps in ((ref, a), (opt, b), (opt8, c)):
            _run(o, ps, gs)
    for x, y, z, p0 in zip(a, b, c, init):
        assert torch.equal(x, y) and not torch.equal(x, p0)
        assert (x - z).abs().max() < 0.02  # the 8-bit momentum's quantization only


def test_empty_matrices_are_a_no_op():
    """(5, 0) and (0, 5) matrices step as nothing, and the others as without them (a
    (5, 0) one raised ZeroDivisionError after the others had stepped: issue 38, item 9)."""
    init = _params(32)
    a, b = _leaves(init), _leaves(init)
    empty = [torch.zeros(5, 0, requires_grad=True), torch.zeros(0, 5, requires_grad=True)]
    ref, opt = mo.Muon8bit(a, lr=0.02), mo.Muon8bit([b[0], *empty, b[1]], lr=0.02)
    for gs in _grads(33, init, 2):
        for e in empty:
            e.grad = torch.zeros(e.shape)
        _run(ref, a, gs)
        _run(opt, b, gs)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert all(e.shape in ((5, 0), (0, 5)) for e in empty)


def test_a_step_that_raises_late_changes_nothing():
    """Whatever a Muon group refuses is refused before the first write: a two-element
    tensor lr, a NaN momentum, with matrices that would be stepped first."""
    init = _params(34)
    for bad in (dict(lr=torch.tensor([0.02, 0.03])), dict(momentum=float("nan"))):
        b = _leaves(init)
        opt = mo.Muon8bit(b, lr=0.02)
        for p, g in zip(b, _grads(35, init, 1)[0]):
            p.grad = g
        opt.param_groups[0].update(bad)
        with pytest.raises((MemfitValueError, MemfitTypeError, ValueError)):
            opt.step()
        assert all(torch.equal(x, y) for x, y in zip(b, init)) and not opt.state


@pytest.mark.parametrize("shape", SHAPES)
def test_newton_schulz_leaves_its_bfloat16_input_alone(shape):
    """zeropower_via_newtonschulz does not modify its input, bfloat16 included (wide and
    tall; issue 38, item 10), and returns torch's bits."""
    from torch.optim._muon import _zeropower_via_newtonschulz

    g = torch.randn(shape, generator=torch.Generator().manual_seed(36)).bfloat16()
    before = g.clone()
    out = zeropower_via_newtonschulz(g)
    assert torch.equal(g, before)
    assert torch.equal(out, _zeropower_via_newtonschulz(before.clone(), (3.4445, -4.7750, 2.0315),
                                                        5, 1e-7))


def test_muon_param_groups_head_as_a_string():
    """head="lm_head" is one name, not the set of its characters: a Linear named "h"
    stays in Muon (issue 38, item 12); a head that is no names is refused."""
    m = torch.nn.ModuleDict({"h": torch.nn.Linear(8, 8), "lm_head": torch.nn.Linear(8, 4),
                             "out": torch.nn.Linear(4, 4)})
    for head in ("lm_head", ["lm_head"], ("lm_head",)):
        muon, adamw = mo.muon_param_groups(m, head=head)
        assert [id(p) for p in muon["params"]] == [id(m["h"].weight), id(m["out"].weight)]
        assert id(m["lm_head"].weight) in {id(p) for p in adamw["params"]}
    for bad in (5, ["lm_head", 3], None):
        with pytest.raises(MemfitTypeError, match="head"):
            mo.muon_param_groups(m, head=bad)


@pytest.mark.parametrize("cls", [mo.Muon8bit, mo.Muon])
def test_channels_last_filter_torch_state_dict_both_ways(cls):
    """A channels_last filter's momentum reads (dequantized_state, to_torch_state_dict)
    as the contiguous filter's, and a torch-format dict of either loads into both
    layouts alike (the same values; 8-bit: requantized, within its error)."""
    w = _params(37, [(64, 32, 3, 3)])[0]
    ct = w.clone().requires_grad_()
    cl = w.clone().contiguous(memory_format=torch.channels_last).requires_grad_()
    opts = [cls([q], lr=0.02) for q in (ct, cl)]
    for (g,) in _grads(38, [w], 2):
        ct.grad, cl.grad = g.clone(), g.contiguous(memory_format=torch.channels_last)
        for o in opts:
            o.step()
    momenta = [_dequantized_momentum(o, q) for o, q in zip(opts, (ct, cl))]
    assert torch.equal(*momenta) and momenta[0].abs().max() > 0
    sds = [mo.to_torch_state_dict(o) for o in opts]
    assert torch.equal(sds[0]["state"][0]["momentum_buffer"], sds[1]["state"][0]["momentum_buffer"])
    for sd in sds:  # requantized as the contiguous filter's would be, in either layout
        loaded = []
        for q in (ct, cl):
            into = cls([q], lr=0.02)
            into.load_state_dict(sd)
            loaded.append(_dequantized_momentum(into, q))
        assert torch.equal(*loaded)
        torch.testing.assert_close(loaded[0], momenta[0], rtol=0, atol=0.02 * momenta[0].abs().max())
