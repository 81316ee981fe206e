"""ActivationMeter: the one saved-tensor meter. Counts the bytes a forward pass keeps for
backward in the planner's terms (also `memfit.profile.SavedTensorMeter`). Imports
torch only when used.
"""

from __future__ import annotations

import threading
from typing import Any, Iterable

from memfit.checkpoint.budget import _fmt_bytes


def _torch():
    import torch

    return torch


def _storage_key(t):
    try:
        st = t.untyped_storage()
        return (st.device.type, st.device.index, st.data_ptr()), st.nbytes()
    except Exception:  # tensor subclasses without storage: count their own bytes
        return ("id", id(t)), t.numel() * t.element_size()


class ActivationMeter:
    """Counts the bytes a forward pass keeps for backward, in the planner's terms.

    Inside ``with meter:`` every tensor saved for backward outside checkpointed
    regions is counted once per storage (``saved_bytes``), checkpoints report what
    they keep to recompute (``boundary_bytes``: inputs, or their int8 codes with
    ``compress="int8"``), and during the later backward each recompute reports the
    tensors it materializes (``recompute_peak_bytes`` is the largest). Parameters
    (and anything in ``exclude``) are not activations and are not counted.

    ``total_bytes = saved_bytes + boundary_bytes + recompute_peak_bytes`` is the
    quantity the planner bounds. Storages are counted whole (a view of a big tensor
    counts the big tensor), which is what stays allocated.

    >>> import torch
    >>> lin = torch.nn.Linear(8, 8)
    >>> with ActivationMeter(exclude=lin) as m:
    ...     y = torch.relu(lin(torch.randn(4, 8)))
    >>> m.saved_bytes  # the input saved by the matmul, the relu output
    256
    """

    def __init__(self, exclude: Any = None):
        self._exclude = set()
        if exclude is not None:
            self.exclude(exclude)
        self._saved = {}
        self._boundary = {}
        self.recompute_peak_bytes = 0
        self.recomputes = 0
        self._hooks = None
        self._lock = threading.Lock()

    def exclude(self, obj) -> None:
        """Do not count these tensors' storages (a module's parameters and buffers,
        a tensor, or an iterable of either)."""
        torch = _torch()
        items: Iterable
        if isinstance(obj, torch.nn.Module):
            items = list(obj.parameters()) + list(obj.buffers())
        elif isinstance(obj, torch.Tensor):
            items = [obj]
        else:
            items = list(obj)
        for t in items:
            if isinstance(t, torch.nn.Module):
                self.exclude(t)
            else:
                self._exclude.add(_storage_key(t)[0])

    def _add(self, table, t):
        key, nbytes = _storage_key(t)
        if key in self._exclude:
            return
        torch = _torch()
        if isinstance(t, torch.nn.Parameter):
            return
        table[key] = nbytes

    @property
    def saved_bytes(self) -> int:
        return sum(self._saved.values())

    @property
    def boundary_bytes(self) -> int:
        return sum(v for k, v in self._boundary.items() if k not in self._saved)

    @property
    def total_bytes(self) -> int:
        return self.saved_bytes + self.boundary_bytes + self.recompute_peak_bytes

    def _note_boundary(self, tensors):
        with self._lock:
            for t in tensors:
                self._add(self._boundary, t)

    def _note_recompute(self, tensors):
        table = {}
        for t in tensors:
            self._add(table, t)
        with self._lock:
            self.recomputes += 1
            self.recompute_peak_bytes = max(self.recompute_peak_bytes, sum(table.values()))

    def __enter__(self):
        torch = _torch()

        def pack(x):
            self._add(self._saved, x)
            return x

        def unpack(x):
            return x

        self._hooks = torch.autograd.graph.saved_tensors_hooks(pack, unpack)
        self._hooks.__enter__()
        _active_meters.append(self)
        return self

    def __exit__(self, *exc):
        _active_meters.remove(self)
        self._hooks.__exit__(*exc)
        self._hooks = None
        return False

    def __repr__(self):
        return (f"ActivationMeter(saved={_fmt_bytes(self.saved_bytes)}, "
                f"boundary={_fmt_bytes(self.boundary_bytes)}, "
                f"recompute_peak={_fmt_bytes(self.recompute_peak_bytes)}, "
                f"total={_fmt_bytes(self.total_bytes)})")


_active_meters: list = []
