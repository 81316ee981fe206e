"""memfit.optim: optimizers with 8-bit and 4-bit blockwise-quantized states, as drop-in
torch.optim.Optimizer subclasses.

    >>> import torch, memfit.optim  # doctest: +SKIP
    >>> opt = memfit.optim.AdamW8bit(model.parameters(), lr=1e-3)  # doctest: +SKIP

One fused kernel per step and device (C with OpenMP on the CPU, a multi-tensor CUDA
launch on the GPU) dequantizes the states, applies the update in float32, writes the
parameter and requantizes, block by block. See docs/optim.md.

:func:`to_torch_state_dict` exports the states for torch.optim, and ``load_state_dict``
also takes torch.optim's and bitsandbytes' state dicts (:mod:`memfit.optim.convert`).

Training a model larger than the GPU: :class:`CPUOffloadOptimizer` keeps the states and
master weights on the host and steps them there (torchao's signature; docs/offload.md).

Coming from bitsandbytes: ``import memfit.optim.bnb as bnb`` gives its classes, names and
signatures on these optimizers (:mod:`memfit.optim.bnb`).

The optimizer classes import torch on first use; :mod:`memfit.optim.functional`, the
array-level API for NumPy, CuPy and JAX users, does not need torch.
"""

__all__ = [
    "Adagrad",
    "Adagrad8bit",
    "AdEMAMix",
    "AdEMAMix8bit",
    "Adam",
    "Adam8bit",
    "AdamW",
    "AdamW4bit",
    "AdamW8bit",
    "CPUOffloadOptimizer",
    "LAMB",
    "LAMB8bit",
    "LARS",
    "LARS8bit",
    "Lion8bit",
    "Muon",
    "Muon8bit",
    "RMSprop8bit",
    "SGD8bit",
    "bnb",
    "convert",
    "dequantized_state",
    "functional",
    "muon_param_groups",
    "to_torch_state_dict",
]

from memfit.optim import _registry

_TORCH_NAMES = {
    "Adagrad": "optimizers", "Adagrad8bit": "optimizers",
    "AdEMAMix": "optimizers", "AdEMAMix8bit": "optimizers",
    "Adam": "optimizers", "Adam8bit": "optimizers", "AdamW": "optimizers",
    "AdamW4bit": "optimizers", "AdamW8bit": "optimizers", "Lion8bit": "optimizers",
    "RMSprop8bit": "optimizers", "SGD8bit": "optimizers", "dequantized_state": "_format",
    "Muon": "muon", "Muon8bit": "muon", "muon_param_groups": "muon",
    "LAMB": "trust", "LAMB8bit": "trust", "LARS": "trust", "LARS8bit": "trust",
    "to_torch_state_dict": "convert", "CPUOffloadOptimizer": "offload",
}


def _import_classes() -> None:
    """Imports every module that defines optimizer classes; each class registers itself
    as it is made (memfit.optim._registry). The registry calls this once, the first time
    a state dict names a class it has not seen (a ``bnb.AdamW8bit`` checkpoint loaded
    into ``memfit.optim.AdamW8bit`` before memfit.optim.bnb was imported): importing
    memfit.optim itself stays free of torch (memfit.optim.functional needs none)."""
    from memfit.optim import bnb, muon, optimizers, trust  # noqa: F401 (they register)


# this package is imported before any of its modules: the registry can always fill itself
_registry.set_loader(_import_classes)


def __getattr__(name):
    import importlib

    if name in ("functional", "convert", "bnb"):
        return importlib.import_module(f"memfit.optim.{name}")
    if name in _TORCH_NAMES:
        value = getattr(importlib.import_module(f"memfit.optim.{_TORCH_NAMES[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'memfit.optim' has no attribute {name!r}")
