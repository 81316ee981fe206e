"""Muon (Jordan et al. 2024; torch.optim.Muon) with 8-bit or float32 momentum, and
AdamW8bit for the parameters Muon is not for, in one optimizer.

One step of a Muon group, per parameter (torch.optim.Muon's math):

1. the fused momentum pass of the C core (kind MF_OPT_MUON, csrc/include/memfit/optim.h):
   dequantizes the momentum, ``buf.lerp_(grad, 1 - momentum)``, requantizes it, and
   writes the update (``grad.lerp(buf, momentum)`` with nesterov, else ``buf``) into a
   scratch tensor of the gradient's dtype, in one pass;
2. :func:`zeropower_via_newtonschulz`: Newton-Schulz in bfloat16 with torch's matmul on
   the parameter's device, a function of the whole 2-D matrix: for a DTensor parameter
   sharded by rows (FSDP2), the matrix is gathered to one rank, orthogonalized there
   once, and its rows scattered back (:mod:`memfit.optim._muon_dist`);
3. ``p.mul_(1 - lr * weight_decay)`` and ``p.add_(O, alpha=-adjusted_lr)``: exactly
   torch's ops for float32 parameters (and for float16/bfloat16 ones with
   ``bf16_stochastic_round=False``); float16/bfloat16 parameters are otherwise updated
   in float32 and written with stochastic rounding (memfit.cast), as memfit's other
   optimizers write them. A shard draws the random bits of its elements' places in the
   whole tensor (``index_base``), so FSDP2 writes the bits one process writes.

Param groups with ``use_muon=False`` are AdamW groups: memfit's AdamW8bit kernel steps
them (the same call into the core as AdamW8bit's), with the group's ``lr``,
``weight_decay``, ``betas`` and ``eps``; what a group leaves out, it takes from the
constructor's ``adamw_*`` arguments (``lr`` and ``weight_decay``: the Muon ones, as
Moonlight does with ``adjust_lr_fn="match_rms_adamw"``). One ``state_dict`` for all.
:func:`muon_param_groups` splits a model by the usual rule.
"""

from __future__ import annotations

import math
import numbers

import torch

from memfit import _cast
from memfit._C import MemfitTypeError, MemfitValueError
from memfit.optim import _core, _dtensor, _muon_dist
from memfit.optim._torch import _MemfitOptimizer

__all__ = ["Muon", "Muon8bit", "muon_param_groups", "zeropower_via_newtonschulz"]

# torch.optim.Muon's defaults (Keller Jordan's coefficients)
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_EPS = 1e-7
NS_STEPS = 5
NS_DTYPE = torch.bfloat16  # what Newton-Schulz computes in, and returns
ADJUST_LR_FNS = (None, "original", "match_rms_adamw", "spectral_unclamped")
# what a use_muon=False group takes when it does not say (betas as Moonlight's AdamW)
ADAMW_BETAS = (0.9, 0.95)
ADAMW_EPS = 1e-8
# module names (the last component) taken for an output head by muon_param_groups
HEAD_NAMES = ("lm_head", "head", "output", "classifier")


def zeropower_via_newtonschulz(g, ns_coefficients=NS_COEFFICIENTS, ns_steps=NS_STEPS,
                               eps=NS_EPS):
    """The orthogonalized update of a whole 2-D matrix ``g``: torch.optim.Muon's
    ``_zeropower_via_newtonschulz``, operation for operation (bfloat16, the transpose of
    a tall matrix, the Frobenius norm clamped at ``eps``, ``ns_steps`` quintic
    iterations by torch.addmm), so the same bits as torch on the same device."""
    if g.dim() != 2:
        raise ValueError(f"g: Newton-Schulz needs a 2-D matrix, got shape {tuple(g.shape)}")
    a, b, c = ns_coefficients
    # a copy even of a bfloat16 g (the normalization below is in place; torch's
    # g.bfloat16() would be g itself, and its caller's matrix would be overwritten)
    x = g.to(NS_DTYPE, copy=True)
    tall = g.size(0) > g.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=eps))  # spectral norm at most 1
    for _ in range(ns_steps):
        gram = x @ x.T
        update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, update, x, beta=a)
    return x.T if tall else x


def adjusted_lr(lr, adjust_lr_fn, rows, cols) -> float:
    """torch.optim.Muon's learning rate for an update of ``rows`` x ``cols`` (``lr``: a
    float, or a 0-d tensor as torch's step makes of a tensor lr). An empty matrix
    (``rows * cols == 0``) has no update: 0."""
    if rows * cols == 0:
        return 0.0
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        ratio = math.sqrt(max(1, rows / cols))
    elif adjust_lr_fn == "match_rms_adamw":
        ratio = 0.2 * math.sqrt(max(rows, cols))
    else:  # spectral_unclamped
        ratio = math.sqrt(rows / cols)
    return lr * ratio


def _matrix_shape(shape) -> tuple:
    """The matrix Muon orthogonalizes for a parameter of ``shape``: itself (2-D), or a
    conv filter (out, in, kh, kw) flattened to (out, in * kh * kw), as the Muon authors
    do."""
    return (shape[0], math.prod(shape[1:])) if len(shape) == 4 else tuple(shape)


class _MuonBase(_MemfitOptimizer):
    """Muon for ``use_muon`` groups (the default), AdamW for ``use_muon=False`` ones."""

    _kind = _core.MUON
    # torch.optim.Muon has none of torch's flags; the other classes' keywords are taken
    # (and checked) all the same, so that a swap from them keeps working, but none is
    # kept in the groups: the state dicts stay torch.optim.Muon's
    _TORCH_FLAGS = {}

    def __init__(self, params, lr=1e-3, weight_decay=0.1, momentum=0.95, nesterov=True,
                 ns_coefficients=NS_COEFFICIENTS, eps=NS_EPS, ns_steps=NS_STEPS,
                 adjust_lr_fn=None, *, adamw_lr=None, adamw_betas=ADAMW_BETAS,
                 adamw_eps=ADAMW_EPS, adamw_weight_decay=None, block_size=None,
                 min_8bit_size=4096, bf16_stochastic_round=None, foreach=None, fused=None,
                 capturable=False, differentiable=False):
        # read by add_param_group, which the base constructor calls for every group
        self._adamw_defaults = dict(betas=tuple(adamw_betas), eps=adamw_eps)
        if adamw_lr is not None:
            self._adamw_defaults["lr"] = adamw_lr
        if adamw_weight_decay is not None:
            self._adamw_defaults["weight_decay"] = adamw_weight_decay
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay, momentum=momentum,
                                      nesterov=nesterov, ns_coefficients=ns_coefficients,
                                      eps=eps, ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn,
                                      use_muon=True),
                         block_size=block_size, min_8bit_size=min_8bit_size,
                         bf16_stochastic_round=bf16_stochastic_round, foreach=foreach,
                         fused=fused, capturable=capturable, differentiable=differentiable)

    def _group_kind(self, group) -> int:
        return _core.MUON if group.get("use_muon", True) else _core.ADAMW

    def add_param_group(self, param_group):
        """torch's add_param_group; a ``use_muon=False`` group takes the AdamW defaults
        (``adamw_*``) for what it leaves out; a Muon group's parameters are checked
        (2-D, or 4-D conv filters)."""
        if isinstance(param_group, dict) and param_group.get("use_muon", True) is False:
            param_group = {**self._adamw_defaults, **param_group}
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            self._check_muon_params(len(self.param_groups) - 1, group, at_step=False)
        except Exception:
            self.param_groups.pop()
            raise

    def _hparams(self, group) -> dict:
        use_muon = group.get("use_muon", True)
        if not isinstance(use_muon, bool):
            raise MemfitTypeError(f"use_muon: expected True or False, got {use_muon!r}")
        if not use_muon:
            missing = [k for k in ("betas", "eps", "weight_decay") if k not in group]
            if missing:  # a Muon group switched to use_muon=False after it was built
                raise MemfitValueError(
                    f"use_muon=False: the group has no {', '.join(missing)} (it was built as a "
                    "Muon group); give AdamW groups use_muon=False when they are made "
                    "(constructor, add_param_group)")
            b1, b2 = _pair("betas", group["betas"])
            return _core.hparams(lr=group["lr"], beta1=b1, beta2=b2, eps=group["eps"],
                                 weight_decay=group["weight_decay"])
        _check_muon_values(group)
        if group.get("kahan", False):
            raise ValueError("kahan=True is not supported in a Muon group (its update comes "
                             "from Newton-Schulz, outside the fused kernel); use "
                             "bf16_stochastic_round")
        return _core.hparams(lr=group["lr"], weight_decay=group["weight_decay"],
                             momentum=group["momentum"], nesterov=group["nesterov"])

    def _check_muon_params(self, gi, group, at_step, members=None) -> None:
        """Refuses what Muon cannot orthogonalize: a parameter that is not a matrix (2-D)
        or a conv filter (4-D, flattened), and a DTensor parameter sharded otherwise than
        by rows on one mesh dimension (Shard(0) with FSDP2 or HSDP; Replicate).
        ``members``: None (every parameter of the group), or only these [(index, p)]."""
        if not group.get("use_muon", True):
            return
        name = type(self).__name__
        for i, p in (enumerate(group["params"]) if members is None else members):
            if at_step and p.grad is None:
                continue
            where = f"{name}: param_groups[{gi}]['params'][{i}] (shape {tuple(p.shape)})"
            if p.dim() not in (2, 4):
                raise MemfitValueError(
                    f"{where}: Muon orthogonalizes matrices (2-D) and conv filters (4-D, "
                    f"flattened to (out, in*kh*kw)), not a {p.dim()}-D tensor: put it in a param "
                    "group with use_muon=False (AdamW), e.g. with "
                    "memfit.optim.muon_param_groups(model); nothing was updated")
            if _dtensor.is_dtensor(p):
                try:  # the other optimizers' rule (Shard(0) or Replicate), then Muon's own
                    _dtensor.check_param(p, lambda q, w=where: w)
                    _muon_dist.shard_dim(p, where)
                except ValueError as e:
                    raise MemfitValueError(f"{e}; nothing was updated" if at_step else str(e)) \
                        from None

    def _check_use_muon(self, gi, group, done, members=None) -> None:
        """Refuses a group whose ``use_muon`` was flipped after its parameters were
        stepped: their states are the other math's (AdamW's two moments in a Muon group,
        a Muon momentum in an AdamW one: Muon keeps no state2, AdamW always does), which
        neither step can continue and no Muon8bit would load from a state dict.
        ``done``: what the caller did not do (the message ends with it). ``members``:
        None (the whole group, checked again only when it or its use_muon changed), or
        only these [(index, p)] (the step in backward: O(1) per tensor)."""
        use_muon = group.get("use_muon", True)
        if members is None:
            seen = self.__dict__.setdefault("_use_muon_checked", {}).get(gi)
            if seen is not None and seen[0] is group and seen[1] == use_muon:
                return
        for i, p in (enumerate(group["params"]) if members is None else members):
            state = self.state.get(p)
            if state and "state1" in state and ("state2" in state) == use_muon:
                was = "AdamW (use_muon=False)" if use_muon else "Muon (use_muon=True)"
                raise MemfitValueError(
                    f"{type(self).__name__}: param_groups[{gi}]['params'][{i}]: use_muon is "
                    f"{use_muon}, but the parameter was stepped as {was} and holds that "
                    "math's states; use_muon cannot change after a group's first step: set it "
                    f"back, or move the parameters to a new optimizer; {done}")
        if members is None:
            self._use_muon_checked[gi] = (group, use_muon)

    def _plan_step(self, members=None):
        # Muon's own refusals too, before anything is written; of the parameters being
        # stepped only (members: the step in backward steps one tensor at a time, in O(1))
        for gi, group in enumerate(self.param_groups):
            if members is None or gi in members:
                self._check_use_muon(gi, group, "nothing was updated",
                                     None if members is None else members[gi])
                self._check_muon_params(gi, group, at_step=True,
                                        members=None if members is None else members[gi])
        return super()._plan_step(members)

    def _check_saveable(self, done) -> None:
        for gi, group in enumerate(self.param_groups):
            self._check_use_muon(gi, group, done)

    def state_dict(self):
        """torch's (and memfit's) state dict; refused (MemfitValueError naming use_muon)
        where a group's use_muon was flipped after its first step: such a dict could not
        be loaded."""
        self._check_saveable("nothing was saved")
        return super().state_dict()

    def _step_bucket(self, group, hp, device, fmt, items, grad_scale, found_inf):
        if not group.get("use_muon", True):
            return super()._step_bucket(group, hp, device, fmt, items, grad_scale, found_inf)
        if found_inf is not None and bool(found_inf.reshape(-1)[0] != 0):
            # skipped (the scaler's protocol): nothing moves, the steps do not count. One
            # host sync per bucket: Newton-Schulz of garbage would cost more.
            return
        # the stochastic-rounding seed of this call (step() and the offloader's step in
        # backward hand it in, _MemfitOptimizer._step_params per tensor): tensor n of the
        # call rounds with stream_seed(seed, n), the bits the core would draw for it
        call_seed = hp["sr_seed"]
        hp = dict(hp, sr_seed=0)  # the pass writes an update, rounded to nearest
        stochastic = self._rounding(group) == "stochastic"
        # what could raise is computed before the first write (a step that raises has
        # changed nothing): the decay and each matrix's lr, with torch.optim.Muon's
        # arithmetic (a tensor lr as the 0-d tensor torch's step makes of it)
        lr, wd = _scalar(group["lr"]), _scalar(group["weight_decay"])
        decay = float(1 - lr * wd)
        shapes = []  # per item: the whole matrix's (rows, cols) and -(its adjusted lr)
        for p, _, _, seen in items:
            rows, cols = _matrix_shape((p if seen[8] is None else seen[8]).shape)
            shapes.append((rows, cols, -float(adjusted_lr(lr, group["adjust_lr_fn"], rows, cols))))

        def newton_schulz(u):
            return zeropower_via_newtonschulz(u, group["ns_coefficients"], group["ns_steps"],
                                              group["eps"])

        # seen[8]: the DTensor a local shard belongs to (None: a plain tensor). A batch is
        # one tensor, or up to W row-sharded ones orthogonalized by W ranks at once
        for batch in _muon_dist.batches([seen[8] for *_, seen in items]):
            updates = []
            for n in batch:
                p, g, states, seen = items[n]
                # the momentum pass writes the update into `out` (the kernels' "param"):
                # row-major, as Muon's states are (_row_major_states), whatever p's layout
                # (a channels_last filter: its gradient is read as a row-major copy)
                out = torch.empty_like(g, memory_format=torch.contiguous_format)
                super()._step_bucket(group, hp, device, fmt, [(out, g, states, seen)],
                                     grad_scale, None)
                updates.append((seen[8], out.view(p.shape[0], shapes[n][1])))
            orthogonal = _muon_dist.orthogonalize(updates, newton_schulz, NS_DTYPE)
            for n, o in zip(batch, orthogonal):
                p, seen = items[n][0], items[n][3]
                rows, cols, alpha = shapes[n]
                if rows * cols == 0:
                    continue  # an empty matrix: no update (torch: none, or ZeroDivisionError)
                o = o.view(p.shape)
                if p.dtype == torch.float32 or not stochastic:
                    p.mul_(decay)  # torch.optim.Muon's two ops
                    p.add_(o, alpha=alpha)
                    continue
                # tensor n of the call, its element index_base + i for local element i, in
                # row-major order (a channels_last filter draws the contiguous one's bits)
                seed = _core.cast_seed(_core.stream_seed(call_seed, n), seen[3])
                v = p.to(torch.float32, memory_format=torch.contiguous_format)
                v.mul_(decay).add_(o, alpha=alpha)
                p.copy_(_cast.cast(v, p.dtype, rounding="stochastic", seed=seed))

    def _row_major_states(self, group) -> bool:
        # the momentum of a Muon group: row-major, as the matrix Newton-Schulz takes, so a
        # channels_last conv filter steps as its contiguous copy (same 8-bit blocks)
        return group.get("use_muon", True)


def _scalar(value):
    """A hyperparameter as torch.optim.Muon's step uses it: a tensor (one element, as
    check_group checked) as a 0-d tensor on the host (torch's _to_scalar), else as it is."""
    return value.detach().reshape(()).cpu() if torch.is_tensor(value) else value


def _pair(name, value):
    try:
        a, b = value
        return float(a), float(b)
    except (TypeError, ValueError):
        raise ValueError(f"{name}: expected a pair of numbers, got {value!r}") from None


def _check_muon_values(group) -> None:
    """torch.optim.Muon's checks of a group's Muon values (and what its step would raise
    later), naming the key."""
    coeffs = group["ns_coefficients"]
    if not isinstance(coeffs, (tuple, list)) or len(coeffs) != 3 or not all(
            isinstance(c, numbers.Real) and math.isfinite(c) for c in coeffs):
        raise ValueError(f"ns_coefficients: expected three finite numbers (a, b, c), got "
                         f"{coeffs!r}")
    steps = group["ns_steps"]
    if isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or not 0 <= steps < 100:
        raise ValueError(f"ns_steps: expected an int in [0, 100), got {steps!r}")
    eps = group["eps"]
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not eps >= 0:
        raise ValueError(f"eps: expected a number >= 0, got {eps!r}")
    if group["adjust_lr_fn"] not in ADJUST_LR_FNS:
        raise ValueError(f"adjust_lr_fn: expected one of {', '.join(map(repr, ADJUST_LR_FNS))}, "
                         f"got {group['adjust_lr_fn']!r}")
    if not isinstance(group["nesterov"], bool):
        raise TypeError(f"nesterov: expected True or False, got {group['nesterov']!r}")


class Muon8bit(_MuonBase):
    """torch.optim.Muon with an 8-bit ``momentum_buffer`` (signed dynamic map, one
    float32 absmax per 256 elements: about 1 byte of state per parameter instead of 4),
    and AdamW8bit for ``use_muon=False`` groups.

    Args: as torch.optim.Muon (``lr``, ``weight_decay=0.1``, ``momentum=0.95``,
    ``nesterov=True``, ``ns_coefficients``, ``eps=1e-7``, ``ns_steps=5``,
    ``adjust_lr_fn``), plus ``adamw_lr``, ``adamw_betas=(0.9, 0.95)``,
    ``adamw_eps=1e-8``, ``adamw_weight_decay`` (defaults of ``use_muon=False`` groups;
    lr and weight decay default to Muon's), ``block_size``, ``min_8bit_size`` and
    ``bf16_stochastic_round`` (see :mod:`memfit.optim.optimizers`), and torch's
    ``fused``/``foreach`` (no effect: always fused), ``capturable``/``differentiable``
    (False; True is refused), as memfit's other classes take them (``maximize`` is not
    taken, as torch.optim.Muon). Parameters of Muon groups: 2-D, or 4-D conv filters
    (flattened to (out, in*kh*kw)). See :mod:`memfit.optim.muon` and docs/optim.md.

    Example::

        groups = memfit.optim.muon_param_groups(model, lr=3e-4)  # AdamW: the rest
        opt = memfit.optim.Muon8bit(groups, lr=0.02)
        loss.backward(); opt.step(); opt.zero_grad()
    """

    _bits = 8


class Muon(_MuonBase):
    """torch.optim.Muon on memfit's fused momentum pass, float32 momentum (and AdamW,
    float32 states, for ``use_muon=False`` groups). Arguments as :class:`Muon8bit`."""

    _bits = 32


def muon_param_groups(model, head=HEAD_NAMES, **adamw_group) -> list:
    """Param groups for :class:`Muon8bit` by the usual rule: the weights of
    ``nn.Linear`` and ``nn.Conv2d`` modules go to Muon, except output heads (modules whose
    name ends in one of ``head``) and weights shared with an ``nn.Embedding`` (tied);
    everything else (embeddings, norms, biases) goes to a ``use_muon=False`` (AdamW)
    group, with ``adamw_group``'s keys (``lr=3e-4``, ...). ``head``: names, or one
    name as a string. Parameters that do not require grad are left out; each parameter
    appears once."""
    from torch import nn

    names = (head,) if isinstance(head, str) else head  # one name, not a set of characters
    try:
        names = frozenset(names)
    except TypeError:
        names = None
    if names is None or not all(isinstance(h, str) for h in names):
        raise MemfitTypeError(f"head: expected a module name or names (strings), got {head!r}")

    tied = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    muon_ids = set()
    for name, m in model.named_modules():
        if isinstance(m, (nn.Linear, nn.Conv2d)) and name.rsplit(".", 1)[-1] not in names \
                and id(m.weight) not in tied:
            muon_ids.add(id(m.weight))
    muon, other, seen = [], [], set()
    for p in model.parameters():
        if id(p) in seen or not p.requires_grad:
            continue
        seen.add(id(p))
        (muon if id(p) in muon_ids else other).append(p)
    groups = [{"params": muon, "use_muon": True}]
    if other:
        groups.append({"params": other, "use_muon": False, **adamw_group})
    return groups
