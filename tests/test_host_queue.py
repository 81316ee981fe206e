"""memfit._C.HostQueue (csrc/core/host_queue.c, csrc/python/host_queue_py.c): jobs in
order on a C thread, errors kept for wait(), byte-exact copies, tickets, stop, argument
checks, no CPU used while idle, and the optimizer step on the queue's passive thread pool
(csrc/core/thread_pool.c) giving the same bits as the OpenMP step."""

import gc
import os
import threading
import time
import weakref

import numpy as np
import pytest

import memfit
from memfit import _C


def live_after(before, timeout=5.0):
    """The number of running host queue threads once it is back to `before` (or the
    timeout passed): a thread ends a moment after the job that dropped its queue."""
    end = time.monotonic() + timeout
    while _C.host_queues_live() > before and time.monotonic() < end:
        time.sleep(0.01)
    return _C.host_queues_live()


def test_jobs_run_in_order_on_one_other_thread():
    q = _C.HostQueue(2)
    seen, idents = [], set()

    def job(i):
        seen.append(i)
        idents.add(threading.get_ident())

    jobs = [q.submit(lambda i=i: job(i)) for i in range(200)]
    assert jobs == list(range(1, 201))  # job numbers in submission order
    q.wait()
    assert seen == list(range(200))
    assert len(idents) == 1 and threading.get_ident() not in idents
    assert q.completed == 200
    q.stop()


def test_first_error_is_raised_by_wait_and_later_jobs_still_run():
    q = _C.HostQueue(1)
    seen = []

    class Held:
        pass

    refs = []

    def fails():
        local = Held()  # a local of the failing frame: cleared, not kept alive by the error
        refs.append(weakref.ref(local))
        raise KeyError("first")

    q.submit(lambda: seen.append(1))
    q.submit(fails)
    q.submit(lambda: seen.append(2))
    q.submit(lambda: 1 / 0)  # a second error: dropped, the first one is raised
    q.submit(lambda: seen.append(3))
    q.wait(q.signal(), raise_error=False)  # every job has run; the error stays kept
    assert seen == [1, 2, 3]
    with pytest.raises(memfit.MemfitTypeError, match="raise_error"):
        q.wait(raise_error=0)
    with pytest.raises(KeyError, match="first") as info:
        q.wait()
    gc.collect()
    assert refs and refs[0]() is None  # the traceback's frames were cleared
    assert info.value.__traceback__ is not None
    q.wait()  # the error was taken: nothing to raise
    q.submit(lambda: seen.append(4))
    q.wait()
    assert seen == [1, 2, 3, 4]
    q.stop()


def test_copies_are_byte_exact_and_ordered_with_jobs():
    rng = np.random.default_rng(0)
    q = _C.HostQueue(1)
    src8 = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
    dst8 = np.zeros_like(src8)
    # float32 with NaN payloads, negative zero and denormals: bits, not values, are copied
    bits = rng.integers(0, 1 << 32, 4097, dtype=np.uint64).astype(np.uint32)
    bits[:4] = [0x7FC00001, 0xFFA00000, 0x80000000, 0x00000001]
    src32 = bits.view(np.float32)
    dst32 = np.full_like(src32, 7.0)
    # a float32 array into a uint8 array of the same bytes
    dst_bytes = np.zeros(4 * src32.size, np.uint8)
    observed = []
    q.submit_copy(dst8, src8)
    q.submit(lambda: observed.append(dst8.copy()))  # runs after the copy
    q.submit_copy(dst32, src32)
    q.submit_copy(dst_bytes, src32)
    q.wait()
    assert np.array_equal(observed[0], src8)
    assert np.array_equal(dst32.view(np.uint32), bits)
    assert np.array_equal(dst_bytes, src32.view(np.uint8))
    q.stop()


def test_torch_copies_and_the_source_kept_alive():
    torch = pytest.importorskip("torch")
    q = _C.HostQueue(1)
    gate = threading.Event()
    q.submit(lambda: gate.wait(10))  # the copy below stays queued until the gate opens
    g = torch.Generator().manual_seed(1)
    expect = torch.randn(1 << 16, generator=g).to(torch.bfloat16)
    src = expect.clone()
    dst = torch.zeros_like(expect)
    q.submit_copy(dst, src)
    del src  # the queue holds it until the copy ran
    gc.collect()
    gate.set()
    q.wait()
    assert torch.equal(dst.view(torch.int16), expect.view(torch.int16))
    q.stop()


def test_tickets():
    q = _C.HostQueue(1)
    gate = threading.Event()
    seen = []
    q.submit(lambda: seen.append("a"))
    first = q.signal()
    q.submit(lambda: gate.wait(10))
    q.submit(lambda: seen.append("b"))
    second = q.signal()
    assert second > first >= 2
    q.wait(first)  # returns while the gate still holds the jobs after it
    assert seen == ["a"] and q.completed < second
    gate.set()
    q.wait(second)
    assert seen == ["a", "b"] and q.completed >= second
    with pytest.raises(memfit.MemfitValueError, match="ticket"):
        q.wait(second + 100)  # no such job yet
    q.stop()


def test_stop_runs_the_pending_jobs_then_ends_the_thread():
    before = _C.host_queues_live()
    q = _C.HostQueue(2)
    assert _C.host_queues_live() == before + 1
    seen = []
    for i in range(5):
        q.submit(lambda i=i: (time.sleep(0.02), seen.append(i)))
    q.stop()
    assert seen == list(range(5))
    assert _C.host_queues_live() == before
    with pytest.raises(memfit.MemfitValueError, match="stopped"):
        q.submit(lambda: None)
    with pytest.raises(memfit.MemfitValueError, match="stopped"):
        q.signal()
    q.wait()  # nothing left: returns
    q.stop()  # idempotent


def test_a_queue_dropped_by_its_own_job_drains_then_ends():
    before = _C.host_queues_live()
    q = _C.HostQueue(2)
    holder = [q]
    src = np.arange(1 << 16, dtype=np.float32)
    dst = np.zeros_like(src)
    queued = threading.Event()  # the job waits until the copy is queued behind it
    q.submit(lambda: (queued.wait(10), holder.clear()))  # the last reference, on its thread
    q.submit_copy(dst, src)  # queued after that job: still runs, its arrays still held
    queued.set()
    del q, src
    assert live_after(before) == before
    assert np.array_equal(dst, np.arange(1 << 16, dtype=np.float32))


def test_bad_arguments_name_the_argument():
    with pytest.raises(memfit.MemfitTypeError, match="threads"):
        _C.HostQueue("2")
    with pytest.raises(memfit.MemfitTypeError, match="threads"):
        _C.HostQueue(True)
    with pytest.raises(memfit.MemfitValueError, match="threads"):
        _C.HostQueue(-1)
    q = _C.HostQueue(0)  # memfit's thread count
    assert q.threads == memfit.get_num_threads()
    a = np.zeros(8, np.float32)
    with pytest.raises(memfit.MemfitTypeError, match="fn"):
        q.submit(3)
    with pytest.raises(memfit.MemfitValueError, match="src: 16 bytes"):
        q.submit_copy(a, np.zeros(4, np.float32))
    ro = np.zeros(8, np.float32)
    ro.setflags(write=False)
    with pytest.raises(ValueError, match="dst"):
        q.submit_copy(ro, a)
    with pytest.raises(TypeError, match="src"):
        q.submit_copy(a, [1.0] * 8)
    with pytest.raises(memfit.MemfitTypeError, match="stream"):
        q.submit_copy(a, a.copy(), stream="s")
    with pytest.raises(memfit.MemfitValueError, match="stream"):
        q.submit_copy(a, a.copy(), stream=5)  # both on the host: no stream to use
    with pytest.raises(memfit.MemfitValueError, match="event"):
        q.submit_event_wait(0)
    if not _C.build_info()["cuda"]:
        with pytest.raises(memfit.CudaError, match="without CUDA|CUDA"):
            q.submit_event_wait(1234)
    with pytest.raises(memfit.MemfitTypeError, match="ticket"):
        q.wait("1")
    with pytest.raises(memfit.MemfitValueError, match="ticket"):
        q.wait(0)
    q.wait()  # none of the refused calls queued anything
    assert q.completed == 0
    q.stop()


def test_a_job_waiting_for_a_later_job_is_refused():
    q = _C.HostQueue(1)
    errors = []

    def job():
        try:
            q.wait(later)
        except ValueError as e:
            errors.append(str(e))

    q.submit(job)
    later = q.signal()
    q.wait()
    assert errors and "wait forever" in errors[0]
    q.stop()


def _thread_cpu_seconds(names):
    """CPU time (user + system) of this process's threads with these names (/proc)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:
            continue  # a thread that ended meanwhile
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        if name in names:
            fields = stat[stat.rindex(")") + 2:].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15)
    return total / tick


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="reads /proc (Linux)")
def test_an_idle_queue_and_its_pool_use_no_cpu():
    """The queue's thread and its pool wait on condition variables: over a 0.5 s idle
    wait they use (almost) no CPU time. A spinning thread would use about 0.5 s."""
    q = _C.HostQueue(3)
    q.submit(lambda: sum(range(10000)))
    q.wait()
    names = {"memfit-queue", "memfit-pool"}
    time.sleep(0.1)
    t0, p0 = _thread_cpu_seconds(names), time.process_time()
    time.sleep(0.5)
    used, proc = _thread_cpu_seconds(names) - t0, time.process_time() - p0
    assert used <= 0.02, f"the idle queue's threads used {used:.3f} s of CPU in 0.5 s"
    assert proc < 0.25, f"the process used {proc:.3f} s of CPU in an idle 0.5 s"
    q.stop()


# -- the optimizer step on the queue's thread pool -----------------------------------------

def _pool_cases():
    import memfit.optim as mo
    return {
        "8bit": (mo.AdamW8bit, "float32"),
        "4bit": (mo.AdamW4bit, "float32"),
        "fp32-states": (mo.AdamW, "float32"),
        "bf16-stochastic": (mo.AdamW8bit, "bfloat16"),
        "lion8bit-bf16": (mo.Lion8bit, "bfloat16"),
    }


@pytest.mark.parametrize("case", ["8bit", "4bit", "fp32-states", "bf16-stochastic",
                                  "lion8bit-bf16"])
def test_the_pool_step_gives_the_openmp_step_bits(case):
    torch = pytest.importorskip("torch")
    cls, dtype = _pool_cases()[case]
    dtype = getattr(torch, dtype)
    g = torch.Generator().manual_seed(7)
    # many work items (well over the 8 under which a step runs on one thread) across
    # tensors of odd sizes: partial items and partial quantization blocks
    shapes = [(1_000_003,), (257, 391), (4097,), (33,), (65_536,)]
    params = [torch.randn(s, generator=g).to(dtype) for s in shapes]
    grads = [[torch.randn(s, generator=g).to(dtype) for s in shapes] for _ in range(3)]

    def run(on_queue):
        ps = [torch.nn.Parameter(p.clone()) for p in params]
        opt = cls(ps, lr=1e-2)
        q = _C.HostQueue(3) if on_queue else None
        threads = []
        for step_grads in grads:
            for p, gr in zip(ps, step_grads):
                p.grad = gr.clone()
            if q is None:
                opt.step()
            else:
                q.submit(lambda: (threads.append(_C.get_num_threads()), opt.step()))
                q.wait()
        if q is not None:
            q.stop()
            assert threads == [3, 3, 3]  # the pool's size, not OpenMP's count
        states = [t for p in ps for t in opt.state[p].values() if torch.is_tensor(t)]
        return ps, states

    ps_omp, st_omp = run(False)
    ps_pool, st_pool = run(True)
    for a, b in zip(ps_omp, ps_pool):
        assert torch.equal(a.detach().view(torch.uint8), b.detach().view(torch.uint8))
    assert len(st_omp) == len(st_pool) > 0
    for a, b in zip(st_omp, st_pool):
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    # and the step did change the parameters (the comparison is not of two no-ops)
    assert not torch.equal(ps_omp[0].detach(), params[0])
