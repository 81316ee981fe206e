"""memfit.optim.CPUOffloadOptimizer's queue jobs without Python (issue 40, item 2): each
chunk's parameters go back to the device as native jobs of the host queue (a byte copy
that never takes the GIL), except a parameter whose bytes are not row-major (torch's
copy_ then), and zero_grad() does not wait for the chunks in flight with
overlap_forward. Every check is bit for bit against the wrapped optimizer."""

import threading

import memfit.optim as mo
import pytest
import torch
from memfit.optim import _offload_pipeline as pipeline
from memfit.optim.offload import CPUOffloadOptimizer
from test_offload import assert_same, batch, loss_of, make_model, train


def count_copies(opt, monkeypatch) -> tuple:
    """Counts the native copies the worker is given and the slots torch's copy_back gets
    (both still do their work)."""
    native, by_torch = [], []
    submit_copy = opt._worker.submit_copy
    monkeypatch.setattr(opt._worker, "submit_copy", lambda dst, src, *a: native.append(
        src.data_ptr()) or submit_copy(dst, src, *a))
    copy_back = pipeline.copy_back
    monkeypatch.setattr(pipeline, "copy_back", lambda o, slots, *a: by_torch.extend(
        s.index for s in slots) or copy_back(o, slots, *a))
    return native, by_torch


@pytest.mark.parametrize("chunk_bytes", [1, 64 << 20], ids=["tensor-chunks", "one-chunk"])
@pytest.mark.parametrize("offload_gradients", [False, True], ids=["grads-dev", "grads-host"])
def test_copies_back_are_native_queue_jobs(chunk_bytes, offload_gradients, monkeypatch):
    """Every parameter (all contiguous) goes back as one native copy per step, from its
    master; torch's copy_back copies none; the bits are the wrapped optimizer's."""
    dtype = torch.bfloat16
    model, ref_model = make_model(dtype), make_model(dtype)
    opt = CPUOffloadOptimizer(model.parameters(), mo.AdamW8bit, lr=1e-2,
                              chunk_bytes=chunk_bytes, offload_gradients=offload_gradients)
    ref = mo.AdamW8bit(ref_model.parameters(), lr=1e-2)
    native, by_torch = count_copies(opt, monkeypatch)
    train(model, opt, steps=3, dtype=dtype)
    train(ref_model, ref, steps=3, dtype=dtype)
    masters = sorted(s.host.data_ptr() for s in opt._slots)
    assert sorted(native) == sorted(masters * 3) and by_torch == []
    assert_same(model, ref_model, opt, ref)
    opt.close()


def transposed_first_weight(model):
    """model[0].weight with the same values, stored column-major (a dense tensor that is
    not contiguous: its bytes are not in row-major order)."""
    w = model[0].weight
    model[0].weight = torch.nn.Parameter(w.detach().t().contiguous().t())
    assert not model[0].weight.is_contiguous() and torch.equal(model[0].weight, w)
    return model


@pytest.mark.parametrize("offload_gradients", [False, True], ids=["grads-dev", "grads-host"])
def test_a_non_contiguous_parameter_keeps_torchs_copy(offload_gradients, monkeypatch):
    """A column-major weight (its master has its layout: empty_like) goes back by
    torch's copy_, which follows the strides; the other parameters natively; the bits
    (values and layout) are the wrapped optimizer's on the same model."""
    model = transposed_first_weight(make_model())
    ref_model = transposed_first_weight(make_model())
    opt = CPUOffloadOptimizer(model.parameters(), mo.AdamW8bit, lr=1e-2, chunk_bytes=1,
                              offload_gradients=offload_gradients)
    ref = mo.AdamW8bit(ref_model.parameters(), lr=1e-2)
    slot = opt._slot_of[id(model[0].weight)]
    assert not pipeline.copies_natively(opt, slot)
    assert all(pipeline.copies_natively(opt, s) for s in opt._slots if s is not slot)
    native, by_torch = count_copies(opt, monkeypatch)
    train(model, opt, steps=3)
    train(ref_model, ref, steps=3)
    assert by_torch == [slot.index] * 3 and len(native) == 5 * 3
    assert model[0].weight.stride() == ref_model[0].weight.stride() == (1, 96)
    assert_same(model, ref_model, opt, ref)
    opt.close()


def test_copies_natively_refuses_what_is_not_a_byte_copy():
    """The rule: same dtype, same byte size, both row-major, on the CPU here."""
    model = make_model()
    opt = CPUOffloadOptimizer(model.parameters(), lr=1e-2)
    s = opt._slots[0]
    assert pipeline.copies_natively(opt, s)
    for dev, host in ((s.dev, s.host.double()), (s.dev.detach()[:, :10], s.host),
                      (s.dev, s.host[:-1]), (s.dev.detach().t(), s.host.t())):
        assert not pipeline.copies_natively(opt, type(s)(dev, host, s.where, s.index))
    opt.close()


@pytest.mark.parametrize("set_to_none", [True, False], ids=["to-none", "to-zero"])
@pytest.mark.parametrize("offload_gradients", [False, True], ids=["grads-dev", "grads-host"])
def test_zero_grad_does_not_wait_for_the_chunks(offload_gradients, set_to_none, monkeypatch):
    """overlap_forward=True: the worker's step of the last layer's weight is held until
    the test releases it (or 30 s pass). step() and then zero_grad() return while it is
    held: the device gradients are cleared at once, the host gradients stay until the
    chunks that read them have run (the clearing is queued after them). 4 steps: bit for
    bit the wrapped optimizer, zero_grad(set_to_none) as given on both."""
    model, ref_model = make_model(), make_model()
    opt = CPUOffloadOptimizer(model.parameters(), mo.AdamW8bit, lr=1e-2, chunk_bytes=1,
                              overlap_forward=True, offload_gradients=offload_gradients)
    ref = mo.AdamW8bit(ref_model.parameters(), lr=1e-2)
    held = opt._slot_of[id(model[4].weight)]
    release, timed_out = threading.Event(), []
    step_bucket = opt.optimizer._step_bucket

    def held_step_bucket(group, hp, device, fmt, items, *a):
        if items[0][0] is held.host and not release.wait(30):
            timed_out.append(True)
        return step_bucket(group, hp, device, fmt, items, *a)

    monkeypatch.setattr(opt.optimizer, "_step_bucket", held_step_bucket)
    for s in range(4):
        x = batch(s, torch.float32)
        opt._events = []
        for m, o in ((model, opt), (ref_model, ref)):
            loss_of(m, x).backward()
            o.step()
            o.zero_grad(set_to_none=set_to_none)
        kinds = [k for _, k, _ in opt._events]
        # both returned while the held chunk is stepping: the step is not over
        assert not release.is_set() and not timed_out and "host_step_end" not in kinds
        if set_to_none:
            assert all(p.grad is None for p in model.parameters())
        else:
            assert all(p.grad is None or not p.grad.any() for p in model.parameters())
        if offload_gradients:  # the held chunk still reads its host gradient
            assert held.host.grad is not None and held.host.grad.any()
        release.set()
        y = batch(10 + s, torch.float32)
        assert torch.equal(model(y), ref_model(y)) and not timed_out  # waits per module
        for g in (opt.param_groups, ref.param_groups):  # (the offloader's waits for the step)
            grads = [p.grad for group in g for p in group["params"]]
            assert all((t is None) if set_to_none else (t is None or not t.any()) for t in grads)
        release.clear()
    assert_same(model, ref_model, opt, ref)
    opt.close()


def test_zero_grad_leaves_a_chunks_error_to_the_next_wait(monkeypatch):
    """overlap_forward=True: a chunk whose step raises does not make zero_grad() raise
    (it waits for nothing); the error is raised, once, by the next API that waits for the
    whole step (state_dict here). zero_grad() inside step() is still refused while the
    chunks are in flight (called from the step of the tensors kept on the device, on the
    caller's thread), clearing nothing."""
    model = make_model()
    opt = CPUOffloadOptimizer(model.parameters(), mo.AdamW8bit, lr=1e-2, chunk_bytes=1,
                              overlap_forward=True, offload_gradients=True,
                              keep_on_device_below=100)  # the biases stay on the device
    failing = opt._slot_of[id(model[2].weight)].host
    step_bucket = opt.optimizer._step_bucket
    refused = []

    def failing_step_bucket(group, hp, device, fmt, items, *a):
        if items[0][0] is failing:
            raise KeyError("chunk failed")
        if items[0][0] is model[0].bias:  # the caller's thread, the chunks queued
            assert opt._inflight.pending
            with pytest.raises(RuntimeError, match="nothing was cleared") as e:
                opt.zero_grad()
            refused.append(str(e.value))
            assert model[0].bias.grad is not None
        return step_bucket(group, hp, device, fmt, items, *a)

    monkeypatch.setattr(opt.optimizer, "_step_bucket", failing_step_bucket)
    loss_of(model, batch(0, torch.float32)).backward()
    opt.step()
    assert len(refused) == 1
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    with pytest.raises(KeyError, match="chunk failed"):
        opt.state_dict()
    assert all(s.host.grad is None for s in opt._slots)  # the queued clearing ran
    opt.state_dict()  # taken: raised once
    opt.close()


def test_the_next_backward_waits_for_zero_grads_queued_clearing(monkeypatch):
    """offload_gradients=True, overlap_forward=True, 2 backwards a step: zero_grad()'s
    clearing of the host gradients is held on the worker (until the test releases it,
    or 30 s pass) while the next forward runs. The step stays in flight until that job
    has run, so the first gradient of the next backward waits for it instead of landing
    beside it (which left the next landing writing into the host gradient it adds to);
    both backwards' gradients are summed (bits as the wrapped optimizer)."""
    from memfit.optim import _offload_grads

    model, ref_model = make_model(), make_model()
    opt = CPUOffloadOptimizer(model.parameters(), mo.AdamW8bit, lr=1e-2, chunk_bytes=1,
                              overlap_forward=True, offload_gradients=True)
    ref = mo.AdamW8bit(ref_model.parameters(), lr=1e-2)
    release, timed_out = threading.Event(), []
    clear = _offload_grads.clear_host_grads

    def held_clear(o, set_to_none):
        if not release.wait(30):
            timed_out.append(True)
        return clear(o, set_to_none)

    monkeypatch.setattr(_offload_grads, "clear_host_grads", held_clear)
    for s in range(3):
        for m, o in ((model, opt), (ref_model, ref)):
            for a in range(2):
                if o is opt and a == 0:  # the clearing is still held during the forward
                    threading.Timer(0.2, release.set).start()
                elif o is opt:  # the clearing has run before the second backward
                    release.set()
                    opt._worker.reach(opt._worker._queue.signal())
                    release.clear()
                loss_of(m, batch(2 * s + a, torch.float32)).backward()
            o.step()
            o.zero_grad()
    release.set()
    opt.state_dict()  # waits for the last step (overlap_forward: no forward after it)
    assert not timed_out
    assert_same(model, ref_model, opt, ref)
    opt.close()
