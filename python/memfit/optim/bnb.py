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

The module is split by capability: the argument mapping (memfit.optim._bnb_args), the
overrides and the shims' mixin (_bnb_overrides), and the classes (_bnb_classes,
_bnb_trust); every name is imported from here, as ever.
"""

from __future__ import annotations

import sys

from memfit.optim._bnb_classes import (  # noqa: F401 (memfit.optim.bnb's names)
    Adagrad,
    Adagrad8bit,
    Adagrad32bit,
    AdEMAMix,
    AdEMAMix8bit,
    AdEMAMix32bit,
    Adam,
    Adam8bit,
    Adam32bit,
    AdamW,
    AdamW8bit,
    AdamW32bit,
    Lion,
    Lion8bit,
    Lion32bit,
    PagedAdEMAMix,
    PagedAdEMAMix8bit,
    PagedAdEMAMix32bit,
    PagedAdam,
    PagedAdam8bit,
    PagedAdam32bit,
    PagedAdamW,
    PagedAdamW8bit,
    PagedAdamW32bit,
    PagedLion,
    PagedLion8bit,
    PagedLion32bit,
    RMSprop,
    RMSprop8bit,
    RMSprop32bit,
    SGD,
    SGD8bit,
    SGD32bit,
)
from memfit.optim._bnb_overrides import GlobalOptimManager  # noqa: F401
from memfit.optim._bnb_trust import (  # noqa: F401 (memfit.optim.bnb's names)
    LAMB,
    LAMB8bit,
    LAMB32bit,
    LARS,
    LARS8bit,
    LARS32bit,
    PytorchLARS,
)

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
