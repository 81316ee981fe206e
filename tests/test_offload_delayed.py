"""memfit.optim.CPUOffloadOptimizer(delayed_update=...) on the CPU: ZeRO-Offload's
one-step-delayed update, bit for bit against a reference computed by hand with the
wrapped optimizer (a "device" model that runs forward and backward on the parameters
the delayed schedule leaves there, and the wrapped optimizer stepping the gradients it
gives)."""

import copy
import gc
import threading
import weakref

import memfit
import memfit.optim as mo
import pytest
import torch
from memfit._C import MemfitTypeError, MemfitValueError
from memfit.optim import _offload_pipeline as pipeline
from memfit.optim.offload import CPUOffloadOptimizer
from test_offload import assert_same, batch, groups, loss_of, make_model


def params_of(model):
    return [p.detach().clone() for p in model.parameters()]


def equal(a, b):
    return len(a) == len(b) and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b))


def reference(cls, kw, dtype, steps, undelayed=1, accum=2, clip=None, flush_at=(),
              scaler=None, inf_at=None, lr_at=None, set_to_none=True, step_size=2,
              skip_calls_no_step=False, in_kernel=False):
    """The delayed schedule by hand: ``dev`` runs forward and backward; the wrapped
    optimizer steps ``master`` with dev's gradients; after step t, dev holds the
    parameters after t (an undelayed step, the first ``undelayed``, or a flush at t) or
    those before it (a delayed step: update t reaches dev at step t+1); unchanged when a
    scaler skips the optimizer's step() (``skip_calls_no_step``: torch's default path,
    at ``inf_at``). Returns dev's parameters after each step() and the master model and
    optimizer at the end."""
    dev, master = make_model(dtype), make_model(dtype)
    ref = cls(groups(master, cls), **kw)
    if in_kernel:
        memfit.amp.scale_in_kernel(ref)
    sched = torch.optim.lr_scheduler.StepLR(ref, step_size=step_size, gamma=0.5)
    after = []
    for t in range(1, steps + 1):
        for a in range(accum):
            x = batch(t * accum + a, dtype)
            if t == inf_at and a == 0:
                x[0, 0] = float("inf")
            loss = loss_of(dev, x)
            (scaler.scale(loss) if scaler else loss).backward()
        for p, q in zip(dev.parameters(), master.parameters()):
            q.grad = p.grad.clone()
            if set_to_none:
                p.grad = None
            else:
                p.grad.zero_()
        if clip is not None:
            if scaler:
                scaler.unscale_(ref)
            torch.nn.utils.clip_grad_norm_([p for g in ref.param_groups for p in g["params"]], clip)
        if lr_at is not None and t == lr_at[0]:
            ref.param_groups[0]["lr"] = lr_at[1]
        before = params_of(master)
        if scaler:
            scaler.step(ref)
            scaler.update()
        else:
            ref.step()
        sched.step()
        ref.zero_grad()
        now = before if t > undelayed and t not in flush_at else params_of(master)
        if skip_calls_no_step and t == inf_at:
            now = params_of(dev)
        with torch.no_grad():
            for p, v in zip(dev.parameters(), now):
                p.copy_(v)
        after.append(params_of(dev))
    return after, master, ref


def run(opt, model, dtype, steps, accum=2, clip=None, flush_at=(), scaler=None, inf_at=None,
        lr_at=None, check=None, set_to_none=True):
    """The training loop a user writes, with the offloader; ``check(t)`` after each step."""
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for t in range(1, steps + 1):
        for a in range(accum):
            x = batch(t * accum + a, dtype)
            if t == inf_at and a == 0:
                x[0, 0] = float("inf")
            loss = loss_of(model, x)
            (scaler.scale(loss) if scaler else loss).backward()
        if clip is not None:
            if scaler:
                scaler.unscale_(opt)
            if opt._offload_grads:
                opt.clip_grad_norm_(clip)
            else:
                torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]],
                                               clip)
        if lr_at is not None and t == lr_at[0]:
            opt.param_groups[0]["lr"] = lr_at[1]
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        sched.step()
        opt.zero_grad(set_to_none=set_to_none)
        if t in flush_at:
            opt.flush()
        if check is not None:
            check(t)


CASES = [(mo.AdamW8bit, dict(lr=1e-2, weight_decay=0.1)), (mo.AdamW, dict(lr=1e-2)),
         (mo.Muon8bit, dict(lr=2e-2))]


@pytest.mark.parametrize("chunk_bytes", [pipeline.DEFAULT_CHUNK_BYTES, 1],
                         ids=["one-chunk", "chunk-per-tensor"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("offload_gradients", [False, True], ids=["grads-dev", "grads-host"])
@pytest.mark.parametrize("cls,kw", CASES, ids=[c.__name__ for c, _ in CASES])
def test_delayed_steps_are_the_wrapped_optimizer_on_the_delayed_gradients(cls, kw,
                                                                          offload_gradients, dtype,
                                                                          chunk_bytes):
    """6 steps of 2 accumulated backwards, two param groups, a scheduler: after each
    step() the model holds the parameters before that update (after it for the first,
    undelayed step); after flush() those of every step; states equal. The step in one
    chunk and in a chunk per tensor (_offload_pipeline)."""
    steps = 6
    expect, master, ref = reference(cls, kw, dtype, steps)
    model = make_model(dtype)
    opt = CPUOffloadOptimizer(groups(model, cls), cls, offload_gradients=offload_gradients,
                              delayed_update=True, chunk_bytes=chunk_bytes, **kw)
    assert len(opt._chunks) == (1 if chunk_bytes > 1 else len(list(model.parameters())))
    seen = []
    run(opt, model, dtype, steps, check=lambda t: seen.append(params_of(model)))
    for t, (got, want) in enumerate(zip(seen, expect), 1):
        assert equal(got, want), t
    assert not equal(seen[-1], params_of(master))  # the last update is still on the host
    opt.flush()
    assert_same(model, master, opt, ref)
    assert opt.param_groups[0]["lr"] == ref.param_groups[0]["lr"] == kw["lr"] * 0.125


@pytest.mark.parametrize("offload_gradients", [False, True], ids=["grads-dev", "grads-host"])
def test_undelayed_steps_first_and_flushes(offload_gradients):
    """delayed_update=3: three undelayed steps, then delayed ones; a flush() puts the
    update on the device, so the next step's gradient is a fresh one."""
    kw, steps = dict(lr=1e-2), 8
    expect, master, ref = reference(mo.AdamW8bit, kw, torch.bfloat16, steps, undelayed=3,
                                    flush_at=(5,))
    model = make_model(torch.bfloat16)
    opt = CPUOffloadOptimizer(groups(model), mo.AdamW8bit, offload_gradients=offload_gradients,
                              delayed_update=3, **kw)
    seen = []
    run(opt, model, torch.bfloat16, steps, flush_at=(5,),
        check=lambda t: seen.append(params_of(model)))
    assert all(equal(a, b) for a, b in zip(seen, expect))
    # the schedule differs from delaying every step after the first
    other, _, _ = reference(mo.AdamW8bit, kw, torch.bfloat16, steps)
    assert not equal(other[-1], expect[-1])
    opt.flush()
    assert_same(model, master, opt, ref)


def test_gradients_kept_on_the_device_and_zeroed_in_place():
    """offload_gradients=False with zero_grad(set_to_none=False): the device gradients
    are zeroed without waiting for the step in flight, and the next backward adds into
    them, as for the wrapped optimizer."""
    kw, steps = dict(lr=1e-2), 4
    expect, master, ref = reference(mo.AdamW8bit, kw, torch.bfloat16, steps, set_to_none=False)
    model = make_model(torch.bfloat16)
    opt = CPUOffloadOptimizer(groups(model), mo.AdamW8bit, delayed_update=True, **kw)
    seen = []
    run(opt, model, torch.bfloat16, steps, set_to_none=False,
        check=lambda t: seen.append(params_of(model)))
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
    assert all(equal(a, b) for a, b in zip(seen, expect))
    opt.flush()
    assert_same(model, master, opt, ref)


def test_clipping_and_lr_changes_with_delay():
    """opt.clip_grad_norm_ clips the gradients of the step it precedes (the norms taken
    as they land in the second arena); an lr set through param_groups before step()
    is the one that step uses."""
    kw, steps = dict(lr=1e-2), 5
    expect, master, ref = reference(mo.AdamW8bit, kw, torch.float32, steps, clip=0.05,
                                    lr_at=(3, 4e-3))
    model = make_model()
    opt = CPUOffloadOptimizer(groups(model), mo.AdamW8bit, offload_gradients=True,
                              delayed_update=True, **kw)
    seen = []
    run(opt, model, torch.float32, steps, clip=0.05, lr_at=(3, 4e-3),
        check=lambda t: seen.append(params_of(model)))
    assert all(equal(a, b) for a, b in zip(seen, expect))
    opt.flush()
    assert_same(model, master, opt, ref)


@pytest.mark.filterwarnings("ignore:.*already NaN/Inf before backward")
@pytest.mark.parametrize("kind", ["memfit", "torch", "torch-in-kernel"])
@pytest.mark.parametrize("offload_gradients", [False, True], ids=["grads-dev", "grads-host"])
def test_scaler_with_delay_skips_the_step_with_inf(offload_gradients, kind):
    """memfit's GradScaler hands found_inf (known before step()) and its scale (copied at
    step(): the scaler's update changes it in place while the step is in flight): the
    step with an inf gradient changes nothing, the update before it still reaches the
    device; torch's after memfit.amp.scale_in_kernel too. torch's scaler on its default
    path does not call step() then: the update before it reaches the device at the next
    step()."""
    kw, steps = dict(lr=1e-2), 6
    mk = ((lambda: memfit.amp.GradScaler("cpu", init_scale=2.0**10)) if kind == "memfit"
          else (lambda: torch.amp.GradScaler("cpu", init_scale=2.0**10)))
    rscaler, scaler = mk(), mk()
    expect, master, ref = reference(mo.AdamW8bit, kw, torch.float32, steps, clip=1.0,
                                    scaler=rscaler, inf_at=4,
                                    skip_calls_no_step=kind == "torch",
                                    in_kernel=kind == "torch-in-kernel")
    model = make_model()
    opt = CPUOffloadOptimizer(groups(model), mo.AdamW8bit, offload_gradients=offload_gradients,
                              delayed_update=True, **kw)
    if kind == "torch-in-kernel":
        memfit.amp.scale_in_kernel(opt)
    seen = []
    run(opt, model, torch.float32, steps, clip=1.0, scaler=scaler, inf_at=4,
        check=lambda t: seen.append(params_of(model)))
    assert scaler.get_scale() == rscaler.get_scale() == 2.0**9
    assert all(equal(a, b) for a, b in zip(seen, expect))
    opt.flush()
    assert_same(model, master, opt, ref)


def test_step_returns_before_the_host_step_and_the_loop_does_not_wait():
    """While the host step is held (a step pre-hook on the wrapped optimizer), step()
    returns, zero_grad() returns, an LR scheduler writes the next lr, and forward and
    backward of the next batch run on the parameters from before the update."""
    model = make_model()
    opt = CPUOffloadOptimizer(groups(model), mo.AdamW8bit, offload_gradients=True,
                              delayed_update=True, lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    gate, entered, lrs = threading.Event(), threading.Event(), []

    def hold(inner, args, kwargs):
        lrs.append(inner.param_groups[0]["lr"])
        entered.set()
        assert gate.wait(30)

    opt.optimizer.register_step_pre_hook(hold)
    gate.set()
    loss_of(model, batch(1, torch.float32)).backward()
    opt.step()  # undelayed: waits for the host step
    sched.step()
    opt.zero_grad()
    theta1 = params_of(model)
    gate.clear()
    entered.clear()
    loss_of(model, batch(2, torch.float32)).backward()
    opt.step()  # delayed: returns while the host step is held
    assert entered.wait(30) and not gate.is_set()
    sched.step()  # no wait: param_groups while the step is in flight
    assert opt.param_groups[0]["lr"] == 2.5e-3  # the scheduler's write, for the next step
    opt.zero_grad()
    loss_of(model, batch(3, torch.float32)).backward()  # lands in the second arena
    assert equal(params_of(model), theta1) and not gate.is_set()
    gate.set()
    state = opt.state  # waits for step 2: its states, not those of step 1
    assert all(st["step"].item() == 2 for st in state.values())
    assert equal(params_of(model), theta1)  # only a step() or flush() moves the model
    opt.step()
    sched.step()
    opt.flush()
    assert lrs == [1e-2, 5e-3, 2.5e-3]  # each step used the lr it was called with
    assert opt.optimizer.param_groups[0]["sr_step"] == 3
    # step 2 read its own gradients (batch 3's landed beside them), with its own lr
    _, master, ref = reference(mo.AdamW8bit, dict(lr=1e-2), torch.float32, 3, accum=1,
                               step_size=1)
    assert_same(model, master, opt, ref)
    opt.close()


class HeldLog(list):
    """An event log (``opt._events``) that holds the worker at the step's
    "host_step_start" (a chunked step's first job, before any chunk steps) until
    ``gate`` is set."""

    def __init__(self):
        super().__init__()
        self.gate, self.entered = threading.Event(), threading.Event()

    def append(self, item):
        super().append(item)
        if item[1] == "host_step_start" and not self.gate.is_set():
            self.entered.set()
            assert self.gate.wait(30)


@pytest.mark.parametrize("offload_gradients", [False, True], ids=["grads-dev", "grads-host"])
def test_chunked_step_in_flight_reads_its_own_gradients_and_queues_no_copy(offload_gradients):
    """The step in chunks (a chunk per tensor), held before its first chunk while the
    next backward runs (its gradients land, with offload_gradients, in the second
    arena): the step steps its own gradients; once it has run, the device still holds
    the parameters before it (no copy back was queued: no chunk_h2d logged) until the
    next step() applies it, one copy back per chunk."""
    kw = dict(lr=1e-2)
    model = make_model()
    opt = CPUOffloadOptimizer(groups(model), mo.AdamW8bit, offload_gradients=offload_gradients,
                              delayed_update=True, chunk_bytes=1, **kw)
    assert len(opt._chunks) == 6 and pipeline.chunkable(opt.optimizer)
    log = opt._events = HeldLog()
    log.gate.set()
    loss_of(model, batch(1, torch.float32)).backward()
    opt.step()  # undelayed
    opt.zero_grad()
    theta1 = params_of(model)
    log.gate.clear()
    n = len(log)
    loss_of(model, batch(2, torch.float32)).backward()
    opt.step()  # delayed: returns; the worker holds before the first chunk
    assert log.entered.wait(30)
    opt.zero_grad()
    loss_of(model, batch(3, torch.float32)).backward()
    log.gate.set()
    opt._worker.wait()  # step 2 has run
    assert equal(params_of(model), theta1)
    kinds = [k for _, k, _ in log[n:]]
    assert kinds.count("chunk_step_end") == 6 and "chunk_h2d" not in kinds
    n = len(log)
    opt.step()  # applies step 2 (its copies back), then queues step 3
    kinds = [k for _, k, _ in log[n:]]
    assert kinds.count("chunk_h2d") == 6  # (step() waited for them)
    assert not equal(params_of(model), theta1)
    opt.flush()
    kinds = [k for _, k, _ in log[n:] if k in ("chunk_h2d", "host_step_start", "host_step_end")]
    assert kinds == ["chunk_h2d"] * 6 + ["host_step_start", "host_step_end"] + ["chunk_h2d"] * 6
    _, master, ref = reference(mo.AdamW8bit, kw, torch.float32, 3, accum=1, step_size=100)
    assert_same(model, master, opt, ref, skip=("params", "initial_lr"))  # (ref's scheduler)
    opt.close()


def test_dropped_with_a_chunked_step_in_flight_is_collected_and_applies_it():
    """The delayed step's queued jobs do not hold the offloader (_offload_delayed._Handle):
    dropped while its step is held on the worker, it is collected at once, and its
    finalizer waits for the step and puts the update on the model."""
    _, master, _ = reference(mo.AdamW8bit, dict(lr=1e-2), torch.float32, 2, accum=1,
                             step_size=100)
    model = make_model()
    opt = CPUOffloadOptimizer(groups(model), mo.AdamW8bit, offload_gradients=True,
                              delayed_update=True, chunk_bytes=1, lr=1e-2)
    log = opt._events = HeldLog()
    log.gate.set()
    loss_of(model, batch(1, torch.float32)).backward()
    opt.step()
    opt.zero_grad()
    log.gate.clear()
    loss_of(model, batch(2, torch.float32)).backward()
    opt.step()  # delayed, held before its first chunk
    assert log.entered.wait(30)
    ref = weakref.ref(opt)
    timer = threading.Timer(0.2, log.gate.set)  # the finalizer waits for the step
    timer.start()
    del opt
    assert ref() is None and log.gate.is_set()
    assert equal(params_of(model), params_of(master))
    timer.join()


def test_state_dict_includes_the_last_update_and_resumes_bit_exactly():
    """state_dict() after step t waits for it and puts it on the device (the model's
    parameters and the states agree); a new delayed offloader loaded from both goes on
    as the original does after the state_dict() (delayed from its first step: the
    undelayed steps are counted by the wrapped optimizer's sr_step)."""
    dtype, kw = torch.bfloat16, dict(lr=1e-2)
    model = make_model(dtype)
    opt = CPUOffloadOptimizer(groups(model), mo.AdamW8bit, offload_gradients=True,
                              delayed_update=True, **kw)
    run(opt, model, dtype, 3)
    saved = copy.deepcopy(opt.state_dict())
    saved_model = copy.deepcopy(model.state_dict())
    expect, master, ref = reference(mo.AdamW8bit, kw, dtype, 3, flush_at=(3,))
    assert equal(params_of(model), params_of(master))  # update 3 is on the model
    assert all(st["step"].item() == 3 for st in saved["state"].values() if "step" in st)
    tail = []
    for t in range(4, 7):
        for a in range(2):
            loss_of(model, batch(t * 2 + a, dtype)).backward()
        opt.step()
        opt.zero_grad()
        tail.append(params_of(model))
    opt.flush()

    model2 = make_model(dtype, seed=1)
    model2.load_state_dict(saved_model)
    opt2 = CPUOffloadOptimizer(groups(model2), mo.AdamW8bit, offload_gradients=True,
                               delayed_update=True, **kw)
    opt2.load_state_dict(saved)
    tail2 = []
    for t in range(4, 7):
        for a in range(2):
            loss_of(model2, batch(t * 2 + a, dtype)).backward()
        opt2.step()
        opt2.zero_grad()
        tail2.append(params_of(model2))
    assert all(equal(a, b) for a, b in zip(tail, tail2))
    assert equal(tail2[0], params_of(master))  # step 4 was delayed in the resumed run too
    opt2.flush()
    assert_same(model2, model, opt2, opt)


def test_load_state_dict_drops_the_update_in_flight():
    """load_state_dict re-reads the host copies from the model: the update in flight
    is not put on the device afterwards (the model's parameters win)."""
    model = make_model()
    opt = CPUOffloadOptimizer(groups(model), mo.AdamW8bit, delayed_update=True, lr=1e-2)
    run(opt, model, torch.float32, 2)
    saved = copy.deepcopy(opt.state_dict())
    run(opt, model, torch.float32, 1)  # a delayed step in flight
    on_device = params_of(model)
    opt.load_state_dict(saved)
    opt.flush()
    assert equal(params_of(model), on_device)
    assert equal([p.detach() for g in opt.optimizer.param_groups for p in g["params"]],
                 [p.detach() for g in groups(model) for p in g["params"]])


@pytest.mark.parametrize("how", ["close", "with", "del"])
def test_closing_or_dropping_puts_the_last_update_on_the_model(how):
    expect, master, _ = reference(mo.AdamW8bit, dict(lr=1e-2), torch.float32, 3)
    model = make_model()
    opt = CPUOffloadOptimizer(groups(model), mo.AdamW8bit, offload_gradients=True,
                              delayed_update=True, lr=1e-2)
    if how == "with":
        with opt:
            run(opt, model, torch.float32, 3)
            assert equal(params_of(model), expect[2])  # update 3 in flight
    else:
        run(opt, model, torch.float32, 3)
        if how == "close":
            opt.close()
        else:
            del opt  # no gc.collect(): nothing else holds it
    assert equal(params_of(model), params_of(master))
    assert sum(len(p._post_accumulate_grad_hooks or {}) for p in model.parameters()) == 0
    gc.collect()


def test_an_error_in_the_delayed_step_surfaces_at_the_next_wait():
    """The host step of t fails after step() returned: the next step() raises it (its
    gradients stay for a retry), nothing was changed by the failed step, and training
    goes on."""
    model = make_model()
    opt = CPUOffloadOptimizer(groups(model), mo.AdamW8bit, offload_gradients=True,
                              delayed_update=True, lr=1e-2)
    fail = [False]

    def boom(inner, args, kwargs):
        if fail[0]:
            fail[0] = False
            raise RuntimeError("host step failed")

    opt.optimizer.register_step_pre_hook(boom)
    run(opt, model, torch.float32, 2)
    opt.flush()
    before, sd = params_of(model), copy.deepcopy(opt.optimizer.state_dict())
    fail[0] = True
    loss_of(model, batch(10, torch.float32)).backward()
    opt.step()  # returns: the failure is on the worker
    loss_of(model, batch(11, torch.float32)).backward()
    with pytest.raises(RuntimeError, match="host step failed"):
        opt.step()
    assert equal(params_of(model), before)
    assert opt.optimizer.state_dict()["param_groups"] == sd["param_groups"]  # sr_step too
    opt.step()  # the landed gradients of batch 11
    opt.flush()
    assert not equal(params_of(model), before)


def test_a_step_after_close_raises_and_changes_nothing():
    model = make_model()
    opt = CPUOffloadOptimizer(groups(model), mo.AdamW8bit, offload_gradients=True,
                              delayed_update=True, lr=1e-2)
    run(opt, model, torch.float32, 2)
    opt.close()
    before, groups_before = params_of(model), copy.deepcopy(opt.optimizer.state_dict())
    with pytest.raises(RuntimeError, match="closed"):
        opt.step()  # no gradient: nothing submitted before the step itself
    assert opt._delayed.front is None and not opt._delayed._pending
    assert equal(params_of(model), before)
    assert opt.state_dict()["param_groups"] == groups_before["param_groups"]


def test_refusals_name_the_argument():
    model = make_model()
    for bad, err in (("yes", MemfitTypeError), (1.5, MemfitTypeError), (0, MemfitValueError),
                     (-2, MemfitValueError)):
        with pytest.raises(err, match="delayed_update"):
            CPUOffloadOptimizer(model.parameters(), delayed_update=bad)
    with pytest.raises(MemfitValueError, match="delayed_update.*step_in_backward"):
        CPUOffloadOptimizer(model.parameters(), offload_gradients=True, step_in_backward=True,
                            delayed_update=True)
    with pytest.raises(MemfitValueError, match="delayed_update with overlap_forward"):
        CPUOffloadOptimizer(model.parameters(), overlap_forward=True, delayed_update=True)
    with pytest.raises(MemfitValueError, match="delayed_update with keep_on_device_below"):
        CPUOffloadOptimizer(model.parameters(), keep_on_device_below=100, delayed_update=2)
    with pytest.raises(MemfitValueError, match="delayed_update needs offload=True"):
        CPUOffloadOptimizer(model.parameters(), offload=False, step_in_backward=True,
                            delayed_update=True)
    assert sum(len(p._post_accumulate_grad_hooks or {}) for p in model.parameters()) == 0


def test_off_by_default():
    """Without delayed_update (or with False) step() returns with the update on the
    model: the path every other offload test runs."""
    for extra in ({}, dict(delayed_update=False)):
        model, ref_model = make_model(), make_model()
        opt = CPUOffloadOptimizer(groups(model), mo.AdamW8bit, lr=1e-2, **extra)
        ref = mo.AdamW8bit(groups(ref_model), lr=1e-2)
        assert opt._delayed is None
        for m, o in ((model, opt), (ref_model, ref)):
            loss_of(m, batch(0, torch.float32)).backward()
            o.step()
            o.zero_grad()
        assert_same(model, ref_model, opt, ref)
