"""memfit.optim.CPUOffloadOptimizer under a hostile caller (issue 38, items 1-7): an
offloader that is dropped or closed leaves no hook and no thread; parameters unfrozen
later train; a step that raises in step_in_backward leaves nothing behind; gradients the
caller assigns are taken; bitsandbytes' per-parameter overrides hold inside it; sets
of parameters are refused; torch's global step hooks run once per step. Every check is
bit for bit against the wrapped optimizer stepping the model's parameters itself."""

import gc

import memfit
from memfit import _C
import memfit.optim as mo
import memfit.optim.bnb as bnb
import pytest
import torch
from memfit.optim.offload import CPUOffloadOptimizer
from test_offload import assert_same, batch, groups, loss_of, make_model, train

# -- 1. the hooks and the thread go with the optimizer ---------------------------------------


def hooks_on(model) -> int:
    return sum(len(p._post_accumulate_grad_hooks or {}) for p in model.parameters())


def one_step(model, opt, i=0):
    loss_of(model, batch(i, torch.float32)).backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("mode", [dict(offload_gradients=True),
                                  dict(offload_gradients=True, step_in_backward=True),
                                  dict(offload=False, step_in_backward=True)],
                         ids=["grads-host", "in-backward-host", "in-backward-device"])
def test_dropped_offloaders_leave_no_hook_and_no_thread(mode):
    model = make_model()
    gc.collect()
    before = _C.host_queues_live()  # the worker threads (host queues) running now
    for i in range(8):
        opt = CPUOffloadOptimizer(model.parameters(), mo.AdamW8bit, lr=1e-2, **mode)
        one_step(model, opt, i)  # the worker thread runs (offload) and the hooks fire
        assert hooks_on(model) == 6
        del opt  # no gc.collect(): nothing but the caller holds an offloader
        assert hooks_on(model) == 0
    gc.collect()
    assert _C.host_queues_live() <= before  # none of ours is left (earlier ones may end)


def test_an_optimizer_replacing_an_offloader_steps_as_it_would_alone():
    """A plain torch optimizer, then a second offloader, each takes over the model that a
    first offloader stepped: bit for bit what they do on a copy no offloader touched."""
    model, ref_model = make_model(), make_model()
    opt = CPUOffloadOptimizer(model.parameters(), mo.AdamW8bit, offload_gradients=True, lr=1e-2)
    one_step(model, opt)
    ref_model.load_state_dict(model.state_dict())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)  # the offloader is dropped here
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2)
    for i in range(2):
        loss_of(model, batch(i, torch.float32)).backward()
        assert all(p.grad is not None for p in model.parameters())  # not taken by a stale hook
        opt.step()
        opt.zero_grad()
        one_step(ref_model, ref, i)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref_model.parameters()))

    first = CPUOffloadOptimizer(model.parameters(), mo.AdamW8bit, offload_gradients=True, lr=1e-2)
    one_step(model, first)
    ref_model.load_state_dict(model.state_dict())
    second = CPUOffloadOptimizer(model.parameters(), mo.AdamW8bit, offload_gradients=True, lr=1e-2)
    del first
    alone = CPUOffloadOptimizer(ref_model.parameters(), mo.AdamW8bit, offload_gradients=True,
                                lr=1e-2)
    for i in range(2):
        one_step(model, second, i)
        one_step(ref_model, alone, i)
    assert_same(model, ref_model, second, alone)


def test_close_and_the_context_manager():
    model = make_model()
    baseline = _C.host_queues_live()
    with CPUOffloadOptimizer(model.parameters(), offload_gradients=True, lr=1e-2) as opt:
        one_step(model, opt)
        assert hooks_on(model) == 6 and _C.host_queues_live() == baseline + 1
    assert hooks_on(model) == 0 and _C.host_queues_live() == baseline
    opt.close()  # idempotent
    loss_of(model, batch(1, torch.float32)).backward()  # the gradients stay on the model
    assert all(p.grad is not None for p in model.parameters())
    with pytest.raises(RuntimeError, match="closed"):
        opt.step()
    kept = opt.state_dict()  # what was trained is still there to save
    assert len(kept["state"]) == 6


# -- 2. parameters unfrozen after construction -----------------------------------------------

MODES = [dict(offload_gradients=True), dict(offload_gradients=True, step_in_backward=True),
         dict(offload=False, step_in_backward=True)]
MODE_IDS = ["grads-host", "in-backward-host", "in-backward-device"]


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_parameters_unfrozen_later_are_trained(mode):
    """Fine-tuning's schedule: the first layer frozen when the optimizer is built,
    unfrozen at the third step (and the last one frozen at the fourth); bfloat16 with
    stochastic rounding, so every tensor must also keep its place in the step."""
    dtype, accum = torch.bfloat16, (1 if mode.get("step_in_backward") else 2)
    model, ref_model = make_model(dtype), make_model(dtype)
    for m in (model, ref_model):
        m[0].requires_grad_(False)
    opt = CPUOffloadOptimizer(groups(model), mo.AdamW8bit, lr=1e-2, **mode)
    ref = mo.AdamW8bit(groups(ref_model), lr=1e-2)
    before = model[0].weight.detach().clone()
    for s in range(5):
        if s == 2:
            for m in (model, ref_model):
                m[0].requires_grad_(True)
        if s == 3:
            for m in (model, ref_model):
                m[4].requires_grad_(False)
        for m, o in ((model, opt), (ref_model, ref)):
            for a in range(accum):
                loss_of(m, batch(s * accum + a, dtype)).backward()
            o.step()
            o.zero_grad()
        assert torch.equal(model[0].weight, before) == (s < 2)
    assert_same(model, ref_model, opt, ref)


# -- 3. a step that raises in step_in_backward ------------------------------------------------

@pytest.mark.parametrize("offload", [True, False], ids=["host", "device"])
def test_a_step_in_backward_that_raises_carries_nothing_over(offload):
    """A bad lr: the error comes from step() (host) or from backward (device: the step
    runs in autograd's hook); then with a good lr the next backward and step() equal a
    fresh optimizer's first step: no 'second gradient', no stale gradient added."""
    dtype = torch.bfloat16
    mode = dict(offload=offload, offload_gradients=offload, step_in_backward=True)
    model, ref_model = make_model(dtype), make_model(dtype)
    opt = CPUOffloadOptimizer(groups(model), mo.AdamW8bit, lr=1e-2, **mode)
    ref = CPUOffloadOptimizer(groups(ref_model), mo.AdamW8bit, lr=1e-2, **mode)
    lrs = [g["lr"] for g in opt.param_groups]
    for g in opt.param_groups:
        g["lr"] = -1.0
    with pytest.raises(ValueError, match="lr"):
        loss_of(model, batch(0, dtype)).backward()
        opt.step()
    assert all(p.grad is None for p in model.parameters())
    assert all(h.grad is None for g in opt.optimizer.param_groups for h in g["params"])
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref_model.parameters()))
    for g, lr in zip(opt.param_groups, lrs):
        g["lr"] = lr
    for m, o in ((model, opt), (ref_model, ref)):
        loss_of(m, batch(1, dtype)).backward()
        o.step()
        o.zero_grad()
    assert_same(model, ref_model, opt, ref)
    assert opt.optimizer.param_groups[0]["sr_step"] == 1  # the step that raised did not count


@pytest.mark.parametrize("offload", [True, False], ids=["host", "device"])
def test_a_refused_scaler_does_not_stay(offload):
    """scaler.step() raises (no GradScaler with step_in_backward): the scaler's
    grad_scale/found_inf are not left on the optimizer, and the next backward and
    step() without the scaler work and equal an optimizer that never saw the scaler."""
    mode = dict(offload=offload, offload_gradients=offload, step_in_backward=True)
    model, ref_model = make_model(), make_model()
    opt = CPUOffloadOptimizer(model.parameters(), mo.AdamW8bit, lr=1e-2, **mode)
    ref = CPUOffloadOptimizer(ref_model.parameters(), mo.AdamW8bit, lr=1e-2, **mode)
    scaler = torch.amp.GradScaler("cpu", init_scale=1.0)  # scale 1: the same gradients
    scaler.scale(loss_of(model, batch(0, torch.float32))).backward()
    with pytest.raises(RuntimeError, match="GradScaler"):
        scaler.step(opt)
    assert "grad_scale" not in vars(opt) and "found_inf" not in vars(opt)
    loss_of(ref_model, batch(0, torch.float32)).backward()
    ref.step()
    for m, o in ((model, opt), (ref_model, ref)):
        o.zero_grad()
        loss_of(m, batch(1, torch.float32)).backward()
        o.step()
    # float32: no random bits; the refused step is not counted (sr_step), as a refused
    # step of the plain optimizer is not
    assert_same(model, ref_model, opt, ref, skip=("params", "sr_step"))
    assert [g["sr_step"] for g in opt.optimizer.param_groups] == [1]


def test_a_plain_step_that_raises_does_not_leave_the_scaler_set():
    model = make_model()
    opt = CPUOffloadOptimizer(model.parameters(), mo.AdamW8bit, lr=1e-2)
    loss_of(model, batch(0, torch.float32)).backward()
    opt.grad_scale, opt.found_inf = torch.tensor(1.0), torch.tensor(0.0)
    opt.param_groups[0]["lr"] = -1.0
    with pytest.raises(ValueError, match="lr"):
        opt.step()
    assert "grad_scale" not in vars(opt) and "found_inf" not in vars(opt)


# -- 4. gradients the caller assigns ----------------------------------------------------------

@pytest.mark.parametrize("mode", MODES[:2], ids=MODE_IDS[:2])
def test_gradients_assigned_by_the_caller_are_taken(mode):
    """torch.autograd.grad users assign p.grad themselves (no hook fires); gradient
    surgery replaces p.grad after backward (the hook already moved it): step() takes
    what is on the device at that point, as the plain optimizer does."""
    dtype = torch.bfloat16
    model, ref_model = make_model(dtype), make_model(dtype)
    opt = CPUOffloadOptimizer(groups(model), mo.AdamW8bit, lr=1e-2, **mode)
    ref = mo.AdamW8bit(groups(ref_model), lr=1e-2)
    for s in range(3):
        for m, o in ((model, opt), (ref_model, ref)):
            params = list(m.parameters())
            loss = loss_of(m, batch(s, dtype))
            if s == 1 and not mode.get("step_in_backward"):
                loss.backward()  # the hooks move these; the caller's doubled ones replace them
            grads = torch.autograd.grad(loss_of(m, batch(s, dtype)), params)
            for p, g in zip(params, grads):
                p.grad = g * 2
            o.step()
            o.zero_grad()
    assert_same(model, ref_model, opt, ref)


def test_clipping_reads_gradients_the_caller_assigned():
    model, ref_model = make_model(), make_model()
    opt = CPUOffloadOptimizer(model.parameters(), mo.AdamW8bit, offload_gradients=True, lr=1e-2)
    ref = mo.AdamW8bit(ref_model.parameters(), lr=1e-2)
    for m in (model, ref_model):
        for p in m.parameters():
            p.grad = torch.full_like(p, 0.5)
    norm = opt.clip_grad_norm_(1.0)
    assert torch.equal(norm, torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 1.0))
    opt.step()
    ref.step()
    assert_same(model, ref_model, opt, ref)


# -- 5. bitsandbytes' per-parameter overrides ------------------------------------------------

@pytest.fixture()
def fresh_manager():
    bnb.GlobalOptimManager.get_instance().initialize()
    yield bnb.GlobalOptimManager.get_instance()
    bnb.GlobalOptimManager.get_instance().initialize()


def embedding_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(64, 96), torch.nn.Linear(96, 80))


def embedding_train(model, opt, steps, start=0):
    for s in range(steps):
        ids = torch.randint(0, 64, (16,), generator=torch.Generator().manual_seed(start + s))
        model(ids).square().mean().backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("when", ["before", "after"])
def test_bnb_overrides_hold_inside_the_offloader(fresh_manager, when):
    """StableEmbedding's habit (optim_bits=32 for the embedding) registered before or
    after the offloader is built: the same numbers and state formats as the plain shim,
    and the state dict loads both ways."""
    model, ref_model = embedding_model(), embedding_model()

    def override():
        fresh_manager.register_module_override(model[0], "weight", {"optim_bits": 32})
        fresh_manager.override_config(ref_model[0].weight, "optim_bits", 32)

    if when == "before":
        override()
    opt = CPUOffloadOptimizer(model.parameters(), bnb.AdamW8bit, offload_gradients=True,
                              lr=1e-2, min_8bit_size=100)
    ref = bnb.AdamW8bit(ref_model.parameters(), lr=1e-2, min_8bit_size=100)
    if when == "after":
        override()
    embedding_train(model, opt, 3)
    embedding_train(ref_model, ref, 3)
    assert opt.state[opt.param_groups[0]["params"][0]]["state1"].dtype == torch.float32
    assert opt.state[opt.param_groups[0]["params"][1]]["state1"].dtype == torch.uint8
    assert_same(model, ref_model, opt, ref)
    # the offloader's dict into a fresh plain shim, the shim's into a fresh offloader
    plain_model, off_model = embedding_model(), embedding_model()
    plain_model.load_state_dict(model.state_dict())
    off_model.load_state_dict(ref_model.state_dict())
    fresh_manager.override_config(plain_model[0].weight, "optim_bits", 32)
    fresh_manager.override_config(off_model[0].weight, "optim_bits", 32)
    plain = bnb.AdamW8bit(plain_model.parameters(), lr=1e-2, min_8bit_size=100)
    plain.load_state_dict(opt.state_dict())
    off = CPUOffloadOptimizer(off_model.parameters(), bnb.AdamW8bit, offload_gradients=True,
                              lr=1e-2, min_8bit_size=100)
    off.load_state_dict(ref.state_dict())
    embedding_train(plain_model, plain, 2, start=3)
    embedding_train(off_model, off, 2, start=3)
    assert_same(off_model, plain_model, off, plain)


# -- 6. sets of parameters --------------------------------------------------------------------

def test_a_set_of_parameters_is_refused():
    model = make_model()
    with pytest.raises(memfit.MemfitTypeError, match=r"params\[0\]\['params'\]: a set"):
        CPUOffloadOptimizer([{"params": set(model.parameters())}], offload_gradients=True)
    with pytest.raises(TypeError, match=r"params\[1\]\['params'\]: a set"):
        CPUOffloadOptimizer([{"params": [model[0].weight]},
                             {"params": frozenset([model[0].bias])}])
    assert hooks_on(model) == 0


# -- 7. torch's global step hooks --------------------------------------------------------------

@pytest.mark.parametrize("mode", [dict(), *MODES], ids=["grads-dev", *MODE_IDS])
def test_global_step_hooks_run_once_per_step(mode):
    from torch.optim.optimizer import (register_optimizer_step_post_hook,
                                       register_optimizer_step_pre_hook)
    model = make_model()
    opt = CPUOffloadOptimizer(model.parameters(), mo.AdamW8bit, lr=1e-2, **mode)
    inner_calls = []
    opt.optimizer.register_step_post_hook(lambda o, a, k: inner_calls.append(o))
    calls = []
    handles = [register_optimizer_step_pre_hook(lambda o, a, k: calls.append(("pre", o))),
               register_optimizer_step_post_hook(lambda o, a, k: calls.append(("post", o)))]
    try:
        for i in range(2):
            one_step(model, opt, i)
    finally:
        for h in handles:
            h.remove()
    assert calls == [("pre", opt), ("post", opt)] * 2
    # a hook registered on the wrapped optimizer itself runs at its own step()
    assert inner_calls == ([] if mode.get("step_in_backward") else [opt.optimizer] * 2)
