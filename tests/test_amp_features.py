"""What memfit's scaler adds to torch's (hysteresis, min/max scale, stats, warnings,
nonfinite_loss) and the helpers (precision, autocast, setup, GradAccumulator)."""

import warnings

import pytest
import torch

import memfit
import memfit.amp as amp

HAVE_CUDA = torch.cuda.is_available() and memfit.build_info()["cuda"]
cuda = [pytest.mark.cuda]  # tests/conftest.py skips these, with the reason, without a GPU
DEVICES = ["cpu", pytest.param("cuda", marks=cuda)]


class Loop:
    """One parameter, one optimizer; iteration(inf=...) injects a non-finite gradient."""

    def __init__(self, device="cpu", **scaler_kwargs):
        self.p = torch.nn.Parameter(torch.ones(4, device=device))
        self.opt = torch.optim.SGD([self.p], lr=0.01)
        self.s = amp.GradScaler(device=device, **scaler_kwargs)

    def iteration(self, inf=False, loss_value=None):
        self.opt.zero_grad()
        loss = (self.p * 2).sum()
        if loss_value is not None:  # NaN/Inf loss whose gradients are NaN/Inf too
            loss = loss * loss_value
        self.s.scale(loss).backward()
        if inf:
            with torch.no_grad():
                self.p.grad[1] = float("inf")
        self.s.step(self.opt)
        self.s.update()
        return self.s.get_scale()


@pytest.mark.parametrize("device", DEVICES)
def test_hysteresis_backs_off_only_after_n_consecutive(device):
    L = Loop(device, init_scale=64.0, growth_interval=1000, hysteresis=3)
    assert [L.iteration(inf=True) for _ in range(2)] == [64.0, 64.0]
    assert L.iteration(inf=False) == 64.0  # a finite step resets the count
    assert [L.iteration(inf=True) for _ in range(4)] == [64.0, 64.0, 32.0, 16.0]
    st = L.s.stats()
    assert st["skipped_steps"] == 6 and st["backoffs"] == 2 and st["longest_skip_streak"] == 4


def test_hysteresis_one_is_torch():
    ours = Loop(init_scale=256.0, growth_interval=2)
    ref_p = torch.nn.Parameter(torch.ones(4))
    ref_opt = torch.optim.SGD([ref_p], lr=0.01)
    ref = torch.amp.GradScaler("cpu", init_scale=256.0, growth_interval=2)
    pattern = [False, True, False, False, False, True, True, False, False, False]
    for inf in pattern:
        ref_opt.zero_grad()
        ref.scale((ref_p * 2).sum()).backward()
        if inf:
            with torch.no_grad():
                ref_p.grad[1] = float("inf")
        ref.step(ref_opt)
        ref.update()
        assert ours.iteration(inf) == ref.get_scale()
        assert ours.s._get_growth_tracker() == ref._get_growth_tracker()
    torch.testing.assert_close(ours.p, ref_p)


def test_min_scale_clamps_and_warns_once_per_streak():
    L = Loop(init_scale=8.0, growth_interval=1000, min_scale=2.0)
    with pytest.warns(amp.ScalerWarning, match="min_scale=2") as rec:
        scales = [L.iteration(inf=True) for _ in range(5)]
    assert scales == [4.0, 2.0, 2.0, 2.0, 2.0]
    assert sum("min_scale" in str(w.message) for w in rec) == 1
    assert L.s.stats()["min_scale_hits"] == 3


def test_max_scale_clamps_growth():
    L = Loop(init_scale=8.0, growth_interval=1, max_scale=20.0)
    assert [L.iteration() for _ in range(3)] == [16.0, 20.0, 20.0]
    st = L.s.stats()
    assert st["max_scale_hits"] == 2 and st["growths"] == 2


def test_bad_extras_rejected():
    for kw, match in ((dict(hysteresis=0), "hysteresis"), (dict(min_scale=-1.0), "min_scale"),
                      (dict(min_scale=4.0, max_scale=2.0), "min_scale"),
                      (dict(growth_interval=0), "growth_interval"),
                      (dict(init_scale=0.0), "init_scale"),
                      (dict(nonfinite_loss="ignore"), "nonfinite_loss"),
                      (dict(warn_after_skips=0), "warn_after_skips")):
        with pytest.raises(ValueError, match=match):
            amp.GradScaler("cpu", **kw)
    with pytest.raises(TypeError, match="growth_interval"):
        amp.GradScaler("cpu", growth_interval=2.5)
    s = amp.GradScaler("cpu")
    with pytest.raises(AssertionError, match="growth factor"):
        s.set_growth_factor(0.9)
    assert s.get_growth_factor() == 2.0  # unchanged after a refused set
    s.set_backoff_factor(0.25)
    s.set_growth_interval(5)
    assert (s.get_backoff_factor(), s.get_growth_interval()) == (0.25, 5)


def test_stats_history_and_skips():
    L = Loop(init_scale=16.0, growth_interval=2)
    pattern = [False, True, False, False, True]
    for inf in pattern:
        L.iteration(inf)
    st = L.s.stats()
    assert st["steps"] == 5 and st["skipped_steps"] == 2
    assert st["skip_rate"] == pytest.approx(0.4)
    assert st["skipped_recent"] == [1, 4]
    assert [h[1] for h in st["history"]] == [16.0, 16.0, 8.0, 8.0, 16.0]
    assert st["scale"] == 8.0 and st["consecutive_skipped"] == 1
    assert st["growths"] == 1 and st["backoffs"] == 2


def test_history_ring_keeps_the_last_240():
    L = Loop(init_scale=2.0**10, growth_interval=10**6)
    for i in range(250):
        L.iteration(inf=(i % 50 == 49))
    st = L.s.stats()
    assert st["steps"] == 250 and len(st["history"]) == 240
    assert st["history"][0][0] == 10 and st["history"][-1][0] == 249
    assert st["skipped_recent"] == [49, 99, 149, 199, 249]


def test_many_skips_in_a_row_warn():
    L = Loop(init_scale=2.0**20, growth_interval=1000, warn_after_skips=3)
    with pytest.warns(amp.ScalerWarning, match="3 optimizer steps in a row were skipped"):
        for _ in range(3):
            L.iteration(inf=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same streak does not warn again
        L.iteration(inf=True)


def test_scale_below_one_warns():
    L = Loop(init_scale=2.0, growth_interval=1000, warn_after_skips=None)
    with pytest.warns(amp.ScalerWarning, match="below 1"):
        for _ in range(3):
            L.iteration(inf=True)


def test_nonfinite_loss_warn_is_torch_plus_a_warning():
    L = Loop(init_scale=64.0, growth_interval=1000)
    before = L.p.detach().clone()
    with pytest.warns(amp.ScalerWarning, match="loss was already NaN/Inf before backward"):
        L.iteration(loss_value=float("nan"))
    assert L.s.get_scale() == 32.0  # backed off, as torch does
    torch.testing.assert_close(L.p.detach(), before)  # and skipped
    assert L.s.stats()["nonfinite_losses"] == 1


def test_nonfinite_loss_skip_keeps_the_scale():
    L = Loop(init_scale=64.0, growth_interval=2, nonfinite_loss="skip")
    L.iteration()
    before = L.p.detach().clone()
    with pytest.warns(amp.ScalerWarning, match="scale left as it was"):
        L.iteration(loss_value=float("inf"))
    assert L.s.get_scale() == 64.0 and L.s._get_growth_tracker() == 1
    torch.testing.assert_close(L.p.detach(), before)
    assert L.iteration() == 128.0  # the tracker was kept: grows on schedule
    st = L.s.stats()
    assert st["skipped_steps"] == 1 and st["backoffs"] == 0


def test_nonfinite_loss_skip_also_skips_when_grads_are_finite():
    # loss = finite part + inf constant: grads finite, loss not; "skip" must skip
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.1)
    s = amp.GradScaler("cpu", init_scale=8.0, nonfinite_loss="skip")
    s.scale(p.sum() + float("inf")).backward()
    with pytest.warns(amp.ScalerWarning):
        s.step(opt)
        s.update()
    torch.testing.assert_close(p.detach(), torch.ones(2))
    # fused optimizers are told through found_inf
    q = torch.nn.Parameter(torch.ones(2))
    fopt = torch.optim.AdamW([q], lr=0.1, fused=True)
    s.scale(q.sum() + float("inf")).backward()
    with pytest.warns(amp.ScalerWarning):
        s.step(fopt)
        s.update()
    torch.testing.assert_close(q.detach(), torch.ones(2))


def test_nonfinite_loss_raise():
    L = Loop(nonfinite_loss="raise", init_scale=8.0)
    with pytest.raises(FloatingPointError, match="before backward"):
        L.s.scale(torch.tensor(float("nan")))
    assert L.iteration() == 8.0  # finite losses pass


def test_stats_before_use_and_disabled():
    assert amp.GradScaler("cpu").stats()["steps"] == 0
    st = amp.GradScaler("cpu", enabled=False).stats()
    assert st["enabled"] is False and st["scale"] == 1.0


# ---- precision / autocast / setup ----------------------------------------------------------


@pytest.fixture
def cpu_bf16(monkeypatch):
    """A CPU on which memfit advises bf16 (native bf16 compute; forced here, so these tests
    run on every CPU: tests/test_hardware.py checks the advice itself)."""
    monkeypatch.setenv("MEMFIT_CPU_PRECISION", "bf16")


def test_precision_cpu(cpu_bf16):
    p = amp.precision("cpu")
    assert p == "bf16" and p.dtype is torch.bfloat16 and "range" in p.reason


@pytest.mark.parametrize("cap,name,expected", [
    ((7, 5), "Tesla T4", "fp16"), ((7, 0), "Tesla V100", "fp16"), ((8, 0), "A100", "bf16"),
    ((9, 0), "H100", "bf16"), ((6, 1), "GTX 1080", "fp32"), ((6, 0), "P100", "fp16")])
def test_precision_cuda_by_capability(monkeypatch, cap, name, expected):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: cap)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: name)
    p = amp.precision("cuda")
    assert p == expected and name in p.reason and f"{cap[0]}.{cap[1]}" in p.reason


def test_precision_cuda_unavailable(monkeypatch, cpu_bf16):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert amp.precision("cuda") == "fp32"
    assert amp.precision() == "bf16"  # default device is then the CPU


def test_autocast_cpu_reusable_and_nested(cpu_bf16):
    ctx = amp.autocast("cpu")
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    for _ in range(2):
        with ctx:
            assert (a @ b).dtype == torch.bfloat16
            with ctx:
                assert (a @ b).dtype == torch.bfloat16
            assert torch.is_autocast_enabled("cpu")
        assert not torch.is_autocast_enabled("cpu")
    with amp.autocast("cpu", dtype="fp32"):
        assert (a @ b).dtype == torch.float32
    with amp.autocast("cpu", dtype=torch.float16):
        assert (a @ b).dtype == torch.float16
    with pytest.raises(ValueError, match="precision"):
        amp.autocast("cpu", dtype="int8")


def test_setup_bf16_disables_scaler_and_says_so_once(monkeypatch, cpu_bf16):
    monkeypatch.setattr(amp.mixed_precision, "_bf16_notice_given", False)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.warns(amp.ScalerWarning, match="no loss scaling is needed"):
        ctx, scaler = amp.setup(model, opt)
    assert not scaler.is_enabled() and ctx.dtype is torch.bfloat16
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        amp.setup(model, opt, precision="bf16")  # once per process
    # the same loop runs with the disabled scaler
    x = torch.randn(2, 4)
    with ctx:
        loss = model(x).float().pow(2).mean()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()


def test_setup_fp16_gives_a_safer_scaler():
    model = torch.nn.Linear(4, 4)
    ctx, scaler = amp.setup(model, precision="fp16", hysteresis=2)
    assert scaler.is_enabled() and scaler.get_scale() == 2.0**10
    assert scaler._hysteresis == 2 and ctx.dtype is torch.float16
    _, s2 = amp.setup(model, precision="fp16", init_scale=256.0)
    assert s2.get_scale() == 256.0
    ctx32, s32 = amp.setup(model, precision="fp32")
    assert not s32.is_enabled() and not ctx32.enabled


# ---- gradient accumulation ------------------------------------------------------------------


def test_accumulator_flush_partial_is_a_mean():
    torch.manual_seed(5)
    xs = [torch.randn(3, 4) for _ in range(3)]
    model = torch.nn.Linear(4, 1)
    ref = torch.nn.Linear(4, 1)
    ref.load_state_dict(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.1)
    acc = amp.GradAccumulator(opt, steps=4)  # no scaler
    for x in xs:
        assert acc.backward(model(x).pow(2).mean()) is False
    assert acc.flush() is True and acc.micro == 0
    loss = sum(ref(x).pow(2).mean() for x in xs) / 3
    loss.backward()
    ropt.step()
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b)
        assert a.grad is None  # zero_grad(set_to_none=True)


def test_accumulator_with_scaler_and_clipping():
    torch.manual_seed(6)
    model = torch.nn.Linear(4, 2)
    ref = torch.nn.Linear(4, 2)
    ref.load_state_dict(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.5)
    scaler = amp.GradScaler("cpu", init_scale=1024.0)
    acc = amp.GradAccumulator(opt, steps=2, scaler=scaler, max_grad_norm=0.1)
    xs = [torch.randn(3, 4) * 10 for _ in range(2)]
    for x in xs:
        acc.backward(model(x).pow(2).mean())
    (sum(ref(x).pow(2).mean() for x in xs) / 2).backward()
    norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
    ropt.step()
    torch.testing.assert_close(acc.last_grad_norm, norm, rtol=1e-5, atol=0)
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_accumulator_sync_context_uses_no_sync():
    class FakeDDP:
        def __init__(self):
            self.entered = 0

        def no_sync(self):
            outer = self

            class Ctx:
                def __enter__(self):
                    outer.entered += 1

                def __exit__(self, *a):
                    return False

            return Ctx()

    m = FakeDDP()
    p = torch.nn.Parameter(torch.ones(2))
    acc = amp.GradAccumulator(torch.optim.SGD([p], lr=0.1), steps=3)
    for _ in range(3):
        with acc.sync_context(m):
            pass
        acc.backward(p.sum())
    assert m.entered == 2  # not on the boundary micro-batch
    with pytest.raises(ValueError, match="steps"):
        amp.GradAccumulator(acc.optimizer, steps=0)


@pytest.mark.cuda
def test_cuda_step_and_update_do_not_sync():
    # with a fused optimizer, unscale_/step/update queue work and never wait for the GPU
    p = torch.nn.Parameter(torch.randn(1000, device="cuda"))
    opt = torch.optim.AdamW([p], lr=0.01, fused=True)
    s = amp.GradScaler("cuda", init_scale=2.0**10, hysteresis=2, min_scale=1.0)
    for i in range(3):
        opt.zero_grad()
        s.scale((p * p).sum()).backward()
        torch.cuda.set_sync_debug_mode("error")
        try:
            s.step(opt)
            s.update()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    assert s.stats()["steps"] == 3


@pytest.mark.cuda
def test_cuda_scaler_matches_cpu_scaler():
    pattern = [False, True, True, False, False, True, False, False, False, True, True, True]
    results = []
    for device in ("cpu", "cuda"):
        L = Loop(device, init_scale=64.0, growth_interval=2, hysteresis=2, min_scale=8.0,
                 max_scale=256.0, warn_after_skips=None)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", amp.ScalerWarning)
            scales = [L.iteration(inf) for inf in pattern]
        st = L.s.stats()
        results.append((scales, {k: v for k, v in st.items() if k != "history"}, st["history"]))
    assert results[0] == results[1]


def test_old_import_paths_are_the_same_objects():
    # amp.py became a package and the matrix products moved under memfit.nn; every old
    # name must still be the very object the new home defines.
    import memfit._matmul
    import memfit.nn
    import memfit.nn.gemm
    from memfit.amp import clip, mixed_precision, scaler

    assert memfit._matmul is memfit.nn.gemm
    for name in ("matmul", "gemm_backend", "set_gemm_backend"):
        assert getattr(amp, name) is getattr(memfit.nn, name) is getattr(memfit.nn.gemm, name)
    assert amp.GradScaler is scaler.GradScaler and amp.OptState is scaler.OptState
    assert amp.clip_grad_norm_ is clip.clip_grad_norm_
    assert amp.precision is mixed_precision.precision and amp.setup is mixed_precision.setup
    for name in amp.__all__:
        assert getattr(amp, name) is not None


# ---- configuration errors echo the value given (issue 24 §6) --------------------------------

@pytest.mark.parametrize("kwargs,message", [
    ({"hysteresis": -1}, r"hysteresis: must be >= 1 .*got -1$"),
    ({"hysteresis": -2**40}, r"hysteresis: must be >= 1 .*got -1099511627776$"),
    ({"growth_interval": -1}, r"growth_interval: must be >= 1, got -1$"),
    ({"growth_interval": -2**33}, r"growth_interval: must be >= 1, got -8589934592$"),
    ({"growth_factor": 1e40}, r"growth_factor: .* got 1e\+40 \(inf in float32"),
    ({"growth_factor": 1 + 1e-9}, r"growth_factor: .* got 1.000000001 \(1.0 in float32"),
    ({"growth_factor": float("nan")}, r"growth_factor: .* got nan$"),
    ({"backoff_factor": 1 - 1e-9}, r"backoff_factor: .* got 0.999999999 \(1.0 in float32"),
    ({"backoff_factor": 1e-50}, r"backoff_factor: .* got 1e-50 \(0.0 in float32"),
    ({"min_scale": -1e-50}, r"min_scale: must be a finite number >= 0, got -1e-50$"),
    ({"min_scale": 1e40}, r"min_scale: .* got 1e\+40 \(inf in float32"),
    ({"max_scale": float("inf")}, r"max_scale: .* got inf$"),
    ({"min_scale": 2.5, "max_scale": 1.5}, r"min_scale: 2.5 is larger than max_scale 1.5$"),
    ({"init_scale": 1e40}, r"init_scale: must be a finite number > 0 within float32's range .*got 1e\+40$"),
    ({"init_scale": 1e-50}, r"init_scale: .*got 1e-50$"),
    ({"init_scale": -3.0}, r"init_scale: .*got -3.0$"),
])
def test_scaler_config_errors_echo_the_given_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        amp.GradScaler(device="cpu", **kwargs)


@pytest.mark.parametrize("setter,value,message", [
    ("set_growth_factor", 1e40, r"got 1e\+40 \(inf in float32"),
    ("set_backoff_factor", 1e-50, r"got 1e-50 \(0.0 in float32"),
    ("set_growth_interval", -7, r"got -7$"),
])
def test_scaler_setters_echo_the_given_value_and_keep_the_old_one(setter, value, message):
    s = amp.GradScaler(device="cpu")
    before = (s.get_growth_factor(), s.get_backoff_factor(), s.get_growth_interval())
    with pytest.raises(ValueError, match=message):
        getattr(s, setter)(value)
    assert (s.get_growth_factor(), s.get_backoff_factor(), s.get_growth_interval()) == before


@pytest.mark.parametrize("key,value,message", [
    ("scale", float("nan"), r"state_dict\['scale'\]: must be a finite number > 0 .*got nan"),
    ("scale", -1.0, r"state_dict\['scale'\]: .*got -1.0"),
    ("_growth_tracker", -1, r"state_dict\['_growth_tracker'\]: must be >= 0 and <= 2147483647, got -1"),
])
def test_scaler_load_state_dict_refuses_bad_values_before_changing_anything(key, value, message):
    s = amp.GradScaler(device="cpu", init_scale=8.0)
    sd = s.state_dict()
    sd[key] = value
    with pytest.raises(ValueError, match=message):
        s.load_state_dict(sd)
    assert s.get_scale() == 8.0 and s.state_dict() == amp.GradScaler(device="cpu", init_scale=8.0).state_dict()
