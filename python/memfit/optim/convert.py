"""State-dict conversion: switch between memfit's optimizers and torch.optim's (or
bitsandbytes') mid-training, and load memfit checkpoints of an older format.

- ``memfit_optimizer.load_state_dict(sd)`` takes, besides its own state dicts:

  - a ``torch.optim`` state dict of the same kind (``torch.optim.AdamW``/``Adam`` for
    memfit's AdamW/Adam/AdamW8bit/Adam8bit/AdamW4bit, ``SGD`` for SGD8bit, ``RMSprop``
    for RMSprop8bit, ``Adagrad`` for Adagrad8bit/Adagrad, lion-pytorch's ``Lion`` for
    Lion8bit; torch has no AdEMAMix, so for AdEMAMix8bit/AdEMAMix the dict
    :func:`to_torch_state_dict` exported): its float states are
    quantized into memfit's layout, and the param groups' hyperparameters that both
    name (lr, betas, eps, weight_decay, maximize, momentum, ...) are taken over, while
    memfit's own (bits, block_size, min_8bit_size, ...) stay the optimizer's;
  - a bitsandbytes 8-bit (block-wise) or 32-bit state dict (``state1``/``state2``,
    ``absmax1``/``absmax2``, ``qmap1``/``qmap2``) of AdamW, Lion, SGD, RMSprop, Adagrad or
    AdEMAMix (whose ``state1`` stacks its two EMAs), dequantized with its own code and
    block size and requantized;
  - a memfit state dict of format_version 1 (:func:`upgrade_v1`), or one saved by
    another memfit class of the same math and bits (a memfit.optim.bnb shim's).

  What cannot be converted is refused, before anything is quantized, with a
  MemfitValueError naming ``param_groups[g]['params'][i]``: amsgrad's
  ``max_exp_avg_sq``, another optimizer's states, other shapes, NaN or Inf values,
  negative second moments, corrupt bitsandbytes absmax or qmap, states of ids no param
  group lists (docs/optim.md, "State dicts of other optimizers").
- :func:`to_torch_state_dict` exports float32 states under torch's names with torch's
  param-group keys, for ``torch.optim.AdamW(...).load_state_dict()``.

    >>> import torch, memfit.optim as mo  # doctest: +SKIP
    >>> opt = mo.AdamW8bit(model.parameters())  # doctest: +SKIP
    >>> ...  # train  # doctest: +SKIP
    >>> t = torch.optim.AdamW(model.parameters())  # doctest: +SKIP
    >>> t.load_state_dict(mo.to_torch_state_dict(opt))  # go on with torch's AdamW  # doctest: +SKIP
    >>> opt.load_state_dict(t.state_dict())  # ... and back to 8-bit states  # doctest: +SKIP

Converting quantizes (float states into 8- or 4-bit) or dequantizes: each value moves
by at most half a code step of its block (the states' own quantization error); float32
states and the step count go across exactly.
"""

from __future__ import annotations

import math
import numbers

import torch

from memfit._C import MemfitValueError
from memfit.optim import _blocks, _checks, _core, _format

__all__ = ["from_bitsandbytes", "from_torch", "to_current", "to_torch_state_dict", "upgrade_v1"]

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
_BNB_STATE_KEYS = {"state1", "state2", "absmax1", "absmax2", "qmap1", "qmap2", "step",
                   "gnorm_vec", "unorm_vec"}
# where bitsandbytes' state_dict() nests the quantized states (hidden from FSDP's gather)
_BNB_WRAPPED = "__bnb_optimizer_quant_state__"


# bitsandbytes' param groups (0.50.2): every optimizer's, and the AdEMAMix options that
# its two-state optimizers (Adam, AdamW, ...) add to theirs (0 and None for Adam)
_BNB_GROUP_KEYS = ("lr", "betas", "eps", "weight_decay")
_BNB_ADEMAMIX_KEYS = ("alpha", "t_alpha", "t_beta3")
_ADEMAMIX_HINT = "load it into memfit.optim.AdEMAMix8bit or AdEMAMix"
# the math of each kind, in the words of the refusals
_KIND_MATH = {_core.ADAMW: "AdamW (decoupled weight decay)", _core.ADAM: "Adam (L2 weight decay)",
              _core.LION: "Lion", _core.SGD: "SGD", _core.RMSPROP: "RMSprop", _core.MUON: "Muon",
              _core.ADAGRAD: "Adagrad", _core.ADEMAMIX: "AdEMAMix"}


def _name(optimizer) -> str:
    return type(optimizer).__name__


_check_optimizer = _format.check_optimizer


def _refuse(optimizer, what) -> MemfitValueError:
    """The refusal of a state dict: every one is a MemfitValueError (docs/optim.md)."""
    return MemfitValueError(f"{_name(optimizer)}.load_state_dict: {what}; nothing was loaded")


def record_name(optimizer) -> str:
    """The name under which ``state_dict()`` records the class of ``optimizer`` (an
    optimizer or its class): the class name, ``bnb.``-prefixed for the classes of
    memfit.optim.bnb, whose ``Adam``, ``Adam8bit`` and ``AdamW`` share their names with
    memfit's own classes but not always their math (bitsandbytes' Adam decays decoupled)."""
    cls = optimizer if isinstance(optimizer, type) else type(optimizer)
    return ("bnb." if cls.__module__ == "memfit.optim.bnb" else "") + cls.__name__


def _saver_classes() -> dict:
    """{recorded name: class} of every class that can have saved a memfit state dict:
    memfit.optim's, and memfit.optim.bnb's under their record_name and, for dicts they
    saved before it was recorded, under their bare name where memfit.optim has none."""
    # here: these import _torch, which imports this module
    from memfit.optim import bnb, muon, optimizers
    out = {n: getattr(optimizers, n) for n in optimizers.__all__}
    out.update((n, getattr(muon, n)) for n in ("Muon", "Muon8bit"))
    for n in bnb.__all__:
        cls = getattr(bnb, n)
        if isinstance(cls, type) and issubclass(cls, _format.MemfitOptimizerBase):
            out[record_name(cls)] = cls
            out.setdefault(n, cls)
    return out


def _qualified(saver) -> str:
    return f"memfit.optim.{saver}" if isinstance(saver, str) else repr(saver)


def _decay_refusal(optimizer, where, decoupled, saved_by) -> MemfitValueError:
    """The refusal of Adam states saved with weight decay of the other meaning (decoupled
    or L2), with the memfit class that applies it as the saver did."""
    name = _name(optimizer)
    bits = optimizer.param_groups[0]["bits"] if optimizer.param_groups else 8
    cls = ({8: "AdamW8bit", 4: "AdamW4bit", 32: "AdamW"} if decoupled
           else {32: "Adam"}).get(bits, "AdamW8bit" if decoupled else "Adam8bit")
    return _refuse(optimizer, f"{where} was saved by {saved_by} with weight decay; {name} applies "
                              f"weight decay {'as L2' if optimizer._kind == _core.ADAM else 'decoupled'}, "
                              f"which would change its meaning: load it into memfit.optim.{cls} instead")


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
        cls = _saver_classes().get(saver) if isinstance(saver, str) else None
        if cls is None:
            raise _refuse(optimizer, f"the state dict was saved by {_qualified(saver)}, which is not a "
                                     f"memfit optimizer class; load a state dict saved by {name} or "
                                     "by a memfit class of the same math")
        saved_groups = state_dict["param_groups"]
        if cls._kind != optimizer._kind:
            if {cls._kind, optimizer._kind} != {_core.ADAM, _core.ADAMW}:
                raise _refuse(optimizer, f"the state dict was saved by {_qualified(saver)}, which does "
                                         f"{_KIND_MATH[cls._kind]}, and {name} does "
                                         f"{_KIND_MATH[optimizer._kind]}")
            for gi, sg in enumerate(saved_groups):  # Adam and AdamW agree without decay
                if sg.get("weight_decay"):
                    raise _decay_refusal(optimizer, f"param_groups[{gi}]", cls._kind == _core.ADAMW,
                                         _qualified(saver))
            # ... and then the saved flag of the decay's meaning becomes this class's
            fixed = {k: v for k, v, _ in optimizer._fixed_options if k == "decoupled_weight_decay"}
            saved_groups = [{**sg, **fixed} if "decoupled_weight_decay" in sg else sg
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


def to_current(optimizer, state_dict):
    """``state_dict`` as ``optimizer.load_state_dict`` loads it: a memfit state dict of
    the current format, converted from an older memfit format, from torch.optim or from
    bitsandbytes where it is one of those; anything else is returned unchanged (and
    load_state_dict refuses it). A memfit state dict saved by another class (a
    memfit.optim.bnb shim's, say) is taken where that class does the same math."""
    _check_optimizer(optimizer)
    if not isinstance(state_dict, dict) or not isinstance(state_dict.get("param_groups"), list) \
            or not isinstance(state_dict.get("state"), dict) \
            or not all(isinstance(g, dict) and "params" in g for g in state_dict["param_groups"]):
        return state_dict
    # memfit's own, also after torch.distributed.checkpoint's get_state_dict (which keeps
    # only "state" and "param_groups"; every group then carries the format)
    _, version = _format.saved_format(state_dict)
    if version is not None:
        state_dict = _same_math(optimizer, state_dict)
        return upgrade_v1(optimizer, state_dict) if version == 1 else state_dict
    keys = set()
    for saved in state_dict["state"].values():
        if isinstance(saved, dict):
            keys.update(saved)
    groups = state_dict["param_groups"]
    if keys & {"state1", "qmap1", _BNB_WRAPPED} or (
            not keys and groups and all(set(g) - {"params"} <= {*_BNB_GROUP_KEYS, *_BNB_ADEMAMIX_KEYS}
                                        and set(_BNB_GROUP_KEYS) <= set(g) for g in groups)):
        return from_bitsandbytes(optimizer, state_dict)
    return from_torch(optimizer, state_dict)


# -- checks every conversion makes ------------------------------------------------------------

def check_state_ids(name, state_dict, ids, state_keys=None) -> None:
    """Refuses (MemfitValueError) a state dict whose ``state`` holds a parameter's state
    under a key that no param group lists (``ids``: the listed ids): it would be
    dropped without a word. String keys after a JSON round trip and renumbered ids are
    the usual causes. A parameter's state is a dict: any dict, or with ``state_keys``
    one holding one of those keys (memfit's own dicts, whose states have known keys).
    Other values under unlisted keys are kept, as torch keeps them.
    ``name``: the optimizer class, for the message."""
    for key, value in state_dict["state"].items():
        if key in ids or not isinstance(value, dict):
            continue
        if state_keys is not None and not any(k in value for k in state_keys):
            continue
        listed = sorted((i for i in ids if isinstance(i, int)), key=int)
        shown = (f"{listed[0]}..{listed[-1]}" if listed and listed == list(range(listed[0], listed[-1] + 1))
                 else ", ".join(map(repr, listed[:8])) + (", ..." if len(listed) > 8 else ""))
        if isinstance(key, str) and key.strip().isdigit() and int(key) in ids:
            hint = ("its ids became strings (a JSON round trip?): turn the keys of 'state' back "
                    "into ints, {int(k): v for k, v in sd['state'].items()}")
        else:
            hint = ("the ids of 'state' and of 'param_groups' do not match (renumbered, or from "
                    "another state dict)")
        raise MemfitValueError(f"{name}.load_state_dict: state[{key!r}] is a parameter's state, but "
                               f"no param group lists the id {key!r} (they list {shown or 'none'}): "
                               f"{hint}; nothing was loaded")


def _places(optimizer, state_dict) -> dict:
    """{saved parameter id: (group index, index in the group, the optimizer's parameter)},
    after the checks torch makes (as many groups, of the same sizes) and check_state_ids."""
    groups, saved_groups = optimizer.param_groups, state_dict["param_groups"]
    if len(groups) != len(saved_groups):
        raise _refuse(optimizer, "loaded state dict has a different number of parameter groups "
                                 f"({len(saved_groups)}, the optimizer {len(groups)})")
    place = {}
    for gi, (g, sg) in enumerate(zip(groups, saved_groups)):
        ids = sg["params"]
        if not isinstance(ids, (list, tuple)) or not all(
                isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise _refuse(optimizer, f"param_groups[{gi}]['params'] is {ids!r}, not a list of "
                                     "parameter ids (ints)")
        if len(ids) != len(g["params"]):
            raise _refuse(optimizer, "loaded state dict contains a parameter group that doesn't match "
                                     f"the size of optimizer's group (param_groups[{gi}]: {len(ids)} "
                                     f"parameters, the optimizer's {len(g['params'])})")
        for i, (pid, p) in enumerate(zip(ids, g["params"])):
            place[pid] = (gi, i, p)
    check_state_ids(_name(optimizer), state_dict, place)
    return place


def _where(place) -> str:
    gi, i, p = place
    return f"param_groups[{gi}]['params'][{i}] (shape {tuple(p.shape)})"


def _tensor_problem(value) -> str:
    """Why ``value`` holds no values memfit can read ("" if it does)."""
    if not torch.is_tensor(value):
        return f"is a {type(value).__name__}, not a tensor"
    if value.layout != torch.strided:
        return f"is a {value.layout} tensor, not a dense one"
    if value.device.type == "meta":
        return "is a meta tensor (it has no values)"
    return ""


def _unsigned_names(optimizer) -> set:
    """torch's names of the states of ``optimizer``'s kind that are >= 0 (second moments)."""
    signed = _core.state_layout(optimizer._kind, 8, 256, 0, 0.5)["signed"]
    return {nm for nm, s in zip(_core.STATE_NAMES[optimizer._kind], signed) if not s}


def _float_state(optimizer, where, label, value, p, non_negative):
    """A foreign float state as float32 on p's device, checked: a dense float tensor of
    p's shape, finite, and >= 0 for a second moment (a negative one would quantize to 0
    beside a non-zero first moment: the next step would divide by eps)."""
    problem = _tensor_problem(value)
    if not problem and not value.is_floating_point():
        problem = f"is {value.dtype}, not a float tensor"
    if problem:
        raise _refuse(optimizer, f"{where}: state {label} {problem}")
    if tuple(value.shape) != tuple(p.shape):
        raise _refuse(optimizer, f"{where}: state {label} has shape {tuple(value.shape)}, not the "
                                 "parameter's: the state dict was saved for a different model")
    value = value.detach().to(device=p.device, dtype=torch.float32)
    if not bool(torch.isfinite(value).all()):
        raise _refuse(optimizer, f"{where}: state {label} holds NaN or Inf values: the state dict "
                                 "is corrupt")
    if non_negative and bool((value < 0).any()):
        raise _refuse(optimizer, f"{where}: state {label} holds negative values, but it is a second "
                                 "moment (a mean of squares, >= 0): the state dict is corrupt")
    return value


def _step_tensor(optimizer, where, step, p):
    """A foreign step count as memfit keeps it: a float32 scalar on p's device."""
    if torch.is_tensor(step):
        problem = _tensor_problem(step)
        if problem or step.numel() != 1:
            raise _refuse(optimizer, f"{where}: state 'step' "
                                     f"{problem or f'has {step.numel()} values, not one'}")
        step = step.item()
    if isinstance(step, bool) or not isinstance(step, numbers.Real) \
            or not (math.isfinite(step) and step >= 0 and step == math.floor(step)):
        raise _refuse(optimizer, f"{where}: state 'step' ({step!r}) is not a whole number of steps "
                                 ">= 0: the state dict is corrupt")
    return torch.tensor(float(step), dtype=torch.float32, device=p.device)


def _checked_group(optimizer, gi, group) -> dict:
    """``group`` (a param group about to be loaded), if this optimizer takes its values."""
    where = f"param_groups[{gi}] of the state dict"
    try:
        _checks.check_group(optimizer, group, where)
    except KeyError as e:
        raise _refuse(optimizer, f"{where} has no {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        raise _refuse(optimizer, str(e)) from None
    return group


# -- foreign state dicts -------------------------------------------------------------------

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
        if decoupled is not None and kind in (_core.ADAMW, _core.ADAM) \
                and bool(decoupled) != (kind == _core.ADAMW) and sg.get("weight_decay", 0):
            saved_by = ("a bitsandbytes Adam or AdamW (both decay decoupled)" if source == "bitsandbytes"
                        else "AdamW" if decoupled else "Adam")
            raise _decay_refusal(optimizer, f"param_groups[{i}]", bool(decoupled), saved_by)
        ng = {k: v for k, v in g.items() if k != "params"}
        for k in _SHARED_HYPER:
            if k in sg and k in ng:
                ng[k] = tuple(sg[k]) if k == "betas" and isinstance(sg[k], (list, tuple)) else sg[k]
        ng["params"] = list(sg["params"])
        out.append(_checked_group(optimizer, i, ng))
    return out


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
        dense = torch.empty_like(p, dtype=torch.float32, device=value.device).copy_(value)
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


def from_torch(optimizer, state_dict):
    """A memfit state dict for ``optimizer`` from a torch.optim state dict of the same
    kind (see the module docstring); ``optimizer.load_state_dict`` calls it for you.

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
                                 t_alpha=sg.get("t_alpha"), t_beta3=sg.get("t_beta3")),
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
                                    absmax, saved.get(f"qmap{k}"), block_size)
            out[names[k - 1]] = s
        momentum = groups[gi].get("momentum", 0)
        if kind == _core.RMSPROP and isinstance(momentum, numbers.Real) and momentum > 0:
            # bitsandbytes' RMSprop keeps no momentum buffer (its kernel ignores momentum);
            # memfit's starts at zero, as torch's RMSprop's does
            out["momentum_buffer"] = torch.zeros(p.shape, dtype=torch.float32)
        converted[pid] = out
    return _from_floats(optimizer, {"state": converted, "param_groups": groups}, "bitsandbytes",
                        labels)


def _bnb_dequantize(optimizer, where, k, nm, signed, codes, p, absmax, qmap, block_size):
    """float32 values of bitsandbytes' 8-bit state{k} (torch's ``nm``) of p, after its
    absmax{k} and qmap{k} are checked: finite, absmax >= 0, qmap within [-1, 1] and
    signed (negative entries) exactly where the state is (a first moment's)."""
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
    if bool((qmap < 0).any()) != signed:
        raise _refuse(optimizer, f"{where}: qmap{k} is "
                                 + (f"an unsigned code, but state{k} ({nm}) is signed" if signed else
                                    f"a signed code, but state{k} ({nm}) is a second moment (>= 0)")
                                 + " (qmap1 and qmap2 swapped?): the state dict is corrupt")
    codes = codes.detach().cpu().contiguous()
    # bitsandbytes' blocks are flat over the state: format 1's layout, one row
    return _blocks.dequantize_state(codes, absmax, 8, qmap, block_size, codes, rows=1)


# -- memfit format 1 -------------------------------------------------------------------------

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


# -- export ------------------------------------------------------------------------------------

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
    for gi, g in enumerate(optimizer.param_groups):
        if optimizer._group_kind(g) != optimizer._kind:
            raise MemfitValueError(
                f"to_torch_state_dict: param_groups[{gi}] of {_name(optimizer)} is stepped by "
                f"{_KIND_MATH[optimizer._group_kind(g)]} (use_muon=False), and one torch "
                f"optimizer ({_KIND_MATH[optimizer._kind]}) cannot hold it; export an optimizer "
                "of Muon groups only")
    index, groups, state = {}, [], {}
    for g in optimizer.param_groups:
        tg = {k: v for k, v in g.items() if k != "params" and k not in _MEMFIT_GROUP_KEYS}
        for k, v in _TORCH_GROUP_DEFAULTS[optimizer._kind].items():
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
