"""A Lightning precision plugin that clips gradients for optimizers which take the
scale on the device: torch's fused Adam/AdamW/SGD, and memfit optimizers opted in with
:func:`memfit.amp.scale_in_kernel`.

Not needed for memfit's optimizers as they are: they leave torch's
``_step_supports_amp_scaling`` unset, so ``pl.Trainer(precision="bf16-mixed" or
"16-mixed", gradient_clip_val=...)`` unscales (torch's scaler) and clips them as any
optimizer (docs/frameworks.md).

Why it exists: torch's GradScaler reads ``optimizer._step_supports_amp_scaling`` as
"hand me ``grad_scale`` and ``found_inf`` and I skip the step on the device", with no
host sync. Lightning's ``MixedPrecision`` reads the same flag as "this optimizer
unscales inside its step": it then skips ``scaler.unscale_`` and refuses
``gradient_clip_val`` (even under ``"bf16-mixed"``, where there is no scaler). That
holds for no optimizer torch or memfit ships today: after ``unscale_`` the scaler
passes ``grad_scale=None`` and the kernels still skip on ``found_inf``, so unscale,
clip, step is exact.

This plugin is Lightning's ``MixedPrecision`` with that one difference: for such an
optimizer it unscales right after backward (where Lightning unscales every other
optimizer), and clipping is allowed. Everything else (autocast, the scaler, its
state dict in checkpoints) is Lightning's own code::

    from memfit.amp.lightning import MixedPrecision
    opt = memfit.amp.scale_in_kernel(mo.AdamW8bit(params))     # in configure_optimizers
    trainer = pl.Trainer(plugins=[MixedPrecision("16-mixed", "cuda")], gradient_clip_val=1.0)

``MixedPrecision`` subclasses ``pytorch_lightning``'s plugin; for the ``lightning``
package (``import lightning.pytorch as pl``) build the class from it:
``mixed_precision_class(lightning.pytorch)``.
"""

from __future__ import annotations

import inspect
from types import ModuleType

_CLASSES: dict = {}


def _takes_unscaled_step(optimizer) -> bool:
    """An optimizer Lightning would neither unscale nor clip, whose step nevertheless
    takes gradients unscaled beforehand (GradScaler then passes grad_scale=None). An
    optimizer of the older protocol (``step(grad_scaler=...)``) unscales itself and
    is left to Lightning's own handling."""
    if not getattr(optimizer, "_step_supports_amp_scaling", False):
        return False
    try:
        return "grad_scaler" not in inspect.signature(optimizer.step).parameters
    except (TypeError, ValueError):
        return False


def mixed_precision_class(pl: ModuleType) -> type:
    """The plugin class for a Lightning package: ``pytorch_lightning`` or
    ``lightning.pytorch`` (its Trainer accepts only plugins of its own classes)."""
    name = pl.__name__
    if name not in _CLASSES:
        base = pl.plugins.precision.MixedPrecision
        generic = pl.plugins.precision.Precision

        class MixedPrecision(base):
            """Lightning's ``MixedPrecision`` (same arguments: ``precision``,
            ``device``, ``scaler``) that unscales and clips optimizers which take the
            scale on the device (see :mod:`memfit.amp.lightning`)."""

            def optimizer_step(self, optimizer, model, closure, **kwargs):
                if self.scaler is None or not _takes_unscaled_step(optimizer):
                    return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)

                def closure_then_unscale():
                    # where Lightning unscales every other optimizer: after backward,
                    # before on_before_optimizer_step and clipping. Lightning skips
                    # unscale_ when backward was skipped; so does this.
                    result = closure()
                    if not (result is None and model.automatic_optimization):
                        self.scaler.unscale_(optimizer)
                    return result

                return super().optimizer_step(optimizer, model=model, closure=closure_then_unscale,
                                              **kwargs)

            def clip_gradients(self, optimizer, clip_val=0.0, gradient_clip_algorithm=None):
                if not _takes_unscaled_step(optimizer):
                    return super().clip_gradients(optimizer, clip_val, gradient_clip_algorithm
                                                  or _norm(pl))
                # the gradients are unscaled (optimizer_step above) or were never scaled
                # (bf16-mixed): clip as every other precision plugin does
                return generic.clip_gradients(self, optimizer, clip_val,
                                              gradient_clip_algorithm or _norm(pl))

        MixedPrecision.__module__ = __name__
        MixedPrecision.__qualname__ = "MixedPrecision"
        _CLASSES[name] = MixedPrecision
    return _CLASSES[name]


def _norm(pl: ModuleType):
    return pl.utilities.GradClipAlgorithmType.NORM


def __getattr__(attr: str):
    """``MixedPrecision``: the class for ``pytorch_lightning``, built when first asked
    (so that importing this module imports no Lightning)."""
    if attr == "MixedPrecision":
        import pytorch_lightning

        return mixed_precision_class(pytorch_lightning)
    raise AttributeError(f"module {__name__!r} has no attribute {attr!r}")
