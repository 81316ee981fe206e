"""torch.optim.Optimizer subclasses on memfit's fused kernels."""

from __future__ import annotations

import math
from collections import defaultdict

import torch

from memfit._C import MemfitTypeError, MemfitValueError
from memfit.optim import _blocks, _core, _dtensor, convert
from memfit.optim._blocks import state_rows

# 2: quantization blocks within rows (dim-0 slices), absmax of shape (rows, blocks per
# row), 4-bit codes of shape (rows, ceil(row length / 2)), and float32 states for 1-D
# parameters; 1: blocks over the whole storage.
_FORMAT_VERSION = 2
# The key under which state_dict() records _FORMAT_VERSION in every param group as well
# as at the top level: torch.distributed.checkpoint's get_state_dict/set_state_dict keep
# only "state" and "param_groups".
_GROUP_FORMAT_KEY = "memfit_format"


# A parameter's state tensors in the order the step passes them to the core (absent: None).
_STATE_KEYS = ("state1", "absmax1", "state2", "absmax2", "step", "kahan_comp")


def _same_layout(a, b) -> bool:
    """Same shape and the same strides along every dimension of more than one element:
    the kernels pair the elements of a parameter, its gradient and its per-element
    states in memory order (the binding's mf_py_same_layout)."""
    return a.shape == b.shape and all(s == t for s, t, n in zip(a.stride(), b.stride(), a.shape)
                                      if n != 1)


def _dim_order(t) -> tuple:
    """t's dimensions of more than one element, outermost in memory first."""
    return tuple(sorted((d for d in range(t.dim()) if t.shape[d] != 1), key=lambda d: -t.stride(d)))


def _check_dense(where, p) -> None:
    """Refuses a parameter that is neither contiguous nor dense in another order
    (channels_last): the kernels run over its storage."""
    local = p.to_local() if _dtensor.is_dtensor(p) else p
    if not _blocks.is_dense(local):
        raise MemfitValueError(f"{where}: must be contiguous (this tensor has gaps or overlapping "
                               "elements: a slice, an expand() or a view of part of a tensor, "
                               f"strides {tuple(local.stride())}); call .contiguous() first; "
                               "nothing was updated")


def _refuse_grad(where, p, g):
    """Raises for a gradient the step cannot take for p (step has found one of: another
    shape, dtype, device, or another memory layout than a non-contiguous p's)."""
    where = f"{where} (shape {tuple(p.shape)})"
    if g.shape != p.shape:
        raise MemfitValueError(
            f"{where}: its gradient has shape {tuple(g.shape)}; a gradient must have its "
            "parameter's shape (one of the same size in another layout, such as JAX's (in, out) "
            "for torch's (out, in) weight, would update the wrong elements); nothing was updated")
    if g.dtype != p.dtype:
        raise MemfitTypeError(f"{where}: its gradient is {g.dtype} and the parameter {p.dtype}; "
                              "cast the gradient to the parameter's dtype; nothing was updated")
    if g.device != p.device:
        raise MemfitValueError(f"{where}: its gradient is on {g.device} but the parameter on "
                               f"{p.device}; nothing was updated")
    _check_dense(where, p)
    raise MemfitValueError(
        f"{where}: must be contiguous (row-major), or dense with a gradient of the same "
        f"strides, but has strides {tuple(p.stride())} and its gradient {tuple(g.stride())}; "
        "make the gradient match the parameter's memory format (e.g. p.grad = p.grad."
        "contiguous(memory_format=torch.channels_last)) or call .contiguous() on the "
        "parameter; nothing was updated")


def _state_problem(key, value, shape, dtype, p):
    """None, or (exception class, message) for a state ``key`` of p that the kernels
    cannot take as p's: not a tensor, another dtype or (global) shape, not laid out as
    p's states are (a DTensor of p's mesh and placements for a DTensor p, except step),
    another device, or other strides (p's for a state of one value per element, else
    contiguous). Metadata only: no host sync."""
    if not torch.is_tensor(value):
        return MemfitTypeError, f"state {key!r} is a {type(value).__name__}, not a tensor"
    if value.dtype != dtype:
        return MemfitTypeError, f"state {key!r} is {value.dtype}, but needs {dtype} {shape}"
    if tuple(value.shape) != shape:
        return (MemfitValueError,
                f"state {key!r} has shape {tuple(value.shape)}, but needs {dtype} {shape}")
    dp, dv = _dtensor.is_dtensor(p), _dtensor.is_dtensor(value)
    if dv != (dp and key != "step") or (dv and (value.device_mesh != p.device_mesh
                                                or value.placements != p.placements)):
        return MemfitValueError, (f"state {key!r} is {_dtensor.describe(value)}, but the "
                                  f"parameter's states are {_dtensor.describe(p, key)}")
    local = value.to_local() if dv else value
    lp = p.to_local() if dp else p
    if local.device != lp.device:
        return MemfitValueError, f"state {key!r} is on {local.device}, the parameter on {lp.device}"
    if key != "step" and shape == tuple(p.shape):
        if not _same_layout(local, lp):
            return MemfitValueError, (f"state {key!r} has strides {tuple(local.stride())}, but "
                                      "holds one value per element and must be laid out as the "
                                      f"parameter (strides {tuple(lp.stride())})")
    elif not local.is_contiguous():
        return MemfitValueError, (f"state {key!r} has strides {tuple(local.stride())}, but must "
                                  "be contiguous")
    return None


_SAVED_FOR_ANOTHER = ("the state dict was saved for a different model or with different "
                      "bits/block_size/min_8bit_size")


def _check_saved_keys(where, saved, expected) -> None:
    """Refuses a saved state of p (``saved``) whose keys are not those p needs
    (``expected``, from _expected_state), or whose tensors have another dtype or shape."""
    for key in saved:
        if key not in expected:
            raise MemfitValueError(f"{where}: has a state {key!r} that this optimizer does not "
                                   f"keep for it: {_SAVED_FOR_ANOTHER}; nothing was loaded")
    for key in expected:
        # a missing Kahan buffer starts at zero: the parameter's value as it is
        if key not in saved and key != "kahan_comp":
            raise MemfitValueError(
                f"{where}: has no state {key!r} (it has {', '.join(map(repr, saved))}; this "
                f"optimizer keeps {', '.join(map(repr, expected))} for it): the state dict is "
                "incomplete; nothing was loaded")
    for key, value in saved.items():
        shape, dtype = expected[key]
        if not torch.is_tensor(value) or value.dtype != dtype or tuple(value.shape) != shape:
            got = (f"{value.dtype} {tuple(value.shape)}" if torch.is_tensor(value)
                   else type(value).__name__)
            raise MemfitValueError(
                f"{where}: state {key!r} is {got}, but needs {dtype} {shape}: "
                f"{_SAVED_FOR_ANOTHER}, or is truncated; nothing was loaded")


def _laid_out(where, key, value, p):
    """``value`` (a loaded copy of p's state ``key``) in the memory layout the kernels
    need: p's for a state of one value per element, else contiguous. Relaying out is
    exact where each value keeps its meaning: float32 states, Kahan buffers, absmax and
    4-bit codes (logical arrays), 8-bit codes stored in p's memory order (only their
    strides differ, as in a slice). 8-bit codes stored in another order are refused: a
    code's quantization block is given by its place in memory, so relaid codes would
    be read with other blocks' absmax."""
    dv = _dtensor.is_dtensor(value)
    local = value.to_local() if dv else value
    lp = p.to_local() if _dtensor.is_dtensor(p) else p
    if key != "step" and tuple(value.shape) == tuple(p.shape):
        if _same_layout(local, lp):
            return value
        if local.dtype == torch.uint8 and _dim_order(local) != _dim_order(lp):
            raise MemfitValueError(
                f"{where}: state {key!r} (8-bit codes) has strides {tuple(local.stride())}, in "
                f"another memory order than the parameter's {tuple(lp.stride())}: its codes "
                "belong to the quantization blocks of other elements; nothing was loaded")
        fixed, stride = torch.empty_like(lp, dtype=local.dtype).copy_(local), p.stride()
    else:
        if local.is_contiguous():
            return value
        fixed, stride = local.contiguous(), None
    return _dtensor.with_local(value, fixed, stride) if dv else fixed


class _MemfitOptimizer(torch.optim.Optimizer):
    """Base class: state layout, the step over param groups, state_dict checks.

    Subclasses set ``_kind`` and ``_bits`` and implement ``_hparams(group)``.

    Per-parameter state (``optimizer.state[p]``):
        ``step``: float32 tensor of shape () on p's device (steps taken; torch's format).
        ``state1``/``state2``: the states, uint8 codes (shape of p for 8 bits,
        ``(rows, ceil(L/2))`` for 4 bits) with ``absmax1``/``absmax2`` (float32,
        ``(rows, ceil(L/block_size))``: one per block), where rows = ``p.shape[0]`` and L
        the elements per row (see :func:`state_rows`; quantization blocks never cross a
        row, so sharding p along dim 0 shards every state with it), or float32 tensors
        of p's shape for 1-D tensors, tensors smaller than ``min_8bit_size`` and 32-bit
        optimizers. Use :func:`memfit.optim.dequantized_state` to read them as floats.
        ``kahan_comp``: with ``kahan=True`` and a float16/bfloat16 ``p``, the Kahan
        compensation (p's dtype and shape; the parameter's value is ``p + kahan_comp``).
    """

    _kind: int = _core.ADAMW
    _bits: int = 8

    # torch.amp.GradScaler (and memfit's) hand the kernels grad_scale and found_inf
    # instead of unscaling and syncing on found_inf: they unscale and skip on the
    # device, and after an explicit unscale_ (grad_scale None) they still skip on
    # found_inf, so unscale_, clipping, step is exact. True for every caller: Lightning
    # reads it as "cannot clip", and memfit.amp.lightning.MixedPrecision is the
    # plugin that unscales and clips such optimizers (docs/frameworks.md).
    _step_supports_amp_scaling = True

    def __init__(self, params, hyper, *, maximize=False, block_size=None, min_8bit_size=4096,
                 bf16_stochastic_round=None, kahan=False):
        """``hyper``: the subclass's own hyperparameters (lr, betas, ...); the keyword
        options are the ones every memfit optimizer takes (see memfit.optim.optimizers)."""
        defaults = dict(hyper, maximize=maximize, min_8bit_size=min_8bit_size,
                        bf16_stochastic_round=bf16_stochastic_round, kahan=kahan)
        defaults.setdefault("bits", self._bits)
        defaults["block_size"] = (_core.DEFAULT_BLOCK[defaults["bits"]] if block_size is None
                                  else block_size)
        # bfloat16/float16 parameters are written with stochastic rounding (no fp32 master
        # copy needed); the seed and a per-group step counter live in the param group,
        # so a resumed run draws the same random bits. None: stochastic unless kahan.
        defaults.setdefault("sr_seed", 0)
        super().__init__(params, defaults)  # checks each group (add_param_group)

    # -- hyperparameters -------------------------------------------------------------

    def _hparams(self, group) -> dict:  # pragma: no cover - abstract
        raise NotImplementedError

    def _check_group(self, group) -> None:
        bits = group["bits"]
        if bits not in (4, 8, 32):
            raise ValueError(f"bits: expected 4, 8 or 32, got {bits!r}")
        bs = group["block_size"]
        if bits != 32 and bs not in _core.BLOCK_SIZES:
            raise ValueError(f"block_size: must be one of {', '.join(map(str, _core.BLOCK_SIZES))}, "
                             f"got {bs!r}")
        if not isinstance(group["min_8bit_size"], int) or group["min_8bit_size"] < 0:
            raise ValueError(f"min_8bit_size: expected an int >= 0, got {group['min_8bit_size']!r}")
        kahan, sr = group.get("kahan", False), group.get("bf16_stochastic_round")
        if not isinstance(kahan, bool):
            raise TypeError(f"kahan: expected True or False, got {kahan!r}")
        if kahan and sr:
            raise ValueError(
                "kahan=True and bf16_stochastic_round=True cannot be combined: the Kahan "
                "buffer keeps the rounding error that stochastic rounding would randomise; "
                "pass only kahan=True (stochastic rounding is then off)")
        _core.check(self._kind, self._hparams(group))

    def add_param_group(self, param_group):
        super().add_param_group(param_group)
        try:
            self._check_group(self.param_groups[-1])
        except Exception:
            self.param_groups.pop()
            raise

    # -- state layout ------------------------------------------------------------------

    @staticmethod
    def _rounding(group) -> str:
        """How this group writes float16/bfloat16 parameters: 'kahan', 'stochastic' or
        'nearest' (see :mod:`memfit.optim.optimizers`)."""
        if group.get("kahan", False):
            return "kahan"
        sr = group.get("bf16_stochastic_round")
        return "stochastic" if sr is None or sr else "nearest"

    @staticmethod
    def _format(group, p) -> int:
        """32, or the group's bits for parameters of two or more dimensions and at least
        min_8bit_size elements. Sizes are global (a DTensor's numel() is the whole
        tensor's), so sharding never changes a state's precision; 1-D tensors keep
        float32 states, as their dim-0 slices are single elements."""
        bits = group["bits"]
        return bits if bits != 32 and p.dim() >= 2 and p.numel() >= group["min_8bit_size"] else 32

    def _expected_state(self, group, p) -> dict:
        """{key: (shape, dtype)} of the state this parameter needs in this group, from
        the C core's layout (mf_optim_state_layout) with p's rows. A state of one value
        per element has p's shape (and, once made, p's memory layout); 4-bit codes and
        absmax are (rows, per row). Shapes are global for a DTensor p: dim 0 of every
        quantized state is p.shape[0]."""
        fmt = self._format(group, p)
        rows = state_rows(p) if fmt != 32 else 1
        layout = _core.state_layout(self._kind, fmt, group["block_size"], p.numel(),
                                    self._hparams(group)["momentum"], rows)
        out = {"step": ((), torch.float32)}
        shape = (rows, layout["state_row_numel"]) if fmt == 4 else tuple(p.shape)
        for k in range(1, layout["num_states"] + 1):
            out[f"state{k}"] = (shape, getattr(torch, layout["state_dtype"]))
            if layout["absmax_numel"]:
                out[f"absmax{k}"] = ((rows, layout["blocks_per_row"]), torch.float32)
        if self._rounding(group) == "kahan" and p.dtype in (torch.bfloat16, torch.float16):
            out["kahan_comp"] = (tuple(p.shape), p.dtype)
        return out

    def _zero_state(self, p, key, shape, dtype):
        """A zero state of global ``shape`` for ``p`` (step: a plain scalar on p's local
        device). States of p's shape follow p's memory layout (zeros_like keeps the
        strides of a dense tensor, channels_last included): the kernels run over the
        storage in memory order, the same for p, its grad and these."""
        if _dtensor.is_dtensor(p) and key != "step":
            # a DTensor of p's mesh and placements, of the global shape
            return _dtensor.zeros_state(p, shape, dtype, self._where)
        local = p.to_local() if _dtensor.is_dtensor(p) else p
        if shape == tuple(p.shape) and key != "step":
            return torch.zeros_like(local, dtype=dtype)
        return torch.zeros(shape, dtype=dtype, device=local.device)

    def _new_states(self, where, group, p, state) -> tuple:
        """(states to add, whether to drop kahan_comp) for p before its first step or
        after its layout changed (bits, dtype, shape, device): the missing states as
        zeros; the states p already has are checked against the layout ``group`` needs
        (:func:`_state_problem`). Changes nothing: step adds them once every parameter
        of every group is checked."""
        state = state or {}
        expected = self._expected_state(group, p)
        if _dtensor.is_dtensor(p):
            _dtensor.check_param(p, self._where)
        added = {}
        for key, (shape, dtype) in expected.items():
            value = state.get(key)
            if value is None:
                added[key] = self._zero_state(p, key, shape, dtype)
                continue
            problem = _state_problem(key, value, shape, dtype, p)
            if problem is not None:
                raise problem[0](f"{where}: {problem[1]}; nothing was updated")
        return added, "kahan_comp" in state and "kahan_comp" not in expected

    def _where(self, p) -> str:
        """Names parameter ``p`` in error messages: its place in param_groups."""
        for i, g in enumerate(self.param_groups):
            for j, q in enumerate(g["params"]):
                if q is p:
                    return f"{type(self).__name__}: param_groups[{i}]['params'][{j}]"
        return f"{type(self).__name__}: a parameter"

    # -- the step --------------------------------------------------------------------------

    # The kernels are C calls that torch.compile cannot trace: when a compiled function
    # reaches step() it runs eagerly (one graph break) instead of dynamo tracing the
    # Python around each C call and breaking, with a warning, at every one of them.
    @torch.compiler.disable
    @torch.no_grad()
    def step(self, closure=None):
        """Performs a single optimization step.

        Every parameter with a gradient, in every group, is checked (gradient dtype,
        device, shape and layout; the states' layout) before any is stepped: a step that
        raises has changed no parameter, state or step counter.

        Args:
            closure: a callable that re-evaluates the model and returns the loss.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad_scale = _dtensor.plain(getattr(self, "grad_scale", None))
        found_inf = _dtensor.plain(getattr(self, "found_inf", None))
        plan, new = self._plan_step()  # raises here, before anything changes
        checked, state_of = self._state_checked, self.state
        for p, added, drop, seen in new:
            state = state_of[p]
            state.update(added)
            if drop:
                # kahan was switched off (or p is float32 now): p is already the nearest
                # value of p + kahan_comp, so the buffer is simply dropped
                del state["kahan_comp"]
            checked[id(p)] = seen
        for group, hp, rounding, buckets, halves in plan:
            sr_step = group.get("sr_step", 0)
            for b, ((device, fmt), items) in enumerate(buckets.items()):
                bhp = hp
                if rounding == "stochastic" and (device, fmt) in halves:
                    bhp = dict(hp, sr_seed=_core.sr_seed(group.get("sr_seed", 0), sr_step, b))
                self._step_bucket(group, bhp, device, fmt, items, grad_scale, found_inf)
            group["sr_step"] = sr_step + 1
        return loss

    def _plan_step(self) -> tuple:
        """Checks every parameter that has a gradient and sorts them into buckets (one
        call into the core per device and state format); changes nothing.

        Returns (plan, new): plan is [(group, hparams, rounding, {(device, format):
        [(param, grad, states, seen)]}, {the (device, format) of buckets with float16 or
        bfloat16 parameters})], the tensors as the kernels take them (a DTensor's local
        ones), states the tuple of ``_STATE_KEYS``; new is [(param, states to add, drop
        kahan_comp, seen)] for parameters whose states are made or were replaced.

        ``seen`` (kept in ``self._state_checked`` by id(p): a tensor's own hash is a
        Python call): (key, format, rows, index_base, states, whether p is float16 or
        bfloat16, its bucket) of the layout p's states were last checked against, rows and
        index_base those of the tensor the kernels step (a DTensor's local shard), and
        the state tensors checked. A step over a model of hundreds of tensors does not
        rebuild every expected layout every time: p's states are checked again only when
        the key changes or a state tensor was replaced. This loop runs per parameter per
        step, and is most of the step's time for models of many small tensors: it reads
        only metadata (no host sync) and stays lean.
        """
        checked = self.__dict__.setdefault("_state_checked", {})
        state_of = self.state
        dtensor_type = _dtensor.DTensor
        name = type(self).__name__
        plan, new = [], []
        for gi, group in enumerate(self.param_groups):
            hp = self._hparams(group)
            rounding = self._rounding(group)
            layout = (group["bits"], group.get("block_size"), group["min_8bit_size"], rounding,
                      hp["momentum"])
            buckets = {}  # (device, format) -> [(p, grad, states, seen)], in first-seen order
            halves = set()
            for i, p in enumerate(group["params"]):
                g = p.grad
                if g is None:
                    continue
                if g.is_sparse:
                    raise RuntimeError(f"{name} does not support sparse gradients")
                shape, dtype, device, contiguous = p.shape, p.dtype, p.device, p.is_contiguous()
                if g.shape != shape or g.dtype != dtype or g.device != device \
                        or not (contiguous or _same_layout(g, p)):
                    _refuse_grad(f"{name}.step: param_groups[{gi}]['params'][{i}]", p, g)
                state = state_of.get(p)
                seen = checked.get(id(p))
                key = (layout, dtype, shape, device, contiguous)
                if state is not None and seen is not None and seen[0] == key:
                    get, s = state.get, seen[4]
                    states = (get("state1"), get("absmax1"), get("state2"), get("absmax2"),
                              get("step"), get("kahan_comp"))
                    # (spelled out: the cheapest test that no state tensor was replaced)
                    fresh = states[0] is s[0] and states[1] is s[1] and states[2] is s[2] \
                        and states[3] is s[3] and states[4] is s[4] and states[5] is s[5]
                else:
                    fresh = False
                if not fresh:
                    where = f"{name}.step: param_groups[{gi}]['params'][{i}] (shape {tuple(shape)})"
                    if not contiguous:
                        _check_dense(where, p)
                    added, drop = self._new_states(where, group, p, state)
                    merged = {**(state or {}), **added}
                    if drop:
                        del merged["kahan_comp"]
                    states = tuple(map(merged.get, _STATE_KEYS))
                    local = p.to_local() if _dtensor.is_dtensor(p) else p
                    seen = (key, self._format(group, p), state_rows(local),
                            _dtensor.index_base(p, self._where), states, dtype != torch.float32,
                            (device, self._format(group, p)))
                    new.append((p, added, drop, seen))
                if dtensor_type is not None and isinstance(p, dtensor_type):
                    # FSDP2 & co.: the kernels step the local rows, in place
                    p, g, states = _dtensor.local_step_args(p, g, states, self._where)
                items = buckets.get(seen[6])
                if items is None:
                    items = buckets[seen[6]] = []
                items.append((p, g, states, seen))
                if seen[5]:
                    halves.add(seen[6])
            plan.append((group, hp, rounding, buckets, halves))
        return plan, new

    def _step_bucket(self, group, hp, device, fmt, items, grad_scale, found_inf):
        """One call into the core for the (parameter, gradient, states, checked layout)
        items of one device and state format (see _plan_step)."""
        params = [p.data for p, *_ in items]
        grads = [g if g.is_contiguous() and not g.requires_grad else _grad_view(p, g)
                 for p, g, *_ in items]
        s1, a1, s2, a2, steps, comps = (list(x) for x in zip(*(st for _, _, st, _ in items)))
        # the core takes absmax lists as None in 32-bit buckets, comps as None without Kahan
        if fmt == 32:
            a1 = a2 = None
        if self._rounding(group) != "kahan":
            comps = None
        rows = [seen[2] for *_, seen in items] if fmt != 32 else None
        # a shard's element 0 is element index_base of the whole tensor (stochastic rounding)
        bases = [seen[3] for *_, seen in items]
        gs = _on(grad_scale, device)
        fi = _on(found_inf, device)
        stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
        _core.step(self._kind, fmt, group["block_size"], hp, params, grads, s1, a1, s2, a2,
                   steps, gs, fi, stream, comps, rows=rows, index_base=bases if any(bases) else None)

    # -- state dict ------------------------------------------------------------------------

    def state_dict(self):
        sd = super().state_dict()
        sd["memfit"] = {"optimizer": type(self).__name__, "format_version": _FORMAT_VERSION}
        for g in sd["param_groups"]:  # new dicts (torch packs each group anew)
            g[_GROUP_FORMAT_KEY] = _FORMAT_VERSION
        return sd

    def _check_saved_format(self, state_dict) -> None:
        """Refuses a state dict that memfit did not save in this format (see
        :func:`saved_format`)."""
        name = type(self).__name__
        saver, version = saved_format(state_dict)
        if version is None:
            raise ValueError(
                f"{name}.load_state_dict: this state dict was not saved by a memfit optimizer "
                "(its optimizer states have a different layout); start the optimizer fresh or "
                "load a state dict saved by memfit.optim." + name)
        if saver is not None and saver != name:
            raise ValueError(f"{name}.load_state_dict: the state dict was saved by memfit.optim."
                             f"{saver}, not {name}")
        if version != _FORMAT_VERSION:
            raise ValueError(f"{name}.load_state_dict: unknown format_version {version!r}")

    def load_state_dict(self, state_dict):
        """Loads a state dict saved by the same memfit optimizer class for parameters of
        the same shapes. Codes, absmax and step are restored exactly (no dtype casts),
        so training resumes bit-identically. A torch.optim or bitsandbytes state dict of
        the same kind, or one of an older memfit format, is converted first (see
        :mod:`memfit.optim.convert`).

        Everything is checked before anything changes: a refused state dict leaves the
        optimizer as it was. Refused, with :class:`memfit.MemfitValueError` (a
        ValueError) naming the parameter as ``param_groups[g]['params'][i]``, its shape
        and the state: another optimizer's or format's state dict; a parameter's state
        with a key missing (torch.optim would raise KeyError at the next step) or one it
        does not keep; a state of another dtype or shape (a truncated tensor included);
        NaN, Inf or negative absmax; a ``step`` that is not a whole number >= 0; NaN or
        Inf float32 states or Kahan buffers, negative second moments; 8-bit codes laid
        out in another memory order than the parameter. Repaired, exactly: states in
        another memory layout whose values are well defined (float32 states, Kahan
        buffers, absmax, 4-bit codes, 8-bit codes in the parameter's order) are copied
        into the layout the kernels need. An empty state (``{}``, a parameter never
        stepped) starts fresh, as in torch; a missing ``kahan_comp`` starts at zero (the
        parameter's value as it is)."""
        state_dict = convert.to_current(self, state_dict)
        name = type(self).__name__
        self._check_saved_format(state_dict)
        groups = self.param_groups
        saved_groups = state_dict["param_groups"]
        if len(groups) != len(saved_groups):
            raise MemfitValueError("loaded state dict has a different number of parameter groups")
        if any(len(g["params"]) != len(sg["params"]) for g, sg in zip(groups, saved_groups)):
            raise MemfitValueError("loaded state dict contains a parameter group that doesn't "
                                   "match the size of optimizer's group")
        # saved parameter id -> (group index, index in the group, the optimizer's parameter)
        place = {pid: (gi, i, p) for gi, (g, sg) in enumerate(zip(groups, saved_groups))
                 for i, (pid, p) in enumerate(zip(sg["params"], g["params"]))}
        new_groups = []
        for g, sg in zip(groups, saved_groups):
            ng = dict(sg)
            ng.pop(_GROUP_FORMAT_KEY, None)  # recorded by state_dict(), not a setting
            ng["params"] = g["params"]
            new_groups.append(ng)
        for ng in new_groups:
            self._check_group(ng)
        state = defaultdict(dict)
        for pid, saved in state_dict["state"].items():
            if pid not in place:
                continue
            gi, i, p = place[pid]
            where = (f"{name}.load_state_dict: param_groups[{gi}]['params'][{i}] "
                     f"(shape {tuple(p.shape)})")
            if not isinstance(saved, dict):
                raise MemfitValueError(f"{where}: its state is a {type(saved).__name__}, not a "
                                       "dict of tensors; nothing was loaded")
            if not saved:
                continue  # never stepped (torch saves such a state as {}): starts fresh
            group = new_groups[gi]
            expected = self._expected_state(group, p)
            _check_saved_keys(where, saved, expected)
            loaded = {k: _laid_out(where, k, self._loaded_value(k, v, p), p)
                      for k, v in saved.items()}
            for key, value in loaded.items():
                problem = _state_problem(key, value, *expected[key], p)
                if problem is not None:
                    raise problem[0](f"{where}: {problem[1]}; nothing was loaded")
            self._check_values(where, group, p, loaded)
            state[p] = loaded
        self.__setstate__({"state": state, "param_groups": new_groups})
        self.__dict__.pop("_state_checked", None)  # new states: check them on the next step

    @staticmethod
    def _loaded_value(key, value, p):
        """A fresh copy of one loaded state, laid out as p's states are (a DTensor of
        p's placements for a DTensor p, whatever the saved layout)."""
        if _dtensor.is_dtensor(p) or _dtensor.is_dtensor(value):
            return _dtensor.loaded_value(key, value, p)
        return value.detach().to(device=p.device, copy=True)

    def _check_values(self, where, group, p, loaded) -> None:
        """Refuses corrupt values in the loaded states of p: NaN, Inf or negative
        absmax (a NaN scale would freeze its block for ever, silently), a step that is
        not a whole number >= 0, NaN or Inf float32 states or Kahan buffers, negative
        second moments. One host sync per parameter, at load only; for a DTensor p one
        all-reduce over its mesh, so that every rank checks its own rows and all refuse
        together."""
        signed = _core.state_layout(self._kind, group["bits"], group["block_size"], 0,
                                    self._hparams(group)["momentum"])["signed"]
        checks = []  # (key, what is wrong, a 0-d bool tensor: True where it is)
        for key, value in loaded.items():
            v = value.to_local() if _dtensor.is_dtensor(value) else value
            if key == "step":
                whole = torch.isfinite(v) & (v >= 0) & (v == torch.floor(v))
                checks.append((key, "is not a whole number of steps >= 0", ~whole))
            elif key.startswith("absmax"):
                # a block's scale is its largest |value|: finite and >= 0 (False for NaN)
                checks.append((key, "holds NaN, Inf or negative block scales",
                               ~((v >= 0) & (v < math.inf)).all()))
            elif v.dtype != torch.uint8:  # float32 states and the Kahan buffer
                checks.append((key, "holds NaN or Inf values", ~torch.isfinite(v).all()))
                if key.startswith("state") and not signed[int(key[5:]) - 1]:
                    checks.append((key, "holds negative values, but it is a second moment "
                                        "(a mean of squares, >= 0)", (v < 0).any()))
        flags = torch.stack([bad for *_, bad in checks]).float()
        if _dtensor.is_dtensor(p):
            flags = _dtensor.sum_over_mesh(flags, p)
        for (key, what, _), bad in zip(checks, flags.tolist()):
            if bad:
                got = f" ({float(loaded[key])})" if key == "step" else ""
                raise MemfitValueError(f"{where}: state {key!r}{got} {what}: the state dict is "
                                       "corrupt; nothing was loaded")


def saved_format(state_dict) -> tuple:
    """(optimizer class name or None, format version or None) of a state dict memfit
    saved: from its top-level "memfit" record or, after torch.distributed.checkpoint's
    get_state_dict/set_state_dict (which keep only "state" and "param_groups"), from the
    format every param group records (the name is then unknown). (None, None): not
    memfit's (a torch.optim or bitsandbytes state dict, or not a state dict)."""
    if not isinstance(state_dict, dict):
        return None, None
    meta, groups = state_dict.get("memfit"), state_dict.get("param_groups")
    if isinstance(meta, dict) and "optimizer" in meta:
        return meta["optimizer"], meta.get("format_version")
    if (isinstance(groups, list) and groups
            and all(isinstance(g, dict) and _GROUP_FORMAT_KEY in g for g in groups)):
        versions = {g[_GROUP_FORMAT_KEY] for g in groups}
        return None, versions.pop() if len(versions) == 1 else sorted(versions, key=repr)
    return None, None


def _grad_view(p, g):
    """The gradient as the kernels take it: detached (a gradient made with
    create_graph=True requires grad; detach() is a view, not a copy) and, for a
    row-major parameter, row-major (a copy only where it is not). A parameter that is
    dense in another order (channels_last) needs a gradient of its own strides: the
    binding checks that and says what to do."""
    if g.requires_grad:
        g = g.detach()
    if not g.is_contiguous() and p.is_contiguous():
        g = g.contiguous()
    return g


def _on(t, device):
    if t is None:
        return None
    if t.device != device or t.dtype != torch.float32:
        # non_blocking only towards a GPU, where the kernel runs after the copy on the same
        # stream; a GPU scaler's grad_scale/found_inf read by the CPU kernels (FSDP2's
        # CPUOffloadPolicy) must have arrived first, or the step reads stale values
        t = t.to(device=device, dtype=torch.float32, non_blocking=device.type != "cpu")
    return t.reshape(1) if t.dim() != 1 else t


def _state_codes(optimizer, group) -> list:
    """[(torch's name, code table or None)] of state1, state2, ... of ``optimizer``'s
    kind: the code each quantized state uses in ``group`` (None for 32-bit groups)."""
    bits = group["bits"]
    signed = (_core.state_layout(optimizer._kind, bits, group["block_size"], 0,
                                 optimizer._hparams(group)["momentum"])["signed"]
              if bits != 32 else None)
    return [(nm, _core.code_table(bits, signed[k]) if signed else None)
            for k, nm in enumerate(_core.STATE_NAMES[optimizer._kind])]


def _dequantize_states(optimizer, group, state, param, rows=None) -> dict:
    """float32 copies of the states in ``state`` (one parameter's, as ``group`` keeps
    them), keyed by torch's names, each of ``param``'s shape and memory layout.
    ``rows``: of the row-block layout, by default state_rows(param); 1 reads format 1."""
    out = {}
    for k, (nm, code) in enumerate(_state_codes(optimizer, group), start=1):
        s = state.get(f"state{k}")
        if s is None:
            continue
        if s.dtype == torch.float32:
            out[nm] = s.detach().clone().reshape(param.shape)
            continue
        out[nm] = _blocks.dequantize_state(s.detach(), state[f"absmax{k}"].detach(),
                                           group["bits"], code, group["block_size"], param,
                                           rows=rows)
    return out


def dequantized_state(optimizer, param) -> dict:
    """fp32 copies of ``param``'s optimizer states, keyed by torch's names
    (``exp_avg``/``exp_avg_sq`` for Adam and AdamW, ``exp_avg`` for Lion,
    ``momentum_buffer`` for SGD, ``square_avg`` (and ``momentum_buffer``) for RMSprop),
    each of ``param``'s shape and device (for a DTensor ``param``: DTensors of its
    placements, each rank's rows computed locally), plus ``kahan_comp`` (the Kahan compensation,
    as float32; ``param.float() + kahan_comp`` is the parameter's value) for bfloat16 or
    float16 parameters of ``kahan=True`` groups. Empty before the first step."""
    if not isinstance(optimizer, _MemfitOptimizer):
        raise TypeError(f"optimizer: expected a memfit.optim optimizer, got {type(optimizer).__name__}")
    state = optimizer.state.get(param)
    if not state:
        return {}
    group = next((g for g in optimizer.param_groups if any(q is param for q in g["params"])), None)
    if group is None:
        raise ValueError("param: not a parameter of this optimizer")
    dparam = None
    if _dtensor.is_dtensor(param):  # each rank dequantizes its rows (no block crosses a row)
        dparam, param, state = param, param.to_local(), _dtensor.local_state(state)
    out = _dequantize_states(optimizer, group, state, param)
    if "kahan_comp" in state:
        out["kahan_comp"] = state["kahan_comp"].detach().float().reshape(param.shape)
    return out if dparam is None else {k: _dtensor.like_param(v, dparam) for k, v in out.items()}
