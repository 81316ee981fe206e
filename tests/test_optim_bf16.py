"""Pure-bf16 training: memfit's optimizers write bfloat16 (and float16) parameters with
stochastic rounding by default, so updates far below half a bfloat16 step are kept on
average instead of being rounded away; reproducible, resumable, and off on request."""

import pytest

torch = pytest.importorskip("torch")
import memfit.optim as mo  # noqa: E402

CLASSES = [mo.AdamW8bit, mo.AdamW4bit, mo.AdamW, mo.Lion8bit]
SHAPE = (64, 256)  # rows of whole blocks (8 bits: 256, 4 bits: 2 x 128)


def push(cls, sr, dtype=torch.bfloat16, steps=40, lr=1e-4, seed=0):
    """Steps a parameter of ones with a constant gradient: every element should move by
    about lr per step (Adam-like updates are ~lr; Lion's exactly lr)."""
    torch.manual_seed(seed)
    p = torch.nn.Parameter(torch.ones(SHAPE, dtype=dtype))
    opt = cls([p], lr=lr, weight_decay=0.0, bf16_stochastic_round=sr)
    for _ in range(steps):
        p.grad = -torch.ones_like(p)
        opt.step()
    assert opt.state[p]["state1"].dtype == (torch.float32 if cls is mo.AdamW else torch.uint8)
    return p


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_small_updates_survive_with_stochastic_rounding(cls):
    # the same run with float32 parameters is the target (1e-4 per step is 1/78 of a
    # bfloat16 step at 1.0; 4-bit states make the steps a little smaller than lr)
    target = push(cls, sr=True, dtype=torch.float32).float().mean().item()
    assert target > 1 + 40 * 0.5e-4
    rne = push(cls, sr=False).float()
    sr = push(cls, sr=True).float()
    assert torch.all(rne == 1.0), "nearest rounding loses every update"
    assert abs(sr.mean().item() - target) < 3e-4
    one = push(cls, sr=True, steps=1).float()
    assert set(one.unique().tolist()) == {1.0, 1.0078125}  # one step: only the two neighbours


def test_float16_parameters_too():
    target = 1 + 40 * 1e-5
    sr = push(mo.AdamW8bit, sr=True, dtype=torch.float16, lr=1e-5).float()
    assert torch.all(push(mo.AdamW8bit, sr=False, dtype=torch.float16, lr=1e-5).float() == 1.0)
    assert abs(sr.mean().item() - target) < 5e-5


def test_reproducible_and_seeded_per_group():
    a, b = push(mo.AdamW8bit, True), push(mo.AdamW8bit, True)
    assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    p = torch.nn.Parameter(torch.ones(SHAPE, dtype=torch.bfloat16))
    opt = mo.AdamW8bit([{"params": [p], "sr_seed": 123}], lr=1e-4, weight_decay=0.0)
    for _ in range(40):
        p.grad = -torch.ones_like(p)
        opt.step()
    assert not torch.equal(p.view(torch.int16), a.view(torch.int16))


def test_resume_is_bit_exact_with_stochastic_rounding():
    torch.manual_seed(1)
    p = torch.nn.Parameter(torch.randn(50, 100, dtype=torch.bfloat16))  # partial blocks
    opt = mo.AdamW8bit([p], lr=1e-3)
    for _ in range(3):
        p.grad = torch.randn_like(p)
        opt.step()
    sd = opt.state_dict()
    assert sd["param_groups"][0]["sr_step"] == 3
    assert sd["state"][0]["state1"].dtype == torch.uint8
    p2 = torch.nn.Parameter(p.detach().clone())
    opt2 = mo.AdamW8bit([p2], lr=1e-3)
    opt2.load_state_dict(sd)
    for _ in range(3):
        g = torch.randn_like(p)
        p.grad, p2.grad = g.clone(), g.clone()
        opt.step()
        opt2.step()
    assert torch.equal(p.view(torch.int16), p2.view(torch.int16))


def test_float32_parameters_are_unaffected():
    """Neither stochastic rounding nor Kahan (which needs no buffer for them) changes
    float32 parameters."""
    torch.manual_seed(2)
    x = torch.randn(20, 250)
    out = []
    for kw in ({"bf16_stochastic_round": True}, {"bf16_stochastic_round": False}, {"kahan": True}):
        p = torch.nn.Parameter(x.clone())
        opt = mo.AdamW8bit([p], lr=1e-3, **kw)
        for _ in range(3):
            p.grad = torch.ones_like(p)
            opt.step()
        assert "kahan_comp" not in opt.state[p] and "kahan_comp" not in mo.dequantized_state(opt, p)
        assert opt.state[p]["state1"].dtype == torch.uint8
        out.append(p.detach())
    assert torch.equal(out[0], out[1]) and torch.equal(out[0], out[2])


@pytest.mark.cuda
def test_cuda_matches_cpu():
    torch.manual_seed(3)
    x, g = torch.randn(280, 250).bfloat16(), (torch.randn(280, 250) * 0.01).bfloat16()
    res = []
    for dev in ("cpu", "cuda"):
        p = torch.nn.Parameter(x.clone().to(dev))
        opt = mo.AdamW8bit([p], lr=1e-3)
        p.grad = g.clone().to(dev)
        opt.step()
        res.append(p.detach().cpu())
    assert torch.equal(res[0].view(torch.int16), res[1].view(torch.int16))
