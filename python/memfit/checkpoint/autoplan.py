"""auto(): measure a model's blocks once, plan for a budget, and wrap the blocks of the
checkpointed segments in place (AutoPlan, which .remove() undoes). Imports torch only
when used.
"""

from __future__ import annotations

import weakref

from memfit.checkpoint.budget import parse_bytes
from memfit.checkpoint.chain import _places, _resolve_chain, measure
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


class _Cursor:
    """The place in the chain that ran last (-1: a pass has not started), shared by the
    wrappers of one plan whose chain uses a module at several places: a call of such a
    module is at its first place after this one (or, past its last place, at its
    first: a new pass). Also the forward pre-hook that auto() puts on the model whose
    chain it is, so that each call of the model starts a pass even when the one
    before raised half-way."""

    def __init__(self):
        self.last = -1
        self.parent = None  # the module it is a pre-hook of (a copy's cursor: the copy's)

    def __call__(self, module, args):
        self.last = -1

    def attach(self, parent):
        parent.register_forward_pre_hook(self)
        self.parent = parent

    def detach(self):
        """Takes the pre-hook off, found by identity (a RemovableHandle would, in a
        deep copy of the model, still point at the original's hooks)."""
        if self.parent is not None:
            hooks = self.parent._forward_pre_hooks
            for k in [k for k, v in hooks.items() if v is self]:
                del hooks[k]
            self.parent = None


class _BlockForward:
    """The forward auto() installs on a block. An object rather than a closure so
    that copy.deepcopy(model) and pickling give the copy its own wrapper around its
    own block (a closure would keep calling the original block).

    ``places``: [(index in the chain, _Region or None)], one per place the block has
    in the chain (more than one when the chain reuses it; None: that place is
    stored, the call runs plainly). ``inner``: the instance ``forward`` it replaced
    (hook libraries set one), called in place of the class's forward; ``own`` says
    whether there was one, so that removing the wrapper restores the module exactly.
    ``owner``: the token of the AutoPlan that installed it."""

    __memfit_checkpoint__ = True

    def __init__(self, module, places, cursor, owner):
        self.module = module
        self.places = places
        self.cursor = cursor
        self.owner = owner
        self.own = "forward" in module.__dict__
        self.inner = module.__dict__.get("forward")

    def _forward(self):
        if self.own:
            return self.inner
        return type(self.module).forward.__get__(self.module)

    def _place(self):
        if len(self.places) == 1:
            return self.places[0]
        last = self.cursor.last
        place = next((p for p in self.places if p[0] > last), self.places[0])
        self.cursor.last = place[0]
        return place

    def __call__(self, *args, **kwargs):
        torch = _torch()
        index, region = self._place()
        if region is None or not torch.is_grad_enabled():
            return self._plain(args, kwargs)
        if _compiling():
            # Under torch.compile each block of the segment is its own torch
            # checkpoint (a segment spans calls the parent makes, which one traced
            # call cannot group): the compiled graph keeps every block's input of the
            # segment, not only the first one's, and recomputes the rest. int8
            # boundaries need the eager frame: this call then runs outside the graph.
            # (The eager call looks the forward up itself: a bound method traced
            # here would be rebuilt after the graph break as `module.forward`, which
            # is this wrapper.)
            if region.compress is not None:
                return _outside_graph(_EagerCall(self, index, region), *args, **kwargs)
            return _compiled_checkpoint(self._forward(), args, kwargs,
                                        preserve_rng_state=region.preserve_rng_state)
        return self._eager(index, region, args, kwargs)

    def _plain(self, args, kwargs):
        try:
            return self._forward()(*args, **kwargs)
        except BaseException:
            if self.cursor is not None:
                self.cursor.last = -1  # the pass ended here: the next call starts one
            raise

    def _eager(self, index, region, args, kwargs):
        orig = self._forward()
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
            if self.cursor is not None:
                self.cursor.last = -1
            raise
        _seal(call)
        if index == region.end - 1:
            region.frame = None
            region.expect = None
        else:
            region.expect = index + 1
            region.prev_out = out
        return out


class _EagerCall:
    """One block call run by the eager frame from inside a torch.compile trace
    (compress="int8"), with the place already chosen."""

    def __init__(self, wrapper, index, region):
        self.args = (wrapper, index, region)

    def __call__(self, *args, **kwargs):
        wrapper, index, region = self.args
        return wrapper._eager(index, region, args, kwargs)


def _unwrap(module):
    """Put back what a _BlockForward replaced on ``module``."""
    w = module.__dict__["forward"]
    if w.own:
        module.__dict__["forward"] = w.inner
    else:
        del module.__dict__["forward"]


def _wrapper_on(module):
    w = module.__dict__.get("forward")
    return w if isinstance(w, _BlockForward) else None


def _no_cursor():
    return None


# id(block) -> (weakref to the block, token of the AutoPlan that planned it last).
# Weak, so that a plan never keeps a model alive; by id, so that a module with its own
# __eq__/__hash__ cannot make it fail; nothing is added to the user's modules.
_LATEST: dict = {}


def _latest_token(block):
    entry = _LATEST.get(id(block))
    return entry[1] if entry is not None and entry[0]() is block else None


class AutoPlan(Plan):
    """The plan :func:`auto` installed; :meth:`remove` puts the blocks back.
    :attr:`installed` says whether the model still runs it (False after
    :meth:`remove`, or once a later :func:`auto` on the same blocks replaced it)."""

    def __init__(self, base: Plan, measurement, stages):
        super().__init__(base.segments, base.memory_bytes, base.recompute_cost,
                         budget_bytes=base.budget_bytes, input_bytes=base.input_bytes,
                         saved_bytes=base.saved_bytes, forward_cost=base.forward_cost,
                         exact=base.exact, unit_bytes=base.unit_bytes, names=base.names)
        self.measurement = measurement
        self._token = object()  # marks this plan's wrappers (a later plan has its own)
        self._stages = [weakref.ref(st) for st, _ in _places(stages)]  # once each
        self._cursor = _no_cursor  # weakref to the plan's _Cursor (it refers to the model)
        self._removed = False

    def _install(self, wrappers):
        """Puts the wrappers on; nothing here can raise half-way."""
        for st, w in wrappers:
            st.__dict__["forward"] = w
        for k in [k for k, (ref, _) in _LATEST.items() if ref() is None]:
            del _LATEST[k]
        for r in self._stages:
            _LATEST[id(r())] = (r, self._token)

    def _mine(self):
        for r in self._stages:
            b = r()
            w = None if b is None else _wrapper_on(b)
            if w is not None and w.owner is self._token:
                yield b

    @property
    def installed(self) -> bool:
        """True while the model's blocks run this plan."""
        if self._removed:
            return False
        alive = [b for b in (r() for r in self._stages) if b is not None]
        return all(_latest_token(b) is self._token for b in alive)

    def remove(self) -> None:
        """Undo :func:`auto`: the blocks run without checkpointing again, each with
        the forward it had before (an instance ``forward`` set by a hook library
        included). Does nothing once removed, or when a later plan replaced it."""
        for b in list(self._mine()):
            _unwrap(b)
        cursor = self._cursor()
        if cursor is not None:
            cursor.detach()
        self._removed = True


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
    no-checkpointing activation memory (a budget beyond any int64 means no limit).

    ``auto`` installs a complete plan or leaves the model exactly as it was: when
    it raises (a budget too small, a block that fails), no block stays wrapped and a
    plan installed before stays installed. A new plan replaces the previous one on
    the same blocks (whose :attr:`AutoPlan.installed` then turns False). A block
    used at several places of the chain is planned per place; a block's instance
    ``forward`` (set by hook libraries) is kept and restored by ``remove()``.

    ``compress="int8"`` stores the segment inputs blockwise-quantized (see
    :func:`checkpoint`).

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
    # Re-planning: measure the blocks as they are without the previous plan, and put
    # that plan back if anything below raises (the model is then exactly as it was).
    previous = [(st, w) for st, w in ((st, _wrapper_on(st)) for st, _ in _places(stages))
                if w is not None]
    for st, _ in previous:
        _unwrap(st)
    try:
        m = measure(model_or_module_list, example_input, blocks=blocks, cost=cost)
        base = plan(m.input_bytes, m.saved_bytes, m.forward_cost, budget,
                    max_slots=max_slots, names=m.names)
        result = AutoPlan(base, m, stages)
        cursor, wrappers = _wrappers(stages, base, result._token, compress,
                                     preserve_rng_state)
        parent = getattr(model_or_module_list, "_orig_mod", model_or_module_list)
        if cursor is not None and isinstance(parent, torch.nn.Module) and \
                not isinstance(parent, torch.nn.ModuleList):
            cursor.attach(parent)
    except BaseException:
        for st, w in previous:
            st.__dict__["forward"] = w
        raise
    for _, w in previous:
        if w.cursor is not None:
            w.cursor.detach()  # the replaced plan's
    result._cursor = _no_cursor if cursor is None else weakref.ref(cursor)
    result._install(wrappers)
    return result


def _wrappers(stages, base, owner, compress, preserve_rng_state):
    """(the plan's _Cursor or None, [(block, its _BlockForward)]), built without
    touching the blocks. A block used at several places of the chain gets one
    wrapper that knows all of them (a stored place runs plainly); their calls are
    told apart by a cursor when such a block is checkpointed at any place."""
    role = [None] * len(stages)
    for s, e, c in base.segments:
        if c:
            region = _Region(s, e, compress, preserve_rng_state)
            for i in range(s, e):
                role[i] = region
    places = _places(stages)
    shared = any(len(idx) > 1 and any(role[i] is not None for i in idx) for _, idx in places)
    cursor = _Cursor() if shared else None
    return cursor, [(st, _BlockForward(st, [(i, role[i]) for i in idx], cursor, owner))
                    for st, idx in places if any(role[i] is not None for i in idx)]
