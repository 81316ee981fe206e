"""The row-block codec (memfit.optim._blocks) against a NumPy reference, and state-dict
conversion (memfit.optim.convert): torch.optim <-> memfit, bitsandbytes -> memfit, and
memfit format_version 1 -> the current format."""

import os

import numpy as np
import pytest
import torch

import memfit.optim as mo
from memfit import _C
from memfit.optim import _blocks, _core, convert
from quant_reference import reference_dequantize, reference_quantize
from test_optim import model, train

DATA = os.path.join(os.path.dirname(__file__), "data")


# ---- the codec -------------------------------------------------------------------------

def _reference_rows(x, rows, bits, code, bs):
    """(codes, absmax, ties) of the row-block layout by the flat NumPy reference applied
    to each row (flat blocks within a row are the row's blocks); 4-bit codes packed."""
    flat = x.detach().cpu().float()
    flat = flat.view(-1) if flat.is_contiguous() else flat.as_strided((flat.numel(),), (1,))
    xs = flat.numpy().reshape(rows, -1)
    per_row = [reference_quantize(r, code, bs) for r in xs]
    idx = np.stack([c for c, _, _ in per_row])
    absmax = np.stack([a for _, a, _ in per_row]).astype(np.float32)
    ties = np.stack([t for _, _, t in per_row])
    if bits == 4:
        even = np.zeros((rows, idx.shape[1] + idx.shape[1] % 2), np.uint8)
        even[:, :idx.shape[1]] = idx
        return even[:, 0::2] | (even[:, 1::2] << 4), absmax, ties, idx
    return idx, absmax, ties, idx


def code_radius(code, signed):
    """The largest distance from a point of [-1, 1] (signed) or [0, 1] to the nearest
    entry of ``code``: the quantization error bound, in units of the block's absmax."""
    c = np.sort(code.astype(np.float64))
    return max(np.diff(c).max() / 2, c[0] - (-1.0 if signed else 0.0), 1.0 - c[-1])


def _indices(codes, bits, length):
    """One code index per element, (rows, length), of 8- or 4-bit codes."""
    return codes.numpy() if bits == 8 else _unpack4(codes, length)


def _unpack4(codes, length):
    c = codes.numpy()
    return np.stack((c & 15, c >> 4), axis=2).reshape(c.shape[0], -1)[:, :length]


CASES = [  # (shape, block_size, channels_last)
    ((3, 100), 64, False),     # rows not a multiple of the block size
    ((5, 129), 64, False),     # odd rows (4 bits: a last high nibble of 0)
    ((1, 300), 128, False),    # one row
    ((301,), 64, False),       # 1-D: one row, odd length
    ((4, 256), 128, False),    # rows of whole blocks
    ((4, 3, 5, 7), 64, False),
    ((4, 3, 5, 7), 64, True),  # channels_last: rows are still dim 0
]


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("signed", [True, False])
@pytest.mark.parametrize("shape,bs,cl", CASES)
def test_codec_matches_numpy_reference(bits, signed, shape, bs, cl):
    gen = torch.Generator().manual_seed(hash((bits, signed, shape, bs, cl)) % 2**31)
    x = torch.randn(shape, generator=gen) * torch.logspace(-3, 2, shape[-1])
    if not signed:
        x = x.abs()
    if x.dim() >= 2 and shape[0] > 2:
        x[1] = 0  # an all-zero row: absmax 0, inv 0, every code the one nearest 0
    if cl:
        x = x.contiguous(memory_format=torch.channels_last)
    code = _core.code_table(bits, signed)
    rows = _blocks.state_rows(x)
    assert rows == (shape[0] if len(shape) >= 2 else 1)
    length = x.numel() // rows
    codes, absmax = _blocks.quantize_state(x, bits, code, bs, rows)
    ref_codes, ref_absmax, ties, ref_idx = _reference_rows(x, rows, bits, code, bs)
    assert absmax.shape == (rows, -(-length // bs)) and absmax.dtype == torch.float32
    assert np.array_equal(absmax.numpy(), ref_absmax)
    if bits == 8:
        assert codes.shape == x.shape and codes.stride() == x.stride()
        got_idx = _blocks._storage(codes).view(rows, length).numpy()
    else:
        assert codes.shape == (rows, (length + 1) // 2)
        got_idx = _unpack4(codes, length)
        if length % 2:
            assert not (codes[:, -1] >> 4).any()  # an odd row's last high nibble is 0
    # the kernel's float32 search and the float64 reference may differ only at exact ties
    assert np.array_equal(got_idx[~ties], ref_idx[~ties])
    assert ties.mean() < 0.01
    # dequantized: code[index] * absmax, one float32 product (exact in float64, rounded once)
    y = _blocks.dequantize_state(codes, absmax, bits, code, bs, like=x)
    assert y.shape == x.shape and y.stride() == x.stride() and y.dtype == torch.float32
    ref_y = np.stack([reference_dequantize(got_idx[r], absmax[r].numpy(), code, bs)
                      for r in range(rows)])
    assert np.array_equal(_blocks._storage(y).view(rows, length).numpy(), ref_y)
    # every value within the code's worst rounding distance times its block's absmax
    blk_absmax = np.repeat(absmax.numpy().astype(np.float64), bs, axis=1)[:, :length]
    err = np.abs(_blocks._storage(y).view(rows, length).numpy().astype(np.float64)
                 - _blocks._storage(x).view(rows, length).numpy())
    # (plus float32 rounding of x * (1/absmax) and of the product: a few ulp of absmax)
    assert (err <= blk_absmax * (code_radius(code, signed) + 2.0**-21)).all()


@pytest.mark.parametrize("bits", [8, 4])
def test_codec_round_trip_and_empty(bits):
    code = _core.code_table(bits, True)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(7, 333, generator=gen)
    codes, absmax = _blocks.quantize_state(x, bits, code, 64, 7)
    y = _blocks.dequantize_state(codes, absmax, bits, code, 64, like=x)
    codes2, absmax2 = _blocks.quantize_state(y, bits, code, 64, 7)
    y2 = _blocks.dequantize_state(codes2, absmax2, bits, code, 64, like=x)
    # a block whose largest |x| is positive dequantizes its maximum to absmax * 1.0:
    # requantizing it gives the same bytes; one whose largest is negative shrinks to
    # absmax * code[0] (the signed codes have no -1), and stays within its error
    same = (absmax2 == absmax)
    assert same.float().mean() > 0.3
    elems = same.repeat_interleave(64, dim=1)[:, :333].numpy()
    assert np.array_equal(_indices(codes2, bits, 333)[elems], _indices(codes, bits, 333)[elems])
    assert torch.equal(y2[elems], y[elems])
    bound = absmax.repeat_interleave(64, dim=1)[:, :333] * (code_radius(code, True) + 2.0**-21)
    assert ((y2 - y).abs() <= bound).all()
    # an empty tensor: no blocks
    e = torch.empty(0, 5)
    c, a = _blocks.quantize_state(e, bits, code, 64, 0)
    assert a.shape == (0, 0) and c.numel() == 0
    assert _blocks.dequantize_state(c, a, bits, code, 64, like=e).shape == (0, 5)


def test_codec_refuses_bad_arguments():
    code8, code4 = _core.code_table(8, True), _core.code_table(4, True)
    x = torch.randn(4, 10)
    with pytest.raises(ValueError, match="values: expected a float32"):
        _blocks.quantize_state(x.double(), 8, code8, 64, 4)
    with pytest.raises(ValueError, match="bits: expected 8 or 4"):
        _blocks.quantize_state(x, 2, code8, 64, 4)
    with pytest.raises(ValueError, match="code: 4-bit states need a code of 16"):
        _blocks.quantize_state(x, 4, code8, 64, 4)
    with pytest.raises(ValueError, match="rows: 3 does not divide"):
        _blocks.quantize_state(x, 8, code8, 64, 3)
    codes, absmax = _blocks.quantize_state(x, 4, code4, 64, 4)
    with pytest.raises(ValueError, match="absmax: expected float32"):
        _blocks.dequantize_state(codes, absmax[:2], 4, code4, 64, like=x)
    with pytest.raises(ValueError, match="codes: expected 4-bit codes"):
        _blocks.dequantize_state(codes[:, :2].contiguous(), absmax, 4, code4, 64, like=x)
    c8, a8 = _blocks.quantize_state(x, 8, code8, 64, 4)
    with pytest.raises(ValueError, match="codes: expected 8-bit codes of the shape"):
        _blocks.dequantize_state(c8.t(), a8, 8, code8, 64, like=x)


def test_code_quantize_binding_checks_arguments():
    code = _core.code_table(4, False)
    x = np.linspace(-0.2, 1.2, 101, dtype=np.float32)
    out = np.empty(101, np.uint8)
    _C.code_quantize(code, x, out)
    # nearest entry of k/16, k = 1..16: below 1/16 -> 0, above 1 -> 15, ties to the lower
    want = np.array([int(np.argmin(np.abs(code.astype(np.float64) - v))) for v in x])
    assert np.array_equal(out, want)
    with pytest.raises(ValueError, match="code: expected 16 or 256 float32 values"):
        _C.code_quantize(code[:15].copy(), x, out)
    with pytest.raises(TypeError, match="x: "):
        _C.code_quantize(code, x.astype(np.float64), out)
    with pytest.raises(ValueError, match="out: expected 101 elements"):
        _C.code_quantize(code, x, out[:100])
    with pytest.raises(TypeError, match="out: expected uint8"):
        _C.code_quantize(code, x, np.empty(101, np.float32))
    with pytest.raises(ValueError, match="x: must be contiguous"):
        _C.code_quantize(code, x[::2], out[:51])


# ---- state-dict conversion ---------------------------------------------------------------
# test_optim's model: weights (96, 64) and (10, 96), rows of 64 and 96 elements (not a
# multiple of the block sizes), get 8-/4-bit states with min_8bit_size=500; the biases
# keep float32 states

def clone_model(m):
    m2 = model()
    m2.load_state_dict(m.state_dict())
    return m2


def continue_both(m, opt, t, torch_cls, steps, bound, **torch_kw):
    """``opt`` (which loaded torch optimizer ``t``'s state dict) and torch's own
    continuation (``torch_cls(**torch_kw)`` loading the same dict, on a copy of ``m``)
    train ``steps`` more steps on the same batches and stay close
    (:func:`assert_continues_alike`); returns the torch run's model."""
    m_t = clone_model(m)
    t_cont = torch_cls(m_t.parameters(), **torch_kw)
    t_cont.load_state_dict(t.state_dict())
    start = [p.detach().clone() for p in m.parameters()]
    train(m, opt, steps, seed=2)
    train(m_t, t_cont, steps, seed=2)
    assert_continues_alike(m, m_t, start, bound)
    return m_t


def assert_continues_alike(m, m_t, start, bound):
    """After both continued from ``start``: each parameter's distance between the memfit
    and the torch runs is below ``bound`` times how far the torch run moved it."""
    for p, q, s in zip(m.parameters(), m_t.parameters(), start):
        ratio = ((p - q).norm() / (q - s).norm()).item()
        assert ratio < bound, ratio


# measured (AMD EPYC, torch 2.13): 8-bit about 0.011, 4-bit about 0.17, fp32 about 1e-6
CONTINUE_BOUND = {8: 0.03, 4: 0.35, 32: 1e-4}


def group_of(opt, p):
    return next(g for g in opt.param_groups if any(q is p for q in g["params"]))


def assert_quantized_from(opt, p, floats):
    """opt's states of p are exactly quantize_state(floats) (float32 states: floats
    themselves), and dequantized_state is within the codes' error of floats."""
    g = group_of(opt, p)
    st, deq = opt.state[p], mo.dequantized_state(opt, p)
    names = _core.STATE_NAMES[opt._kind]
    quantized = 0
    for k, nm in enumerate(names, start=1):
        if f"state{k}" not in st:  # RMSprop without momentum keeps one state
            continue
        want = floats[nm].float()
        if st[f"state{k}"].dtype == torch.float32:
            assert torch.equal(st[f"state{k}"], want)
            assert torch.equal(deq[nm], want)
            continue
        quantized += 1
        signed = _core.state_layout(opt._kind, g["bits"], g["block_size"], 0,
                                    opt._hparams(g)["momentum"])["signed"][k - 1]
        code = _core.code_table(g["bits"], signed)
        codes, absmax = _blocks.quantize_state(want, g["bits"], code, g["block_size"],
                                               _blocks.state_rows(p), keep_positive=not signed)
        assert torch.equal(st[f"state{k}"], codes) and torch.equal(st[f"absmax{k}"], absmax)
        rows = _blocks.state_rows(p)
        bound = absmax.repeat_interleave(g["block_size"], dim=1)[:, :p.numel() // rows]
        bound = bound.reshape(p.shape) * (code_radius(code, signed) + 2.0**-21)
        assert ((deq[nm] - want).abs() <= bound).all(), nm
    return quantized


@pytest.mark.parametrize("cls,torch_cls", [(mo.AdamW8bit, torch.optim.AdamW),
                                           (mo.AdamW4bit, torch.optim.AdamW),
                                           (mo.Adam8bit, torch.optim.Adam),
                                           (mo.AdamW, torch.optim.AdamW)])
def test_torch_state_dict_into_memfit(cls, torch_cls):
    m = model()
    t = torch_cls(m.parameters(), lr=3e-3, betas=(0.8, 0.99), eps=1e-7, weight_decay=0.05)
    train(m, t, 3)
    opt = cls(m.parameters(), min_8bit_size=500)
    bits, bs = opt.param_groups[0]["bits"], opt.param_groups[0]["block_size"]
    opt.load_state_dict(t.state_dict())
    g = opt.param_groups[0]
    assert (g["lr"], tuple(g["betas"]), g["eps"], g["weight_decay"]) == (3e-3, (0.8, 0.99), 1e-7, 0.05)
    assert (g["bits"], g["block_size"], g["min_8bit_size"]) == (bits, bs, 500)
    quantized = 0
    for p in m.parameters():
        assert opt.state[p]["step"].dtype == torch.float32 and opt.state[p]["step"].item() == 3
        quantized += assert_quantized_from(opt, p, t.state[p])
    assert quantized == (0 if bits == 32 else 4)  # two states of the two weights
    # training goes on from there, close to torch's own continuation
    continue_both(m, opt, t, torch_cls, 3, CONTINUE_BOUND[bits])


@pytest.mark.parametrize("cls,torch_cls", [(mo.AdamW8bit, torch.optim.AdamW),
                                           (mo.AdamW4bit, torch.optim.AdamW),
                                           (mo.Adam8bit, torch.optim.Adam)])
def test_memfit_state_dict_into_torch(cls, torch_cls):
    m = model()
    opt = cls(m.parameters(), lr=3e-3, weight_decay=0.05, min_8bit_size=500)
    train(m, opt, 3)
    sd = mo.to_torch_state_dict(opt)
    assert not set(sd["param_groups"][0]) & {"bits", "block_size", "min_8bit_size", "sr_seed"}
    m_t = clone_model(m)
    t = torch_cls(m_t.parameters())
    t.load_state_dict(sd)
    tg = t.param_groups[0]
    assert (tg["lr"], tg["weight_decay"], tg["amsgrad"]) == (3e-3, 0.05, False)
    assert tg["decoupled_weight_decay"] == (torch_cls is torch.optim.AdamW)
    for p, q in zip(m.parameters(), m_t.parameters()):
        deq = mo.dequantized_state(opt, p)
        assert torch.equal(t.state[q]["exp_avg"], deq["exp_avg"])
        assert torch.equal(t.state[q]["exp_avg_sq"], deq["exp_avg_sq"])
        assert torch.equal(t.state[q]["step"], opt.state[p]["step"])
    start = [p.detach().clone() for p in m.parameters()]
    train(m, opt, 3, seed=2)
    train(m_t, t, 3, seed=2)
    assert_continues_alike(m, m_t, start, CONTINUE_BOUND[opt.param_groups[0]["bits"]])


def assert_fp32_states_cross(m, source, names):
    """memfit's 32-bit AdamW loads `source`'s state dict with every state bit-exact:
    `names` maps memfit's state names to the source's. Returns the memfit optimizer."""
    opt = mo.AdamW(m.parameters())
    opt.load_state_dict(source.state_dict())
    for p in m.parameters():
        for mine, theirs in names.items():
            assert torch.equal(opt.state[p][mine], source.state[p][theirs]), mine
    return opt


def test_fp32_states_cross_bit_exactly():
    m = model()
    t = torch.optim.AdamW(m.parameters(), lr=1e-2)
    train(m, t, 2)
    opt = assert_fp32_states_cross(
        m, t, {"state1": "exp_avg", "state2": "exp_avg_sq", "step": "step"})
    train(m, opt, 2)
    t2 = torch.optim.AdamW(m.parameters())
    t2.load_state_dict(mo.to_torch_state_dict(opt))
    for p in m.parameters():
        assert torch.equal(t2.state[p]["exp_avg"], opt.state[p]["state1"])
        assert torch.equal(t2.state[p]["exp_avg_sq"], opt.state[p]["state2"])
    # and back: the same memfit state dict
    opt2 = mo.AdamW(m.parameters())
    opt2.load_state_dict(t2.state_dict())
    a, b = opt.state_dict(), opt2.state_dict()
    for pid in a["state"]:
        for k, v in a["state"][pid].items():
            assert torch.equal(v, b["state"][pid][k]), k
    assert a["param_groups"][0]["lr"] == b["param_groups"][0]["lr"]


def test_sgd_momentum_round_trip():
    m = model()
    t = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, nesterov=True)
    train(m, t, 2)
    opt = mo.SGD8bit(m.parameters(), lr=0.01, momentum=0.5, min_8bit_size=500)
    opt.load_state_dict(t.state_dict())
    g = opt.param_groups[0]
    assert (g["lr"], g["momentum"], g["nesterov"]) == (0.05, 0.9, True)
    for p in m.parameters():
        assert opt.state[p]["step"].item() == 1  # torch's SGD counts no steps
        assert_quantized_from(opt, p, t.state[p])
    m_t = continue_both(m, opt, t, torch.optim.SGD, 2, CONTINUE_BOUND[8], lr=0.05, momentum=0.9,
                        nesterov=True)
    sd = mo.to_torch_state_dict(opt)
    assert all(set(s) == {"momentum_buffer"} for s in sd["state"].values())
    torch.optim.SGD(m_t.parameters(), lr=0.05, momentum=0.9).load_state_dict(sd)


def test_adagrad_torch_state_dict_both_ways():
    """torch.optim.Adagrad's state dict (sum, step, lr_decay, initial_accumulator_value)
    loads into Adagrad8bit (sum quantized as quantize_state does) and continues as torch
    does; to_torch_state_dict goes back to torch.optim.Adagrad."""
    m = model()
    t = torch.optim.Adagrad(m.parameters(), lr=0.05, lr_decay=0.1, initial_accumulator_value=0.2)
    train(m, t, 2)
    opt = mo.Adagrad8bit(m.parameters(), min_8bit_size=500)
    opt.load_state_dict(t.state_dict())
    g = opt.param_groups[0]
    assert (g["lr"], g["lr_decay"], g["initial_accumulator_value"]) == (0.05, 0.1, 0.2)
    for p in m.parameters():
        assert opt.state[p]["step"].item() == 2
        assert assert_quantized_from(opt, p, t.state[p]) == (1 if p.dim() == 2 else 0)
    continue_both(m, opt, t, torch.optim.Adagrad, 2, CONTINUE_BOUND[8])
    sd = mo.to_torch_state_dict(opt)
    assert all(set(st) == {"step", "sum"} for st in sd["state"].values())
    t2 = torch.optim.Adagrad(model().parameters())
    t2.load_state_dict(sd)
    assert t2.param_groups[0]["lr_decay"] == 0.1 and "bits" not in t2.param_groups[0]


def test_rmsprop_and_lion_exports():
    m = model()
    t = torch.optim.RMSprop(m.parameters(), lr=1e-3, alpha=0.9, momentum=0.5)
    train(m, t, 2)
    opt = mo.RMSprop8bit(m.parameters(), momentum=0.1, min_8bit_size=500)
    opt.load_state_dict(t.state_dict())
    assert (opt.param_groups[0]["alpha"], opt.param_groups[0]["momentum"]) == (0.9, 0.5)
    for p in m.parameters():
        assert opt.state[p]["step"].item() == 2
        assert assert_quantized_from(opt, p, t.state[p]) == (2 if p.dim() == 2 else 0)
    sd = mo.to_torch_state_dict(opt)
    t2 = torch.optim.RMSprop(model().parameters())
    t2.load_state_dict(sd)
    assert t2.param_groups[0]["centered"] is False
    lion = mo.Lion8bit(m.parameters(), min_8bit_size=500)
    train(m, lion, 2)
    sd = mo.to_torch_state_dict(lion)
    assert all(set(st) == {"step", "exp_avg"} for st in sd["state"].values())
    assert set(sd["param_groups"][0]) == {"lr", "betas", "weight_decay", "maximize", "params"}
    back = mo.Lion8bit(m.parameters(), min_8bit_size=500)
    back.load_state_dict(sd)  # lion-pytorch's format: exp_avg under lr, betas, weight_decay
    for p in m.parameters():
        for k, v in lion.state[p].items():
            # rows whose requantized absmax is unchanged keep their bytes; all stay close
            if k == "absmax1":
                assert ((back.state[p][k] - v).abs() <= v * 0.0071).all()


def test_conversion_refusals():
    m = model()
    t = torch.optim.AdamW(m.parameters(), amsgrad=True)
    train(m, t, 1)
    with pytest.raises(ValueError, match="amsgrad"):
        mo.AdamW8bit(m.parameters()).load_state_dict(t.state_dict())
    t = torch.optim.Adam(m.parameters(), weight_decay=0.1)
    train(m, t, 1)
    with pytest.raises(ValueError, match="saved by Adam with weight decay.*Adam8bit"):
        mo.AdamW8bit(m.parameters()).load_state_dict(t.state_dict())
    t = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    train(m, t, 1)
    with pytest.raises(ValueError, match="not by a torch.optim optimizer of the same kind"):
        mo.AdamW8bit(m.parameters()).load_state_dict(t.state_dict())
    t = torch.optim.AdamW(m.parameters())
    train(m, t, 1)
    sd = t.state_dict()
    with pytest.raises(ValueError, match="same kind as Lion8bit"):
        mo.Lion8bit(m.parameters()).load_state_dict(sd)
    other = torch.nn.Sequential(torch.nn.Linear(64, 95), torch.nn.Tanh(), torch.nn.Linear(95, 10))
    with pytest.raises(ValueError, match="different model"):
        mo.AdamW8bit(other.parameters()).load_state_dict(sd)
    bad = {**sd, "state": {**sd["state"], 0: {**sd["state"][0]}}}
    bad["state"][0]["exp_avg"] = sd["state"][0]["exp_avg"].clone()
    bad["state"][0]["exp_avg"][0, 0] = float("nan")
    opt = mo.AdamW8bit(m.parameters())
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[0\] \(shape \(96, 64\)\): state 'exp_avg' holds NaN or Inf"):
        opt.load_state_dict(bad)
    assert not opt.state  # nothing half-loaded
    with pytest.raises(TypeError, match="optimizer: expected a memfit.optim optimizer"):
        mo.to_torch_state_dict(t)


def test_bitsandbytes_adamw8bit_state_dict():
    bnb = pytest.importorskip("bitsandbytes")
    m = model()
    b = bnb.optim.AdamW8bit(m.parameters(), lr=2e-3, weight_decay=0.02, min_8bit_size=500)
    train(m, b, 3)
    sd = b.state_dict()
    opt = mo.AdamW8bit(m.parameters(), min_8bit_size=500)
    opt.load_state_dict(sd)
    assert (opt.param_groups[0]["lr"], opt.param_groups[0]["weight_decay"]) == (2e-3, 0.02)
    quantized = 0
    for p in m.parameters():
        st = b.state[p]
        floats = {}
        for k, nm in ((1, "exp_avg"), (2, "exp_avg_sq")):
            s = st[f"state{k}"]
            if s.dtype == torch.uint8:
                # bitsandbytes' own dequantizer: qmap[code] * absmax[i // 256]
                q = bnb.functional.QuantState(absmax=st[f"absmax{k}"], code=st[f"qmap{k}"],
                                              blocksize=256, dtype=torch.float32)
                floats[nm] = bnb.functional.dequantize_blockwise(s, quant_state=q)
            else:
                floats[nm] = s
        assert opt.state[p]["step"].item() == 3
        quantized += assert_quantized_from(opt, p, floats)
    assert quantized == 4
    train(m, opt, 2, seed=2)  # and training goes on
    # bitsandbytes' 32-bit states cross exactly
    b32 = bnb.optim.AdamW(m.parameters(), optim_bits=32)
    train(m, b32, 2)
    assert_fp32_states_cross(m, b32, {"state1": "state1", "state2": "state2"})


def test_format_1_state_dicts_load():
    """tests/data/optim_state_v1.pt: AdamW8bit/AdamW4bit state dicts saved by memfit's
    format 1 (flat blocks), min_8bit_size=256, for parameters w_even (4, 256) (rows of
    whole blocks), w_odd (6, 101) and b (300,) (a 1-D tensor with quantized states in
    format 1, float32 states now)."""
    data = torch.load(os.path.join(DATA, "optim_state_v1.pt"), weights_only=True)
    for cls in (mo.AdamW8bit, mo.AdamW4bit):
        saved = data[cls.__name__]
        v1 = saved["optimizer"]
        assert v1["memfit"]["format_version"] == 1
        ps = [torch.nn.Parameter(v.clone()) for v in saved["params_after"]]
        opt = cls(ps, lr=1e-2, min_8bit_size=256)
        opt.load_state_dict(v1)
        bits, bs = opt.param_groups[0]["bits"], opt.param_groups[0]["block_size"]
        w_even, w_odd, b = ps
        for k, signed in ((1, True), (2, False)):
            code = _core.code_table(bits, signed)
            old_codes, old_absmax = (v1["state"][i][f"state{k}"] for i in range(3)), None
            for i, p in enumerate(ps):
                codes, absmax = v1["state"][i][f"state{k}"], v1["state"][i][f"absmax{k}"]
                flat = _blocks.dequantize_state(codes, absmax, bits, code, bs, p, rows=1)
                st = opt.state[p]
                if p is b:
                    assert st[f"state{k}"].dtype == torch.float32 and f"absmax{k}" not in st
                    assert torch.equal(st[f"state{k}"], flat)
                    continue
                assert st[f"absmax{k}"].shape == (p.shape[0], -(-p.shape[1] // bs))
                if p is w_even:  # byte for byte
                    assert torch.equal(st[f"state{k}"].reshape(-1), codes.reshape(-1))
                    assert torch.equal(st[f"absmax{k}"].reshape(-1), absmax)
                    assert torch.equal(mo.dequantized_state(opt, p)["exp_avg_sq" if k == 2
                                                                    else "exp_avg"], flat)
                else:  # requantized in rows
                    want, _ = _blocks.quantize_state(flat, bits, code, bs, p.shape[0])
                    assert torch.equal(st[f"state{k}"], want)
        for p in ps:
            assert opt.state[p]["step"].item() == 3
        assert opt.state_dict()["memfit"]["format_version"] != 1
        gen = torch.Generator().manual_seed(3)
        for p in ps:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
        assert all(torch.isfinite(p).all() for p in ps)
        assert opt.state[ps[0]]["step"].item() == 4


@pytest.mark.parametrize("cls", [mo.AdamW8bit, mo.AdamW4bit, mo.Lion8bit])
def test_requantizing_dequantized_states_after_steps(cls):
    """quantize_state(dequantized_state(...)) after real steps reproduces the kernel's
    codes and absmax wherever a block's largest |value| dequantizes to absmax itself
    (code entry 1.0: every block of the non-negative second moments; the blocks of
    signed states whose largest magnitude is positive, as the signed codes have no -1)."""
    m = model()
    opt = cls(m.parameters(), min_8bit_size=500)
    train(m, opt, 3)
    checked = 0
    for p in m.parameters():
        st = opt.state[p]
        if st["state1"].dtype != torch.uint8:
            continue
        g = group_of(opt, p)
        deq = mo.dequantized_state(opt, p)
        layout = _core.state_layout(opt._kind, g["bits"], g["block_size"], 0, 0.0)
        for k, nm in enumerate(_core.STATE_NAMES[opt._kind], start=1):
            signed = layout["signed"][k - 1]
            code = _core.code_table(g["bits"], signed)
            codes, absmax = _blocks.quantize_state(deq[nm], g["bits"], code, g["block_size"],
                                                   _blocks.state_rows(p), keep_positive=not signed)
            same = absmax == st[f"absmax{k}"]
            if not signed:
                assert same.all()
            assert same.float().mean() > 0.25
            length = p.numel() // p.shape[0]
            elems = same.repeat_interleave(g["block_size"], dim=1)[:, :length].numpy()
            assert np.array_equal(_indices(codes, g["bits"], length)[elems],
                                  _indices(st[f"state{k}"], g["bits"], length)[elems])
            checked += 1
    assert checked >= 2


# ---- hostile and foreign state dicts -------------------------------------------------------
# Every refusal is a MemfitValueError naming the parameter as param_groups[g]['params'][i],
# and leaves the optimizer bit-identical: its parameters, states and param groups.

def frozen(opt):
    """Everything a load could change: parameters, states, param groups (by value)."""
    groups = [{k: (list(map(id, v)) if k == "params" else v) for k, v in g.items()}
              for g in opt.param_groups]
    params = [p.detach().clone() for g in opt.param_groups for p in g["params"]]
    state = {id(p): {k: v.clone() for k, v in st.items()} for p, st in opt.state.items()}
    return groups, params, state


def assert_frozen(opt, before):
    groups, params, state = frozen(opt)
    assert groups == before[0]
    assert all(torch.equal(a, b) for a, b in zip(params, before[1]))
    assert state.keys() == before[2].keys()
    for pid, st in state.items():
        assert st.keys() == before[2][pid].keys()
        assert all(torch.equal(v, before[2][pid][k]) for k, v in st.items())


def assert_refused(opt, sd, match):
    """opt.load_state_dict(sd) raises MemfitValueError matching ``match`` and changes nothing."""
    before = frozen(opt)
    with pytest.raises(_C.MemfitValueError, match=match):
        opt.load_state_dict(sd)
    assert_frozen(opt, before)


def trained(cls, steps=1, **kw):
    """(model, optimizer) after ``steps`` steps: the refusals below must leave real states."""
    m = model()
    opt = cls(m.parameters(), min_8bit_size=500, **kw)
    train(m, opt, steps, seed=7)
    return m, opt


W0 = r"param_groups\[0\]\['params'\]\[0\] \(shape \(96, 64\)\)"  # the first weight


def torch_sd(torch_cls, m, steps=2, **kw):
    t = torch_cls(m.parameters(), **kw)
    train(m, t, steps)
    return t.state_dict()


@pytest.mark.parametrize("cls,torch_cls,key", [(mo.AdamW8bit, torch.optim.AdamW, "exp_avg_sq"),
                                               (mo.AdamW4bit, torch.optim.AdamW, "exp_avg_sq"),
                                               (mo.AdamW, torch.optim.AdamW, "exp_avg_sq"),
                                               (mo.RMSprop8bit, torch.optim.RMSprop, "square_avg"),
                                               (mo.Adagrad8bit, torch.optim.Adagrad, "sum")])
def test_negative_second_moment_is_refused_for_every_format(cls, torch_cls, key):
    """Before the fix an 8-bit AdamW8bit took a negated row of exp_avg_sq: the values
    quantized to 0 beside non-zero first moments, and the next zero-gradient step moved a
    weight by lr * |m| / eps (about 500 at lr=1e-3 here, 1.9e6 in the report)."""
    m, opt = trained(cls)
    sd = torch_sd(torch_cls, clone_model(m))
    sd["state"][0][key][3] = -sd["state"][0][key][3] - 1e-6
    assert_refused(opt, sd, f"{W0}: state '{key}' holds negative values, but it is a second moment")


@pytest.mark.parametrize("cls", [mo.AdamW8bit, mo.AdamW4bit])
def test_non_finite_step_and_state_values_are_refused(cls):
    m, opt = trained(cls)
    good = torch_sd(torch.optim.AdamW, clone_model(m))
    for key, value, match in [("exp_avg", float("inf"), "'exp_avg' holds NaN or Inf"),
                              ("exp_avg_sq", float("nan"), "'exp_avg_sq' holds NaN or Inf"),
                              ("step", float("nan"), r"'step' \(nan\) is not a whole number"),
                              ("step", -1.0, r"'step' \(-1.0\) is not a whole number"),
                              ("step", 2.5, r"'step' \(2.5\) is not a whole number")]:
        sd = {**good, "state": {**good["state"], 0: dict(good["state"][0])}}
        t = sd["state"][0][key].clone()
        t.view(-1)[0] = value
        sd["state"][0][key] = t
        assert_refused(opt, sd, f"{W0}: state {match}")


def test_malformed_foreign_states_raise_memfit_value_error():
    """Lists, strings, sparse and meta tensors, a str step, str ids: a MemfitValueError
    that names the parameter, never AttributeError, RuntimeError or NotImplementedError."""
    m, opt = trained(mo.AdamW8bit)
    good = torch_sd(torch.optim.AdamW, clone_model(m))

    def with_state0(**kw):
        return {**good, "state": {**good["state"], 0: {**good["state"][0], **kw}}}

    ea = good["state"][0]["exp_avg"]
    cases = [
        ({**good, "state": {**good["state"], 0: [ea]}}, f"{W0}: its state is a list, not a dict"),
        (with_state0(exp_avg=ea.to_sparse()), f"{W0}: state 'exp_avg' is a torch.sparse_coo tensor"),
        (with_state0(exp_avg=torch.empty_like(ea, device="meta")), f"{W0}: state 'exp_avg' is a meta"),
        (with_state0(exp_avg=ea.tolist()), f"{W0}: state 'exp_avg' is a list, not a tensor"),
        (with_state0(exp_avg=ea.to(torch.int32)), f"{W0}: state 'exp_avg' is torch.int32"),
        (with_state0(step="abc"), rf"{W0}: state 'step' \('abc'\) is not a whole number"),
        (with_state0(step=torch.ones(2)), f"{W0}: state 'step' has 2 values"),
        (with_state0(step=torch.tensor(1.0).to_sparse()), f"{W0}: state 'step' is a torch.sparse_coo"),
        ({**good, "param_groups": [{**good["param_groups"][0], "params": ["a", 1, 2, 3]}]},
         r"param_groups\[0\]\['params'\] is \['a', 1, 2, 3\], not a list of parameter ids"),
        ({**good, "param_groups": [{**good["param_groups"][0], "lr": "fast"}]},
         r"param_groups\[0\] of the state dict: "),
    ]
    for sd, match in cases:
        assert_refused(opt, sd, match)


def test_states_of_unlisted_ids_are_refused_not_dropped():
    m, opt = trained(mo.AdamW8bit)
    good = torch_sd(torch.optim.AdamW, clone_model(m))
    # a JSON round trip turns the state's keys into strings (the group's ids stay ints)
    as_json = {**good, "state": {str(k): v for k, v in good["state"].items()}}
    assert_refused(opt, as_json, r"state\['0'\] is a parameter's state, but no param group lists "
                                 r"the id '0' \(they list 0\.\.3\): its ids became strings")
    shifted = {**good, "state": {k + 1: v for k, v in good["state"].items()}}
    assert_refused(opt, shifted, r"state\[4\] is a parameter's state.*do not match")
    # bitsandbytes' and format 1's paths make the same check
    bnb_json = bnb_state_dict(opt, {1: (0.9, 0.99)}, opt_bits=8)
    bnb_json["state"] = {str(k): v for k, v in bnb_json["state"].items()}
    assert_refused(mo.Lion8bit(m.parameters()), bnb_json, r"state\['0'\] is a parameter's state")
    # what is not a parameter's state (not a dict) is kept, as torch keeps it
    kept = convert.from_torch(opt, {**good, "state": {**good["state"], "note": 3}})
    assert kept["state"]["note"] == 3
    with pytest.raises(_C.MemfitValueError, match=r"state\[9\] is a parameter's state"):
        convert.check_state_ids("X", {"state": {9: {}}}, {0: None})


# -- bitsandbytes' state dicts, laid out as bitsandbytes 0.50.2 saves them ---------------------

BNB_HYPER = {  # memfit kind -> (bitsandbytes' group, what memfit's group takes from it)
    _core.ADAMW: (dict(lr=2e-3, betas=(0.8, 0.99), eps=1e-7, weight_decay=0.02, alpha=0.0,
                       t_alpha=None, t_beta3=None),
                  dict(lr=2e-3, betas=(0.8, 0.99), eps=1e-7, weight_decay=0.02)),
    _core.LION: (dict(lr=3e-4, betas=(0.95, 0.98), eps=0.0, weight_decay=0.1),
                 dict(lr=3e-4, betas=(0.95, 0.98), weight_decay=0.1)),
    _core.SGD: (dict(lr=0.05, betas=(0.9, 0.1), eps=0.0, weight_decay=0.01),
                dict(lr=0.05, momentum=0.9, dampening=0.1, weight_decay=0.01)),
    _core.RMSPROP: (dict(lr=1e-3, betas=(0.9, 0.0), eps=1e-6, weight_decay=0.01),
                    dict(lr=1e-3, alpha=0.9, momentum=0.0, eps=1e-6, weight_decay=0.01)),
    # bitsandbytes' Adagrad has no lr_decay or initial value (it refuses both but 0)
    _core.ADAGRAD: (dict(lr=2e-2, betas=(0.0, 0.0), eps=1e-10, weight_decay=0.01),
                    dict(lr=2e-2, eps=1e-10, weight_decay=0.01, lr_decay=0.0,
                         initial_accumulator_value=0.0)),
    _core.ADEMAMIX: (dict(lr=2e-3, betas=(0.8, 0.99, 0.995), eps=1e-7, weight_decay=0.02,
                          alpha=4.0, t_alpha=6, t_beta3=5),
                     dict(lr=2e-3, betas=(0.8, 0.99, 0.995), eps=1e-7, weight_decay=0.02,
                          alpha=4.0, t_alpha=6, t_beta3=5)),
}
BNB_WRAPPED = "__bnb_optimizer_quant_state__"


def bnb_state_dict(source, group=None, opt_bits=8, min_8bit_size=500):
    """The state dict bitsandbytes 0.50.2 saves (optim/optimizer.py, Optimizer8bit and
    Optimizer1State/Optimizer2State) for the float states of memfit optimizer ``source``
    (dequantized), parameter by parameter in its order: 'step' an int; 'state1' (and, for
    Adam, 'state2'), float32, or with ``opt_bits=8`` for tensors of at least
    ``min_8bit_size`` elements uint8 codes of the parameter's shape with 'absmax1'/'absmax2'
    (one per 256 elements, flat over the tensor) and 'qmap1'/'qmap2' (the signed and
    unsigned dynamic maps: memfit's 8-bit codes, which are bitsandbytes' map to within
    an ulp; the converter reads the dict's own; a one-state optimizer's 'qmap1' is the
    signed map, also for RMSprop's and Adagrad's second moments, as bitsandbytes'
    Optimizer1State has it); all but 'step' nested under
    __bnb_optimizer_quant_state__ (hidden from FSDP); param groups {lr, betas, eps,
    weight_decay} (and Adam's AdEMAMix keys), from BNB_HYPER or ``group``. AdEMAMix's
    'state1' stacks exp_avg and exp_avg_slow, (2, *shape), with 'absmax1' (2, blocks)."""
    kind = source._kind
    names = _core.STATE_NAMES[kind][:2 if kind in (_core.ADAMW, _core.ADAM, _core.ADEMAMIX) else 1]
    stacked = kind == _core.ADEMAMIX
    signed = _core.state_layout(kind, 8, 256, 0, 0.5)["signed"]
    state, ids = {}, []
    params = [p for g in source.param_groups for p in g["params"]]
    for pid, p in enumerate(params):
        ids.append(pid)
        floats = mo.dequantized_state(source, p)
        if not floats:
            continue
        inner = {}
        for k, nm in enumerate(names, start=1):
            x = floats[nm].contiguous()
            halves = 2 if stacked and k == 1 else 1
            if halves == 2:
                x = torch.stack([x, floats["exp_avg_slow"]])
            if opt_bits == 8 and p.numel() >= min_8bit_size:
                # Optimizer1State quantizes its state1 with the signed map ("dynamic")
                # whatever it holds (RMSprop's square_avg, Adagrad's sum); Optimizer2State
                # state2 with the unsigned one
                code_signed = signed[k - 1] or len(names) == 1
                code = torch.as_tensor(_core.code_table(8, code_signed))
                codes, absmax = _blocks.quantize_state(x, 8, code, 256, halves,
                                                       keep_positive=not signed[k - 1])
                absmax = absmax.reshape(halves, -1) if halves == 2 else absmax.reshape(-1)
                inner.update({f"state{k}": codes, f"absmax{k}": absmax,
                              f"qmap{k}": code.clone()})
            else:
                inner[f"state{k}"] = x
        state[pid] = {"step": int(source.state[p]["step"].item()), BNB_WRAPPED: inner}
    g = dict(BNB_HYPER[_core.ADAMW if kind == _core.ADAM else kind][0])
    g.update(group or {})
    return {"state": state, "param_groups": [{**g, "params": ids}]}


def bnb_floats(saved, k):
    """bitsandbytes' dequantization of state{k}: qmap[code] * absmax[i // 256], flat."""
    inner = saved[BNB_WRAPPED]
    s = inner[f"state{k}"]
    if s.dtype != torch.uint8:
        return s
    absmax = inner[f"absmax{k}"]
    if absmax.dim() == 2:  # AdEMAMix's stacked state1: each half its own blocks
        return torch.stack([bnb_floats({BNB_WRAPPED: {f"state{k}": s[h], f"absmax{k}": absmax[h],
                                                      f"qmap{k}": inner[f"qmap{k}"]}}, k)
                            for h in range(2)])
    flat = inner[f"qmap{k}"][s.reshape(-1).long()]
    flat = flat * absmax.repeat_interleave(256)[:flat.numel()]
    return flat.reshape(s.shape)


# memfit class, extra constructor keywords (momentum: RMSprop8bit then keeps two states)
BNB_TARGETS = [(mo.AdamW8bit, {}), (mo.Lion8bit, {}), (mo.SGD8bit, dict(momentum=0.5)),
               (mo.RMSprop8bit, {}), (mo.Adagrad8bit, dict(initial_accumulator_value=0.3))]


@pytest.mark.parametrize("cls,kw", BNB_TARGETS, ids=[c.__name__ for c, _ in BNB_TARGETS])
@pytest.mark.parametrize("bits", [8, 32])
def test_bitsandbytes_state_dict_of_every_kind_loads(cls, kw, bits):
    """bitsandbytes' AdamW, Lion, SGD and RMSprop dicts (8-bit and 32-bit) load: the
    hyperparameters as memfit.optim.bnb maps bitsandbytes' arguments, the states exactly
    quantize_state(bitsandbytes' dequantized values) (float32 ones bit for bit)."""
    _, source = trained(cls, 2, **kw)
    sd = bnb_state_dict(source, opt_bits=bits)
    m = model()
    opt = cls(m.parameters(), min_8bit_size=500, **kw)
    opt.load_state_dict(sd)
    g = opt.param_groups[0]
    want = BNB_HYPER[cls._kind][1]
    assert {k: (tuple(g[k]) if k == "betas" else g[k]) for k in want} == want
    assert g["bits"] == 8 and g["min_8bit_size"] == 500  # memfit's own keys stay the optimizer's
    quantized = 0
    for pid, p in enumerate(m.parameters()):
        names = _core.STATE_NAMES[cls._kind]
        floats = {nm: bnb_floats(sd["state"][pid], k) for k, nm in enumerate(names, start=1)
                  if f"state{k}" in sd["state"][pid][BNB_WRAPPED]}
        assert opt.state[p]["step"].item() == 2
        quantized += assert_quantized_from(opt, p, floats)
    assert quantized == 2 * len(_core.STATE_NAMES[cls._kind] if cls is not mo.RMSprop8bit else [1])
    train(m, opt, 1, seed=2)
    assert all(torch.isfinite(p).all() for p in m.parameters())


@pytest.mark.parametrize("cls", [mo.RMSprop8bit, mo.Adagrad8bit])
def test_bitsandbytes_one_state_second_moment_in_the_signed_map(cls):
    """bitsandbytes' RMSprop8bit and Adagrad8bit keep their second moment in the signed
    map (Optimizer1State's qmap1; issue 38, item 14): such a dict loads, its values read
    with the dict's own code (bnb_state_dict builds it so: the test above checks the
    values); a code that reads as a negative second moment is refused, nothing loaded."""
    _, source = trained(cls, 2)
    sd = bnb_state_dict(source)
    inner = next(s[BNB_WRAPPED] for s in sd["state"].values() if "qmap1" in s[BNB_WRAPPED])
    assert bool((inner["qmap1"] < 0).any())  # the signed map, as bitsandbytes saves it
    cls(model().parameters(), min_8bit_size=500).load_state_dict(sd)
    inner["state1"].view(-1)[0] = 0  # code 0 of the signed map: -1 (times the absmax)
    opt = cls(model().parameters(), min_8bit_size=500)
    with pytest.raises(_C.MemfitValueError, match="negative"):
        opt.load_state_dict(sd)
    assert not opt.state


@pytest.mark.parametrize("cls,kw", BNB_TARGETS, ids=[c.__name__ for c, _ in BNB_TARGETS])
def test_bitsandbytes_32bit_state_dict_resumes_bit_exactly(cls, kw):
    """A 32-bit bitsandbytes dict of a memfit run's states: loaded into a fresh optimizer
    with 32-bit groups, the next steps equal the source's own, bit for bit."""
    m_src = model()
    src = cls([{"params": list(m_src.parameters()), "bits": 32}], **kw)
    train(m_src, src, 2)
    sd = bnb_state_dict(src, {k: v for k, v in src.param_groups[0].items()
                              if k in ("lr", "eps", "weight_decay", "betas")} | (
        {"betas": (src.param_groups[0]["momentum"], src.param_groups[0]["dampening"])}
        if cls is mo.SGD8bit else {"betas": (src.param_groups[0]["alpha"], 0.0)}
        if cls is mo.RMSprop8bit else {}), opt_bits=32)
    m = clone_model(m_src)
    opt = cls([{"params": list(m.parameters()), "bits": 32}], **kw)
    opt.load_state_dict(sd)
    train(m_src, src, 2, seed=3)
    train(m, opt, 2, seed=3)
    for p, q in zip(m_src.parameters(), m.parameters()):
        assert torch.equal(p, q)
        assert all(torch.equal(v, opt.state[q][k]) for k, v in src.state[p].items())


def test_bitsandbytes_rmsprop_momentum_starts_a_zero_buffer():
    """bitsandbytes' RMSprop keeps betas=(alpha, momentum) and one state (its kernel
    applies no momentum); memfit's, as the shim's constructor, applies the momentum, with
    a buffer that starts at zero (as torch's RMSprop's does)."""
    _, source = trained(mo.RMSprop8bit, 2)
    sd = bnb_state_dict(source, {"betas": (0.9, 0.5)})
    m = model()
    opt = mo.RMSprop8bit(m.parameters(), min_8bit_size=500)
    opt.load_state_dict(sd)
    assert opt.param_groups[0]["momentum"] == 0.5
    for p in m.parameters():
        assert not mo.dequantized_state(opt, p)["momentum_buffer"].any()


def test_bitsandbytes_refusals_name_the_parameter_and_bitsandbytes():
    m, opt = trained(mo.AdamW8bit)
    good = bnb_state_dict(opt)

    def corrupt(key, fn, pid=0):
        sd = {**good, "state": {**good["state"]}}
        inner = dict(sd["state"][pid][BNB_WRAPPED])
        sd["state"][pid] = {**sd["state"][pid], BNB_WRAPPED: inner}
        if key == "step":
            sd["state"][pid]["step"] = fn(sd["state"][pid]["step"])
        else:
            inner[key] = fn(inner[key].clone())
        return sd

    def first(v, x):
        v.view(-1)[0] = x
        return v

    swapped = corrupt("qmap1", lambda q: good["state"][0][BNB_WRAPPED]["qmap2"].clone())
    swapped["state"][0][BNB_WRAPPED]["qmap2"] = good["state"][0][BNB_WRAPPED]["qmap1"].clone()
    for sd, match in [
        (corrupt("absmax2", lambda a: -a), r"absmax2 holds NaN, Inf or negative block scales"),
        (corrupt("absmax1", lambda a: first(a, float("nan"))), "absmax1 holds NaN, Inf or negative"),
        (swapped, r"qmap1 is an unsigned code, but state1 \(exp_avg\) is signed \(qmap1 and qmap2 swapped\?\)"),
        (corrupt("qmap2", lambda q: first(q, float("inf"))), "qmap2 holds NaN or values outside"),
        (corrupt("qmap2", lambda q: q[:255]), "qmap2 has 255 values, expected 256"),
        (corrupt("absmax1", lambda a: a[:5]), "absmax1 has 5 values, which no block size gives"),
        (corrupt("step", lambda s: float("nan")), r"'step' \(nan\) is not a whole number"),
    ]:
        assert_refused(opt, sd, f"{W0}: .*{match}")
    # a 32-bit state: a negative second moment, Inf anywhere
    b = r"param_groups\[0\]\['params'\]\[1\] \(shape \(96,\)\)"
    assert_refused(opt, corrupt("state2", lambda s: first(s, -1.0), pid=1),
                   rf"{b}: state 'state2' \(exp_avg_sq\) holds negative values")
    assert_refused(opt, corrupt("state1", lambda s: first(s, float("inf")), pid=1),
                   rf"{b}: state 'state1' \(exp_avg\) holds NaN or Inf")
    # kinds: one state and two states do not mix; a decoupled Adam dict needs an AdamW
    _, lion = trained(mo.Lion8bit)
    one_state = bnb_state_dict(lion)
    with pytest.raises(_C.MemfitValueError, match="one state per parameter .*bitsandbytes' Lion, SGD, RMSprop "
                                                  "or Adagrad.*AdamW8bit keeps exp_avg, exp_avg_sq") as e:
        opt.load_state_dict(one_state)
    assert "torch.optim" not in str(e.value)
    assert_refused(lion, good, r"two states per parameter \(state1, state2: bitsandbytes' Adam, AdamW "
                               r"or AdEMAMix\)")
    adam = mo.Adam8bit(m.parameters(), min_8bit_size=500)
    train(m, adam, 1)
    assert_refused(adam, good, r"param_groups\[0\] was saved by a bitsandbytes Adam or AdamW \(both "
                               r"decay decoupled\) with weight decay; Adam8bit applies weight decay as "
                               r"L2.*load it into memfit.optim.AdamW8bit instead")
    mo.Adam8bit(model().parameters(), min_8bit_size=500).load_state_dict(
        bnb_state_dict(opt, {"weight_decay": 0.0}))  # without decay the math is the same
    assert_refused(opt, bnb_state_dict(opt, {"alpha": 5.0}),
                   "AdEMAMix.*load it into memfit.optim.AdEMAMix8bit or AdEMAMix")
    assert_refused(opt, bnb_state_dict(opt, {"betas": (0.9, 0.99, 0.999)}),
                   "three betas: bitsandbytes' AdEMAMix; load it into memfit.optim.AdEMAMix8bit")


AD_KW = dict(betas=(0.8, 0.99, 0.995), alpha=4.0, t_alpha=6, t_beta3=5, lr=2e-3, eps=1e-7,
             weight_decay=0.02)


@pytest.mark.parametrize("cls", [mo.AdEMAMix8bit, mo.AdEMAMix])
def test_ademamix_to_torch_state_dict_and_back(cls):
    """torch has no AdEMAMix: to_torch_state_dict gives the three dequantized float32
    states under memfit's names, the step and bitsandbytes' group keys, and memfit's
    AdEMAMix classes load it back (mid-schedule): quantize_state of those floats, and for
    32-bit states a continuation bit-identical to the source's."""
    m, opt = trained(cls, 3, **AD_KW)
    sd = mo.to_torch_state_dict(opt)
    g = sd["param_groups"][0]
    assert {k: (tuple(v) if k == "betas" else v) for k, v in g.items() if k != "params"} == \
        {**AD_KW, "maximize": False}
    for pid, p in enumerate(m.parameters()):
        st, deq = sd["state"][pid], mo.dequantized_state(opt, p)
        assert set(st) == {"step", "exp_avg", "exp_avg_sq", "exp_avg_slow"}
        assert all(st[k].dtype == torch.float32 and torch.equal(st[k], deq[k]) for k in deq)
        assert st["step"].item() == 3
    m2 = clone_model(m)
    opt2 = cls(m2.parameters(), min_8bit_size=500)
    opt2.load_state_dict(sd)
    assert {k: opt2.param_groups[0][k] for k in ("alpha", "t_alpha", "t_beta3", "lr")} == \
        {k: AD_KW[k] for k in ("alpha", "t_alpha", "t_beta3", "lr")}
    quantized = sum(assert_quantized_from(opt2, q, sd["state"][pid])
                    for pid, q in enumerate(m2.parameters()))
    assert quantized == (6 if cls is mo.AdEMAMix8bit else 0)  # three states of two weights
    train(m, opt, 3, seed=2)
    train(m2, opt2, 3, seed=2)
    for p, q in zip(m.parameters(), m2.parameters()):
        assert torch.equal(p, q) if cls is mo.AdEMAMix else torch.isfinite(q).all()
    # a to_torch_state_dict without the step cannot resume the bias correction
    sd["state"][0].pop("step")
    assert_refused(opt2, sd, f"{W0}: has no state 'step'")


@pytest.mark.parametrize("bits", [8, 32])
def test_bitsandbytes_ademamix_state_dict_loads(bits):
    """bitsandbytes' AdEMAMix dict (state1: exp_avg and exp_avg_slow stacked, absmax1 one
    row per half) loads into AdEMAMix8bit with its hyperparameters; 32-bit states cross
    bit for bit. An Adam dict does not load into AdEMAMix8bit, nor this one into AdamW8bit."""
    _, source = trained(mo.AdEMAMix8bit, 2, **AD_KW)
    sd = bnb_state_dict(source, opt_bits=bits)
    assert tuple(sd["state"][0][BNB_WRAPPED]["state1"].shape) == (2, 96, 64)
    m = model()
    opt = mo.AdEMAMix8bit(m.parameters(), min_8bit_size=500)
    opt.load_state_dict(sd)
    g = opt.param_groups[0]
    want = BNB_HYPER[_core.ADEMAMIX][1]
    assert {k: (tuple(g[k]) if k == "betas" else g[k]) for k in want} == want
    for pid, p in enumerate(m.parameters()):
        s1 = bnb_floats(sd["state"][pid], 1)
        floats = {"exp_avg": s1[0], "exp_avg_slow": s1[1],
                  "exp_avg_sq": bnb_floats(sd["state"][pid], 2)}
        assert opt.state[p]["step"].item() == 2
        assert assert_quantized_from(opt, p, floats) == (3 if p.dim() == 2 else 0)
    train(m, opt, 1, seed=2)
    assert all(torch.isfinite(p).all() for p in m.parameters())
    _, adamw = trained(mo.AdamW8bit)
    assert_refused(opt, bnb_state_dict(adamw), r"not three betas.*two betas: bitsandbytes' Adam or AdamW")
    assert_refused(adamw, sd, "three betas: bitsandbytes' AdEMAMix; load it into memfit.optim.AdEMAMix8bit")
    bad = {**sd, "state": {**sd["state"], 0: {**sd["state"][0], BNB_WRAPPED: {
        **sd["state"][0][BNB_WRAPPED], "state1": sd["state"][0][BNB_WRAPPED]["state1"][0]}}}}
    assert_refused(opt, bad, rf"{W0}: state1 of bitsandbytes' AdEMAMix \(exp_avg and exp_avg_slow "
                             r"stacked\) has shape \(96, 64\), expected \(2, 96, 64\)")



def unwrapped(sd):
    """``sd`` as bitsandbytes 0.49.0 and 0.49.1 save it: the quantized states beside 'step'
    (0.49.2 nests them under __bnb_optimizer_quant_state__)."""
    return {**sd, "state": {pid: {**{k: v for k, v in s.items() if k != BNB_WRAPPED}, **s[BNB_WRAPPED]}
                            for pid, s in sd["state"].items()}}


BNB_049 = BNB_TARGETS + [(mo.AdEMAMix8bit, AD_KW)]


@pytest.mark.parametrize("cls,kw", BNB_049, ids=[c.__name__ for c, _ in BNB_049])
def test_bitsandbytes_049_unwrapped_state_dict_loads_as_the_wrapped_one(cls, kw):
    """bitsandbytes 0.49.0/0.49.1 dicts (states not nested) load to the same states, bit for
    bit, as the nested dicts of 0.49.2 and 0.50."""
    _, source = trained(cls, 2, **kw)
    sd = bnb_state_dict(source)
    flat = unwrapped(sd)
    assert "state1" in flat["state"][0] and BNB_WRAPPED not in flat["state"][0]
    ma, mb = model(), model()
    a, b = cls(ma.parameters(), min_8bit_size=500, **kw), cls(mb.parameters(), min_8bit_size=500, **kw)
    a.load_state_dict(sd)
    b.load_state_dict(flat)
    assert a.param_groups[0]["lr"] == b.param_groups[0]["lr"]
    for pa, pb in zip(ma.parameters(), mb.parameters()):
        sa, sb = a.state[pa], b.state[pb]
        assert sa.keys() == sb.keys() and "state1" in sa
        assert all(torch.equal(sa[k], sb[k]) for k in sa)


def test_bitsandbytes_049_non_blockwise_8bit_state_is_refused():
    """0.49's block_wise=False (LAMB's default there): one max per tensor ('max1',
    'new_max1', ...) instead of absmax blocks; refused, naming the key."""
    _, source = trained(mo.AdamW8bit, 2)
    sd = unwrapped(bnb_state_dict(source))
    s = sd["state"][0]
    for k in (1, 2):
        del s[f"absmax{k}"]
        s[f"max{k}"] = s[f"new_max{k}"] = torch.ones(1)
    assert_refused(trained(mo.AdamW8bit)[1], sd, rf"{W0}: bitsandbytes state 'max1' cannot be "
                                                 r"converted \(only block-wise 8-bit and 32-bit states\)")


@pytest.mark.parametrize("zero", [0, 0.0])
def test_bitsandbytes_ademamix_schedule_of_zero_loads_as_none(zero):
    """bitsandbytes 0.49.2 on reads t_alpha=0 / t_beta3=0 as no scheduler (``if t_alpha:``):
    its groups load with None; the states as with None."""
    _, source = trained(mo.AdEMAMix8bit, 2, **{**AD_KW, "t_alpha": None, "t_beta3": None})
    loaded = []
    for t in (zero, None):
        sd = bnb_state_dict(source, {"t_alpha": t, "t_beta3": t})
        m = model()
        opt = mo.AdEMAMix8bit(m.parameters(), min_8bit_size=500)
        opt.load_state_dict(sd)
        assert (opt.param_groups[0]["t_alpha"], opt.param_groups[0]["t_beta3"]) == (None, None)
        train(m, opt, 1, seed=2)
        loaded.append(list(m.parameters()))
    assert all(torch.equal(p, q) for p, q in zip(*loaded))
    bad = bnb_state_dict(source, {"t_alpha": -1})
    assert_refused(mo.AdEMAMix8bit(model().parameters(), min_8bit_size=500), bad,
                   r"t_alpha: expected None or a positive int")

def test_memfit_state_dicts_are_taken_by_the_math_not_the_class_name():
    """A memfit state dict loads into another memfit class of the same kind and bits
    (memfit.optim.bnb's shims: test_optim_bnb.py); otherwise the refusal says why."""
    m, a8 = trained(mo.AdamW8bit)
    sd = a8.state_dict()
    assert_refused(trained(mo.AdamW)[1], sd, r"param_groups\[0\] was saved by memfit.optim.AdamW8bit "
                                             r"with 8-bit states, and AdamW keeps 32-bit states")
    assert_refused(trained(mo.Lion8bit)[1], sd, r"saved by memfit.optim.AdamW8bit, which does AdamW "
                                                r"\(decoupled weight decay\), and Lion8bit does Lion")
    adam = trained(mo.Adam8bit, weight_decay=0.1)[1]
    assert_refused(adam, sd, r"saved by memfit.optim.AdamW8bit with weight decay; Adam8bit applies "
                             "weight decay as L2")
    assert_refused(a8, adam.state_dict(), r"saved by memfit.optim.Adam8bit with weight decay; "
                                          "AdamW8bit applies weight decay decoupled.*memfit.optim.Adam8bit")
    assert_refused(a8, {**sd, "memfit": {**sd["memfit"], "optimizer": "Adamw8bit"}},
                   "saved by memfit.optim.Adamw8bit, which is not a memfit optimizer class")
    # the same math: AdamW8bit's dict into an Adam8bit without decay, bit for bit
    plain = mo.Adam8bit(clone_model(m).parameters(), min_8bit_size=500)
    plain.load_state_dict(trained(mo.AdamW8bit, weight_decay=0.0)[1].state_dict())
    assert plain.param_groups[0]["weight_decay"] == 0.0


def test_group_mismatches_keep_torchs_words():
    m, opt = trained(mo.AdamW8bit)
    sd = torch_sd(torch.optim.AdamW, clone_model(m))
    assert_refused(opt, {**sd, "param_groups": sd["param_groups"] * 2},
                   r"loaded state dict has a different number of parameter groups \(2, the optimizer 1\)")
    g = sd["param_groups"][0]
    assert_refused(opt, {**sd, "param_groups": [{**g, "params": g["params"][:3]}]},
                   r"doesn't match the size of optimizer's group \(param_groups\[0\]: 3 parameters")
