"""Float states under torch's names into memfit's layout (``_from_floats``): what
torch.optim's state dicts (convert._torch_optim) and bitsandbytes' dequantized ones
(convert._bitsandbytes) both end with. The param groups' hyperparameters that both name
are taken over, memfit's own stay the optimizer's (``_merged_groups``)."""

from __future__ import annotations

from memfit.optim import _core
from memfit.optim.convert._memfit import _memfit_state, _result
from memfit.optim.convert._refusals import (
    _checked_group, _decay_refusal, _float_state, _name, _places, _refuse, _step_tensor,
    _unsigned_names, _where)

# hyperparameters taken over from a foreign state dict where both name them
_SHARED_HYPER = ("lr", "betas", "eps", "weight_decay", "maximize", "momentum", "dampening",
                 "nesterov", "alpha", "ns_coefficients", "ns_steps", "adjust_lr_fn", "lr_decay",
                 "initial_accumulator_value", "t_alpha", "t_beta3")
# a group key that tells which kind of torch optimizer saved it
_KIND_MARKER = {_core.ADAMW: "eps", _core.ADAM: "eps", _core.LION: "betas",
                _core.SGD: "momentum", _core.RMSPROP: "alpha", _core.MUON: "ns_steps",
                _core.ADAGRAD: "lr_decay", _core.ADEMAMIX: "t_beta3"}
_TORCH_STATE_NAMES = {"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer",
                      "square_avg", "grad_avg", "sum", "exp_avg_slow", "step"}


def _merged_groups(optimizer, saved_groups, source):
    """The optimizer's param groups (memfit's keys included) with the hyperparameters a
    foreign state dict names taken over (``saved_groups`` under torch's keys), and the
    saved parameter ids."""
    name, kind = _name(optimizer), optimizer._kind
    out = []
    for i, (g, sg) in enumerate(zip(optimizer.param_groups, saved_groups)):
        if sg.get("amsgrad"):
            raise _refuse(optimizer, f"param_groups[{i}] of this {source} state dict uses amsgrad=True: "
                                     "memfit's Adam has no max_exp_avg_sq state to keep it in")
        if sg.get("centered"):
            raise _refuse(optimizer, f"param_groups[{i}] of this {source} state dict uses centered=True, "
                                     "which RMSprop8bit does not support")
        marker = _KIND_MARKER[kind]
        if marker not in sg or (kind == _core.LION and "eps" in sg) \
                or (kind in (_core.ADAMW, _core.ADAM, _core.ADEMAMIX) and "betas" not in sg):
            raise _refuse(optimizer, f"this state dict was not saved by a memfit optimizer, and its "
                                     f"param_groups[{i}] not by a {source} optimizer of the same kind "
                                     f"as {name} (its keys: "
                                     f"{', '.join(sorted(map(str, (k for k in sg if k != 'params'))))})")
        decoupled = sg.get("decoupled_weight_decay")
        gkind = optimizer._group_kind(g)  # LAMB's: ADAM with adam_w_mode=False (L2)
        if decoupled is not None and gkind in (_core.ADAMW, _core.ADAM) \
                and bool(decoupled) != (gkind == _core.ADAMW) and sg.get("weight_decay", 0):
            saved_by = ("a bitsandbytes Adam or AdamW (both decay decoupled)" if source == "bitsandbytes"
                        else "AdamW" if decoupled else "Adam")
            raise _decay_refusal(optimizer, f"param_groups[{i}]", bool(decoupled), saved_by, gkind)
        ng = {k: v for k, v in g.items() if k != "params"}
        for k in _SHARED_HYPER:
            if k in sg and k in ng:
                ng[k] = tuple(sg[k]) if k == "betas" and isinstance(sg[k], (list, tuple)) else sg[k]
        ng["params"] = list(sg["params"])
        out.append(_checked_group(optimizer, i, ng))
    return out


def _from_floats(optimizer, state_dict, source, labels=None):
    """from_torch, for float states under torch's names from ``source`` (torch.optim, or
    bitsandbytes' states dequantized: ``labels`` then names them in messages)."""
    name, kind = _name(optimizer), optimizer._kind
    place = _places(optimizer, state_dict)
    groups = _merged_groups(optimizer, state_dict["param_groups"], source)
    names = _core.STATE_NAMES[kind]
    unsigned = _unsigned_names(optimizer)
    state = {}
    for pid, saved in state_dict["state"].items():
        if pid not in place:
            state[pid] = saved  # not a parameter's state (check_state_ids): kept, as torch
            continue
        gi, i, p = place[pid]
        where = _where(place[pid])
        if not isinstance(saved, dict):
            raise _refuse(optimizer, f"{where}: its state is a {type(saved).__name__}, not a dict")
        for key in saved:
            if key not in _TORCH_STATE_NAMES:
                raise _refuse(optimizer, f"this state dict was not saved by a memfit optimizer, and "
                                         f"{where} has a state {key!r} that memfit cannot convert (it "
                                         f"converts torch.optim's {', '.join(names)} for {name})")
            if key != "step" and key not in names:
                raise _refuse(optimizer, f"{where}: state {key!r} cannot be converted: {name} keeps "
                                         f"{', '.join(names)} (a state dict of another optimizer, or of "
                                         "amsgrad?)")
        if "step" not in saved and not any(saved.get(nm) is not None for nm in names):
            continue  # a parameter that was never stepped
        if "step" not in saved and kind in (_core.ADAMW, _core.ADAM, _core.ADEMAMIX):
            # Adam's bias correction needs it (torch's Adam raises KeyError without)
            raise _refuse(optimizer, f"{where}: has no state 'step': the state dict is incomplete")
        floats = {k: _float_state(optimizer, where, (labels or {}).get(k, repr(k)), v, p, k in unsigned)
                  for k, v in saved.items() if k != "step" and v is not None}
        # torch's SGD (and lion-pytorch's Lion) count no steps; a momentum buffer they made
        # has seen one at least, and memfit's step 1 would overwrite SGD's with the gradient
        step = _step_tensor(optimizer, where, saved.get("step", 1 if floats else 0), p)
        state[pid] = _memfit_state(optimizer, where, groups[gi], p, floats, step)
    return _result(optimizer, state, groups)
