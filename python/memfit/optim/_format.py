"""memfit's optimizer state-dict format: its version, where state_dict() records it,
how to read it back, and the code tables and float32 values of the quantized states.

Below both _torch.py (the optimizers) and convert/ (foreign and older state dicts):
the layering is _format <- convert <- _torch, one way. ``MemfitOptimizerBase`` lets this
module and convert/ tell a memfit optimizer without importing _torch.
"""

from __future__ import annotations

import torch

from memfit.optim import _blocks, _core, _dtensor

# 2: quantization blocks within rows (dim-0 slices), absmax of shape (rows, blocks per
# row), 4-bit codes of shape (rows, ceil(row length / 2)), and float32 states for 1-D
# parameters; 1: blocks over the whole storage.
FORMAT_VERSION = 2
# The key under which state_dict() records FORMAT_VERSION in every param group as well
# as at the top level: torch.distributed.checkpoint's get_state_dict/set_state_dict keep
# only "state" and "param_groups".
GROUP_FORMAT_KEY = "memfit_format"


class MemfitOptimizerBase:
    """Marks memfit's torch optimizers (the base of ``_torch._MemfitOptimizer``).
    Subclasses have ``_kind``, ``_hparams(group)`` and ``_expected_state(group, p)``."""

    def _group_kind(self, group) -> int:
        """The optimizer kind (mf_optim_kind) that steps ``group``: the class's
        ``_kind``, unless one optimizer steps groups of two kinds (memfit.optim.Muon8bit:
        Muon groups and ``use_muon=False`` AdamW groups)."""
        return self._kind

    def _check_saveable(self, done) -> None:
        """Raises (MemfitValueError) where the states cannot be saved as they are, so
        that no state dict memfit cannot read is written (memfit.optim.Muon8bit: a
        group's use_muon flipped after its first step); ``done``: what was not done.
        Nothing to check by default."""

    def _row_major_states(self, group) -> bool:
        """Whether the states of p's shape are row-major whatever p's layout (Muon's:
        its momentum pass never touches p, and a conv filter's momentum is the row-major
        matrix Newton-Schulz takes) instead of laid out as p (the default)."""
        return False

    def _state_like(self, group, p):
        """A tensor of p's shape in the memory layout of p's per-element states in
        ``group``: p itself, or a new contiguous one for row-major states of a p in
        another layout (a channels_last filter's in a Muon group)."""
        if not self._row_major_states(group) or p.is_contiguous():
            return p
        return torch.empty(p.shape, dtype=p.dtype, device=p.device)


def check_optimizer(optimizer) -> None:
    """Raises TypeError unless ``optimizer`` is one of memfit's torch optimizers."""
    if not isinstance(optimizer, MemfitOptimizerBase):
        raise TypeError(f"optimizer: expected a memfit.optim optimizer, got "
                        f"{type(optimizer).__name__}")


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
            and all(isinstance(g, dict) and GROUP_FORMAT_KEY in g for g in groups)):
        versions = {g[GROUP_FORMAT_KEY] for g in groups}
        return None, versions.pop() if len(versions) == 1 else sorted(versions, key=repr)
    return None, None


def state_codes(optimizer, group) -> list:
    """[(torch's name, code table or None)] of state1, state2, ... of the kind that
    steps ``group``: the code each quantized state uses in ``group`` (None for 32-bit groups)."""
    bits, kind = group["bits"], optimizer._group_kind(group)
    signed = (_core.state_layout(kind, bits, group["block_size"], 0,
                                 optimizer._hparams(group)["momentum"])["signed"]
              if bits != 32 else None)
    return [(nm, _core.code_table(bits, signed[k]) if signed else None)
            for k, nm in enumerate(_core.STATE_NAMES[kind])]


def dequantize_states(optimizer, group, state, param, rows=None) -> dict:
    """float32 copies of the states in ``state`` (one parameter's, as ``group`` keeps
    them), keyed by torch's names, each of ``param``'s shape and its states' memory
    layout (:meth:`MemfitOptimizerBase._state_like`). ``rows``: of the row-block
    layout, by default state_rows(param); 1 reads format 1."""
    out = {}
    like = optimizer._state_like(group, param)
    for k, (nm, code) in enumerate(state_codes(optimizer, group), start=1):
        s = state.get(f"state{k}")
        if s is None:
            continue
        if s.dtype == torch.float32:
            out[nm] = s.detach().clone().reshape(param.shape)
            continue
        out[nm] = _blocks.dequantize_state(s.detach(), state[f"absmax{k}"].detach(),
                                           group["bits"], code, group["block_size"], like,
                                           rows=rows)
    return out


def dequantized_state(optimizer, param) -> dict:
    """fp32 copies of ``param``'s optimizer states, keyed by torch's names
    (``exp_avg``/``exp_avg_sq`` for Adam and AdamW, ``exp_avg`` for Lion,
    ``momentum_buffer`` for SGD, ``square_avg`` (and ``momentum_buffer``) for RMSprop,
    ``sum`` for Adagrad),
    each of ``param``'s shape and device (for a DTensor ``param``: DTensors of its
    placements, each rank's rows computed locally), plus ``kahan_comp`` (the Kahan compensation,
    as float32; ``param.float() + kahan_comp`` is the parameter's value) for bfloat16 or
    float16 parameters of ``kahan=True`` groups. Empty before the first step."""
    check_optimizer(optimizer)
    state = optimizer.state.get(param)
    if not state:
        return {}
    group = next((g for g in optimizer.param_groups if any(q is param for q in g["params"])), None)
    if group is None:
        raise ValueError("param: not a parameter of this optimizer")
    dparam = None
    if _dtensor.is_dtensor(param):  # each rank dequantizes its rows (no block crosses a row)
        dparam, param, state = param, param.to_local(), _dtensor.local_state(state)
    out = dequantize_states(optimizer, group, state, param)
    if "kahan_comp" in state:
        out["kahan_comp"] = state["kahan_comp"].detach().float().reshape(param.shape)
    return out if dparam is None else {k: _dtensor.like_param(v, dparam) for k, v in out.items()}
