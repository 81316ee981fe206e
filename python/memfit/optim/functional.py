"""Functional optimizer steps on plain arrays, for NumPy, CuPy, JAX-on-CPU (through
NumPy) or anything else that speaks DLPack; torch tensors work too.

Each optimizer has an ``*_init(param, ...)`` that returns its state (a dict of arrays
in ``param``'s framework and device, plus the layout) and a ``*_step(param, grad,
state, ...)`` that updates ``param`` and ``state`` in place:

    >>> import numpy as np
    >>> from memfit.optim import functional as F
    >>> p = np.random.default_rng(0).standard_normal(10000).astype(np.float32)
    >>> st = F.adamw8bit_init(p)
    >>> g = np.ones_like(p)
    >>> F.adamw8bit_step(p, g, st, lr=1e-3)
    >>> int(st["step"][0])
    1

``param`` must be writable (JAX arrays are immutable: use ``np.array(x)`` and convert
back). Hyperparameters have torch's names and defaults. ``grad_scale`` and
``found_inf`` are optional 1-element float32 arrays on the parameter's device: the
gradient is divided by ``grad_scale`` and, if ``found_inf`` is non-zero, nothing
changes (the check happens inside the kernel: no device-to-host copy). Without them,
elements whose gradient is NaN/Inf are left unchanged (parameter and state).

float16/bfloat16 parameters are written back with nearest-even rounding, or, with
``kahan=True`` at init, Kahan-compensated: the state then holds ``"kahan_comp"``, an
array of the parameter's dtype and size whose values carry what rounding cut off (the
parameter's value is ``param + kahan_comp``; see csrc/include/memfit/optim.h). float32
parameters need no compensation: ``kahan=True`` adds nothing for them.
"""

from __future__ import annotations

from memfit import _arrays
from memfit._C import MemfitValueError
from memfit.optim import _core

__all__ = [
    "adam8bit_init", "adam8bit_step", "adam_init", "adam_step", "adamw4bit_init",
    "adamw4bit_step", "adamw8bit_init", "adamw8bit_step", "adamw_init", "adamw_step",
    "init", "lion8bit_init", "lion8bit_step", "rmsprop8bit_init", "rmsprop8bit_step",
    "sgd8bit_init", "sgd8bit_step", "step",
]

_KINDS = {"adamw": _core.ADAMW, "adam": _core.ADAM, "lion": _core.LION, "sgd": _core.SGD,
          "rmsprop": _core.RMSPROP, "adagrad": _core.ADAGRAD, "ademamix": _core.ADEMAMIX}


def _numel(x) -> int:
    n = 1
    for s in x.shape:
        n *= int(s)
    return n


def init(kind: str, param, bits: int = 8, block_size: int | None = None, momentum: float = 0.0,
         min_8bit_size: int = 0, kahan: bool = False) -> dict:
    """Zero state for ``param``: {"step", "state1", "absmax1", "state2", "absmax2",
    "kahan_comp", "bits", "block_size", "rows"} (unused entries are None; ademamix adds
    "state3", "absmax3"). ``kind``: adamw, adam, lion, sgd, rmsprop or ademamix; ``bits``:
    8, 4 or 32. Tensors with fewer than
    ``min_8bit_size`` elements get float32 states. ``kahan``: keep a Kahan compensation
    buffer for a float16/bfloat16 ``param`` (none for float32). Quantization blocks stay
    within rows (``param.shape[0]`` of them for a row-major array of two or more
    dimensions, as the torch optimizers do; 1 for a vector), and the states are flat
    arrays: codes (4 bits: ``rows * ceil(row/2)`` bytes) and ``rows * ceil(row/block_size)``
    absmax values."""
    if kind not in _KINDS:
        raise ValueError(f"kind: expected one of {', '.join(_KINDS)}, got {kind!r}")
    if bits not in (4, 8, 32):
        raise ValueError(f"bits: expected 4, 8 or 32, got {bits!r}")
    if not isinstance(kahan, bool):
        raise TypeError(f"kahan: expected True or False, got {kahan!r}")
    k = _KINDS[kind]
    src = _arrays.as_input(param)
    n = _numel(src)
    if bits != 32 and n < min_8bit_size:
        bits = 32
    bs = int(block_size) if block_size is not None else _core.DEFAULT_BLOCK[bits]
    rows = max(int(src.shape[0]), 1) if len(src.shape) >= 2 else 1
    layout = _core.state_layout(k, bits, bs, n, momentum, rows)
    st = {"step": _zeros(src, (1,), "float32"), "bits": bits, "block_size": bs, "kind": kind,
          "rows": rows,
          "state1": None, "absmax1": None, "state2": None, "absmax2": None, "kahan_comp": None}
    if layout["num_states"] > 2:  # AdEMAMix's exp_avg_slow
        st["state3"] = st["absmax3"] = None
    dt = _arrays.dtype_name(src.dtype)
    if kahan and dt in ("float16", "bfloat16"):
        st["kahan_comp"] = _zeros(src, (n,), dt)
    for j in range(1, layout["num_states"] + 1):
        st[f"state{j}"] = _zeros(src, (layout["state_numel"],), layout["state_dtype"])
        if layout["absmax_numel"]:
            st[f"absmax{j}"] = _zeros(src, (layout["absmax_numel"],), "float32")
    return st


def _zeros(like, shape, dtype):
    a = _arrays.empty(like, shape, dtype)
    a[...] = 0
    return a


_STATE_KEYS = ("step", "bits", "block_size", "state1", "absmax1", "state2", "absmax2")


def _check_state_arg(kind: str, state) -> None:
    """TypeError/ValueError naming ``state`` for anything but the dict init made."""
    if not isinstance(state, dict):
        raise TypeError(f"state: expected the dict that {kind}'s init returned (e.g. "
                        f"init({kind!r}, param, bits)), got {type(state).__name__}")
    missing = [k for k in _STATE_KEYS if k not in state]
    if missing:
        raise ValueError(f"state: has no {', '.join(map(repr, missing))}; pass the dict that "
                         f"{kind}'s init returned, unchanged")


def step(kind: str, param, grad, state: dict, *, grad_scale=None, found_inf=None, **hp) -> None:
    """One step of optimizer ``kind`` with hyperparameters ``hp`` (lr, beta1, beta2,
    eps, weight_decay, momentum, dampening, alpha, nesterov, maximize; adamw/adam and sgd
    also max_unorm, the trust ratio of LAMB and LARS, and adamw/adam bias_correction;
    adagrad: lr_decay (its ``sum`` starts at 0: torch's initial_accumulator_value=0);
    ademamix: beta3, alpha, t_alpha, t_beta3 (steps; 0: no scheduler))."""
    if kind not in _KINDS:
        raise ValueError(f"kind: expected one of {', '.join(_KINDS)}, got {kind!r}")
    _check_state_arg(kind, state)
    if state.get("kind", kind) != kind:
        raise ValueError(f"state: was made for {state['kind']!r}, not {kind!r}")
    k = _KINDS[kind]
    h = _core.hparams(**hp)
    p, g = _arrays.as_input(param), _arrays.as_input(grad)
    _check_grad_shape(p, g)
    ns = _core.state_layout(k, state["bits"], state["block_size"], 0, h["momentum"])["num_states"]
    for j in range(1, ns + 1):
        if state.get(f"state{j}") is None:
            raise ValueError(f"state: has no state{j}; make it with {kind}'s init and the same momentum")
    _core.step(k, state["bits"], state["block_size"], h, [p], [g],
               [state["state1"]], [state["absmax1"]], [state["state2"]], [state["absmax2"]],
               [state["step"]], grad_scale, found_inf, _arrays.stream_of(p),
               [state.get("kahan_comp")], rows=[state.get("rows", 1)],
               trust=[_zeros(p, (_core.trust_numel(_numel(p)),), "float32")]
               if h["max_unorm"] > 0 else None,
               state3=[state["state3"]] if ns > 2 else None,
               absmax3=[state["absmax3"]] if ns > 2 else None)


def _check_grad_shape(param, grad) -> None:
    """Refuses a gradient of another shape than its parameter (where both arrays have a
    shape): the core sees only the element counts, and would apply a gradient of the
    same size in another layout, such as JAX's (in, out) for torch's (out, in) weight,
    to the wrong elements."""
    ps, gs = getattr(param, "shape", None), getattr(grad, "shape", None)
    if ps is not None and gs is not None and tuple(ps) != tuple(gs):
        raise MemfitValueError(f"grad: has shape {tuple(gs)}, but param has shape {tuple(ps)}; "
                               "a gradient must have its parameter's shape (transpose or reshape "
                               "it to the parameter's layout first)")


def _betas(betas) -> tuple:
    if isinstance(betas, (str, bytes)) or not hasattr(betas, "__len__") or len(betas) != 2:
        raise (ValueError if hasattr(betas, "__len__") else TypeError)(
            f"betas: expected a pair (beta1, beta2), got {betas!r}")
    return tuple(betas)


def _adam_hp(lr, betas, eps, weight_decay, maximize):
    b1, b2 = _betas(betas)
    return dict(lr=lr, beta1=b1, beta2=b2, eps=eps, weight_decay=weight_decay, maximize=maximize)


def adamw8bit_init(param, block_size=256, min_8bit_size=0, kahan=False):
    return init("adamw", param, 8, block_size, min_8bit_size=min_8bit_size, kahan=kahan)


def adamw8bit_step(param, grad, state, *, lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                   weight_decay=1e-2, maximize=False, grad_scale=None, found_inf=None):
    """AdamW step (torch.optim.AdamW's math) with the state from :func:`adamw8bit_init`."""
    step("adamw", param, grad, state, grad_scale=grad_scale, found_inf=found_inf,
         **_adam_hp(lr, betas, eps, weight_decay, maximize))


def adam8bit_init(param, block_size=256, min_8bit_size=0, kahan=False):
    return init("adam", param, 8, block_size, min_8bit_size=min_8bit_size, kahan=kahan)


def adam8bit_step(param, grad, state, *, lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                  weight_decay=0.0, maximize=False, grad_scale=None, found_inf=None):
    """Adam step (L2 weight decay, torch.optim.Adam's math)."""
    step("adam", param, grad, state, grad_scale=grad_scale, found_inf=found_inf,
         **_adam_hp(lr, betas, eps, weight_decay, maximize))


def adamw4bit_init(param, block_size=128, min_8bit_size=0, kahan=False):
    return init("adamw", param, 4, block_size, min_8bit_size=min_8bit_size, kahan=kahan)


def adamw4bit_step(param, grad, state, *, lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                   weight_decay=1e-2, maximize=False, grad_scale=None, found_inf=None):
    """AdamW step with 4-bit states (from :func:`adamw4bit_init`)."""
    step("adamw", param, grad, state, grad_scale=grad_scale, found_inf=found_inf,
         **_adam_hp(lr, betas, eps, weight_decay, maximize))


def adamw_init(param, kahan=False):
    return init("adamw", param, 32, kahan=kahan)


def adamw_step(param, grad, state, *, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
               maximize=False, grad_scale=None, found_inf=None):
    """AdamW step with float32 states (from :func:`adamw_init`)."""
    step("adamw", param, grad, state, grad_scale=grad_scale, found_inf=found_inf,
         **_adam_hp(lr, betas, eps, weight_decay, maximize))


def adam_init(param, kahan=False):
    return init("adam", param, 32, kahan=kahan)


def adam_step(param, grad, state, *, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
              maximize=False, grad_scale=None, found_inf=None):
    """Adam step with float32 states (from :func:`adam_init`)."""
    step("adam", param, grad, state, grad_scale=grad_scale, found_inf=found_inf,
         **_adam_hp(lr, betas, eps, weight_decay, maximize))


def lion8bit_init(param, block_size=256, min_8bit_size=0, kahan=False):
    return init("lion", param, 8, block_size, min_8bit_size=min_8bit_size, kahan=kahan)


def lion8bit_step(param, grad, state, *, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0,
                  maximize=False, grad_scale=None, found_inf=None):
    """Lion step with an 8-bit exp_avg (from :func:`lion8bit_init`)."""
    b1, b2 = _betas(betas)
    step("lion", param, grad, state, grad_scale=grad_scale, found_inf=found_inf, lr=lr,
         beta1=b1, beta2=b2, weight_decay=weight_decay, maximize=maximize)


def sgd8bit_init(param, momentum=0.9, block_size=256, min_8bit_size=0, kahan=False):
    return init("sgd", param, 8, block_size, momentum=momentum, min_8bit_size=min_8bit_size,
                kahan=kahan)


def sgd8bit_step(param, grad, state, *, lr=1e-3, momentum=0.9, dampening=0.0, weight_decay=0.0,
                 nesterov=False, maximize=False, grad_scale=None, found_inf=None):
    """SGD step (torch.optim.SGD's math) with an 8-bit momentum buffer."""
    step("sgd", param, grad, state, grad_scale=grad_scale, found_inf=found_inf, lr=lr,
         momentum=momentum, dampening=dampening, weight_decay=weight_decay, nesterov=nesterov,
         maximize=maximize)


def rmsprop8bit_init(param, momentum=0.0, block_size=256, min_8bit_size=0, kahan=False):
    return init("rmsprop", param, 8, block_size, momentum=momentum, min_8bit_size=min_8bit_size,
                kahan=kahan)


def rmsprop8bit_step(param, grad, state, *, lr=1e-2, alpha=0.99, eps=1e-8, weight_decay=0.0,
                     momentum=0.0, maximize=False, grad_scale=None, found_inf=None):
    """RMSprop step (torch.optim.RMSprop's math, not centered) with 8-bit states."""
    step("rmsprop", param, grad, state, grad_scale=grad_scale, found_inf=found_inf, lr=lr,
         alpha=alpha, eps=eps, weight_decay=weight_decay, momentum=momentum, maximize=maximize)
