"""AdEMAMix8bit and AdEMAMix (32-bit states) against a float64 NumPy reference of
bitsandbytes' AdEMAMix (its _ReferenceAdEMAMix and 32-bit kernel; the paper's update), with
and without the alpha and beta3 schedulers; the deterministic exp the beta3 scheduler
uses (csrc/include/memfit/numeric.h) against math.exp; state-dict round trips that resume
bit-exactly mid-schedule; bad arguments."""

import math
import shutil
import struct
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

import memfit.optim as mo
from memfit import MemfitValueError

ROOT = Path(__file__).resolve().parents[1]
STEPS = 20


def reference(p0, grads, lr, betas, alpha, t_alpha, t_beta3, eps, wd, maximize=False,
              bf16=False):
    """The parameter after len(grads) steps, in float64 (bf16: the parameter is rounded
    to bfloat16 after each step, as a nearest-rounding bfloat16 step stores it)."""
    b1, b2, b3 = betas
    p = p0.astype(np.float64)
    m1, m2, nu = (np.zeros_like(p) for _ in range(3))
    for t, g in enumerate(grads, start=1):
        g = -g.astype(np.float64) if maximize else g.astype(np.float64)
        alpha_t = min(t * alpha / t_alpha, alpha) if t_alpha else alpha
        if t_beta3:
            x = t / t_beta3
            lb1, lb3 = math.log(b1), math.log(b3)
            b3_t = min(math.exp(lb1 * lb3 / ((1 - x) * lb3 + x * lb1)), b3)
        else:
            b3_t = b3
        m1 = b1 * m1 + (1 - b1) * g
        m2 = b3_t * m2 + (1 - b3_t) * g
        nu = b2 * nu + (1 - b2) * g * g
        denom = np.sqrt(nu) / math.sqrt(1 - b2 ** t) + eps
        p = p * (1 - lr * wd) - lr * (m1 / (1 - b1 ** t) + alpha_t * m2) / denom
        if bf16:
            p = torch.from_numpy(p).to(torch.bfloat16).double().numpy()
    return p


def run(cls, p0, grads, dtype=torch.float32, **kw):
    p = torch.nn.Parameter(torch.from_numpy(p0.copy()).to(dtype))  # p0 stays as it is
    opt = cls([p], **kw)
    for g in grads:
        p.grad = torch.from_numpy(g).to(dtype)
        opt.step()
    return p.detach().double().numpy(), opt


def data(shape=(64, 96), seed=0):
    rng = np.random.default_rng(seed)
    p0 = rng.standard_normal(shape).astype(np.float32)
    # a gradient with a drift (the slow EMA sees it) plus noise
    drift = rng.standard_normal(shape).astype(np.float32)
    grads = [(0.5 * drift + rng.standard_normal(shape)).astype(np.float32) for _ in range(STEPS)]
    return p0, grads


# (t_alpha, t_beta3): no scheduler, each, both; smaller than STEPS, so both saturate
SCHEDULES = [(None, None), (8, None), (None, 8), (8, 12)]
HP = dict(lr=1e-2, betas=(0.9, 0.999, 0.9999), alpha=5.0, eps=1e-8)


@pytest.mark.parametrize("t_alpha,t_beta3", SCHEDULES)
@pytest.mark.parametrize("wd,maximize", [(0.0, False), (0.1, False), (1e-2, True)])
def test_ademamix32_matches_float64_reference(t_alpha, t_beta3, wd, maximize):
    p0, grads = data()
    kw = dict(HP, t_alpha=t_alpha, t_beta3=t_beta3, weight_decay=wd)
    got, opt = run(mo.AdEMAMix, p0, grads, maximize=maximize, **kw)
    ref = reference(p0, grads, kw["lr"], kw["betas"], kw["alpha"], t_alpha, t_beta3, kw["eps"],
                    wd, maximize)
    # float32 arithmetic over 20 steps: a few float32 ulps of the parameter
    np.testing.assert_allclose(got, ref, rtol=2e-6, atol=2e-6)
    # the update moved the parameter by about lr * (1 + alpha) per step: not a no-op
    assert np.abs(got - p0).max() > 0.5 * kw["lr"] * STEPS
    st = mo.dequantized_state(opt, opt.param_groups[0]["params"][0])
    assert set(st) == {"exp_avg", "exp_avg_sq", "exp_avg_slow"}


@pytest.mark.parametrize("t_alpha,t_beta3", SCHEDULES)
def test_ademamix8bit_within_bound(t_alpha, t_beta3):
    """8-bit states: each state is within half a code step of its block's value at every
    step, which moves the parameter by a few percent of the update. Bound (measured:
    3.1% and 1.2%): the distance to the float64 reference stays below 5% of the
    reference's largest move, and on average below 2% of its mean move."""
    p0, grads = data(seed=1)
    kw = dict(HP, t_alpha=t_alpha, t_beta3=t_beta3, weight_decay=1e-2)
    got, opt = run(mo.AdEMAMix8bit, p0, grads, **kw)
    ref = reference(p0, grads, kw["lr"], kw["betas"], kw["alpha"], t_alpha, t_beta3, kw["eps"],
                    1e-2)
    p = opt.param_groups[0]["params"][0]
    assert opt.state[p]["state1"].dtype == torch.uint8
    assert opt.state[p]["state3"].dtype == torch.uint8
    move = np.abs(ref - p0)
    err = np.abs(got - ref)
    assert err.max() <= 0.05 * move.max(), (err.max(), move.max())
    assert err.mean() <= 0.02 * move.mean(), (err.mean(), move.mean())
    # the 32-bit optimizer on the same data is much closer: the bound is the states'
    got32, _ = run(mo.AdEMAMix, p0, grads, **kw)
    assert np.abs(got32 - ref).max() < err.max()


def test_ademamix_bf16_params_nearest():
    p0, grads = data(seed=2)
    p0 = torch.from_numpy(p0).bfloat16().float().numpy()
    kw = dict(HP, t_alpha=8, t_beta3=12, weight_decay=1e-2)
    got, _ = run(mo.AdEMAMix, p0, grads, dtype=torch.bfloat16, bf16_stochastic_round=False, **kw)
    ref = reference(p0, grads, kw["lr"], kw["betas"], kw["alpha"], 8, 12, kw["eps"], 1e-2,
                    bf16=True)
    # each step rounds to bfloat16 (8 significant bits): a rounding that falls the other
    # way than the float64 reference's moves the parameter by one bfloat16 step, of the
    # size the parameter had then (up to lr * STEPS = 0.2 away: the floor of 1/8)
    ulp = np.exp2(np.floor(np.log2(np.maximum(np.abs(ref), 0.125))) - 7)
    assert (np.abs(got - ref) <= 2 * ulp).all()
    assert (np.abs(got - ref) <= ulp).mean() > 0.99


def test_ademamix_bf16_kahan_tracks_float32():
    p0, grads = data(seed=3)
    p0 = torch.from_numpy(p0).bfloat16().float().numpy()
    kw = dict(HP, t_alpha=8, t_beta3=12, weight_decay=1e-2)
    p = torch.nn.Parameter(torch.from_numpy(p0.copy()).bfloat16())
    opt = mo.AdEMAMix([p], kahan=True, **kw)
    for g in grads:
        p.grad = torch.from_numpy(g).bfloat16()
        opt.step()
    value = (p.detach().float() + opt.state[p]["kahan_comp"].float()).double().numpy()
    ref = reference(p0, [torch.from_numpy(g).bfloat16().float().numpy() for g in grads],
                    kw["lr"], kw["betas"], kw["alpha"], 8, 12, kw["eps"], 1e-2)
    # p + comp carries about 16 significant bits
    np.testing.assert_allclose(value, ref, rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("cls", [mo.AdEMAMix8bit, mo.AdEMAMix])
def test_state_dict_round_trip_mid_schedule_is_bit_exact(cls):
    p0, grads = data(seed=4)
    kw = dict(HP, t_alpha=15, t_beta3=15, weight_decay=1e-2)
    a = torch.nn.Parameter(torch.from_numpy(p0.copy()))
    opt_a = cls([a], **kw)
    for g in grads[:10]:
        a.grad = torch.from_numpy(g)
        opt_a.step()
    saved = opt_a.state_dict()
    b = torch.nn.Parameter(a.detach().clone())
    opt_b = cls([b], **HP)  # other schedules: the loaded groups bring theirs
    opt_b.load_state_dict(saved)
    assert opt_b.param_groups[0]["t_alpha"] == 15 and opt_b.param_groups[0]["t_beta3"] == 15
    for g in grads[10:]:
        for p, o in ((a, opt_a), (b, opt_b)):
            p.grad = torch.from_numpy(g)
            o.step()
    assert torch.equal(a, b)
    for key, value in opt_a.state[a].items():
        assert torch.equal(value, opt_b.state[b][key]), key


def _fresh(cls=mo.AdEMAMix8bit, **kw):
    return cls([torch.nn.Parameter(torch.zeros(64, 80))], **kw)


@pytest.mark.parametrize("kw,exc,match", [
    (dict(betas=(0.9, 0.999)), ValueError, "betas"),
    (dict(betas=(0.9, 0.999, 1.0)), ValueError, "betas.*index 2"),
    (dict(betas=(-0.1, 0.999, 0.9999)), ValueError, "betas.*index 0"),
    (dict(alpha=-1.0), ValueError, "alpha"),
    (dict(alpha=float("nan")), ValueError, "alpha"),
    (dict(t_alpha=0), ValueError, "t_alpha"),
    (dict(t_alpha=1.5), TypeError, "t_alpha"),
    (dict(t_beta3=-3), ValueError, "t_beta3"),
    (dict(t_beta3=True), TypeError, "t_beta3"),
    (dict(betas=(0.0, 0.999, 0.9999), t_beta3=10), ValueError, "betas.*t_beta3"),
    (dict(eps=-1e-8), ValueError, "eps"),
    (dict(lr=-1.0), ValueError, "lr"),
    (dict(weight_decay=-0.1), ValueError, "weight_decay"),
])
def test_bad_arguments(kw, exc, match):
    with pytest.raises(exc, match=match):
        _fresh(**kw)


def test_refused_step_changes_nothing():
    p = torch.nn.Parameter(torch.randn(64, 80))
    opt = mo.AdEMAMix8bit([p], t_alpha=5)
    p.grad = torch.randn_like(p)
    opt.step()
    before = p.detach().clone(), {k: v.clone() for k, v in opt.state[p].items()}
    opt.param_groups[0]["t_alpha"] = -1  # a broken schedule edit
    with pytest.raises(ValueError, match="t_alpha"):
        opt.step()
    assert torch.equal(p, before[0])
    for k, v in opt.state[p].items():
        assert torch.equal(v, before[1][k]), k


def test_beta1_zero_without_beta3_scheduler():
    """beta1 = 0 is allowed without t_beta3 (no logarithm taken): m1 is the gradient."""
    p0, grads = data(seed=5)
    kw = dict(lr=1e-2, betas=(0.0, 0.999, 0.9999), alpha=2.0, eps=1e-8)
    got, _ = run(mo.AdEMAMix, p0, grads[:5], weight_decay=0.0, **kw)
    ref = reference(p0, grads[:5], kw["lr"], kw["betas"], kw["alpha"], None, None, kw["eps"], 0.0)
    np.testing.assert_allclose(got, ref, rtol=2e-6, atol=2e-6)


# ---- the deterministic exp (numeric.h's mf_exp_f64) ----------------------------------

_EXP_PROGRAM = r"""
#include <stdio.h>
#include <string.h>
#include "memfit/numeric.h"
int main(void) {
  double x;
  while (fread(&x, sizeof x, 1, stdin) == 1) {
    double y = mf_exp_f64(x);
    fwrite(&y, sizeof y, 1, stdout);
  }
  return 0;
}
"""


def _ulps(a: float, b: float) -> int:
    ia = struct.unpack("<q", struct.pack("<d", a))[0]
    ib = struct.unpack("<q", struct.pack("<d", b))[0]
    return abs(ia - ib)


def test_exp_against_math_exp(tmp_path):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    src = tmp_path / "exp.c"
    src.write_text(_EXP_PROGRAM)
    exe = tmp_path / "exp"
    subprocess.run([cc, "-O2", "-ffp-contract=off", "-std=c11", f"-I{ROOT / 'csrc' / 'include'}",
                    str(src), "-o", str(exe)], check=True)
    rng = np.random.default_rng(0)
    # the scheduler's arguments lie in [ln(beta1), 0) (beta1 down to 1e-30), plus the
    # whole normal range and the edges
    xs = np.concatenate([rng.uniform(-70.0, 0.0, 20000), rng.uniform(-1e-3, 0.0, 2000),
                         rng.uniform(-700.0, 700.0, 5000),
                         np.array([0.0, -0.0, 1.0, -1.0, math.log(0.9), math.log(0.9999),
                                   0.5 * math.log(2), -0.5 * math.log(2), 709.7, -708.0])])
    out = subprocess.run([str(exe)], input=xs.astype("<f8").tobytes(), capture_output=True,
                         check=True).stdout
    ys = np.frombuffer(out, dtype="<f8")
    worst = max(_ulps(float(y), math.exp(float(x))) for x, y in zip(xs, ys))
    assert worst <= 2, worst
    specials = np.array([800.0, -800.0, float("nan"), float("inf"), float("-inf")])
    out = subprocess.run([str(exe)], input=specials.astype("<f8").tobytes(), capture_output=True,
                         check=True).stdout
    ys = np.frombuffer(out, dtype="<f8")
    assert ys[0] == math.inf and ys[1] == 0.0 and math.isnan(ys[2])
    assert ys[3] == math.inf and ys[4] == 0.0


@pytest.mark.parametrize("cls", [mo.AdEMAMix8bit, mo.AdEMAMix])
@pytest.mark.parametrize("key,value,match", [
    ("t_alpha", 10**400, r"t_alpha: an int of \d+ bits is too large"),
    ("t_beta3", 10**400, r"t_beta3: an int of \d+ bits is too large"),
    ("alpha", 1e39, r"alpha: 1e\+39 is beyond float32's range"),
    ("lr", 1e39, r"lr: 1e\+39 is beyond float32's range"),
    ("eps", -1e39, r"eps: -1e\+39 is beyond float32's range"),
])
def test_values_beyond_float32_are_refused_naming_them(cls, key, value, match):
    """A value the float32 states cannot represent (or that no double holds) is refused
    at construction and when a group edit reaches step(), naming it, with nothing
    changed (issue 38, item 15: a bare OverflowError, or training frozen silently). The
    schedules' step counts stay in double: t_alpha=10**39 is taken."""
    p = torch.nn.Parameter(torch.randn(64, 80))
    with pytest.raises(MemfitValueError, match=match):
        cls([p], **{key: value})
    cls([p], t_alpha=10**39, t_beta3=10**39)
    opt = cls([p], t_alpha=5)
    p.grad = torch.randn_like(p)
    opt.step()
    before = p.detach().clone(), {k: v.clone() for k, v in opt.state[p].items()}
    opt.param_groups[0][key] = value
    with pytest.raises(MemfitValueError, match=match):
        opt.step()
    assert torch.equal(p, before[0])
    assert all(torch.equal(v, before[1][k]) for k, v in opt.state[p].items())
