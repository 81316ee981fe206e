"""bitsandbytes' LAMB and LARS classes (and their 8bit/32bit forms, PytorchLARS) on
memfit.optim.trust's, with bitsandbytes' names and signatures. Their module is
memfit.optim.bnb, where users import them from."""

from __future__ import annotations

from memfit.optim import trust as _trust
from memfit.optim._bnb_args import _no_amsgrad, _string_betas, _trust_options
from memfit.optim._bnb_overrides import _BnbOptimizer, _shim_class
from memfit.optim._registry import SHIM_MODULE


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
    return _shim_class(name, _trust.LAMB8bit, __init__, doc)


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
    return _shim_class(name, _trust.LARS8bit, __init__, doc)


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

    __module__ = SHIM_MODULE  # where users import it from (pickle, the state dict's record)

    _needs_momentum = False

    def __init__(self, params, lr=0.01, momentum=0, dampening=0, weight_decay=0, nesterov=False,
                 max_unorm=0.02):
        self._set_bits(32)
        _trust.LARS.__init__(self, params, lr, momentum, dampening, weight_decay, nesterov,
                             max_unorm=max_unorm, min_8bit_size=0)
