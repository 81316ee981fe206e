"""torch.optim.Optimizer subclasses on memfit's fused kernels: their base class,
``_MemfitOptimizer``, composed of parts that each change on their own:

- here: construction, the checks of param groups, the state layout of each parameter,
  and registration of the classes (memfit.optim._registry);
- memfit.optim._torch_step: the step (checks of every parameter, buckets, core calls);
- memfit.optim._torch_subset: the step of a few parameters with step()'s random bits
  (memfit.optim.offload's step in backward);
- memfit.optim._torch_state_dict: state_dict, load_state_dict and torch's state-dict hooks.

The names other modules import from here stay importable from here.
"""

from __future__ import annotations

import torch

from memfit.optim import _checks, _core, _dtensor, _format, _registry
# re-exported: their old home (tests and users import them from here)
from memfit.optim._format import dequantized_state, saved_format  # noqa: F401
from memfit.optim._blocks import state_rows
from memfit.optim._torch_state_dict import (  # noqa: F401 (memfit.optim.offload imports them from here)
    _StateDictMixin,
    run_load_state_dict_post_hooks,
    run_load_state_dict_pre_hooks,
    run_state_dict_post_hooks,
)
from memfit.optim._torch_step import (  # noqa: F401 (their old home)
    _DTENSOR,
    _STATE_KEYS,
    _StepMixin,
    _grad_view,
    _on,
    _storage_marks,
)
from memfit.optim._torch_subset import _SubsetStepMixin


class _MemfitOptimizer(_StepMixin, _SubsetStepMixin, _StateDictMixin, torch.optim.Optimizer,
                       _format.MemfitOptimizerBase):
    """Base class: construction, param-group checks and the state layout here; the step
    (memfit.optim._torch_step), the step of a subset (_torch_subset) and state dicts
    (_torch_state_dict) are its parts, composed by this class's bases.

    Subclasses set ``_kind`` and ``_bits`` (their math, which the public ones register
    with memfit.optim._registry as they are made) and implement ``_hparams(group)``.

    Per-parameter state (``optimizer.state[p]``):
        ``step``: float32 tensor of shape () on p's device (steps taken; torch's format).
        ``state1``/``state2``: the states, uint8 codes (shape of p for 8 bits,
        ``(rows, ceil(L/2))`` for 4 bits) with ``absmax1``/``absmax2`` (float32,
        ``(rows, ceil(L/block_size))``: one per block), where rows = ``p.shape[0]`` and L
        the elements per row (see :func:`state_rows`; quantization blocks never cross a
        row, so sharding p along dim 0 shards every state with it), or float32 tensors
        of p's shape for 1-D tensors, tensors smaller than ``min_8bit_size`` and 32-bit
        optimizers. AdEMAMix keeps a third, ``state3``/``absmax3``, laid out alike. Use
        :func:`memfit.optim.dequantized_state` to read them as floats.
        ``kahan_comp``: with ``kahan=True`` and a float16/bfloat16 ``p``, the Kahan
        compensation (p's dtype and shape; the parameter's value is ``p + kahan_comp``).
    """

    _kind: int = _core.ADAMW
    _bits: int = 8

    # step() takes a GradScaler's grad_scale and found_inf: the kernels unscale and skip
    # on the device (after unscale_, grad_scale None, they still skip on found_inf).
    # memfit's protocol, read by memfit.amp.GradScaler only. torch's flag
    # (_step_supports_amp_scaling) stays unset: Lightning reads it as "cannot clip", so
    # torch's scaler unscales these as any optimizer, unless memfit.amp.scale_in_kernel
    # opts one in (memfit/amp/in_kernel.py).
    _memfit_scale_in_kernel = True

    # torch's flags that this class keeps in its param groups, as torch's class of the
    # same kind does (every class takes all four keywords: see
    # memfit.optim.optimizers), with their defaults: filled into a loaded or unpickled
    # group that lacks them, as torch's __setstate__ does
    _TORCH_FLAGS = dict(maximize=False, foreach=None, fused=None, capturable=False,
                        differentiable=False)
    # (group key, the only value memfit's math has, advice): options of torch's class
    # that memfit does not have, refused wherever they are given (keyword, param group,
    # loaded group) instead of being ignored; their values are the defaults of a group
    # that lacks them
    _fixed_options: tuple = ()

    def __init__(self, params, hyper, *, maximize=False, block_size=None, min_8bit_size=4096,
                 bf16_stochastic_round=None, kahan=False, foreach=None, fused=None,
                 capturable=False, differentiable=False):
        """``hyper``: the subclass's own hyperparameters (lr, betas, ...); the keyword
        options are the ones every memfit optimizer takes (see memfit.optim.optimizers)."""
        flags = dict(maximize=maximize, foreach=foreach, fused=fused, capturable=capturable,
                     differentiable=differentiable)
        _checks.check_torch_flags(flags)  # also those this class does not keep
        defaults = dict(hyper, min_8bit_size=min_8bit_size,
                        bf16_stochastic_round=bf16_stochastic_round, kahan=kahan,
                        **{k: v for k, v in flags.items() if k in self._TORCH_FLAGS})
        defaults.setdefault("bits", self._bits)
        defaults["block_size"] = (_core.DEFAULT_BLOCK[defaults["bits"]] if block_size is None
                                  else block_size)
        # bfloat16/float16 parameters are written with stochastic rounding (no fp32 master
        # copy needed); the seed and a per-group step counter live in the param group,
        # so a resumed run draws the same random bits. None: stochastic unless kahan.
        defaults.setdefault("sr_seed", 0)
        super().__init__(params, defaults)  # checks each group (add_param_group)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        # memfit.optim's public classes register their math: the converters look up the
        # class a state dict names there, without importing the class modules
        _registry.register(cls)

    def __setstate__(self, state):
        super().__setstate__(state)
        missing = {**self._TORCH_FLAGS, **{k: v for k, v, _ in self._fixed_options}}
        for group in self.param_groups:
            for key, value in missing.items():
                group.setdefault(key, value)

    # -- hyperparameters -------------------------------------------------------------

    def _hparams(self, group) -> dict:  # pragma: no cover - abstract
        raise NotImplementedError

    def add_param_group(self, param_group):
        """torch's add_param_group, then memfit's checks of the new group's values and
        parameters (dtype, layout); a refused group is not added."""
        super().add_param_group(param_group)
        gi = len(self.param_groups) - 1
        try:
            where = f"{type(self).__name__}: param_groups[{gi}]"
            _checks.check_group(self, self.param_groups[-1], where)
            for i, p in enumerate(self.param_groups[-1]["params"]):
                _checks.check_param(f"{where}['params'][{i}]", p)
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
        layout = _core.state_layout(self._group_kind(group), fmt, group["block_size"], p.numel(),
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

    def _zero_state(self, p, key, shape, dtype, row_major=False):
        """A zero state of global ``shape`` for ``p`` (step: a plain scalar on p's local
        device). States of p's shape follow p's memory layout (zeros_like keeps the
        strides of a dense tensor, channels_last included), unless ``row_major``
        (``_row_major_states``): the kernels run over the storage in memory order, the
        same for p, its grad and these."""
        if _dtensor.is_dtensor(p) and key != "step":
            # a DTensor of p's mesh and placements, of the global shape
            return _dtensor.zeros_state(p, shape, dtype, self._where)
        local = p.to_local() if _dtensor.is_dtensor(p) else p
        if shape == tuple(p.shape) and key != "step" and not row_major:
            return torch.zeros_like(local, dtype=dtype)
        return torch.zeros(shape, dtype=dtype, device=local.device)

    def _initial_state(self, group, p, key, shape, dtype):
        """The value a new state of p in ``group`` starts from: zeros (_zero_state), but
        for classes whose state starts elsewhere (Adagrad's initial_accumulator_value)."""
        return self._zero_state(p, key, shape, dtype, self._row_major_states(group))

    def _new_states(self, where, group, p, state) -> tuple:
        """(states to add, whether to drop kahan_comp) for p before its first step or
        after its layout changed (bits, dtype, shape, device): the missing states as
        they start (:meth:`_initial_state`); the states p already has are checked against the layout ``group`` needs
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
                added[key] = self._initial_state(group, p, key, shape, dtype)
                continue
            problem = _checks.state_problem(key, value, shape, dtype, p,
                                            self._row_major_states(group))
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
