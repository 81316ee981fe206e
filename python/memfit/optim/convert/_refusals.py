"""What every conversion of a state dict checks, and how it refuses: the parameter ids
(``check_state_ids``, ``_places``), foreign float states (finite, second moments >= 0),
step counts and param-group values; every refusal is a MemfitValueError that names the
argument and says nothing was loaded (``_refuse``)."""

from __future__ import annotations

import math
import numbers

import torch

from memfit._C import MemfitValueError
from memfit.optim import _checks, _core, _format

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


def _decay_refusal(optimizer, where, decoupled, saved_by, kind=None) -> MemfitValueError:
    """The refusal of Adam states saved with weight decay of the other meaning (decoupled
    or L2), with the memfit class (or LAMB's adam_w_mode) that applies it as the saver
    did. ``kind``: the kind of the group it would be loaded into (default: the class's;
    LAMB's groups are ADAM with adam_w_mode=False)."""
    name = _name(optimizer)
    kind = optimizer._kind if kind is None else kind
    if getattr(optimizer, "_TRUST_KEYS", ()):  # LAMB: the same class, the other mode
        advice = f"give {name} adam_w_mode={bool(decoupled)} for it"
    else:
        bits = optimizer.param_groups[0]["bits"] if optimizer.param_groups else 8
        cls = ({8: "AdamW8bit", 4: "AdamW4bit", 32: "AdamW"} if decoupled
               else {32: "Adam"}).get(bits, "AdamW8bit" if decoupled else "Adam8bit")
        advice = f"load it into memfit.optim.{cls} instead"
    return _refuse(optimizer, f"{where} was saved by {saved_by} with weight decay; {name} applies "
                              f"weight decay {'as L2' if kind == _core.ADAM else 'decoupled'} there, "
                              f"which would change its meaning: {advice}")


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
