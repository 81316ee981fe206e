"""Behaviour of memfit.optim as a torch optimizer: state layout, state_dict round trip
and bit-exact resume, param groups, LR schedulers, None/zero/non-finite gradients,
GradScaler's fused-optimizer protocol, argument checks, the functional API, and
CPU/CUDA agreement (when a GPU is present)."""

import io

import numpy as np
import pytest
import torch

import memfit.optim as mo
from memfit.optim import _core
from memfit.optim import functional as F


ALL = [mo.AdamW8bit, mo.Adam8bit, mo.Lion8bit, mo.SGD8bit, mo.RMSprop8bit, mo.AdamW4bit,
       mo.AdamW, mo.Adam, mo.Adagrad8bit, mo.Adagrad, mo.LAMB8bit, mo.LAMB, mo.LARS8bit, mo.LARS,
       mo.AdEMAMix8bit, mo.AdEMAMix]


def make(cls, params, **kw):
    if cls in (mo.SGD8bit, mo.LARS8bit, mo.LARS):
        kw.setdefault("momentum", 0.9)
    if cls in (mo.LARS8bit, mo.LARS):
        kw.setdefault("lr", 1e-2)  # required, as in bitsandbytes
    if cls is mo.RMSprop8bit:
        kw.setdefault("momentum", 0.5)
    if cls in (mo.Adagrad8bit, mo.Adagrad):  # the state starts at a constant, not 0
        kw.setdefault("initial_accumulator_value", 0.1)
    return cls(params, **kw)


def model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Tanh(), torch.nn.Linear(96, 10))


def train(m, opt, steps, seed=1):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(32, 64, generator=gen)
        y = torch.randint(0, 10, (32,), generator=gen)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(m(x), y).backward()
        opt.step()


def snapshot(m, opt):
    params = [p.detach().clone() for p in m.parameters()]
    state = [{k: v.clone() for k, v in opt.state[p].items()} for p in m.parameters()]
    return params, state


def assert_same(a, b):
    for x, y in zip(a[0], b[0]):
        assert torch.equal(x, y)
    for sx, sy in zip(a[1], b[1]):
        assert sx.keys() == sy.keys()
        for k in sx:
            assert torch.equal(sx[k], sy[k]), k


# ---- state layout -----------------------------------------------------------------

def test_state_layout_and_memory():
    w = torch.nn.Parameter(torch.randn(400, 250))  # 100k elements: quantized
    b = torch.nn.Parameter(torch.randn(100))       # small: fp32 states
    opt = mo.AdamW8bit([w, b])
    w.grad = torch.randn_like(w)
    b.grad = torch.randn_like(b)
    opt.step()
    st = opt.state[w]
    assert st["state1"].dtype == torch.uint8 and st["state1"].shape == w.shape
    assert st["absmax1"].shape == (400, 1)  # one block per row of 250: blocks never cross rows
    assert st["step"].dtype == torch.float32 and st["step"].item() == 1.0
    assert opt.state[b]["state1"].dtype == torch.float32
    nbytes = sum(v.numel() * v.element_size() for v in st.values())
    assert nbytes < 2.04 * w.numel()  # ~2 bytes per parameter instead of 8

    opt4 = mo.AdamW4bit([w])
    opt4.step()
    st4 = opt4.state[w]
    assert st4["state1"].shape == (400, 125) and st4["absmax1"].shape == (400, 2)


@pytest.mark.parametrize("shape,quantized", [((3, 1365), False), ((64, 64), True),
                                             ((8192,), False)])
def test_min_8bit_size_boundary(shape, quantized):
    # quantized from min_8bit_size = 4096 elements on, for tensors of two or more
    # dimensions; 1-D tensors keep float32 states at any size
    p = torch.nn.Parameter(torch.randn(shape))
    p.grad = torch.randn(shape)
    opt = mo.AdamW8bit([p])
    opt.step()
    want = torch.uint8 if quantized else torch.float32
    assert opt.state[p]["state1"].dtype == want
    assert opt.state[p]["state2"].dtype == want
    # a custom threshold, per group
    q = torch.nn.Parameter(torch.randn(shape))
    q.grad = torch.randn(shape)
    opt2 = mo.AdamW8bit([{"params": [q], "min_8bit_size": 100000}])
    opt2.step()
    assert opt2.state[q]["state1"].dtype == torch.float32
    if len(shape) == 1:  # 1-D: float32 states even with no size threshold at all
        for cls in (mo.AdamW8bit, mo.AdamW4bit):
            r = torch.nn.Parameter(torch.randn(shape))
            r.grad = torch.randn(shape)
            opt3 = cls([r], min_8bit_size=0)
            opt3.step()
            assert opt3.state[r]["state1"].dtype == torch.float32, cls
            assert "absmax1" not in opt3.state[r], cls


def _nearest(code, x):
    """mf_quantize_nearest in NumPy float32: largest code <= x, ties to the lower."""
    lo = np.clip(np.searchsorted(code, x, side="right") - 1, 0, len(code) - 1)
    hi = np.minimum(lo + 1, len(code) - 1)
    up = (hi > lo) & ((code[hi] - x) < (x - code[lo]))
    return np.where(up, hi, lo).astype(np.uint8)


def _nearest_keep_positive(code, x):
    """mf_quantize_keep_positive_n in NumPy: nearest, but a positive x never takes a
    code value <= 0 (the smallest positive one instead): the rule of second moments."""
    q = _nearest(code, x)
    first_positive = np.searchsorted(code, np.float32(0), side="right")
    if first_positive < len(code):
        q = np.where((x > 0) & (code[q] <= 0), first_positive, q).astype(np.uint8)
    return q


@pytest.mark.parametrize("bits,shape", [(8, (5001,)), (4, (4097,)), (4, (1,)), (4, (255,)), (8, (1,)),
                                         (8, (3, 1667)), (4, (5, 257)), (4, (3, 255)), (8, (4, 256))])
def test_first_step_codes_exact(bits, shape):
    """After one step from zero states: exp_avg = (1-beta1)*g and exp_avg_sq =
    (1-beta2)*g*g in float32; absmax per block and the (4-bit: packed, odd sizes
    included) codes (nearest; exp_avg_sq's kept off 0) must match a NumPy computation
    bit for bit. Arrays of two
    dimensions: blocks and 4-bit bytes per row (dim-0 slice), the last ones partial."""
    numel = int(np.prod(shape))
    rng = np.random.default_rng(numel + bits)
    g = (rng.standard_normal(shape) * 0.01).astype(np.float32)
    p = rng.standard_normal(shape).astype(np.float32)
    st = F.init("adamw", p, bits)
    F.step("adamw", p, g, st, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
    bs = st["block_size"]
    rows = shape[0] if len(shape) >= 2 else 1
    row_len = numel // rows
    for k, val in ((1, np.float32(0.1) * g), (2, np.float32(1 - 0.999) * (g * g))):
        code = _core.code_table(bits, k == 1)
        val = val.reshape(rows, row_len)
        nb = (row_len + bs - 1) // bs  # blocks per row
        padded = np.zeros((rows, nb * bs), np.float32)
        padded[:, :row_len] = val
        absmax = np.abs(padded).reshape(rows, nb, bs).max(axis=2)
        np.testing.assert_array_equal(st[f"absmax{k}"], absmax.reshape(-1))
        inv = np.float32(1) / absmax
        search = _nearest if k == 1 else _nearest_keep_positive  # exp_avg_sq is non-negative
        q = search(code, val * np.repeat(inv, bs, axis=1)[:, :row_len])
        if bits == 4:
            q = np.concatenate([q, np.zeros((rows, row_len % 2), np.uint8)], axis=1)
            q = (q[:, 0::2] | (q[:, 1::2] << 4)).astype(np.uint8)
        np.testing.assert_array_equal(st[f"state{k}"], q.reshape(-1))


def test_dequantized_state_names():
    p = torch.nn.Parameter(torch.randn(32, 257))  # rows of 257: a partial block per row
    names = {mo.AdamW8bit: {"exp_avg", "exp_avg_sq"}, mo.Lion8bit: {"exp_avg"},
             mo.SGD8bit: {"momentum_buffer"}, mo.RMSprop8bit: {"square_avg", "momentum_buffer"},
             mo.AdamW4bit: {"exp_avg", "exp_avg_sq"}, mo.AdamW: {"exp_avg", "exp_avg_sq"},
             mo.Adagrad8bit: {"sum"},
             mo.LAMB8bit: {"exp_avg", "exp_avg_sq"}, mo.LARS8bit: {"momentum_buffer"}}
    for cls, want in names.items():
        opt = make(cls, [p])
        assert mo.dequantized_state(opt, p) == {}
        p.grad = torch.randn(p.shape) * 0.01
        opt.step()
        assert opt.state[p]["state1"].dtype == (torch.float32 if cls is mo.AdamW else torch.uint8)
        st = mo.dequantized_state(opt, p)
        assert set(st) == want
        for v in st.values():
            assert v.shape == p.shape and v.dtype == torch.float32 and torch.isfinite(v).all()
    assert set(mo.dequantized_state(mo.RMSprop8bit([p]), p)) == set()
    opt = mo.RMSprop8bit([p])
    opt.step()
    assert set(mo.dequantized_state(opt, p)) == {"square_avg"}


# ---- state_dict ---------------------------------------------------------------------

@pytest.mark.parametrize("cls", ALL, ids=lambda c: c.__name__)
def test_state_dict_bit_exact_resume(cls):
    m = model()
    opt = make(cls, m.parameters(), lr=1e-2, min_8bit_size=1000)
    train(m, opt, 3)
    buf = io.BytesIO()
    torch.save({"model": m.state_dict(), "opt": opt.state_dict()}, buf)
    train(m, opt, 4, seed=7)
    uninterrupted = snapshot(m, opt)

    buf.seek(0)
    ck = torch.load(buf, weights_only=True)
    m2 = model(seed=99)
    m2.load_state_dict(ck["model"])
    opt2 = make(cls, m2.parameters(), lr=1e-2, min_8bit_size=1000)
    opt2.load_state_dict(ck["opt"])
    for p in m2.parameters():
        assert opt2.state[p]["step"].item() == 3.0
    train(m2, opt2, 4, seed=7)
    assert_same(uninterrupted, snapshot(m2, opt2))
    # quantized states really were exercised
    if cls._bits != 32:
        assert any(s["state1"].dtype == torch.uint8 for s in opt2.state.values())


def test_state_dict_refusals():
    m = model()
    opt = mo.AdamW8bit(m.parameters(), min_8bit_size=1000)
    train(m, opt, 1)
    sd = opt.state_dict()
    with pytest.raises(ValueError, match="saved by memfit.optim.AdamW8bit"):
        mo.Lion8bit(model().parameters()).load_state_dict(sd)
    with pytest.raises(ValueError, match="not saved by a memfit optimizer"):
        # (torch.optim.AdamW's state dicts are converted: tests/test_optim_convert.py)
        t = torch.optim.Adagrad(m.parameters())
        train(m, t, 1)
        mo.AdamW8bit(m.parameters()).load_state_dict(t.state_dict())
    with pytest.raises(ValueError, match="each with a list of 'params'"):
        mo.AdamW8bit(m.parameters()).load_state_dict({"state": {}, "param_groups": [{}]})
    other = torch.nn.Sequential(torch.nn.Linear(64, 95), torch.nn.Tanh(), torch.nn.Linear(95, 10))
    with pytest.raises(ValueError, match="different model"):
        mo.AdamW8bit(other.parameters(), min_8bit_size=1000).load_state_dict(sd)
    with pytest.raises(ValueError, match="different model|bits"):
        # same shapes, but these tensors would keep fp32 states with this threshold
        mo.AdamW8bit(model().parameters(), min_8bit_size=10**9).load_state_dict(
            {**sd, "param_groups": [{**g, "min_8bit_size": 10**9} for g in sd["param_groups"]]})
    with pytest.raises(ValueError, match="number of parameter groups"):
        ps = list(model().parameters())
        mo.AdamW8bit([{"params": ps[:2]}, {"params": ps[2:]}]).load_state_dict(sd)


# ---- param groups, schedulers, maximize -----------------------------------------------

def _pair(cls_m, cls_t, groups_kw, steps=5, sched=None):
    m1, m2 = model(), model()
    g1 = [{"params": list(m1[0].parameters()), **groups_kw[0]},
          {"params": list(m1[2].parameters()), **groups_kw[1]}]
    g2 = [{"params": list(m2[0].parameters()), **groups_kw[0]},
          {"params": list(m2[2].parameters()), **groups_kw[1]}]
    o1, o2 = cls_m(g1, lr=1e-2), cls_t(g2, lr=1e-2)
    s1 = sched(o1) if sched else None
    s2 = sched(o2) if sched else None
    gen = torch.Generator().manual_seed(3)
    for _ in range(steps):
        x = torch.randn(16, 64, generator=gen)
        for m, o, s in ((m1, o1, s1), (m2, o2, s2)):
            o.zero_grad()
            m(x).square().mean().backward()
            o.step()
            if s:
                s.step()
    return m1, m2, o1, o2


def test_param_groups_match_torch():
    kw = [{"lr": 3e-3, "weight_decay": 0.1, "betas": (0.8, 0.99)}, {"weight_decay": 0.0}]
    m1, m2, o1, o2 = _pair(mo.AdamW, torch.optim.AdamW, kw)
    for a, b in zip(m1.parameters(), m2.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    assert o1.param_groups[0]["lr"] == 3e-3 and o1.param_groups[1]["lr"] == 1e-2
    # the 8-bit optimizer follows the same per-group hyperparameters, approximately
    m3, m4, o3, _ = _pair(lambda g, lr: mo.AdamW8bit(g, lr=lr, min_8bit_size=0), torch.optim.AdamW, kw)
    for a, b in zip(m3.parameters(), m4.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=2e-3)
    # the weights of both groups took the 8-bit path (the biases, 1-D, keep float32 states)
    for g in o3.param_groups:
        for p in g["params"]:
            assert o3.state[p]["state1"].dtype == (torch.uint8 if p.dim() >= 2 else torch.float32)


def test_lr_scheduler_and_add_param_group():
    sched = lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5)  # noqa: E731
    m1, m2, o1, o2 = _pair(mo.Adam, torch.optim.Adam, [{}, {}], steps=6, sched=sched)
    assert o1.param_groups[0]["lr"] == o2.param_groups[0]["lr"] == 1e-2 * 0.125
    for a, b in zip(m1.parameters(), m2.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    extra = torch.nn.Parameter(torch.randn(10))
    o1.add_param_group({"params": [extra], "lr": 0.5})
    extra.grad = torch.ones(10)
    before = extra.detach().clone()
    o1.step()
    assert torch.all(extra < before)
    with pytest.raises(ValueError, match="lr"):
        o1.add_param_group({"params": [torch.nn.Parameter(torch.randn(3))], "lr": -1.0})
    assert len(o1.param_groups) == 3


def test_maximize():
    p1 = torch.nn.Parameter(torch.randn(5000))
    p2 = torch.nn.Parameter(p1.detach().clone())
    g = torch.randn(5000)
    p1.grad, p2.grad = g.clone(), -g
    mo.AdamW([p1], maximize=True).step()
    mo.AdamW([p2]).step()
    torch.testing.assert_close(p1, p2, rtol=0, atol=0)


# ---- gradients: None, zero, non-finite, sparse -------------------------------------------

def test_none_and_zero_grads():
    a = torch.nn.Parameter(torch.randn(40, 125))
    b = torch.nn.Parameter(torch.randn(40, 125))
    a0, b0 = a.detach().clone(), b.detach().clone()
    opt = mo.AdamW8bit([a, b], lr=1e-2, weight_decay=0.1)
    a.grad = torch.zeros(40, 125)  # b.grad stays None
    opt.step()
    assert b not in opt.state and torch.equal(b, b0)
    assert opt.state[a]["state1"].dtype == torch.uint8
    # zero gradient: only the decoupled weight decay moves a; states stay zero
    decay = torch.tensor(1 - 1e-2 * 0.1, dtype=torch.float32)
    assert torch.equal(a.detach(), a0 * decay)
    st = mo.dequantized_state(opt, a)
    assert all(torch.count_nonzero(v) == 0 for v in st.values())
    opt.zero_grad()
    assert a.grad is None


@pytest.mark.parametrize("cls", ALL, ids=lambda c: c.__name__)
def test_nonfinite_grads_skip_elements(cls):
    shape = (32, 256)  # rows of whole blocks (8 bits: 256, 4 bits: 2 x 128)
    n = 32 * 256
    p = torch.nn.Parameter(torch.randn(shape))
    opt = make(cls, [p], lr=1e-2)
    p.grad = torch.randn(shape) * 0.01
    opt.step()
    if opt.param_groups[0]["bits"] != 32:
        assert opt.state[p]["state1"].dtype == torch.uint8
    before = p.detach().clone().view(-1)
    st_before = {k: v.view(-1) for k, v in mo.dequantized_state(opt, p).items()}
    g = torch.randn(shape) * 0.01
    bad = torch.tensor([3, 700, 4000, 8191])  # element numbers in storage order
    g.view(-1)[bad[:2]] = float("nan")
    g.view(-1)[bad[2]] = float("inf")
    g.view(-1)[bad[3]] = float("-inf")
    p.grad = g
    opt.step()
    assert opt.state[p]["step"].item() == 2.0
    assert torch.equal(p.detach().view(-1)[bad], before[bad])
    good = torch.ones(n, dtype=torch.bool)
    good[bad] = False
    assert (p.detach().view(-1)[good] != before[good]).float().mean() > 0.9
    st = {k: v.view(-1) for k, v in mo.dequantized_state(opt, p).items()}
    # skipped elements keep their old state values: exactly with fp32 states, up to
    # requantization with the block's new absmax otherwise
    tol = {32: 0.0, 8: 0.02, 4: 0.15}[opt.param_groups[0]["bits"]]
    for k, v in st.items():
        assert torch.isfinite(v).all(), k
        old = st_before[k]
        torch.testing.assert_close(v[bad], old[bad], rtol=0, atol=tol * old.abs().max().item())
    for key in ("absmax1", "absmax2"):
        if key in opt.state[p]:
            assert torch.isfinite(opt.state[p][key]).all()


def test_eps0_zero_gradient_issue_case_stays_put():
    # issue 30 §7: torch.optim.AdamW gives NaN here (0/0); memfit leaves the parameter
    p, g = np.zeros(1, np.float32), np.zeros(1, np.float32)
    state = F.init("adamw", p, 32)
    F.adamw_step(p, g, state, lr=0.5, betas=(0.0, 0.0), eps=0.0)
    assert p[0] == 0.0 and state["step"][0] == 1.0
    assert state["state1"][0] == 0.0 and state["state2"][0] == 0.0


@pytest.mark.parametrize("bits", [32, 8, 4])
@pytest.mark.parametrize("kind,momentum", [("adamw", 0.0), ("adam", 0.0), ("rmsprop", 0.0), ("rmsprop", 0.5)])
def test_eps0_zero_second_moment_skips_the_element(kind, momentum, bits):
    """eps=0 and a zero second moment under a zero (effective) gradient: the update is
    0/0. memfit skips such an element, as any undefined update (docs/optim.md): its
    parameter does not move (AdamW's weight decay included) and its states stay zero,
    where torch writes NaN; every other element takes torch's step."""
    n = 1024  # 8-bit: 4 blocks of 256; 4-bit: 8 of 128
    rng = np.random.default_rng(5)
    p0 = rng.uniform(-2, 2, n).astype(np.float32)
    g = rng.uniform(-1, 1, n).astype(np.float32)
    zero = np.zeros(n, bool)
    zero[::3] = True         # zero gradients inside blocks with others...
    zero[512:768] = True     # ...and whole blocks of them
    g[zero] = 0.0
    p0[::6] = 0.0            # Adam and RMSprop add weight_decay * p to the gradient
    if kind == "rmsprop":
        hp = dict(lr=0.1, alpha=0.9, eps=0.0, weight_decay=0.1, momentum=momentum)
        ref = torch.nn.Parameter(torch.from_numpy(p0.copy()))
        opt = torch.optim.RMSprop([ref], **hp)
    else:
        hp = dict(lr=0.1, betas=(0.9, 0.99), eps=0.0, weight_decay=0.1)
        ref = torch.nn.Parameter(torch.from_numpy(p0.copy()))
        opt = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam}[kind]([ref], **hp)
    ref.grad = torch.from_numpy(g.copy())
    opt.step()
    torch_p = ref.detach().numpy()
    undefined = np.isnan(torch_p)
    # the case occurs: AdamW at every zero gradient, Adam and RMSprop where p is 0 too
    assert undefined.sum() == (zero.sum() if kind == "adamw" else (zero & (p0 == 0)).sum()) > 0
    p = p0.copy()
    state = F.init(kind, p, bits, momentum=momentum)
    hp_mf = {k: v for k, v in hp.items() if k != "betas"}
    if kind != "rmsprop":
        hp_mf.update(beta1=0.9, beta2=0.99)
    F.step(kind, p, g, state, **hp_mf)
    assert state["step"][0] == 1.0
    assert np.array_equal(p[undefined], p0[undefined])
    np.testing.assert_allclose(p[~undefined], torch_p[~undefined], rtol=1e-6, atol=1e-7)
    # a step with no gradient at all: the elements that never had one are still 0/0
    # where their block's second moment is exactly zero. It always is with 32-bit
    # states, and with 8-bit ones (a zero stays zero); the 4-bit second-moment code
    # (k/16) has no zero, so in a block with other gradients such an element's update is
    # 0 / (absmax/16) = 0 and only AdamW's weight decay moves it, as with eps > 0.
    before = p.copy()
    F.step(kind, p, np.zeros(n, np.float32), state, **hp_mf)
    assert np.isfinite(p).all()
    for k in ("state1", "state2", "absmax1", "absmax2"):
        assert state[k] is None or np.isfinite(state[k].astype(np.float32)).all(), k
    decayed = undefined & (bits == 4) & (kind == "adamw")
    decayed[512:768] = False  # a block of zero gradients: absmax 0, second moment 0
    assert decayed.any() == (bits == 4 and kind == "adamw")
    decay = np.float32(1 - 0.1 * 0.1)
    assert np.array_equal(p[decayed], before[decayed] * decay)
    assert np.array_equal(p[undefined & ~decayed], before[undefined & ~decayed])
    assert (p[~undefined] != before[~undefined]).mean() > 0.5  # the others move on


def test_sparse_and_dtype_mismatch_rejected():
    emb = torch.nn.Embedding(100, 8, sparse=True)
    opt = mo.AdamW8bit(emb.parameters())
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()
    p = torch.nn.Parameter(torch.randn(5, 1000, dtype=torch.bfloat16))
    p.grad = torch.randn(5, 1000, dtype=torch.bfloat16)
    opt = mo.AdamW8bit([p])
    opt.state[p]  # noqa: B018
    opt.step()
    p.grad = None
    p.grad = torch.randn(5, 1000, dtype=torch.bfloat16)
    opt.state[p]["state1"] = torch.zeros(5, 1000, dtype=torch.float32)
    with pytest.raises(TypeError, match=r"param_groups\[0\]\['params'\]\[0\] \(shape \(5, 1000\)\): "
                                        r"state 'state1' is torch.float32, but needs torch.uint8"):
        opt.step()
    with pytest.raises(TypeError, match=r"grads\[0\]: expected dtype bfloat16"):
        F.adamw8bit_step(np.zeros(5000, np.float32).astype(_bf16()), np.zeros(5000, np.float32),
                         F.adamw8bit_init(np.zeros(5000, np.float32)))
    with pytest.raises(ValueError, match="amsgrad"):
        mo.AdamW8bit([p], amsgrad=True)
    with pytest.raises(ValueError, match="betas"):
        mo.AdamW8bit([p], betas=(1.0, 0.999))
    with pytest.raises(ValueError, match="block_size"):
        mo.AdamW8bit([p], block_size=100)
    with pytest.raises(ValueError, match="centered"):
        mo.RMSprop8bit([p], centered=True)
    with pytest.raises(ValueError, match="nesterov"):
        mo.SGD8bit([p], nesterov=True)


def _bf16():
    import ml_dtypes

    return ml_dtypes.bfloat16


def test_non_contiguous_param_rejected():
    w = torch.nn.Parameter(torch.randn(100, 80).t())
    w.grad = torch.randn(80, 100)
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[0\] \(shape \(80, 100\)\): "
                                         r"must be contiguous"):
        mo.AdamW8bit([w], min_8bit_size=0).step()


# ---- GradScaler ---------------------------------------------------------------------------

def _scaler(way):
    """A scaler and what to do to the optimizer for one way of scaling: torch's scaler
    opted into the in-kernel path, memfit's scaler (in-kernel without asking), or
    torch's scaler on its default path (it unscales the gradients itself)."""
    import memfit.amp

    if way == "memfit":
        return memfit.amp.GradScaler("cpu", init_scale=2.0**12), lambda o: o
    prepare = memfit.amp.scale_in_kernel if way == "torch+scale_in_kernel" else (lambda o: o)
    return torch.amp.GradScaler("cpu", init_scale=2.0**12), prepare


@pytest.mark.parametrize("way", ["torch+scale_in_kernel", "memfit"])
@pytest.mark.parametrize("cls", [mo.AdamW8bit, mo.AdamW], ids=lambda c: c.__name__)
def test_grad_scaler_fused_protocol(cls, way):
    m1, m2 = model(), model()
    scaler, prepare = _scaler(way)
    o1 = prepare(cls(m1.parameters(), lr=1e-2, min_8bit_size=1000))
    o2 = cls(m2.parameters(), lr=1e-2, min_8bit_size=1000)
    gen = torch.Generator().manual_seed(5)
    for _ in range(3):
        x = torch.randn(16, 64, generator=gen)
        o1.zero_grad()
        o2.zero_grad()
        scaler.scale(m1(x).square().mean()).backward()
        m2(x).square().mean().backward()
        scaled = [p.grad.clone() for p in m1.parameters()]
        scaler.step(o1)
        # fused path: the scaler did not unscale the grads in place, the kernel did
        for g0, p in zip(scaled, m1.parameters()):
            assert torch.equal(g0, p.grad)
        scaler.update()
        o2.step()
    for a, b in zip(m1.parameters(), m2.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert not hasattr(o1, "grad_scale") and not hasattr(o1, "found_inf")

    # an inf in one gradient: the whole step is skipped, nothing changes, scale halves
    before = snapshot(m1, o1)
    o1.zero_grad()
    scaler.scale(m1(torch.randn(16, 64)).square().mean()).backward()
    next(m1.parameters()).grad[0, 0] = float("inf")
    scale = scaler.get_scale()
    scaler.step(o1)
    scaler.update()
    assert_same(before, snapshot(m1, o1))
    assert scaler.get_scale() == scale / 2

    # unscale_ first (gradient clipping), then step: grads are used as they are
    o1.zero_grad()
    scaler.scale(m1(torch.randn(16, 64)).square().mean()).backward()
    scaler.unscale_(o1)
    torch.nn.utils.clip_grad_norm_(m1.parameters(), 1.0)
    steps = o1.state[next(m1.parameters())]["step"].item()
    scaler.step(o1)
    scaler.update()
    assert o1.state[next(m1.parameters())]["step"].item() == steps + 1


@pytest.mark.parametrize("cls", [mo.AdamW8bit, mo.Lion8bit], ids=lambda c: c.__name__)
def test_grad_scaler_default_path_equals_in_kernel(cls):
    """torch's scaler with a memfit optimizer as it is (no opt-in): the scaler unscales
    the gradients in place and skips an inf step on the host, as for torch's AdamW.
    Same bits as the in-kernel path (torch's scaler opted in, and memfit's scaler):
    a power-of-two scale unscales exactly either way. Steps: 3 finite, one with an
    inf gradient, one after unscale_ and clipping."""
    runs = {}
    for way in ("torch", "torch+scale_in_kernel", "memfit"):
        m = model()
        scaler, prepare = _scaler(way)
        opt = prepare(cls(m.parameters(), lr=1e-2, min_8bit_size=1000))
        gen = torch.Generator().manual_seed(5)
        steps_called = []
        step = opt.step
        opt.step = lambda *a, **k: steps_called.append(1) or step(*a, **k)
        for i in range(5):
            opt.zero_grad()
            scaler.scale(m(torch.randn(16, 64, generator=gen)).square().mean()).backward()
            if i == 3:
                next(m.parameters()).grad[0, 0] = float("inf")
            scaled = [p.grad.clone() for p in m.parameters()]
            if i == 4:
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(m.parameters(), 0.01)
            elif way == "torch":
                scaler.step(opt)  # unscales in place: the gradients are divided by 2**12
                assert all(torch.equal(g / 2.0**12, p.grad) for g, p in zip(scaled, m.parameters())
                           if i != 3)
                scaler.update()
                continue
            scaler.step(opt)
            scaler.update()
        runs[way] = (snapshot(m, opt), scaler.get_scale(), len(steps_called))
    assert runs["torch"][1:] == (2.0**11, 4)  # backed off once; the inf step was not called
    for way in ("torch+scale_in_kernel", "memfit"):
        assert runs[way][1:] == (2.0**11, 5)  # called, and skipped on the device
        assert_same(runs["torch"][0], runs[way][0])


def test_grad_scaler_float16_parameters_need_the_in_kernel_path():
    """float16 parameters (pure fp16 training): torch's scaler refuses to unscale their
    gradients on its default path, as for torch's AdamW; the in-kernel path (opted
    in, or memfit's scaler) takes them and steps as with the unscaled gradient."""
    results = {}
    for way in ("torch", "torch+scale_in_kernel", "memfit"):
        w = torch.nn.Parameter(torch.linspace(-1, 1, 64 * 64).reshape(64, 64).half())
        scaler, prepare = _scaler(way)
        opt = prepare(mo.AdamW8bit([w], lr=1e-2, min_8bit_size=1, bf16_stochastic_round=False))
        scaler.scale((w.float() ** 2).sum()).backward()
        if way == "torch":
            with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):
                scaler.step(opt)
            continue
        scaler.step(opt)
        scaler.update()
        results[way] = w.detach().clone()
    ref = torch.nn.Parameter(torch.linspace(-1, 1, 64 * 64).reshape(64, 64).half())
    opt = mo.AdamW8bit([ref], lr=1e-2, min_8bit_size=1, bf16_stochastic_round=False)
    (ref.float() ** 2).sum().backward()
    opt.step()
    for way, w in results.items():
        assert torch.equal(w, ref.detach()), way


def test_functional_grad_scale_and_found_inf():
    rng = np.random.default_rng(0)
    p = rng.standard_normal(6000).astype(np.float32)
    g = (rng.standard_normal(6000) * 0.01).astype(np.float32)
    q = p.copy()
    st1, st2 = F.adamw8bit_init(p), F.adamw8bit_init(q)
    F.adamw8bit_step(p, g, st1)
    F.adamw8bit_step(q, g * np.float32(1024), st2, grad_scale=np.array([1024], np.float32),
                     found_inf=np.zeros(1, np.float32))
    np.testing.assert_array_equal(p, q)  # scaling by a power of two is exact
    q0, s0 = q.copy(), st2["state1"].copy()
    F.adamw8bit_step(q, g, st2, found_inf=np.ones(1, np.float32))
    np.testing.assert_array_equal(q, q0)
    np.testing.assert_array_equal(st2["state1"], s0)
    assert st2["step"][0] == 1


# ---- functional API ------------------------------------------------------------------------

_FUNCTIONAL_CLASSES = {("adamw", 8): mo.AdamW8bit, ("adamw", 4): mo.AdamW4bit, ("adamw", 32): mo.AdamW,
                       ("lion", 8): mo.Lion8bit, ("sgd", 8): mo.SGD8bit, ("rmsprop", 8): mo.RMSprop8bit,
                       ("adam", 8): mo.Adam8bit, ("adagrad", 8): mo.Adagrad8bit, ("adagrad", 32): mo.Adagrad,
                       ("ademamix", 8): mo.AdEMAMix8bit, ("ademamix", 32): mo.AdEMAMix}


@pytest.mark.parametrize("kind,bits", sorted(_FUNCTIONAL_CLASSES))
def test_functional_matches_optimizer(kind, bits):
    """The NumPy functional step and the torch optimizer run the same kernel: same bits."""
    cls = _FUNCTIONAL_CLASSES[(kind, bits)]
    rng = np.random.default_rng(1)
    p_np = rng.standard_normal((13, 771)).astype(np.float32)  # rows of 771: partial blocks
    p_t = torch.nn.Parameter(torch.from_numpy(p_np.copy()))
    # (the functional Adagrad's sum starts at 0: initial_accumulator_value=0)
    extra = {"adagrad": dict(lr_decay=0.1, initial_accumulator_value=0.0),
             "ademamix": dict(t_alpha=2, t_beta3=3)}.get(kind, {})
    opt = make(cls, [p_t], lr=1e-2, min_8bit_size=0, **extra)
    hp = {k: v for k, v in opt.param_groups[0].items() if k in ("lr", "weight_decay", "maximize")}
    g0 = opt.param_groups[0]
    if "betas" in g0:
        hp.update(zip(("beta1", "beta2", "beta3"), g0["betas"]))
    for k in ("eps", "momentum", "dampening", "nesterov", "alpha", "lr_decay", "t_alpha", "t_beta3"):
        if k in g0:
            hp[k] = g0[k]
    st = F.init(kind, p_np, bits, momentum=hp.get("momentum", 0.0))
    for _ in range(3):
        g = (rng.standard_normal((13, 771)) * 0.01).astype(np.float32)
        p_t.grad = torch.from_numpy(g.copy())
        opt.step()
        F.step(kind, p_np, g, st, **hp)
    np.testing.assert_array_equal(p_np, p_t.detach().numpy())
    np.testing.assert_array_equal(st["state1"], opt.state[p_t]["state1"].reshape(-1).numpy())
    if bits != 32:
        np.testing.assert_array_equal(st["absmax1"], opt.state[p_t]["absmax1"].reshape(-1).numpy())


def test_functional_bf16_numpy():
    import ml_dtypes

    rng = np.random.default_rng(2)
    p = rng.standard_normal((20, 250)).astype(ml_dtypes.bfloat16)  # rows of 250: partial blocks
    g = (rng.standard_normal((20, 250)) * 0.01).astype(ml_dtypes.bfloat16)
    pt = torch.nn.Parameter(torch.from_numpy(p.astype(np.float32)).bfloat16())
    pt.grad = torch.from_numpy(g.astype(np.float32)).bfloat16()
    st = F.adamw8bit_init(p)
    F.adamw8bit_step(p, g, st, lr=1e-2)
    opt = mo.AdamW8bit([pt], lr=1e-2, bf16_stochastic_round=False)  # the functional API rounds to nearest
    opt.step()
    np.testing.assert_array_equal(p.astype(np.float32), pt.detach().float().numpy())
    assert opt.state[pt]["state1"].dtype == torch.uint8
    for k in ("state1", "absmax1", "state2", "absmax2"):
        np.testing.assert_array_equal(st[k], opt.state[pt][k].reshape(-1).numpy())


def test_functional_state_checks():
    p = np.zeros(5000, np.float32)
    st = F.adamw8bit_init(p)
    with pytest.raises(ValueError, match="state: was made for 'adamw'"):
        F.lion8bit_step(p, p, st)
    st["absmax1"] = np.zeros(3, np.float32)
    with pytest.raises(ValueError, match=r"absmax1\[0\]: expected 20 elements"):
        F.adamw8bit_step(p, p, st)


def test_import_memfit_optim_functional_without_torch():
    import subprocess
    import sys

    code = ("import sys, memfit, memfit.optim.functional as F, numpy as np; "
            "p=np.ones(300, np.float32); s=F.adamw4bit_init(p); F.adamw4bit_step(p, p, s); "
            "assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


# ---- CPU vs CUDA ---------------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.parametrize("cls", ALL, ids=lambda c: c.__name__)
@pytest.mark.parametrize("dtype,kahan", [(torch.float32, False), (torch.bfloat16, False),
                                         (torch.float16, False), (torch.bfloat16, True),
                                         (torch.float16, True)])
def test_cpu_cuda_agree_bitwise(cls, dtype, kahan):
    """Same function on both devices: params, codes, absmax, step (and the Kahan
    compensation) bit-identical (several tensors in one call, odd sizes, a partial last
    block)."""
    torch.manual_seed(0)
    shapes = [(1000, 37), (4097,), (33,), (256, 256)]
    cpu = [torch.nn.Parameter((torch.randn(s) * 0.1).to(dtype)) for s in shapes]
    gpu = [torch.nn.Parameter(p.detach().cuda()) for p in cpu]
    kw = {"kahan": True, "weight_decay": 0.1} if kahan else {}
    oc = make(cls, cpu, lr=1e-2, min_8bit_size=1000, **kw)
    og = make(cls, gpu, lr=1e-2, min_8bit_size=1000, **kw)
    for _ in range(4):
        for pc, pg in zip(cpu, gpu):
            g = (torch.randn(pc.shape) * 0.01).to(dtype)
            pc.grad, pg.grad = g, g.cuda()
        oc.step()
        og.step()
    for pc, pg in zip(cpu, gpu):
        assert torch.equal(pc.detach(), pg.detach().cpu())
        assert ("kahan_comp" in oc.state[pc]) == kahan
        for k, v in oc.state[pc].items():
            assert torch.equal(v, og.state[pg][k].cpu()), k


@pytest.mark.cuda
@pytest.mark.parametrize("cls,bs", [(mo.AdamW8bit, 64), (mo.AdamW4bit, 64), (mo.AdamW8bit, 4096),
                                    (mo.RMSprop8bit, 128), (mo.Lion8bit, 256)])
def test_cpu_cuda_agree_bitwise_many_tensors_scaled(cls, bs):
    """The GPU computes the per-tensor constants once per thread block and reduces absmax
    with warp shuffles: still the CPU's bits, with 45 tensors (more than one launch
    holds), odd sizes, block sizes 64 to 4096, and a grad_scale read on the device."""
    gen = torch.Generator().manual_seed(18)
    # 2-D (1-D parameters keep float32 states): rows of odd lengths, and rows of a
    # whole block of 4096 then a partial one
    dims = torch.randint(1, 300, (44, 2), generator=gen)
    shapes = [(int(r) // 10 + 1, int(c)) for r, c in dims] + [(3, 4096 + 65)]
    cpu = [torch.nn.Parameter(torch.randn(s, generator=gen) * 0.1) for s in shapes]
    gpu = [torch.nn.Parameter(p.detach().cuda()) for p in cpu]
    oc = make(cls, cpu, lr=1e-2, min_8bit_size=1, block_size=bs)
    og = make(cls, gpu, lr=1e-2, min_8bit_size=1, block_size=bs)
    scale = 1024.0
    for _ in range(3):
        for pc, pg in zip(cpu, gpu):
            g = torch.randn(pc.shape, generator=gen) * 0.01 * scale
            pc.grad, pg.grad = g, g.cuda()
        for opt, dev in ((oc, "cpu"), (og, "cuda")):  # as torch.amp.GradScaler hands them over
            opt.grad_scale = torch.full((), scale, device=dev)
            opt.found_inf = torch.zeros((), device=dev)
            opt.step()
    for pc, pg in zip(cpu, gpu):
        assert torch.equal(pc.detach(), pg.detach().cpu())
        assert oc.state[pc]["state1"].dtype == torch.uint8
        for k, v in oc.state[pc].items():
            assert torch.equal(v, og.state[pg][k].cpu()), k


@pytest.mark.cuda
def test_cuda_grad_scaler_skip_without_sync():
    import memfit.amp

    m = model().cuda()
    # the in-kernel path (torch's scaler on its default path syncs on found_inf)
    opt = memfit.amp.scale_in_kernel(mo.AdamW8bit(m.parameters(), min_8bit_size=1000))
    scaler = torch.amp.GradScaler("cuda")
    x = torch.randn(16, 64, device="cuda")
    scaler.scale(m(x).square().mean()).backward()
    scaler.step(opt)
    scaler.update()
    before = snapshot(m, opt)
    opt.zero_grad()
    scaler.scale(m(x).square().mean()).backward()
    next(m.parameters()).grad[0, 0] = float("nan")
    scaler.step(opt)
    scaler.update()
    assert_same(before, snapshot(m, opt))


def test_cpu_isa_variants_agree_bitwise():
    """The plain x86-64, AVX2 and AVX-512 variants of the CPU kernel (and the table
    search vs the binary search) compute the same bits, float32 states and elements the
    update skips included."""
    import subprocess
    import sys

    code = ("import numpy as np, sys; from memfit.optim import functional as F\n"
            "rng = np.random.default_rng(0); out = []\n"
            "for kind, bits in (('adamw', 8), ('adamw', 4), ('lion', 8), ('rmsprop', 8),\n"
            "                   ('adamw', 32), ('adam', 32), ('ademamix', 8), ('ademamix', 4)):\n"
            "    p = rng.standard_normal(9001).astype(np.float32); st = F.init(kind, p, bits)\n"
            "    for _ in range(3):\n"
            "        g = (rng.standard_normal(9001) * 0.01).astype(np.float32)\n"
            "        g[3::89], g[5::131], g[7::113] = np.nan, -np.inf, 3e19  # skipped elements\n"
            "        F.step(kind, p, g, st, lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, alpha=0.99)\n"
            "    out += [p.tobytes()] + [v.tobytes() for k, v in sorted(st.items())\n"
            "                            if isinstance(v, np.ndarray) and k != 'code1' and k != 'code2']\n"
            "sys.stdout.write(__import__('hashlib').sha256(b''.join(out)).hexdigest())\n")
    digests = set()
    for isa in ("generic", "avx2", "avx512", "avx512vbmi"):
        env = {**__import__("os").environ, "MEMFIT_CPU_ISA": isa}
        r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        digests.add(r.stdout)
    assert len(digests) == 1, digests


_FUSED_CASES = """
import hashlib, sys, torch, memfit.optim as mo
torch.manual_seed(0)
# (optimizer, kwargs): every kind and state layout the fused 8-bit kernel takes
cases = [(mo.AdamW8bit, {}), (mo.Adam8bit, {"weight_decay": 0.1}), (mo.Lion8bit, {}),
         (mo.SGD8bit, {"momentum": 0.9, "nesterov": True}), (mo.SGD8bit, {"momentum": 0.9}),
         (mo.RMSprop8bit, {}),
         (mo.RMSprop8bit, {"momentum": 0.5}), (mo.AdamW8bit, {"block_size": 64}),
         (mo.AdamW8bit, {"block_size": 4096}), (mo.AdamW8bit, {"maximize": True}),
         (mo.AdamW4bit, {}), (mo.AdamW4bit, {"block_size": 64, "weight_decay": 0.1}),
         (mo.Adagrad8bit, {"lr_decay": 0.1, "weight_decay": 0.1, "initial_accumulator_value": 0.1}),
         (mo.AdEMAMix8bit, {"t_alpha": 2, "t_beta3": 3}),
         (mo.AdEMAMix8bit, {"block_size": 64, "weight_decay": 0.1, "maximize": True})]
out = []
# float32 parameters take no rounding option (no compensation buffer, nothing to round):
# the three modes would be one computation three times, so float32 runs once
roundings = ({"bf16_stochastic_round": True}, {"bf16_stochastic_round": False}, {"kahan": True})
for dtype, rounding in [(torch.float32, {})] + [(d, r) for d in (torch.bfloat16, torch.float16)
                                                 for r in roundings]:
    for cls, kw in cases:
        # 2-D, as 1-D parameters keep float32 states: rows of whole blocks (block size
        # 4096: one partial block); rows of a fused work item (16384) then an odd
        # partial block; a small one (rows of 128: whole blocks of 64 and 128)
        ps = [torch.nn.Parameter((torch.randn(s) * 0.1).to(dtype))
              for s in ((24, 256), (2, 16384 + 301), (32, 128))]
        opt = cls(ps, lr=1e-2, min_8bit_size=0, **rounding, **kw)
        for _ in range(3):
            for p in ps:
                p.grad = (torch.randn(p.shape) * 0.01).to(dtype)
                p.grad[::97] = 0.0
                # elements the update skips: a NaN or infinite gradient, and one
                # whose square overflows (inside vectors of otherwise finite ones)
                g = p.grad.view(-1)
                g[3::89], g[5::131], g[7::113] = float("nan"), float("-inf"), 3e19
            opt.step()
        for p in ps:
            assert opt.state[p]["state1"].dtype == torch.uint8
            out.append(p.detach().view(-1).view(torch.uint8).numpy().tobytes())
            for v in opt.state[p].values():
                if torch.is_tensor(v):
                    out.append(v.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
sys.stdout.write(hashlib.sha256(b"".join(out)).hexdigest())
"""


def test_fused_kernels_match_block_kernel_bitwise():
    """The fused kernels (optim_fused.h, built for AVX-512 with VBMI, AVX-512 without
    it (MEMFIT_CPU_ISA=avx512) and AVX2) compute the same bits as the plain block
    kernel, for every optimizer kind with 8-bit states (AdEMAMix's three included) and
    AdamW4bit, every parameter
    dtype, rounding mode (stochastic, nearest, Kahan) and block size, with gradients
    that make some elements skip. A variant this CPU lacks falls back to the widest one
    it has."""
    import os
    import subprocess
    import sys

    digests = {}
    # the code search in each form (MEMFIT_OPTIM_KERNEL): 8-bit AVX2 by gathers or by
    # scalar loads, AVX-512 by gathers or by the arithmetic of code_lut.h; 4-bit by the
    # table or the threshold tree
    for isa, kernel in (("generic", None), ("avx2", "avx2-gather,avx2-table4"),
                        ("avx2", "avx2-scalar,avx2-tree4"), ("avx2", "avx2-gather,avx2-tree4"),
                        ("avx512", "avx512-table,avx512-table4"), ("avx512", "avx512-arith,avx512-tree4"),
                        ("avx512vbmi", "avx512-table,avx512-tree4"),
                        ("avx512vbmi", "avx512-arith,avx512-table4")):
        env = {**os.environ, "MEMFIT_CPU_ISA": isa}
        if kernel:
            env["MEMFIT_OPTIM_KERNEL"] = kernel
        r = subprocess.run([sys.executable, "-c", _FUSED_CASES], env=env, capture_output=True,
                           text=True, check=True)
        digests[(isa, kernel)] = r.stdout
    assert len(set(digests.values())) == 1, digests


def test_state_layout_rechecked_when_states_are_replaced():
    """The step remembers which parameters' states it has checked; clearing the states,
    or loading a state dict, makes it check (and create) them again instead of stepping
    on stale ones."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(40, 125))
    opt = mo.AdamW8bit([p], lr=1e-2)
    p.grad = torch.randn(40, 125) * 0.01
    opt.step()
    sd = opt.state_dict()
    opt.state.clear()
    opt.step()  # fresh states, as on the first step
    assert float(opt.state[p]["step"]) == 1.0
    assert opt.state[p]["state1"].dtype == torch.uint8
    opt.load_state_dict(sd)
    opt.step()
    assert float(opt.state[p]["step"]) == 2.0


@pytest.mark.parametrize("cls", [mo.AdamW8bit, mo.AdamW4bit, mo.AdamW])
def test_many_tensors_any_thread_count_same_bits(cls):
    """One step call shares the work items of all its tensors among the threads
    dynamically (csrc/core/optim.c): each item must still get its own tensor's step
    count and arrays. Tensors with different step counts (some had no gradient on the
    first steps), an empty one, whole fused items, partial blocks and tiny ones, stepped
    together with 1, 2 or 3 threads, give the same bits as each tensor stepped alone."""
    import memfit

    # rows of whole blocks and rows of partial ones (stepped row by row), an empty tensor
    # and a tensor of empty rows
    shapes = [(280, 250), (0, 16), (3, 100), (5, 16384), (16, 256), (5, 3337), (1, 1), (40, 125),
              (4, 0)]

    def run(together, threads):
        torch.manual_seed(0)
        ps = [torch.nn.Parameter(torch.randn(s) * 0.1) for s in shapes]
        opts = ([cls(ps, lr=1e-2, min_8bit_size=0)] if together
                else [cls([p], lr=1e-2, min_8bit_size=0) for p in ps])
        gen = torch.Generator().manual_seed(1)
        old = memfit.get_num_threads()
        memfit.set_num_threads(threads)
        try:
            for step in range(4):
                for i, p in enumerate(ps):
                    g = torch.randn(p.shape, generator=gen) * 0.01
                    p.grad = g if step >= i % 3 else None  # tensors start at steps 0, 1, 2
                for o in opts:
                    o.step()
        finally:
            memfit.set_num_threads(0 if old == 0 else old)
        states = [opts[0 if together else i].state[p] for i, p in enumerate(ps)]
        assert [float(s["step"]) for s in states] == [4 - i % 3 for i in range(len(ps))]
        want = torch.float32 if cls is mo.AdamW else torch.uint8
        assert all(s["state1"].dtype == want for s in states)
        return [p.detach().clone() for p in ps], [{k: v.clone() for k, v in s.items()} for s in states]

    alone = run(False, 1)
    for threads in (1, 2, 3):
        assert_same(alone, run(True, threads))


def test_torch_cpu_views_match_numpy_and_refuse_what_dlpack_refuses():
    """CPU torch tensors reach the core through their own attributes (csrc/python/
    views.c), not DLPack: a step on torch tensors (slices at a storage offset, uint8
    states, bfloat16 params) gives the bits of the same step on NumPy arrays; a tensor
    that requires grad or is not contiguous is still refused with the general path's
    error, naming the argument."""
    rng = np.random.default_rng(5)
    n = 5000
    base = rng.standard_normal((53, 100)).astype(np.float32)  # rows of 100: partial blocks
    g = (rng.standard_normal((50, 100)) * 0.01).astype(np.float32)
    for dtype in (torch.float32, torch.bfloat16):
        big = torch.from_numpy(base.copy()).to(dtype)
        p_t, g_t = big[3:], torch.from_numpy(g).to(dtype)  # p_t: a view at a storage offset (300)
        st_t = F.adamw8bit_init(p_t)
        for _ in range(2):
            F.adamw8bit_step(p_t, g_t, st_t, lr=1e-2)
        if dtype == torch.float32:  # the same step on NumPy arrays (__array_interface__)
            p_n, st_n = base[3:].copy(), F.adamw8bit_init(base[3:].copy())
            for _ in range(2):
                F.adamw8bit_step(p_n, g, st_n, lr=1e-2)
            np.testing.assert_array_equal(p_t.numpy(), p_n)
            for k in ("state1", "absmax1", "state2", "absmax2"):
                np.testing.assert_array_equal(st_t[k].numpy(), st_n[k])
        else:  # the optimizer class (nearest rounding, as the functional API) on a fresh copy
            pt = torch.nn.Parameter(torch.from_numpy(base[3:].copy()).to(dtype))
            opt = mo.AdamW8bit([pt], lr=1e-2, bf16_stochastic_round=False, min_8bit_size=0)
            for _ in range(2):
                pt.grad = g_t.clone()
                opt.step()
            assert torch.equal(pt.detach(), p_t)
            for k in ("state1", "absmax1", "state2", "absmax2"):
                assert torch.equal(opt.state[pt][k].reshape(-1), st_t[k].reshape(-1)), k
        assert torch.equal(big[:3], torch.from_numpy(base[:3]).to(dtype))  # untouched
    p = torch.zeros(n)
    st = F.adamw8bit_init(p)
    st["absmax1"].requires_grad_()  # (the functional API detaches params and grads itself)
    with pytest.raises(TypeError, match=r"absmax1\[0\]: could not be exported through DLPack"):
        F.adamw8bit_step(p, p, st)
    st["absmax1"] = st["absmax1"].detach()
    with pytest.raises(ValueError, match=r"must be contiguous"):
        F.adamw8bit_step(p, torch.zeros(2 * n)[::2], st)
    st["state1"] = st["state1"].float()
    with pytest.raises(TypeError, match=r"state1\[0\]: expected dtype uint8, got float32"):
        F.adamw8bit_step(p, p, st)
