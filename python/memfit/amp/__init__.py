"""Mixed precision for PyTorch: a GradScaler that explains itself, fused gradient
passes, and autocast helpers.

``memfit.amp.GradScaler`` takes torch's constructor, methods and semantics (it is a
drop-in for ``torch.amp.GradScaler``) and keeps its state machine and update rule in
memfit's C core. On CUDA the scale, the growth tracker and the step statistics live
on the device and ``update()`` is one kernel launch with no host sync; on the CPU the
same rule (one C function, see ``csrc/include/memfit/scaler.h``) runs on host memory.

Beyond torch (all optional):

* ``hysteresis=N``: back off only after N consecutive non-finite steps.
* ``min_scale`` / ``max_scale``: bounds on the scale.
* ``stats()``: skipped steps, backoffs, growths and the recent scale history.
* warnings that say what happened: many steps in a row skipped, the scale stuck at
  ``min_scale`` (or below 1), a loss that was already NaN/Inf before backward.
* ``nonfinite_loss="warn" | "skip" | "raise"``: what to do with such a loss.

The classic loop::

    import memfit.amp as amp
    autocast, scaler = amp.setup(model, optimizer)        # bf16 or fp16, scaler if fp16
    for x, y in loader:
        with autocast:
            loss = loss_fn(model(x), y)
        scaler.scale(loss).backward()
        amp.clip_grad_norm_(model.parameters(), 1.0, scaler=scaler, optimizer=optimizer)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)

One capability per file: ``scaler.py`` (GradScaler: its state machine; OptState and
ScalerConfigError importable from it), with its base classes ``_scaler_settings.py``
(the update rule's settings and their checks, ScalerConfigError), ``_unscale.py`` (the
fused unscale and inf check), ``_scaler_checkpoint.py`` (state_dict, pickling),
``report.py`` (ScalerWarning, the scaler's warnings and stats()), and ``_stage.py``
(OptState); ``clip.py`` (clip_grad_norm_), ``in_kernel.py`` (scale_in_kernel: which
optimizers take the scale in their step), ``mixed_precision.py`` (precision, Precision, autocast,
AutocastContext, setup), ``accumulate.py`` (GradAccumulator), ``lightning.py``
(a Lightning precision plugin; imported only when asked for, it imports Lightning).
``cast`` and the matrix products (``matmul``, ``gemm_backend``, ``set_gemm_backend``)
are re-exported here under their old names; they live in ``memfit.cast`` and
``memfit.nn``.

This package imports torch.
"""

from memfit._cast import cast  # re-exported: casts with stochastic rounding
from memfit.nn.gemm import gemm_backend, matmul, set_gemm_backend  # old names: see memfit.nn
from memfit.amp import _grads
from memfit.amp.accumulate import GradAccumulator
from memfit.amp.clip import clip_grad_norm_
from memfit.amp.in_kernel import scale_in_kernel
from memfit.amp.mixed_precision import AutocastContext, Precision, autocast, precision, setup
from memfit.amp.report import ScalerWarning
from memfit.amp.scaler import GradScaler, OptState, ScalerConfigError

_stream = _grads._stream  # the CUDA stream helper benchmarks/bench_amp.py uses

__all__ = [
    "AutocastContext",
    "GradAccumulator",
    "GradScaler",
    "OptState",
    "Precision",
    "ScalerConfigError",
    "ScalerWarning",
    "autocast",
    "cast",
    "clip_grad_norm_",
    "gemm_backend",
    "matmul",
    "precision",
    "scale_in_kernel",
    "set_gemm_backend",
    "setup",
]
