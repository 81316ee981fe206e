"""Pieces shared by the torch optimizers and the functional API: optimizer kinds,
state layouts, code tables, and the call into the C core.

Nothing here imports torch: the functional API works on NumPy/CuPy/DLPack arrays.
"""

from __future__ import annotations

import threading

import numpy as np

from memfit import _C, _arrays
from memfit import quant as _quant

_CONSTANTS = _C.optim_constants()

# Kinds, as numbered in csrc/include/memfit/optim.h (mf_optim_kind).
_KIND = _CONSTANTS["kinds"]
ADAMW, ADAM, LION, SGD, RMSPROP, MUON, ADAGRAD, ADEMAMIX = (
    _KIND[k] for k in ("AdamW", "Adam", "Lion", "SGD", "RMSprop", "Muon", "Adagrad", "AdEMAMix"))
KIND_NAMES = {number: name for name, number in _KIND.items()}

# torch's names for state1 / state2 (/ state3) of each kind (what dequantized_state returns).
STATE_NAMES = {
    ADAMW: ("exp_avg", "exp_avg_sq"),
    ADAM: ("exp_avg", "exp_avg_sq"),
    LION: ("exp_avg",),
    SGD: ("momentum_buffer",),
    RMSPROP: ("square_avg", "momentum_buffer"),
    MUON: ("momentum_buffer",),  # its step writes the update into `params` (optim.h)
    ADAGRAD: ("sum",),
    # the names of the AdEMAMix paper's reference implementation
    ADEMAMIX: ("exp_avg", "exp_avg_sq", "exp_avg_slow"),
}

# {bits: default block size} (MF_OPTIM_BLOCK_8BIT/4BIT) and the block sizes the kernels take.
DEFAULT_BLOCK = _CONSTANTS["default_block_size"]
BLOCK_SIZES = _quant.BLOCK_SIZES


def state_layout(kind: int, bits: int, block_size: int, numel: int, momentum: float = 0.0,
                 rows: int = 1) -> dict:
    """The states a parameter of ``numel`` elements in ``rows`` rows needs, as the C core
    defines and checks them (mf_optim_state_layout; the rows of the quantization blocks
    are described in csrc/include/memfit/optim.h, mf_optim_row): ``num_states`` (0 to
    3), ``signed`` (a triple: per state), ``state_dtype`` ("float32" or "uint8"), ``rows``,
    ``state_row_numel`` and ``blocks_per_row``, and their products ``state_numel`` and
    ``absmax_numel`` (per state; 0 for float32 states)."""
    return _C.optim_state_layout(kind, bits, block_size, numel, float(momentum), rows)


def code_table(bits: int, signed: bool) -> np.ndarray:
    """The code a quantized state uses.

    8-bit: the dynamic (tree) map, signed for first moments / momenta, unsigned for
    second moments (as bitsandbytes). 4-bit: the signed dynamic map with 3 exponent
    bits for first moments, and for second moments the linear map without zero,
    ``k/16`` for ``k = 1..16`` (Li et al. 2023, "Memory Efficient Optimizers with
    4-bit States"): a second moment quantized to 0 would divide a non-zero first
    moment by eps.
    """
    if bits == 8:
        return _quant.dynamic_map(signed=signed)
    if bits == 4:
        if signed:
            return _quant.dynamic_map(signed=True, total_bits=4, max_exponent_bits=3)
        return (np.arange(1, 17, dtype=np.float64) / 16.0).astype(np.float32)
    raise ValueError(f"bits: expected 8 or 4, got {bits}")


_codes: dict = {}
_codes_lock = threading.Lock()


def code_like(bits: int, signed: bool, like):
    """code_table(bits, signed) in `like`'s framework and device, cached."""
    key = (_arrays.device_key(like), bits, signed)
    with _codes_lock:
        c = _codes.get(key)
        if c is None:
            c = _arrays.to_like(code_table(bits, signed), like)
            _codes[key] = c
    return c


# the largest float32: the kernels compute in float32 (mf_optim_consts) and keep their
# states in it; a larger hyperparameter would become Inf there (frozen or NaN training)
FLOAT32_MAX = float(np.finfo(np.float32).max)
# the hyperparameters the kernels round to float32 (t_alpha, t_beta3 and lr_decay stay
# in double: mf_optim_prepare)
_FLOAT32_HPARAMS = ("lr", "beta1", "beta2", "beta3", "eps", "weight_decay", "momentum",
                    "dampening", "alpha", "max_unorm")


def hparams(lr=0.0, beta1=0.0, beta2=0.0, eps=0.0, weight_decay=0.0, momentum=0.0,
            dampening=0.0, alpha=0.0, nesterov=False, maximize=False, sr_seed=0,
            lr_decay=0.0, max_unorm=0.0, bias_correction=True, beta3=0.0, t_alpha=0,
            t_beta3=0) -> dict:
    """The hyperparameters by name, as the C binding parses them (mf_optim_hparams).
    ``sr_seed`` != 0 writes half-precision parameters with stochastic rounding seeded
    by it; ``max_unorm`` > 0 scales each tensor's update by its trust ratio (LAMB, LARS:
    :func:`step` then needs ``trust``). ``beta3``, ``t_alpha``, ``t_beta3``: AdEMAMix's
    (0: no scheduler). A finite value beyond float32's range where the kernels compute
    in float32 (``_FLOAT32_HPARAMS``), or beyond a double's anywhere, is refused
    (MemfitValueError naming it); NaN, Inf and out-of-range values are the core's to
    refuse (:func:`check`)."""
    out = {"lr": _real("lr", lr), "beta1": _real("beta1", beta1), "beta2": _real("beta2", beta2),
           "eps": _real("eps", eps), "weight_decay": _real("weight_decay", weight_decay),
           "momentum": _real("momentum", momentum), "dampening": _real("dampening", dampening),
           "alpha": _real("alpha", alpha), "lr_decay": _real("lr_decay", lr_decay),
           "nesterov": bool(nesterov),
           "maximize": bool(maximize), "sr_seed": int(sr_seed) & ((1 << 64) - 1),
           "max_unorm": _real("max_unorm", max_unorm),
           "no_bias_correction": not bias_correction,
           "beta3": _real("beta3", beta3), "t_alpha": _real("t_alpha", t_alpha),
           "t_beta3": _real("t_beta3", t_beta3)}
    for name in _FLOAT32_HPARAMS:
        check_float32(name, out[name])
    return out


def check_float32(name: str, value: float) -> None:
    """Refuses a finite ``value`` that float32 cannot hold (it would be Inf there)."""
    if FLOAT32_MAX < abs(value) < float("inf"):
        raise _C.MemfitValueError(
            f"{name}: {value!r} is beyond float32's range (|{name}| <= {FLOAT32_MAX:.8g}), in "
            "which the optimizer computes and keeps its states: it would be Inf there")


def _real(name: str, value) -> float:
    """float(value), or the error naming the hyperparameter (a Tensor lr of two
    elements, a string, an int too large for a double): float() alone says neither
    which value nor what it needs."""
    try:
        return float(value)
    except OverflowError:
        got = (f"an int of {value.bit_length()} bits" if isinstance(value, int) else repr(value))
        raise _C.MemfitValueError(f"{name}: {got} is too large for a floating-point number (a "
                                  "double: about 1.8e308 at most)") from None
    except (TypeError, ValueError):
        shape = getattr(value, "shape", None)
        got = f"an array of shape {tuple(shape)}" if shape is not None else repr(value)
        raise (TypeError if isinstance(value, (str, bytes)) or shape is None else ValueError)(
            f"{name}: expected a real number (or a one-element tensor), got {got}") from None


_MASK64 = (1 << 64) - 1
# mf_optim_store_param hashes tensor number `stream` of a step call with the seed
# sr_seed + _GOLDEN * (stream + 1) (csrc/include/memfit/optim.h; the binding numbers
# the tensors of one call 0, 1, ... as int32, so a call has fewer than 2**31)
_GOLDEN = 0x9E3779B97F4A7C15
_MAX_STREAMS = 1 << 31
# _GOLDEN's inverse mod 2**64: the position k at which sr_seed + _GOLDEN * k is 0
_GOLDEN_INV = pow(_GOLDEN, -1, 1 << 64)


def sr_seed(base: int, step: int, bucket: int) -> int:
    """The stochastic-rounding seed of one step call: a mix of the group's base seed,
    its step counter and the bucket (device, state format) being stepped. Never 0, nor
    is any :func:`stream_seed` of it (0 means "no stochastic rounding" to the core)."""
    z = (int(base) * _GOLDEN + int(step) * 0xBF58476D1CE4E5B9 + int(bucket) + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0x94D049BB133111EB) & _MASK64
    seed = (z ^ (z >> 31)) | 1
    if (-seed * _GOLDEN_INV) & _MASK64 < _MAX_STREAMS:
        # seed + _GOLDEN * k == 0 for a position k a call can have (once in 2**33 seeds):
        # this shift moves that k to 2**64 - 2**32 + k, out of reach, and keeps seed odd
        seed = (seed + _GOLDEN * (1 << 32)) & _MASK64
    return seed


def stream_seed(seed: int, position: int) -> int:
    """The seed that makes a call's first tensor (stream 0) draw the stochastic-rounding
    bits that tensor number ``position`` of a call seeded ``seed`` draws: one tensor of
    a bucket stepped on its own gets the bits of the whole bucket's call. Not 0 for a
    ``seed`` from :func:`sr_seed`."""
    if not 0 <= position < _MAX_STREAMS:
        raise ValueError(f"position: expected 0 <= position < 2**31 (a tensor's place in one "
                         f"step call), got {position}")
    return (int(seed) + _GOLDEN * position) & _MASK64


def cast_seed(seed: int, first: int) -> int:
    """The seed under which element i of a :func:`memfit.cast` draws the stochastic-rounding
    bits that element ``first + i`` draws under ``seed`` (the cast hashes element i by
    seed + _GOLDEN * (i + 1): numeric.h's mf_hash64): a shard that starts at element
    ``first`` of a tensor rounds as the whole tensor's cast would round those elements."""
    return (int(seed) + _GOLDEN * int(first)) & _MASK64


def check(kind: int, hp: dict) -> None:
    """Raises ValueError (naming the argument) for out-of-range hyperparameters."""
    _C.optim_check(kind, hp)


def codes_for(kind: int, bits: int, hp: dict, like) -> tuple:
    """(code1, code2): the code tables of the quantized states of this optimizer, in
    ``like``'s framework and device (None where there is no such state). A third state
    (AdEMAMix) is signed and uses code1 (csrc/include/memfit/optim.h)."""
    if bits == 32:
        return None, None
    layout = state_layout(kind, bits, DEFAULT_BLOCK[bits], 0, hp["momentum"])
    return tuple(code_like(bits, layout["signed"][k], like) if k < layout["num_states"] else None
                 for k in range(2))


def step(kind, bits, block_size, hp, params, grads, state1, absmax1, state2, absmax2,
         steps, grad_scale=None, found_inf=None, stream=0, comps=None, rows=None,
         index_base=None, trust=None, state3=None, absmax3=None):
    """One fused step over lists of arrays on one device (see mf_optim_step). ``hp``: a
    dict from :func:`hparams`. ``comps``: None, or one Kahan compensation buffer (or
    None) per parameter: an array of the parameter's float16/bfloat16 dtype and size
    (see csrc/include/memfit/optim.h). ``rows``: None (whole tensors) or the rows of each
    parameter's quantization blocks; ``index_base``: None, or per parameter the number
    of its element 0 in the tensor it is a shard of (stochastic rounding draws by it).
    ``trust``: with ``hp["max_unorm"]`` > 0, per parameter a float32 array of
    :func:`trust_numel` elements, 8-byte aligned (a float64 array viewed as float32): the
    trust ratio's scratch. ``state3``, ``absmax3``: None, or the third state's lists
    (AdEMAMix)."""
    code1, code2 = codes_for(kind, bits, hp, params[0]) if params else (None, None)
    if comps is not None and all(c is None for c in comps):
        comps = None
    _C.optim_step(kind, bits, block_size, hp, params, grads, state1, absmax1, state2, absmax2,
                  steps, code1=code1, code2=code2, grad_scale=grad_scale, found_inf=found_inf,
                  stream=stream, comps=comps, rows=rows, index_base=index_base, trust=trust,
                  state3=state3, absmax3=absmax3)


# mf_optim_trust_numel (csrc/include/memfit/optim.h): float32 words of the trust ratio's
# scratch, two float64 per chunk of TRUST_CHUNK elements and two for the totals
TRUST_CHUNK = 4096


def trust_numel(numel: int) -> int:
    """float32 elements of the trust ratio's scratch for a parameter of ``numel``."""
    return 4 * (-(-int(numel) // TRUST_CHUNK) + 1)
