"""Checkpointed recomputation with a memory budget.

Activation checkpointing trades compute for memory: a checkpointed part of the model
keeps only its input during the forward pass and runs again during backward to get
the tensors its backward needs. memfit answers the question users actually ask,
"make it fit in this much memory", instead of asking for a segment count:

    >>> import torch, memfit.checkpoint as mc
    >>> model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(64, 256),
    ...     torch.nn.GELU(), torch.nn.Linear(256, 64)) for _ in range(8)])
    >>> x = torch.randn(32, 64)
    >>> p = mc.auto(model, x, budget="50%")   # half of the store-everything memory
    >>> print(p)                                # doctest: +SKIP
    >>> model(x).sum().backward()               # runs with the chosen checkpoints

Pieces:

* :func:`plan` -- the planner (C core): given per-stage ``input_bytes``,
  ``saved_bytes`` and ``forward_cost`` of a chain and a budget, the plan of least
  recompute cost that fits. :func:`plan_sqrt` is the classic sqrt(n) plan.
* :func:`checkpoint` -- a non-reentrant checkpoint on saved-tensor hooks, a drop-in
  for ``torch.utils.checkpoint.checkpoint`` with ``compress="int8"`` on top.
* :func:`checkpoint_sequential` and :func:`auto` -- measure the stages once, plan,
  and run (or wrap) the stages accordingly.
* :class:`ActivationMeter` -- counts the bytes kept for backward, in the planner's
  terms, so a plan can be checked against what really happened.

Memory model (the planner's contract). A chain of ``n`` stages; stage ``i`` has
``input_bytes[i]`` (the tensor handed to it), ``saved_bytes[i]`` (what its backward
needs when it is not checkpointed) and ``forward_cost[i]``. A plan cuts the chain into
contiguous segments, each *stored* (its stages keep their saved tensors) or
*checkpointed* (only ``input_bytes[start]`` is kept; the stages run again in
backward). Then::

    memory  = sum(input_bytes[start] for checkpointed segments)
            + sum(saved_bytes[i]     for stages in stored segments)
            + max(sum(saved_bytes[start:end]) for checkpointed segments)  # the one
                                                                          # recomputed
    recompute cost = sum(forward_cost[i] for stages in checkpointed segments)

It is an upper bound on the real peak (when segment k is recomputed, the segments
after it are already freed). torch is imported only when a function needs it.
"""

from __future__ import annotations

import math
import re
import threading
import time
import warnings
import weakref
from collections import OrderedDict
from typing import Any, Callable, Iterable, Sequence

from memfit import _C
from memfit._C import Error as _MemfitError

__all__ = [
    "ActivationMeter",
    "AutoPlan",
    "ChainMeasurement",
    "CheckpointError",
    "Plan",
    "auto",
    "checkpoint",
    "checkpoint_sequential",
    "measure",
    "min_budget",
    "parse_bytes",
    "plan",
    "plan_sqrt",
]


class CheckpointError(_MemfitError, RuntimeError):
    """A checkpointed function did something recomputation cannot reproduce (its
    recompute saved tensors of other shapes or dtypes, or a different number)."""


# --------------------------------------------------------------------- budgets --

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value, *, total: int | None = None, name: str = "budget") -> int:
    """A byte count from an int, a float, or a string such as ``"6GB"`` (10**9),
    ``"6GiB"``/``"6G"`` (2**30), ``"512MiB"``, ``"1.5 GB"``; ``"50%"`` means that share
    of ``total`` (for budgets: of the store-everything activation memory).

    >>> parse_bytes("6GB"), parse_bytes("512MiB"), parse_bytes("25%", total=1000)
    (6000000000, 536870912, 250)
    """
    if isinstance(value, bool):
        raise TypeError(f"{name}: expected bytes as an int or a string like '6GB', got bool")
    if isinstance(value, str):
        s = value.strip()
        if s.endswith("%"):
            if total is None:
                raise ValueError(f"{name}: {value!r} is a share of the full activation "
                                 "memory, which is not known here; give bytes")
            try:
                frac = float(s[:-1]) / 100.0
            except ValueError:
                raise ValueError(f"{name}: cannot read {value!r} as a percentage") from None
            if not (frac >= 0.0 and math.isfinite(frac)):
                raise ValueError(f"{name}: {value!r} must be a non-negative percentage")
            return int(math.floor(frac * total))
        m = _SIZE_RE.match(s)
        if not m or m.group(2).lower() not in _UNITS:
            raise ValueError(f"{name}: cannot read {value!r} as a size; use bytes (an int) "
                             "or e.g. '6GB', '6GiB', '512MiB', '50%'")
        out = float(m.group(1)) * _UNITS[m.group(2).lower()]
        return int(math.floor(out))
    try:
        import operator

        v = operator.index(value)
    except TypeError:
        if isinstance(value, float):
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name}: must be a finite size >= 0, got {value}") from None
            return int(math.floor(value))
        raise TypeError(f"{name}: expected bytes as an int or a string like '6GB', "
                        f"got {type(value).__name__}") from None
    if v < 0:
        raise ValueError(f"{name}: must be >= 0 bytes, got {v}")
    return int(v)


def _fmt_bytes(n) -> str:
    if n is None:
        return "?"
    n = float(n)
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= div:
            return f"{n / div:.2f} {unit}"
    return f"{int(n)} B"


# ------------------------------------------------------------------------ plans --

class Plan:
    """A checkpointing plan for a chain of stages.

    Attributes:
        segments: list of ``(start, end_exclusive, checkpointed)`` covering
            ``range(n_stages)`` in order.
        memory_bytes: the plan's memory under the model (module docstring), or None
            when the stage sizes are not known (``plan_sqrt(n)`` alone).
        recompute_cost: sum of ``forward_cost`` over checkpointed stages (every
            stage costs 1 when no costs were given).
        budget_bytes: the budget it was planned for (None if none).
        exact: True when the planner proved it least-cost; False when it rounded
            sizes to ``unit_bytes`` (the plan still fits, it may cost a little more).
        input_bytes, saved_bytes, forward_cost: the chain it was planned on.
        names: optional stage names (for printing).

    >>> p = plan([2, 2, 2, 2], [10, 10, 10, 10], [1, 1, 1, 1], budget_bytes=34)
    >>> p.segments, p.memory_bytes, p.recompute_cost
    ([(0, 1, True), (1, 2, True), (2, 4, False)], 34, 2.0)
    """

    def __init__(self, segments, memory_bytes=None, recompute_cost=None, *, budget_bytes=None,
                 input_bytes=None, saved_bytes=None, forward_cost=None, exact=True,
                 unit_bytes=1, names=None):
        self.segments = [(int(s), int(e), bool(c)) for s, e, c in segments]
        self.memory_bytes = None if memory_bytes is None else int(memory_bytes)
        self.recompute_cost = None if recompute_cost is None else float(recompute_cost)
        self.budget_bytes = budget_bytes
        self.exact = bool(exact)
        self.unit_bytes = int(unit_bytes)
        self.input_bytes = None if input_bytes is None else [int(v) for v in input_bytes]
        self.saved_bytes = None if saved_bytes is None else [int(v) for v in saved_bytes]
        self.forward_cost = None if forward_cost is None else [float(v) for v in forward_cost]
        self.names = None if names is None else list(names)

    @classmethod
    def from_segments(cls, segments, input_bytes, saved_bytes, forward_cost=None,
                      names=None) -> "Plan":
        """Evaluates any hand-made plan (e.g. "checkpoint every block") under the
        model. ``segments`` as in :attr:`segments`.

        >>> Plan.from_segments([(0, 1, True), (1, 2, True)], [4, 4], [10, 10]).memory_bytes
        18
        """
        segs = [(int(s), int(e), bool(c)) for s, e, c in segments]
        mem, cost = _C.plan_evaluate(list(input_bytes), list(saved_bytes),
                                     None if forward_cost is None else list(forward_cost), segs)
        if forward_cost is None:
            cost = float(sum(e - s for s, e, c in segs if c))
        return cls(segs, mem, cost, input_bytes=input_bytes, saved_bytes=saved_bytes,
                   forward_cost=forward_cost, names=names)

    @property
    def n_stages(self) -> int:
        return self.segments[-1][1] if self.segments else 0

    @property
    def checkpointed_stages(self) -> list[int]:
        """Indices of the stages that run again during backward."""
        return [i for s, e, c in self.segments if c for i in range(s, e)]

    @property
    def full_memory_bytes(self):
        """Memory with no checkpointing (sum of saved_bytes), when known."""
        return None if self.saved_bytes is None else sum(self.saved_bytes)

    def to_dict(self) -> dict:
        return {
            "segments": [list(s) for s in self.segments],
            "memory_bytes": self.memory_bytes,
            "recompute_cost": self.recompute_cost,
            "budget_bytes": self.budget_bytes,
            "full_memory_bytes": self.full_memory_bytes,
            "exact": self.exact,
            "unit_bytes": self.unit_bytes,
        }

    def __repr__(self) -> str:
        return (f"Plan(segments={self.segments!r}, memory_bytes={self.memory_bytes!r}, "
                f"recompute_cost={self.recompute_cost!r})")

    def _stage_label(self, s, e) -> str:
        if self.names and e - s == 1:
            return f"{s:>4}       {self.names[s]}"
        if self.names:
            return f"{s:>4}-{e - 1:<4}  {self.names[s]} .. {self.names[e - 1]}"
        return f"{s:>4}-{e - 1:<4}" if e - s > 1 else f"{s:>4}     "

    def __str__(self) -> str:
        n = self.n_stages
        ck = len(self.checkpointed_stages)
        head = f"checkpoint plan: {n} stages in {len(self.segments)} segments, {ck} recomputed"
        lines = [head]
        if self.memory_bytes is not None:
            mem = f"  memory {_fmt_bytes(self.memory_bytes)}"
            if self.budget_bytes is not None:
                mem += f" of a {_fmt_bytes(self.budget_bytes)} budget"
            if self.full_memory_bytes is not None:
                mem += f" (no checkpointing: {_fmt_bytes(self.full_memory_bytes)})"
            lines.append(mem)
        if self.recompute_cost is not None:
            extra = ""
            if self.forward_cost:
                total = sum(self.forward_cost)
                if total > 0:
                    extra = f" = {100.0 * self.recompute_cost / total:.1f}% of one forward"
            lines.append(f"  recompute cost {self.recompute_cost:.6g}{extra}")
        if not self.exact:
            lines.append(f"  (sizes rounded to {_fmt_bytes(self.unit_bytes)} for planning)")
        for s, e, c in self.segments:
            label = self._stage_label(s, e)
            if c:
                what = "checkpointed"
                if self.input_bytes is not None:
                    what += (f"  keeps {_fmt_bytes(self.input_bytes[s])},"
                             f" recomputes {_fmt_bytes(sum(self.saved_bytes[s:e]))}")
            else:
                what = "stored"
                if self.saved_bytes is not None:
                    what += f"        keeps {_fmt_bytes(sum(self.saved_bytes[s:e]))}"
            lines.append(f"  stages {label}  {what}")
        return "\n".join(lines)


def _as_list(v, name):
    try:
        return list(v)
    except TypeError:
        raise TypeError(f"{name}: expected a sequence (one entry per stage), "
                        f"got {type(v).__name__}") from None


def _chain_args(input_bytes, saved_bytes, forward_cost):
    ib = _as_list(input_bytes, "input_bytes")
    sb = _as_list(saved_bytes, "saved_bytes")
    fc = [1.0] * len(ib) if forward_cost is None else _as_list(forward_cost, "forward_cost")
    return ib, sb, fc


def plan(input_bytes: Sequence[int], saved_bytes: Sequence[int],
         forward_cost: Sequence[float] | None = None, budget_bytes=None, *,
         max_slots: int | None = None, names=None) -> Plan:
    """The least-recompute-cost plan whose memory fits in ``budget_bytes``.

    Args:
        input_bytes, saved_bytes: per stage, as in the module docstring (ints).
        forward_cost: per stage, any non-negative unit (seconds, FLOPs); None: 1 each.
        budget_bytes: int bytes or a string: ``"6GB"``, ``"512MiB"``, ``"50%"`` (a share
            of the store-everything memory ``sum(saved_bytes)``).
        max_slots: resolution of the planner's memory axis (default: chosen from n so
            that planning takes ~0.1 s). Chains whose sizes share a large common unit
            (identical blocks) are planned exactly; others are rounded, see
            :attr:`Plan.exact`. The plan returned is never worse than storing
            everything, checkpointing every stage, or :func:`plan_sqrt`, when those fit.

    Raises:
        ValueError: when no plan fits; the message gives the smallest feasible budget
            (also available as :func:`min_budget`).

    Exact dynamic program in C, O(n * slots * caps); 1000 stages plan in 0.1-0.3 s.

    >>> p = plan([2, 2, 2, 2], [10, 10, 10, 10], None, "85%")  # 85% of 40 bytes
    >>> p.segments, p.memory_bytes, p.recompute_cost
    ([(0, 1, True), (1, 2, True), (2, 4, False)], 34, 2.0)
    """
    ib, sb, fc = _chain_args(input_bytes, saved_bytes, forward_cost)
    if budget_bytes is None:
        raise TypeError("plan: budget_bytes is required (bytes, '6GB' or '50%')")
    total = None
    if isinstance(budget_bytes, str) and budget_bytes.strip().endswith("%"):
        total = _C.plan_evaluate(ib, sb, None, [(0, len(ib), False)])[0] if ib else 0
    budget = parse_bytes(budget_bytes, total=total, name="budget_bytes")
    slots = 0 if max_slots is None else int(max_slots)
    segs, mem, cost, unit, exact = _C.plan_budget(ib, sb, fc, budget, slots)
    return Plan(segs, mem, cost, budget_bytes=budget, input_bytes=ib, saved_bytes=sb,
                forward_cost=fc, exact=exact, unit_bytes=unit, names=names)


def min_budget(input_bytes: Sequence[int], saved_bytes: Sequence[int]) -> int:
    """The smallest memory of any plan for this chain (exact), i.e. the least budget
    :func:`plan` accepts.

    >>> min_budget([4, 4, 4, 4], [10, 10, 10, 10])
    26
    """
    return _C.plan_min_budget(_as_list(input_bytes, "input_bytes"),
                              _as_list(saved_bytes, "saved_bytes"))


def plan_sqrt(n: int, input_bytes=None, saved_bytes=None, forward_cost=None, names=None) -> Plan:
    """The classic sqrt(n) plan (Chen et al. 2016): ``round(sqrt(n))`` segments of
    near-equal length, all checkpointed but the last (whose backward runs right
    after its forward), as ``torch.utils.checkpoint.checkpoint_sequential`` does.
    With the stage sizes given, ``memory_bytes`` and ``recompute_cost`` are filled in.

    >>> plan_sqrt(10).segments
    [(0, 4, True), (4, 7, True), (7, 10, False)]
    """
    if isinstance(n, bool):
        raise TypeError("n: expected an int")
    segs = _C.plan_sqrt(int(n))
    if input_bytes is None or saved_bytes is None:
        cost = float(sum(e - s for s, e, c in segs if c)) if forward_cost is None else \
            float(sum(forward_cost[i] for s, e, c in segs if c for i in range(s, e)))
        return Plan(segs, None, cost, forward_cost=forward_cost, names=names)
    return Plan.from_segments(segs, input_bytes, saved_bytes, forward_cost, names=names)


# ------------------------------------------------------------ saved-tensor hooks --

def _torch():
    import torch

    return torch


class _StopRecompute(BaseException):
    # BaseException so that a broad `except Exception` in user code cannot swallow it.
    pass


class _Slot:
    """What the forward saves in place of a tensor: a key the recompute fills,
    per backward pass (graph task)."""

    __slots__ = ("values", "__weakref__")

    def __init__(self):
        self.values = {}


def _storage_key(t):
    try:
        st = t.untyped_storage()
        return (st.device.type, st.device.index, st.data_ptr()), st.nbytes()
    except Exception:  # tensor subclasses without storage: count their own bytes
        return ("id", id(t)), t.numel() * t.element_size()


class ActivationMeter:
    """Counts the bytes a forward pass keeps for backward, in the planner's terms.

    Inside ``with meter:`` every tensor saved for backward outside checkpointed
    regions is counted once per storage (``saved_bytes``), checkpoints report what
    they keep to recompute (``boundary_bytes``: inputs, or their int8 codes with
    ``compress="int8"``), and during the later backward each recompute reports the
    tensors it materializes (``recompute_peak_bytes`` is the largest). Parameters
    (and anything in ``exclude``) are not activations and are not counted.

    ``total_bytes = saved_bytes + boundary_bytes + recompute_peak_bytes`` is the
    quantity the planner bounds. Storages are counted whole (a view of a big tensor
    counts the big tensor), which is what stays allocated.

    >>> import torch
    >>> lin = torch.nn.Linear(8, 8)
    >>> with ActivationMeter(exclude=lin) as m:
    ...     y = torch.relu(lin(torch.randn(4, 8)))
    >>> m.saved_bytes  # the input saved by the matmul, the relu output
    256
    """

    def __init__(self, exclude: Any = None):
        self._exclude = set()
        if exclude is not None:
            self.exclude(exclude)
        self._saved = {}
        self._boundary = {}
        self.recompute_peak_bytes = 0
        self.recomputes = 0
        self._hooks = None
        self._lock = threading.Lock()

    def exclude(self, obj) -> None:
        """Do not count these tensors' storages (a module's parameters and buffers,
        a tensor, or an iterable of either)."""
        torch = _torch()
        items: Iterable
        if isinstance(obj, torch.nn.Module):
            items = list(obj.parameters()) + list(obj.buffers())
        elif isinstance(obj, torch.Tensor):
            items = [obj]
        else:
            items = list(obj)
        for t in items:
            if isinstance(t, torch.nn.Module):
                self.exclude(t)
            else:
                self._exclude.add(_storage_key(t)[0])

    def _add(self, table, t):
        key, nbytes = _storage_key(t)
        if key in self._exclude:
            return
        torch = _torch()
        if isinstance(t, torch.nn.Parameter):
            return
        table[key] = nbytes

    @property
    def saved_bytes(self) -> int:
        return sum(self._saved.values())

    @property
    def boundary_bytes(self) -> int:
        return sum(v for k, v in self._boundary.items() if k not in self._saved)

    @property
    def total_bytes(self) -> int:
        return self.saved_bytes + self.boundary_bytes + self.recompute_peak_bytes

    def _note_boundary(self, tensors):
        with self._lock:
            for t in tensors:
                self._add(self._boundary, t)

    def _note_recompute(self, tensors):
        table = {}
        for t in tensors:
            self._add(table, t)
        with self._lock:
            self.recomputes += 1
            self.recompute_peak_bytes = max(self.recompute_peak_bytes, sum(table.values()))

    def __enter__(self):
        torch = _torch()

        def pack(x):
            self._add(self._saved, x)
            return x

        def unpack(x):
            return x

        self._hooks = torch.autograd.graph.saved_tensors_hooks(pack, unpack)
        self._hooks.__enter__()
        _active_meters.append(self)
        return self

    def __exit__(self, *exc):
        _active_meters.remove(self)
        self._hooks.__exit__(*exc)
        self._hooks = None
        return False

    def __repr__(self):
        return (f"ActivationMeter(saved={_fmt_bytes(self.saved_bytes)}, "
                f"boundary={_fmt_bytes(self.boundary_bytes)}, "
                f"recompute_peak={_fmt_bytes(self.recompute_peak_bytes)}, "
                f"total={_fmt_bytes(self.total_bytes)})")


_active_meters: list = []


# ------------------------------------------------------------------ the frame --

_TENSOR, _QUANT, _LINK, _VALUE = 0, 1, 2, 3


def _autocast_state():
    torch = _torch()
    kinds = ["cpu"]
    if torch.cuda.is_available():
        kinds.append("cuda")
    cache = torch.is_autocast_cache_enabled()
    return [(k, torch.is_autocast_enabled(k), torch.get_autocast_dtype(k), cache) for k in kinds]


def _tensor_devices(args, kwargs):
    torch = _torch()
    devs = set()
    for v in list(args) + list(kwargs.values()):
        if isinstance(v, torch.Tensor) and v.device.type == "cuda":
            devs.add(v.device.index if v.device.index is not None else torch.cuda.current_device())
    if not devs and torch.cuda.is_available() and torch.cuda.is_initialized():
        devs.add(torch.cuda.current_device())
    return sorted(devs)


def _index_tensors(out):
    """{id(tensor): path} for tensors in an output: the tensor itself, or one level
    into a tuple/list/dict (HF ModelOutput is a dict and a tuple)."""
    torch = _torch()
    found = {}
    if isinstance(out, torch.Tensor):
        found[id(out)] = ()
    elif isinstance(out, dict):
        for k, v in out.items():
            if isinstance(v, torch.Tensor):
                found.setdefault(id(v), (k,))
    elif isinstance(out, (tuple, list)):
        for i, v in enumerate(out):
            if isinstance(v, torch.Tensor):
                found.setdefault(id(v), (i,))
    return found


def _follow(out, path):
    for p in path:
        out = out[p]
    return out


def _detached(t):
    d = t.detach()
    if t.requires_grad:
        d.requires_grad_(True)
    return d


class _Call:
    __slots__ = ("fn", "args", "kwargs", "rng_cpu", "rng_cuda", "autocast")


class _Frame:
    """One checkpointed region: the calls to replay (one for checkpoint(), one per
    block for a segment wrapped by auto()), what they were given, and one slot per
    tensor the forward would have saved."""

    def __init__(self, *, preserve_rng_state, check, recompute_ctx, compress):
        self.calls = []
        self.slots = []   # weakrefs to _Slot, in the order the forward saved them
        self.meta = []    # (shape, dtype, device) of each, for the determinism check
        self.preserve_rng_state = preserve_rng_state
        self.check = check
        self.recompute_ctx = recompute_ctx
        self.compress = compress
        self.meters = list(_active_meters)
        self.lock = threading.RLock()
        self.devices = set()

    # -- forward --
    def _store(self, v, boundary, links):
        torch = _torch()
        if isinstance(v, torch.Tensor):
            if links is not None and id(v) in links:
                return (_LINK, links[id(v)])
            if (boundary and self.compress == "int8" and v.dtype in
                    (torch.float32, torch.float16, torch.bfloat16) and v.numel() > 0
                    and not (v.requires_grad and v.is_leaf)):
                from memfit import quant

                state = quant.quantize_blockwise(v.detach().contiguous())
                for m in self.meters:
                    m._note_boundary([state.codes, state.absmax])
                return (_QUANT, state, v.requires_grad)
            for m in self.meters:
                m._note_boundary([v])
            return (_TENSOR, v)
        return (_VALUE, v)

    def add_call(self, fn, args, kwargs, prev_out=None, boundary=True):
        torch = _torch()
        links = _index_tensors(prev_out) if prev_out is not None else None
        c = _Call()
        c.fn = fn
        c.args = [self._store(a, boundary, links) for a in args]
        c.kwargs = {k: self._store(v, boundary, links) for k, v in kwargs.items()}
        c.rng_cpu = c.rng_cuda = None
        if self.preserve_rng_state:
            c.rng_cpu = torch.get_rng_state()
            devs = _tensor_devices(args, kwargs)
            if devs:
                c.rng_cuda = [(d, torch.cuda.get_rng_state(d)) for d in devs]
                self.devices.update(devs)
        c.autocast = _autocast_state()
        self.calls.append(c)
        return c

    def hooks(self):
        torch = _torch()
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, x):
        slot = _Slot()
        self.slots.append(weakref.ref(slot))
        if self.check:
            self.meta.append((tuple(x.shape), x.dtype, x.device))
        return slot

    # -- backward --
    def _unpack(self, slot):
        torch = _torch()
        gid = torch._C._current_graph_task_id()
        transient = gid == -1  # unpacked outside a backward (e.g. grad_fn._saved_*)
        if transient:
            gid = object()
        with self.lock:
            if gid not in slot.values:
                # First unpack of this backward pass (or a second unpack of the same
                # slot, e.g. ctx.saved_tensors read twice): run the region again.
                self._recompute(gid)
            if gid not in slot.values:
                raise CheckpointError("memfit.checkpoint: internal error: the recompute "
                                      "did not produce a saved tensor")
            value = slot.values.pop(gid)
            if transient:
                for ref in self.slots:
                    s = ref()
                    if s is not None:
                        s.values.pop(gid, None)
        return value

    def _args_for(self, call, prev_out):
        def load(entry):
            kind = entry[0]
            if kind == _TENSOR:
                return _detached(entry[1])
            if kind == _QUANT:
                from memfit import quant

                t = quant.dequantize_blockwise(entry[1])
                if entry[2]:
                    t.requires_grad_(True)
                return t
            if kind == _LINK:
                return _follow(prev_out, entry[1])
            return entry[1]

        return [load(a) for a in call.args], {k: load(v) for k, v in call.kwargs.items()}

    def _recompute(self, gid):
        torch = _torch()
        n = len(self.slots)
        count = [0]
        made = []
        metered = bool(self.meters)

        def pack(x):
            i = count[0]
            count[0] += 1
            if i >= n:
                raise CheckpointError(
                    "memfit.checkpoint: the recompute saved more tensors for backward "
                    f"than the forward did ({n}). The checkpointed function must do the "
                    "same work when it runs again.")
            if self.check:
                shape, dtype, device = self.meta[i]
                if tuple(x.shape) != shape or x.dtype != dtype or x.device != device:
                    raise CheckpointError(
                        f"memfit.checkpoint: recomputed tensor #{i} (of {n} saved for "
                        f"backward) has shape {tuple(x.shape)}, dtype {x.dtype}, device "
                        f"{x.device}, but the forward saved shape {shape}, dtype {dtype}, "
                        f"device {device}. The checkpointed function computed something "
                        "different when run again: look for randomness outside torch's "
                        "RNG, shapes that depend on data or on state that changed between "
                        "forward and backward (flags, caches, use_cache=True), or pass "
                        "determinism_check='none' to skip this check.")
            v = x.detach() if x.requires_grad else x
            slot = self.slots[i]()
            if slot is not None:
                slot.values[gid] = v
            if metered:
                made.append(v)
            if count[0] == n:
                raise _StopRecompute
            # The detached tensor, not x: a saved output x holds its own grad_fn, and
            # storing x in that node's saved variables would make a cycle that keeps
            # the whole recomputed graph (and this frame) alive.
            return v

        def unpack(x):
            return x

        stopped = False
        with torch.random.fork_rng(devices=sorted(self.devices),
                                   enabled=self.preserve_rng_state):
            try:
                with torch.autograd.graph.saved_tensors_hooks(pack, unpack), \
                        torch.enable_grad(), self.recompute_ctx():
                    prev = None
                    for call in self.calls:
                        if call.rng_cpu is not None:
                            torch.set_rng_state(call.rng_cpu)
                        if call.rng_cuda:
                            for d, st in call.rng_cuda:
                                torch.cuda.set_rng_state(st, d)
                        args, kwargs = self._args_for(call, prev)
                        with _autocast_ctx(call.autocast):
                            prev = call.fn(*args, **kwargs)
            except _StopRecompute:
                stopped = True
        if not stopped and n > 0:
            raise CheckpointError(
                f"memfit.checkpoint: the recompute saved {count[0]} tensors for backward "
                f"but the forward saved {n}. The checkpointed function must do the same "
                "work when it runs again (look for branches on global state).")
        for m in self.meters:
            m._note_recompute(made)


class _autocast_ctx:
    """Re-enters the autocast state recorded in the forward, for every device type."""

    def __init__(self, state):
        self.state = state
        self.ctxs = []

    def __enter__(self):
        torch = _torch()
        for kind, enabled, dtype, cache in self.state:
            ctx = torch.autocast(device_type=kind, enabled=enabled, dtype=dtype,
                                 cache_enabled=cache)
            ctx.__enter__()
            self.ctxs.append(ctx)
        return self

    def __exit__(self, *exc):
        while self.ctxs:
            self.ctxs.pop().__exit__(*exc)
        return False


class _nullctx:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _check_options(compress, use_reentrant, determinism_check, context_fn):
    if compress not in (None, "int8"):
        raise ValueError(f"compress: expected None or 'int8', got {compress!r}")
    if use_reentrant:
        warnings.warn("memfit.checkpoint is always non-reentrant (saved-tensor hooks); "
                      "use_reentrant=True is ignored. Gradients are the same.",
                      stacklevel=3)
    if determinism_check not in ("default", "none"):
        raise ValueError("determinism_check: expected 'default' or 'none', got "
                         f"{determinism_check!r}")
    if context_fn is not None and not callable(context_fn):
        raise TypeError("context_fn: expected a callable returning two context managers")


def checkpoint(function: Callable, *args, compress: str | None = None,
               use_reentrant: bool | None = None, preserve_rng_state: bool = True,
               determinism_check: str = "default", context_fn: Callable | None = None,
               debug: bool = False, **kwargs):
    """Run ``function(*args, **kwargs)`` without keeping the tensors its backward
    needs; they are recomputed when backward first asks for one.

    Non-reentrant, built on saved-tensor hooks, like
    ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``, and taking the
    same keyword arguments: ``use_reentrant`` (always non-reentrant; True warns),
    ``preserve_rng_state``, ``determinism_check`` (``"default"`` or ``"none"``),
    ``context_fn`` and ``debug`` (accepted, ignored). Every other keyword goes to
    ``function``. Semantics:

    * any inputs: keyword arguments, non-tensor arguments, tensors that do not
      require grad; any outputs (tuples, dicts, non-tensors);
    * under ``torch.no_grad()`` it just runs ``function``;
    * nested checkpoints, ``torch.autograd.grad``, ``retain_graph=True`` work;
    * the CPU and CUDA RNG states are restored for the recompute (dropout draws the
      same mask) and the global RNG stream is left as it was; autocast is restored;
    * the recompute stops as soon as every tensor the backward needs exists;
    * a recompute that saves tensors of another shape, dtype or device, or a
      different number of them, raises :class:`CheckpointError`;
    * gradients are bitwise those of the plain function for deterministic ops.

    ``compress="int8"``: tensor inputs (the only thing a checkpoint keeps) are stored
    blockwise-quantized with :func:`memfit.quant.quantize_blockwise` (block 256, the
    dynamic code): about 4x less memory for float32, 2x for bf16/fp16. The forward
    is unchanged; the recompute starts from the dequantized input, so the tensors
    the backward uses carry the quantization error (dynamic 8-bit: about 1% of each
    block's absmax at worst for typical activations). Gradients with respect to
    parameters then differ slightly from exact ones; gradients still flow to the
    inputs exactly through the graph. Leaf tensors that require grad (parameters)
    are kept as they are.

    >>> import torch
    >>> lin = torch.nn.Linear(16, 16)
    >>> x = torch.randn(4, 16, requires_grad=True)
    >>> y = checkpoint(lambda t, scale: torch.tanh(lin(t)) * scale, x, scale=2.0)
    >>> y.sum().backward()
    >>> x.grad.shape
    torch.Size([4, 16])
    """
    torch = _torch()
    _check_options(compress, use_reentrant, determinism_check, context_fn)
    if not callable(function):
        raise TypeError(f"function: expected a callable, got {type(function).__name__}")
    if not torch.is_grad_enabled():
        return function(*args, **kwargs)
    if context_fn is not None:
        fwd_ctx = context_fn()[0]
        recompute_ctx = lambda: context_fn()[1]  # noqa: E731  a fresh one per recompute
    else:
        fwd_ctx, recompute_ctx = _nullctx(), _nullctx
    frame = _Frame(preserve_rng_state=preserve_rng_state, check=determinism_check != "none",
                   recompute_ctx=recompute_ctx, compress=compress)
    frame.add_call(function, args, kwargs)
    with frame.hooks(), fwd_ctx:
        return function(*args, **kwargs)


# ------------------------------------------------------- measuring a chain --

class ChainMeasurement:
    """Per-stage sizes and costs of a chain, measured by :func:`measure`."""

    def __init__(self, input_bytes, saved_bytes, forward_cost, names):
        self.input_bytes = input_bytes
        self.saved_bytes = saved_bytes
        self.forward_cost = forward_cost
        self.names = names

    @property
    def full_memory_bytes(self) -> int:
        return sum(self.saved_bytes)

    def __len__(self):
        return len(self.saved_bytes)

    def __repr__(self):
        return (f"ChainMeasurement(n={len(self)}, input_bytes={self.input_bytes}, "
                f"saved_bytes={self.saved_bytes}, forward_cost={self.forward_cost})")


def _find_blocks(model):
    """The chain inside a model: the nn.ModuleList holding the most parameters
    (transformer blocks in GPT-2, Llama, BERT, ViT ...)."""
    torch = _torch()
    best, best_n = None, -1
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.ModuleList) and len(mod) > 0:
            n = sum(p.numel() for p in mod.parameters())
            if n > best_n:
                best, best_n = mod, n
    if best is None:
        raise ValueError("model: found no nn.ModuleList of blocks in it; pass blocks=")
    return best


def _resolve_chain(model_or_blocks, blocks):
    """-> (list of stage modules, runner(example) -> output)"""
    torch = _torch()
    if blocks is not None:
        stages = list(blocks)

        def run(example):
            return _call_with(model_or_blocks, example)
        return stages, run
    if isinstance(model_or_blocks, torch.nn.Sequential):
        stages = list(model_or_blocks)

        def run(example):
            return _call_with(model_or_blocks, example)
        return stages, run
    if isinstance(model_or_blocks, (torch.nn.ModuleList, list, tuple)):
        stages = list(model_or_blocks)

        def run(example):
            x = example
            for st in stages:
                out = _call_with(st, x)
                x = out if isinstance(out, torch.Tensor) else out[0]
            return x
        return stages, run
    if isinstance(model_or_blocks, torch.nn.Module):
        stages = list(_find_blocks(model_or_blocks))

        def run(example):
            return _call_with(model_or_blocks, example)
        return stages, run
    raise TypeError("model_or_module_list: expected an nn.Module (Sequential, ModuleList or "
                    f"a model with a block list), got {type(model_or_blocks).__name__}")


def _call_with(fn, example):
    if isinstance(example, dict):
        return fn(**example)
    if isinstance(example, (tuple, list)):
        return fn(*example)
    return fn(example)


def _sync(devices):
    torch = _torch()
    for d in devices:
        torch.cuda.synchronize(d)


def measure(model_or_blocks, example_input, *, blocks=None, cost: str = "time",
            repeats: int = 2) -> ChainMeasurement:
    """Measure each stage of a chain once: the bytes handed to it, the bytes its
    backward would keep (counted with saved-tensor hooks, parameters excluded) and
    its forward cost (``cost="time"``: the fastest of ``repeats`` timed runs;
    ``"flops"``: torch's FLOP counter). The measuring forward passes keep nothing
    for backward, so they need about one stage's activations, not the whole
    model's; RNG state and module buffers (e.g. BatchNorm statistics) are restored.

    ``model_or_blocks``: an ``nn.Sequential``; an ``nn.ModuleList`` or list of blocks
    (called in turn, each taking the previous output, or its first element when it
    returns a tuple); or any model, whose largest ``nn.ModuleList`` (or ``blocks=``) is
    the chain and which is called as ``model(example_input)`` (``model(**d)`` for a
    dict, ``model(*t)`` for a tuple).
    """
    torch = _torch()
    if cost not in ("time", "flops"):
        raise ValueError(f"cost: expected 'time' or 'flops', got {cost!r}")
    stages, run = _resolve_chain(model_or_blocks, blocks)
    if not stages:
        raise ValueError("model_or_module_list: the chain has no stages")
    n = len(stages)
    inb = [0] * n
    sab = [0] * n
    cst = [math.inf] * n
    params = set()
    owner = model_or_blocks if isinstance(model_or_blocks, torch.nn.Module) else None
    mods = [owner] if owner is not None else []
    mods += [s for s in stages if isinstance(s, torch.nn.Module)]
    for mod in mods:
        for t in list(mod.parameters()) + list(mod.buffers()):
            params.add(_storage_key(t)[0])
    buffers = []
    for mod in mods:
        buffers += [(b, b.detach().clone()) for b in mod.buffers()]
    devices = set()

    def drop_pack(x):
        return None

    def no_unpack(x):
        raise CheckpointError("memfit.checkpoint.measure: the measuring forward keeps "
                              "nothing for backward")

    originals = []

    def make_wrapper(i, stage_call):
        def wrapper(*args, **kwargs):
            seen = {}
            for v in list(args) + list(kwargs.values()):
                if isinstance(v, torch.Tensor):
                    k, nb = _storage_key(v)
                    if k not in params:
                        seen[k] = nb
                    if v.device.type == "cuda":
                        devices.add(v.device.index)
            inb[i] = max(inb[i], sum(seen.values()))
            saved = {}
            alive = []  # until the stage returns, so freed memory is not reused and
                        # two saved tensors never share an address in `saved`

            def pack(x):
                k, nb = _storage_key(x)
                if k not in params:
                    saved[k] = nb
                    alive.append(x)
                return None

            if cost == "flops":
                from torch.utils.flop_counter import FlopCounterMode

                with FlopCounterMode(display=False) as fc, \
                        torch.autograd.graph.saved_tensors_hooks(pack, no_unpack):
                    out = stage_call(*args, **kwargs)
                cst[i] = float(fc.get_total_flops())
            else:
                _sync(devices)
                t0 = time.perf_counter()
                with torch.autograd.graph.saved_tensors_hooks(pack, no_unpack):
                    out = stage_call(*args, **kwargs)
                _sync(devices)
                cst[i] = min(cst[i], time.perf_counter() - t0)
            sab[i] = max(sab[i], sum(saved.values()))
            del alive[:]
            return out
        return wrapper

    plain = [i for i, st in enumerate(stages) if not isinstance(st, torch.nn.Module)]
    if plain:
        raise TypeError(f"measure: stage {plain[0]} is not an nn.Module; wrap plain "
                        "functions in a module or pass the sizes to plan() yourself")
    for i, st in enumerate(stages):
        originals.append((st, st.__dict__.get("forward")))
        st.forward = make_wrapper(i, st.forward)
    rng_devs = sorted(d for d in range(torch.cuda.device_count())) \
        if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    try:
        with torch.random.fork_rng(devices=rng_devs), torch.enable_grad(), \
                torch.autograd.graph.saved_tensors_hooks(drop_pack, no_unpack):
            for _ in range(max(1, int(repeats)) if cost == "time" else 1):
                out = run(example_input)
                del out
    finally:
        for st, fwd in originals:
            if fwd is None:
                st.__dict__.pop("forward", None)
            else:
                st.forward = fwd
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
    names = []
    for i, st in enumerate(stages):
        names.append(f"{type(st).__name__}[{i}]")
    missing = [i for i in range(n) if cst[i] == math.inf]
    if missing:
        raise ValueError(f"measure: stage {missing[0]} was not called by the forward pass "
                         "(the chain must run every stage once per forward)")
    return ChainMeasurement(inb, sab, cst, names)


# ------------------------------------------------------ running a chain --

def _sequence_of_stages(stages):
    torch = _torch()
    if isinstance(stages, (torch.nn.Sequential, torch.nn.ModuleList)):
        return list(stages)
    if isinstance(stages, (list, tuple)):
        for i, s in enumerate(stages):
            if not callable(s):
                raise TypeError(f"stages[{i}]: expected a callable, got {type(s).__name__}")
        return list(stages)
    raise TypeError("stages: expected an nn.Sequential, nn.ModuleList or a list of "
                    f"callables, got {type(stages).__name__}")


_seq_cache: "OrderedDict[tuple, tuple]" = OrderedDict()


def _run_range(stages, s, e):
    def run(x):
        for i in range(s, e):
            x = stages[i](x)
        return x
    return run


def checkpoint_sequential(stages, x, budget=None, segments: int | None = None, *,
                          compress: str | None = None, cost: str = "time",
                          plan: Plan | None = None, preserve_rng_state: bool = True,
                          max_slots: int | None = None, use_reentrant: bool | None = None):
    """Run ``stages`` in turn on ``x``, checkpointed by a plan; returns the output.

    * ``budget`` (bytes, ``"6GB"``, ``"50%"``): the stages are measured once with
      :func:`measure` (cached for the same stages and input shape) and
      :func:`memfit.checkpoint.plan` chooses the segments;
    * ``segments=k``: ``k`` equal segments, all checkpointed but the last, like
      ``torch.utils.checkpoint.checkpoint_sequential``;
    * ``plan=``: a :class:`Plan` you made;
    * none of them: the :func:`plan_sqrt` plan.

    Under ``torch.no_grad()`` the stages just run.

    >>> import torch
    >>> net = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(6)])
    >>> y = checkpoint_sequential(net, torch.randn(4, 32), segments=2)
    >>> y.shape
    torch.Size([4, 32])
    """
    torch = _torch()
    seq = _sequence_of_stages(stages)
    n = len(seq)
    if n == 0:
        return x
    given = sum(v is not None for v in (budget, segments, plan))
    if given > 1:
        raise ValueError("checkpoint_sequential: give at most one of budget=, segments=, plan=")
    if segments is not None:
        if isinstance(segments, bool) or not isinstance(segments, int):
            raise TypeError(f"segments: expected an int, got {type(segments).__name__}")
        if not 1 <= segments <= n:
            raise ValueError(f"segments: must be in [1, {n}] for {n} stages, got {segments}")
        bounds = [round(j * n / segments) for j in range(segments + 1)]
        the_plan = Plan([(bounds[j], bounds[j + 1], j + 1 < segments) for j in range(segments)])
    elif plan is not None:
        if not isinstance(plan, Plan):
            raise TypeError(f"plan: expected a memfit.checkpoint.Plan, got {type(plan).__name__}")
        if plan.n_stages != n:
            raise ValueError(f"plan: made for {plan.n_stages} stages, got {n}")
        the_plan = plan
    elif budget is not None:
        the_plan = _cached_plan(seq, x, budget, cost, max_slots)
    else:
        the_plan = plan_sqrt(n)
    if not torch.is_grad_enabled():
        for st in seq:
            x = st(x)
        return x
    for s, e, c in the_plan.segments:
        if c:
            x = checkpoint(_run_range(seq, s, e), x, compress=compress,
                           preserve_rng_state=preserve_rng_state, use_reentrant=use_reentrant)
        else:
            for i in range(s, e):
                x = seq[i](x)
    return x


def _signature(x):
    torch = _torch()
    if isinstance(x, torch.Tensor):
        return (tuple(x.shape), x.dtype, x.device, x.requires_grad)
    return (type(x).__name__,)


def _cached_plan(seq, x, budget, cost, max_slots):
    torch = _torch()
    training = tuple(getattr(s, "training", None) for s in seq)
    key = (tuple(id(s) for s in seq), _signature(x), str(budget), cost, max_slots, training)
    hit = _seq_cache.get(key)
    if hit is not None:
        refs, p = hit
        if all(r() is s for r, s in zip(refs, seq)):
            _seq_cache.move_to_end(key)
            return p
    m = measure(torch.nn.ModuleList(seq) if all(isinstance(s, torch.nn.Module) for s in seq)
                else seq, x, cost=cost)
    p = plan(m.input_bytes, m.saved_bytes, m.forward_cost, budget, max_slots=max_slots,
             names=m.names)
    try:
        refs = [weakref.ref(s) for s in seq]
    except TypeError:
        return p
    _seq_cache[key] = (refs, p)
    while len(_seq_cache) > 16:
        _seq_cache.popitem(last=False)
    return p


# ------------------------------------------------------------------- auto --

class _Region:
    """A checkpointed segment [start, end) of blocks called one after another by
    their parent (nn.Sequential, a model's loop over an nn.ModuleList). The first
    block opens a frame, the next ones add their call to it, so the whole segment
    keeps only the first block's input and is replayed block by block."""

    def __init__(self, start, end, compress, preserve_rng_state):
        self.start = start
        self.end = end
        self.compress = compress
        self.preserve_rng_state = preserve_rng_state
        self.frame = None
        self.expect = None
        self.prev_out = None


class _BlockForward:
    """The forward auto() installs on a block of a checkpointed segment. An object
    rather than a closure so that copy.deepcopy(model) and pickling give the copy
    its own wrapper around its own block (a closure would keep calling the
    original block)."""

    __memfit_checkpoint__ = True

    def __init__(self, module, region, index):
        self.module = module
        self.region = region
        self.index = index

    def __call__(self, *args, **kwargs):
        torch = _torch()
        region, index = self.region, self.index
        orig = type(self.module).forward.__get__(self.module)
        if not torch.is_grad_enabled():
            return orig(*args, **kwargs)
        frame = region.frame
        if frame is None or index == region.start or region.expect != index:
            # a fresh pass (or blocks called out of order: start a new frame here)
            frame = _Frame(preserve_rng_state=region.preserve_rng_state, check=True,
                           recompute_ctx=_nullctx, compress=region.compress)
            region.frame = frame
            frame.add_call(orig, args, kwargs)
        else:
            frame.add_call(orig, args, kwargs, prev_out=region.prev_out, boundary=False)
        region.prev_out = None
        try:
            with frame.hooks():
                out = orig(*args, **kwargs)
        except BaseException:
            region.frame = None
            raise
        if index == region.end - 1:
            region.frame = None
            region.expect = None
        else:
            region.expect = index + 1
            region.prev_out = out
        return out


class AutoPlan(Plan):
    """The plan :func:`auto` installed; :meth:`remove` puts the blocks back."""

    def __init__(self, base: Plan, blocks, measurement):
        super().__init__(base.segments, base.memory_bytes, base.recompute_cost,
                         budget_bytes=base.budget_bytes, input_bytes=base.input_bytes,
                         saved_bytes=base.saved_bytes, forward_cost=base.forward_cost,
                         exact=base.exact, unit_bytes=base.unit_bytes, names=base.names)
        self.measurement = measurement
        self._blocks = [weakref.ref(b) for b in blocks]

    def remove(self) -> None:
        """Undo :func:`auto`: the blocks run without checkpointing again."""
        for r in self._blocks:
            b = r()
            if b is not None and getattr(b.__dict__.get("forward"), "__memfit_checkpoint__", False):
                del b.__dict__["forward"]


def auto(model_or_module_list, example_input, budget="6GB", *, blocks=None,
         compress: str | None = None, cost: str = "time", max_slots: int | None = None,
         preserve_rng_state: bool = True) -> AutoPlan:
    """Checkpoint a model's blocks so that their activations fit in ``budget``.

    Measures each block once (:func:`measure`), plans (:func:`plan`), and wraps the
    blocks of each checkpointed segment so that the next forward passes keep only
    the segment's input; returns the plan (print it) with ``.remove()`` to undo.

    Works on an ``nn.Sequential``, an ``nn.ModuleList`` of blocks, and on a whole
    model (e.g. a Hugging Face ``GPT2LMHeadModel``: its largest ``nn.ModuleList``,
    ``model.transformer.h``, is the chain; or pass ``blocks=``). Within a segment the
    output of one block is recognised as the next block's input by identity, so the
    parent's loop is not replayed; other arguments (masks, position embeddings) are
    kept by reference. Turn off caches that change state per call (Hugging Face:
    ``use_cache=False``) when training with it.

    ``budget``: bytes, ``"6GB"``, ``"512MiB"`` or ``"50%"`` of the measured
    no-checkpointing activation memory. ``compress="int8"`` stores the segment
    inputs blockwise-quantized (see :func:`checkpoint`).

    >>> import torch
    >>> net = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(32, 128),
    ...       torch.nn.GELU(), torch.nn.Linear(128, 32)) for _ in range(6)])
    >>> p = auto(net, torch.randn(8, 32), budget="40%")
    >>> p.memory_bytes <= p.budget_bytes
    True
    >>> p.remove()
    """
    torch = _torch()
    if compress not in (None, "int8"):
        raise ValueError(f"compress: expected None or 'int8', got {compress!r}")
    stages, _ = _resolve_chain(model_or_module_list, blocks)
    for i, st in enumerate(stages):
        if not isinstance(st, torch.nn.Module):
            raise TypeError(f"blocks[{i}]: expected an nn.Module, got {type(st).__name__}")
        if getattr(st.__dict__.get("forward"), "__memfit_checkpoint__", False):
            del st.__dict__["forward"]  # re-planning: drop the previous wrappers
    m = measure(model_or_module_list, example_input, blocks=blocks, cost=cost)
    base = plan(m.input_bytes, m.saved_bytes, m.forward_cost, budget, max_slots=max_slots,
                names=m.names)
    for s, e, c in base.segments:
        if not c:
            continue
        region = _Region(s, e, compress, preserve_rng_state)
        for i in range(s, e):
            st = stages[i]
            if "forward" in st.__dict__:
                raise ValueError(f"blocks[{i}]: its forward is already replaced by an "
                                 "instance attribute; memfit cannot wrap it")
            st.forward = _BlockForward(st, region, i)
    return AutoPlan(base, stages, m)
