"""Pieces shared by the torch optimizers and the functional API: optimizer kinds,
state layouts, code tables, and the call into the C core.

Nothing here imports torch: the functional API works on NumPy/CuPy/DLPack arrays.
"""

from __future__ import annotations

import threading

import numpy as np

from memfit import _C, _arrays
from memfit.quant import dynamic_map

# Kinds, as numbered in csrc/include/memfit/optim.h (mf_optim_kind).
ADAMW, ADAM, LION, SGD, RMSPROP = 0, 1, 2, 3, 4
KIND_NAMES = {ADAMW: "AdamW", ADAM: "Adam", LION: "Lion", SGD: "SGD", RMSPROP: "RMSprop"}

# torch's names for state1 / state2 of each kind (what dequantized_state returns).
STATE_NAMES = {
    ADAMW: ("exp_avg", "exp_avg_sq"),
    ADAM: ("exp_avg", "exp_avg_sq"),
    LION: ("exp_avg",),
    SGD: ("momentum_buffer",),
    RMSPROP: ("square_avg", "momentum_buffer"),
}

DEFAULT_BLOCK = {8: 256, 4: 128, 32: 256}


def num_states(kind: int, momentum: float = 0.0) -> int:
    """States per element (mf_optim_num_states)."""
    if kind in (ADAMW, ADAM):
        return 2
    if kind == LION:
        return 1
    if kind == SGD:
        return 1 if momentum != 0 else 0
    return 2 if momentum != 0 else 1


def state_signed(kind: int, k: int) -> bool:
    """Whether state k (1 or 2) is signed (mf_optim_state_signed)."""
    return k == 2 if kind == RMSPROP else k == 1


def state_numel(bits: int, n: int) -> int:
    return (n + 1) // 2 if bits == 4 else n


def num_blocks(n: int, block_size: int) -> int:
    return (n + block_size - 1) // block_size


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
        return dynamic_map(signed=signed)
    if bits == 4:
        if signed:
            return dynamic_map(signed=True, total_bits=4, max_exponent_bits=3)
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


def hparams(lr=0.0, beta1=0.0, beta2=0.0, eps=0.0, weight_decay=0.0, momentum=0.0,
            dampening=0.0, alpha=0.0, nesterov=False, maximize=False, sr_seed=0) -> tuple:
    """The tuple the C binding takes (mf_optim_hparams). ``sr_seed`` != 0 writes
    half-precision parameters with stochastic rounding seeded by it."""
    return (float(lr), float(beta1), float(beta2), float(eps), float(weight_decay),
            float(momentum), float(dampening), float(alpha), bool(nesterov), bool(maximize),
            int(sr_seed) & ((1 << 64) - 1))


def sr_seed(base: int, step: int, bucket: int) -> int:
    """The stochastic-rounding seed of one step call: a mix of the group's base seed,
    its step counter and the bucket (device, state format) being stepped; never 0."""
    z = (int(base) * 0x9E3779B97F4A7C15 + int(step) * 0xBF58476D1CE4E5B9 + int(bucket) + 1) & ((1 << 64) - 1)
    z = ((z ^ (z >> 30)) * 0x94D049BB133111EB) & ((1 << 64) - 1)
    return (z ^ (z >> 31)) | 1


def check(kind: int, hp: tuple) -> None:
    """Raises ValueError (naming the argument) for out-of-range hyperparameters."""
    _C.optim_check(kind, hp)


def step(kind, bits, block_size, hp, params, grads, state1, absmax1, state2, absmax2,
         steps, grad_scale=None, found_inf=None, stream=0, comps=None):
    """One fused step over lists of arrays on one device (see mf_optim_step).
    ``comps``: None, or one Kahan compensation buffer (or None) per parameter: an array
    of the parameter's float16/bfloat16 dtype and size (see csrc/include/memfit/optim.h)."""
    ns = num_states(kind, hp[5])
    code1 = code2 = None
    if bits != 32 and params:
        if ns >= 1:
            code1 = code_like(bits, state_signed(kind, 1), params[0])
        if ns >= 2:
            code2 = code_like(bits, state_signed(kind, 2), params[0])
    if comps is not None and all(c is None for c in comps):
        comps = None
    _C.optim_step(kind, bits, block_size, hp, code1, code2, params, grads, state1, absmax1,
                  state2, absmax2, steps, grad_scale, found_inf, stream, comps)
