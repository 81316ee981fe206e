"""The checkpoint planner: Plan, plan, min_budget and plan_sqrt over a chain's per-stage
sizes and costs (the C core does the search). Imports no torch, so a plan can be made
on a machine without it.
"""

from __future__ import annotations

import numbers
from typing import Sequence

from memfit import _C
from memfit.checkpoint.budget import _fmt_bytes, parse_bytes

_INT64_MAX = 2**63 - 1


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
        n = len(input_bytes)
        for i, (s, e, _) in enumerate(segs):
            if not (0 <= s <= n and 0 <= e <= n):  # (the core checks the order)
                raise _C.MemfitValueError(f"segments[{i}]: ({s}, {e}) lies outside the chain's "
                                          f"{n} stages")
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
    slots = _max_slots(max_slots)
    # A budget beyond any int64 (2**63, "1e30GB") is no limit at all: no chain's memory
    # reaches it (the C core adds sizes in int64), so the core gets the largest one it
    # can take; the Plan keeps the budget as given.
    segs, mem, cost, unit, exact = _C.plan_budget(ib, sb, fc, min(budget, _INT64_MAX), slots)
    return Plan(segs, mem, cost, budget_bytes=budget, input_bytes=ib, saved_bytes=sb,
                forward_cost=fc, exact=exact, unit_bytes=unit, names=names)


def _max_slots(max_slots) -> int:
    """``max_slots`` as the C core takes it: 0 (auto) for None, else an int >= 0. More
    slots than bytes in the budget add nothing (a slot is at least one byte), so a
    value past int64 is clamped rather than refused; the core refuses a table too large
    for the host with a MemoryError that says to lower it."""
    if max_slots is None:
        return 0
    if isinstance(max_slots, bool) or not isinstance(max_slots, numbers.Integral):
        raise TypeError(f"max_slots: expected an int >= 0 or None, got {max_slots!r}")
    if max_slots < 0:
        raise ValueError(f"max_slots: must be >= 0 (0 or None: chosen from the chain), got {max_slots}")
    return min(int(max_slots), _INT64_MAX)


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
