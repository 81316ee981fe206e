"""The optimizers: drop-in replacements for torch.optim.AdamW & co. and for
bitsandbytes' 8-bit optimizers, with the same argument names.

Common keyword options (also settable per param group):
    maximize: maximize the objective instead of minimizing (as torch).
    block_size: elements per quantization block (256 for 8-bit, 128 for 4-bit).
    min_8bit_size: parameters with fewer elements keep float32 states (as
        bitsandbytes; default 4096). Applies to the 4-bit optimizer too.
    bits: per param group, 8, 4 or 32 (32: float32 states), overriding the class.
    bf16_stochastic_round: bfloat16/float16 parameters are written from the float32
        update with stochastic rounding (the default, None, means True unless
        ``kahan=True``), so updates smaller than half a bfloat16 step are kept on
        average and no float32 master copy is needed; False rounds to nearest-even.
        Reproducible: seeded by the group's ``sr_seed`` (default 0) and step counter,
        both saved in the state dict.
    kahan: bfloat16/float16 parameters keep a Kahan compensation buffer (state
        ``kahan_comp``, the parameter's dtype: 2 bytes per parameter) that holds what
        nearest rounding cut off, so small updates accumulate deterministically; the
        update reads ``param + kahan_comp``. Default False. Cannot be combined with
        ``bf16_stochastic_round=True`` (ValueError). float32 parameters need no buffer:
        for them ``kahan`` changes nothing and adds no state.

torch's flags, taken by every class so that ``torch.optim.AdamW(..., fused=True)``
becomes ``memfit.optim.AdamW8bit(..., fused=True)``, and kept in the param groups (and
state dicts) where torch's class of the same kind keeps them (Adam/AdamW all four, SGD
fused/foreach/differentiable, RMSprop capturable/foreach/differentiable, Adagrad
fused/foreach/differentiable, Lion none):
    fused: memfit always steps with its own fused kernel (one call per device and state
        format); True and None (the default) say so, False is accepted and changes
        nothing (there is no unfused path).
    foreach: no effect (None, True or False); True together with fused=True is refused
        with RuntimeError, as torch does.
    capturable: only False. memfit's step keeps no host-side state that a CUDA graph
        could replay except its stochastic-rounding step counter, which a replay would
        not advance: True is refused (ValueError).
    differentiable: only False. The step runs in C/CUDA kernels outside autograd:
        True is refused (ValueError); use torch.optim for a differentiable step.
Parameters must be float32, float16 or bfloat16, dense (strided) tensors: others are
refused by the constructor, add_param_group, and (after ``model.double()``) step.
"""

from __future__ import annotations

import numbers

import torch

from memfit.optim import _core
from memfit.optim._torch import _MemfitOptimizer

__all__ = ["AdEMAMix", "AdEMAMix8bit", "Adagrad", "Adagrad8bit", "Adam", "Adam8bit", "AdamW",
           "AdamW4bit", "AdamW8bit", "Lion8bit", "RMSprop8bit", "SGD8bit"]


def _betas(betas, count=2):
    """``betas`` as ``count`` floats (a pair; AdEMAMix's three), checked as torch checks them."""
    try:
        values = tuple(betas)
    except TypeError:
        values = ()
    if len(values) != count:
        want = "a pair (beta1, beta2)" if count == 2 else "three betas (beta1, beta2, beta3)"
        raise ValueError(f"betas: expected {want}, got {betas!r}")
    if len({torch.is_tensor(b) for b in values}) > 1:  # as torch.optim.Adam & co.
        raise ValueError(f"betas must be either both floats or both Tensors, got {betas!r}")
    return tuple(float(b) for b in values)


_AMSGRAD = ("amsgrad", False, "memfit's Adam keeps no max_exp_avg_sq state (AMSGrad); "
                              "pass amsgrad=False")


class _AdamBase(_MemfitOptimizer):
    _kind = _core.ADAMW
    # what amsgrad and decoupled_weight_decay must be (see _MemfitOptimizer._fixed_options)
    _fixed_options = (_AMSGRAD, (
        "decoupled_weight_decay", True,
        "this class applies weight decay decoupled (AdamW); for L2 decay added to the "
        "gradient (torch.optim.Adam's) use memfit.optim.Adam8bit or Adam"))

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 amsgrad=False, *, maximize=False, block_size=None, min_8bit_size=4096,
                 bf16_stochastic_round=None, kahan=False, decoupled_weight_decay=None,
                 **torch_flags):
        # decoupled_weight_decay: torch.optim.Adam's keyword (None: this class's own way,
        # the other is refused with advice, by the group check)
        if decoupled_weight_decay is None:
            decoupled_weight_decay = self._fixed_options[1][1]
        super().__init__(params, dict(lr=lr, betas=_betas(betas), eps=eps,
                                      weight_decay=weight_decay, amsgrad=amsgrad,
                                      decoupled_weight_decay=decoupled_weight_decay),
                         maximize=maximize, block_size=block_size, min_8bit_size=min_8bit_size,
                         bf16_stochastic_round=bf16_stochastic_round, kahan=kahan, **torch_flags)

    def _hparams(self, group):
        b1, b2 = _betas(group["betas"])
        return _core.hparams(lr=group["lr"], beta1=b1, beta2=b2, eps=group["eps"],
                             weight_decay=group["weight_decay"], maximize=group["maximize"])


class AdamW8bit(_AdamBase):
    """AdamW (decoupled weight decay, as torch.optim.AdamW) with 8-bit blockwise states:
    ``exp_avg`` in the signed and ``exp_avg_sq`` in the unsigned dynamic map, one
    float32 absmax per 256 elements; about 2 bytes of state per parameter instead of 8.

    Args: as torch.optim.AdamW (``amsgrad`` must stay False), plus ``block_size`` and
    ``min_8bit_size`` (see :mod:`memfit.optim.optimizers`).
    """

    _kind = _core.ADAMW
    _bits = 8


class _AdamL2Base(_AdamBase):
    """Adam with torch.optim.Adam's default (no weight decay); decay is L2, added to the
    gradient."""

    _kind = _core.ADAM
    _fixed_options = (_AMSGRAD, (
        "decoupled_weight_decay", False,
        "this class applies weight decay as L2, added to the gradient (torch.optim.Adam's "
        "default); for decoupled decay use memfit.optim.AdamW8bit or AdamW"))

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 amsgrad=False, *, maximize=False, block_size=None, min_8bit_size=4096,
                 bf16_stochastic_round=None, kahan=False, decoupled_weight_decay=None,
                 **torch_flags):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, maximize=maximize,
                         block_size=block_size, min_8bit_size=min_8bit_size,
                         bf16_stochastic_round=bf16_stochastic_round, kahan=kahan,
                         decoupled_weight_decay=decoupled_weight_decay, **torch_flags)


class Adam8bit(_AdamL2Base):
    """Adam (L2 weight decay added to the gradient, as torch.optim.Adam) with 8-bit states."""

    _bits = 8


class AdamW4bit(_AdamBase):
    """AdamW with 4-bit states (two codes per byte, block size 128): ``exp_avg`` in a
    16-value signed dynamic map, ``exp_avg_sq`` in the linear map k/16, k = 1..16 (no
    zero). About 1 byte of state per parameter."""

    _kind = _core.ADAMW
    _bits = 4


class AdamW(_AdamBase):
    """torch.optim.AdamW on memfit's fused kernel, float32 states (``bits=32``)."""

    _kind = _core.ADAMW
    _bits = 32


class Adam(_AdamL2Base):
    """torch.optim.Adam on memfit's fused kernel, float32 states."""

    _bits = 32


class Lion8bit(_MemfitOptimizer):
    """Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms") with an
    8-bit ``exp_avg``: ``p -= lr * (sign(beta1*m + (1-beta1)*g) + weight_decay*p)``,
    then ``m = beta2*m + (1-beta2)*g``. Defaults as bitsandbytes' Lion8bit."""

    _kind = _core.LION
    _bits = 8
    _TORCH_FLAGS = dict(maximize=False)  # as lion-pytorch's Lion (torch has none)

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0, *,
                 maximize=False, block_size=None, min_8bit_size=4096,
                 bf16_stochastic_round=None, kahan=False, **torch_flags):
        super().__init__(params, dict(lr=lr, betas=_betas(betas), weight_decay=weight_decay),
                         maximize=maximize, block_size=block_size, min_8bit_size=min_8bit_size,
                         bf16_stochastic_round=bf16_stochastic_round, kahan=kahan, **torch_flags)

    def _hparams(self, group):
        b1, b2 = _betas(group["betas"])
        return _core.hparams(lr=group["lr"], beta1=b1, beta2=b2,
                             weight_decay=group["weight_decay"], maximize=group["maximize"])


class SGD8bit(_MemfitOptimizer):
    """torch.optim.SGD with an 8-bit ``momentum_buffer`` (signed dynamic map). With
    ``momentum=0`` there is no state and this is plain SGD."""

    _kind = _core.SGD
    _bits = 8
    _TORCH_FLAGS = dict(maximize=False, foreach=None, differentiable=False, fused=None)

    def __init__(self, params, lr=1e-3, momentum=0.0, dampening=0.0, weight_decay=0.0,
                 nesterov=False, *, maximize=False, block_size=None, min_8bit_size=4096,
                 bf16_stochastic_round=None, kahan=False, **torch_flags):
        super().__init__(params, dict(lr=lr, momentum=momentum, dampening=dampening,
                                      weight_decay=weight_decay, nesterov=nesterov),
                         maximize=maximize, block_size=block_size, min_8bit_size=min_8bit_size,
                         bf16_stochastic_round=bf16_stochastic_round, kahan=kahan, **torch_flags)

    def _hparams(self, group):
        return _core.hparams(lr=group["lr"], momentum=group["momentum"],
                             dampening=group["dampening"], weight_decay=group["weight_decay"],
                             nesterov=group["nesterov"], maximize=group["maximize"])


class RMSprop8bit(_MemfitOptimizer):
    """torch.optim.RMSprop with an 8-bit ``square_avg`` (unsigned dynamic map) and, when
    ``momentum > 0``, an 8-bit ``momentum_buffer``. ``centered=True`` is not supported."""

    _kind = _core.RMSPROP
    _bits = 8
    _TORCH_FLAGS = dict(maximize=False, capturable=False, foreach=None, differentiable=False)
    _fixed_options = (("centered", False, "RMSprop8bit keeps no grad_avg state (centered "
                                          "RMSprop); pass centered=False"),)

    def __init__(self, params, lr=1e-2, alpha=0.99, eps=1e-8, weight_decay=0.0, momentum=0.0,
                 centered=False, *, maximize=False, block_size=None, min_8bit_size=4096,
                 bf16_stochastic_round=None, kahan=False, **torch_flags):
        super().__init__(params, dict(lr=lr, alpha=alpha, eps=eps, weight_decay=weight_decay,
                                      momentum=momentum, centered=centered),
                         maximize=maximize, block_size=block_size, min_8bit_size=min_8bit_size,
                         bf16_stochastic_round=bf16_stochastic_round, kahan=kahan, **torch_flags)

    def _hparams(self, group):
        return _core.hparams(lr=group["lr"], alpha=group["alpha"], eps=group["eps"],
                             weight_decay=group["weight_decay"], momentum=group["momentum"],
                             maximize=group["maximize"])


class _AdagradBase(_MemfitOptimizer):
    """torch.optim.Adagrad's math: with ``clr = lr / (1 + (t - 1) * lr_decay)`` at step t,
    ``g += weight_decay * p`` (L2), ``sum += g * g``, ``p -= clr * g / (sqrt(sum) + eps)``;
    ``sum`` starts at ``initial_accumulator_value``."""

    _kind = _core.ADAGRAD
    _TORCH_FLAGS = dict(maximize=False, foreach=None, differentiable=False, fused=None)

    def __init__(self, params, lr=1e-2, lr_decay=0, weight_decay=0, initial_accumulator_value=0,
                 eps=1e-10, foreach=None, *, maximize=False, differentiable=False, fused=None,
                 block_size=None, min_8bit_size=4096, bf16_stochastic_round=None, kahan=False,
                 **torch_flags):
        super().__init__(params, dict(lr=lr, lr_decay=lr_decay, weight_decay=weight_decay,
                                      initial_accumulator_value=initial_accumulator_value, eps=eps),
                         maximize=maximize, block_size=block_size, min_8bit_size=min_8bit_size,
                         bf16_stochastic_round=bf16_stochastic_round, kahan=kahan, foreach=foreach,
                         differentiable=differentiable, fused=fused, **torch_flags)

    @staticmethod
    def _initial_value(group) -> float:
        """The group's initial_accumulator_value, checked as torch checks it (and finite
        in float32, the state's dtype: states never hold Inf)."""
        value = _core._real("initial_accumulator_value", group["initial_accumulator_value"])
        if not 0.0 <= value < float("inf"):
            raise ValueError(f"initial_accumulator_value: invalid value {value!r} (must be a "
                             "finite number >= 0)")
        _core.check_float32("initial_accumulator_value", value)  # the sum starts at it
        return value

    def _hparams(self, group):
        self._initial_value(group)  # checked wherever the group is (check_group calls this)
        return _core.hparams(lr=group["lr"], lr_decay=group["lr_decay"], eps=group["eps"],
                             weight_decay=group["weight_decay"], maximize=group["maximize"])

    def _initial_state(self, group, p, key, shape, dtype):
        """``sum`` starts at initial_accumulator_value v, as torch's: float32 states full of
        v; quantized ones as every element at the code value 1.0 (the top of the unsigned
        code) times a block absmax of v, which reads back as v exactly."""
        state = super()._initial_state(group, p, key, shape, dtype)
        value = self._initial_value(group)
        if not value or key not in ("state1", "absmax1"):
            return state
        if key == "absmax1" or dtype == torch.float32:
            return state.fill_(value)
        bits = self._format(group, p)
        top = len(_core.code_table(bits, False)) - 1  # the unsigned codes end at 1.0
        if bits == 8:
            return state.fill_(top)
        state.fill_(top | top << 4)  # two 4-bit codes per byte
        if (p.numel() // shape[0]) % 2:
            state[:, -1] = top  # an odd row's last byte holds one code (high nibble 0)
        return state


class Adagrad8bit(_AdagradBase):
    """torch.optim.Adagrad with an 8-bit ``sum`` (unsigned dynamic map, one float32 absmax
    per 256 elements): 1 byte of state per parameter instead of 4. Same signature and
    defaults as torch.optim.Adagrad (``lr_decay`` and ``initial_accumulator_value``
    included), plus memfit's options (see :mod:`memfit.optim.optimizers`).

        >>> opt = memfit.optim.Adagrad8bit(model.parameters(), lr=1e-2)  # doctest: +SKIP
    """

    _bits = 8


class Adagrad(_AdagradBase):
    """torch.optim.Adagrad on memfit's fused kernel, float32 ``sum``.

        >>> opt = memfit.optim.Adagrad(model.parameters(), lr=1e-2, lr_decay=1e-4)  # doctest: +SKIP
    """

    _bits = 32


def _schedule_steps(name, value):
    """AdEMAMix's t_alpha / t_beta3: None (no scheduler) or a positive int; as the core
    takes it (0 for None)."""
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}: expected None or a positive int (a number of steps), got {value!r}")
    if int(value) <= 0:
        raise ValueError(f"{name}: expected None or a positive int (a number of steps), got {value!r}")
    return int(value)


class _AdEMAMixBase(_MemfitOptimizer):
    _kind = _core.ADEMAMIX
    _TORCH_FLAGS = dict(maximize=False)  # torch has no AdEMAMix; bitsandbytes keeps none

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999, 0.9999), alpha=5.0, t_alpha=None,
                 t_beta3=None, eps=1e-8, weight_decay=1e-2, *, maximize=False, block_size=None,
                 min_8bit_size=4096, bf16_stochastic_round=None, kahan=False, **torch_flags):
        super().__init__(params, dict(lr=lr, betas=_betas(betas, 3), alpha=alpha, t_alpha=t_alpha,
                                      t_beta3=t_beta3, eps=eps, weight_decay=weight_decay),
                         maximize=maximize, block_size=block_size, min_8bit_size=min_8bit_size,
                         bf16_stochastic_round=bf16_stochastic_round, kahan=kahan, **torch_flags)

    def _hparams(self, group):
        b1, b2, b3 = _betas(group["betas"], 3)
        return _core.hparams(lr=group["lr"], beta1=b1, beta2=b2, beta3=b3, alpha=group["alpha"],
                             t_alpha=_schedule_steps("t_alpha", group["t_alpha"]),
                             t_beta3=_schedule_steps("t_beta3", group["t_beta3"]),
                             eps=group["eps"], weight_decay=group["weight_decay"],
                             maximize=group["maximize"])


class AdEMAMix8bit(_AdEMAMixBase):
    """AdEMAMix (Pagliardini, Ablin, Grangier 2024, "The AdEMAMix Optimizer: Better, Faster,
    Older") with 8-bit states, as bitsandbytes' AdEMAMix8bit computes it: a fast EMA
    ``exp_avg`` (beta1), a slow one ``exp_avg_slow`` (beta3; both in the signed dynamic
    map) and ``exp_avg_sq`` (beta2, unsigned map); about 3 bytes of state per parameter::

        m1 = b1*m1 + (1-b1)*g;  m2 = b3_t*m2 + (1-b3_t)*g;  nu = b2*nu + (1-b2)*g*g
        p  = p*(1 - lr*wd) - lr * (m1/(1-b1^t) + alpha_t*m2) / (sqrt(nu)/sqrt(1-b2^t) + eps)

    with the optional warm-up schedulers of the paper: ``t_alpha`` steps ramp alpha
    linearly from 0, ``t_beta3`` steps move beta3 from beta1 to its value (None: none).
    The schedulers are computed on the parameters' device inside the step, from the
    step counter. DTensor (FSDP2) parameters work as for AdamW8bit (the update is
    elementwise; each rank steps its rows).

        >>> opt = memfit.optim.AdEMAMix8bit(model.parameters(), lr=1e-3,  # doctest: +SKIP
        ...                                 t_alpha=100_000, t_beta3=100_000)

    Args: bitsandbytes' (lr, betas, alpha, t_alpha, t_beta3, eps, weight_decay,
    min_8bit_size), plus memfit's common options (see :mod:`memfit.optim.optimizers`).
    """

    _bits = 8


class AdEMAMix(_AdEMAMixBase):
    """AdEMAMix (see :class:`AdEMAMix8bit`) with float32 states (``bits=32``).

        >>> opt = memfit.optim.AdEMAMix(model.parameters(), alpha=8.0)  # doctest: +SKIP
    """

    _bits = 32
