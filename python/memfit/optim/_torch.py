"""torch.optim.Optimizer subclasses on memfit's fused kernels."""

from __future__ import annotations

import itertools
import sys
from collections import defaultdict

import torch

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
# Modules that read _step_supports_amp_scaling as "never unscale_ this optimizer, never
# clip it" (see _MemfitOptimizer._step_supports_amp_scaling): Lightning's, under both of
# its package names.
_UNSCALE_FIRST_CALLERS = ("lightning_fabric.", "pytorch_lightning.", "lightning.")


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

    @property
    def _step_supports_amp_scaling(self) -> bool:
        """True: torch.amp.GradScaler (and memfit's) hand the kernels grad_scale and
        found_inf instead of unscaling and syncing on found_inf: they unscale and skip
        on the device, and after an explicit ``unscale_`` (grad_scale None) they still
        skip on found_inf, so ``unscale_``, clipping, ``step`` is exact.

        Lightning reads this flag as "unscale_ before step would unscale twice", skips
        its unscale_ and refuses gradient clipping (``_optimizer_handles_unscaling`` in
        lightning_fabric/plugins/precision/amp.py, asked even under bf16-mixed, where no
        scaler exists). That does not hold here, so Lightning alone is told False: it
        unscales, clips, and its ``scaler.step`` still gives the kernels found_inf."""
        caller = sys._getframe(1).f_globals.get("__name__", "")
        return not caller.startswith(_UNSCALE_FIRST_CALLERS)

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

    def _init_state(self, group, p) -> dict:
        state = self.state[p]
        expected = self._expected_state(group, p)
        dtensor = _dtensor.is_dtensor(p)
        if dtensor:
            _dtensor.check_param(p, self._where)
        for key, (shape, dtype) in expected.items():
            if key not in state:
                if dtensor and key != "step":
                    # a DTensor of p's mesh and placements, of the global shape
                    state[key] = _dtensor.zeros_state(p, shape, dtype, self._where)
                    continue
                # states of p's shape follow p's memory layout (zeros_like keeps the
                # strides of a dense tensor, channels_last included): the kernels run
                # over the storage in memory order, the same for p, its grad and these
                state[key] = (torch.zeros_like(p, dtype=dtype) if shape == tuple(p.shape) and key != "step"
                              else torch.zeros(shape, dtype=dtype, device=p.device))
        if "kahan_comp" in state and "kahan_comp" not in expected:
            # kahan was switched off (or p is float32 now): p is already the nearest value
            # of p + kahan_comp, so the buffer is simply dropped
            del state["kahan_comp"]
        return state

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

        Args:
            closure: a callable that re-evaluates the model and returns the loss.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad_scale = _dtensor.plain(getattr(self, "grad_scale", None))
        found_inf = _dtensor.plain(getattr(self, "found_inf", None))
        dtensor_type = _dtensor.DTensor
        # parameter -> (key, format, rows, index_base) of the layout its state was last
        # checked against (rows and index_base of the tensor the kernels step: the local
        # shard of a DTensor), so that a step over a model with hundreds of tensors does
        # not rebuild every expected layout every time (this loop and _step_bucket run per
        # parameter per step: kept lean, it is most of the step's time for models of many
        # small tensors)
        checked = self.__dict__.setdefault("_state_checked", {})
        state_of = self.state
        for group in self.param_groups:
            hp = self._hparams(group)
            rounding = self._rounding(group)
            layout = (group["bits"], group.get("block_size"), group["min_8bit_size"], rounding,
                      hp["momentum"])
            buckets = {}  # (device, format) -> [(p, grad, state)], in first-seen order
            for p in group["params"]:
                g = p.grad
                if g is None:
                    continue
                if g.is_sparse:
                    raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
                state = state_of[p]
                key = (layout, p.dtype, p.shape)
                seen = checked.get(p)
                if seen is None or seen[0] != key or "step" not in state:
                    state = self._init_state(group, p)
                    local = p.to_local() if _dtensor.is_dtensor(p) else p
                    seen = checked[p] = (key, self._format(group, p), state_rows(local),
                                         _dtensor.index_base(p, self._where))
                if dtensor_type is not None and isinstance(p, dtensor_type):
                    # FSDP2 & co.: the kernels step the local rows, in place
                    p, g, state = _dtensor.local_step_args(p, g, state, self._where)
                device = p.device
                if g.device != device:
                    raise ValueError(f"{type(self).__name__}: a gradient is on {g.device} but its "
                                     f"parameter on {device}")
                items = buckets.get((device, seen[1]))
                if items is None:
                    items = buckets[(device, seen[1])] = []
                items.append((p, g, state, seen))
            sr_step = group.get("sr_step", 0)
            for b, ((device, fmt), items) in enumerate(buckets.items()):
                bhp = hp
                if rounding == "stochastic" and any(p.dtype != torch.float32 for p, *_ in items):
                    bhp = dict(hp, sr_seed=_core.sr_seed(group.get("sr_seed", 0), sr_step, b))
                self._step_bucket(group, bhp, device, fmt, items, grad_scale, found_inf)
            group["sr_step"] = sr_step + 1
        return loss

    def _step_bucket(self, group, hp, device, fmt, items, grad_scale, found_inf):
        """One call into the core for the (parameter, gradient, state, checked layout)
        items of one device and state format (see step's ``checked``)."""
        params = [p.data for p, *_ in items]
        grads = [g if g.is_contiguous() and not g.requires_grad else _grad_view(p, g)
                 for p, g, *_ in items]
        s1 = [st.get("state1") for _, _, st, _ in items]
        s2 = [st.get("state2") for _, _, st, _ in items]
        steps = [st["step"] for _, _, st, _ in items]
        # lists the core takes as None when no parameter has the array
        a1 = a2 = comps = None
        if fmt != 32:
            a1 = [st.get("absmax1") for _, _, st, _ in items]
            a2 = [st.get("absmax2") for _, _, st, _ in items]
        if self._rounding(group) == "kahan":
            comps = [st.get("kahan_comp") for _, _, st, _ in items]
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
        :mod:`memfit.optim.convert`). Anything else is refused with ValueError."""
        state_dict = convert.to_current(self, state_dict)
        name = type(self).__name__
        self._check_saved_format(state_dict)
        groups = self.param_groups
        saved_groups = state_dict["param_groups"]
        if len(groups) != len(saved_groups):
            raise ValueError("loaded state dict has a different number of parameter groups")
        if any(len(g["params"]) != len(sg["params"]) for g, sg in zip(groups, saved_groups)):
            raise ValueError("loaded state dict contains a parameter group that doesn't match "
                             "the size of optimizer's group")
        id_map = dict(zip(itertools.chain.from_iterable(sg["params"] for sg in saved_groups),
                          itertools.chain.from_iterable(g["params"] for g in groups)))
        new_groups = []
        for g, sg in zip(groups, saved_groups):
            ng = dict(sg)
            ng.pop(_GROUP_FORMAT_KEY, None)  # recorded by state_dict(), not a setting
            ng["params"] = g["params"]
            new_groups.append(ng)
        group_of = {id(p): ng for ng in new_groups for p in ng["params"]}
        state = defaultdict(dict)
        for pid, saved in state_dict["state"].items():
            if pid not in id_map:
                continue
            p = id_map[pid]
            ng = group_of[id(p)]
            expected = self._expected_state(ng, p)
            for key, value in saved.items():
                if key not in expected:
                    raise ValueError(f"{name}.load_state_dict: parameter {pid} has an unexpected state "
                                     f"{key!r} (saved with different settings?)")
                shape, dtype = expected[key]
                if not torch.is_tensor(value) or value.dtype != dtype or tuple(value.shape) != shape:
                    got = (f"{value.dtype} {tuple(value.shape)}" if torch.is_tensor(value)
                           else type(value).__name__)
                    raise ValueError(
                        f"{name}.load_state_dict: state {key!r} of parameter {pid} is {got}, but this "
                        f"parameter (shape {tuple(p.shape)}) needs {dtype} {shape}: the state dict was "
                        "saved for a different model or with different bits/block_size/min_8bit_size")
            if "step" not in saved:
                raise ValueError(f"{name}.load_state_dict: parameter {pid} has no 'step'")
            state[p] = self._loaded_state(saved, p)
        for ng in new_groups:
            self._check_group(ng)
        self.__setstate__({"state": state, "param_groups": new_groups})
        self.__dict__.pop("_state_checked", None)  # new states: check them on the next step

    @staticmethod
    def _loaded_state(saved: dict, p) -> dict:
        """Fresh copies of one parameter's checked states, laid out as p's states are
        (DTensors of p's placements for a DTensor p, whatever the saved layout)."""
        if _dtensor.is_dtensor(p) or any(_dtensor.is_dtensor(v) for v in saved.values()):
            return {k: _dtensor.loaded_value(k, v, p) for k, v in saved.items()}
        return {k: v.detach().to(device=p.device, copy=True) for k, v in saved.items()}


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
        t = t.to(device=device, dtype=torch.float32, non_blocking=True)
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
