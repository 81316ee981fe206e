"""The offloader's step in chunks (memfit.optim.offload; docs/offload.md, "The pipeline").

The step of :class:`~memfit.optim.offload.CPUOffloadOptimizer` (every mode but
``step_in_backward``, which steps each tensor as its gradient lands) is cut into chunks
of about ``chunk_bytes`` of gradients, and each chunk goes through three stages on its
own: its gradients go device -> host (default mode: copied by :func:`step`, on the
caller's thread; ``offload_gradients=True``: they already landed during backward), the
worker steps it on the host, and its parameters go host -> device at once. So the copy
of chunk k+1, the host step of chunk k and the copy back of chunk k-1 run at the same
time, instead of every copy, then the whole step, then every copy back.

Same bits as the wrapped optimizer's ``step()``: :func:`plan_calls` runs its checks over
every parameter first (a step that raises changes nothing) and numbers each tensor as
step() does (its bucket, its place in it: what stochastic rounding draws by); each
chunk's tensors are then stepped by calls that keep those numbers (:func:`calls_of`:
one per run of consecutive places), so the chunks change no bit. A GradScaler's
``grad_scale``/``found_inf`` reach every call (the kernels unscale and skip per tensor,
as step() does per bucket).

The chunks (:func:`make_chunks`) follow the order backward makes the gradients (the
reverse of the parameters' order, the proxy torch's DDP buckets use); a step that runs
after backward (every mode here) steps them in the parameters' order, so that the
first layers' parameters are back first, for the next forward (``overlap_forward``,
:class:`InFlight`).

On the worker (the host queue), only each chunk's step is a Python job: the waits before
it (its gradients' landing, the last copies of its masters to the device) and its
parameters' copies back are native jobs of the queue, which never take the GIL
(:func:`enqueue_chunk`; a parameter whose bytes are not row-major keeps torch's copy,
:func:`copies_natively`).
"""

from __future__ import annotations

import torch

from memfit._C import MemfitTypeError, MemfitValueError
from memfit.optim import _core
from memfit.optim._torch import _MemfitOptimizer, _on

DEFAULT_CHUNK_BYTES = 64 << 20  # about 64 MiB of gradients per chunk (docs/offload.md)


def check_count(name: str, v, least: int) -> int:
    """A constructor's count (``chunk_bytes``: bytes, ``keep_on_device_below``:
    elements): an int >= least."""
    if isinstance(v, bool) or not isinstance(v, int):
        raise MemfitTypeError(f"{name}: expected an int, got {type(v).__name__}")
    if v < least:
        raise MemfitValueError(f"{name}: expected at least {least}, got {v}")
    return v


def grad_bytes(t: torch.Tensor) -> int:
    """The bytes of t's gradient (the parameter's dtype and size)."""
    return t.numel() * t.element_size()


def make_chunks(slots: list, chunk_bytes: int) -> list:
    """The slots in the order backward makes their gradients (the reverse of the
    parameters' order), cut into chunks: a chunk is closed once it holds chunk_bytes of
    gradients or more (so a tensor larger than chunk_bytes ends the chunk it joins).
    Returns a list of tuples of slots; chunk 0 gets its gradients first."""
    chunks, current, size = [], [], 0
    for s in reversed(slots):
        current.append(s)
        size += grad_bytes(s.dev)
        if size >= chunk_bytes:
            chunks.append(tuple(current))
            current, size = [], 0
    if current:
        chunks.append(tuple(current))
    return chunks


# memfit's own step() as its class defines it (a base of _MemfitOptimizer: _torch_step),
# before torch's Optimizer wraps the class's step for its hooks
_MEMFIT_STEP = next(c.__dict__["step"] for c in _MemfitOptimizer.__mro__ if "step" in c.__dict__)


def chunkable(inner) -> bool:
    """Whether the wrapped optimizer's step is memfit's own, unchanged: then the
    pipeline cuts it into chunks. Otherwise (a step replaced on the instance or
    overridden by a subclass, step hooks registered on the wrapped optimizer itself)
    its ``step()`` runs whole, after every gradient has landed, as it is."""
    step = type(inner).step
    return (getattr(step, "__wrapped__", step) is _MEMFIT_STEP
            and "step" not in inner.__dict__
            and not inner._optimizer_step_pre_hooks and not inner._optimizer_step_post_hooks)


def plan_calls(inner) -> dict:
    """The wrapped optimizer's step(), planned per tensor. Checks every parameter that
    has a gradient, as step() does (raises before anything changes) and makes the
    missing states; returns {id(param): (group index, bucket number, place in the
    bucket, group, hparams, device, format, item, the bucket's stochastic-rounding seed
    or None)}, which :func:`calls_of` turns into core calls. The buckets are numbered by
    state format in the order of the group's parameters, as step() numbers them when
    every parameter is on one device (so a small tensor kept on the device draws the
    bits it would draw among the others)."""
    plan, new = inner._plan_step()
    inner._add_states(new)
    checked = inner._state_checked
    planned = {}
    for gi, (group, hp, rounding, buckets, _) in enumerate(plan):
        places, counts = {}, {}  # id(p) -> (bucket, place); format -> [bucket, count]
        for p in group["params"]:
            if p.grad is None:
                continue
            at = counts.get(checked[id(p)][6][1])
            if at is None:
                at = counts[checked[id(p)][6][1]] = [len(counts), 0]
            places[id(p)] = (at[0], at[1])
            at[1] += 1
        base, sr_step = group.get("sr_seed", 0), group.get("sr_step", 0)
        for (device, fmt), items in buckets.items():
            for item in items:
                b, k = places[id(item[0])]
                seed = _core.sr_seed(base, sr_step, b) if rounding == "stochastic" else None
                planned[id(item[0])] = (gi, b, k, group, hp, device, fmt, item, seed)
    return planned


def calls_of(planned: dict, tensors) -> list:
    """The core calls (_step_bucket's group, hparams, device, format, items) that step
    the planned ``tensors``, as step() would step them: tensors at consecutive places
    of one bucket share a call seeded with the stream of the first one's place (tensor
    j of a call seeded ``stream_seed(seed, k)`` draws what place k + j draws), so a chunk
    that holds whole buckets makes step()'s own calls, and one tensor alone is
    _MemfitOptimizer._step_params's call."""
    mine = sorted((planned[id(t)] for t in tensors if id(t) in planned),
                  key=lambda c: (c[0], c[1], c[2]))
    calls, run = [], []
    for c in mine + [None]:
        if c is not None and run and c[:2] == run[-1][:2] and c[2] == run[-1][2] + 1 \
                and c[5] == run[-1][5]:
            run.append(c)
            continue
        if run:
            _, _, k, group, hp, device, fmt, _, seed = run[0]
            items = [r[7] for r in run]
            if seed is not None and any(item[3][5] for item in items):  # float16/bfloat16
                hp = dict(hp, sr_seed=_core.stream_seed(seed, k))
            calls.append((group, hp, device, fmt, items))
        run = [c]
    return calls


def positions(inner, stepping) -> dict:
    """The numbers the step in backward steps each tensor with (_step_params), the
    buckets numbered by state format alone, as :func:`plan_calls` numbers them: a
    tensor kept on the device (``keep_on_device_below``) draws the bits it would draw
    among the host copies, as in the wrapped optimizer's step() with every parameter on
    one device."""
    return inner._sr_positions(stepping, by_format=True)


class InFlight:
    """The chunks of the last step whose parameters may still be on their way to the
    device (``overlap_forward=True``: step() returns once every chunk is queued).

    Each chunk has a marker: the number of its last job on the worker (its copies back
    are issued once that job has run; on the CPU: done) and, on a GPU, its CUDA event
    (recorded after its copies on the h2d stream: one event per chunk, made once,
    :meth:`event`). While markers are pending a module forward pre-hook (global,
    installed by :meth:`install`, removed as soon as nothing is pending) makes each
    module wait for the parameters it registers itself (``module._parameters``): the
    host waits for the chunk's last job (raising nothing: an error of a chunk is raised
    by the next API that waits for the whole step) and, on a GPU, the current stream for
    the copy. A parameter read by another module's forward than its own is not waited
    for: that is overlap_forward's rule."""

    def __init__(self):
        self._of = {}       # id(device parameter) -> its chunk's marker
        self._last = None   # the last job of the last chunk added (jobs run in order)
        self._worker = None
        self._handle = None
        self._events = {}   # chunk index -> its CUDA event (made once, re-recorded each step)

    def event(self, ci: int, stream):
        """Chunk ci's CUDA event, recorded after its copies back on ``stream`` (the h2d
        stream; None on the CPU: no event). Made once and recorded there at once, so
        that it has a CUDA handle (torch makes an event's handle at its first record)
        for the queue's native copies to record and wait for."""
        if stream is None:
            return None
        e = self._events.get(ci)
        if e is None:
            e = self._events[ci] = torch.cuda.Event()
            e.record(stream)
        return e

    def add(self, slots, worker, job: int, event) -> None:
        """Chunk ``slots``' copies back are issued once ``worker``'s job ``job`` has run
        (and, on a GPU, done at CUDA event ``event``)."""
        marker = (job, event)
        for s in slots:
            self._of[id(s.dev)] = marker
        self._worker, self._last = worker, job

    def until(self, job: int) -> None:
        """The step stays in flight (the pre-hook stays, and the APIs that wait for the
        whole step still wait) until the worker's job ``job`` has run as well."""
        if self._of:
            self._last = job

    @property
    def pending(self) -> bool:
        return bool(self._of)

    def install(self, hooks: list) -> None:
        """Installs the forward pre-hook (main thread; kept in ``hooks`` so that close()
        removes it with the gradient hooks)."""
        if self._handle is None and self._of:
            of = self._of

            def wait_for_own_parameters(module, args):
                for p in module._parameters.values():
                    m = of.get(id(p)) if p is not None else None
                    if m is not None:
                        self._worker.reach(m[0])  # (the GIL released while it waits)
                        if m[1] is not None:
                            torch.cuda.current_stream(p.device).wait_event(m[1])
                if self._last is not None and self._worker.completed >= self._last:
                    self.clear(hooks)  # the copies of every chunk are issued
            self._handle = torch.nn.modules.module.register_module_forward_pre_hook(
                wait_for_own_parameters)
            hooks.append(self._handle)

    def clear(self, hooks: list) -> None:
        """Nothing in flight any more (main thread): the pre-hook is removed."""
        self._of.clear()
        self._last = None
        if self._handle is not None:
            self._handle.remove()
            if self._handle in hooks:
                hooks.remove(self._handle)
            self._handle = None


class _Run:
    """One step in chunks: what its jobs on the worker share (the scale and found_inf,
    on the host, and whether a job raised: the jobs after it step nothing)."""

    def __init__(self, grad_scale, found_inf):
        self.grad_scale, self.found_inf = grad_scale, found_inf
        self.failed = False
        self.events = []  # the CUDA events native jobs wait for: alive until the step ends

    def begin(self, opt) -> None:
        """Worker: the scaler's tensors on the host, once for every call (on a GPU this
        waits for the scaler's own check, not the caller)."""
        opt._log("host_step_start")
        try:
            cpu = torch.device("cpu")
            self.grad_scale = _on(self.grad_scale, cpu)
            self.found_inf = _on(self.found_inf, cpu)
        except BaseException:
            self.failed = True
            raise

    def chunk(self, opt, ci, slots, calls, by_torch, event) -> None:
        """Worker: chunk ci steps (its gradients have landed and the last copies of its
        masters to the device have read them: the native waits queued before this job).
        Its parameters that the queue cannot copy byte for byte (``by_torch``) go back
        to the device here, and on a GPU, when no native copy follows (``event`` given),
        the chunk's CUDA event is recorded after them."""
        try:
            if self.failed:
                return
            opt._log("chunk_landed", ci)
            opt._log("chunk_step_start", ci)
            step_bucket = opt.optimizer._step_bucket
            with torch.no_grad():  # (thread-local: the worker's own)
                for call in calls:
                    step_bucket(*call, self.grad_scale, self.found_inf)
            opt._log("chunk_step_end", ci)
            copy_back(opt, by_torch, event)
        except BaseException:
            self.failed = True
            raise
        finally:
            if not opt._offload_grads:  # consumed (else kept until zero_grad, as p.grad)
                for s in slots:
                    opt._drop_host_grad(s)

    def end(self, opt, slots) -> None:
        """Worker: the optimizer step is over (sr_step advances, as step() advances it,
        unless a chunk raised); whatever a failed chunk left is dropped."""
        if not opt._offload_grads:
            for s in slots:
                if s.host.grad is not None:
                    opt._drop_host_grad(s)
        if not self.failed:
            opt.optimizer._advance_sr_step()
            opt.optimizer._optimizer_step_code()
        self.events.clear()
        opt._log("host_step_end")


def copy_in(opt, slots):
    """Starts chunk ``slots``' gradients device -> host, into their host gradients (the
    arena's views); returns the copy's CUDA event (None on the CPU: done here)."""
    if opt._d2h is None:
        for s in slots:
            s.host.grad.copy_(s.dev.grad)
        return None
    ready = torch.cuda.current_stream(opt._device).record_event()
    opt._d2h.wait_event(ready)
    with torch.cuda.stream(opt._d2h):
        for s in slots:
            g = s.dev.grad
            s.host.grad.copy_(g.detach(), non_blocking=True)
            g.record_stream(opt._d2h)  # its memory is not reused before the copy ends
        return opt._d2h.record_event()


NATIVE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # what the queue's views take


def copies_natively(opt, s) -> bool:
    """Whether slot s's parameter goes back to the device as a native job of the queue
    (a byte copy, no GIL: memcpy on the CPU, cudaMemcpyAsync on a GPU): only when the
    master and the device tensor are both contiguous (row-major), of the same dtype and
    byte size, on the CPU or a CUDA device. Anything else (a transposed or channels_last
    parameter, whose bytes are not in row-major order) keeps torch's ``copy_``, which
    follows the strides."""
    d, h = s.dev, s.host
    on = "cuda" if opt._h2d is not None else "cpu"
    return (d.device.type == on and h.device.type == "cpu" and d.dtype == h.dtype
            and d.dtype in NATIVE_DTYPES and d.numel() == h.numel()
            and d.is_contiguous() and h.is_contiguous())


def split_copies(opt, slots) -> tuple:
    """(the slots whose parameters go back as native copies, the others: torch's)."""
    native, by_torch = [], []
    for s in slots:
        (native if copies_natively(opt, s) else by_torch).append(s)
    return native, by_torch


def copy_back(opt, slots, event=None) -> None:
    """Worker: ``slots``' updated parameters host -> device by torch (the ones
    :func:`copies_natively` refuses), on the h2d stream (which waits for the compute
    stream's point before the step: :func:`step`); then CUDA event ``event`` is recorded
    there, if given."""
    with torch.no_grad():
        if opt._h2d is None:
            for s in slots:
                s.dev.detach().copy_(s.host)
            return
        with torch.cuda.stream(opt._h2d):
            for s in slots:
                s.dev.detach().copy_(s.host, non_blocking=True)
        if event is not None:
            event.record(opt._h2d)


def enqueue_chunk(opt, run, ci, mine, landed, calls, copy=True) -> None:
    """Queues chunk ci on the worker, in order: native waits (its gradients' landing,
    the previous copies of its masters to the device: on a GPU), its step (a Python
    job), its parameters' copies back (:func:`enqueue_copies`), then marks it in flight.
    ``copy=False`` (delayed_update, _offload_delayed): no copy back is queued; the
    update is applied later by :func:`enqueue_copies`."""
    worker = opt._worker
    waits = {}
    if landed is not None:
        waits[id(landed)] = landed
    for s in mine:  # the last copy of each master to the device has read it
        if s.h2d_done is not None:
            waits[id(s.h2d_done)] = s.h2d_done
    for e in waits.values():
        run.events.append(e)  # alive until the wait has run (run.end drops them)
        worker.submit_event_wait(e.cuda_event)
    if not copy:
        worker.submit(lambda: run.chunk(opt, ci, mine, calls, [], None))
        return
    native, by_torch = split_copies(opt, mine)
    event = opt._inflight.event(ci, opt._h2d)
    job = worker.submit(lambda: run.chunk(opt, ci, mine, calls, by_torch,
                                          None if native else event))
    job = enqueue_copies(opt, ci, mine, native, job)
    opt._inflight.add(mine, worker, job, event)


def enqueue_copies(opt, ci, mine, native=None, job=None) -> int:
    """Queues chunk ci's parameters' copies back to the device (``mine``: its slots):
    native jobs (FIFO after whatever is queued: its step), torch's copies of the others
    as a Python job unless ``native`` is given (then the chunk's step makes them), and
    with the event log a Python job that logs ``chunk_h2d``. On a GPU the last copy
    records the chunk's CUDA event, which each slot's ``h2d_done`` then is. Returns the
    number of the last job queued (``job`` if none)."""
    worker, h2d = opt._worker, opt._h2d
    event = opt._inflight.event(ci, h2d)
    if native is None:
        native, by_torch = split_copies(opt, mine)
        if by_torch:
            job = worker.submit(lambda: copy_back(opt, by_torch, None if native else event))
    stream = h2d.cuda_stream if h2d is not None else 0
    for k, s in enumerate(native):
        # the queue holds both tensors until the copy has run; on a GPU the last copy
        # records the chunk's event (the stream orders every copy of the chunk before it)
        last = k == len(native) - 1
        job = worker.submit_copy(s.dev.detach(), s.host, stream,
                                 event.cuda_event if last and event is not None else 0)
    for s in mine:
        s.h2d_done = event
    if event is not None:
        worker.copies_done = event  # waited for when the worker stops (_Worker.stop)
    if opt._events is not None:
        # a native job cannot log: this job runs right after the chunk's copies are issued
        # (done, on the CPU), which is what chunk_h2d means (the log's one GIL take per
        # chunk, only while the log is on)
        job = worker.submit(lambda: opt._log("chunk_h2d", ci))
    return job


def step(opt, grad_scale, found_inf, delayed=None) -> None:
    """CPUOffloadOptimizer.step() in every mode but step_in_backward: the chunks are
    queued on the worker; returns once all are done (or, with overlap_forward, once all
    are queued: the next forward waits per module, :class:`InFlight`). ``delayed`` (a
    list, delayed_update): returns once all are queued, with no copy back queued (nor,
    for a step that cannot be chunked, made): _offload_delayed applies the update later;
    True is appended to the list once the step's jobs are queued (a step that raises
    before that queued none)."""
    slots = [s for s in opt._slots if s.host is not s.dev]
    if opt._offload_grads:
        opt._adopt_device_grads()
        opt._worker.wait()  # the landings of backward: every host gradient is known
        have = {id(s) for s in slots if s.host.grad is not None}
    else:
        have = {id(s) for s in slots if s.dev.grad is not None}
        for s in slots:
            if id(s) in have:  # planned on the arena's views; the data lands per chunk
                s.host.grad = opt._staging.view(s.index)
                s.claimed = True
    after = (torch.cuda.current_stream(opt._device).record_event()
             if opt._h2d is not None else None)
    if not chunkable(opt.optimizer):
        whole(opt, slots, have, grad_scale, found_inf, after, delayed)
        return
    try:
        planned = plan_calls(opt.optimizer)  # raises here, before anything changes
    except BaseException:
        if not opt._offload_grads:  # a step that raised leaves no host copy behind
            for s in slots:
                opt._drop_host_grad(s)
        raise
    run = _Run(grad_scale, found_inf)
    opt._worker.submit(lambda: run.begin(opt))
    if delayed is not None:
        delayed.append(True)
    if after is not None:
        # every copy back of this step (issued on the worker, later) comes after the
        # kernels queued so far on the compute stream, which may still read the parameters
        opt._h2d.wait_event(after)
    try:
        for ci in range(len(opt._chunks) - 1, -1, -1):  # the parameters' order
            mine = [s for s in opt._chunks[ci] if id(s) in have]
            if not mine:
                continue
            landed = None
            if not opt._offload_grads:
                opt._log("chunk_d2h_start", ci)
                landed = copy_in(opt, mine)
                opt._log("chunk_d2h_end", ci)
            enqueue_chunk(opt, run, ci, mine, landed, calls_of(planned, [s.host for s in mine]),
                          copy=delayed is None)
        # the tensors kept on the device (keep_on_device_below) step there, on this
        # thread (the caller's stream), while the worker steps the chunks
        with torch.no_grad():
            for call in calls_of(planned, [s.dev for s in opt._slots if s.host is s.dev]):
                opt.optimizer._step_bucket(*call, grad_scale, found_inf)
    except BaseException:
        run.failed = True  # (a copy or a kernel refused): the chunks after it step nothing
        raise
    finally:
        opt._worker.submit(lambda: run.end(opt, slots))
    if opt._d2h is not None:
        # the next backward writes the device gradients after these copies read them
        torch.cuda.current_stream(opt._device).wait_stream(opt._d2h)


def whole(opt, slots, have, grad_scale, found_inf, after, delayed=None) -> None:
    """The wrapped optimizer's own step() (not chunkable): every gradient lands, then one
    host step, then every copy back (``delayed``, as :func:`step`'s: none, and returns
    once the step is queued)."""
    landed = []  # alive until the worker has waited for them (below)
    for s in slots:
        if id(s) in have and not opt._offload_grads:
            e = copy_in(opt, [s])
            if e is not None:
                landed.append(e)
                opt._worker.submit_event_wait(e.cuda_event)  # native: no GIL
    opt._worker.submit(lambda: opt._host_step(slots, grad_scale, found_inf, after,
                                              copy_back=delayed is None))
    if delayed is not None:
        delayed.append(True)
        opt._worker.submit(landed.clear)  # (the events stay alive until the step has run)
        return
    try:
        opt._worker.wait()
    finally:
        if not opt._offload_grads:  # a step that raised leaves no host copy behind
            for s in slots:
                opt._drop_host_grad(s)
