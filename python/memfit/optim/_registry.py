"""Which memfit optimizer classes there are, and the math each does: the registry the
converters read, so that they never import the class modules (which import them).

A class declares its math where it is defined (``_kind``: the mf_optim_kind that steps
it, ``_bits``: its default state format; the states follow from the kind,
``_core.STATE_NAMES``) and registers itself when it is made: memfit's torch base class
(memfit.optim._torch) calls :func:`register` from ``__init_subclass__``. Registered are
the public classes of memfit.optim's modules (memfit.optim.optimizers, muon, trust and
the bitsandbytes shims of memfit.optim.bnb), each under the name its ``state_dict()``
records (:func:`record_name`); a user's own subclass is not (a state dict it saved loads
only into its own class).

A state dict names the class that saved it, and that class need not be imported yet
(a checkpoint of a ``bnb.AdamW8bit`` loaded into ``memfit.optim.AdamW8bit`` in a fresh
process): the package memfit.optim, which Python imports before any of its modules,
hands :func:`set_loader` the function that imports every class module, and
:func:`saver_class` calls it once, on the first name it does not know.

Imports: _core only (no torch), so every layer may ask.
"""

from __future__ import annotations

from collections import namedtuple

from memfit.optim import _core

# The math of a class: the kind that steps it, its default bits, its states (torch's names)
Math = namedtuple("Math", "kind bits states")

# the module whose classes are bitsandbytes' shims: their records say "bnb."
SHIM_MODULE = "memfit.optim.bnb"

_recorded = {}  # record name -> class
_bare = {}  # a shim's bare name -> its class (for dicts saved before records named the shim)
_loader = None  # imports every class module (set by memfit/optim/__init__.py)
_loaded = False


def record_name(optimizer) -> str:
    """The name under which ``state_dict()`` records the class of ``optimizer`` (an
    optimizer or its class): the class name, ``bnb.``-prefixed for the classes of
    memfit.optim.bnb, whose ``Adam``, ``Adam8bit`` and ``AdamW`` share their names with
    memfit's own classes but not always their math (bitsandbytes' Adam decays decoupled)."""
    cls = optimizer if isinstance(optimizer, type) else type(optimizer)
    return ("bnb." if cls.__module__ == SHIM_MODULE else "") + cls.__name__


def math_of(cls) -> Math:
    """The math ``cls`` (an optimizer class or instance) declares."""
    return Math(cls._kind, cls._bits, _core.STATE_NAMES[cls._kind])


def register(cls) -> type:
    """Records ``cls`` if it is a public class of memfit.optim (see the module's doc);
    returns it (usable as a class decorator)."""
    if cls.__name__.startswith("_") or not cls.__module__.startswith("memfit.optim."):
        return cls
    name = record_name(cls)
    _recorded[name] = cls
    if name != cls.__name__:
        _bare.setdefault(cls.__name__, cls)
    return cls


def set_loader(loader) -> None:
    """``loader()`` imports every module that defines memfit optimizer classes (they
    register as they are made); :func:`saver_class` calls it once, when first asked for a
    name it does not know."""
    global _loader
    _loader = loader


def saver_class(saver):
    """The class a memfit state dict recorded as its saver (``saver``, a record name),
    or None where memfit has none: memfit's own class of that name, else the
    bitsandbytes shim recorded under it (``bnb.AdamW8bit``) or, for dicts a shim saved
    before the records named the shim, its bare name where memfit has no class of it."""
    if not isinstance(saver, str):
        return None
    if saver not in _recorded and saver not in _bare:
        _load_all()
    return _recorded.get(saver) or _bare.get(saver)


def classes() -> dict:
    """{record name: class} of every registered class (all of them: loads them first)."""
    _load_all()
    return dict(_recorded)


def _load_all() -> None:
    global _loaded
    if not _loaded and _loader is not None:
        _loader()
        _loaded = True  # after: an import that failed is tried again next time
