"""torch.optim's state dicts, both ways: ``from_torch`` (float states under torch's names,
quantized into memfit's layout, with the hyperparameters both name taken over) and
``to_torch_state_dict`` (float32 states and torch's param-group keys out). The float
states in, shared with bitsandbytes' dicts, are convert._floats'."""

from __future__ import annotations

import torch

from memfit._C import MemfitValueError
from memfit.optim import _core, _format
from memfit.optim.convert._floats import _from_floats
from memfit.optim.convert._refusals import _KIND_MATH, _check_optimizer, _name

# param-group keys that only memfit has: never exported, and kept from the optimizer
# when a foreign state dict is loaded
_MEMFIT_GROUP_KEYS = ("bits", "block_size", "min_8bit_size", "bf16_stochastic_round", "kahan",
                      "sr_seed", "sr_step", "use_muon", _format.GROUP_FORMAT_KEY)
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
def from_torch(optimizer, state_dict):
    """A memfit state dict for ``optimizer`` from a torch.optim state dict of the same
    kind (see :mod:`memfit.optim.convert`); ``optimizer.load_state_dict`` calls it for you.

    >>> sd = from_torch(memfit_opt, torch_adamw.state_dict())  # doctest: +SKIP
    """
    _check_optimizer(optimizer)
    return _from_floats(optimizer, state_dict, "torch.optim")


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
