"""memfit.amp.GradScaler against torch's own grad-scaling tests (test_torch.py /
test_cuda.py: _run_scaling_case, clipping, accumulation, penalty, multiple models and
optimizers, state_dict, overflow), on the CPU, plus CUDA versions marked `cuda`.

Each scenario runs with memfit's scaler and, as a control of the test itself, with
torch.amp.GradScaler: both must pass the same assertions.
"""

import functools
import itertools
import pickle
from functools import partial

import pytest
import torch

import memfit
import memfit.amp as amp

HAVE_CUDA = torch.cuda.is_available() and memfit.build_info()["cuda"]
cuda = [pytest.mark.cuda]  # tests/conftest.py skips these, with the reason, without a GPU

IMPLS = {"memfit": amp.GradScaler, "torch": torch.amp.GradScaler}
DEVICES = ["cpu", pytest.param("cuda", marks=cuda)]


def make_models(device, optimizer_ctor=torch.optim.SGD, optimizer_kwargs=None):
    mod_control = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)).to(device)
    mod_scaling = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)).to(device)
    with torch.no_grad():
        for c, s in zip(mod_control.parameters(), mod_scaling.parameters()):
            s.copy_(c)
    kwargs = {"lr": 1.0}
    kwargs.update(optimizer_kwargs or {})
    return (mod_control, mod_scaling, optimizer_ctor(mod_control.parameters(), **kwargs),
            optimizer_ctor(mod_scaling.parameters(), **kwargs))


def make_case(device, optimizer_ctor=torch.optim.SGD, optimizer_kwargs=None):
    data = [(torch.randn(8, 8, device=device), torch.randn(8, 8, device=device))
            for _ in range(4)]
    return make_models(device, optimizer_ctor, optimizer_kwargs) + (data, torch.nn.MSELoss(), 2)


def run_scaling_case(impl, device, run, unskipped, skipped, atol=1e-7,
                     optimizer_ctor=torch.optim.SGD, optimizer_kwargs=None, compare_grads=True):
    torch.manual_seed(0)
    for enabled in (True, False):
        mc, ms, oc, os_, data, loss_fn, skip_iter = make_case(device, optimizer_ctor, optimizer_kwargs)
        scaler = IMPLS[impl](device=device, init_scale=128.0, growth_factor=2.0,
                             enabled=enabled, growth_interval=1)
        run(device, data, mc, oc, scaler, loss_fn, skip_iter, False)
        ret = run(device, data, ms, os_, scaler, loss_fn, skip_iter, True)
        scaler = ret if ret else scaler
        if enabled:
            net_growth = scaler.get_growth_factor() ** unskipped if unskipped > 0 else 1.0
            net_backoff = scaler.get_backoff_factor() ** skipped if skipped > 0 else 1.0
            assert scaler.get_scale() == 128.0 * net_growth * net_backoff
        else:
            assert scaler.get_scale() == 1.0
        for c, s in zip(mc.parameters(), ms.parameters()):
            if compare_grads:
                torch.testing.assert_close(c.grad, s.grad, atol=atol, rtol=1e-5)
            c_state, s_state = oc.state[c], os_.state[s]
            for k in c_state:
                torch.testing.assert_close(c_state[k], s_state[k], atol=atol, rtol=1e-5, msg=k)
            torch.testing.assert_close(c, s, atol=atol, rtol=1e-5)


def inject_inf(model):
    with torch.no_grad():
        model[1].weight.grad.fill_(float("inf"))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("device", DEVICES)
def test_skipped_steps_and_final_scale(impl, device):
    def run(device, data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):
        for i, (x, y) in enumerate(data):
            optimizer.zero_grad()
            loss = loss_fn(model(x), y)
            if try_scaling_api:
                scaler.scale(loss).backward()
                if i == skip_iter and scaler.is_enabled():
                    inject_inf(model)
                scaler.step(optimizer)
                scaler.update()
            else:
                loss.backward()
                if not scaler.is_enabled() or i != skip_iter:
                    optimizer.step()

    run_scaling_case(impl, device, run, unskipped=3, skipped=1)


# torch's optimizers: plain, foreach, and the fused AdamW that takes grad_scale/found_inf
OPTIMIZERS = [
    (torch.optim.SGD, {"momentum": 0.9}),
    (torch.optim.AdamW, {"lr": 0.01, "foreach": False}),
    (torch.optim.AdamW, {"lr": 0.01, "foreach": True}),
    (torch.optim.AdamW, {"lr": 0.01, "fused": True}),
    (torch.optim.Adam, {"lr": 0.01, "fused": True}),
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("ctor,kwargs", OPTIMIZERS, ids=lambda v: getattr(v, "__name__", str(v)))
def test_torch_optimizers_with_injected_inf(impl, ctor, kwargs):
    def run(device, data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):
        for i, (x, y) in enumerate(data):
            optimizer.zero_grad()
            loss = loss_fn(model(x), y)
            if try_scaling_api:
                scaler.scale(loss).backward()
                if i == skip_iter and scaler.is_enabled():
                    inject_inf(model)
                scaler.step(optimizer)
                scaler.update()
            else:
                loss.backward()
                if not scaler.is_enabled() or i != skip_iter:
                    optimizer.step()

    run_scaling_case(impl, "cpu", run, unskipped=3, skipped=1, atol=1e-5,
                     optimizer_ctor=ctor, optimizer_kwargs=kwargs)


@pytest.mark.parametrize("impl", IMPLS)
def test_fused_optimizer_after_explicit_unscale(impl):
    # unscale_ then step: the fused optimizer gets grad_scale=None and found_inf
    def run(device, data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):
        for i, (x, y) in enumerate(data):
            optimizer.zero_grad()
            loss = loss_fn(model(x), y)
            if try_scaling_api:
                scaler.scale(loss).backward()
                if i == skip_iter and scaler.is_enabled():
                    inject_inf(model)
                scaler.unscale_(optimizer)
                scaler.step(optimizer)
                scaler.update()
            else:
                loss.backward()
                if not scaler.is_enabled() or i != skip_iter:
                    optimizer.step()

    run_scaling_case(impl, "cpu", run, unskipped=3, skipped=1, atol=1e-5,
                     optimizer_ctor=torch.optim.AdamW, optimizer_kwargs={"lr": 0.01, "fused": True})


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("device", DEVICES)
def test_clipping(impl, device):
    def run(device, data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):
        max_norm = 0.2
        for i, (x, y) in enumerate(data):
            optimizer.zero_grad()
            loss = loss_fn(model(x), y)
            if try_scaling_api:
                scaler.scale(loss).backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm * scaler.get_scale())
                if i == skip_iter and scaler.is_enabled():
                    inject_inf(model)
                scaler.step(optimizer)
                scaler.update()
            else:
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
                if not scaler.is_enabled() or i != skip_iter:
                    optimizer.step()

    run_scaling_case(impl, device, run, unskipped=3, skipped=1, atol=1e-5)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("clip", ["torch", "memfit"])
def test_clipping_separate_unscale(impl, clip):
    def run(device, data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):
        max_norm = 0.2
        clip_fn = torch.nn.utils.clip_grad_norm_ if clip == "torch" else amp.clip_grad_norm_
        for i, (x, y) in enumerate(data):
            optimizer.zero_grad()
            loss = loss_fn(model(x), y)
            if try_scaling_api:
                scaler.scale(loss).backward()
                if i == skip_iter and scaler.is_enabled():
                    inject_inf(model)
                scaler.unscale_(optimizer)
                clip_fn(model.parameters(), max_norm, error_if_nonfinite=False)
                scaler.step(optimizer)
                scaler.update()
            else:
                loss.backward()
                clip_fn(model.parameters(), max_norm)
                if not scaler.is_enabled() or i != skip_iter:
                    optimizer.step()

    run_scaling_case(impl, "cpu", run, unskipped=3, skipped=1, atol=1e-5)


def test_clip_with_scaler_argument_unscales_once():
    # memfit's clip_grad_norm_(..., scaler=, optimizer=) unscales through the scaler
    def run(device, data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):
        for i, (x, y) in enumerate(data):
            optimizer.zero_grad()
            loss = loss_fn(model(x), y)
            if try_scaling_api:
                scaler.scale(loss).backward()
                if i == skip_iter and scaler.is_enabled():
                    inject_inf(model)
                amp.clip_grad_norm_(model.parameters(), 0.2, scaler=scaler, optimizer=optimizer)
                scaler.step(optimizer)
                scaler.update()
            else:
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.2)
                if not scaler.is_enabled() or i != skip_iter:
                    optimizer.step()

    run_scaling_case("memfit", "cpu", run, unskipped=3, skipped=1, atol=1e-5)


@pytest.mark.parametrize("impl", IMPLS)
def test_penalty(impl):
    def run(device, data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):
        for i, (x, y) in enumerate(data):
            optimizer.zero_grad()
            loss = loss_fn(model(x), y)
            if try_scaling_api:
                grad_params = torch.autograd.grad(scaler.scale(loss), model.parameters(),
                                                  create_graph=True)
                inv_scale = 1.0 / scaler.get_scale()
                grad_params = [p * inv_scale for p in grad_params]
            else:
                grad_params = torch.autograd.grad(loss, model.parameters(), create_graph=True)
            grad_norm = sum(g.pow(2).sum() for g in grad_params).sqrt()
            loss = loss + grad_norm
            if try_scaling_api:
                scaler.scale(loss).backward()
                if i == skip_iter and scaler.is_enabled():
                    inject_inf(model)
                scaler.step(optimizer)
                scaler.update()
            else:
                loss.backward()
                if not scaler.is_enabled() or i != skip_iter:
                    optimizer.step()

    run_scaling_case(impl, "cpu", run, unskipped=3, skipped=1, atol=1e-5)


@pytest.mark.parametrize("impl", IMPLS)
def test_accumulation(impl):
    def run(device, data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):
        iters = 2
        for i, (x, y) in enumerate(data):
            loss = loss_fn(model(x), y) / iters
            if try_scaling_api:
                scaler.scale(loss).backward()
            else:
                loss.backward()
            if i % iters == iters - 1:
                if try_scaling_api:
                    scaler.step(optimizer)
                    scaler.update()
                else:
                    optimizer.step()
                optimizer.zero_grad()

    run_scaling_case(impl, "cpu", run, unskipped=2, skipped=0)


def test_grad_accumulator_helper_matches_manual_loop():
    def run(device, data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):
        if try_scaling_api:
            acc = amp.GradAccumulator(optimizer, steps=2, scaler=scaler)
            stepped = [acc.backward(loss_fn(model(x), y)) for x, y in data]
            assert stepped == [False, True, False, True]
            assert acc.optimizer_steps == 2 and not acc.flush()
        else:
            for i, (x, y) in enumerate(data):
                (loss_fn(model(x), y) / 2).backward()
                if i % 2 == 1:
                    optimizer.step()
                    optimizer.zero_grad()

    run_scaling_case("memfit", "cpu", run, unskipped=2, skipped=0)


@pytest.mark.parametrize("impl", IMPLS)
def test_autocast_fp16_cpu(impl):
    def run(device, data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):
        for i, (x, y) in enumerate(data):
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16, enabled=try_scaling_api):
                loss = loss_fn(model(x), y)
            if try_scaling_api:
                scaler.scale(loss).backward()
                if i == skip_iter and scaler.is_enabled():
                    inject_inf(model)
                scaler.step(optimizer)
                scaler.update()
            else:
                loss.backward()
                if not scaler.is_enabled() or i != skip_iter:
                    optimizer.step()

    run_scaling_case(impl, "cpu", run, unskipped=3, skipped=1, atol=1e-3)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("device", DEVICES)
def test_multiple_models_and_optimizers(impl, device):
    torch.manual_seed(1)
    for enabled in (True, False):
        mc0, ms0, oc0, os0, data, loss_fn, skip_iter = make_case(device)
        mc1, ms1, oc1, os1 = make_models(device)
        scaler = IMPLS[impl](device=device, init_scale=128.0, growth_factor=2.0,
                             enabled=enabled, growth_interval=1)

        def run(model0, model1, optimizer0, optimizer1, try_scaling_api):
            for i, (x, y) in enumerate(data):
                optimizer0.zero_grad()
                optimizer1.zero_grad()
                out0, out1 = model0(x), model1(x)
                loss0 = loss_fn(0.3 * out0 + 0.7 * out1, y)
                loss1 = loss_fn(0.6 * out0 - 0.4 * out1, y)
                if try_scaling_api:
                    scaler.scale(loss0).backward(retain_graph=True)
                    scaler.scale(loss1).backward()
                    if i == skip_iter and scaler.is_enabled():
                        inject_inf(model1)
                    scaler.unscale_(optimizer0)  # stress: one optimizer unscaled separately
                    scaler.step(optimizer0)
                    scaler.step(optimizer1)
                    scaler.update()
                else:
                    loss0.backward(retain_graph=True)
                    loss1.backward()
                    optimizer0.step()
                    if not scaler.is_enabled() or i != skip_iter:
                        optimizer1.step()

        run(mc0, mc1, oc0, oc1, False)
        run(ms0, ms1, os0, os1, True)
        expected = 128.0 * 2.0**3 * 0.5 if enabled else 1.0
        assert scaler.get_scale() == expected
        for c, s in zip(itertools.chain(mc0.parameters(), mc1.parameters()),
                        itertools.chain(ms0.parameters(), ms1.parameters())):
            torch.testing.assert_close(c, s, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("device", DEVICES)
def test_growth_interval_one_and_update_rule(impl, device):
    # torch's test_grad_scaling_update_scale, through the public API
    s = IMPLS[impl](device=device, init_scale=4.0, growth_factor=2.0, backoff_factor=0.25,
                    growth_interval=2)
    p = torch.nn.Parameter(torch.ones(3, device=device))
    opt = torch.optim.SGD([p], lr=0.0)

    def iteration(inf):
        opt.zero_grad()
        s.scale((p * 1.0).sum()).backward()
        if inf:
            with torch.no_grad():
                p.grad[0] = float("inf")
        s.step(opt)
        s.update()

    iteration(False)
    assert (s._get_growth_tracker(), s.get_scale()) == (1, 4.0)
    iteration(False)
    assert (s._get_growth_tracker(), s.get_scale()) == (0, 8.0)
    iteration(True)
    assert (s._get_growth_tracker(), s.get_scale()) == (0, 2.0)


@pytest.mark.parametrize("impl", IMPLS)
def test_scale_will_not_overflow(impl):
    torch.manual_seed(2)
    model = torch.nn.Linear(5, 1)
    optimizer = torch.optim.Adam(model.parameters())
    scaler = IMPLS[impl](device="cpu", growth_interval=1, growth_factor=2**4, init_scale=1e38)
    x, y = torch.randn(1, 5), 1e-30 * torch.randn(1, 1)
    scaler.scale(((model(x) - y) ** 2).mean()).backward()
    scaler.step(optimizer)
    scaler.update()
    scale = scaler.get_scale()
    assert scale == pytest.approx(1e38, rel=1e-6)  # stayed: 1e38 * 16 overflows float32
    assert scale != float("inf") and scale == scale


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("device", DEVICES)
def test_scale_nested_outputs(impl, device):
    scaler = IMPLS[impl](device=device, init_scale=2.0)
    t = torch.full((1,), 4.0, device=device)
    outputs = (t.clone(), (t.clone(), t.clone()), [t.clone(), (t.clone(), t.clone())])
    outputs = scaler.scale(outputs)
    assert isinstance(outputs, tuple) and isinstance(outputs[2], list)
    flat = [outputs[0], *outputs[1], outputs[2][0], *outputs[2][1]]
    assert all(v.item() == 8.0 for v in flat)
    assert scaler._scale.device == t.device
    gen = scaler.scale(iter([t.clone(), t.clone()]))
    assert [v.item() for v in gen] == [8.0, 8.0]
    with pytest.raises(ValueError):
        scaler.scale([t.clone(), 3.0])


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("lazy_init", [True, False])
def test_state_dict(impl, lazy_init):
    S = partial(IMPLS[impl], device="cpu")
    s0 = S(init_scale=3.0, growth_factor=4.0, backoff_factor=0.5, growth_interval=2)
    s1 = S(init_scale=6.0, growth_factor=7.0, backoff_factor=0.8, growth_interval=1)
    s1._init_growth_tracker = 7  # a value load_state_dict must overwrite
    if lazy_init:
        s1.scale(torch.full((1,), 4.0))
    s1.load_state_dict(s0.state_dict())
    assert s1.get_scale() == 3.0
    assert s1.get_growth_factor() == 4.0
    assert s1.get_backoff_factor() == 0.5
    assert s1.get_growth_interval() == 2
    assert s1._init_growth_tracker == 0
    assert set(s0.state_dict()) == {"scale", "growth_factor", "backoff_factor",
                                     "growth_interval", "_growth_tracker"}


def test_state_dict_round_trips_with_torch():
    m = amp.GradScaler("cpu", init_scale=512.0, growth_interval=3)
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.1)
    m.scale(p.sum()).backward()
    m.step(opt)
    m.update()
    t = torch.amp.GradScaler("cpu")
    t.load_state_dict(m.state_dict())
    assert t.state_dict() == m.state_dict()
    assert m.state_dict()["_growth_tracker"] == 1
    back = amp.GradScaler("cpu")
    back.load_state_dict(t.state_dict())
    assert back.state_dict() == m.state_dict()


@pytest.mark.parametrize("impl", IMPLS)
def test_load_empty_state_dict_raises(impl):
    with pytest.raises(RuntimeError, match="empty"):
        IMPLS[impl](device="cpu").load_state_dict({})
    IMPLS[impl](device="cpu", enabled=False).load_state_dict({})  # disabled: no-op
    assert IMPLS[impl](device="cpu", enabled=False).state_dict() == {}


@pytest.mark.parametrize("impl", IMPLS)
def test_pickle_between_iterations(impl):
    s = IMPLS[impl](device="cpu", init_scale=64.0, growth_interval=2)
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.1)
    s.scale(p.sum()).backward()
    s.step(opt)
    with pytest.raises(AssertionError, match="pickled"):
        pickle.dumps(s)  # mid-iteration
    s.update()
    s2 = pickle.loads(pickle.dumps(s))
    assert s2.get_scale() == 64.0 and s2._get_growth_tracker() == 1
    opt.zero_grad()
    s2.scale(p.sum()).backward()
    s2.step(opt)
    s2.update()
    assert s2.get_scale() == 128.0
    if impl == "memfit":  # the statistics survive the round trip
        assert s2.stats()["steps"] == 2


@pytest.mark.parametrize("impl", IMPLS)
def test_misuse_raises_like_torch(impl):
    S = partial(IMPLS[impl], device="cpu")
    with pytest.raises(AssertionError):
        S(growth_factor=1.0)
    with pytest.raises(AssertionError):
        S(backoff_factor=1.0)
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.1)
    s = S()
    for fn in (lambda: s.unscale_(opt), lambda: s.step(opt), lambda: s.update()):
        with pytest.raises(AssertionError):  # before scale()
            fn()
    s.scale(p.sum()).backward()
    with pytest.raises(RuntimeError, match="Closure"):
        s.step(opt, closure=lambda: None)
    s.unscale_(opt)
    with pytest.raises(RuntimeError, match="already been called"):
        s.unscale_(opt)
    s.step(opt)
    with pytest.raises(RuntimeError, match="already been called"):
        s.step(opt)
    with pytest.raises(RuntimeError, match="after step"):
        s.unscale_(opt)
    s.update()
    with pytest.raises(AssertionError, match="No inf checks"):
        s.update()  # nothing stepped since the last update
    # fp16 gradients are refused by unscale_, as torch does
    h = torch.nn.Parameter(torch.ones(2, dtype=torch.float16))
    oh = torch.optim.SGD([h], lr=0.1)
    h.grad = torch.ones(2, dtype=torch.float16)
    with pytest.raises(ValueError, match="FP16"):
        s.unscale_(oh)


@pytest.mark.parametrize("impl", IMPLS)
def test_new_scale(impl):
    s = IMPLS[impl](device="cpu", init_scale=8.0)
    p = torch.nn.Parameter(torch.ones(2))
    s.scale(p.sum())
    s.update(4.0)
    assert s.get_scale() == 4.0
    s.update(torch.tensor(32.0))
    assert s.get_scale() == 32.0
    if impl == "memfit":  # torch documents "1-element" but only takes 0-d tensors
        s.update(torch.tensor([16.0]))
        assert s.get_scale() == 16.0
    for bad in (torch.tensor([1.0, 2.0]), torch.tensor([2.0], requires_grad=True)):
        with pytest.raises(AssertionError):
            s.update(bad)
    if HAVE_CUDA:
        with pytest.raises(AssertionError):
            s.update(torch.tensor([2.0], device="cuda"))


@pytest.mark.parametrize("impl", IMPLS)
def test_disabled_passes_through(impl):
    s = IMPLS[impl](device="cpu", enabled=False)
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.5)
    loss = p.sum()
    assert s.scale(loss) is loss
    loss.backward()
    s.unscale_(opt)
    s.step(opt)
    s.update()
    assert s.get_scale() == 1.0 and not s.is_enabled()
    torch.testing.assert_close(p.detach(), torch.full((2,), 0.5))


def test_cuda_scaler_without_cuda_disables_like_torch():
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    with pytest.warns(UserWarning, match="CUDA is not available"):
        s = amp.GradScaler()
    assert not s.is_enabled()


class RecordingOptimizer(torch.optim.Optimizer):
    """Plain SGD that takes the fused protocol: reads grad_scale/found_inf."""

    _step_supports_amp_scaling = True

    def __init__(self, params, lr):
        super().__init__(params, {"lr": lr})
        self.seen = []

    @torch.no_grad()
    def step(self, closure=None):
        gs, fi = getattr(self, "grad_scale", None), getattr(self, "found_inf", None)
        self.seen.append((None if gs is None else gs.item(), fi.item()))
        if fi.item() != 0:
            return None
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is not None:
                    p.sub_(g["lr"] * (p.grad if gs is None else p.grad / gs))
        return "stepped"


@pytest.mark.parametrize("impl", IMPLS)
def test_fused_protocol_attributes(impl):
    s = IMPLS[impl](device="cpu", init_scale=16.0, growth_interval=100)
    p = torch.nn.Parameter(torch.ones(3))
    opt = RecordingOptimizer([p], lr=1.0)
    for i in range(3):
        opt.zero_grad()
        s.scale((p * 2).sum()).backward()
        if i == 1:
            with torch.no_grad():
                p.grad[0] = float("nan")
        if i == 2:
            s.unscale_(opt)
        s.step(opt)
        s.update()
        assert not hasattr(opt, "grad_scale") and not hasattr(opt, "found_inf")
    # READY: the scale and found_inf; NaN: found_inf 1; after unscale_: grad_scale None
    assert opt.seen == [(16.0, 0.0), (16.0, 1.0), (None, 0.0)]
    assert s.get_scale() == 8.0
    torch.testing.assert_close(p.detach(), torch.full((3,), -3.0))


def _memfit_optimizers():
    try:
        import memfit.optim as mo
    except ImportError:
        return []
    out = []
    for name in ("Adam", "AdamW", "Adam8bit", "AdamW8bit", "AdamW4bit", "Lion8bit",
                 "SGD8bit", "RMSprop8bit", "Adagrad8bit", "AdEMAMix8bit", "LAMB8bit", "LARS8bit"):
        cls = getattr(mo, name, None)
        if cls is not None:
            if name == "LARS8bit":  # momentum=0 raises NotImplementedError, as bitsandbytes'
                cls = functools.partial(cls, momentum=0.9)
            out.append(pytest.param(cls, id=name))
    return out


MEMFIT_OPTS = _memfit_optimizers()


@pytest.mark.skipif(not MEMFIT_OPTS, reason="memfit.optim is not on this branch yet (issue 3)")
@pytest.mark.parametrize("ctor", MEMFIT_OPTS or [None])
def test_memfit_optimizers(ctor):
    def run(device, data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):
        for i, (x, y) in enumerate(data):
            optimizer.zero_grad()
            loss = loss_fn(model(x), y)
            if try_scaling_api:
                scaler.scale(loss).backward()
                if i == skip_iter and scaler.is_enabled():
                    inject_inf(model)
                scaler.step(optimizer)
                scaler.update()
            else:
                loss.backward()
                if not scaler.is_enabled() or i != skip_iter:
                    optimizer.step()

    # memfit's optimizers take grad_scale/found_inf and unscale inside the kernel without
    # writing the unscaled gradient back (torch's fused kernels do write it back), so
    # .grad is not compared; the parameters and the optimizer states are.
    run_scaling_case("memfit", "cpu", run, unskipped=3, skipped=1, atol=1e-4,
                     optimizer_ctor=ctor, optimizer_kwargs={"lr": 1e-3}, compare_grads=False)


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("lazy_init", [False, True])
@pytest.mark.parametrize("change,error,message", [
    # a bad value in any field, beside good new values in the others (which must not load)
    ({"growth_interval": 0}, ValueError, r"state_dict\['growth_interval'\]: must be >= 1, got 0$"),
    ({"growth_interval": -5}, ValueError, r"state_dict\['growth_interval'\]: .*got -5$"),
    ({"growth_interval": 2.5}, TypeError, r"state_dict\['growth_interval'\]: expected an int, got float"),
    ({"growth_interval": NAN}, TypeError, r"state_dict\['growth_interval'\]: expected an int"),
    ({"growth_interval": "10"}, TypeError, r"state_dict\['growth_interval'\]: expected an int, got str"),
    ({"growth_interval": True}, TypeError, r"state_dict\['growth_interval'\]: expected an int, got bool"),
    ({"backoff_factor": 1.5}, ValueError, r"state_dict\['backoff_factor'\]: .*must be < 1.0 .*got 1.5$"),
    ({"backoff_factor": NAN}, ValueError, r"state_dict\['backoff_factor'\]: .*got nan$"),
    ({"backoff_factor": 0.0}, ValueError, r"state_dict\['backoff_factor'\]: .*got 0.0$"),
    ({"backoff_factor": "abc"}, TypeError, r"state_dict\['backoff_factor'\]: expected a number, got str"),
    ({"backoff_factor": None}, TypeError, r"state_dict\['backoff_factor'\]: expected a number"),
    ({"growth_factor": 1.0}, ValueError, r"state_dict\['growth_factor'\]: .*must be > 1.0, got 1.0$"),
    ({"growth_factor": INF}, ValueError, r"state_dict\['growth_factor'\]: .*got inf$"),
    ({"growth_factor": 1e40}, ValueError, r"state_dict\['growth_factor'\]: .*got 1e\+40 \(inf in float32"),
    ({"growth_factor": [2.0]}, TypeError, r"state_dict\['growth_factor'\]: expected a number, got list"),
    ({"scale": INF}, ValueError, r"state_dict\['scale'\]: must be a finite number > 0"),
    ({"scale": "1"}, TypeError, r"state_dict\['scale'\]: expected a number, got str"),
    ({"_growth_tracker": 2**31}, ValueError, r"state_dict\['_growth_tracker'\]: .*<= 2147483647, got 2147483648$"),
    ({"_growth_tracker": 1.0}, TypeError, r"state_dict\['_growth_tracker'\]: expected an int, got float"),
    # a missing key: KeyError, as torch raises (which changes some fields first)
    ({"growth_interval": None, "_drop": "growth_interval"}, KeyError, r"missing 'growth_interval'"),
    ({"_drop": "_growth_tracker"}, KeyError, r"missing '_growth_tracker'"),
])
def test_load_state_dict_refuses_any_bad_field_before_changing_anything(lazy_init, change, error, message):
    s = amp.GradScaler(device="cpu", init_scale=8.0, growth_factor=3.0, backoff_factor=0.25,
                       growth_interval=5)
    if lazy_init:  # the state block exists: its bytes must not change either
        s.scale(torch.ones(1))
        s._state.view(torch.int32)[1] = 2
    before, words = s.state_dict(), None if s._state is None else s._state.clone()
    sd = {"scale": 16.0, "growth_factor": 4.0, "backoff_factor": 0.125, "growth_interval": 7,
          "_growth_tracker": 1}
    change = dict(change)
    drop = change.pop("_drop", None)
    sd.update(change)
    sd.pop(drop, None)
    with pytest.raises(error, match=message):
        s.load_state_dict(sd)
    assert s.state_dict() == before
    if words is not None:
        assert torch.equal(s._state, words)
    s.load_state_dict(dict(sd, **{k: v for k, v in before.items() if k in change or k == drop}))
    assert s.state_dict() != before  # the same dict with the bad field repaired loads


def test_load_state_dict_takes_what_torch_takes():
    """numpy numbers (a dict read back through numpy), a 1-element scale tensor, and
    unknown keys (ignored, as torch ignores them) load as torch's scaler loads them."""
    import numpy as np
    sd = {"scale": torch.tensor([32.0]), "growth_factor": np.float64(3.0),
          "backoff_factor": np.float32(0.25), "growth_interval": np.int64(9),
          "_growth_tracker": np.int32(4), "unknown": "ignored"}
    m, t = amp.GradScaler("cpu"), torch.amp.GradScaler("cpu")
    m.load_state_dict(sd)
    t.load_state_dict(sd)
    assert m.state_dict() == {"scale": 32.0, "growth_factor": 3.0, "backoff_factor": 0.25,
                              "growth_interval": 9, "_growth_tracker": 4}
    assert m.get_scale() == t.get_scale() and m._get_growth_tracker() == t._get_growth_tracker()
    with pytest.raises(TypeError, match=r"state_dict: expected a dict .*got list"):
        m.load_state_dict([("scale", 1.0)])
