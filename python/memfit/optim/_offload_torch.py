"""What torch's Optimizer API sees of memfit.optim.offload's CPUOffloadOptimizer: its
param groups (torch's forms of ``params``, and the wrapped optimizer's group dicts with
the tensors whose ``.grad`` the step reads) and the wrapped optimizer's step without
torch's global step hooks."""

from __future__ import annotations

from collections.abc import MutableMapping

import torch

from memfit._C import MemfitTypeError, MemfitValueError


class _Group(MutableMapping):
    """One of :attr:`CPUOffloadOptimizer.param_groups`: the wrapped optimizer's group
    (so an LR scheduler's ``group['lr'] = ...`` changes the lr the host step uses), with
    ``'params'`` the tensors whose ``.grad`` the step reads. The group is looked up at
    each use: the wrapped optimizer's load_state_dict replaces its group dicts."""

    def __init__(self, optimizer, index: int, params: list):
        self._optimizer, self._index, self._params = optimizer, index, params

    @property
    def _inner(self) -> dict:
        return self._optimizer.param_groups[self._index]

    def __getitem__(self, key):
        return self._params if key == "params" else self._inner[key]

    def __setitem__(self, key, value):
        if key == "params":
            raise MemfitValueError("CPUOffloadOptimizer: param_groups[g]['params'] cannot be "
                                   "replaced; build a new optimizer over the new parameters")
        self._inner[key] = value

    def __delitem__(self, key):
        if key == "params":
            raise MemfitValueError("CPUOffloadOptimizer: param_groups[g]['params'] cannot be "
                                   "deleted")
        del self._inner[key]

    def __iter__(self):
        return iter(self._inner)

    def __len__(self):
        return len(self._inner)

    def __repr__(self):
        return repr({**self._inner, "params": self._params})


def _groups_of(params) -> list:
    """The param groups as dicts with a list of params (torch's forms: tensors, dicts)."""
    if isinstance(params, torch.Tensor):
        raise MemfitTypeError("params: expected an iterable of tensors or dicts, got a tensor; "
                              "pass [tensor] or model.parameters()")
    items = list(params)
    if not items:
        raise MemfitValueError("params: optimizer got an empty parameter list")
    if not isinstance(items[0], dict):
        items = [{"params": items}]
    groups = []
    for gi, g in enumerate(items):
        if not isinstance(g, dict):
            raise MemfitTypeError(f"params[{gi}]: expected a dict (a param group) like params[0], "
                                  f"got {type(g).__name__}")
        ps = g.get("params")
        if isinstance(ps, (set, frozenset)):
            raise MemfitTypeError(
                f"params[{gi}]['params']: a set; optimizer parameters need an ordered collection "
                "(a set's order changes between runs and would map states to the wrong "
                "parameters): pass a list")
        ps = [ps] if isinstance(ps, torch.Tensor) else list(ps if ps is not None else ())
        groups.append({**g, "params": ps})
    return groups


def _inner_step(inner) -> None:
    """The wrapped optimizer's step() without torch's global step hooks: they ran for the
    offloader's own step (torch wraps each optimizer class's step to run them, the
    wrapped optimizer's too), and run once per step. Hooks registered on the wrapped
    optimizer itself run, as torch runs them."""
    step = type(inner).step
    bare = getattr(step, "__wrapped__", None)
    if bare is None or getattr(inner.step, "__func__", None) is not step:
        inner.step()  # replaced on the instance, or not wrapped by torch: as it is
        return
    args, kwargs = (inner,), {}
    for hook in list(inner._optimizer_step_pre_hooks.values()):
        result = hook(inner, args, kwargs)
        if result is not None:
            args, kwargs = result
    bare(*args, **kwargs)
    inner._optimizer_step_code()
    for hook in list(inner._optimizer_step_post_hooks.values()):
        hook(inner, args, kwargs)
