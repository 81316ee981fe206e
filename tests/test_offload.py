"""memfit.optim.CPUOffloadOptimizer on the CPU (the "device" is the CPU: real host copies,
a real worker thread and staging buffers, streams as no-ops): bit for bit against the
wrapped optimizer stepping the model's parameters itself."""

import copy
import time

import memfit
import memfit.optim as mo
import pytest
import torch
from memfit.optim.offload import CPUOffloadOptimizer

OPTIMIZERS = [
    (mo.AdamW8bit, dict(lr=1e-2, weight_decay=0.1)),
    (mo.Adam8bit, dict(lr=1e-2)),
    (mo.AdamW4bit, dict(lr=1e-2)),
    (mo.AdamW, dict(lr=1e-2)),
    (mo.Lion8bit, dict(lr=1e-3)),
    (mo.SGD8bit, dict(lr=1e-2, momentum=0.9)),
    (mo.RMSprop8bit, dict(lr=1e-3)),
    (mo.Muon8bit, dict(lr=2e-2)),  # the biases' group: use_muon=False (see groups)
    (mo.Muon, dict(lr=2e-2)),
    (mo.Adagrad8bit, dict(lr=1e-2, initial_accumulator_value=0.1)),
    (mo.AdEMAMix8bit, dict(lr=1e-3, t_alpha=2, t_beta3=2)),
    (mo.LAMB8bit, dict(lr=1e-2)),
]
IDS = [c.__name__ for c, _ in OPTIMIZERS]


def make_model(dtype=torch.float32, seed=0):
    """Two weights big enough for quantized states (>= 4096 elements), 1-D biases
    (float32 states), and a weight shared by two layers."""
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.GELU(), torch.nn.Linear(96, 48),
                            torch.nn.GELU(), torch.nn.Linear(48, 64))
    return m.to(dtype)


def groups(model, cls=None):
    """Two param groups with different lrs: weights, then biases (for Muon, the biases
    in a use_muon=False group: AdamW in the same optimizer)."""
    ps = list(model.named_parameters())
    biases = {"params": [p for n, p in ps if n.endswith("bias")], "lr": 3e-3}
    if cls in (mo.Muon8bit, mo.Muon):
        biases["use_muon"] = False
    return [{"params": [p for n, p in ps if n.endswith("weight")]}, biases]


def batch(i, dtype):
    g = torch.Generator().manual_seed(100 + i)
    return torch.randn(8, 64, generator=g).to(dtype)


def loss_of(model, x):
    return (model(x).float() - 0.5).square().mean()


def train(model, opt, steps=5, accum=2, dtype=torch.float32, clip=None, scheduler=None,
          inf_at=None, scaler=None):
    """steps optimizer steps of accum backwards each; returns the clip norms."""
    norms = []
    for s in range(steps):
        for a in range(accum):
            x = batch(s * accum + a, dtype)
            if s == inf_at and a == 0:
                x[0, 0] = float("inf")
            loss = loss_of(model, x)
            (scaler.scale(loss) if scaler else loss).backward()
        if clip is not None:
            if scaler:
                scaler.unscale_(opt)
            norms.append(clip(model, opt))
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        if scheduler is not None:
            scheduler.step()
        opt.zero_grad(set_to_none=True)
    return norms


def assert_same(model, ref_model, opt, ref, skip=("params",)):
    for (n, p), q in zip(model.named_parameters(), ref_model.parameters()):
        assert p.dtype == q.dtype and torch.equal(p, q), n
    sd, rsd = opt.state_dict(), ref.state_dict()
    assert sd["state"].keys() == rsd["state"].keys() and sd["state"]
    for k in rsd["state"]:
        assert sd["state"][k].keys() == rsd["state"][k].keys()
        for key, v in rsd["state"][k].items():
            assert torch.equal(sd["state"][k][key], v), (k, key)
            assert sd["state"][k][key].device.type == "cpu"
    strip = lambda gs: [{k: v for k, v in g.items() if k not in skip} for g in gs]
    assert strip(sd["param_groups"]) == strip(rsd["param_groups"])


def pair(cls, kw, dtype=torch.float32, **okw):
    model, ref_model = make_model(dtype), make_model(dtype)
    opt = CPUOffloadOptimizer(groups(model, cls), cls, **okw, **kw)
    ref = cls(groups(ref_model, cls), **kw)
    return model, ref_model, opt, ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("offload_gradients", [False, True], ids=["grads-dev", "grads-host"])
@pytest.mark.parametrize("cls,kw", OPTIMIZERS, ids=IDS)
def test_bit_identical_to_the_wrapped_optimizer(cls, kw, offload_gradients, dtype):
    """5 steps of 2 accumulated backwards, two param groups and a scheduler; bfloat16
    parameters are written with stochastic rounding (the default) on the host copy."""
    model, ref_model, opt, ref = pair(cls, kw, dtype, offload_gradients=offload_gradients)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    rsched = torch.optim.lr_scheduler.StepLR(ref, step_size=2, gamma=0.5)
    train(model, opt, dtype=dtype, scheduler=sched)
    train(ref_model, ref, dtype=dtype, scheduler=rsched)
    assert opt.param_groups[0]["lr"] == ref.param_groups[0]["lr"] == kw["lr"] * 0.25
    assert opt.optimizer.param_groups[1]["lr"] == 3e-3 * 0.25  # the host step's lr
    assert_same(model, ref_model, opt, ref)
    # the states live on the host copies, not on the model's parameters
    host = {id(p) for g in opt.optimizer.param_groups for p in g["params"]}
    assert host.isdisjoint(id(p) for p in model.parameters())
    assert set(map(id, opt.optimizer.state)) == host


@pytest.mark.parametrize("offload_gradients", [False, True])
def test_clipping(offload_gradients):
    model, ref_model, opt, ref = pair(mo.AdamW8bit, dict(lr=1e-2),
                                      offload_gradients=offload_gradients)
    clip = ((lambda m, o: o.clip_grad_norm_(0.05)) if offload_gradients
            else (lambda m, o: torch.nn.utils.clip_grad_norm_(
                [p for g in groups(m) for p in g["params"]], 0.05)))
    norms = train(model, opt, clip=clip)
    # the norm of the same gradients, summed in param_groups order as the optimizer's is
    ref_norms = train(ref_model, ref, clip=lambda m, o: torch.nn.utils.clip_grad_norm_(
        [p for g in o.param_groups for p in g["params"]], 0.05))
    assert all(torch.equal(a, b) for a, b in zip(norms, ref_norms)) and min(norms) > 0.05
    assert_same(model, ref_model, opt, ref)


@pytest.mark.filterwarnings("ignore:.*already NaN/Inf before backward")
@pytest.mark.parametrize("kind", ["torch", "memfit"])
@pytest.mark.parametrize("offload_gradients", [False, True])
def test_scaler_skips_a_step_with_inf_gradients(kind, offload_gradients):
    """The step with an inf gradient changes nothing (parameters, states, step counts);
    with offload_gradients=True the scaler reads the host gradients, unscale_ and the
    optimizer's clip_grad_norm_ included."""
    make = ((lambda: torch.amp.GradScaler("cpu", init_scale=2.0**10)) if kind == "torch"
            else (lambda: memfit.amp.GradScaler("cpu", init_scale=2.0**10)))
    model, ref_model, opt, ref = pair(mo.AdamW8bit, dict(lr=1e-2),
                                      offload_gradients=offload_gradients)

    def clip(m, o):
        return (o.clip_grad_norm_(1.0) if offload_gradients
                else torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0))

    scaler, rscaler = make(), make()
    train(model, opt, steps=2, scaler=scaler, clip=clip)
    train(ref_model, ref, steps=2, scaler=rscaler,
          clip=lambda m, o: torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0))
    before = ([p.detach().clone() for p in model.parameters()],
              copy.deepcopy(opt.state_dict()["state"]))
    train(model, opt, steps=1, inf_at=0, scaler=scaler, clip=clip)
    train(ref_model, ref, steps=1, inf_at=0, scaler=rscaler,
          clip=lambda m, o: torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0))
    assert scaler.get_scale() == rscaler.get_scale() == 2.0**9  # backed off
    assert all(torch.equal(a, b) for a, b in zip(before[0], model.parameters()))
    for k, st in opt.state_dict()["state"].items():
        assert all(torch.equal(v, before[1][k][key]) for key, v in st.items())
    train(model, opt, steps=2, scaler=scaler, clip=clip)
    train(ref_model, ref, steps=2, scaler=rscaler,
          clip=lambda m, o: torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0))
    assert_same(model, ref_model, opt, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("direction", ["plain-to-offloaded", "offloaded-to-plain"])
def test_resume_across_offloaded_and_not(direction, dtype):
    """A checkpoint of the wrapped optimizer's format: 3 steps on one side, save model
    and optimizer, load them into the other side, 2 more steps: as 5 steps without
    interruption."""
    kw = dict(lr=1e-2)
    model, ref_model, opt, ref = pair(mo.AdamW8bit, kw, dtype, offload_gradients=True)
    train(ref_model, ref, dtype=dtype)  # 5 steps, uninterrupted
    first_model = make_model(dtype)
    first = (mo.AdamW8bit(groups(first_model), **kw) if direction == "plain-to-offloaded"
             else CPUOffloadOptimizer(groups(first_model), mo.AdamW8bit, **kw))
    train(first_model, first, steps=3, dtype=dtype)
    saved_model = copy.deepcopy(first_model.state_dict())
    saved = copy.deepcopy(first.state_dict())
    second_model = make_model(dtype, seed=1)  # other weights: the load must replace them
    second = (CPUOffloadOptimizer(groups(second_model), mo.AdamW8bit, **kw)
              if direction == "plain-to-offloaded" else mo.AdamW8bit(groups(second_model), **kw))
    second_model.load_state_dict(saved_model)
    second.load_state_dict(saved)  # the offloader re-reads its host copies here
    for s in range(3, 5):  # steps 4 and 5, on the same batches as the reference
        for a in range(2):
            loss_of(second_model, batch(s * 2 + a, dtype)).backward()
        second.step()
        second.zero_grad()
    both = (second, ref) if direction == "plain-to-offloaded" else (ref, second)
    assert_same(second_model, ref_model, *both) if direction == "plain-to-offloaded" else \
        assert_same(ref_model, second_model, *both)


def test_no_gradient_stays_on_the_device():
    model = make_model()
    opt = CPUOffloadOptimizer(model.parameters(), offload_gradients=True, lr=1e-2)
    loss_of(model, batch(0, torch.float32)).backward()
    assert all(p.grad is None for p in model.parameters())
    hosts = opt.param_groups[0]["params"]
    assert all(h.grad is not None and h.grad.shape == p.shape
               for h, p in zip(hosts, model.parameters()))
    ref = make_model()
    loss_of(ref, batch(0, torch.float32)).backward()
    assert all(torch.equal(h.grad, p.grad) for h, p in zip(hosts, ref.parameters()))
    opt.zero_grad()
    assert all(h.grad is None for h in hosts)


def storages(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors``."""
    seen = {}
    for t in tensors:
        if t is not None:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


@pytest.mark.parametrize("dtype,master", [(torch.float32, 4), (torch.bfloat16, 2)],
                         ids=["fp32", "bf16"])
def test_bytes_per_parameter_as_documented(dtype, master):
    """docs/offload.md: the device holds the parameters only; the host holds the master
    copy (parameter dtype), the gradient (parameter dtype, until zero_grad) and AdamW8bit's
    states (2 bytes + one float32 absmax per 256 per state, and a step counter)."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(512, 1024).to(dtype))
    opt = CPUOffloadOptimizer([w], mo.AdamW8bit, offload_gradients=True, lr=1e-3)
    (w.float().square().sum()).backward()
    opt.step()
    n = w.numel()
    device = storages([w, w.grad])
    assert device == n * master  # the gradient is gone
    (h,) = opt.param_groups[0]["params"]
    state = opt.optimizer.state[h]
    host = storages([h, h.grad, *state.values()])
    absmax = 2 * 512 * (1024 // 256) * 4
    assert host == n * master + n * master + 2 * n + absmax + 4
    opt.zero_grad()
    assert storages([h, h.grad, *state.values()]) == n * master + 2 * n + absmax + 4


@pytest.mark.parametrize("step_in_backward", [False, True])
def test_next_forward_sees_the_update(step_in_backward, monkeypatch):
    """A slow worker (its step sleeps first): the forward right after step() reads the
    updated parameters, never the old ones."""
    model, ref_model, opt, ref = pair(mo.AdamW8bit, dict(lr=1e-2), offload_gradients=True,
                                      step_in_backward=step_in_backward)
    # the host step: the wrapped step(), or in backward its step of one tensor
    name = "_step_params" if step_in_backward else "step"
    inner_step = getattr(opt.optimizer, name)
    calls = []

    def slow_step(*a, **k):
        time.sleep(0.05)
        calls.append(opt._worker.on_thread())
        return inner_step(*a, **k)

    monkeypatch.setattr(opt.optimizer, name, slow_step)
    x = batch(0, torch.float32)
    for m, o in ((ref_model, ref), (model, opt)):
        loss_of(m, x).backward()
        o.step()
    out = model(x)  # right after the offloader's step(): no wait in between
    expected = ref_model(x)
    assert torch.equal(out, expected)
    assert calls and all(calls)  # the host step ran on the worker's thread


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("cls,kw", OPTIMIZERS, ids=IDS)
@pytest.mark.parametrize("offload", [True, False], ids=["host", "device"])
def test_step_in_backward(offload, cls, kw, dtype):
    """Each tensor steps as its gradient is ready and the gradient is freed, with the
    wrapped optimizer's bits: bfloat16/float16 parameters written with stochastic
    rounding (the default) draw the random bits of the whole step (each tensor keeps
    its bucket and its place in it; sr_step counts optimizer steps, not tensors)."""
    model, ref_model, opt, ref = pair(cls, kw, dtype, offload=offload,
                                      offload_gradients=offload, step_in_backward=True)
    for s in range(4):
        x = batch(s, dtype)
        loss_of(model, x).backward()
        assert all(p.grad is None for p in model.parameters())
        opt.step()
        opt.zero_grad()
        loss_of(ref_model, x).backward()
        ref.step()
        ref.zero_grad()
    assert opt.optimizer.param_groups[1]["sr_step"] == ref.param_groups[1]["sr_step"] == 4
    assert_same(model, ref_model, opt, ref)
    if dtype != torch.float32:  # rounding made a difference: nearest-even lands elsewhere
        near_model = make_model(dtype)
        near = cls(groups(near_model, cls), bf16_stochastic_round=False, **kw)
        for s in range(4):
            loss_of(near_model, batch(s, dtype)).backward()
            near.step()
            near.zero_grad()
        assert not all(torch.equal(p, q) for p, q in zip(model.parameters(),
                                                         near_model.parameters()))


@pytest.mark.parametrize("offload", [True, False], ids=["host", "device"])
def test_step_in_backward_a_parameter_without_gradient(offload):
    """The rule (docs/offload.md): every parameter with requires_grad keeps the place it
    has in a step where all of them have gradients. One that gets no gradient in a
    backward does not step (as in torch); the others get the bits of that full step."""
    model, ref_model, opt, ref = pair(mo.AdamW8bit, dict(lr=1e-2), torch.bfloat16,
                                      offload=offload, offload_gradients=offload,
                                      step_in_backward=True)
    before = [p.detach().clone() for p in model[0].parameters()]
    # model[0] gets no gradient: model[2].weight is second in its bucket of the full step
    h = torch.randn(8, 96, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    (model[2:](h).float().square().mean()).backward()
    opt.step()
    (ref_model[2:](h).float().square().mean()).backward()
    for p in ref_model[0].parameters():
        p.grad = torch.ones_like(p)  # the full step: every parameter has a gradient
    ref.step()
    assert all(torch.equal(a, p) for a, p in zip(before, model[0].parameters()))
    for p, q in zip(list(model.parameters())[2:], list(ref_model.parameters())[2:]):
        assert torch.equal(p, q)
    state = opt.optimizer.state
    assert [len(state[h]) > 0 for h in opt.optimizer.param_groups[0]["params"]] == [False, True,
                                                                                  True]


@pytest.mark.parametrize("cls", [mo.AdamW8bit, mo.Muon8bit], ids=["AdamW8bit", "Muon8bit"])
@pytest.mark.parametrize("offload", [True, False], ids=["host", "device"])
def test_step_in_backward_plans_each_parameter_once(offload, cls, monkeypatch):
    """A backward over n tensors costs O(n): each parameter list of the wrapped optimizer
    is read once per backward (for the tensors' places), each tensor is planned alone,
    not all n again for each of the n tensors (Muon's own checks included)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(24)])
    n = len(list(model.parameters()))
    opt = CPUOffloadOptimizer(groups(model, cls), cls, offload=offload,
                              offload_gradients=offload, step_in_backward=True, lr=1e-3)
    reads = [0]

    class CountingList(list):
        def __iter__(self):
            for p in super().__iter__():
                reads[0] += 1
                yield p

    for g in opt.optimizer.param_groups:
        g["params"] = CountingList(g["params"])
    planned = []
    plan = type(opt.optimizer)._plan_step

    def counting_plan(self, members=None):
        planned.append(None if members is None else sum(map(len, members.values())))
        return plan(self, members)

    monkeypatch.setattr(type(opt.optimizer), "_plan_step", counting_plan)
    for s in range(3):
        reads[0] = 0
        planned.clear()
        model(torch.randn(4, 16)).square().mean().backward()
        opt.step()
        assert planned == [1] * n  # one plan per tensor, of that tensor alone
        assert reads[0] == n  # the places: one pass over the parameters per backward


def test_scheduler_after_load_state_dict():
    """After load_state_dict (which replaces the wrapped optimizer's group dicts), an LR
    scheduler's lr still reaches the host step: bit-identical to the wrapped optimizer."""
    model, ref_model, opt, ref = pair(mo.AdamW8bit, dict(lr=1e-2))
    train(model, opt, steps=1)
    train(ref_model, ref, steps=1)
    opt.load_state_dict(opt.state_dict())
    ref.load_state_dict(ref.state_dict())
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    rsched = torch.optim.lr_scheduler.StepLR(ref, step_size=1, gamma=0.5)
    train(model, opt, steps=2, scheduler=sched)
    train(ref_model, ref, steps=2, scheduler=rsched)
    assert opt.optimizer.param_groups[0]["lr"] == opt.param_groups[0]["lr"] == 1e-2 * 0.25
    assert_same(model, ref_model, opt, ref)


def test_hooks_run_as_torch_runs_them():
    """Step, state_dict and load_state_dict hooks registered on the offloader run, with
    the offloader as their optimizer, in torch's order; returned replacements are used."""
    model, ref_model, opt, ref = pair(mo.AdamW8bit, dict(lr=1e-2))
    calls = []
    opt.register_step_pre_hook(lambda o, a, k: calls.append(("step_pre", o is opt)))
    opt.register_step_post_hook(lambda o, a, k: calls.append(("step_post", o is opt)))
    train(model, opt, steps=1)
    train(ref_model, ref, steps=1)
    assert calls == [("step_pre", True), ("step_post", True)]
    assert_same(model, ref_model, opt, ref)  # the hooks changed nothing else

    calls.clear()
    opt.register_state_dict_pre_hook(lambda o: calls.append(("sd_pre", o is opt)))
    opt.register_state_dict_post_hook(
        lambda o, sd: calls.append(("sd_post", o is opt)) or {**sd, "extra": 1})
    sd = opt.state_dict()
    assert calls == [("sd_pre", True), ("sd_post", True)] and sd["extra"] == 1
    assert sd["memfit"]["optimizer"] == "AdamW8bit"

    calls.clear()

    def replace(o, d):  # a pre-hook's replacement is what loads
        calls.append(("load_pre", o is opt))
        return {**d, "param_groups": [dict(g, lr=0.125) for g in d["param_groups"]]}

    opt.register_load_state_dict_pre_hook(replace)
    opt.register_load_state_dict_post_hook(
        lambda o: calls.append(("load_post", o is opt, o.param_groups[0]["lr"])))
    del sd["extra"]
    opt.load_state_dict(sd)
    assert calls == [("load_pre", True), ("load_post", True, 0.125)]
    assert [g["lr"] for g in opt.optimizer.param_groups] == [0.125, 0.125]
    assert sd["param_groups"][0]["lr"] == 1e-2  # the caller's dict is not changed


@pytest.mark.parametrize("offload", [True, False], ids=["host", "device"])
def test_step_in_backward_bf16_nearest_rounding(offload):
    kw = dict(lr=1e-2, bf16_stochastic_round=False)
    model, ref_model, opt, ref = pair(mo.AdamW8bit, kw, torch.bfloat16, offload=offload,
                                      offload_gradients=offload, step_in_backward=True)
    for s in range(3):
        for m, o in ((model, opt), (ref_model, ref)):
            loss_of(m, batch(s, torch.bfloat16)).backward()
            o.step()
            o.zero_grad()
    assert_same(model, ref_model, opt, ref)


@pytest.mark.parametrize("offload", [True, False], ids=["host", "device"])
def test_step_in_backward_refuses_what_needs_all_gradients(offload):
    model = make_model()
    opt = CPUOffloadOptimizer(model.parameters(), offload=offload, offload_gradients=offload,
                              step_in_backward=True, lr=1e-2)
    loss_of(model, batch(0, torch.float32)).backward()
    with pytest.raises(RuntimeError, match="middle of a step"):
        opt.zero_grad()
    with pytest.raises(RuntimeError, match="no global norm"):
        opt.clip_grad_norm_(1.0)
    with pytest.raises(RuntimeError, match="second gradient before step"):
        loss_of(model, batch(1, torch.float32)).backward()
    opt.step()  # the first backward's steps landed; the refused second one changed nothing
    assert all(p.grad is None for p in model.parameters())
    once = make_model()
    once_opt = CPUOffloadOptimizer(once.parameters(), offload=offload, offload_gradients=offload,
                                   step_in_backward=True, lr=1e-2)
    loss_of(once, batch(0, torch.float32)).backward()
    once_opt.step()
    assert_same(model, once, opt, once_opt)
    loss_of(model, batch(2, torch.float32)).backward()
    opt.grad_scale = torch.tensor(2.0)
    with pytest.raises(RuntimeError, match="GradScaler"):
        opt.step()


def test_bad_use_is_refused_and_changes_nothing():
    model = make_model()
    params = list(model.parameters())
    with pytest.raises(TypeError, match="optimizer_class: expected a memfit.optim optimizer"):
        CPUOffloadOptimizer(params, torch.optim.AdamW)
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[1\]: is on meta"):
        CPUOffloadOptimizer([params[0], torch.nn.Parameter(torch.zeros(3, device="meta"))])
    with pytest.raises(ValueError, match="lr"):
        CPUOffloadOptimizer(params, mo.AdamW8bit, offload_gradients=True, lr=-1.0)
    assert all(not p._post_accumulate_grad_hooks for p in params)  # no hook left behind
    with pytest.raises(ValueError, match="needs offload_gradients=True"):
        CPUOffloadOptimizer(params, step_in_backward=True)
    with pytest.raises(ValueError, match="more than once"):
        CPUOffloadOptimizer([params[0], params[0]])
    opt = CPUOffloadOptimizer(params, mo.AdamW8bit, lr=1e-2)
    with pytest.raises(ValueError, match="cannot be added after construction"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))]})
    assert len(opt.param_groups) == 1 and len(opt.param_groups[0]["params"]) == len(params)


def test_zero_grad_during_the_step_is_refused(monkeypatch):
    model = make_model()
    opt = CPUOffloadOptimizer(model.parameters(), mo.AdamW8bit, lr=1e-2)
    seen = []
    inner_step = opt.optimizer.step

    def step_that_calls_zero_grad(*a, **k):
        try:
            opt.zero_grad()
        except RuntimeError as e:
            seen.append(str(e))
        return inner_step(*a, **k)

    monkeypatch.setattr(opt.optimizer, "step", step_that_calls_zero_grad)
    loss_of(model, batch(0, torch.float32)).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    opt.step()
    assert seen and "middle of a step" in seen[0]
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters()))


def test_a_refused_step_changes_nothing():
    """A state the wrapped step refuses (another dtype): its error from step(), nothing
    stepped (parameters, other states), no host gradient left behind."""
    model = make_model()
    opt = CPUOffloadOptimizer(model.parameters(), mo.AdamW8bit, lr=1e-2)
    loss_of(model, batch(0, torch.float32)).backward()
    opt.step()
    hosts = opt.optimizer.param_groups[0]["params"]
    opt.optimizer.state[hosts[-1]]["state1"] = opt.optimizer.state[hosts[-1]]["state1"].double()
    before = [p.detach().clone() for p in model.parameters()]
    steps = [opt.optimizer.state[h]["step"].item() for h in hosts]
    loss_of(model, batch(1, torch.float32)).backward()
    with pytest.raises(TypeError, match="state 'state1' is torch.float64"):
        opt.step()
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert steps == [opt.optimizer.state[h]["step"].item() for h in hosts]
    assert all(h.grad is None for h in hosts)


def test_stream_seeds_are_never_zero():
    """The step in backward seeds each tensor with _core.stream_seed(bucket seed, its
    place k) = seed + 0x9e3779b97f4a7c15 * k (mod 2**64), and a seed of 0 would turn its
    stochastic rounding off: sr_seed never returns a seed for which a place a call can
    have (k < 2**31) gives 0. Bucket numbers are made here whose mix lands on such a seed
    (the mix is invertible); other seeds are the bits they always were."""
    from memfit.optim import _core
    mask, golden = (1 << 64) - 1, 0x9E3779B97F4A7C15

    def unshift(x, r):  # the inverse of x ^ (x >> r)
        y = x
        for _ in range(64 // r + 1):
            y = x ^ (y >> r)
        return y & mask

    for k in (1, 3, 2**20 + 1, 2**31 - 1):  # a seed's zero place is odd (seeds are odd)
        bad = -golden * k & mask  # bad + golden * k == 0
        z = unshift(unshift(bad, 31) * pow(0x94D049BB133111EB, -1, 1 << 64) & mask, 30)
        seed = _core.sr_seed(0, 0, z - 1)  # its mix is `bad`
        assert seed != bad and seed % 2 == 1
        assert _core.stream_seed(seed, k) != 0
        assert (-seed * pow(golden, -1, 1 << 64)) & mask >= 2**31  # no place gives 0
        assert _core.stream_seed(bad, k) == 0  # what the shift avoids
    assert _core.sr_seed(0, 0, 0) == 0x94D049BA3A91829D  # unchanged for other seeds
    assert _core.sr_seed(12345, 7, 2) == 0x48B4E3F94D0334D3
    with pytest.raises(ValueError, match="position"):
        _core.stream_seed(1, 2**31)


def test_step_params_refuses_stale_places():
    """_step_params with places made before a group's state format changed (min_8bit_size
    edited in the middle of a step): refused, nothing updated."""
    model = make_model(torch.bfloat16)
    inner = mo.AdamW8bit(groups(model), lr=1e-2)
    places = inner._sr_positions({id(p) for p in model.parameters()})
    inner.param_groups[0]["min_8bit_size"] = 10**9  # the weights' states would be float32
    loss_of(model, batch(0, torch.bfloat16)).backward()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r"param_groups\[0\]: a parameter's state format"):
        inner._step_params(list(model.parameters()), places)
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert not inner.state and all(g.get("sr_step", 0) == 0 for g in inner.param_groups)
    inner._step_params(list(model.parameters()),
                       inner._sr_positions({id(p) for p in model.parameters()}))
    assert not any(torch.equal(a, p) for a, p in zip(before, model.parameters()))
