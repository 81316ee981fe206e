"""State dicts of memfit's torch optimizers, a part of memfit.optim._torch._MemfitOptimizer:
``state_dict()`` with memfit's format record, ``load_state_dict()`` that converts a
foreign or older dict first (memfit.optim.convert) and checks everything before it
changes anything, and torch's state-dict hooks, run where torch runs them (for these
optimizers and memfit.optim.offload's CPUOffloadOptimizer).

The class this is mixed into provides the state layout (``_expected_state``,
``_row_major_states``) and the torch flags and fixed options its groups keep.
"""

from __future__ import annotations

from collections import OrderedDict, defaultdict

from memfit._C import MemfitValueError
from memfit.optim import _checks, _dtensor, _format, convert
from memfit.optim._torch_step import _STATE_KEYS


class _StateDictMixin:
    """state_dict, load_state_dict and the checks of a saved format."""

    def state_dict(self):
        """torch's state dict, plus memfit's format record (top level and every group).
        The state-dict hooks run where torch runs them: pre-hooks first (torch's
        state_dict), post-hooks on the finished dict, memfit's record included."""
        post_hooks = self._optimizer_state_dict_post_hooks
        self._optimizer_state_dict_post_hooks = OrderedDict()  # run below, after the record
        try:
            sd = super().state_dict()
        finally:
            self._optimizer_state_dict_post_hooks = post_hooks
        sd["memfit"] = {"optimizer": type(self).__name__, "format_version": _format.FORMAT_VERSION}
        for g in sd["param_groups"]:  # new dicts (torch packs each group anew)
            g[_format.GROUP_FORMAT_KEY] = _format.FORMAT_VERSION
        return run_state_dict_post_hooks(self, sd, post_hooks)

    def _check_saved_format(self, state_dict, versions=None, same_class=True) -> None:
        """Refuses a state dict that memfit did not save in one of ``versions`` (by
        default the current format; see :func:`memfit.optim._format.saved_format`), or,
        with ``same_class``, saved for another class (before conversion the saver may be
        another class of the same math: convert.to_current judges that)."""
        name = type(self).__name__
        versions = versions or (_format.FORMAT_VERSION,)
        saver, version = _format.saved_format(state_dict)
        if saver is None and version is None:
            raise MemfitValueError(
                f"{name}.load_state_dict: this state dict was not saved by a memfit optimizer "
                "(its optimizer states have a different layout); start the optimizer fresh or "
                "load a state dict saved by memfit.optim." + name)
        if same_class and saver is not None and saver != name:
            raise MemfitValueError(f"{name}.load_state_dict: the state dict was saved by "
                                   f"memfit.optim.{saver}, not {name}: load it into a "
                                   f"memfit.optim.{saver}; nothing was loaded")
        if version not in versions:
            raise MemfitValueError(
                f"{name}.load_state_dict: unknown format_version {version!r} in memfit's record "
                f"(this memfit reads {' and '.join(map(str, versions))}: a state dict saved by "
                "a newer memfit, or its record was edited); nothing was loaded")

    def load_state_dict(self, state_dict):
        """Loads a state dict saved by the same memfit optimizer class for parameters of
        the same shapes. Codes, absmax and step are restored exactly (no dtype casts),
        so training resumes bit-identically. A torch.optim or bitsandbytes state dict of
        the same kind, or one of an older memfit format, is converted first (see
        :mod:`memfit.optim.convert`).

        Everything is checked before anything changes: a refused state dict leaves the
        optimizer as it was. Refused, with :class:`memfit.MemfitValueError` (a
        ValueError) naming the parameter as ``param_groups[g]['params'][i]``, its shape
        and the state: another optimizer's or format's state dict; a parameter's state
        with a key missing (torch.optim would raise KeyError at the next step) or one it
        does not keep; a state of another dtype or shape (a truncated tensor included);
        NaN, Inf or negative absmax; a ``step`` that is not a whole number >= 0; NaN or
        Inf float32 states or Kahan buffers, negative second moments; 8-bit codes laid
        out in another memory order than the parameter. Repaired, exactly: states in
        another memory layout whose values are well defined (float32 states, Kahan
        buffers, absmax, 4-bit codes, 8-bit codes in the parameter's order) are copied
        into the layout the kernels need. An empty state (``{}``, a parameter never
        stepped) starts fresh, as in torch; a missing ``kahan_comp`` starts at zero (the
        parameter's value as it is).

        As in torch: the load_state_dict pre-hooks run first, on a shallow copy of
        ``state_dict`` (a hook may return a replacement), the post-hooks after loading;
        a param group missing torch's flags (maximize, foreach, fused, capturable,
        differentiable) gets their defaults; ``param_names`` absent from the saved groups
        are kept; a ``step`` saved as a number is converted to a tensor; entries of
        ``state`` that belong to no parameter are kept as they are, unless they look
        like a parameter's state (hold memfit's state keys): then it is refused, as a
        state that would be lost (shifted or string ids)."""
        state_dict = run_load_state_dict_pre_hooks(self, state_dict)
        name = type(self).__name__
        _checks.check_structure(name, state_dict)
        if _format.saved_format(state_dict) != (None, None):
            # memfit's own: its record is checked before any conversion reads it
            self._check_saved_format(state_dict, versions=(1, _format.FORMAT_VERSION),
                                     same_class=False)
        state_dict = convert.to_current(self, state_dict)
        self._check_saved_format(state_dict)
        groups = self.param_groups
        saved_groups = state_dict["param_groups"]
        if len(groups) != len(saved_groups):
            raise MemfitValueError("loaded state dict has a different number of parameter groups")
        if any(len(g["params"]) != len(sg["params"]) for g, sg in zip(groups, saved_groups)):
            raise MemfitValueError("loaded state dict contains a parameter group that doesn't "
                                   "match the size of optimizer's group")
        # saved parameter id -> (group index, index in the group, the optimizer's parameter)
        place = {pid: (gi, i, p) for gi, (g, sg) in enumerate(zip(groups, saved_groups))
                 for i, (pid, p) in enumerate(zip(sg["params"], g["params"]))}
        new_groups = []
        missing = {**self._TORCH_FLAGS, **{k: v for k, v, _ in self._fixed_options}}
        for gi, (g, sg) in enumerate(zip(groups, saved_groups)):
            ng = {**missing, **sg}  # torch's __setstate__ fills the flags an old dict lacks
            ng.pop(_format.GROUP_FORMAT_KEY, None)  # recorded by state_dict(), not a setting
            ng["params"] = g["params"]
            if "param_names" in g and "param_names" not in sg:
                ng["param_names"] = g["param_names"]
            try:  # a refused load is a MemfitValueError, whatever the value's fault
                _checks.check_group(self, ng, f"{name}.load_state_dict: param_groups[{gi}]")
            except (TypeError, ValueError, RuntimeError) as e:
                raise MemfitValueError(f"{e}; nothing was loaded") from None
            new_groups.append(ng)
        convert.check_state_ids(name, state_dict, place, _STATE_KEYS)
        state = defaultdict(dict)
        for pid, saved in state_dict["state"].items():
            if pid not in place:
                state[pid] = saved  # not a parameter's: kept as it is, as torch does
                continue
            gi, i, p = place[pid]
            where = (f"{name}.load_state_dict: param_groups[{gi}]['params'][{i}] "
                     f"(shape {tuple(p.shape)})")
            if not isinstance(saved, dict):
                raise MemfitValueError(f"{where}: its state is a {type(saved).__name__}, not a "
                                       "dict of tensors; nothing was loaded")
            if not saved:
                continue  # never stepped (torch saves such a state as {}): starts fresh
            group = new_groups[gi]
            if "step" in saved:
                saved = {**saved, "step": _checks.saved_step(where, saved["step"])}
            expected = self._expected_state(group, p)
            _checks.check_saved_keys(where, saved, expected)
            row_major = self._row_major_states(group)
            loaded = {k: _checks.laid_out(where, k, self._loaded_value(k, v, p), p, row_major)
                      for k, v in saved.items()}
            for key, value in loaded.items():
                problem = _checks.state_problem(key, value, *expected[key], p, row_major)
                if problem is not None:
                    raise problem[0](f"{where}: {problem[1]}; nothing was loaded")
            _checks.check_values(self, where, group, p, loaded)
            state[p] = loaded
        self.__setstate__({"state": state, "param_groups": new_groups})
        self.__dict__.pop("_state_checked", None)  # new states: check them on the next step
        run_load_state_dict_post_hooks(self)

    @staticmethod
    def _loaded_value(key, value, p):
        """A fresh copy of one loaded state, laid out as p's states are (a DTensor of
        p's placements for a DTensor p, whatever the saved layout)."""
        if _dtensor.is_dtensor(p) or _dtensor.is_dtensor(value):
            return _dtensor.loaded_value(key, value, p)
        return value.detach().to(device=p.device, copy=True)


# torch's state-dict hooks, run as torch.optim.Optimizer runs them, for the optimizers
# here and memfit.optim.offload's CPUOffloadOptimizer (whose state_dict is its wrapped
# optimizer's): ``optimizer`` is the one the hooks were registered on, and is passed to them

def run_state_dict_post_hooks(optimizer, state_dict, hooks=None):
    """The state_dict post-hooks (``hooks``, by default the optimizer's) on the finished
    dict; a hook may return a replacement."""
    hooks = optimizer._optimizer_state_dict_post_hooks if hooks is None else hooks
    for hook in list(hooks.values()):
        result = hook(optimizer, state_dict)
        if result is not None:
            state_dict = result
    return state_dict


def run_load_state_dict_pre_hooks(optimizer, state_dict):
    """The load_state_dict pre-hooks on a shallow copy of ``state_dict`` (the caller's
    dict is not changed); a hook may return a replacement. Returns the dict to load."""
    state_dict = state_dict.copy() if isinstance(state_dict, dict) else state_dict
    for hook in list(optimizer._optimizer_load_state_dict_pre_hooks.values()):
        result = hook(optimizer, state_dict)
        if result is not None:
            state_dict = result
    return state_dict


def run_load_state_dict_post_hooks(optimizer) -> None:
    for hook in list(optimizer._optimizer_load_state_dict_post_hooks.values()):
        hook(optimizer)
