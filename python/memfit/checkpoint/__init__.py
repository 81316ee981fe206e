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

One capability per file: ``budget.py`` (parse_bytes), ``planner.py`` (Plan, plan,
min_budget, plan_sqrt; imports no torch), ``meter.py`` (ActivationMeter),
``recompute.py`` (checkpoint, CheckpointError), ``chain.py`` (measure,
ChainMeasurement), ``sequential.py`` (checkpoint_sequential), ``autoplan.py`` (auto,
AutoPlan).
"""

from memfit.checkpoint.autoplan import AutoPlan, auto
from memfit.checkpoint.budget import parse_bytes
from memfit.checkpoint.chain import ChainMeasurement, measure
from memfit.checkpoint.meter import ActivationMeter
from memfit.checkpoint.planner import Plan, min_budget, plan, plan_sqrt
from memfit.checkpoint.recompute import CheckpointError, _Frame, checkpoint
from memfit.checkpoint.sequential import checkpoint_sequential

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
