"""bitsandbytes' optimizer classes on memfit's optimizers.py (Adam, AdamW, Lion,
AdEMAMix, SGD, RMSprop, Adagrad and their 8bit/32bit/Paged forms), with bitsandbytes'
names and signatures: each is made by a factory per family, a thin subclass whose
constructor maps the arguments (memfit.optim._bnb_args) onto the memfit class of the
same math. Their module is memfit.optim.bnb, where users import them from."""

from __future__ import annotations

from memfit.optim import optimizers as _m
from memfit.optim._bnb_args import _no_amsgrad, _paged_error, _resolve, _string_betas
from memfit.optim._bnb_overrides import _shim_class
from memfit.optim.convert._bitsandbytes import bnb_schedule_steps as _bnb_schedule_steps


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
    return _shim_class(name, base, __init__, doc)


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
    return _shim_class(name, _m.Lion8bit, __init__, doc)


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
    return _shim_class(name, base, __init__, doc)


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
    return _shim_class(name, _m.SGD8bit, __init__, doc)


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
    return _shim_class(name, _m.RMSprop8bit, __init__, doc)


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
    return _shim_class(name, _m.Adagrad8bit, __init__, doc)


Adagrad = _adagrad_class("Adagrad", None)
Adagrad8bit = _adagrad_class("Adagrad8bit", 8)
Adagrad32bit = _adagrad_class("Adagrad32bit", 32)
