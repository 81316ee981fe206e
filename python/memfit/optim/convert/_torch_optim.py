"""torch.optim's state dicts, both ways: ``from_torch`` (float states under torch's names,
quantized into memfit's layout, with the hyperparameters both name taken over) and
``to_torch_state_dict`` (float32 states and torch's param-group keys out)."""

from __future__ import annotations

import torch

from memfit._C import MemfitValueError
from memfit.optim import _core, _format
from memfit.optim.convert._refusals import (
    _KIND_MATH, _check_optimizer, _checked_group, _decay_refusal, _float_state, _name, _places,
    _refuse, _step_tensor, _unsigned_names, _where)
from memfit.optim.convert._memfit import _memfit_state, _result

# param-group keys that only memfit has: never exported, and kept from the optimizer
# when a foreign state dict is loaded
_MEMFIT_GROUP_KEYS = ("bits", "block_size", "min_8bit_size", "bf16_stochastic_round", "kahan",
                      "sr_seed", "sr_step", "use_muon", _format.GROUP_FORMAT_KEY)
# hyperparameters taken over from a foreign state dict where both name them
_SHARED_HYPER = ("lr", "betas", "eps", "weight_decay", "maximize", "momentum", "dampening",
                 "nesterov", "alpha", "ns_coefficients", "ns_steps", "adjust_lr_fn", "lr_decay",
                 "initial_accumulator_value", "t_alpha", "t_beta3")
# torch.optim's own group keys for each kind, with the values memfit's behaviour matches
_TORCH_GROUP_DEFAULTS = {
    _core.ADAMW: dict(amsgrad=False, foreach=None, capturable=False, differentiable=False,
                      fused=None, decoupled_weight_decay=True),
    _core.ADAM: dict(amsgrad=False, foreach=None, capturable=False, differentiable=False,
                     fused=None, decoupled_weight_decay=False),
    _core.SGD: dict(foreach=None, differentiable=False, fused=None),
    _core.RMSPROP: dict(centered=False, capturable=False, foreach=None, differentiable=False),
    _core.LION: {},
    _core.MUON: {},
    _core.ADAGRAD: dict(foreach=None, differentiable=False, fused=None),
    # torch has no AdEMAMix: the export keeps bitsandbytes' (and memfit's) keys only
    _core.ADEMAMIX: {},
}
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


def from_torch(optimizer, state_dict):
    """A memfit state dict for ``optimizer`` from a torch.optim state dict of the same
    kind (see :mod:`memfit.optim.convert`); ``optimizer.load_state_dict`` calls it for you.

    >>> sd = from_torch(memfit_opt, torch_adamw.state_dict())  # doctest: +SKIP
    """
    _check_optimizer(optimizer)
    return _from_floats(optimizer, state_dict, "torch.optim")


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


def to_torch_state_dict(optimizer) -> dict:
    """``optimizer``'s state as a torch.optim state dict: float32 states under torch's
    names (``exp_avg``/``exp_avg_sq`` for Adam and AdamW, ``momentum_buffer`` for SGD,
    ``square_avg``/``momentum_buffer`` for RMSprop, ``sum`` for Adagrad, ``exp_avg`` for
    Lion as lion-pytorch names it), the float32 ``step``, and param groups with torch's
    keys (memfit's own, such as bits and block_size, left out), for the torch optimizer
    of the same kind to load (Adagrad's parameters not stepped yet get torch's initial state, which its step
    needs). torch has no AdEMAMix: for AdEMAMix8bit/AdEMAMix the same float32 dict
    (``exp_avg``, ``exp_avg_sq``, ``exp_avg_slow``, ``step``; groups with lr, betas, alpha,
    t_alpha, t_beta3, eps, weight_decay, maximize), which any AdEMAMix class of memfit
    loads back. Quantized states are dequantized exactly (:func:`memfit.optim.dequantized_state`);
    a Kahan compensation buffer is dropped (the parameter keeps its rounded value).

    >>> t = torch.optim.AdamW(model.parameters())  # doctest: +SKIP
    >>> t.load_state_dict(memfit.optim.to_torch_state_dict(opt))  # doctest: +SKIP
    """
    _check_optimizer(optimizer)
    optimizer._check_saveable("nothing was exported")
    adam = {_core.ADAM, _core.ADAMW}  # one torch.optim.Adam/AdamW dict holds both decays
    for gi, g in enumerate(optimizer.param_groups):
        if optimizer._group_kind(g) != optimizer._kind \
                and not {optimizer._group_kind(g), optimizer._kind} <= adam:
            raise MemfitValueError(
                f"to_torch_state_dict: param_groups[{gi}] of {_name(optimizer)} is stepped by "
                f"{_KIND_MATH[optimizer._group_kind(g)]} (use_muon=False), and one torch "
                f"optimizer ({_KIND_MATH[optimizer._kind]}) cannot hold it; export an optimizer "
                "of Muon groups only")
    index, groups, state = {}, [], {}
    for g in optimizer.param_groups:
        tg = {k: v for k, v in g.items() if k != "params" and k not in _MEMFIT_GROUP_KEYS}
        # per group: LAMB's adam_w_mode=False groups are Adam's (decoupled_weight_decay=False)
        for k, v in _TORCH_GROUP_DEFAULTS[optimizer._group_kind(g)].items():
            tg.setdefault(k, v)
        ids = []
        for p in g["params"]:
            pid = index.setdefault(id(p), len(index))
            ids.append(pid)
            st = optimizer.state.get(p)
            if not st:
                if optimizer._kind == _core.ADAGRAD:
                    # torch's Adagrad makes every parameter's state in its constructor, and
                    # its step needs it: the state memfit's would start from
                    state[pid] = {"step": torch.tensor(0.0), "sum": torch.full_like(
                        p, float(g["initial_accumulator_value"]), dtype=torch.float32)}
                continue
            floats = _format.dequantized_state(optimizer, p)
            floats.pop("kahan_comp", None)
            # torch's SGD and Muon keep no step count
            state[pid] = ({} if optimizer._kind in (_core.SGD, _core.MUON)
                          else {"step": st["step"].detach().clone()})
            state[pid].update(floats)
        tg["params"] = ids
        groups.append(tg)
    return {"state": state, "param_groups": groups}
