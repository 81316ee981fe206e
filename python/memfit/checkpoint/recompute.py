"""The recompute frame: checkpoint(), a non-reentrant checkpoint on saved-tensor hooks
(a drop-in for torch.utils.checkpoint.checkpoint, plus compress="int8"), and the
_Frame that auto() also uses for a segment of blocks. Imports torch only when used.
"""

from __future__ import annotations

import threading
import warnings
import weakref
from typing import Callable

from memfit._C import Error as _MemfitError
from memfit.checkpoint.meter import _active_meters, _torch


class CheckpointError(_MemfitError, RuntimeError):
    """A checkpointed function did something recomputation cannot reproduce (its
    recompute saved tensors of other shapes or dtypes, or a different number)."""


class _StopRecompute(BaseException):
    # BaseException so that a broad `except Exception` in user code cannot swallow it.
    pass


class _Slot:
    """What the forward saves in place of a tensor: a key the recompute fills,
    per backward pass (graph task)."""

    __slots__ = ("values", "__weakref__")

    def __init__(self):
        self.values = {}


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
    __slots__ = ("fn", "args", "kwargs", "rng_cpu", "rng_cuda", "autocast", "versions")


def _kept_tensors(call):
    """(name, tensor) of each tensor a call keeps as it was given (not quantized, not a
    link to the previous call's output): what the recompute will read again."""
    named = [(f"argument {i}", e) for i, e in enumerate(call.args)]
    named += [(f"keyword argument {k!r}", e) for k, e in call.kwargs.items()]
    return [(name, e[1]) for name, e in named if e[0] == _TENSOR]


def _seal(call):
    """Records the version counters of the tensors the recompute will read, once the
    call's forward (or a recompute, which may modify them itself) has run."""
    call.versions = [t._version for _, t in _kept_tensors(call)]


def _check_versions(call):
    """Autograd's check for saved tensors (which saved-tensor hooks switch off), on
    what the recompute starts from: an input modified in place after the forward
    would be recomputed from its new value, giving wrong gradients silently."""
    for (name, t), expected in zip(_kept_tensors(call), call.versions or ()):
        if t._version != expected:
            raise CheckpointError(
                "one of the variables needed for gradient computation has been modified "
                f"by an inplace operation: [{t.type()} {list(t.shape)}], {name} of the "
                f"checkpointed function, is at version {t._version}; expected version "
                f"{expected} instead. memfit.checkpoint recomputes from its inputs in "
                "the backward pass: do not modify them in place between the forward and "
                "the backward (pass a .clone() instead).")


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
        c.versions = None  # set by _seal once the forward has run
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

        _check_versions(call)
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
                        try:
                            with _autocast_ctx(call.autocast):
                                prev = call.fn(*args, **kwargs)
                        finally:
                            _seal(call)  # a function that modifies its inputs did so again
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


def _compiling() -> bool:
    """True while torch.compile (dynamo) traces the caller. The recompute frame
    (saved-tensor hooks, a lock, per-backward slots) is eager machinery dynamo cannot
    trace; under compile a checkpoint is torch's non-reentrant one instead, which
    dynamo captures as a higher-order op so the compiled graph recomputes the region
    in its backward."""
    torch = _torch()
    return torch.compiler.is_compiling()


def _compiled_checkpoint(function, args, kwargs, *, preserve_rng_state,
                         determinism_check="default", context_fn=None):
    """checkpoint() under torch.compile: the same region checkpointed by
    torch.utils.checkpoint (non-reentrant), whose graph dynamo traces (fullgraph=True
    works)."""
    torch = _torch()
    extra = {} if context_fn is None else {"context_fn": context_fn}
    return torch.utils.checkpoint.checkpoint(
        function, *args, use_reentrant=False, preserve_rng_state=preserve_rng_state,
        determinism_check=determinism_check, **extra, **kwargs)


def _outside_graph(fn, *args, **kwargs):
    """Call ``fn`` eagerly from inside a torch.compile trace, for compress="int8": the
    quantized inputs are kept by memfit's eager frame, which has no compiled form. A
    graph break (fullgraph=True reports this message); the rest of the model still
    compiles."""
    torch = _torch()
    torch._dynamo.graph_break(
        "memfit.checkpoint: compress='int8' keeps the checkpoint's inputs quantized by "
        "eager code, which runs outside the compiled graph; use compress=None to compile "
        "it whole (fullgraph=True)")
    return torch.compiler.disable(fn)(*args, **kwargs)


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
    * a tensor argument modified in place after the forward raises
      :class:`CheckpointError` (a RuntimeError) at the backward, with autograd's
      "modified by an inplace operation ... is at version N; expected version M"
      message, instead of recomputing from the new value;
    * gradients are bitwise those of the plain function for deterministic ops;
    * inside a ``torch.compile``-d module it is torch's non-reentrant checkpoint
      (which dynamo traces, ``fullgraph=True`` included, and which checks in-place
      modification itself); with ``compress="int8"`` it runs eagerly outside the
      compiled graph (a graph break).

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
    if _compiling():
        if compress is not None:
            return _outside_graph(checkpoint, function, *args, compress=compress,
                                  preserve_rng_state=preserve_rng_state,
                                  determinism_check=determinism_check,
                                  context_fn=context_fn, **kwargs)
        return _compiled_checkpoint(function, args, kwargs,
                                    preserve_rng_state=preserve_rng_state,
                                    determinism_check=determinism_check,
                                    context_fn=context_fn)
    if context_fn is not None:
        fwd_ctx = context_fn()[0]
        recompute_ctx = lambda: context_fn()[1]  # noqa: E731  a fresh one per recompute
    else:
        fwd_ctx, recompute_ctx = _nullctx(), _nullctx
    frame = _Frame(preserve_rng_state=preserve_rng_state, check=determinism_check != "none",
                   recompute_ctx=recompute_ctx, compress=compress)
    call = frame.add_call(function, args, kwargs)
    with frame.hooks(), fwd_ctx:
        out = function(*args, **kwargs)
    _seal(call)
    return out
