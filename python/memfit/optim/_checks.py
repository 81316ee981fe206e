"""The checks of memfit's torch optimizers: what step() checks before it writes anything
(gradients, parameters, the states' layout) and what load_state_dict() checks before it
loads anything (keys, dtypes, shapes, layouts and values of every saved state), and the
checks of a param group's values. Nothing here changes an optimizer; each check raises
MemfitTypeError/MemfitValueError naming the parameter as the caller passed ``where``."""

from __future__ import annotations

import math
import numbers

import torch

from memfit._C import MemfitTypeError, MemfitValueError
from memfit.optim import _blocks, _core, _dtensor


def same_layout(a, b) -> bool:
    """Same shape and the same strides along every dimension of more than one element:
    the kernels pair the elements of a parameter, its gradient and its per-element
    states in memory order (the binding's mf_py_same_layout)."""
    return a.shape == b.shape and all(s == t for s, t, n in zip(a.stride(), b.stride(), a.shape)
                                      if n != 1)


def dim_order(t) -> tuple:
    """t's dimensions of more than one element, outermost in memory first."""
    return tuple(sorted((d for d in range(t.dim()) if t.shape[d] != 1), key=lambda d: -t.stride(d)))


def check_dense(where, p) -> None:
    """Refuses a parameter that is neither contiguous nor dense in another order
    (channels_last): the kernels run over its storage."""
    local = p.to_local() if _dtensor.is_dtensor(p) else p
    if not _blocks.is_dense(local):
        raise MemfitValueError(f"{where}: must be contiguous (this tensor has gaps or overlapping "
                               "elements: a slice, an expand() or a view of part of a tensor, "
                               f"strides {tuple(local.stride())}); call .contiguous() first; "
                               "nothing was updated")


def refuse_grad(where, p, g):
    """Raises for a gradient the step cannot take for p (step has found one of: another
    shape, dtype, device, or another memory layout than a non-contiguous p's)."""
    where = f"{where} (shape {tuple(p.shape)})"
    if g.shape != p.shape:
        raise MemfitValueError(
            f"{where}: its gradient has shape {tuple(g.shape)}; a gradient must have its "
            "parameter's shape (one of the same size in another layout, such as JAX's (in, out) "
            "for torch's (out, in) weight, would update the wrong elements); nothing was updated")
    if g.dtype != p.dtype:
        raise MemfitTypeError(f"{where}: its gradient is {g.dtype} and the parameter {p.dtype}; "
                              "cast the gradient to the parameter's dtype; nothing was updated")
    if g.device != p.device:
        raise MemfitValueError(f"{where}: its gradient is on {g.device} but the parameter on "
                               f"{p.device}; nothing was updated")
    check_dense(where, p)
    raise MemfitValueError(
        f"{where}: must be contiguous (row-major), or dense with a gradient of the same "
        f"strides, but has strides {tuple(p.stride())} and its gradient {tuple(g.stride())}; "
        "make the gradient match the parameter's memory format (e.g. p.grad = p.grad."
        "contiguous(memory_format=torch.channels_last)) or call .contiguous() on the "
        "parameter; nothing was updated")


def state_problem(key, value, shape, dtype, p, row_major=False):
    """None, or (exception class, message) for a state ``key`` of p that the kernels
    cannot take as p's: not a tensor, another dtype or (global) shape, not laid out as
    p's states are (a DTensor of p's mesh and placements for a DTensor p, except step),
    another device, or other strides (p's for a state of one value per element, else
    contiguous; contiguous for all with ``row_major``, the optimizer's
    ``_row_major_states``). Metadata only: no host sync."""
    if not torch.is_tensor(value):
        return MemfitTypeError, f"state {key!r} is a {type(value).__name__}, not a tensor"
    if value.dtype != dtype:
        return MemfitTypeError, f"state {key!r} is {value.dtype}, but needs {dtype} {shape}"
    if tuple(value.shape) != shape:
        return (MemfitValueError,
                f"state {key!r} has shape {tuple(value.shape)}, but needs {dtype} {shape}")
    dp, dv = _dtensor.is_dtensor(p), _dtensor.is_dtensor(value)
    if dv != (dp and key != "step") or (dv and (value.device_mesh != p.device_mesh
                                                or value.placements != p.placements)):
        return MemfitValueError, (f"state {key!r} is {_dtensor.describe(value)}, but the "
                                  f"parameter's states are {_dtensor.describe(p, key)}")
    local = value.to_local() if dv else value
    lp = p.to_local() if dp else p
    if local.device != lp.device:
        return MemfitValueError, f"state {key!r} is on {local.device}, the parameter on {lp.device}"
    if key != "step" and shape == tuple(p.shape) and not row_major:
        if not same_layout(local, lp):
            return MemfitValueError, (f"state {key!r} has strides {tuple(local.stride())}, but "
                                      "holds one value per element and must be laid out as the "
                                      f"parameter (strides {tuple(lp.stride())})")
    elif not local.is_contiguous():
        return MemfitValueError, (f"state {key!r} has strides {tuple(local.stride())}, but must "
                                  "be contiguous")
    return None


_SAVED_FOR_ANOTHER = ("the state dict was saved for a different model or with different "
                      "bits/block_size/min_8bit_size")


def check_saved_keys(where, saved, expected) -> None:
    """Refuses a saved state of p (``saved``) whose keys are not those p needs
    (``expected``, from _expected_state), or whose tensors have another dtype or shape."""
    for key in saved:
        if key not in expected:
            raise MemfitValueError(f"{where}: has a state {key!r} that this optimizer does not "
                                   f"keep for it: {_SAVED_FOR_ANOTHER}; nothing was loaded")
    for key in expected:
        # a missing Kahan buffer starts at zero: the parameter's value as it is
        if key not in saved and key != "kahan_comp":
            raise MemfitValueError(
                f"{where}: has no state {key!r} (it has {', '.join(map(repr, saved))}; this "
                f"optimizer keeps {', '.join(map(repr, expected))} for it): the state dict is "
                "incomplete; nothing was loaded")
    for key, value in saved.items():
        shape, dtype = expected[key]
        if torch.is_tensor(value) and (value.layout != torch.strided or value.is_meta):
            raise MemfitValueError(
                f"{where}: state {key!r} is a {value.layout} tensor on {value.device}: states "
                "must be dense tensors with data (not sparse, not meta); nothing was loaded")
        if not torch.is_tensor(value) or value.dtype != dtype or tuple(value.shape) != shape:
            got = (f"{value.dtype} {tuple(value.shape)}" if torch.is_tensor(value)
                   else type(value).__name__)
            raise MemfitValueError(
                f"{where}: state {key!r} is {got}, but needs {dtype} {shape}: "
                f"{_SAVED_FOR_ANOTHER}, or is truncated; nothing was loaded")


def laid_out(where, key, value, p, row_major=False):
    """``value`` (a loaded copy of p's state ``key``) in the memory layout the kernels
    need: p's for a state of one value per element, else (and for all with
    ``row_major``, see state_problem) contiguous. Relaying out is
    exact where each value keeps its meaning: float32 states, Kahan buffers, absmax and
    4-bit codes (logical arrays), 8-bit codes stored in p's memory order (only their
    strides differ, as in a slice). 8-bit codes stored in another order are refused: a
    code's quantization block is given by its place in memory, so relaid codes would
    be read with other blocks' absmax."""
    dv = _dtensor.is_dtensor(value)
    local = value.to_local() if dv else value
    lp = p.to_local() if _dtensor.is_dtensor(p) else p
    per_element = key != "step" and tuple(value.shape) == tuple(p.shape)
    if per_element and row_major and local.dtype == torch.uint8 and not local.is_contiguous() \
            and dim_order(local) != tuple(d for d in range(local.dim()) if local.shape[d] != 1):
        raise MemfitValueError(
            f"{where}: state {key!r} (8-bit codes) has strides {tuple(local.stride())}, not in "
            "row-major order: its codes belong to the quantization blocks of other elements; "
            "nothing was loaded")
    if per_element and not row_major:
        if same_layout(local, lp):
            return value
        if local.dtype == torch.uint8 and dim_order(local) != dim_order(lp):
            raise MemfitValueError(
                f"{where}: state {key!r} (8-bit codes) has strides {tuple(local.stride())}, in "
                f"another memory order than the parameter's {tuple(lp.stride())}: its codes "
                "belong to the quantization blocks of other elements; nothing was loaded")
        fixed, stride = torch.empty_like(lp, dtype=local.dtype).copy_(local), p.stride()
    else:
        if local.is_contiguous():
            return value
        fixed, stride = local.contiguous(), None
    return _dtensor.with_local(value, fixed, stride) if dv else fixed


# the parameter dtypes the kernels step (uint8 and others are states' dtypes only)
PARAM_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_param(where, p, at_step=False) -> None:
    """Refuses a parameter the kernels cannot step: not dense (strided), a dtype other
    than PARAM_DTYPES and, ``at_step``, on a device other than the CPU or a CUDA GPU
    (not checked earlier: a model built on the meta device gets its storage in place,
    after the optimizer is made)."""
    what = f"{where} (shape {tuple(p.shape)}, {p.dtype})"
    if p.layout != torch.strided:
        raise MemfitValueError(f"{what}: is a {p.layout} tensor; memfit's optimizers step dense "
                               "(strided) parameters only; nothing was updated")
    if p.dtype not in PARAM_DTYPES:
        raise MemfitTypeError(
            f"{what}: unsupported dtype {p.dtype}; memfit's optimizers take float32, float16 "
            "and bfloat16 parameters: cast the model (e.g. model.float()) or leave this "
            "parameter out of the optimizer; nothing was updated")
    if at_step and p.device.type not in ("cpu", "cuda"):
        raise MemfitValueError(f"{what}: is on {p.device}; memfit's optimizers step parameters "
                               "on the CPU or a CUDA GPU; nothing was updated")


def check_torch_flags(flags) -> None:
    """Refuses torch's flags (a param group or the constructor's keywords) that memfit
    cannot honour: fused and foreach both True (as torch does), capturable=True,
    differentiable=True, or values that are not bools (None: fused and foreach)."""
    for key in ("fused", "foreach", "capturable", "differentiable"):
        value = flags.get(key)
        if value is not None and not isinstance(value, bool):
            none = " or None" if key in ("fused", "foreach") else ""
            raise TypeError(f"{key}: expected True, False{none}, got {value!r}")
    if flags.get("fused") and flags.get("foreach"):
        raise RuntimeError("`fused` and `foreach` cannot be `True` together (as in torch); "
                           "memfit is always fused: leave foreach out")
    if flags.get("capturable"):
        raise ValueError("capturable=True is not supported: memfit's step never waits for the "
                         "device (steps, grad_scale and found_inf stay on it), but its "
                         "stochastic-rounding counter is kept on the host, so a CUDA graph "
                         "replay would repeat the same random bits; pass capturable=False and "
                         "leave step() out of the captured graph")
    if flags.get("differentiable"):
        raise ValueError("differentiable=True is not supported: memfit's step runs in C/CUDA "
                         "kernels outside autograd; pass differentiable=False, or use "
                         "torch.optim's class for a differentiable step")


def _whole(value) -> bool:
    """An int (or NumPy integer), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_group(optimizer, group, where) -> dict:
    """The hyperparameters of a param group of ``optimizer`` as the core takes them
    (``optimizer._hparams(group)``), after checking every value of the group: memfit's
    options (bits, block_size, min_8bit_size, kahan with stochastic rounding, sr_seed,
    sr_step), torch's flags (fused, foreach, capturable, differentiable), the options
    memfit does not have (``optimizer._fixed_options``: amsgrad, centered, ...), and the
    hyperparameters the core refuses (a negative lr after a schedule, ...). Raises
    naming ``where`` (the group) and the key; changes nothing. Called by the
    constructor, add_param_group, load_state_dict and, for every group, by each step
    before it writes anything (a group's values can be changed at any time)."""
    try:
        for key, value, advice in optimizer._fixed_options:
            got = group.get(key, value)
            if bool(got) != value:
                raise ValueError(f"{key}={got!r} is not supported: {advice}")
        bits = group["bits"]
        if bits not in (4, 8, 32):
            raise ValueError(f"bits: expected 4, 8 or 32, got {bits!r}")
        bs = group["block_size"]
        if bits != 32 and bs not in _core.BLOCK_SIZES:
            raise ValueError(f"block_size: must be one of "
                             f"{', '.join(map(str, _core.BLOCK_SIZES))}, got {bs!r}")
        if not _whole(group["min_8bit_size"]) or group["min_8bit_size"] < 0:
            raise ValueError(f"min_8bit_size: expected an int >= 0, got {group['min_8bit_size']!r}")
        kahan, sr = group.get("kahan", False), group.get("bf16_stochastic_round")
        if not isinstance(kahan, bool):
            raise TypeError(f"kahan: expected True or False, got {kahan!r}")
        if kahan and sr:
            raise ValueError(
                "kahan=True and bf16_stochastic_round=True cannot be combined: the Kahan "
                "buffer keeps the rounding error that stochastic rounding would randomise; "
                "pass only kahan=True (stochastic rounding is then off)")
        if not _whole(group.get("sr_seed", 0)):
            raise TypeError(f"sr_seed: expected an int (the stochastic-rounding seed), got "
                            f"{group['sr_seed']!r}")
        sr_step = group.get("sr_step", 0)
        if not _whole(sr_step) or sr_step < 0:
            raise ValueError(f"sr_step: expected an int >= 0 (the group's step counter for "
                             f"stochastic rounding), got {sr_step!r}")
        check_torch_flags(group)
        hp = optimizer._hparams(group)
        _core.check(optimizer._group_kind(group), hp)
    except (TypeError, ValueError, RuntimeError) as e:
        if str(e).startswith(where):
            raise
        raise type(e)(f"{where}: {e}") from None
    return hp


def saved_step(where, value):
    """A loaded ``step`` as the kernels keep it. A real number (Python or NumPy, as
    older torch and hand-edited state dicts hold it; torch loads them) that is a whole
    number >= 0 becomes torch's float32 0-d tensor; NaN, Inf, negative or fractional
    ones are refused. Anything else is returned as it is, for check_saved_keys and
    check_values to judge."""
    if torch.is_tensor(value) or isinstance(value, bool) or not isinstance(value, numbers.Real):
        return value
    v = float(value)
    if not (math.isfinite(v) and v >= 0 and v == math.floor(v)):
        raise MemfitValueError(f"{where}: state 'step' is {value!r}: a step count must be a "
                               "whole number >= 0 (not NaN, Inf, negative or fractional); the "
                               "state dict is corrupt; nothing was loaded")
    return torch.tensor(v, dtype=torch.float32)


def check_structure(name, state_dict) -> None:
    """Refuses what is not a state dict at all: not a dict, ``state`` not a dict,
    ``param_groups`` not a list of dicts with a list of ``params``."""
    where = f"{name}.load_state_dict"
    if not isinstance(state_dict, dict):
        raise MemfitValueError(f"{where}: expected a state dict (a dict with 'state' and "
                               f"'param_groups'), got a {type(state_dict).__name__}")
    state, groups = state_dict.get("state"), state_dict.get("param_groups")
    if not isinstance(state, dict):
        raise MemfitValueError(f"{where}: the state dict's 'state' is a {type(state).__name__}, "
                               "expected a dict {parameter id: that parameter's state}; "
                               "nothing was loaded")
    if not isinstance(groups, (list, tuple)) or not all(
            isinstance(g, dict) and isinstance(g.get("params"), (list, tuple)) for g in groups):
        raise MemfitValueError(f"{where}: the state dict's 'param_groups' must be a list of "
                               "dicts, each with a list of 'params'; nothing was loaded")


def check_values(optimizer, where, group, p, loaded) -> None:
    """Refuses corrupt values in the loaded states of p: NaN, Inf or negative
    absmax (a NaN scale would freeze its block for ever, silently), a step that is
    not a whole number >= 0, NaN or Inf float32 states or Kahan buffers, negative
    second moments. One host sync per parameter, at load only; for a DTensor p one
    all-reduce over its mesh, so that every rank checks its own rows and all refuse
    together."""
    signed = _core.state_layout(optimizer._group_kind(group), group["bits"], group["block_size"], 0,
                                optimizer._hparams(group)["momentum"])["signed"]
    checks = []  # (key, what is wrong, a 0-d bool tensor: True where it is)
    for key, value in loaded.items():
        v = value.to_local() if _dtensor.is_dtensor(value) else value
        if key == "step":
            whole = torch.isfinite(v) & (v >= 0) & (v == torch.floor(v))
            checks.append((key, "is not a whole number of steps >= 0", ~whole))
        elif key.startswith("absmax"):
            # a block's scale is its largest |value|: finite and >= 0 (False for NaN)
            checks.append((key, "holds NaN, Inf or negative block scales",
                           ~((v >= 0) & (v < math.inf)).all()))
        elif v.dtype != torch.uint8:  # float32 states and the Kahan buffer
            checks.append((key, "holds NaN or Inf values", ~torch.isfinite(v).all()))
            if key.startswith("state") and not signed[int(key[5:]) - 1]:
                checks.append((key, "holds negative values, but it is a second moment "
                                    "(a mean of squares, >= 0)", (v < 0).any()))
    flags = torch.stack([bad for *_, bad in checks]).float()
    if _dtensor.is_dtensor(p):
        flags = _dtensor.sum_over_mesh(flags, p)
    for (key, what, _), bad in zip(checks, flags.tolist()):
        if bad:
            got = f" ({float(loaded[key])})" if key == "step" else ""
            raise MemfitValueError(f"{where}: state {key!r}{got} {what}: the state dict is "
                                   "corrupt; nothing was loaded")
