"""Kahan-compensated half-precision parameters (``kahan=True``): every optimizer keeps a
compensation buffer in the parameter's dtype, the update starts from ``p + comp``, and
``p = nearest(x_new)``, ``comp = nearest(x_new - p)`` (csrc/include/memfit/optim.h).

Checked here: one step of every optimizer against a float64 NumPy reference of the same
scheme (teacher-forced from memfit's own state), weight decay reading ``p + comp``,
small updates that nearest rounding loses and Kahan keeps, float16, float32 parameters
(no buffer; also tests/test_optim_bf16.py), state_dict round trip and bit-exact resume,
switching Kahan off and on, skipped steps and elements, the functional API and bad
input. CPU == CUDA bits: tests/test_optim.py::test_cpu_cuda_agree_bitwise (kahan=True)."""

import io

import numpy as np
import pytest

torch = pytest.importorskip("torch")
ml_dtypes = pytest.importorskip("ml_dtypes")
import memfit.optim as mo  # noqa: E402
from memfit.optim import functional as F  # noqa: E402

ALL = [mo.AdamW8bit, mo.Adam8bit, mo.Lion8bit, mo.SGD8bit, mo.RMSprop8bit, mo.AdamW4bit,
       mo.AdamW, mo.Adam, mo.Adagrad8bit, mo.Adagrad, mo.LAMB8bit, mo.LAMB, mo.LARS8bit, mo.LARS,
       mo.AdEMAMix8bit, mo.AdEMAMix]
HALF = [torch.bfloat16, torch.float16]
KIND = {mo.AdamW8bit: "adamw", mo.Adam8bit: "adam", mo.Lion8bit: "lion", mo.SGD8bit: "sgd",
        mo.RMSprop8bit: "rmsprop", mo.AdamW4bit: "adamw", mo.AdamW: "adamw", mo.Adam: "adam",
        mo.Adagrad8bit: "adagrad", mo.Adagrad: "adagrad",
        mo.LAMB8bit: "adamw", mo.LAMB: "adamw", mo.LARS8bit: "sgd", mo.LARS: "sgd",
        mo.AdEMAMix8bit: "ademamix", mo.AdEMAMix: "ademamix"}


def make(cls, params, **kw):
    if cls in (mo.SGD8bit, mo.LARS8bit, mo.LARS):
        kw.setdefault("momentum", 0.9)
        kw.setdefault("nesterov", True)
    if cls in (mo.LARS8bit, mo.LARS):
        # clips these tests' updates (||d|| = 0.42 .. 0.71 ||p||) at every step, but less
        # than LARS' default 0.02: updates that small leave the comp's bits to float32
        # rounding (measured: 6% of them differ from the reference at 0.1, 2.8% at 0.3)
        kw.setdefault("max_unorm", 0.3)
    if cls is mo.RMSprop8bit:
        kw.setdefault("momentum", 0.5)
    if cls in (mo.Adagrad8bit, mo.Adagrad):  # the state starts at a constant, not 0
        kw.setdefault("initial_accumulator_value", 0.1)
    return cls(params, **kw)


def value(opt, p):
    """p + kahan_comp in float64: the parameter's value."""
    return p.detach().double() + opt.state[p]["kahan_comp"].double()


def bits(t):
    return t.detach().view(torch.int16)


# ---- against a float64 reference of the same scheme --------------------------------

def ref_update(kind, group, x, g, st, t):
    """The optimizer's new value of x (float64) from float64 gradient g and states st
    (torch's names) at step number t, as torch's optimizers define it; with the group's
    max_unorm > 0 (LAMB, LARS), the update lr * u scaled by the trust ratio."""
    new = _update(kind, group, x, g, st, t)
    max_unorm = group.get("max_unorm", 0.0)
    if not max_unorm:
        return new
    decay = 1 - group["lr"] * group["weight_decay"] if kind == "adamw" else 1.0
    step = x * decay - new  # lr * u
    unorm = np.linalg.norm(step) / group["lr"]
    limit = max_unorm * np.linalg.norm(x)
    return x * decay - (limit / unorm if unorm > limit else 1.0) * step


def _update(kind, group, x, g, st, t):
    lr, wd = group["lr"], group["weight_decay"]
    if kind in ("adamw", "adam"):
        b1, b2 = group["betas"]
        if kind == "adam":
            g = g + wd * x
        m = b1 * st["exp_avg"] + (1 - b1) * g
        v = b2 * st["exp_avg_sq"] + (1 - b2) * g * g
        denom = np.sqrt(v) / np.sqrt(1 - b2**t) + group["eps"]
        decay = 1 - lr * wd if kind == "adamw" else 1.0
        return x * decay - lr / (1 - b1**t) * m / denom
    if kind == "ademamix":  # no schedulers (t_alpha, t_beta3 None): tests/test_optim_ademamix.py has them
        b1, b2, b3 = group["betas"]
        m1 = b1 * st["exp_avg"] + (1 - b1) * g
        m2 = b3 * st["exp_avg_slow"] + (1 - b3) * g
        v = b2 * st["exp_avg_sq"] + (1 - b2) * g * g
        denom = np.sqrt(v) / np.sqrt(1 - b2**t) + group["eps"]
        return x * (1 - lr * wd) - lr * (m1 / (1 - b1**t) + group["alpha"] * m2) / denom
    if kind == "lion":
        b1, _ = group["betas"]
        return x * (1 - lr * wd) - lr * np.sign(b1 * st["exp_avg"] + (1 - b1) * g)
    if kind == "sgd":
        mom = group["momentum"]
        g = g + wd * x
        m = g if t == 1 else mom * st["momentum_buffer"] + (1 - group["dampening"]) * g
        return x - lr * (g + mom * m if group["nesterov"] else m)
    if kind == "adagrad":
        g = g + wd * x
        clr = lr / (1 + (t - 1) * group["lr_decay"])
        return x - clr * g / (np.sqrt(st["sum"] + g * g) + group["eps"])
    g = g + wd * x  # rmsprop
    sq = group["alpha"] * st["square_avg"] + (1 - group["alpha"]) * g * g
    d = g / (np.sqrt(sq) + group["eps"])
    if group["momentum"]:
        d = group["momentum"] * st["momentum_buffer"] + d
    return x - lr * d


def split(x, np_dtype):
    """The Kahan split of float64 values: p = nearest(x), comp = nearest(x - p)."""
    p = x.astype(np_dtype)
    return p, (x - p.astype(np.float64)).astype(np_dtype)


@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("cls", ALL, ids=lambda c: c.__name__)
def test_one_step_matches_float64_reference(cls, dtype):
    """Each step, from memfit's own parameter, compensation and (dequantized) states:
    the new p + comp equals the float64 update to the precision of a pair of half
    floats, and p and comp have the reference's bits except next to rounding ties."""
    np_dtype = np.dtype(ml_dtypes.bfloat16) if dtype == torch.bfloat16 else np.dtype(np.float16)
    rtol = 2.0**-16 if dtype == torch.bfloat16 else 2.0**-20
    gen = torch.Generator().manual_seed(0)
    shape = (80, 250)  # rows of 250: a partial block per row
    n = 80 * 250
    p = torch.nn.Parameter((torch.randn(shape, generator=gen) * 0.5).to(dtype))
    opt = make(cls, [p], lr=1e-3, weight_decay=0.1, kahan=True, min_8bit_size=0)
    group = opt.param_groups[0]
    kind = KIND[cls]
    p_miss = c_miss = 0
    for _ in range(6):
        g = (torch.randn(shape, generator=gen) * 0.1).to(dtype)
        if opt.state[p]:
            x = value(opt, p).numpy()
            st = {k: v.double().numpy() for k, v in mo.dequantized_state(opt, p).items()}
            t = opt.state[p]["step"].item() + 1
        else:
            x, t = p.detach().double().numpy(), 1
            st = {"exp_avg": 0.0, "exp_avg_sq": 0.0, "momentum_buffer": 0.0, "square_avg": 0.0,
                  "sum": group.get("initial_accumulator_value", 0.0), "exp_avg_slow": 0.0}
        x_ref = ref_update(kind, group, x, g.double().numpy(), st, t)
        p.grad = g
        opt.step()
        assert "kahan_comp" in opt.state[p] and opt.state[p]["kahan_comp"].dtype == dtype
        if opt.param_groups[0]["bits"] != 32:
            assert opt.state[p]["state1"].dtype == torch.uint8
        got = value(opt, p).numpy()
        err = np.abs(got - x_ref)
        assert np.all(err <= rtol * np.abs(x_ref) + 1e-7), (err.max(), np.argmax(err))
        p_ref, c_ref = split(x_ref, np_dtype)
        p_miss += int(np.sum(p.detach().float().numpy() != p_ref.astype(np.float32)))
        c_miss += int(np.sum(opt.state[p]["kahan_comp"].float().numpy() != c_ref.astype(np.float32)))
    # float32 arithmetic differs from float64 by a few float32 ulps: that moves a value
    # across a rounding boundary of p (2^-8 relative) very rarely (measured: at most 13 of
    # 120000), of a small comp more often (bfloat16: 1.5-2.8%); a float16 comp is as fine
    # as float32's own rounding, so its bits are not compared (its value is, above)
    assert p_miss <= 6 * n * 1e-3, p_miss
    if dtype == torch.bfloat16:
        assert c_miss <= 6 * n * 0.05, c_miss


@pytest.mark.parametrize("cls", [mo.AdamW8bit, mo.AdamW, mo.SGD8bit], ids=lambda c: c.__name__)
def test_weight_decay_reads_param_plus_comp(cls):
    """With zero gradients and lr * weight_decay = 0.5, the update halves p + comp,
    which splits exactly into p / 2 and comp / 2 (decay applied to p alone would zero
    the compensation)."""
    torch.manual_seed(1)
    shape = (40, 125)
    p = torch.nn.Parameter(torch.randn(shape).bfloat16())
    kw = {"momentum": 0.0} if cls is mo.SGD8bit else {}
    opt = cls([p], lr=0.5, weight_decay=1.0, kahan=True, min_8bit_size=0, **kw)
    p.grad = torch.zeros_like(p)
    opt.step()  # creates the state; comp is 0, so this halves p exactly
    if cls is mo.AdamW8bit:  # (SGD8bit without momentum keeps no state)
        assert opt.state[p]["state1"].dtype == torch.uint8
    # comp = k/128 of a step of p, |k| < 32: below half a step even where p is a power
    # of two (the step below it is half as large), and p + comp is exact in float32 (a
    # comp far below p's last bit would be cut by the float32 sum)
    ulp = torch.ldexp(torch.ones(shape), torch.frexp(p.detach().float()).exponent - 8)
    comp = (torch.randint(-31, 32, shape) * ulp / 128).bfloat16()
    opt.state[p]["kahan_comp"].copy_(comp)
    before = p.detach().clone()
    opt.step()
    assert torch.equal(bits(p), bits((before.float() * 0.5).bfloat16()))
    assert torch.equal(bits(opt.state[p]["kahan_comp"]), bits((comp.float() * 0.5).bfloat16()))


# ---- what Kahan buys: small updates ---------------------------------------------------

def push(cls, dtype, steps, lr, rounding, shape=(32, 257)):
    """A constant gradient on parameters around 1 (values in [0.5, 1.5)): every step
    moves each element by about lr, far below half a step of dtype. Returns the final
    value (p + comp with Kahan) and the initial value, in float64. Rows of 257: a
    partial block per row (8 and 4 bits)."""
    gen = torch.Generator().manual_seed(0)
    x0 = (torch.rand(shape, generator=gen) + 0.5).bfloat16().double()  # exact in every dtype
    p = torch.nn.Parameter(x0.to(dtype))
    kw = {"kahan": True} if rounding == "kahan" else {"bf16_stochastic_round": rounding == "sr"}
    opt = make(cls, [p], lr=lr, weight_decay=0.0, **kw)
    for _ in range(steps):
        p.grad = -torch.ones_like(p)
        opt.step()
    if cls._bits != 32:  # the quantized states are what is tested
        assert opt.state[p]["state1"].dtype == torch.uint8
    x = p.detach().double()
    if "kahan_comp" in opt.state[p]:
        x = x + opt.state[p]["kahan_comp"].double()
    return x, x0


@pytest.mark.parametrize("cls", ALL, ids=lambda c: c.__name__)
def test_small_updates_accumulate_with_kahan(cls):
    # lr 1e-4 (SGD/RMSprop: 1e-5, their steps are ~10x lr here) is about 1/80 of a bfloat16
    # step at 1.0: nearest rounding loses every update, Kahan keeps them; the float32 run
    # is the target
    # (LARS: 1e-3, its ratio scales the steps by 0.3 here)
    lr = {mo.SGD8bit: 1e-5, mo.RMSprop8bit: 1e-5, mo.LARS8bit: 1e-3, mo.LARS: 1e-3}.get(cls, 1e-4)
    path = 300  # steps of about lr each
    if cls in (mo.Adagrad8bit, mo.Adagrad):
        # Adagrad's step k is lr / sqrt(0.1 + k) here: its first is below half a bfloat16
        # step too, and the path is about 34 of them
        lr = 5e-4
        path = sum(1 / np.sqrt(0.1 + k) for k in range(1, 301))
    target, x0 = push(cls, torch.float32, 300, lr, "nearest")
    moved = (target - x0).abs().min().item()
    assert moved > path * lr * 0.25
    rne, _ = push(cls, torch.bfloat16, 300, lr, "nearest")
    assert torch.equal(rne, x0), "nearest rounding loses every update"
    kahan, _ = push(cls, torch.bfloat16, 300, lr, "kahan")
    # the error is the compensation's own rounding (8 significant bits), a few % of the
    # path (measured: mean at most 3.0%, worst element 8.1% (RMSprop), 3.1% otherwise;
    # stochastic rounding: mean 35-64%, worst element 230-650%)
    err = (kahan - target).abs() / (target - x0).abs()
    assert err.mean().item() < 0.04 and err.max().item() < 0.1, (err.mean().item(), err.max().item())
    # and deterministic: the same run gives the same bits
    again, _ = push(cls, torch.bfloat16, 300, lr, "kahan")
    assert torch.equal(again, kahan)


def test_kahan_beats_stochastic_rounding_per_element():
    """Stochastic rounding is right on average; Kahan is right element by element."""
    target, x0 = push(mo.AdamW8bit, torch.float32, 200, 1e-4, "nearest")
    sr, _ = push(mo.AdamW8bit, torch.bfloat16, 200, 1e-4, "sr")
    kahan, _ = push(mo.AdamW8bit, torch.bfloat16, 200, 1e-4, "kahan")
    assert (kahan - target).abs().max() < 0.1 * (sr - target).abs().max()


def test_float16_parameters():
    target, x0 = push(mo.AdamW8bit, torch.float32, 300, 1e-5, "nearest")
    rne, _ = push(mo.AdamW8bit, torch.float16, 300, 1e-5, "nearest")
    kahan, _ = push(mo.AdamW8bit, torch.float16, 300, 1e-5, "kahan")
    assert (rne - x0).abs().max() < 1e-2 * (target - x0).abs().min()  # float16 loses them too
    # float16's 11 significant bits make the compensation ~8x finer than bfloat16's
    assert ((kahan - target).abs() / (target - x0).abs()).max().item() < 0.01


def test_mixed_groups_and_dtypes():
    """kahan per param group; bf16 and fp32 parameters in one Kahan group."""
    torch.manual_seed(3)
    a = torch.nn.Parameter(torch.randn(20, 250).bfloat16())
    b = torch.nn.Parameter(torch.randn(20, 250))
    c = torch.nn.Parameter(torch.randn(20, 250).bfloat16())
    opt = mo.AdamW8bit([{"params": [a, b], "kahan": True}, {"params": [c]}], lr=1e-3)
    for q in (a, b, c):
        q.grad = torch.randn_like(q)
    opt.step()
    assert "kahan_comp" in opt.state[a] and "kahan_comp" not in opt.state[b]
    assert "kahan_comp" not in opt.state[c]  # stochastic rounding in the default group
    assert opt.state[a]["kahan_comp"].abs().max() > 0
    assert all(opt.state[q]["state1"].dtype == torch.uint8 for q in (a, b, c))


# ---- state dict ------------------------------------------------------------------------

def model(seed=0, dtype=torch.bfloat16):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Tanh(), torch.nn.Linear(96, 10))
    return m.to(dtype)


def train(m, opt, steps, seed=1):
    gen = torch.Generator().manual_seed(seed)
    dtype = next(m.parameters()).dtype
    for _ in range(steps):
        x = torch.randn(32, 64, generator=gen).to(dtype)
        y = torch.randint(0, 10, (32,), generator=gen)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(m(x).float(), y).backward()
        opt.step()


def snapshot(m, opt):
    return ([bits(p).clone() for p in m.parameters()],
            [{k: v.clone() for k, v in opt.state[p].items()} for p in m.parameters()])


@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("cls", ALL, ids=lambda c: c.__name__)
def test_state_dict_round_trip_and_bit_exact_resume(cls, dtype):
    m = model(dtype=dtype)
    opt = make(cls, m.parameters(), lr=1e-2, min_8bit_size=1000, kahan=True)
    train(m, opt, 3)
    buf = io.BytesIO()
    torch.save({"model": m.state_dict(), "opt": opt.state_dict()}, buf)
    sd = opt.state_dict()
    assert all(s["kahan_comp"].dtype == dtype for s in sd["state"].values())
    assert sd["param_groups"][0]["kahan"] is True
    train(m, opt, 4, seed=7)
    uninterrupted = snapshot(m, opt)

    buf.seek(0)
    ck = torch.load(buf, weights_only=True)
    m2 = model(seed=99, dtype=dtype)
    m2.load_state_dict(ck["model"])
    opt2 = make(cls, m2.parameters(), lr=1e-2, min_8bit_size=1000)  # kahan comes from the dict
    opt2.load_state_dict(ck["opt"])
    assert opt2.param_groups[0]["kahan"] is True
    train(m2, opt2, 4, seed=7)
    resumed = snapshot(m2, opt2)
    for x, y in zip(uninterrupted[0], resumed[0]):
        assert torch.equal(x, y)
    for sx, sy in zip(uninterrupted[1], resumed[1]):
        assert sx.keys() == sy.keys() and "kahan_comp" in sx
        for k in sx:
            assert torch.equal(sx[k], sy[k]), k


def test_state_dict_refuses_bad_comp():
    m = model()
    opt = mo.AdamW8bit(m.parameters(), kahan=True, min_8bit_size=1000)
    train(m, opt, 1)
    sd = opt.state_dict()
    sd["state"][0]["kahan_comp"] = sd["state"][0]["kahan_comp"].float()
    with pytest.raises(ValueError, match="kahan_comp"):
        mo.AdamW8bit(model().parameters(), kahan=True, min_8bit_size=1000).load_state_dict(sd)


def test_dequantized_state_has_comp():
    m = model()
    opt = mo.Lion8bit(m.parameters(), kahan=True, min_8bit_size=1000)
    train(m, opt, 2)
    w = m[0].weight
    st = mo.dequantized_state(opt, w)
    assert set(st) == {"exp_avg", "kahan_comp"}
    assert st["kahan_comp"].dtype == torch.float32 and st["kahan_comp"].shape == w.shape
    assert torch.equal(st["kahan_comp"], opt.state[w]["kahan_comp"].float())


def test_switching_kahan_off_drops_the_buffer():
    """p is always the nearest value of p + comp, so turning Kahan off just drops the
    buffer (and the state dict stays loadable); turning it back on starts from zero."""
    p = torch.nn.Parameter(torch.ones(5000, dtype=torch.bfloat16))
    opt = mo.AdamW([p], lr=1e-4, weight_decay=0.0, kahan=True)
    for _ in range(45):
        p.grad = -torch.ones_like(p)
        opt.step()
    x = value(opt, p)
    assert torch.equal(p.detach(), x.to(torch.bfloat16)) and torch.all(p > 1.0)
    before = p.detach().clone()
    opt.param_groups[0].update(kahan=False, bf16_stochastic_round=False, lr=0.0)
    p.grad = torch.zeros_like(p)
    opt.step()
    assert "kahan_comp" not in opt.state[p]
    assert torch.equal(bits(p), bits(before))
    mo.AdamW([p]).load_state_dict(opt.state_dict())
    opt.param_groups[0].update(kahan=True)
    opt.step()
    assert torch.equal(opt.state[p]["kahan_comp"], torch.zeros_like(p))


# ---- skipped steps and elements ---------------------------------------------------------

def test_skipped_step_and_nonfinite_elements_keep_the_value():
    torch.manual_seed(4)
    p = torch.nn.Parameter(torch.randn(50, 100).bfloat16())
    opt = mo.AdamW8bit([p], lr=1e-3, kahan=True, min_8bit_size=0)
    p.grad = torch.randn_like(p)
    opt.step()
    assert opt.state[p]["state1"].dtype == torch.uint8
    x = value(opt, p)
    comp = opt.state[p]["kahan_comp"].clone()
    before = p.detach().clone()
    # GradScaler's found_inf: nothing moves
    opt.grad_scale, opt.found_inf = torch.ones(1), torch.ones(1)
    opt.step()
    del opt.grad_scale, opt.found_inf
    assert torch.equal(bits(p), bits(before)) and torch.equal(bits(opt.state[p]["kahan_comp"]), bits(comp))
    # NaN gradients: those elements keep p + comp
    g = torch.randn_like(p)
    g.view(-1)[::7] = float("nan")
    p.grad = g
    opt.step()
    assert torch.equal(value(opt, p).view(-1)[::7], x.view(-1)[::7])
    assert not torch.equal(value(opt, p).view(-1)[1::7], x.view(-1)[1::7])
    assert torch.isfinite(opt.state[p]["kahan_comp"].float()).all()


# ---- functional API ----------------------------------------------------------------------

@pytest.mark.parametrize("kind,bits_,cls", [("adamw", 8, mo.AdamW8bit), ("adamw", 32, mo.AdamW),
                                            ("sgd", 8, mo.SGD8bit), ("adamw", 4, mo.AdamW4bit)])
def test_functional_matches_optimizer(kind, bits_, cls):
    rng = np.random.default_rng(5)
    shape = (41, 244)  # rows of 244: a partial block per row (8 bits: 256, 4 bits: 128 + 116)
    p_np = rng.standard_normal(shape).astype(ml_dtypes.bfloat16)
    p_t = torch.nn.Parameter(torch.from_numpy(p_np.astype(np.float32)).bfloat16())
    opt = cls([p_t], lr=1e-2, min_8bit_size=0, kahan=True,
              **({"momentum": 0.9} if cls is mo.SGD8bit else {}))
    g0 = opt.param_groups[0]
    hp = {k: g0[k] for k in ("lr", "weight_decay", "eps", "momentum", "dampening", "nesterov")
          if k in g0}
    if "betas" in g0:
        hp["beta1"], hp["beta2"] = g0["betas"]
    st = F.init(kind, p_np, bits_, momentum=hp.get("momentum", 0.0), kahan=True)
    assert st["kahan_comp"].dtype == p_np.dtype and st["kahan_comp"].shape == (p_np.size,)  # flat
    for _ in range(3):
        g = (rng.standard_normal(shape) * 0.01).astype(ml_dtypes.bfloat16)
        p_t.grad = torch.from_numpy(g.astype(np.float32)).bfloat16()
        opt.step()
        F.step(kind, p_np, g, st, **hp)
    np.testing.assert_array_equal(p_np.view(np.int16), bits(p_t).numpy())
    np.testing.assert_array_equal(st["kahan_comp"].view(np.int16),
                                  bits(opt.state[p_t]["kahan_comp"]).reshape(-1).numpy())
    for k in ("state1", "absmax1", "state2", "absmax2"):
        if st[k] is not None:
            np.testing.assert_array_equal(st[k], opt.state[p_t][k].reshape(-1).numpy())


def test_functional_helpers_take_kahan():
    p = np.ones(300, np.float16)
    for init in (F.adamw8bit_init, F.adam8bit_init, F.adamw4bit_init, F.adamw_init, F.adam_init,
                 F.lion8bit_init, F.sgd8bit_init, F.rmsprop8bit_init):
        assert init(p, kahan=True)["kahan_comp"].dtype == np.float16
        assert init(p)["kahan_comp"] is None
        assert init(p.astype(np.float32), kahan=True)["kahan_comp"] is None  # float32: none needed
    st = F.adamw_init(p, kahan=True)
    for _ in range(20):
        F.adamw_step(p, -np.ones_like(p), st, lr=1e-5, weight_decay=0.0)
    assert np.all(p == 1.0)
    assert np.allclose(p.astype(np.float64) + st["kahan_comp"], 1 + 20e-5, rtol=0, atol=2e-6)


# ---- bad input ---------------------------------------------------------------------------

def test_kahan_with_stochastic_rounding_is_refused():
    p = torch.nn.Parameter(torch.ones(10, dtype=torch.bfloat16))
    for cls in ALL:
        with pytest.raises(ValueError, match="kahan=True and bf16_stochastic_round=True"):
            make(cls, [p], lr=1e-3, kahan=True, bf16_stochastic_round=True)
        make(cls, [p], lr=1e-3, kahan=True)  # stochastic rounding defaults to off with kahan
        make(cls, [p], lr=1e-3, kahan=True, bf16_stochastic_round=False)
    with pytest.raises(ValueError, match="kahan=True and bf16_stochastic_round=True"):
        mo.AdamW8bit([{"params": [p], "kahan": True, "bf16_stochastic_round": True}])
    opt = mo.AdamW8bit([p])
    with pytest.raises(ValueError, match="kahan=True and bf16_stochastic_round=True"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(3))], "kahan": True,
                             "bf16_stochastic_round": True})
    # the functional API: a compensation buffer with a stochastic-rounding seed
    q = np.ones(300, ml_dtypes.bfloat16)
    st = F.adamw8bit_init(q, kahan=True)
    with pytest.raises(ValueError, match="Kahan compensation and stochastic rounding"):
        F.step("adamw", q, q, st, lr=1e-3, beta1=0.9, beta2=0.999, sr_seed=7)


def test_wrong_types_are_refused():
    p = torch.nn.Parameter(torch.ones(10, dtype=torch.bfloat16))
    for bad in ("yes", None, 1):
        with pytest.raises(TypeError, match="kahan: expected True or False"):
            mo.AdamW8bit([p], kahan=bad)
    with pytest.raises(TypeError, match="kahan: expected True or False"):
        F.adamw8bit_init(np.ones(300, np.float16), kahan="yes")
    q = np.ones(300, ml_dtypes.bfloat16)
    st = F.adamw8bit_init(q, kahan=True)
    st["kahan_comp"] = np.zeros(300, np.float32)  # not the parameter's dtype
    with pytest.raises(TypeError, match="comps"):
        F.adamw8bit_step(q, q, st)
    st["kahan_comp"] = np.zeros(299, ml_dtypes.bfloat16)
    with pytest.raises(ValueError, match="comps"):
        F.adamw8bit_step(q, q, st)
    r = np.ones(300, np.float32)  # float32 parameters take no buffer
    st = F.adamw8bit_init(r)
    st["kahan_comp"] = np.zeros(300, np.float32)
    with pytest.raises(ValueError, match="only for float16/bfloat16"):
        F.adamw8bit_step(r, r, st)
