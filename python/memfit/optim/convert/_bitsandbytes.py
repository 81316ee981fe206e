"""bitsandbytes' state dicts: 8-bit block-wise and 32-bit ``state1``/``state2`` with their
``absmax``/``qmap`` checked and dequantized (AdEMAMix's ``state1`` stacks its two EMAs),
param groups mapped as memfit.optim.bnb maps bitsandbytes' arguments, then loaded as
torch.optim's float states are (``_from_floats``)."""

from __future__ import annotations

import math
import numbers

import torch

from memfit.optim import _blocks, _core
from memfit.optim.convert._refusals import _check_optimizer, _name, _places, _refuse, _tensor_problem, _where
from memfit.optim.convert._floats import _from_floats

_BNB_STATE_KEYS = {"state1", "state2", "absmax1", "absmax2", "qmap1", "qmap2", "step",
                   "gnorm_vec", "unorm_vec"}
# where bitsandbytes' state_dict() nests the quantized states (hidden from FSDP's gather)
_BNB_WRAPPED = "__bnb_optimizer_quant_state__"


# bitsandbytes' param groups (0.50.2): every optimizer's, and the AdEMAMix options that
# its two-state optimizers (Adam, AdamW, ...) add to theirs (0 and None for Adam)
_BNB_GROUP_KEYS = ("lr", "betas", "eps", "weight_decay")
_BNB_ADEMAMIX_KEYS = ("alpha", "t_alpha", "t_beta3")
_ADEMAMIX_HINT = "load it into memfit.optim.AdEMAMix8bit or AdEMAMix"


def bnb_schedule_steps(value):
    """AdEMAMix's ``t_alpha`` / ``t_beta3`` as bitsandbytes reads them: from 0.49.2 on
    (``if t_alpha:``) a 0 means no scheduler, memfit's None (0.49.0 and 0.49.1 divided by
    it at the first step). Any other value is passed on to memfit's own check."""
    zero = isinstance(value, numbers.Real) and not isinstance(value, bool) and value == 0
    return None if zero else value


def _bnb_groups(optimizer, saved_groups, two_state):
    """bitsandbytes' param groups under torch's keys for ``optimizer``'s kind, as the
    shim's constructors map bitsandbytes' arguments (memfit.optim.bnb): one-state groups
    keep (momentum, dampening) (SGD) and (alpha, momentum) (RMSprop) in ``betas`` and
    Lion's and SGD's an unused eps. ``two_state``: Adam, AdamW (decoupled weight decay,
    both) or AdEMAMix (three betas), else Lion, SGD, RMSprop or Adagrad, whichever
    ``optimizer`` is."""
    name, kind = _name(optimizer), optimizer._kind
    names = _core.STATE_NAMES[kind]
    adam = kind in (_core.ADAMW, _core.ADAM)
    ademamix = kind == _core.ADEMAMIX
    if two_state != (adam or ademamix):
        raise _refuse(optimizer, "this bitsandbytes state dict keeps "
                                 + ("two states per parameter (state1, state2: bitsandbytes' Adam, "
                                    "AdamW or AdEMAMix)" if two_state else "one state per parameter "
                                    "(state1: bitsandbytes' Lion, SGD, RMSprop or Adagrad)")
                                 + f", but {name} keeps {', '.join(names)}: load it into a memfit "
                                   "optimizer of the same kind")
    out = []
    for gi, sg in enumerate(saved_groups):
        missing = [k for k in _BNB_GROUP_KEYS if k not in sg]
        if missing:
            raise _refuse(optimizer, f"param_groups[{gi}] has no {', '.join(missing)}: not a "
                                     "bitsandbytes optimizer's param group")
        betas = sg["betas"]
        nbetas = 3 if ademamix else 2
        if not isinstance(betas, (list, tuple)) or len(betas) != nbetas:
            listed = isinstance(betas, (list, tuple))
            raise _refuse(optimizer, f"param_groups[{gi}]['betas'] is {betas!r}, not "
                                     + ("three betas (beta1, beta2, beta3)" if ademamix else "a pair")
                                     + (f" (three betas: bitsandbytes' AdEMAMix; {_ADEMAMIX_HINT})"
                                        if listed and len(betas) == 3 else
                                        " (two betas: bitsandbytes' Adam or AdamW; load it into "
                                        "memfit.optim.AdamW8bit or AdamW)" if ademamix and listed
                                        and len(betas) == 2 else ""))
        if not ademamix and (sg.get("alpha") or sg.get("t_alpha") is not None
                             or sg.get("t_beta3") is not None):
            raise _refuse(optimizer, f"param_groups[{gi}] sets AdEMAMix's alpha, t_alpha or t_beta3 "
                                     f"(bitsandbytes' AdEMAMix): {_ADEMAMIX_HINT}")
        b0, b1 = betas[:2]
        common = dict(lr=sg["lr"], weight_decay=sg["weight_decay"], params=sg["params"])
        out.append({
            _core.ADAMW: dict(betas=betas, eps=sg["eps"], decoupled_weight_decay=True),
            _core.ADAM: dict(betas=betas, eps=sg["eps"], decoupled_weight_decay=True),
            _core.LION: dict(betas=betas),
            _core.SGD: dict(momentum=b0, dampening=b1),
            _core.RMSPROP: dict(alpha=b0, momentum=b1, eps=sg["eps"]),
            # bitsandbytes' Adagrad has neither (it refuses both), so its state is torch's
            _core.ADAGRAD: dict(eps=sg["eps"], lr_decay=0.0, initial_accumulator_value=0.0),
            # bitsandbytes' AdEMAMix groups always hold these (its constructor's defaults)
            _core.ADEMAMIX: dict(betas=betas, eps=sg["eps"], alpha=sg.get("alpha", 5.0),
                                 t_alpha=bnb_schedule_steps(sg.get("t_alpha")),
                                 t_beta3=bnb_schedule_steps(sg.get("t_beta3"))),
        }[kind] | common)
    return out


def from_bitsandbytes(optimizer, state_dict, block_size=None):
    """A memfit state dict for ``optimizer`` from a bitsandbytes optimizer's state dict
    (8-bit block-wise or 32-bit states: ``state1``/``state2`` are torch's first/second
    states, dequantized as ``qmap[code] * absmax[block]``); ``optimizer.load_state_dict``
    calls it for you. Adam and AdamW (two states) load into memfit's AdamW classes (and
    into Adam ones without weight decay: bitsandbytes' decays decoupled); Lion, SGD,
    RMSprop and Adagrad (one state) into Lion8bit, SGD8bit, RMSprop8bit and Adagrad8bit,
    AdEMAMix (``state1`` of shape ``(2, *p.shape)``: exp_avg, exp_avg_slow) into
    AdEMAMix8bit/AdEMAMix, their hyperparameters
    mapped as memfit.optim.bnb maps bitsandbytes' arguments (RMSprop's ``momentum``
    acts from the load on, with a buffer that starts at zero as torch's). ``block_size``:
    bitsandbytes' block size, by default found from the number of absmax values (exact:
    two block sizes that give the same count give the same blocks).

    >>> opt.load_state_dict(bnb_adamw8bit.state_dict())  # doctest: +SKIP
    """
    _check_optimizer(optimizer)
    kind = optimizer._kind
    names = _core.STATE_NAMES[kind]
    signed = _core.state_layout(kind, 8, 256, 0, 0.5)["signed"]
    place = _places(optimizer, state_dict)
    unwrapped = {}
    for pid, saved in state_dict["state"].items():
        if pid not in place:
            unwrapped[pid] = saved
            continue
        where = _where(place[pid])
        inner = saved.get(_BNB_WRAPPED, {}) if isinstance(saved, dict) else None
        if not isinstance(inner, dict):
            raise _refuse(optimizer, f"{where}: its state is a {type(saved).__name__}, not a dict"
                          if inner is None else f"{where}: its {_BNB_WRAPPED!r} is a "
                          f"{type(inner).__name__}, not a dict")
        saved = {**{k: v for k, v in saved.items() if k != _BNB_WRAPPED}, **inner}
        unknown = sorted(map(str, set(saved) - _BNB_STATE_KEYS))
        if unknown:
            raise _refuse(optimizer, f"{where}: bitsandbytes state {unknown[0]!r} cannot be converted "
                                     "(only block-wise 8-bit and 32-bit states)")
        unwrapped[pid] = saved
    stepped = [s for pid, s in unwrapped.items() if pid in place and s]
    if stepped:
        kinds = {"state2" in s for s in stepped}
        if len(kinds) > 1:
            raise _refuse(optimizer, "some parameters have one bitsandbytes state, others two: not one "
                                     "optimizer's state dict")
        two_state = kinds.pop()
    else:  # nothing stepped: Adam's groups say so since AdEMAMix joined them (0.44)
        two_state = kind in (_core.ADAMW, _core.ADAM, _core.ADEMAMIX) or any(
            k in sg for sg in state_dict["param_groups"] for k in _BNB_ADEMAMIX_KEYS)
    groups = _bnb_groups(optimizer, state_dict["param_groups"], two_state)
    labels = {nm: f"'state{k}' ({nm})" for k, nm in enumerate(names, start=1)}
    if kind == _core.ADEMAMIX:  # bitsandbytes stacks m1 and m2 in state1, m1 first
        labels.update(exp_avg="'state1'[0] (exp_avg)", exp_avg_slow="'state1'[1] (exp_avg_slow)")
    converted = {}
    for pid, saved in unwrapped.items():
        if pid not in place or not saved:
            converted[pid] = saved
            continue
        gi, _, p = place[pid]
        where = _where(place[pid])
        out = {"step": saved["step"]} if "step" in saved else {}
        for k in (1, 2) if two_state else (1,):
            s = saved.get(f"state{k}")
            if s is None:
                raise _refuse(optimizer, f"{where}: has no bitsandbytes state{k}: the state dict is "
                                         "incomplete")
            absmax = saved.get(f"absmax{k}")
            if kind == _core.ADEMAMIX and k == 1:
                # bitsandbytes' AdEMAMix keeps m1 and m2 as state1 (2, *shape), each half
                # quantized with its own row of absmax1 (2, blocks)
                if not torch.is_tensor(s) or tuple(s.shape) != (2, *p.shape):
                    raise _refuse(optimizer, f"{where}: state1 of bitsandbytes' AdEMAMix (exp_avg and "
                                             f"exp_avg_slow stacked) has shape "
                                             f"{tuple(getattr(s, 'shape', ()))}, expected "
                                             f"{(2, *p.shape)}")
                uint8 = s.dtype == torch.uint8
                if uint8 and not (torch.is_tensor(absmax) and absmax.dim() == 2 and absmax.shape[0] == 2):
                    raise _refuse(optimizer, f"{where}: 8-bit state1 of bitsandbytes' AdEMAMix needs "
                                             "absmax1 of shape (2, blocks), one row per stacked state")
                for half, j in ((0, 0), (1, 2)):
                    out[names[j]] = (_bnb_dequantize(optimizer, where, k, names[j], signed[j], s[half], p,
                                                     absmax[half], saved.get("qmap1"), block_size)
                                     if uint8 else s[half])
                continue
            if torch.is_tensor(s) and s.dtype == torch.uint8:
                s = _bnb_dequantize(optimizer, where, k, names[k - 1], signed[k - 1], s, p,
                                    absmax, saved.get(f"qmap{k}"), block_size,
                                    any_code=not two_state)
            out[names[k - 1]] = s
        momentum = groups[gi].get("momentum", 0)
        if kind == _core.RMSPROP and isinstance(momentum, numbers.Real) and momentum > 0:
            # bitsandbytes' RMSprop keeps no momentum buffer (its kernel ignores momentum);
            # memfit's starts at zero, as torch's RMSprop's does
            out["momentum_buffer"] = torch.zeros(p.shape, dtype=torch.float32)
        converted[pid] = out
    return _from_floats(optimizer, {"state": converted, "param_groups": groups}, "bitsandbytes",
                        labels)


def _bnb_dequantize(optimizer, where, k, nm, signed, codes, p, absmax, qmap, block_size,
                    any_code=False):
    """float32 values of bitsandbytes' 8-bit state{k} (torch's ``nm``) of p, after its
    absmax{k} and qmap{k} are checked: finite, absmax >= 0, qmap within [-1, 1] and
    signed (negative entries) exactly where the state is (a first moment's). With
    ``any_code`` (the state of a one-state optimizer: bitsandbytes' Optimizer1State
    quantizes state1 with the signed map whatever it holds, RMSprop's and Adagrad's
    second moments too) a second moment may come in either code: its values are read
    with the dict's own, and a negative one is refused afterwards (_float_state)."""
    for key, t in ((f"absmax{k}", absmax), (f"qmap{k}", qmap)):
        problem = _tensor_problem(t) if t is not None else "is missing"
        if not problem and not t.is_floating_point():
            problem = f"is {t.dtype}, not a float tensor"
        if problem:
            raise _refuse(optimizer, f"{where}: 8-bit state{k} needs {key}, which {problem} (not a "
                                     "block-wise bitsandbytes state)")
    problem = _tensor_problem(codes)
    if problem:
        raise _refuse(optimizer, f"{where}: state{k} {problem}")
    if tuple(codes.shape) != tuple(p.shape):
        raise _refuse(optimizer, f"{where}: state{k} has shape {tuple(codes.shape)}, not the parameter's: "
                                 "the state dict was saved for a different model")
    n, nblocks = codes.numel(), absmax.numel()
    if block_size is None:
        sizes = [b for b in _core.BLOCK_SIZES if -(-n // b) == nblocks]
        if not sizes:
            raise _refuse(optimizer, f"{where}: absmax{k} has {nblocks} values, which no block size "
                                     f"gives for {n} elements")
        block_size = sizes[0]
    if qmap.numel() != 256:
        raise _refuse(optimizer, f"{where}: qmap{k} has {qmap.numel()} values, expected 256")
    absmax = absmax.detach().float().cpu().reshape(-1)
    qmap = qmap.detach().float().cpu().reshape(-1)
    if not bool(((absmax >= 0) & (absmax < math.inf)).all()):
        raise _refuse(optimizer, f"{where}: absmax{k} holds NaN, Inf or negative block scales: the "
                                 "state dict is corrupt")
    if not bool((qmap.abs() <= 1).all()):  # False for NaN
        raise _refuse(optimizer, f"{where}: qmap{k} holds NaN or values outside [-1, 1]: not a "
                                 "bitsandbytes code; the state dict is corrupt")
    if bool((qmap < 0).any()) != signed and not (any_code and not signed):
        raise _refuse(optimizer, f"{where}: qmap{k} is "
                                 + (f"an unsigned code, but state{k} ({nm}) is signed" if signed else
                                    f"a signed code, but state{k} ({nm}) is a second moment (>= 0)")
                                 + " (qmap1 and qmap2 swapped?): the state dict is corrupt")
    codes = codes.detach().cpu().contiguous()
    # bitsandbytes' blocks are flat over the state: format 1's layout, one row
    return _blocks.dequantize_state(codes, absmax, 8, qmap, block_size, codes, rows=1)
