"""checkpoint_sequential(): run a chain of stages checkpointed by a plan (measured and
planned once per input signature, then cached). Imports torch only when used.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict

from memfit.checkpoint.chain import measure
from memfit.checkpoint.meter import _torch
from memfit.checkpoint.planner import Plan, plan, plan_sqrt
from memfit.checkpoint.recompute import checkpoint


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


def checkpoint_sequential(stages=None, x=None, budget=None, segments: int | None = None, *,
                          compress: str | None = None, cost: str = "time",
                          plan: Plan | None = None, preserve_rng_state: bool = True,
                          max_slots: int | None = None, use_reentrant: bool | None = None,
                          functions=None, input=None):
    """Run ``stages`` in turn on ``x``, checkpointed by a plan; returns the output.

    torch's calling convention also works: ``checkpoint_sequential(functions,
    segments, input)``, positionally or with those keyword names.

    * ``budget`` (bytes, ``"6GB"``, ``"50%"``): the stages are measured once with
      :func:`measure` (cached for the same stages and input shape) and
      :func:`memfit.checkpoint.plan` chooses the segments;
    * ``segments=k``: ``k`` segments, all checkpointed but the last, split as
      ``torch.utils.checkpoint.checkpoint_sequential`` does;
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
    if functions is not None:
        if stages is not None:
            raise TypeError("checkpoint_sequential: give stages or functions=, not both")
        stages = functions
    if input is not None:
        if x is not None:
            raise TypeError("checkpoint_sequential: give x or input=, not both")
        x = input
    if (isinstance(x, int) and not isinstance(x, bool) and isinstance(budget, torch.Tensor)
            and segments is None):
        segments, x, budget = x, budget, None  # torch order: (functions, segments, input)
    if stages is None:
        raise TypeError("checkpoint_sequential: missing the stages")
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
        # torch's split: segments - 1 checkpointed runs of n // segments stages, the
        # rest (the last segment, whose backward comes first) stored
        size = n // segments
        segs = [(j * size, (j + 1) * size, True) for j in range(segments - 1)]
        the_plan = Plan(segs + [((segments - 1) * size, n, False)])
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
