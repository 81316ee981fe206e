"""State-dict conversion: switch between memfit's optimizers and torch.optim's (or
bitsandbytes') mid-training, and load memfit checkpoints of an older format.

- ``memfit_optimizer.load_state_dict(sd)`` takes, besides its own state dicts:

  - a ``torch.optim`` state dict of the same kind (``torch.optim.AdamW``/``Adam`` for
    memfit's AdamW/Adam/AdamW8bit/Adam8bit/AdamW4bit, ``SGD`` for SGD8bit, ``RMSprop``
    for RMSprop8bit, lion-pytorch's ``Lion`` for Lion8bit): its float states are
    quantized into memfit's layout, and the param groups' hyperparameters that both
    name (lr, betas, eps, weight_decay, maximize, momentum, ...) are taken over, while
    memfit's own (bits, block_size, min_8bit_size, ...) stay the optimizer's;
  - a bitsandbytes 8-bit (block-wise) or 32-bit state dict (``state1``/``state2``,
    ``absmax1``/``absmax2``, ``qmap1``/``qmap2``), dequantized with its own code and
    block size and requantized;
  - a memfit state dict of format_version 1 (:func:`upgrade_v1`).

  What cannot be converted is refused with ValueError: amsgrad's ``max_exp_avg_sq``,
  another optimizer's states, other shapes, non-finite values.
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

import itertools

import torch

from memfit.optim import _blocks, _core, _format

__all__ = ["from_bitsandbytes", "from_torch", "to_current", "to_torch_state_dict", "upgrade_v1"]

# param-group keys that only memfit has: never exported, and kept from the optimizer
# when a foreign state dict is loaded
_MEMFIT_GROUP_KEYS = ("bits", "block_size", "min_8bit_size", "bf16_stochastic_round", "kahan",
                      "sr_seed", "sr_step", _format.GROUP_FORMAT_KEY)
# hyperparameters taken over from a foreign state dict where both name them
_SHARED_HYPER = ("lr", "betas", "eps", "weight_decay", "maximize", "momentum", "dampening",
                 "nesterov", "alpha")
# torch.optim's own group keys for each kind, with the values memfit's behaviour matches
_TORCH_GROUP_DEFAULTS = {
    _core.ADAMW: dict(amsgrad=False, foreach=None, capturable=False, differentiable=False,
                      fused=None, decoupled_weight_decay=True),
    _core.ADAM: dict(amsgrad=False, foreach=None, capturable=False, differentiable=False,
                     fused=None, decoupled_weight_decay=False),
    _core.SGD: dict(foreach=None, differentiable=False, fused=None),
    _core.RMSPROP: dict(centered=False, capturable=False, foreach=None, differentiable=False),
    _core.LION: {},
}
# a group key that tells which kind of torch optimizer saved it
_KIND_MARKER = {_core.ADAMW: "eps", _core.ADAM: "eps", _core.LION: "betas",
                _core.SGD: "momentum", _core.RMSPROP: "alpha"}
_TORCH_STATE_NAMES = {"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer",
                      "square_avg", "grad_avg", "step"}
_BNB_STATE_KEYS = {"state1", "state2", "absmax1", "absmax2", "qmap1", "qmap2", "step",
                   "gnorm_vec", "unorm_vec"}
# where bitsandbytes' state_dict() nests the quantized states (hidden from FSDP's gather)
_BNB_WRAPPED = "__bnb_optimizer_quant_state__"


def _name(optimizer) -> str:
    return type(optimizer).__name__


_check_optimizer = _format.check_optimizer


def to_current(optimizer, state_dict):
    """``state_dict`` as ``optimizer.load_state_dict`` loads it: a memfit state dict of
    the current format, converted from an older memfit format, from torch.optim or from
    bitsandbytes where it is one of those; anything else is returned unchanged (and
    load_state_dict refuses it)."""
    _check_optimizer(optimizer)
    if not isinstance(state_dict, dict) or not isinstance(state_dict.get("param_groups"), list) \
            or not isinstance(state_dict.get("state"), dict) \
            or not all(isinstance(g, dict) and "params" in g for g in state_dict["param_groups"]):
        return state_dict
    # memfit's own, also after torch.distributed.checkpoint's get_state_dict (which keeps
    # only "state" and "param_groups"; every group then carries the format)
    _, version = _format.saved_format(state_dict)
    if version is not None:
        return upgrade_v1(optimizer, state_dict) if version == 1 else state_dict
    keys = set()
    for saved in state_dict["state"].values():
        if isinstance(saved, dict):
            keys.update(saved)
    if keys & {"state1", "qmap1", _BNB_WRAPPED}:
        return from_bitsandbytes(optimizer, state_dict)
    return from_torch(optimizer, state_dict)


# -- foreign state dicts -------------------------------------------------------------------

def _params_by_saved_id(optimizer, state_dict):
    """{saved parameter id: the optimizer's parameter}, after the checks torch makes."""
    groups, saved_groups = optimizer.param_groups, state_dict["param_groups"]
    if len(groups) != len(saved_groups):
        raise ValueError("loaded state dict has a different number of parameter groups")
    if any(len(g["params"]) != len(sg["params"]) for g, sg in zip(groups, saved_groups)):
        raise ValueError("loaded state dict contains a parameter group that doesn't match "
                         "the size of optimizer's group")
    return dict(zip(itertools.chain.from_iterable(sg["params"] for sg in saved_groups),
                    itertools.chain.from_iterable(g["params"] for g in groups)))


def _merged_groups(optimizer, saved_groups, source):
    """The optimizer's param groups (memfit's keys included) with the hyperparameters a
    foreign state dict names taken over, and the saved parameter ids."""
    name, kind = _name(optimizer), optimizer._kind
    out = []
    for i, (g, sg) in enumerate(zip(optimizer.param_groups, saved_groups)):
        if sg.get("amsgrad"):
            raise ValueError(f"{name}.load_state_dict: param group {i} of this {source} state "
                             "dict uses amsgrad=True: memfit's Adam has no max_exp_avg_sq state "
                             "to keep it in")
        if sg.get("centered"):
            raise ValueError(f"{name}.load_state_dict: param group {i} of this {source} state "
                             "dict uses centered=True, which RMSprop8bit does not support")
        marker = _KIND_MARKER[kind]
        if marker not in sg or (kind == _core.LION and "eps" in sg) \
                or (kind in (_core.ADAMW, _core.ADAM) and "betas" not in sg):
            raise ValueError(f"{name}.load_state_dict: this state dict was not saved by a memfit "
                             f"optimizer, and its param group {i} not by a {source} optimizer "
                             f"of the same kind as {name} (its keys: "
                             f"{', '.join(sorted(k for k in sg if k != 'params'))})")
        decoupled = sg.get("decoupled_weight_decay")
        if decoupled is not None and kind in (_core.ADAMW, _core.ADAM) \
                and bool(decoupled) != (kind == _core.ADAMW) and sg.get("weight_decay", 0):
            raise ValueError(f"{name}.load_state_dict: param group {i} was saved by "
                             f"{'AdamW' if decoupled else 'Adam'} with weight decay; {name} "
                             f"applies weight decay {'as L2' if kind == _core.ADAM else 'decoupled'}"
                             ": load it into memfit.optim."
                             f"{'AdamW8bit' if decoupled else 'Adam8bit'} instead")
        ng = {k: v for k, v in g.items() if k != "params"}
        for k in _SHARED_HYPER:
            if k in sg and k in ng:
                ng[k] = tuple(sg[k]) if k == "betas" else sg[k]
        ng["params"] = list(sg["params"])
        out.append(ng)
    return out


def _float_state(name, pid, key, value, p):
    """A foreign float state as float32 on p's device, checked."""
    if not torch.is_tensor(value) or not value.is_floating_point():
        raise ValueError(f"{name}.load_state_dict: state {key!r} of parameter {pid} is "
                         f"{type(value).__name__ if not torch.is_tensor(value) else value.dtype}, "
                         "not a float tensor")
    if tuple(value.shape) != tuple(p.shape):
        raise ValueError(f"{name}.load_state_dict: state {key!r} of parameter {pid} has shape "
                         f"{tuple(value.shape)}, but the parameter has {tuple(p.shape)}: the state "
                         "dict was saved for a different model")
    value = value.detach().to(device=p.device, dtype=torch.float32)
    if not bool(torch.isfinite(value).all()):
        raise ValueError(f"{name}.load_state_dict: state {key!r} of parameter {pid} has "
                         "non-finite values (NaN or Inf): refusing to quantize them")
    return value


def _step_tensor(step, p):
    if torch.is_tensor(step):
        if step.numel() != 1:
            raise ValueError(f"step: expected one value, got a tensor of shape {tuple(step.shape)}")
        step = step.item()
    return torch.tensor(float(step), dtype=torch.float32, device=p.device)


def _memfit_state(optimizer, group, p, floats, step, extra=None):
    """The state of p in ``group`` as this optimizer keeps it, from float32 values under
    torch's names (quantized where the layout says so)."""
    expected = optimizer._expected_state(group, p)
    out = {"step": step}
    for k, (nm, code) in enumerate(_format.state_codes(optimizer, group), start=1):
        if f"state{k}" not in expected:
            continue
        value = floats.get(nm)
        if value is None:
            raise ValueError(f"{_name(optimizer)}.load_state_dict: a parameter of shape "
                             f"{tuple(p.shape)} has no {nm!r} state to convert")
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
    name = _name(optimizer)
    params = _params_by_saved_id(optimizer, state_dict)
    groups = _merged_groups(optimizer, state_dict["param_groups"], "torch.optim")
    group_of = {id(p): ng for ng, g in zip(groups, optimizer.param_groups) for p in g["params"]}
    names = _core.STATE_NAMES[optimizer._kind]
    state = {}
    for pid, saved in state_dict["state"].items():
        if pid not in params:
            continue
        for key in saved:
            if key not in _TORCH_STATE_NAMES:
                raise ValueError(
                    f"{name}.load_state_dict: this state dict was not saved by a memfit optimizer, "
                    f"and its state {key!r} of parameter {pid} is not one that memfit can convert "
                    f"(it converts torch.optim's {', '.join(names)} for {name})")
            if key != "step" and key not in names:
                raise ValueError(
                    f"{name}.load_state_dict: state {key!r} of parameter {pid} cannot be converted: "
                    f"{name} keeps {', '.join(names)} (a state dict of another optimizer, or of "
                    "amsgrad?)")
        if "step" not in saved and names[0] not in saved:
            continue  # a parameter that was never stepped
        p = params[pid]
        floats = {k: _float_state(name, pid, k, v, p) for k, v in saved.items()
                  if k != "step" and v is not None}
        # torch's SGD counts no steps; a momentum buffer it made has seen one at least,
        # and memfit's step 1 would overwrite the buffer with the gradient
        step = saved.get("step", 1 if floats else 0)
        state[pid] = _memfit_state(optimizer, group_of[id(p)], p, floats, _step_tensor(step, p))
    return _result(optimizer, state, groups)


def from_bitsandbytes(optimizer, state_dict, block_size=None):
    """A memfit state dict for ``optimizer`` from a bitsandbytes optimizer's state dict
    (8-bit block-wise or 32-bit states: ``state1``/``state2`` are torch's first/second
    states, dequantized as ``qmap[code] * absmax[block]``); ``optimizer.load_state_dict``
    calls it for you. ``block_size``: bitsandbytes' block size, by default found from the
    number of absmax values (exact: two block sizes that give the same count give the
    same blocks).

    >>> opt.load_state_dict(bnb_adamw8bit.state_dict())  # doctest: +SKIP
    """
    _check_optimizer(optimizer)
    name = _name(optimizer)
    names = _core.STATE_NAMES[optimizer._kind]
    params = _params_by_saved_id(optimizer, state_dict)
    converted = {}
    for pid, saved in state_dict["state"].items():
        if pid not in params:
            continue
        saved = {**{k: v for k, v in saved.items() if k != _BNB_WRAPPED},
                 **saved.get(_BNB_WRAPPED, {})}
        unknown = sorted(set(saved) - _BNB_STATE_KEYS)
        if unknown:
            raise ValueError(f"{name}.load_state_dict: bitsandbytes state {unknown[0]!r} of parameter "
                             f"{pid} cannot be converted (only block-wise 8-bit and 32-bit states)")
        n_states = sum(f"state{k}" in saved for k in (1, 2))
        if n_states != len(names):
            raise ValueError(f"{name}.load_state_dict: parameter {pid} has {n_states} bitsandbytes "
                             f"states, but {name} keeps {len(names)} ({', '.join(names)}): a state "
                             "dict of another optimizer")
        p = params[pid]
        out = {"step": saved.get("step", 0)}
        for k, nm in enumerate(names, start=1):
            s = saved[f"state{k}"]
            if torch.is_tensor(s) and s.dtype == torch.uint8:
                s = _bnb_dequantize(name, pid, k, s, saved.get(f"absmax{k}"),
                                    saved.get(f"qmap{k}"), block_size)
            out[nm] = s
        converted[pid] = out
    return from_torch(optimizer, {"state": converted, "param_groups": state_dict["param_groups"]})


def _bnb_dequantize(name, pid, k, codes, absmax, qmap, block_size):
    if not torch.is_tensor(absmax) or not torch.is_tensor(qmap):
        raise ValueError(f"{name}.load_state_dict: 8-bit state{k} of parameter {pid} has no "
                         f"absmax{k}/qmap{k} (not a block-wise bitsandbytes state)")
    n, nblocks = codes.numel(), absmax.numel()
    if block_size is None:
        sizes = [b for b in _core.BLOCK_SIZES if -(-n // b) == nblocks]
        if not sizes:
            raise ValueError(f"{name}.load_state_dict: absmax{k} of parameter {pid} has {nblocks} "
                             f"values, which no block size gives for {n} elements")
        block_size = sizes[0]
    if qmap.numel() != 256:
        raise ValueError(f"{name}.load_state_dict: qmap{k} of parameter {pid} has {qmap.numel()} "
                         "values, expected 256")
    codes = codes.detach().cpu().contiguous()
    # bitsandbytes' blocks are flat over the state: format 1's layout, one row
    return _blocks.dequantize_state(codes, absmax.detach().float().cpu().reshape(-1), 8,
                                    qmap.detach().float().cpu(), block_size, codes, rows=1)


# -- memfit format 1 -------------------------------------------------------------------------

def upgrade_v1(optimizer, state_dict):
    """A memfit state dict of format_version 1 (quantization blocks flat over each
    state's storage: absmax ``(ceil(n / block_size),)``, 4-bit codes ``(ceil(n / 2),)``)
    in the current row-block layout, for ``optimizer`` (of the class that saved it):
    bytes unchanged where each row is a whole number of blocks (only shapes change),
    else dequantized and requantized; quantized states of 1-D parameters become float32
    states, as they now are. ``optimizer.load_state_dict`` calls it for you.

    >>> opt.load_state_dict(torch.load("old_checkpoint.pt")["optimizer"])  # doctest: +SKIP
    """
    _check_optimizer(optimizer)
    name = _name(optimizer)
    meta = state_dict.get("memfit") or {}
    if meta.get("format_version") != 1:
        raise ValueError(f"{name}.load_state_dict: expected a state dict of format_version 1, "
                         f"got {meta.get('format_version')!r}")
    if meta.get("optimizer") != name:
        raise ValueError(f"{name}.load_state_dict: the state dict was saved by memfit.optim."
                         f"{meta.get('optimizer')}, not {name}")
    params = _params_by_saved_id(optimizer, state_dict)
    saved_groups = state_dict["param_groups"]
    group_of = {id(params[pid]): sg for sg in saved_groups for pid in sg["params"]}
    state = {}
    for pid, saved in state_dict["state"].items():
        if pid not in params:
            continue
        p, sg = params[pid], group_of[id(params[pid])]
        expected = optimizer._expected_state(sg, p)
        if not any(torch.is_tensor(saved.get(f"absmax{k}")) for k in (1, 2)):
            state[pid] = dict(saved)  # float32 states: the same in both formats
            continue
        bits, bs = sg["bits"], sg["block_size"]
        rows = _blocks.state_rows(p)
        length = _blocks.row_length(p.numel(), rows)
        if all(f"absmax{k}" in expected for k in (1, 2) if f"state{k}" in saved) \
                and length % bs == 0:
            # rows of whole blocks: the blocks, and so every byte, are those of format 1
            new = dict(saved)
            for k in (1, 2):
                if f"state{k}" in saved:
                    new[f"absmax{k}"] = saved[f"absmax{k}"].reshape(expected[f"absmax{k}"][0])
                    if bits == 4:
                        new[f"state{k}"] = saved[f"state{k}"].reshape(expected[f"state{k}"][0])
            state[pid] = new
            continue
        # format 1 is the row-block layout with one row (its flat blocks)
        local = {k: v.to(p.device) for k, v in saved.items() if k.startswith(("state", "absmax"))}
        floats = _format.dequantize_states(optimizer, sg, local, p, rows=1)
        extra = {k: v for k, v in saved.items() if k == "kahan_comp"}
        state[pid] = _memfit_state(optimizer, {**sg, "params": []}, p, floats,
                                   saved["step"], extra)
    return _result(optimizer, state, [dict(sg) for sg in saved_groups])


# -- export ------------------------------------------------------------------------------------

def to_torch_state_dict(optimizer) -> dict:
    """``optimizer``'s state as a torch.optim state dict: float32 states under torch's
    names (``exp_avg``/``exp_avg_sq`` for Adam and AdamW, ``momentum_buffer`` for SGD,
    ``square_avg``/``momentum_buffer`` for RMSprop, ``exp_avg`` for Lion as lion-pytorch
    names it), the float32 ``step``, and param groups with torch's keys (memfit's own,
    such as bits and block_size, left out), for the torch optimizer of the same kind to
    load. Quantized states are dequantized exactly (:func:`memfit.optim.dequantized_state`);
    a Kahan compensation buffer is dropped (the parameter keeps its rounded value).

    >>> t = torch.optim.AdamW(model.parameters())  # doctest: +SKIP
    >>> t.load_state_dict(memfit.optim.to_torch_state_dict(opt))  # doctest: +SKIP
    """
    _check_optimizer(optimizer)
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
                continue
            floats = _format.dequantized_state(optimizer, p)
            floats.pop("kahan_comp", None)
            # torch's SGD keeps no step count
            state[pid] = ({} if optimizer._kind == _core.SGD
                          else {"step": st["step"].detach().clone()})
            state[pid].update(floats)
        tg["params"] = ids
        groups.append(tg)
    return {"state": state, "param_groups": groups}
