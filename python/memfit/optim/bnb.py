"""bitsandbytes' optimizer classes, with their names and constructor signatures, on
memfit's optimizers: coming from bitsandbytes, swap the import and keep the lines.

    >>> import memfit.optim.bnb as bnb   # was: import bitsandbytes as bnb  # doctest: +SKIP
    >>> opt = bnb.optim.AdamW8bit(model.parameters(), lr=1e-3, betas=(0.9, 0.995))  # doctest: +SKIP
    >>> bnb.optim.GlobalOptimManager.get_instance().register_module_override(
    ...     model.embed, "weight", {"optim_bits": 32})                            # doctest: +SKIP

``bnb.optim`` is this module itself, so ``bnb.optim.AdamW8bit``, ``bnb.AdamW8bit`` and
``from memfit.optim.bnb import AdamW8bit`` are the same class. Each class is a thin
subclass of the memfit optimizer that does the same math (the table in docs/optim.md,
"Coming from bitsandbytes"); its constructor only translates arguments, so a step is
bit-identical to the memfit class built with the translated arguments, and
``state_dict()`` is that class's, recorded as saved by ``bnb.<class>``: it loads
into the memfit class of the same math and bits and back (a ``bnb.AdamW32bit``'s into
``memfit.optim.AdamW``, a ``bnb.Lion32bit``'s into ``Lion8bit`` with ``bits=32``
groups), and a ``bnb.Adam8bit``'s (decoupled decay) into ``memfit.optim.Adam8bit``
(L2) only without weight decay.

Both bitsandbytes spellings are taken: 0.49's ``(..., min_8bit_size,
percentile_clipping=100, block_wise=True, is_paged=False)`` and 0.50's ``(...,
min_8bit_size, is_paged=False)`` (0.50 removed ``percentile_clipping`` and
``block_wise``), by keyword and positionally. Positionally the two differ in the
argument after ``min_8bit_size``: a ``bool`` there is 0.50's ``is_paged``, an ``int``
0.49's ``percentile_clipping``.

Every argument does what bitsandbytes documents, or raises ``ValueError`` saying what
memfit does instead; none is ignored:

- ``optim_bits`` (8 or 32; ``args.optim_bits`` where ``args`` is given): the state
  format, as bitsandbytes; anything else (``"banana"``, None) raises. The ``*8bit`` and
  ``*32bit`` classes accept only their default, 32 (``Adagrad8bit``'s: 8; bitsandbytes'
  ``*8bit`` raise for anything else, its ``*32bit`` ignore it), and keep their own format.
- ``betas`` of Adam and AdamW may be a string, ``"(0.9, 0.995)"`` (fairseq's configs),
  as bitsandbytes parses it: read as a literal pair of numbers, never evaluated (AdEMAMix:
  three numbers). Lion takes no string (bitsandbytes fails on one): ValueError.
- ``min_8bit_size``: tensors with fewer elements keep float32 states. memfit also
  keeps float32 states for 1-D tensors of any size (its quantization blocks stay
  inside a row; docs/optim.md).
- ``percentile_clipping`` < 100, ``block_wise=False``, ``is_paged=True`` (and the
  ``Paged*`` classes), ``amsgrad=True``, ``args`` with ``max_unorm`` > 0 or
  ``skip_zeros``: ValueError naming memfit's alternative.
- ``Adagrad``/``Adagrad8bit``/``Adagrad32bit``: torch.optim.Adagrad's math, where
  bitsandbytes refuses ``lr_decay`` != 0 and ``initial_accumulator_value`` != 0: memfit
  does both, as torch does. ``Adagrad8bit`` takes ``optim_bits=8`` (its default there).
- ``LAMB``/``LARS`` (and their ``8bit``/``32bit`` forms, ``PytorchLARS``): memfit's
  :mod:`memfit.optim.trust` classes, which apply the trust ratio (``max_unorm``) in 8 and
  32 bits, and LAMB's ``bias_correction``/``adam_w_mode`` and LARS' ``dampening``/``nesterov``
  as documented, where bitsandbytes' 8-bit kernels have no trust ratio (0.50's LAMB8bit
  refuses ``max_unorm != 1``; 0.49's LAMB classes dropped a ``max_unorm`` argument and
  used 1.0) and its 32-bit ones ignore those options. Both spellings:
  a float after ``min_8bit_size`` is 0.50's ``max_unorm``, an int 0.49's
  ``percentile_clipping``; LAMB's ``block_wise`` (0.49's default False, which bitsandbytes
  needed for an 8-bit trust ratio) may be either: memfit applies the trust ratio to its
  blockwise states. ``args.max_unorm`` sets their ``max_unorm``.
- ``AdEMAMix`` (and its ``8bit``/``32bit`` forms): a ``t_alpha`` or ``t_beta3`` of 0 means
  no scheduler (None), as bitsandbytes reads it from 0.49.2 on (0.49.0/0.49.1 divided by it).
- ``Adam``/``Adam8bit``/``Adam32bit``: bitsandbytes applies their ``weight_decay``
  decoupled, as AdamW (``p *= 1 - lr * weight_decay``), not torch.optim.Adam's L2; so
  do these (memfit's AdamW math, with Adam's default ``weight_decay=0``). memfit's own
  ``memfit.optim.Adam8bit`` is torch's Adam.

``GlobalOptimManager`` takes bitsandbytes' per-parameter overrides (``override_config``,
``register_module_override``, ``register_parameters``) for the keys that choose a
state format (``optim_bits``: 32 for a parameter of an 8-bit optimizer;
``min_8bit_size``); they apply to the optimizers of this module, when a parameter's
state is created (its first step), as in bitsandbytes. memfit's own form of the same
is a param group: ``{"params": [model.embed.weight], "bits": 32}``.
"""

from __future__ import annotations

import ast
import numbers
import sys
import weakref
from types import MappingProxyType

import torch

from memfit.optim import _registry
from memfit.optim import optimizers as _m
from memfit.optim import trust as _trust
from memfit.optim.convert._bitsandbytes import bnb_schedule_steps as _bnb_schedule_steps
from memfit.optim._torch import _MemfitOptimizer

__all__ = [
    "Adagrad", "Adagrad8bit", "Adagrad32bit",
    "AdEMAMix", "AdEMAMix8bit", "AdEMAMix32bit",
    "Adam", "Adam8bit", "Adam32bit", "AdamW", "AdamW8bit", "AdamW32bit",
    "GlobalOptimManager", "LAMB", "LAMB8bit", "LAMB32bit", "LARS", "LARS8bit", "LARS32bit",
    "Lion", "Lion8bit", "Lion32bit",
    "PagedAdEMAMix", "PagedAdEMAMix8bit", "PagedAdEMAMix32bit",
    "PagedAdam", "PagedAdam8bit", "PagedAdam32bit", "PagedAdamW", "PagedAdamW8bit",
    "PagedAdamW32bit", "PagedLion", "PagedLion8bit", "PagedLion32bit", "PytorchLARS",
    "RMSprop", "RMSprop8bit", "RMSprop32bit", "SGD", "SGD8bit", "SGD32bit",
]

# `import memfit.optim.bnb as bnb` then `bnb.optim.AdamW8bit(...)`, as with bitsandbytes
optim = sys.modules[__name__]

_CLIP_ADVICE = ("clip by the gradient norm before the step instead: "
                "memfit.amp.clip_grad_norm_(model.parameters(), max_norm) (or torch.nn.utils.clip_grad_norm_)")


def _paged_error(name: str) -> ValueError:
    return ValueError(
        f"{name}: memfit has no paged optimizers (bitsandbytes' is_paged keeps the states in "
        "CUDA unified memory, paged out to the CPU under memory pressure, and on a CPU does "
        "nothing); memfit keeps the states on the parameter's device, 8-bit ones at a quarter "
        "of float32's bytes: pass is_paged=False, or use the class without 'Paged'. When the "
        "states do not fit the GPU, keep them on the host, stepped by the CPU: "
        "memfit.optim.CPUOffloadOptimizer(params, memfit.optim.AdamW8bit, "
        "offload_gradients=True, ...) (docs/offload.md)")


def _get(args, key, default):
    """bitsandbytes reads ``args.<key>``; a dict is taken too."""
    if isinstance(args, dict):
        return args.get(key, default)
    return getattr(args, key, default)


def _tail(name, percentile_clipping, block_wise, is_paged):
    """(percentile_clipping, block_wise, is_paged) of either spelling: 0.50's positional
    is_paged lands in 0.49's percentile_clipping slot; a bool there is 0.50's."""
    if isinstance(percentile_clipping, bool):
        if block_wise is not True or is_paged is not False:
            raise TypeError(f"{name}: got a bool for percentile_clipping (bitsandbytes 0.50's "
                            "positional is_paged) together with block_wise/is_paged")
        return 100, True, percentile_clipping
    return percentile_clipping, block_wise, is_paged


def _check_bnb_options(name, *, percentile_clipping=100, block_wise=True, is_paged=False,
                       max_unorm=0.0, skip_zeros=False):
    if is_paged:
        raise _paged_error(name)
    if (isinstance(percentile_clipping, bool) or not isinstance(percentile_clipping, int)
            or not 0 < percentile_clipping <= 100):
        raise ValueError(f"{name}: percentile_clipping: expected an int in 1..100, got "
                         f"{percentile_clipping!r}")
    if percentile_clipping < 100:
        raise ValueError(f"{name}: percentile_clipping={percentile_clipping}: memfit has no "
                         f"percentile clipping (bitsandbytes 0.50 removed it too); {_CLIP_ADVICE}")
    if block_wise is not True:
        raise ValueError(f"{name}: block_wise={block_wise!r}: memfit quantizes block-wise only "
                         "(256 values per scale, as bitsandbytes' default and only mode since 0.50)")
    if max_unorm:
        raise ValueError(f"{name}: args.max_unorm={max_unorm!r}: memfit has no update-norm "
                         f"clipping; {_CLIP_ADVICE}")
    if skip_zeros:
        raise ValueError(f"{name}: args.skip_zeros=True: memfit updates every element (weight "
                         "decay included); leave parameters out of the optimizer to freeze them")


def _resolve(name, *, optim_bits, args, min_8bit_size, percentile_clipping=100, block_wise=True,
             is_paged=False, fixed_bits=None, fixed_default=32, trust=False):
    """The checked (bits, min_8bit_size) of a bitsandbytes constructor call. ``fixed_bits``:
    the class's own format (the *8bit and *32bit classes), None where optim_bits says;
    ``fixed_default``: the optim_bits default of such a class (32, but Adagrad8bit's 8).
    ``trust``: LAMB and LARS, which take args.max_unorm (their caller reads it)."""
    percentile_clipping, block_wise, is_paged = _tail(name, percentile_clipping, block_wise, is_paged)
    if fixed_bits is not None and not (_is_int(optim_bits) and optim_bits == fixed_default):
        # bitsandbytes' *8bit classes raise for another optim_bits, its *32bit ones ignore it
        other = "'8bit'" if fixed_bits == 8 else "'32bit'"
        raise ValueError(f"{name}: optim_bits={optim_bits!r}: {name} keeps {fixed_bits}-bit states; "
                         f"optim_bits must stay {fixed_default}, bitsandbytes' default, kept for "
                         "compatibility "
                         f"(for other states use the class without {other}, with optim_bits=8 or 32)")
    bits = optim_bits if fixed_bits is None else fixed_bits
    max_unorm, skip_zeros = 0.0, False
    if args is not None:  # bitsandbytes takes these from args instead of the arguments
        bits = _get(args, "optim_bits", bits)
        min_8bit_size = _get(args, "min_8bit_size", min_8bit_size)
        percentile_clipping = _get(args, "percentile_clipping", percentile_clipping)
        block_wise = _get(args, "block_wise", block_wise)
        max_unorm = 0.0 if trust else _get(args, "max_unorm", 0.0)
        skip_zeros = _get(args, "skip_zeros", False)
    _check_bnb_options(name, percentile_clipping=percentile_clipping, block_wise=block_wise,
                       is_paged=is_paged, max_unorm=max_unorm, skip_zeros=skip_zeros)
    if not (_is_int(bits) and bits in (8, 32)):
        raise ValueError(f"{name}: optim_bits: expected 8 or 32 (as bitsandbytes), got {bits!r}; "
                         "for 4-bit states use memfit.optim.AdamW4bit")
    return int(bits), min_8bit_size


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _string_betas(name, betas, parsed, count=2):
    """``betas`` as the constructor takes them. bitsandbytes' Adam-family optimizers
    (``parsed``) also take them as a string, ``"(0.9, 0.999)"``, as fairseq's configs pass
    them: read here as a Python literal (never evaluated) that must be ``count`` numbers
    (AdEMAMix's: three). Its
    Lion takes no string (bitsandbytes fails on one): refused, saying so."""
    if not isinstance(betas, str):
        return betas
    if not parsed:
        raise ValueError(f"{name}: betas: expected a pair of floats, got the string {betas!r} "
                         "(bitsandbytes parses string betas only for Adam and AdamW); pass "
                         "betas=(beta1, beta2)")
    try:
        value = ast.literal_eval(betas.strip())
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        value = None
    if not (isinstance(value, tuple) and len(value) == count
            and all(isinstance(b, (int, float)) and not isinstance(b, bool) for b in value)):
        example = "(0.9, 0.999)" if count == 2 else "(0.9, 0.999, 0.9999)"
        raise ValueError(f"{name}: betas: expected {'two' if count == 2 else 'three'} numbers, as the "
                         f"string '{example}' or the tuple {example}, got {betas!r}")
    return tuple(float(b) for b in value)


def _no_amsgrad(name, amsgrad):
    if amsgrad:
        raise ValueError(f"{name}: amsgrad=True: memfit has no AMSGrad (bitsandbytes' 8-bit "
                         "classes refuse it and its 32-bit ones ignore it); pass amsgrad=False")


class _BnbOptimizer:
    """Mixin of the classes below: the state format of each parameter also follows the
    GlobalOptimManager's overrides (bitsandbytes' override_config)."""

    # memfit.optim.offload builds the optimizer on host copies of the model's parameters
    # and maps each copy to its parameter here (id(copy) -> parameter): the overrides
    # registered for the parameter are the copy's; the class's own is empty and read-only
    _override_alias = MappingProxyType({})

    def _set_bits(self, bits):
        # the state format of every group that does not say otherwise (memfit's "bits"
        # group option); set before the base constructor reads it
        self._bits = bits

    def state_dict(self):
        sd = super().state_dict()
        # "bnb.Adam8bit", not memfit's own Adam8bit (L2 decay): loaders decide by the math
        sd["memfit"]["optimizer"] = _registry.record_name(self)
        return sd

    def _format(self, group, p) -> int:
        config = GlobalOptimManager.get_instance()._config_for(self._override_alias.get(id(p), p))
        if not config:
            return _MemfitOptimizer._format(group, p)
        bits = config.get("optim_bits", group["bits"])
        if bits == 8 and group["bits"] != 8:
            raise ValueError(
                f"{self._where(p)}: override optim_bits=8 in a {group['bits']}-bit group: memfit "
                "chooses 8-bit states per param group; put this parameter in a group with "
                "'bits': 8 (or use the 8-bit class for all and override the others to 32)")
        return _MemfitOptimizer._format(
            dict(group, bits=bits, min_8bit_size=config.get("min_8bit_size", group["min_8bit_size"])), p)


# -- Adam and AdamW -------------------------------------------------------------------------

def _adam_class(name, base, fixed_bits, weight_decay_default, paged=False, has_is_paged=True):
    """A bitsandbytes Adam-family class: ``base`` is memfit's class of the same math."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                 weight_decay=weight_decay_default, amsgrad=False, optim_bits=32, args=None,
                 min_8bit_size=4096, percentile_clipping=100, block_wise=True, is_paged=False):
        if paged:
            raise _paged_error(name)
        _no_amsgrad(name, amsgrad)
        bits, min8 = _resolve(name, optim_bits=optim_bits, args=args, min_8bit_size=min_8bit_size,
                              percentile_clipping=percentile_clipping, block_wise=block_wise,
                              is_paged=is_paged, fixed_bits=fixed_bits)
        self._set_bits(bits)
        base.__init__(self, params, lr, _string_betas(name, betas, True), eps, weight_decay,
                      min_8bit_size=min8)

    if not has_is_paged:  # bitsandbytes' PagedAdamW*/PagedLion* take no is_paged
        def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8,  # noqa: F811
                     weight_decay=weight_decay_default, amsgrad=False, optim_bits=32, args=None,
                     min_8bit_size=4096, percentile_clipping=100, block_wise=True):
            raise _paged_error(name)

    doc = (f"bitsandbytes' ``{name}`` on ``memfit.optim.{base.__name__}``'s math"
           + (" (decoupled weight decay, as bitsandbytes)" if "AdamW" not in name else "")
           + (f"; always raises ValueError: {name} is paged" if paged else "")
           + ". See :mod:`memfit.optim.bnb`.")
    return type(name, (_BnbOptimizer, base), {"__init__": __init__, "__doc__": doc,
                                              "__module__": __name__})


# bitsandbytes' Adam decays decoupled, as its AdamW: both on memfit's AdamW math
AdamW = _adam_class("AdamW", _m.AdamW, None, 1e-2)
AdamW8bit = _adam_class("AdamW8bit", _m.AdamW8bit, 8, 1e-2)
AdamW32bit = _adam_class("AdamW32bit", _m.AdamW, 32, 1e-2)
Adam = _adam_class("Adam", _m.AdamW, None, 0)
Adam8bit = _adam_class("Adam8bit", _m.AdamW8bit, 8, 0)
Adam32bit = _adam_class("Adam32bit", _m.AdamW, 32, 0)
PagedAdamW = _adam_class("PagedAdamW", _m.AdamW, None, 1e-2, paged=True, has_is_paged=False)
PagedAdamW8bit = _adam_class("PagedAdamW8bit", _m.AdamW8bit, 8, 1e-2, paged=True, has_is_paged=False)
PagedAdamW32bit = _adam_class("PagedAdamW32bit", _m.AdamW, 32, 1e-2, paged=True, has_is_paged=False)
PagedAdam = _adam_class("PagedAdam", _m.AdamW, None, 0, paged=True)
PagedAdam8bit = _adam_class("PagedAdam8bit", _m.AdamW8bit, 8, 0, paged=True)
PagedAdam32bit = _adam_class("PagedAdam32bit", _m.AdamW, 32, 0, paged=True)


# -- Lion -----------------------------------------------------------------------------------

def _lion_class(name, fixed_bits, paged=False):
    if paged:  # bitsandbytes' PagedLion* take no is_paged
        if fixed_bits is None:
            def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0, optim_bits=32,
                         args=None, min_8bit_size=4096, percentile_clipping=100, block_wise=True):
                raise _paged_error(name)
        else:
            def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0, args=None,
                         min_8bit_size=4096, percentile_clipping=100, block_wise=True):
                raise _paged_error(name)
    elif fixed_bits is None:
        def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0, optim_bits=32,
                     args=None, min_8bit_size=4096, percentile_clipping=100, block_wise=True,
                     is_paged=False):
            _init_lion(self, name, params, lr, betas, weight_decay, optim_bits, args, min_8bit_size,
                       percentile_clipping, block_wise, is_paged, fixed_bits)
    else:
        def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0, args=None,
                     min_8bit_size=4096, percentile_clipping=100, block_wise=True, is_paged=False):
            _init_lion(self, name, params, lr, betas, weight_decay, 32, args, min_8bit_size,
                       percentile_clipping, block_wise, is_paged, fixed_bits)
    doc = (f"bitsandbytes' ``{name}`` on ``memfit.optim.Lion8bit``'s math"
           + (f"; always raises ValueError: {name} is paged" if paged else "")
           + ". See :mod:`memfit.optim.bnb`.")
    return type(name, (_BnbOptimizer, _m.Lion8bit), {"__init__": __init__, "__doc__": doc,
                                                     "__module__": __name__})


def _init_lion(self, name, params, lr, betas, weight_decay, optim_bits, args, min_8bit_size,
               percentile_clipping, block_wise, is_paged, fixed_bits):
    # bitsandbytes' Lion8bit/Lion32bit take no optim_bits: their format is the class's
    bits, min8 = _resolve(name, optim_bits=optim_bits if fixed_bits is None else fixed_bits, args=args,
                          min_8bit_size=min_8bit_size, percentile_clipping=percentile_clipping,
                          block_wise=block_wise, is_paged=is_paged)
    self._set_bits(bits)
    _m.Lion8bit.__init__(self, params, lr, _string_betas(name, betas, False), weight_decay,
                         min_8bit_size=min8)


Lion = _lion_class("Lion", None)
Lion8bit = _lion_class("Lion8bit", 8)
Lion32bit = _lion_class("Lion32bit", 32)
PagedLion = _lion_class("PagedLion", None, paged=True)
PagedLion8bit = _lion_class("PagedLion8bit", 8, paged=True)
PagedLion32bit = _lion_class("PagedLion32bit", 32, paged=True)


# -- AdEMAMix (bitsandbytes 0.50's optim/ademamix.py: no args, percentile_clipping or block_wise;
# AdEMAMix8bit/AdEMAMix32bit and the Paged* but PagedAdEMAMix take no optim_bits, the Paged* no is_paged)

def _ademamix_class(name, base, fixed_bits, paged=False):
    def init(self, params, lr, betas, alpha, t_alpha, t_beta3, eps, weight_decay, optim_bits,
             min_8bit_size, is_paged):
        if paged:
            raise _paged_error(name)
        bits, min8 = _resolve(name, optim_bits=optim_bits, args=None, min_8bit_size=min_8bit_size,
                              is_paged=is_paged, fixed_bits=fixed_bits)
        self._set_bits(bits)
        base.__init__(self, params, lr, _string_betas(name, betas, True, 3), alpha,
                      _bnb_schedule_steps(t_alpha), _bnb_schedule_steps(t_beta3), eps, weight_decay,
                      min_8bit_size=min8)

    if fixed_bits is None and not paged:
        def __init__(self, params, lr=1e-3, betas=(0.9, 0.999, 0.9999), alpha=5.0, t_alpha=None,
                     t_beta3=None, eps=1e-8, weight_decay=1e-2, optim_bits=32, min_8bit_size=4096,
                     is_paged=False):
            init(self, params, lr, betas, alpha, t_alpha, t_beta3, eps, weight_decay, optim_bits,
                 min_8bit_size, is_paged)
    elif fixed_bits is None:
        def __init__(self, params, lr=1e-3, betas=(0.9, 0.999, 0.9999), alpha=5.0, t_alpha=None,
                     t_beta3=None, eps=1e-8, weight_decay=1e-2, optim_bits=32, min_8bit_size=4096):
            raise _paged_error(name)
    elif not paged:
        def __init__(self, params, lr=1e-3, betas=(0.9, 0.999, 0.9999), alpha=5.0, t_alpha=None,
                     t_beta3=None, eps=1e-8, weight_decay=1e-2, min_8bit_size=4096, is_paged=False):
            init(self, params, lr, betas, alpha, t_alpha, t_beta3, eps, weight_decay, 32,
                 min_8bit_size, is_paged)
    else:
        def __init__(self, params, lr=1e-3, betas=(0.9, 0.999, 0.9999), alpha=5.0, t_alpha=None,
                     t_beta3=None, eps=1e-8, weight_decay=1e-2, min_8bit_size=4096):
            raise _paged_error(name)
    doc = (f"bitsandbytes' ``{name}`` on ``memfit.optim.{base.__name__}``'s math"
           + (f"; always raises ValueError: {name} is paged" if paged else "")
           + ". See :mod:`memfit.optim.bnb`.")
    return type(name, (_BnbOptimizer, base), {"__init__": __init__, "__doc__": doc,
                                              "__module__": __name__})


AdEMAMix = _ademamix_class("AdEMAMix", _m.AdEMAMix, None)
AdEMAMix8bit = _ademamix_class("AdEMAMix8bit", _m.AdEMAMix8bit, 8)
AdEMAMix32bit = _ademamix_class("AdEMAMix32bit", _m.AdEMAMix, 32)
PagedAdEMAMix = _ademamix_class("PagedAdEMAMix", _m.AdEMAMix, None, paged=True)
PagedAdEMAMix8bit = _ademamix_class("PagedAdEMAMix8bit", _m.AdEMAMix8bit, 8, paged=True)
PagedAdEMAMix32bit = _ademamix_class("PagedAdEMAMix32bit", _m.AdEMAMix, 32, paged=True)


# -- SGD and RMSprop (bitsandbytes: no is_paged) ----------------------------------------------

def _sgd_class(name, fixed_bits):
    if fixed_bits is None:
        def __init__(self, params, lr, momentum=0, dampening=0, weight_decay=0, nesterov=False,
                     optim_bits=32, args=None, min_8bit_size=4096, percentile_clipping=100,
                     block_wise=True):
            _init_sgd(self, name, params, lr, momentum, dampening, weight_decay, nesterov, optim_bits,
                      args, min_8bit_size, percentile_clipping, block_wise)
    else:
        def __init__(self, params, lr, momentum=0, dampening=0, weight_decay=0, nesterov=False,
                     args=None, min_8bit_size=4096, percentile_clipping=100, block_wise=True):
            _init_sgd(self, name, params, lr, momentum, dampening, weight_decay, nesterov, fixed_bits,
                      args, min_8bit_size, percentile_clipping, block_wise)
    doc = (f"bitsandbytes' ``{name}`` on ``memfit.optim.SGD8bit``'s math (torch.optim.SGD's: "
           "dampening and nesterov honoured; momentum=0, which bitsandbytes refuses, is plain "
           "SGD). See :mod:`memfit.optim.bnb`.")
    return type(name, (_BnbOptimizer, _m.SGD8bit), {"__init__": __init__, "__doc__": doc,
                                                    "__module__": __name__})


def _init_sgd(self, name, params, lr, momentum, dampening, weight_decay, nesterov, optim_bits, args,
              min_8bit_size, percentile_clipping, block_wise):
    bits, min8 = _resolve(name, optim_bits=optim_bits, args=args, min_8bit_size=min_8bit_size,
                          percentile_clipping=percentile_clipping, block_wise=block_wise)
    self._set_bits(bits)
    _m.SGD8bit.__init__(self, params, lr, momentum, dampening, weight_decay, nesterov,
                        min_8bit_size=min8)


SGD = _sgd_class("SGD", None)
SGD8bit = _sgd_class("SGD8bit", 8)
SGD32bit = _sgd_class("SGD32bit", 32)


def _rmsprop_class(name, fixed_bits):
    if fixed_bits is None:
        def __init__(self, params, lr=1e-2, alpha=0.99, eps=1e-8, weight_decay=0, momentum=0,
                     centered=False, optim_bits=32, args=None, min_8bit_size=4096,
                     percentile_clipping=100, block_wise=True):
            _init_rmsprop(self, name, params, lr, alpha, eps, weight_decay, momentum, centered,
                          optim_bits, args, min_8bit_size, percentile_clipping, block_wise)
    else:
        def __init__(self, params, lr=1e-2, alpha=0.99, eps=1e-8, weight_decay=0, momentum=0,
                     centered=False, args=None, min_8bit_size=4096, percentile_clipping=100,
                     block_wise=True):
            _init_rmsprop(self, name, params, lr, alpha, eps, weight_decay, momentum, centered,
                          fixed_bits, args, min_8bit_size, percentile_clipping, block_wise)
    doc = (f"bitsandbytes' ``{name}`` on ``memfit.optim.RMSprop8bit``'s math (torch.optim.RMSprop's; "
           "centered=True is refused, as bitsandbytes does). See :mod:`memfit.optim.bnb`.")
    return type(name, (_BnbOptimizer, _m.RMSprop8bit), {"__init__": __init__, "__doc__": doc,
                                                        "__module__": __name__})


def _init_rmsprop(self, name, params, lr, alpha, eps, weight_decay, momentum, centered, optim_bits,
                  args, min_8bit_size, percentile_clipping, block_wise):
    if centered:
        raise ValueError(f"{name}: centered=True: neither memfit nor bitsandbytes has a centered "
                         "RMSprop; pass centered=False (or use torch.optim.RMSprop)")
    bits, min8 = _resolve(name, optim_bits=optim_bits, args=args, min_8bit_size=min_8bit_size,
                          percentile_clipping=percentile_clipping, block_wise=block_wise)
    self._set_bits(bits)
    _m.RMSprop8bit.__init__(self, params, lr, alpha, eps, weight_decay, momentum, False,
                            min_8bit_size=min8)


RMSprop = _rmsprop_class("RMSprop", None)
RMSprop8bit = _rmsprop_class("RMSprop8bit", 8)
RMSprop32bit = _rmsprop_class("RMSprop32bit", 32)


# -- Adagrad (bitsandbytes: no is_paged; Adagrad8bit's optim_bits defaults to 8) --------------

def _adagrad_class(name, fixed_bits):
    default_bits = 8 if fixed_bits == 8 else 32

    def __init__(self, params, lr=1e-2, lr_decay=0, weight_decay=0, initial_accumulator_value=0,
                 eps=1e-10, optim_bits=default_bits, args=None, min_8bit_size=4096,
                 percentile_clipping=100, block_wise=True):
        bits, min8 = _resolve(name, optim_bits=optim_bits, args=args, min_8bit_size=min_8bit_size,
                              percentile_clipping=percentile_clipping, block_wise=block_wise,
                              fixed_bits=fixed_bits, fixed_default=default_bits)
        self._set_bits(bits)
        _m.Adagrad8bit.__init__(self, params, lr, lr_decay, weight_decay,
                                initial_accumulator_value, eps, min_8bit_size=min8)

    doc = (f"bitsandbytes' ``{name}`` on ``memfit.optim.Adagrad8bit``'s math (torch.optim.Adagrad's: "
           "lr_decay and initial_accumulator_value, which bitsandbytes refuses unless 0, are "
           "honoured). See :mod:`memfit.optim.bnb`.")
    return type(name, (_BnbOptimizer, _m.Adagrad8bit), {"__init__": __init__, "__doc__": doc,
                                                        "__module__": __name__})


Adagrad = _adagrad_class("Adagrad", None)
Adagrad8bit = _adagrad_class("Adagrad8bit", 8)
Adagrad32bit = _adagrad_class("Adagrad32bit", 32)
# -- LAMB and LARS (memfit.optim.trust) -----------------------------------------------------

def _trust_options(name, optim_bits, args, min_8bit_size, percentile_clipping, block_wise,
                   max_unorm, default_unorm, fixed_bits):
    """(bits, min_8bit_size, max_unorm) of a LAMB/LARS call, either spelling: 0.49's
    ``(..., min_8bit_size, percentile_clipping, [block_wise,] max_unorm)`` and 0.50's
    ``(..., min_8bit_size, max_unorm)``, whose positional max_unorm lands in 0.49's
    percentile_clipping slot (a float there is 0.50's max_unorm). 0.49 made these
    non-blockwise (block_wise=False: its 8-bit trust ratio needed it); memfit applies the
    trust ratio to its blockwise states, so either value means the same here."""
    if isinstance(percentile_clipping, float):
        if max_unorm != default_unorm:
            raise TypeError(f"{name}: got a float for percentile_clipping (bitsandbytes 0.50's "
                            "positional max_unorm) together with max_unorm")
        percentile_clipping, max_unorm = 100, percentile_clipping
    if block_wise not in (True, False):
        raise ValueError(f"{name}: block_wise: expected True or False, got {block_wise!r}")
    bits, min8 = _resolve(name, optim_bits=optim_bits, args=args, min_8bit_size=min_8bit_size,
                          percentile_clipping=percentile_clipping, fixed_bits=fixed_bits,
                          trust=True)
    if args is not None:
        max_unorm = _get(args, "max_unorm", max_unorm)
    return bits, min8, max_unorm


def _lamb_class(name, fixed_bits):
    if fixed_bits is None:
        def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8,
                     weight_decay=0, amsgrad=False, adam_w_mode=True, optim_bits=32, args=None,
                     min_8bit_size=4096, percentile_clipping=100, block_wise=False,
                     max_unorm=1.0):
            _init_lamb(self, name, params, lr, bias_correction, betas, eps, weight_decay, amsgrad,
                       adam_w_mode, optim_bits, args, min_8bit_size, percentile_clipping,
                       block_wise, max_unorm, None)
    else:
        def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8,
                     weight_decay=0, amsgrad=False, adam_w_mode=True, args=None,
                     min_8bit_size=4096, percentile_clipping=100, block_wise=False,
                     max_unorm=1.0):
            _init_lamb(self, name, params, lr, bias_correction, betas, eps, weight_decay, amsgrad,
                       adam_w_mode, 32, args, min_8bit_size, percentile_clipping, block_wise,
                       max_unorm, fixed_bits)
    doc = (f"bitsandbytes' ``{name}`` on ``memfit.optim.LAMB8bit``'s math (the trust ratio, "
           "bias_correction and adam_w_mode applied in 8 and 32 bits). See :mod:`memfit.optim.bnb`.")
    return type(name, (_BnbOptimizer, _trust.LAMB8bit), {"__init__": __init__, "__doc__": doc,
                                                         "__module__": __name__})


def _init_lamb(self, name, params, lr, bias_correction, betas, eps, weight_decay, amsgrad,
               adam_w_mode, optim_bits, args, min_8bit_size, percentile_clipping, block_wise,
               max_unorm, fixed_bits):
    _no_amsgrad(name, amsgrad)
    bits, min8, max_unorm = _trust_options(name, optim_bits, args, min_8bit_size,
                                           percentile_clipping, block_wise, max_unorm, 1.0,
                                           fixed_bits)
    self._set_bits(bits)
    _trust.LAMB8bit.__init__(self, params, lr, bias_correction, _string_betas(name, betas, True),
                             eps, weight_decay, False, adam_w_mode, max_unorm=max_unorm,
                             min_8bit_size=min8)


LAMB = _lamb_class("LAMB", None)
LAMB8bit = _lamb_class("LAMB8bit", 8)
LAMB32bit = _lamb_class("LAMB32bit", 32)


def _lars_class(name, fixed_bits):
    if fixed_bits is None:
        def __init__(self, params, lr, momentum=0, dampening=0, weight_decay=0, nesterov=False,
                     optim_bits=32, args=None, min_8bit_size=4096, percentile_clipping=100,
                     max_unorm=0.02):
            _init_lars(self, name, params, lr, momentum, dampening, weight_decay, nesterov,
                       optim_bits, args, min_8bit_size, percentile_clipping, max_unorm, None)
    else:
        def __init__(self, params, lr, momentum=0, dampening=0, weight_decay=0, nesterov=False,
                     args=None, min_8bit_size=4096, percentile_clipping=100, max_unorm=0.02):
            _init_lars(self, name, params, lr, momentum, dampening, weight_decay, nesterov, 32,
                       args, min_8bit_size, percentile_clipping, max_unorm, fixed_bits)
    doc = (f"bitsandbytes' ``{name}`` on ``memfit.optim.LARS8bit``'s math (PytorchLARS': the "
           "trust ratio, dampening and nesterov applied in 8 and 32 bits; momentum=0 raises "
           "NotImplementedError as in bitsandbytes). See :mod:`memfit.optim.bnb`.")
    return type(name, (_BnbOptimizer, _trust.LARS8bit), {"__init__": __init__, "__doc__": doc,
                                                         "__module__": __name__})


def _init_lars(self, name, params, lr, momentum, dampening, weight_decay, nesterov, optim_bits,
               args, min_8bit_size, percentile_clipping, max_unorm, fixed_bits):
    if momentum == 0:  # before the arguments' checks, as bitsandbytes
        raise NotImplementedError("LARS without momentum is not supported!")
    bits, min8, max_unorm = _trust_options(name, optim_bits, args, min_8bit_size,
                                           percentile_clipping, False, max_unorm, 0.02,
                                           fixed_bits)
    self._set_bits(bits)
    _trust.LARS8bit.__init__(self, params, lr, momentum, dampening, weight_decay, nesterov,
                             max_unorm=max_unorm, min_8bit_size=min8)


LARS = _lars_class("LARS", None)
LARS8bit = _lars_class("LARS8bit", 8)
LARS32bit = _lars_class("LARS32bit", 32)


class PytorchLARS(_BnbOptimizer, _trust.LARS):
    """bitsandbytes' ``PytorchLARS`` (its pure-torch LARS) on ``memfit.optim.LARS``'s math,
    float32 states, every parameter (no min_8bit_size). As there, ``momentum=0`` is
    accepted: the update is the (L2-decayed) gradient, scaled by the trust ratio
    (bitsandbytes' own step fails on it). See :mod:`memfit.optim.bnb`."""

    _needs_momentum = False

    def __init__(self, params, lr=0.01, momentum=0, dampening=0, weight_decay=0, nesterov=False,
                 max_unorm=0.02):
        self._set_bits(32)
        _trust.LARS.__init__(self, params, lr, momentum, dampening, weight_decay, nesterov,
                             max_unorm=max_unorm, min_8bit_size=0)


# -- per-parameter overrides -----------------------------------------------------------------

# the override keys that choose a state format, and the values of bitsandbytes' other
# 8-bit options that change nothing (anything else would be ignored: refused instead)
_FORMAT_KEYS = ("optim_bits", "min_8bit_size")
_NEUTRAL = {"percentile_clipping": 100, "block_wise": True, "max_unorm": 0.0, "skip_zeros": False,
            "is_paged": False}


def _check_override(config) -> dict:
    if not isinstance(config, dict):
        raise TypeError(f"config: expected a dict of option -> value, got {type(config).__name__}")
    for key, value in config.items():
        if key == "optim_bits":
            if value not in (8, 32):
                raise ValueError(f"override optim_bits: expected 8 or 32, got {value!r}")
        elif key == "min_8bit_size":
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"override min_8bit_size: expected an int >= 0, got {value!r}")
        elif key in _NEUTRAL:
            _check_bnb_options("override", **{key: value})
        else:
            raise ValueError(
                f"override {key!r}: memfit overrides only the state format per parameter "
                f"({', '.join(_FORMAT_KEYS)}); give a parameter its own {key} with a param group: "
                f"opt = bnb.AdamW8bit([{{'params': [p], {key!r}: ...}}, {{'params': others}}])")
    return {k: v for k, v in config.items() if k in _FORMAT_KEYS}


class GlobalOptimManager:
    """bitsandbytes' singleton of per-parameter option overrides, for the optimizers of
    :mod:`memfit.optim.bnb`. Keys: ``optim_bits`` (32: float32 states for this parameter
    of an 8-bit optimizer) and ``min_8bit_size``; bitsandbytes' other 8-bit options only
    at their neutral values, anything else raises ValueError (use a param group). An
    override takes effect when the parameter's state is created (its first step), so it
    may come before or after the optimizer is built, as in bitsandbytes.

        >>> mng = bnb.optim.GlobalOptimManager.get_instance()  # doctest: +SKIP
        >>> mng.override_config(model.embed.weight, "optim_bits", 32)  # doctest: +SKIP
    """

    _instance = None

    def __init__(self):
        raise RuntimeError("Call get_instance() instead")

    def initialize(self):
        """Forgets every override (bitsandbytes' name)."""
        self._by_param = {}  # id(p) -> (weakref to p, config): ids of dead tensors are reused
        self._by_module = []  # (weakref to module, attribute name, config), resolved per lookup

    @classmethod
    def get_instance(cls):
        if cls._instance is None:
            cls._instance = cls.__new__(cls)
            cls._instance.initialize()
        return cls._instance

    def register_parameters(self, params):
        """Accepted for bitsandbytes' code; overrides are keyed by the parameter itself, so
        registering changes nothing (bitsandbytes >= 0.50 does not need it either)."""
        for group in (list(params) if not isinstance(params, torch.Tensor) else [params]):
            ps = group["params"] if isinstance(group, dict) else [group]
            for p in ([ps] if isinstance(ps, torch.Tensor) else ps):
                if not isinstance(p, torch.Tensor):
                    raise TypeError(f"params: expected tensors or param groups, got {type(p).__name__}")

    def override_config(self, parameters, key=None, value=None, key_value_dict=None):
        """Overrides options of ``parameters`` (a tensor or a list of them): ``key`` and
        ``value``, or several in ``key_value_dict``."""
        if key is not None and value is not None:
            if key_value_dict is not None:
                raise ValueError("override_config: give key and value, or key_value_dict, not both")
            key_value_dict = {key: value}
        if key_value_dict is None:
            return
        config = _check_override(key_value_dict)
        for p in ([parameters] if isinstance(parameters, torch.Tensor) else list(parameters)):
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"parameters: expected a tensor or a list of tensors, got {type(p).__name__}")
            ref, old = self._by_param.get(id(p), (None, {}))
            merged = dict(old if ref is not None and ref() is p else {}, **config)
            self._by_param[id(p)] = (weakref.ref(p), merged)

    def register_module_override(self, module, param_name, config):
        """Overrides options of ``getattr(module, param_name)`` (bitsandbytes' StableEmbedding
        registers ``(self, "weight", {"optim_bits": 32})``)."""
        if not isinstance(getattr(module, param_name, None), torch.Tensor):
            raise ValueError(f"register_module_override: {type(module).__name__} has no tensor "
                             f"attribute {param_name!r}")
        self._by_module.append((weakref.ref(module), param_name, _check_override(config)))

    def _config_for(self, p) -> dict:
        config = {}
        for ref, name, cfg in self._by_module:
            module = ref()
            if module is not None and getattr(module, name, None) is p:
                config.update(cfg)
        ref, cfg = self._by_param.get(id(p), (None, None))
        if ref is not None and ref() is p:
            config.update(cfg)
        return config
