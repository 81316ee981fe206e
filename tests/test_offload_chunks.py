"""memfit.optim.CPUOffloadOptimizer's step in chunks (issue 40, _offload_pipeline): chunks of
about chunk_bytes of gradients, each copied in, stepped and copied back while the others
are (checked with a fake device: a slowed copy engine, a held worker, the event log's
order, never wall-clock thresholds); overlap_forward's per-module wait; small tensors
kept on the device; a GradScaler's inf check made as gradients land; step_in_backward's
FIFO buffer. Every check is bit for bit against the wrapped optimizer."""

import contextlib
import threading
import time

import memfit
import memfit.optim as mo
import pytest
import torch
from memfit import _C
from memfit.optim.offload import CPUOffloadOptimizer
from memfit.recipes import STAGING_SLOTS
from test_offload import assert_same, batch, groups, loss_of, make_model, train
from test_offload_pipeline import host_grads, slow_loss

# -- the step in chunks (_offload_pipeline) ------------------------------------------------------

def test_chunks_follow_backward_and_chunk_bytes():
    """Chunks take the slots in backward's order (the reverse of the parameters') and
    close once they hold chunk_bytes of gradients; chunk_bytes is checked."""
    model = make_model()  # 64x96, 96, 48x96, 48, 64x48, 64 float32 parameters
    sizes = [p.numel() * 4 for p in model.parameters()]
    opt = CPUOffloadOptimizer(model.parameters(), lr=1e-2)
    assert opt.chunk_bytes == 64 << 20 and len(opt._chunks) == 1
    assert [s.index for s in opt._chunks[0]] == [5, 4, 3, 2, 1, 0]
    opt = CPUOffloadOptimizer(model.parameters(), lr=1e-2, chunk_bytes=sizes[4] + 1)
    # 64x48 + 64 floats reach it; then 48 + 48x96; then 96 + 64x96
    assert [[s.index for s in c] for c in opt._chunks] == [[5, 4], [3, 2], [1, 0]]
    opt = CPUOffloadOptimizer(model.parameters(), lr=1e-2, chunk_bytes=1)
    assert [[s.index for s in c] for c in opt._chunks] == [[i] for i in range(5, -1, -1)]
    for bad, err in ((0, memfit.MemfitValueError), (-5, memfit.MemfitValueError),
                     (1.5, memfit.MemfitTypeError), (True, memfit.MemfitTypeError)):
        with pytest.raises(err, match="chunk_bytes"):
            CPUOffloadOptimizer(model.parameters(), lr=1e-2, chunk_bytes=bad)
    with pytest.raises(memfit.MemfitTypeError, match="overlap_forward"):
        CPUOffloadOptimizer(model.parameters(), lr=1e-2, overlap_forward=1)
    assert all(not p._post_accumulate_grad_hooks for p in model.parameters())


CHUNKED = [(mo.AdamW8bit, dict(lr=1e-2, weight_decay=0.1)), (mo.AdamW4bit, dict(lr=1e-2)),
           (mo.Muon8bit, dict(lr=2e-2)), (mo.LAMB8bit, dict(lr=1e-2)), (mo.AdamW, dict(lr=1e-2))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("offload_gradients", [False, True], ids=["grads-dev", "grads-host"])
@pytest.mark.parametrize("cls,kw", CHUNKED, ids=[c.__name__ for c, _ in CHUNKED])
def test_every_tensor_a_chunk_is_bit_identical(cls, kw, offload_gradients, dtype):
    """chunk_bytes=1: each tensor is a chunk of its own, stepped, landed and copied back
    on its own (the event log counts them); 5 steps of 2 accumulated backwards, two param
    groups, a scheduler: bit for bit the wrapped optimizer (stochastic rounding draws
    each tensor's bits by its bucket and place, whatever the chunks)."""
    model, ref_model = make_model(dtype), make_model(dtype)
    opt = CPUOffloadOptimizer(groups(model, cls), cls, chunk_bytes=1,
                              offload_gradients=offload_gradients, **kw)
    ref = cls(groups(ref_model, cls), **kw)
    opt._events = []
    for o, m in ((opt, model), (ref, ref_model)):
        train(m, o, dtype=dtype, scheduler=torch.optim.lr_scheduler.StepLR(o, 2, gamma=0.5))
    kinds = [k for _, k, _ in opt._events]
    assert kinds.count("chunk_step_start") == kinds.count("chunk_h2d") == 5 * 6
    assert kinds.count("host_step_start") == kinds.count("host_step_end") == 5
    assert_same(model, ref_model, opt, ref)


@pytest.mark.filterwarnings("ignore:.*already NaN/Inf before backward")
@pytest.mark.parametrize("kind", ["torch", "memfit"])
@pytest.mark.parametrize("offload_gradients", [False, True], ids=["grads-dev", "grads-host"])
def test_chunks_with_a_scaler_and_clipping(kind, offload_gradients):
    """A GradScaler's scale and found_inf reach every chunk's calls: the step with an inf
    gradient changes nothing, the others equal the wrapped optimizer's, with clipping
    (bf16 parameters, stochastic rounding, every tensor a chunk)."""
    dtype = torch.bfloat16
    make = ((lambda: torch.amp.GradScaler("cpu", init_scale=2.0**10)) if kind == "torch"
            else (lambda: memfit.amp.GradScaler("cpu", init_scale=2.0**10)))
    model, ref_model = make_model(dtype), make_model(dtype)
    opt = CPUOffloadOptimizer(groups(model), mo.AdamW8bit, lr=1e-2, chunk_bytes=1,
                              offload_gradients=offload_gradients)
    ref = mo.AdamW8bit(groups(ref_model), lr=1e-2)
    scaler, rscaler = make(), make()
    if kind == "memfit":
        memfit.amp.scale_in_kernel(opt)
        memfit.amp.scale_in_kernel(ref)

    def clip(m, o):
        return (o.clip_grad_norm_(1.0) if offload_gradients and o is opt
                else torch.nn.utils.clip_grad_norm_([p for g in groups(m) for p in g["params"]],
                                                    1.0))
    for steps, inf_at, c in ((2, None, clip), (1, 0, None), (2, None, None), (1, 0, clip)):
        train(model, opt, steps=steps, dtype=dtype, scaler=scaler, clip=c, inf_at=inf_at)
        train(ref_model, ref, steps=steps, dtype=dtype, scaler=rscaler, clip=c, inf_at=inf_at)
        assert scaler.get_scale() == rscaler.get_scale()
    assert scaler.get_scale() == 2.0**8  # backed off twice
    assert_same(model, ref_model, opt, ref)


def test_the_scaler_check_is_made_as_gradients_land(monkeypatch):
    """offload_gradients=True with memfit's scaler: from the second step on, the worker
    has checked every host gradient for inf/NaN as it landed, so the scaler's check
    before the step reads none of them on the caller's thread; the skip and the bits
    are as without offload."""
    model, ref_model = make_model(), make_model()
    opt = CPUOffloadOptimizer(model.parameters(), mo.AdamW8bit, lr=1e-2, offload_gradients=True)
    ref = mo.AdamW8bit(ref_model.parameters(), lr=1e-2)
    scaler = memfit.amp.GradScaler("cpu", init_scale=2.0**10)
    rscaler = memfit.amp.GradScaler("cpu", init_scale=2.0**10)
    unscale = _C.unscale_grads
    calls = []
    monkeypatch.setattr(_C, "unscale_grads", lambda views, *a: calls.append(
        (threading.current_thread().name, len(views))) or unscale(views, *a))
    for s in range(4):
        calls.clear()
        train(model, opt, steps=1, scaler=scaler, inf_at=0 if s == 2 else None)
        train(ref_model, ref, steps=1, scaler=rscaler, inf_at=0 if s == 2 else None)
        # the caller's checks: the offloader's, then the reference's; the worker's: one
        # per gradient landed (2 backwards of 6), once the scaler has asked
        ours = [n for name, n in calls if name == threading.current_thread().name]
        worker = [n for name, n in calls if name != threading.current_thread().name]
        assert ours == ([0, 6] if s else [6, 6]) and worker == ([1] * 12 if s else [])
        assert scaler.get_scale() == rscaler.get_scale()
    assert scaler.get_scale() == 2.0**9
    assert_same(model, ref_model, opt, ref)


def chunk_events(opt, kind) -> dict:
    """{chunk index: when} of one event kind in the log."""
    return {d: t for t, k, d in opt._events if k == kind}


def test_chunks_overlap_copy_in_step_and_copy_back(monkeypatch):
    """A fake device whose copy engine is slow: each chunk's device -> host copy waits
    (up to 30 s) for the host step of the chunk before it to start. A pipeline that
    stepped only after every copy would wait out the 30 s on every chunk; this one
    steps chunk k while chunk k+1 is copied, and copies chunk k back before chunk k+1
    steps (the event log's order; no time is measured). Bits as the wrapped optimizer."""
    from memfit.optim import _offload_pipeline as pipeline

    model, ref_model = make_model(torch.bfloat16), make_model(torch.bfloat16)
    opt = CPUOffloadOptimizer(model.parameters(), mo.AdamW8bit, lr=1e-2, chunk_bytes=1)
    ref = mo.AdamW8bit(ref_model.parameters(), lr=1e-2)
    copy_in = pipeline.copy_in
    waited_out = []

    def slow_copy_in(o, slots):
        started = chunk_events(o, "chunk_step_start")
        previous = next((ci for ci, c in enumerate(o._chunks) if c[0] is slots[0]), None) + 1
        deadline = time.monotonic() + 30
        while previous < len(o._chunks) and previous not in started:
            if time.monotonic() > deadline:
                waited_out.append(previous)
                break
            time.sleep(0.001)
            started = chunk_events(o, "chunk_step_start")
        return copy_in(o, slots)

    monkeypatch.setattr(pipeline, "copy_in", slow_copy_in)
    for s in range(3):
        opt._events = []
        for m, o in ((model, opt), (ref_model, ref)):
            loss_of(m, batch(s, torch.bfloat16)).backward()
            o.step()
            o.zero_grad()
        assert not waited_out
        d2h_end, start = chunk_events(opt, "chunk_d2h_end"), chunk_events(opt, "chunk_step_start")
        end, back = chunk_events(opt, "chunk_step_end"), chunk_events(opt, "chunk_h2d")
        order = list(range(5, -1, -1))  # the parameters' order: backward's chunks reversed
        for k, nxt in zip(order, order[1:]):
            assert start[k] < d2h_end[nxt]  # chunk k steps while chunk k+1 is copied in
            assert end[k] <= back[k] < start[nxt]  # and goes back before chunk k+1 steps
        returned = [t for t, kind, _ in opt._events if kind == "step_returning"]
        assert len(returned) == 1 and max(back.values()) < returned[0]
    assert_same(model, ref_model, opt, ref)


def test_overlap_forward_waits_per_module(monkeypatch):
    """overlap_forward=True: step() returns once every chunk is queued, and each module's
    forward waits only for the parameters it registers itself. The worker's step of the
    last layer's weight is held until the test releases it (or 30 s pass): step()
    returns while it is held, the first layers' forward runs meanwhile, the last layer's
    waits for it and reads the update; the output equals the wrapped optimizer's model,
    and the forward hook is gone once nothing is in flight."""
    model, ref_model = make_model(), make_model()
    opt = CPUOffloadOptimizer(model.parameters(), mo.AdamW8bit, lr=1e-2, chunk_bytes=1,
                              overlap_forward=True)
    ref = mo.AdamW8bit(ref_model.parameters(), lr=1e-2)
    held = model[4].weight
    host_of_held = opt._slot_of[id(held)].host
    release, timed_out = threading.Event(), []
    step_bucket = opt.optimizer._step_bucket

    def held_step_bucket(group, hp, device, fmt, items, *a):
        if items[0][0] is host_of_held and not release.wait(30):
            timed_out.append(True)
        return step_bucket(group, hp, device, fmt, items, *a)

    monkeypatch.setattr(opt.optimizer, "_step_bucket", held_step_bucket)
    hooks = torch.nn.modules.module._global_forward_pre_hooks
    before = len(hooks)
    for s in range(3):
        x = batch(s, torch.float32)
        for m, o in ((model, opt), (ref_model, ref)):
            loss_of(m, x).backward()
            o.step()
        assert len(hooks) == before + 1 and not release.is_set()
        y = batch(10 + s, torch.float32)
        h = model[3](model[2](model[1](model[0](y))))  # their own chunks only
        assert not release.is_set() and not timed_out
        release.set()
        out = model[4](h)  # waits for the held chunk
        assert torch.equal(out, ref_model(y)) and not timed_out
        assert len(hooks) == before  # nothing in flight: the hook removed itself
        release.clear()
        opt.zero_grad()
        ref.zero_grad()
    assert_same(model, ref_model, opt, ref)
    # every other API waits for the whole step first
    loss_of(model, batch(5, torch.float32)).backward()
    opt.step()
    threading.Timer(0.2, release.set).start()
    sd = opt.state_dict()
    assert len(hooks) == before and not timed_out
    loss_of(ref_model, batch(5, torch.float32)).backward()
    ref.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref_model.parameters()))
    assert sd["state"].keys() == ref.state_dict()["state"].keys()
    opt.close()


# -- small tensors stay on the device ------------------------------------------------------------

@pytest.mark.parametrize("mode", [dict(), dict(offload_gradients=True),
                                  dict(offload_gradients=True, step_in_backward=True)],
                         ids=["grads-dev", "grads-host", "in-backward"])
def test_small_tensors_stay_on_the_device(mode):
    """keep_on_device_below=4096 (torchao's rule): tensors under 4096 elements have
    no host copy and no host buffer; the wrapped optimizer steps the model's own tensors
    for them (on the CPU, the "device" here) and keeps their gradients in ``p.grad``;
    the weights are offloaded as before. Bits as the wrapped optimizer (bf16, stochastic
    rounding: the biases draw the bits of their places among all the parameters)."""
    dtype = torch.bfloat16
    model, ref_model = make_model(dtype), make_model(dtype)
    opt = CPUOffloadOptimizer(groups(model), mo.AdamW8bit, lr=1e-2, chunk_bytes=1,
                              keep_on_device_below=4096, **mode)
    ref = mo.AdamW8bit(groups(ref_model), lr=1e-2)
    small = {id(p) for p in model.parameters() if p.numel() < 4096}
    assert len(small) == 4  # the biases and the 64x48 weight
    inner = [h for g in opt.optimizer.param_groups for h in g["params"]]
    assert {id(h) for h in inner} & {id(p) for p in model.parameters()} == small
    assert len(opt._chunks) == 2 and all(id(s.dev) not in small for c in opt._chunks for s in c)
    for s in range(3):
        for m, o in ((model, opt), (ref_model, ref)):
            loss_of(m, batch(s, dtype)).backward()
            if o is opt and not mode.get("step_in_backward"):
                assert all((p.grad is not None) == (id(p) in small or not mode)
                           for p in model.parameters())
            o.step()
            o.zero_grad()
    assert [opt._staging.view(s.index) is None for s in opt._slots] == \
        [id(s.dev) in small for s in opt._slots]
    assert_same(model, ref_model, opt, ref)
    with pytest.raises(memfit.MemfitValueError, match="keep_on_device_below"):
        CPUOffloadOptimizer(model.parameters(), keep_on_device_below=-1)
    with pytest.raises(memfit.MemfitTypeError, match="keep_on_device_below"):
        CPUOffloadOptimizer(model.parameters(), keep_on_device_below=4096.0)


# -- step_in_backward's buffer: one, first in first out ------------------------------------------

def test_fifo_hands_out_pieces_in_order_and_waits_when_full():
    """The FIFO buffer: pieces follow each other and wrap; space comes back only once the
    oldest piece is given back; a take that finds it full waits for that."""
    from memfit.optim._offload_staging import _Fifo

    allocs = []
    fifo = _Fifo(256, lambda n: allocs.append(n) or torch.zeros(n, dtype=torch.uint8))
    a, ea = fifo.take(100)
    b, eb = fifo.take(100)
    assert allocs == [256] and a.data_ptr() + 100 == b.data_ptr()
    fifo.give_back(eb)  # not the oldest: nothing is free yet
    got = []
    t = threading.Thread(target=lambda: got.append(fifo.take(100)))
    t.start()
    t.join(0.2)
    assert t.is_alive() and not got  # 56 bytes at the end, none before the oldest piece
    fifo.give_back(ea)
    t.join(30)
    assert got and got[0][0].data_ptr() == a.data_ptr()  # everything was free: from 0
    c, ec = fifo.take(100)
    d, ed = fifo.take(50)  # [200, 250)
    fifo.give_back(got[0][1])
    e, ee = fifo.take(90)  # 6 bytes left at the end: wraps to the start, before c
    assert e.data_ptr() == a.data_ptr() and c.data_ptr() == a.data_ptr() + 100
    assert allocs == [256]


@pytest.mark.parametrize("accumulate", [False, True], ids=["plain", "no_step"])
def test_step_in_backward_allocates_nothing_after_the_first_step(accumulate):
    """step_in_backward's gradients pass through one FIFO buffer (two of the largest
    gradient: memfit estimate's staging; backward waits when the worker has not freed
    room) and, summed under no_step(), through the arena: no allocation after the
    first step, every piece given back, and the wrapped optimizer's bits."""
    dtype = torch.bfloat16
    model, ref_model = make_model(dtype), make_model(dtype)
    opt = CPUOffloadOptimizer(groups(model), mo.AdamW8bit, lr=1e-2, offload_gradients=True,
                              step_in_backward=True)
    ref = mo.AdamW8bit(groups(ref_model), lr=1e-2)
    counts = []
    for s in range(4):
        for a in range(2 if accumulate else 1):
            x = batch(2 * s + a, dtype)
            with opt.no_step() if a == 0 and accumulate else contextlib.nullcontext():
                slow_loss(model, x, 0.01).backward()
            loss_of(ref_model, x).backward()
        opt.step()
        ref.step()
        ref.zero_grad()
        counts.append(opt._staging.allocations)
        assert not opt._staging._out and all(g is None for g in host_grads(opt))
    assert counts == [2 if accumulate else 1] * 4  # the FIFO (and the arena)
    assert opt._staging._fifo._size == STAGING_SLOTS * 96 * 64 * 2  # the largest gradient
    assert_same(model, ref_model, opt, ref)


def test_an_offloader_dropped_in_flight_leaves_no_forward_hook():
    """overlap_forward: an offloader closed or dropped while its chunks are in flight
    takes its forward pre-hook with it (and the chunks still land: its worker drains)."""
    hooks = torch.nn.modules.module._global_forward_pre_hooks
    before = len(hooks)
    for close in (True, False):
        model = make_model()
        opt = CPUOffloadOptimizer(model.parameters(), lr=1e-2, chunk_bytes=1,
                                  overlap_forward=True)
        loss_of(model, batch(0, torch.float32)).backward()
        opt.step()
        assert len(hooks) == before + 1
        if close:
            opt.close()
        else:
            del opt  # collected once the worker's queued jobs (which hold it) have run
            deadline = time.monotonic() + 30
            while len(hooks) != before and time.monotonic() < deadline:
                time.sleep(0.01)
        assert len(hooks) == before


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("cls,kw", CHUNKED[:4], ids=[c.__name__ for c, _ in CHUNKED[:4]])
def test_chunks_of_several_tensors_share_calls(cls, kw, dtype, monkeypatch):
    """Chunks of several tensors: the tensors at consecutive places of one bucket share
    one core call, seeded with the stream of the first one's place (here the biases'
    bucket in one call of 3, and the 2nd and 3rd weights in one call that starts at
    place 1; the 1st weight alone in the next chunk): bits as the wrapped optimizer."""
    kw = dict(kw, min_8bit_size=1024)  # the three weights in one bucket (8/4-bit states)
    model, ref_model = make_model(dtype), make_model(dtype)
    size = torch.tensor([], dtype=dtype).element_size()
    opt = CPUOffloadOptimizer(groups(model, cls), cls, chunk_bytes=7000 * size, **kw)
    ref = cls(groups(ref_model, cls), **kw)
    # slots: weights 0, 1, 2, then biases 3, 4, 5; in backward's order the biases and
    # the 3rd and 2nd weights reach 7000 elements (64 + 48 + 96 + 3072 + 4608)
    assert [[s.index for s in c] for c in opt._chunks] == [[5, 4, 3, 2, 1], [0]]
    sizes = []
    step_bucket = opt.optimizer._step_bucket
    monkeypatch.setattr(opt.optimizer, "_step_bucket",
                        lambda *a: sizes.append(len(a[4])) or step_bucket(*a))
    for o, m in ((opt, model), (ref, ref_model)):
        train(m, o, dtype=dtype, steps=3)
    assert sorted(sizes) == [1] * 3 + [2] * 3 + [3] * 3  # per step: 3 biases, 2 weights, 1
    assert_same(model, ref_model, opt, ref)


def test_a_wrapped_step_with_hooks_of_its_own_runs_whole():
    """Step hooks registered on the wrapped optimizer itself: its step() runs whole (the
    hooks see one step, as torch runs them), not in chunks; bits as without offload."""
    model, ref_model = make_model(torch.bfloat16), make_model(torch.bfloat16)
    opt = CPUOffloadOptimizer(groups(model), mo.AdamW8bit, lr=1e-2, chunk_bytes=1)
    ref = mo.AdamW8bit(groups(ref_model), lr=1e-2)
    seen = []
    opt.optimizer.register_step_pre_hook(lambda o, a, k: seen.append(o is opt.optimizer))
    opt._events = []
    for o, m in ((opt, model), (ref, ref_model)):
        train(m, o, dtype=torch.bfloat16, steps=2)
    assert seen == [True, True]
    assert not [k for _, k, _ in opt._events if k.startswith("chunk_")]
    assert_same(model, ref_model, opt, ref)
