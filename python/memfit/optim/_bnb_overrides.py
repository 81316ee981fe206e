"""bitsandbytes' per-parameter overrides for memfit.optim.bnb's classes: the
``GlobalOptimManager`` singleton, and the mixin of every shim class (``_BnbOptimizer``)
that reads it when a parameter's state format is chosen and records the shim as the
saver of its state dicts; ``_shim_class`` makes a shim class on that mixin."""

from __future__ import annotations

import weakref
from types import MappingProxyType

import torch

from memfit.optim import _registry
from memfit.optim._bnb_args import _check_bnb_options
from memfit.optim._torch import _MemfitOptimizer


class _BnbOptimizer:
    """Mixin of every class of memfit.optim.bnb: the state format of each parameter also
    follows the GlobalOptimManager's overrides (bitsandbytes' override_config)."""

    # memfit.optim.offload builds the optimizer on host copies of the model's parameters
    # and maps each copy to its parameter here (id(copy) -> parameter): the overrides
    # registered for the parameter are the copy's; the class's own is empty and read-only
    _override_alias = MappingProxyType({})

    def _set_bits(self, bits):
        # the state format of every group that does not say otherwise (memfit's "bits"
        # group option); set before the base constructor reads it
        self._bits = bits

    def state_dict(self):
        sd = super().state_dict()
        # "bnb.Adam8bit", not memfit's own Adam8bit (L2 decay): loaders decide by the math
        sd["memfit"]["optimizer"] = _registry.record_name(self)
        return sd

    def _format(self, group, p) -> int:
        config = GlobalOptimManager.get_instance()._config_for(self._override_alias.get(id(p), p))
        if not config:
            return _MemfitOptimizer._format(group, p)
        bits = config.get("optim_bits", group["bits"])
        if bits == 8 and group["bits"] != 8:
            raise ValueError(
                f"{self._where(p)}: override optim_bits=8 in a {group['bits']}-bit group: memfit "
                "chooses 8-bit states per param group; put this parameter in a group with "
                "'bits': 8 (or use the 8-bit class for all and override the others to 32)")
        return _MemfitOptimizer._format(
            dict(group, bits=bits, min_8bit_size=config.get("min_8bit_size", group["min_8bit_size"])), p)


def _shim_class(name, base, init, doc) -> type:
    """A class of memfit.optim.bnb: ``base`` (memfit's class of the same math) with
    bitsandbytes' constructor ``init`` and the overrides' mixin; its module is
    memfit.optim.bnb, where users import it from (pickles and state-dict records name
    it there)."""
    return type(name, (_BnbOptimizer, base), {"__init__": init, "__doc__": doc,
                                              "__module__": _registry.SHIM_MODULE})


# -- per-parameter overrides -----------------------------------------------------------------

# the override keys that choose a state format, and the values of bitsandbytes' other
# 8-bit options that change nothing (anything else would be ignored: refused instead)
_FORMAT_KEYS = ("optim_bits", "min_8bit_size")
_NEUTRAL = {"percentile_clipping": 100, "block_wise": True, "max_unorm": 0.0, "skip_zeros": False,
            "is_paged": False}


def _check_override(config) -> dict:
    if not isinstance(config, dict):
        raise TypeError(f"config: expected a dict of option -> value, got {type(config).__name__}")
    for key, value in config.items():
        if key == "optim_bits":
            if value not in (8, 32):
                raise ValueError(f"override optim_bits: expected 8 or 32, got {value!r}")
        elif key == "min_8bit_size":
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"override min_8bit_size: expected an int >= 0, got {value!r}")
        elif key in _NEUTRAL:
            _check_bnb_options("override", **{key: value})
        else:
            raise ValueError(
                f"override {key!r}: memfit overrides only the state format per parameter "
                f"({', '.join(_FORMAT_KEYS)}); give a parameter its own {key} with a param group: "
                f"opt = bnb.AdamW8bit([{{'params': [p], {key!r}: ...}}, {{'params': others}}])")
    return {k: v for k, v in config.items() if k in _FORMAT_KEYS}


class GlobalOptimManager:
    """bitsandbytes' singleton of per-parameter option overrides, for the optimizers of
    :mod:`memfit.optim.bnb`. Keys: ``optim_bits`` (32: float32 states for this parameter
    of an 8-bit optimizer) and ``min_8bit_size``; bitsandbytes' other 8-bit options only
    at their neutral values, anything else raises ValueError (use a param group). An
    override takes effect when the parameter's state is created (its first step), so it
    may come before or after the optimizer is built, as in bitsandbytes.

        >>> mng = bnb.optim.GlobalOptimManager.get_instance()  # doctest: +SKIP
        >>> mng.override_config(model.embed.weight, "optim_bits", 32)  # doctest: +SKIP
    """

    _instance = None

    def __init__(self):
        raise RuntimeError("Call get_instance() instead")

    def initialize(self):
        """Forgets every override (bitsandbytes' name)."""
        self._by_param = {}  # id(p) -> (weakref to p, config): ids of dead tensors are reused
        self._by_module = []  # (weakref to module, attribute name, config), resolved per lookup

    @classmethod
    def get_instance(cls):
        if cls._instance is None:
            cls._instance = cls.__new__(cls)
            cls._instance.initialize()
        return cls._instance

    def register_parameters(self, params):
        """Accepted for bitsandbytes' code; overrides are keyed by the parameter itself, so
        registering changes nothing (bitsandbytes >= 0.50 does not need it either)."""
        for group in (list(params) if not isinstance(params, torch.Tensor) else [params]):
            ps = group["params"] if isinstance(group, dict) else [group]
            for p in ([ps] if isinstance(ps, torch.Tensor) else ps):
                if not isinstance(p, torch.Tensor):
                    raise TypeError(f"params: expected tensors or param groups, got {type(p).__name__}")

    def override_config(self, parameters, key=None, value=None, key_value_dict=None):
        """Overrides options of ``parameters`` (a tensor or a list of them): ``key`` and
        ``value``, or several in ``key_value_dict``."""
        if key is not None and value is not None:
            if key_value_dict is not None:
                raise ValueError("override_config: give key and value, or key_value_dict, not both")
            key_value_dict = {key: value}
        if key_value_dict is None:
            return
        config = _check_override(key_value_dict)
        for p in ([parameters] if isinstance(parameters, torch.Tensor) else list(parameters)):
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"parameters: expected a tensor or a list of tensors, got {type(p).__name__}")
            ref, old = self._by_param.get(id(p), (None, {}))
            merged = dict(old if ref is not None and ref() is p else {}, **config)
            self._by_param[id(p)] = (weakref.ref(p), merged)

    def register_module_override(self, module, param_name, config):
        """Overrides options of ``getattr(module, param_name)`` (bitsandbytes' StableEmbedding
        registers ``(self, "weight", {"optim_bits": 32})``)."""
        if not isinstance(getattr(module, param_name, None), torch.Tensor):
            raise ValueError(f"register_module_override: {type(module).__name__} has no tensor "
                             f"attribute {param_name!r}")
        self._by_module.append((weakref.ref(module), param_name, _check_override(config)))

    def _config_for(self, p) -> dict:
        config = {}
        for ref, name, cfg in self._by_module:
            module = ref()
            if module is not None and getattr(module, name, None) is p:
                config.update(cfg)
        ref, cfg = self._by_param.get(id(p), (None, None))
        if ref is not None and ref() is p:
            config.update(cfg)
        return config
