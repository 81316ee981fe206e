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

from memfit.optim import _format
from memfit.optim.convert._bitsandbytes import (
    _BNB_ADEMAMIX_KEYS, _BNB_GROUP_KEYS, _BNB_WRAPPED, from_bitsandbytes)
from memfit.optim.convert._refusals import _check_optimizer
from memfit.optim.convert._refusals import check_state_ids  # noqa: F401 (memfit.optim._torch's)
from memfit.optim.convert._memfit import _same_math, upgrade_v1
from memfit.optim._registry import record_name  # noqa: F401 (its old home)
from memfit.optim.convert._torch_optim import from_torch, to_torch_state_dict

__all__ = ["from_bitsandbytes", "from_torch", "to_current", "to_torch_state_dict", "upgrade_v1"]


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
