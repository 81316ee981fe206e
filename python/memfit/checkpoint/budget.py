"""Memory budgets: parse_bytes reads "6GB", "512MiB", "50%" or a byte count; _fmt_bytes
prints one. Imports no torch.
"""

from __future__ import annotations

import math
import numbers
import re


_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value, *, total: int | None = None, name: str = "budget") -> int:
    """A byte count from an int, a float, or a string such as ``"6GB"`` (10**9),
    ``"6GiB"``/``"6G"`` (2**30), ``"512MiB"``, ``"1.5 GB"``; ``"50%"`` means that share
    of ``total`` (for budgets: of the store-everything activation memory).

    >>> parse_bytes("6GB"), parse_bytes("512MiB"), parse_bytes("25%", total=1000)
    (6000000000, 536870912, 250)
    """
    if isinstance(value, bool):
        raise TypeError(f"{name}: expected bytes as an int or a string like '6GB', got bool")
    if isinstance(value, str):
        s = value.strip()
        if s.endswith("%"):
            if total is None:
                raise ValueError(f"{name}: {value!r} is a share of the full activation "
                                 "memory, which is not known here; give bytes")
            try:
                frac = float(s[:-1]) / 100.0
            except ValueError:
                raise ValueError(f"{name}: cannot read {value!r} as a percentage") from None
            if not (frac >= 0.0 and math.isfinite(frac)):
                raise ValueError(f"{name}: {value!r} must be a non-negative percentage")
            return _whole_bytes(frac * total, value, name)
        m = _SIZE_RE.match(s)
        if not m or m.group(2).lower() not in _UNITS:
            raise ValueError(f"{name}: cannot read {value!r} as a size; use bytes (an int) "
                             "or e.g. '6GB', '6GiB', '512MiB', '50%'")
        return _whole_bytes(float(m.group(1)) * _UNITS[m.group(2).lower()], value, name)
    try:
        import operator

        v = operator.index(value)
    except TypeError:
        if isinstance(value, numbers.Real):  # float, NumPy floats
            f = float(value)
            if not (math.isfinite(f) and f >= 0):
                raise ValueError(f"{name}: must be a finite size >= 0, got {value!r}") from None
            return int(math.floor(f))
        raise TypeError(f"{name}: expected bytes as an int or a string like '6GB', "
                        f"got {type(value).__name__}") from None
    if v < 0:
        raise ValueError(f"{name}: must be >= 0 bytes, got {v}")
    return int(v)


def _whole_bytes(size: float, value, name: str) -> int:
    """floor(size), or a ValueError naming the argument where the text overflowed a
    float ("1e400GB" reads as inf)."""
    if not math.isfinite(size):
        raise ValueError(f"{name}: {value!r} is too large to be a size in bytes")
    return int(math.floor(size))


def _fmt_bytes(n) -> str:
    if n is None:
        return "?"
    n = float(n)
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= div:
            return f"{n / div:.2f} {unit}"
    return f"{int(n)} B"
