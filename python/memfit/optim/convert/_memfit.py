"""memfit's own state dicts: whether the class that saved one (found by its record in
memfit.optim._registry, never by importing the class modules) does the same math as the
loading optimizer (``_same_math``: a memfit.optim.bnb shim's, Adam into AdamW without
weight decay, LAMB/LARS into AdamW/Adam/SGD at plain values), format 1's
upgrade (``upgrade_v1``), and the memfit state built from float32 values that every
conversion ends with (``_memfit_state``, ``_result``)."""

from __future__ import annotations

import math

import torch

from memfit.optim import _blocks, _core, _format, _registry
from memfit.optim._registry import record_name
from memfit.optim.convert._refusals import (
    _KIND_MATH, _check_optimizer, _checked_group, _decay_refusal, _float_state, _name, _places,
    _refuse, _tensor_problem, _unsigned_names, _where)


def _qualified(saver) -> str:
    return f"memfit.optim.{saver}" if isinstance(saver, str) else repr(saver)


def _same_math(optimizer, state_dict):
    """``state_dict`` (a memfit one) if the class that saved it does the same math as
    ``optimizer`` (the same kind, the same bits in every param group), with its record
    naming ``optimizer``'s class; else a MemfitValueError. A shim's dict (memfit.optim.bnb)
    thus loads into the memfit class of the same math and back, and an Adam's into an
    AdamW (or back) only without weight decay."""
    saver, _ = _format.saved_format(state_dict)
    if saver is None:  # after torch.distributed.checkpoint: only the format is known
        return state_dict
    name = _name(optimizer)
    if saver != record_name(optimizer):
        cls = _registry.saver_class(saver)
        if cls is None:
            raise _refuse(optimizer, f"the state dict was saved by {_qualified(saver)}, which is not a "
                                     f"memfit optimizer class; load a state dict saved by {name} or "
                                     "by a memfit class of the same math")
        saved_groups = state_dict["param_groups"]
        adam = {_core.ADAM, _core.ADAMW}
        saved_kind = _registry.math_of(cls).kind
        if saved_kind != optimizer._kind and not {saved_kind, optimizer._kind} <= adam:
            raise _refuse(optimizer, f"the state dict was saved by {_qualified(saver)}, which does "
                                     f"{_KIND_MATH[saved_kind]}, and {name} does "
                                     f"{_KIND_MATH[optimizer._kind]}")
        if {saved_kind, optimizer._kind} <= adam:
            # Adam and AdamW agree without decay; per group, as LAMB's adam_w_mode chooses
            # (the saved one where the group has it: the loaded group keeps it)
            for gi, sg in enumerate(saved_groups):
                group_kind = ((_core.ADAMW if sg["adam_w_mode"] else _core.ADAM)
                              if "adam_w_mode" in sg else saved_kind)
                kind = optimizer._group_kind(sg)
                if group_kind != kind and sg.get("weight_decay"):
                    raise _decay_refusal(optimizer, f"param_groups[{gi}]", group_kind == _core.ADAMW,
                                         _qualified(saver), kind)
        if saved_kind != optimizer._kind:
            # ... and then the saved flag of the decay's meaning becomes this class's (LAMB
            # keeps none: its adam_w_mode says it)
            fixed = {k: v for k, v, _ in optimizer._fixed_options if k == "decoupled_weight_decay"}
            saved_groups = [{**{k: v for k, v in sg.items() if k != "decoupled_weight_decay"},
                             **fixed} if "decoupled_weight_decay" in sg else sg
                            for sg in saved_groups]
            state_dict = {**state_dict, "param_groups": saved_groups}
        if getattr(cls, "_TRUST_KEYS", ()) and not getattr(optimizer, "_TRUST_KEYS", ()):
            for gi, sg in enumerate(saved_groups):  # LAMB/LARS into AdamW/Adam/SGD
                extras = {k: sg[k] for k in ("max_unorm", "bias_correction", "adam_w_mode")
                          if k in sg and sg[k] != (0.0 if k == "max_unorm" else True)}
                if extras:
                    raise _refuse(optimizer, f"param_groups[{gi}] was saved by {_qualified(saver)} with "
                                             f"{', '.join(f'{k}={v!r}' for k, v in extras.items())}, "
                                             f"which {name} does not apply (options of LAMB and LARS only); "
                                             "load it into the class that saved it")
        for gi, (g, sg) in enumerate(zip(optimizer.param_groups, saved_groups)):
            if sg.get("bits") != g["bits"]:
                raise _refuse(optimizer, f"param_groups[{gi}] was saved by {_qualified(saver)} with "
                                         f"{sg.get('bits')!r}-bit states, and {name} keeps {g['bits']}-bit "
                                         f"states there: give that group 'bits': {sg.get('bits')!r} "
                                         f"({name}([{{'params': ..., 'bits': {sg.get('bits')!r}}}, ...])) "
                                         "or load it into the class that saved it")
    if state_dict.get("memfit", {}).get("optimizer") == name:
        return state_dict
    return {**state_dict, "memfit": {**state_dict["memfit"], "optimizer": name}}


def _memfit_state(optimizer, where, group, p, floats, step, extra=None):
    """The state of p in ``group`` as this optimizer keeps it, from float32 values under
    torch's names (quantized where the layout says so)."""
    expected = optimizer._expected_state(group, p)
    out = {"step": step}
    for k, (nm, code) in enumerate(_format.state_codes(optimizer, group), start=1):
        if f"state{k}" not in expected:
            continue
        value = floats.get(nm)
        if value is None:
            raise _refuse(optimizer, f"{where}: has no {nm!r} state to convert (it has "
                                     f"{', '.join(map(repr, floats)) or 'none'})")
        # laid out as p's states are (p's layout, or row-major ones: Muon's)
        dense = torch.empty_like(optimizer._state_like(group, p), dtype=torch.float32,
                                 device=value.device).copy_(value)
        if f"absmax{k}" not in expected:
            out[f"state{k}"] = dense
            continue
        # the unsigned codes are those of the non-negative states (second moments),
        # which the kernels store with keep_positive
        out[f"state{k}"], absmax = _blocks.quantize_state(
            dense, group["bits"], code, group["block_size"], _blocks.state_rows(p),
            keep_positive=float(code[0]) >= 0)
        out[f"absmax{k}"] = absmax.reshape(expected[f"absmax{k}"][0])
    out.update(extra or {})
    return out


def _result(optimizer, state, groups):
    return {"state": state, "param_groups": groups,
            "memfit": {"optimizer": _name(optimizer), "format_version": _format.FORMAT_VERSION}}


def upgrade_v1(optimizer, state_dict):
    """A memfit state dict of format_version 1 (quantization blocks flat over each
    state's storage: absmax ``(ceil(n / block_size),)``, 4-bit codes ``(ceil(n / 2),)``)
    in the current row-block layout, for ``optimizer`` (of the class that saved it, or
    one of the same math): bytes unchanged where each row is a whole number of blocks
    (only shapes change), else dequantized and requantized; quantized states of 1-D
    parameters become float32 states, as they now are. ``optimizer.load_state_dict``
    calls it for you.

    >>> opt.load_state_dict(torch.load("old_checkpoint.pt")["optimizer"])  # doctest: +SKIP
    """
    _check_optimizer(optimizer)
    meta = state_dict.get("memfit") or {}
    if meta.get("format_version") != 1:
        raise _refuse(optimizer, f"expected a state dict of format_version 1, got "
                                 f"{meta.get('format_version')!r}")
    state_dict = _same_math(optimizer, state_dict)
    place = _places(optimizer, state_dict)
    saved_groups = [_checked_group(optimizer, gi, dict(sg))
                    for gi, sg in enumerate(state_dict["param_groups"])]
    unsigned = _unsigned_names(optimizer)
    state = {}
    for pid, saved in state_dict["state"].items():
        if pid not in place:
            state[pid] = saved
            continue
        gi, _, p = place[pid]
        where = _where(place[pid])
        if not isinstance(saved, dict):
            raise _refuse(optimizer, f"{where}: its state is a {type(saved).__name__}, not a dict")
        sg = saved_groups[gi]
        expected = optimizer._expected_state(sg, p)
        if not any(torch.is_tensor(saved.get(f"absmax{k}")) for k in (1, 2)):
            state[pid] = dict(saved)  # float32 states: the same in both formats
            continue
        bits, bs = sg["bits"], sg["block_size"]
        rows = _blocks.state_rows(p)
        length = _blocks.row_length(p.numel(), rows)
        flat = {k: v for k, v in saved.items() if k.startswith(("state", "absmax"))}
        for key, v in flat.items():
            problem = _tensor_problem(v)
            if problem:
                raise _refuse(optimizer, f"{where}: state {key!r} {problem}")
        if all(f"absmax{k}" in expected for k in (1, 2) if f"state{k}" in saved) \
                and length % bs == 0:
            # rows of whole blocks: the blocks, and so every byte, are those of format 1
            new = dict(saved)
            for key, v in flat.items():
                shape = expected.get(key, (None,))[0]
                if shape is None or v.numel() != math.prod(shape):
                    raise _refuse(optimizer, f"{where}: state {key!r} has {v.numel()} values, "
                                             f"which format 1 does not give it for this parameter")
                if key.startswith("absmax") or bits == 4:
                    new[key] = v.reshape(shape)
            state[pid] = new
            continue
        # format 1 is the row-block layout with one row (its flat blocks)
        local = {k: v.to(p.device) for k, v in flat.items()}
        try:
            floats = _format.dequantize_states(optimizer, sg, local, p, rows=1)
        except (KeyError, ValueError) as e:
            raise _refuse(optimizer, f"{where}: its format-1 states do not fit the parameter ({e})") \
                from None
        floats = {k: _float_state(optimizer, where, repr(k), v, p, k in unsigned)
                  for k, v in floats.items()}
        extra = {k: v for k, v in saved.items() if k == "kahan_comp"}
        if "step" not in saved:
            raise _refuse(optimizer, f"{where}: has no state 'step': the state dict is incomplete")
        state[pid] = _memfit_state(optimizer, where, {**sg, "params": []}, p, floats,
                                   saved["step"], extra)
    return _result(optimizer, state, [dict(sg) for sg in state_dict["param_groups"]])
