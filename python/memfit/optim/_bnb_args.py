"""bitsandbytes' constructor arguments as memfit.optim.bnb's classes take them: both
spellings (0.49's and 0.50's, by keyword and positionally), ``args`` objects, string
betas, and the refusals of what memfit does not do (paged states, percentile clipping,
non-blockwise quantization, AMSGrad), each saying what memfit does instead."""

from __future__ import annotations

import ast
import numbers

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
