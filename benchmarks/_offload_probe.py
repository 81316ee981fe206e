"""One offloaded training step, taken apart: what benchmarks/bench_offload.py prints per
step, measured around the step by :class:`StepProbe` and read from the offloader's own
event log (``CPUOffloadOptimizer._events``: a list of ``(perf_counter_ns, kind,
detail)``, python/memfit/optim/offload.py ``_log``), plus the step-time model the
benchmark checks against.

The event log is read defensively: kinds this file does not know are ignored, and a
number whose events are missing is None (printed "-"). Known kinds:

    hook                      detail (slot index, ns in the hook): the gradient hook on
                              the autograd thread (its copy out starts there; on the CPU
                              it *is* the copy, a memcpy)
    host_step_start/_end      the wrapped optimizer's whole step on the worker (with
                              chunks: the frame around them)
    tensor_start/_end         one tensor's step in backward (step_in_backward=True)
    chunk_step_start/_end     one chunk's step (the chunked pipeline, issue 40 item 2;
                              chunk_stepped is taken as an end too)
    chunk_landed, *landed*    a chunk's (a gradient's) copy out has arrived on the host
    chunk_h2d, *copied*       a chunk's copy back issued (on the CPU: done)

The host step's busy time and calls are counted at the finest level logged (chunks, else
tensors, else the whole step); chunk_d2h_start/_end (copies out issued by step()) are
not host work and count as nothing here.

Clocks: host times are ``time.perf_counter_ns()`` (the event log's clock); on a GPU the
probe also records CUDA events on the compute stream and on the offloader's copy streams
(``_d2h``, ``_h2d`` where it has them) for what only the device knows: when the last
gradient copy ended against the end of backward's kernels, and how long the compute
stream sat idle between backward and the next forward.
"""

from __future__ import annotations

import time

import torch

# (start kinds, end kinds) of the host's stepping, finest first
LEVELS = ((("chunk_step_start",), ("chunk_step_end", "chunk_stepped")),
          (("tensor_start",), ("tensor_end",)),
          (("host_step_start",), ("host_step_end",)))
CHUNK_MIB = 64  # the pipeline's chunk (issue 40 item 2): what the model's tail is made of


def _host_work(ev) -> tuple:
    """(start times, end times) of the host's stepping at the finest level logged."""
    for starts, ends in LEVELS:
        a = [t for t, k, _ in ev if k in starts]
        if a:
            return a, [t for t, k, _ in ev if k in ends]
    return [], []


def _copied_back(kind: str) -> bool:
    return "copied" in kind or kind.endswith("_h2d")


def _stream(opt, name):
    s = getattr(opt, name, None)
    return s if torch.cuda.is_available() and isinstance(s, torch.cuda.Stream) else None


def _pinned_counts():
    """torch's pinned (host) allocator: (requests handed out, blocks created) so far."""
    stats = getattr(torch.cuda, "host_memory_stats", None)  # torch >= 2.8
    if not torch.cuda.is_available() or stats is None:
        return None
    st = stats()
    return st.get("active_requests.allocated", 0), st.get("num_host_alloc", 0)


class StepProbe:
    """Times one step of ``model`` + ``opt`` (call the marks in order: begin, forward_done,
    backward_done, step_done after step(), iteration_done after zero_grad()) and turns it
    and the offloader's events into a dict of phases (:meth:`phases`). With a GPU the
    marks synchronise the compute stream only (the copy streams run on), so backward's
    time is its kernels' and the copies' exposure is measured against them. The
    iteration ends after zero_grad(), as a training loop's does: an offloader whose
    step() returns before its host work is done (overlap_forward) may wait there."""

    def __init__(self, opt, device):
        self.opt, self.cuda = opt, device.type == "cuda"
        self.d2h, self.h2d = _stream(opt, "_d2h"), _stream(opt, "_h2d")
        self.device = device
        self.logged = hasattr(opt, "_events")  # an offloader: its host step and copies

    def _event(self, stream=None):
        e = torch.cuda.Event(enable_timing=True)
        e.record(stream if stream is not None else torch.cuda.current_stream(self.device))
        return e

    def _staging_allocs(self):
        return getattr(getattr(self.opt, "_staging", None), "allocations", None)

    def begin(self):
        if hasattr(self.opt, "_events"):
            self.opt._events = []  # this step's events only
        self.staging0, self.pinned0 = self._staging_allocs(), _pinned_counts()
        if self.cuda:
            torch.cuda.synchronize(self.device)
        self.t0 = time.perf_counter_ns()

    def forward_done(self):
        if self.cuda:
            torch.cuda.current_stream(self.device).synchronize()
            self.e_bwd0 = self._event()
        self.t1 = time.perf_counter_ns()

    def backward_done(self):
        if self.cuda:
            self.e_bwd1 = self._event()  # backward's last kernel
            self.e_d2h = self._event(self.d2h) if self.d2h is not None else None
            torch.cuda.current_stream(self.device).synchronize()
        self.t2 = time.perf_counter_ns()

    def step_done(self):
        self.t3 = time.perf_counter_ns()  # step() has returned (on a GPU: without a host sync)

    def iteration_done(self):
        """After zero_grad(): where the next forward would start."""
        self.t4 = time.perf_counter_ns()
        self.t_h2d = self.t4
        if self.cuda:
            self.e_next = self._event()  # where the next forward's first kernel would start
            if self.h2d is not None:
                self._event(self.h2d).synchronize()  # every copy back queued so far is done
                self.t_h2d = time.perf_counter_ns()
            torch.cuda.synchronize(self.device)
        self.t_end = time.perf_counter_ns()
        self.staging1, self.pinned1 = self._staging_allocs(), _pinned_counts()

    def phases(self, sizes: list, threads) -> dict:
        """The step's numbers (ms unless named otherwise; "vs backward end": negative =
        during backward). ``sizes[i]``: (elements, bytes per element) of the parameter in
        slot i (the offloader's slots follow the parameters' order)."""
        ev = list(getattr(self.opt, "_events", None) or [])
        ms = lambda ns: ns / 1e6
        t2 = self.t2
        hooks = [(t, d) for t, k, d in ev if k == "hook" and isinstance(d, tuple) and len(d) == 2]
        hooked = {i for _, (i, _) in hooks if isinstance(i, int) and 0 <= i < len(sizes)}
        starts, ends = _host_work(ev)
        landed = [t for t, k, _ in ev if "landed" in k]
        copied = [t for t, k, _ in ev if _copied_back(k)]
        if starts and len(starts) == len(ends):  # the worker steps in order: pairs
            busy = sum(b - a for a, b in zip(sorted(starts), sorted(ends)))
        elif starts and ends:
            busy = max(ends) - min(starts)
        else:
            busy = None
        nbytes = sum(sizes[i][0] * sizes[i][1] for i in hooked) if hooks else None
        nparams = sum(sizes[i][0] for i in (hooked if hooks else range(len(sizes))))
        # one gradient out and one parameter back per tensor whose gradient reached the
        # offloader (its hook ran); gradients have their parameter's dtype
        b = {"forward_ms": ms(self.t1 - self.t0), "backward_ms": ms(t2 - self.t1),
             "step_after_backward_ms": ms(self.t3 - t2),
             "zero_grad_ms": ms(self.t4 - self.t3),
             "iteration_ms": ms(self.t_end - self.t0),
             "d2h_bytes": nbytes, "h2d_bytes": nbytes,
             "d2h_gb_s": None, "h2d_gb_s": None, "d2h_exposed_ms": None, "h2d_exposed_ms": None,
             "host_start_vs_backward_end_ms": ms(min(starts) - t2) if starts else None,
             "host_end_vs_backward_end_ms": ms(max(ends) - t2) if ends else None,
             "host_step_ms": ms(busy) if busy is not None else None,
             "host_calls": len(starts),
             "host_ns_per_param": None, "host_core_ns_per_param": None,
             "threads": threads,
             "device_idle_ms": None,
             "hook_ms": ms(sum(d for _, (_, d) in hooks)) if hooks else None,
             "hooks": len(hooks),
             "staging_allocs": (None if self.staging0 is None or self.staging1 is None
                                else self.staging1 - self.staging0),
             "pinned_requests": None, "pinned_new_blocks": None}
        host_end = max(ends) if ends else t2
        if self.cuda:
            if self.e_d2h is not None:
                b["d2h_exposed_ms"] = max(0.0, self.e_bwd1.elapsed_time(self.e_d2h))
                span = self.e_bwd0.elapsed_time(self.e_d2h) / 1e3
                b["d2h_gb_s"] = nbytes / span / 1e9 if nbytes and span > 0 else None
            b["device_idle_ms"] = max(0.0, self.e_bwd1.elapsed_time(self.e_next))
            if self.h2d is not None:
                last_back = max([self.t_h2d, *copied])
                b["h2d_exposed_ms"] = max(0.0, ms(last_back - max(t2, host_end)))
                first = min(starts) if starts else t2
                span = (last_back - first) / 1e9
                b["h2d_gb_s"] = nbytes / span / 1e9 if nbytes and span > 0 else None
            if self.pinned0 is not None:
                b["pinned_requests"] = self.pinned1[0] - self.pinned0[0]
                b["pinned_new_blocks"] = self.pinned1[1] - self.pinned0[1]
        elif self.logged:
            # the CPU as the device: a gradient is copied inside its hook (or lands on the
            # worker), a parameter back right after its step; step() returns after both
            last_out = max(landed) if landed else (max(t for t, _ in hooks) if hooks else None)
            b["d2h_exposed_ms"] = None if last_out is None else max(0.0, ms(last_out - t2))
            last_back = max(copied) if copied else self.t3
            b["h2d_exposed_ms"] = max(0.0, ms(last_back - max(t2, host_end)))
        if not self.cuda:
            b["device_idle_ms"] = ms(self.t4 - t2)  # the next forward waits for the host
        if busy is not None and nparams:
            b["host_ns_per_param"] = busy / nparams
            b["host_core_ns_per_param"] = busy * (threads or 1) / nparams
        return b


def measured_ms(b: dict) -> float:
    """A step as the device lives it: forward, backward, then the idle gap until the next
    forward may start (after step() and zero_grad(); on the CPU: until they return)."""
    return b["forward_ms"] + b["backward_ms"] + (b["device_idle_ms"] or 0.0)


def predicted_ms(b: dict, d2h_gb_s: float | None, h2d_gb_s: float | None) -> dict | None:
    """The step-time model (written down in bench_offload.py's docstring and RESULTS.md):

        predicted = forward + max(backward, d2h_bytes / d2h_bw, host_step) + tail
        tail      = host_step * c + (h2d_bytes * c) / h2d_bw,  c = min(1, 64 MiB / h2d_bytes)

    the pipeline issue 40 asks for: the gradients leave during backward, each chunk
    steps as it lands, so backward, the copies out and the host step overlap and the
    slowest of them sets the pace; what cannot overlap is the last chunk's step and its
    copy back. Also ``serial``: the same parts one after the other (forward + backward +
    exposed d2h + host step + every copy back), what an offloader without overlap costs.
    None when a part is missing."""
    host, nbytes = b.get("host_step_ms"), b.get("d2h_bytes")
    if host is None or not nbytes or not d2h_gb_s or not h2d_gb_s:
        return None
    d2h = nbytes / (d2h_gb_s * 1e9) * 1e3
    h2d = b["h2d_bytes"] / (h2d_gb_s * 1e9) * 1e3
    c = min(1.0, CHUNK_MIB * 2**20 / b["h2d_bytes"])
    tail = host * c + h2d * c
    return {"predicted_ms": b["forward_ms"] + max(b["backward_ms"], d2h, host) + tail,
            "serial_ms": b["forward_ms"] + b["backward_ms"] + (b["d2h_exposed_ms"] or 0.0)
            + host + h2d,
            "model_d2h_ms": d2h, "model_h2d_ms": h2d, "model_tail_ms": tail}
