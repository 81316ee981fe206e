"""auto(): measure a model's blocks once, plan for a budget, and wrap the blocks of the
checkpointed segments in place (AutoPlan, which .remove() undoes). Imports torch only
when used.
"""

from __future__ import annotations

import weakref

from memfit.checkpoint.budget import parse_bytes
from memfit.checkpoint.chain import _resolve_chain, measure
from memfit.checkpoint.meter import _torch
from memfit.checkpoint.planner import Plan, plan
from memfit.checkpoint.recompute import (_compiled_checkpoint, _compiling, _Frame, _nullctx,
                                         _outside_graph, _seal)


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
        if _compiling():
            # Under torch.compile each block of the segment is its own torch
            # checkpoint (a segment spans calls the parent makes, which one traced
            # call cannot group): the compiled graph keeps every block's input of the
            # segment, not only the first one's, and recomputes the rest. int8
            # boundaries need the eager frame: this call then runs outside the graph.
            if region.compress is not None:
                return _outside_graph(self, *args, **kwargs)
            return _compiled_checkpoint(orig, args, kwargs,
                                        preserve_rng_state=region.preserve_rng_state)
        frame = region.frame
        if frame is None or index == region.start or region.expect != index:
            # a fresh pass (or blocks called out of order: start a new frame here)
            frame = _Frame(preserve_rng_state=region.preserve_rng_state, check=True,
                           recompute_ctx=_nullctx, compress=region.compress)
            region.frame = frame
            call = frame.add_call(orig, args, kwargs)
        else:
            call = frame.add_call(orig, args, kwargs, prev_out=region.prev_out, boundary=False)
        region.prev_out = None
        try:
            with frame.hooks():
                out = orig(*args, **kwargs)
        except BaseException:
            region.frame = None
            raise
        _seal(call)
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
    parse_bytes(budget, total=0, name="budget")  # named as the caller knows it, before anything runs
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
