"""memfit.optim.CPUOffloadOptimizer's host side at the GPU's pace (issue 40): gradients
land in host buffers allocated once (an arena and a reused spill pool), the host step
runs on its own thread count with a passive OpenMP wait, and every mode stays bit for
bit the wrapped optimizer's."""

import os
import time

import memfit
import memfit.optim as mo
import pytest
import torch
from memfit import _C
from memfit.optim.offload import CPUOffloadOptimizer
from test_offload import assert_same, batch, groups, loss_of, make_model

# -- host buffers: allocated once ------------------------------------------------------------


def host_grads(opt):
    return [h.grad for g in opt.optimizer.param_groups for h in g["params"]]


@pytest.mark.parametrize("offload_gradients", [True, False], ids=["grads-host", "grads-dev"])
def test_no_host_buffer_is_allocated_after_the_second_step(offload_gradients, monkeypatch):
    """Two accumulated backwards per step (the second one's gradients go through spill
    buffers): after the second step no buffer is allocated, the host gradients are the
    same memory every step (views of one arena), and the numbers are the wrapped
    optimizer's."""
    dtype = torch.bfloat16
    model, ref_model = make_model(dtype), make_model(dtype)
    opt = CPUOffloadOptimizer(groups(model), mo.AdamW8bit, lr=1e-2,
                              offload_gradients=offload_gradients)
    ref = mo.AdamW8bit(groups(ref_model), lr=1e-2)
    seen = []
    step = opt.optimizer.step

    def recording_step(*a, **k):  # the host gradients the wrapped step reads
        seen.append([h.grad.data_ptr() for g in opt.optimizer.param_groups for h in g["params"]])
        return step(*a, **k)

    monkeypatch.setattr(opt.optimizer, "step", recording_step)

    def steps(m, o, first, n):
        for s in range(first, first + n):
            for a in range(2):
                loss_of(m, batch(2 * s + a, dtype)).backward()
            o.step()
            o.zero_grad()

    steps(model, opt, 0, 2)
    after_two = opt._staging.allocations
    # the arena, and with accumulation the ring of two spill buffers
    assert after_two == (3 if offload_gradients else 1)
    steps(model, opt, 2, 3)
    assert opt._staging.allocations == after_two
    assert len(seen) == 5 and all(ptrs == seen[0] for ptrs in seen)
    # one arena: every host gradient inside one allocation, none overlapping
    spans = sorted((p, p + h.numel() * h.element_size())
                   for p, h in zip(seen[0], [h for g in opt.optimizer.param_groups
                                             for h in g["params"]]))
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
    steps(ref_model, ref, 0, 5)
    assert_same(model, ref_model, opt, ref)


def test_step_in_backward_spill_buffers_are_reused():
    """step_in_backward keeps no host gradient between steps: its spill buffers go back
    to the pool once their tensor has stepped, so the pool never holds more buffers
    than there are parameters, however many steps run."""
    model = make_model(torch.bfloat16)
    opt = CPUOffloadOptimizer(model.parameters(), mo.AdamW8bit, lr=1e-2, offload_gradients=True,
                              step_in_backward=True)
    for s in range(6):
        loss_of(model, batch(s, torch.bfloat16)).backward()
        opt.step()
    assert 1 <= opt._staging.allocations <= 6
    assert all(g is None for g in host_grads(opt))
    assert not opt._staging._out  # every spill buffer is back in the pool


def test_zero_grad_keeps_the_arena_for_the_next_step():
    model, ref_model = make_model(), make_model()
    opt = CPUOffloadOptimizer(model.parameters(), mo.AdamW8bit, lr=1e-2, offload_gradients=True)
    ref = mo.AdamW8bit(ref_model.parameters(), lr=1e-2)
    for m, o in ((model, opt), (ref_model, ref)):
        loss_of(m, batch(0, torch.float32)).backward()
        o.step()
        o.zero_grad(set_to_none=False)  # zeroed in place: the next backward adds to zeros
        loss_of(m, batch(1, torch.float32)).backward()
        o.step()
        o.zero_grad()
        # the caller drops a host gradient by hand: the next one lands in the arena again
        loss_of(m, batch(2, torch.float32)).backward()
        if o is opt:
            opt.param_groups[0]["params"][0].grad = None  # (waits for the landings)
        else:
            ref_model[0].weight.grad = None
        loss_of(m, batch(3, torch.float32)).backward()
        o.step()
    assert_same(model, ref_model, opt, ref)
    assert opt._staging.allocations == 3  # the arena and the ring of two spill buffers


# -- threads -----------------------------------------------------------------------------------

def test_host_threads_default_and_argument():
    """The host step's thread count: cores - 1 by default (at least 1), or the
    argument, on the worker thread only (the caller's own count is unchanged)."""
    model = make_model()
    cores = len(os.sched_getaffinity(0))
    before = memfit.get_num_threads()
    for arg, want in ((None, max(1, cores - 1)), (3, 3)):
        opt = CPUOffloadOptimizer(model.parameters(), lr=1e-2, host_threads=arg)
        assert opt.host_threads == want
        seen = []
        opt._worker.submit(lambda: seen.append(_C.get_num_threads()))
        opt._worker.wait()
        assert seen == [want]
        assert memfit.get_num_threads() == before
        opt.close()
    with pytest.raises(memfit.MemfitValueError, match="host_threads"):
        CPUOffloadOptimizer(model.parameters(), host_threads=0)
    with pytest.raises(memfit.MemfitTypeError, match="host_threads"):
        CPUOffloadOptimizer(model.parameters(), host_threads=True)
    assert all(not p._post_accumulate_grad_hooks for p in model.parameters())


def test_thread_count_for_this_thread_only():
    before = memfit.get_num_threads()
    try:
        _C.set_thread_num_threads(1)
        assert memfit.get_num_threads() == 1
        with pytest.raises(ValueError, match="n: must be >= 0"):
            _C.set_thread_num_threads(-1)
    finally:
        _C.set_thread_num_threads(0)
    assert memfit.get_num_threads() == before


# -- the host step hidden behind backward (a fake device: backward sleeps, GIL released) -----

class SlowBackward(torch.autograd.Function):
    """Identity forward; its backward sleeps (time.sleep releases the GIL), as a busy
    GPU keeps the autograd thread waiting while the host is free."""

    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        time.sleep(ctx.seconds)
        return g, None


def slow_loss(model, x, seconds):
    """The model's loss, with a sleeping backward between each Linear's gradients."""
    for layer in model:
        x = layer(x)
        if isinstance(layer, torch.nn.Linear):
            x = SlowBackward.apply(x, seconds)
    return (x.float() - 0.5).square().mean()


def test_step_in_backward_steps_while_backward_runs():
    """The issue's CPU check: with a backward longer than the host step, the tensors
    step while backward still runs (the offloader's own event log places each tensor's
    step against the end of backward), step() has at most the last layer's tensors
    left, and the bits are the wrapped optimizer's. No timing is asserted: a sleep of
    0.2 s between layers leaves the worker ample time on a loaded machine."""
    dtype = torch.bfloat16
    model, ref_model = make_model(dtype), make_model(dtype)
    opt = CPUOffloadOptimizer(groups(model), mo.AdamW8bit, lr=1e-2, offload_gradients=True,
                              step_in_backward=True)
    ref = mo.AdamW8bit(groups(ref_model), lr=1e-2)
    for s in range(2):
        opt._events = []
        slow_loss(model, batch(s, dtype), 0.2).backward()
        backward_end = time.perf_counter_ns()
        opt.step()
        ended = [(t, i) for t, kind, i in opt._events if kind == "tensor_end"]
        assert sorted(i for _, i in ended) == list(range(6))  # each tensor stepped once
        before = {i for t, i in ended if t < backward_end}
        # the later layers' weights and biases (gradients ready 0.2 s or more before
        # the end of backward) stepped during backward; after it, at most the first
        # layer's two tensors (the last gradients) are left to step()
        # (slots: the weights' group, then the biases': layer 0's are 0 and 3)
        assert {1, 2, 4, 5} <= before
        hooks = [d for _, kind, d in opt._events if kind == "hook"]
        assert sorted(i for i, _ in hooks) == list(range(6))
        loss_of(ref_model, batch(s, dtype)).backward()
        ref.step()
        ref.zero_grad()
    assert_same(model, ref_model, opt, ref)


def test_the_plain_step_starts_after_backward():
    """Without step_in_backward the host step waits for step() (a scaler, clipping or a
    next micro-batch may still come): the event log shows one host step after backward."""
    model = make_model()
    opt = CPUOffloadOptimizer(model.parameters(), lr=1e-2, offload_gradients=True)
    opt._events = []
    loss_of(model, batch(0, torch.float32)).backward()
    backward_end = time.perf_counter_ns()
    opt.step()
    starts = [t for t, kind, _ in opt._events if kind == "host_step_start"]
    assert len(starts) == 1 and starts[0] > backward_end


# -- clipping's norm, taken as the gradients land ------------------------------------------------

def mixed_model():
    """float32 and bfloat16 layers: torch sums the per-tensor norms grouped by dtype."""
    m = make_model()
    m[2].to(torch.bfloat16)
    return m


def mixed_loss(m, x):
    h = torch.nn.functional.gelu(m[0](x))
    h = torch.nn.functional.gelu(m[2](h.to(torch.bfloat16))).float()
    return (m[4](h) - 0.5).square().mean()


def test_clipping_norms_are_taken_as_gradients_land(monkeypatch):
    """From the second step on, the worker has each tensor's norm when backward ends, so
    clip_grad_norm_ takes no norm itself; the total equals torch's clip_grad_norm_ bit
    for bit (mixed dtypes: torch's grouping order), and so do the steps."""
    model, ref_model = mixed_model(), mixed_model()
    opt = CPUOffloadOptimizer(model.parameters(), mo.AdamW8bit, lr=1e-2, offload_gradients=True)
    ref = mo.AdamW8bit(ref_model.parameters(), lr=1e-2)
    calls = []
    foreach_norm = torch._foreach_norm
    for s in range(4):
        for a in range(2):
            mixed_loss(model, batch(2 * s + a, torch.float32)).backward()
            mixed_loss(ref_model, batch(2 * s + a, torch.float32)).backward()
        opt._worker.wait()
        monkeypatch.setattr(torch, "_foreach_norm",
                            lambda ts, *a: calls.append(len(ts)) or foreach_norm(ts, *a))
        norm = opt.clip_grad_norm_(0.05)
        monkeypatch.setattr(torch, "_foreach_norm", foreach_norm)
        assert sorted(calls) == ([] if s else [2, 4])  # step 0: taken at clip time, per dtype
        calls.clear()
        assert torch.equal(norm, torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 0.05))
        opt.step()
        ref.step()
        opt.zero_grad()
        ref.zero_grad()
    assert_same(model, ref_model, opt, ref)


def test_clipping_after_the_gradients_changed_takes_the_norms_again():
    """A scaler's unscale_ changes the host gradients in place (and does not bump their
    version counters): reading param_groups forgets the landed norms, so the norm is of
    the gradients as they are at clip time."""
    model, ref_model = make_model(), make_model()
    opt = CPUOffloadOptimizer(model.parameters(), mo.AdamW8bit, lr=1e-2, offload_gradients=True)
    ref = mo.AdamW8bit(ref_model.parameters(), lr=1e-2)
    for s in range(3):
        for m in (model, ref_model):
            loss_of(m, batch(s, torch.float32)).backward()
        inv = torch.full((1,), 0.25)
        for params in ([p for g in opt.param_groups for p in g["params"]],
                       list(ref_model.parameters())):
            torch._amp_foreach_non_finite_check_and_unscale_([p.grad for p in params],
                                                             torch.zeros(1), inv)
        assert torch.equal(opt.clip_grad_norm_(0.05),
                           torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 0.05))
        for o in (opt, ref):
            o.step()
            o.zero_grad()
    assert_same(model, ref_model, opt, ref)


# -- gradient accumulation with the step in backward: no_step() ----------------------------------

@pytest.mark.parametrize("offload", [True, False], ids=["host", "device"])
def test_no_step_accumulates_and_the_last_backward_steps(offload):
    """Three micro-batches, the first two under no_step(): the steps run during the last
    backward (the event log: before it ended, on the host) and equal the wrapped
    optimizer stepping the sum of the three, bit for bit (bf16, stochastic rounding).
    step() right after no_step() backwards steps the sums too."""
    dtype = torch.bfloat16
    model, ref_model = make_model(dtype), make_model(dtype)
    opt = CPUOffloadOptimizer(groups(model), mo.AdamW8bit, lr=1e-2, offload=offload,
                              offload_gradients=offload, step_in_backward=True)
    ref = mo.AdamW8bit(groups(ref_model), lr=1e-2)
    for s in range(3):
        opt._events = []
        for a in range(3):
            x = batch(3 * s + a, dtype)
            if a < 2 or s == 2:  # the third step: every backward under no_step()
                with opt.no_step():
                    slow_loss(model, x, 0.05 if offload else 0.0).backward()
            else:
                slow_loss(model, x, 0.05 if offload else 0.0).backward()
            backward_end = time.perf_counter_ns()
            loss_of(ref_model, x).backward()
            if a < 2:
                assert not any(k == "tensor_end" for _, k, _ in opt._events)  # nothing stepped
        if offload and s < 2:
            assert {1, 2, 4, 5} <= {i for t, k, i in opt._events
                                    if k == "tensor_end" and t < backward_end}
        opt.step()
        ref.step()
        opt.zero_grad()
        ref.zero_grad()
    assert_same(model, ref_model, opt, ref)
    with pytest.raises(memfit.MemfitValueError, match="no_step"):
        with CPUOffloadOptimizer(model.parameters(), offload_gradients=True).no_step():
            pass
