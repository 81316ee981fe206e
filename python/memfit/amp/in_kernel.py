"""Which optimizers take a GradScaler's scale inside their step, and the opt-in that
hands it to them from torch's scaler.

memfit's optimizers can unscale in their kernels: a scaler sets ``optimizer.grad_scale``
(the scale; None after ``unscale_``) and ``optimizer.found_inf`` (a 0/1 tensor on the
device) and calls ``step()``; the kernels divide each gradient by ``grad_scale`` as they
read it and, when ``found_inf`` is non-zero, change nothing. No host sync on the inf
check, and memfit's scaler then only reads the gradients (its inf check) instead of
unscaling them in place; torch's scaler still runs a pass of its own (an inf check
with a scale of 1), so on the CPU its two paths cost the same (benchmarks/RESULTS.md,
bench_amp_path).

Two flags say that a step takes them, read by different callers:

* ``_memfit_scale_in_kernel``: memfit's protocol, a class attribute of every memfit
  optimizer. Only ``memfit.amp.GradScaler`` reads it: with memfit's scaler the
  in-kernel path is automatic.
* ``_step_supports_amp_scaling``: torch's flag (torch's fused Adam/AdamW/SGD/Adagrad set
  it). ``torch.amp.GradScaler`` reads it, and so do Lightning and Fabric, as "this
  optimizer unscales inside its step": they then neither unscale nor clip, and
  Lightning refuses ``gradient_clip_val`` (under ``"bf16-mixed"`` too). memfit's
  optimizers leave it unset, so toward torch's scaler and Lightning they are plain
  optimizers (torch unscales with its own kernel; clipping works), and
  :func:`scale_in_kernel` sets it on one optimizer for a torch-scaler loop that wants
  the in-kernel path (docs/amp.md).
"""

from __future__ import annotations

from memfit._C import MemfitTypeError

# memfit's protocol flag (one definition: the optimizers set it under this name)
MEMFIT_FLAG = "_memfit_scale_in_kernel"
# torch's flag (torch.amp.GradScaler, Lightning and Fabric read it)
TORCH_FLAG = "_step_supports_amp_scaling"


def takes_scale_in_kernel(optimizer) -> bool:
    """Whether ``optimizer.step()`` reads ``grad_scale``/``found_inf`` set on it: memfit's
    flag or torch's (what memfit.amp.GradScaler asks before it hands them over)."""
    return bool(getattr(optimizer, MEMFIT_FLAG, False) or getattr(optimizer, TORCH_FLAG, False))


def scale_in_kernel(optimizer, enabled: bool = True):
    """Opt one memfit optimizer into the in-kernel path under ``torch.amp.GradScaler``
    (sets torch's ``_step_supports_amp_scaling`` on this instance; ``enabled=False``
    removes it). Returns the optimizer.

    Then torch's ``scaler.step(opt)`` hands the kernels ``grad_scale`` and ``found_inf``
    (no host sync; the gradients stay scaled), and
    ``scaler.unscale_(opt)`` before clipping still works. Lightning and Fabric read the
    same flag as "cannot clip": with ``gradient_clip_val`` use
    ``memfit.amp.lightning.MixedPrecision`` for such an optimizer, or leave it at the
    default. ``memfit.amp.GradScaler`` takes the in-kernel path without this call.
    The setting is the instance's, not its state's: a pickled or deep-copied
    optimizer comes back without it (the default path, which is also exact). float16
    parameters need it (or memfit's scaler): torch's default path refuses to unscale
    float16 gradients.
    """
    if not getattr(optimizer, MEMFIT_FLAG, False):
        raise MemfitTypeError(
            f"optimizer: expected a memfit optimizer (its step takes grad_scale and found_inf), "
            f"got {type(optimizer).__name__}")
    if not isinstance(enabled, bool):
        raise MemfitTypeError(f"enabled: expected True or False, got {enabled!r}")
    if enabled:
        setattr(optimizer, TORCH_FLAG, True)
    else:
        optimizer.__dict__.pop(TORCH_FLAG, None)
    return optimizer


def skip(optimizer, unscaled: dict, scale) -> dict:
    """The gradients memfit.amp.GradScaler need not read ({id(g): (g, found_inf)}): those
    it unscaled already (``unscaled``) and, for its check before a step (``scale``
    None: no unscale), those the optimizer checked for inf/NaN itself as they landed
    (memfit.optim.CPUOffloadOptimizer with offload_gradients=True: its worker checks
    them during backward; memfit/optim/_offload_found_inf.py)."""
    landed = getattr(optimizer, "_memfit_checked_grads", None)
    return unscaled if scale is not None or landed is None else {**unscaled, **landed()}
