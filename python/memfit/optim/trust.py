"""LAMB and LARS: AdamW's and SGD's updates scaled per tensor by a trust ratio.

    scale = max_unorm * ||p|| / ||u||  if ||u|| > max_unorm * ||p||, else 1

with ||p|| the parameter's norm before the step and u its update direction without lr
and without decoupled weight decay (LAMB: the bias-corrected Adam direction
m_hat / (sqrt(v_hat) + eps); LARS: the momentum buffer, or its Nesterov form). The
step scales ``lr * u`` by it. Two passes per tensor in the fused kernel (a norm pass,
then the update; csrc/include/memfit/optim.h, "trust ratio"), with sums in float64 in a
fixed order: the CPU and the GPU give the same bits. ``||p|| = 0`` gives scale 0 (a zero
tensor does not move), as in bitsandbytes.

The norms need the whole tensor: sharded (FSDP2 DTensor) parameters are refused.
"""

from __future__ import annotations

import torch

from memfit.optim import _core, _dtensor
from memfit.optim._torch import _MemfitOptimizer
from memfit.optim.optimizers import _betas

__all__ = ["LAMB", "LAMB8bit", "LARS", "LARS8bit"]


class _TrustBase(_MemfitOptimizer):
    """The trust ratio's extras: its scratch per step, the refusal of DTensors, and the
    group keys AdamW's and SGD's groups lack (a state dict of AdamW8bit/SGD8bit loaded
    here continues with this optimizer's own max_unorm & co.)."""

    _TRUST_KEYS: tuple = ("max_unorm",)

    def _opt(self, group, key):
        """group[key], or this optimizer's default where a loaded group lacks it."""
        return group.get(key, self.defaults[key])

    def __setstate__(self, state):
        super().__setstate__(state)
        for group in self.param_groups:
            for key in self._TRUST_KEYS:
                group.setdefault(key, self.defaults[key])

    def add_param_group(self, param_group):
        super().add_param_group(param_group)
        try:
            for p in self.param_groups[-1]["params"]:
                self._refuse_dtensor(p)
        except ValueError:
            self.param_groups.pop()
            raise

    def _refuse_dtensor(self, p) -> None:
        if _dtensor.is_dtensor(p):
            raise ValueError(
                f"{self._where(p)}: a sharded parameter (DTensor): {type(self).__name__}'s "
                f"trust ratio needs the norms of the whole tensor, which one shard does not "
                f"have; use it without FSDP2 sharding (or with DDP), or AdamW8bit/SGD8bit")

    def _new_states(self, where, group, p, state) -> tuple:
        self._refuse_dtensor(p)
        return super()._new_states(where, group, p, state)

    def _trust_scratch(self, params) -> list:
        """Per parameter, the float64 scratch of the norm pass as float32 words
        (mf_optim_tensor.trust): one allocation for the bucket, sliced."""
        sizes = [_core.trust_numel(p.numel()) // 2 for p in params]
        buf = torch.empty(sum(sizes), dtype=torch.float64, device=params[0].device)
        out, at = [], 0
        for n in sizes:
            out.append(buf[at:at + n].view(torch.float32))
            at += n
        return out


class _LambBase(_TrustBase):
    _kind = _core.ADAMW
    _TRUST_KEYS = ("max_unorm", "bias_correction", "adam_w_mode")
    _fixed_options = (("amsgrad", False, "LAMB keeps no max_exp_avg_sq state (AMSGrad); "
                                         "pass amsgrad=False"),)

    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8,
                 weight_decay=0.0, amsgrad=False, adam_w_mode=True, *, max_unorm=1.0,
                 maximize=False, block_size=None, min_8bit_size=4096,
                 bf16_stochastic_round=None, kahan=False, **torch_flags):
        super().__init__(params, dict(lr=lr, betas=_betas(betas), eps=eps,
                                      weight_decay=weight_decay, amsgrad=amsgrad,
                                      bias_correction=bool(bias_correction),
                                      adam_w_mode=bool(adam_w_mode), max_unorm=max_unorm),
                         maximize=maximize, block_size=block_size, min_8bit_size=min_8bit_size,
                         bf16_stochastic_round=bf16_stochastic_round, kahan=kahan, **torch_flags)

    def _group_kind(self, group) -> int:
        return _core.ADAMW if self._opt(group, "adam_w_mode") else _core.ADAM

    def _hparams(self, group):
        b1, b2 = _betas(group["betas"])
        return _core.hparams(lr=group["lr"], beta1=b1, beta2=b2, eps=group["eps"],
                             weight_decay=group["weight_decay"], maximize=group["maximize"],
                             max_unorm=self._opt(group, "max_unorm"),
                             bias_correction=self._opt(group, "bias_correction"))


class LAMB8bit(_LambBase):
    """LAMB (You et al. 2019): AdamW's update scaled per tensor by the trust ratio
    (:mod:`memfit.optim.trust`), with 8-bit ``exp_avg``/``exp_avg_sq`` as AdamW8bit.

    Arguments and defaults as bitsandbytes' LAMB8bit (lr=1e-3, bias_correction=True,
    betas=(0.9, 0.999), eps=1e-8, weight_decay=0, amsgrad=False (True is refused),
    adam_w_mode=True, max_unorm=1.0), plus memfit's options (block_size, min_8bit_size,
    bf16_stochastic_round, kahan, maximize, torch's flags; :mod:`memfit.optim.optimizers`).
    Unlike bitsandbytes, whose 8-bit kernel has no trust ratio (its LAMB8bit is AdamW8bit
    and refuses max_unorm != 1) and which ignores bias_correction and adam_w_mode, memfit
    applies all three: ``max_unorm=0`` is exactly AdamW8bit, ``adam_w_mode=False`` adds
    the decay to the gradient (Adam8bit's L2), ``bias_correction=False`` steps with lr and
    no correction of either moment. Sharded (DTensor) parameters are refused.

        >>> opt = memfit.optim.LAMB8bit(model.parameters(), lr=1e-3, weight_decay=0.01)  # doctest: +SKIP
    """

    _bits = 8


class LAMB(_LambBase):
    """LAMB with float32 states (:class:`LAMB8bit`'s math; bitsandbytes' LAMB32bit)."""

    _bits = 32


class _LarsBase(_TrustBase):
    _kind = _core.SGD
    _TORCH_FLAGS = dict(maximize=False, foreach=None, differentiable=False, fused=None)
    # bitsandbytes' LARS classes refuse momentum=0; its PytorchLARS (memfit.optim.bnb) not
    _needs_momentum = True

    def __init__(self, params, lr, momentum=0.0, dampening=0.0, weight_decay=0.0,
                 nesterov=False, *, max_unorm=0.02, maximize=False, block_size=None,
                 min_8bit_size=4096, bf16_stochastic_round=None, kahan=False, **torch_flags):
        if momentum == 0 and self._needs_momentum:
            raise NotImplementedError("LARS without momentum is not supported!")  # as bnb
        super().__init__(params, dict(lr=lr, momentum=momentum, dampening=dampening,
                                      weight_decay=weight_decay, nesterov=nesterov,
                                      max_unorm=max_unorm),
                         maximize=maximize, block_size=block_size, min_8bit_size=min_8bit_size,
                         bf16_stochastic_round=bf16_stochastic_round, kahan=kahan, **torch_flags)

    def _hparams(self, group):
        return _core.hparams(lr=group["lr"], momentum=group["momentum"],
                             dampening=group["dampening"], weight_decay=group["weight_decay"],
                             nesterov=group["nesterov"], maximize=group["maximize"],
                             max_unorm=self._opt(group, "max_unorm"))


class LARS8bit(_LarsBase):
    """LARS (You et al. 2017): torch.optim.SGD's momentum update (L2 decay in the
    gradient, buffer = gradient at the first step, Nesterov optional) scaled per tensor
    by the trust ratio (:mod:`memfit.optim.trust`), with an 8-bit ``momentum_buffer``.

    Arguments and defaults as bitsandbytes' LARS8bit (lr required, momentum=0 refused
    with NotImplementedError as there, dampening=0, weight_decay=0, nesterov=False,
    max_unorm=0.02), plus memfit's options. Its math is bitsandbytes' PytorchLARS; unlike
    bitsandbytes' kernels (whose 8-bit LARS has no trust ratio, and whose 32-bit one
    ignores dampening and nesterov), memfit applies all of it in 8 and 32 bits.
    ``max_unorm=0`` is exactly SGD8bit. Sharded (DTensor) parameters are refused.

        >>> opt = memfit.optim.LARS8bit(model.parameters(), lr=0.1, momentum=0.9)  # doctest: +SKIP
    """

    _bits = 8


class LARS(_LarsBase):
    """LARS with a float32 ``momentum_buffer`` (:class:`LARS8bit`'s math; bitsandbytes'
    LARS32bit and PytorchLARS)."""

    _bits = 32
