"""The GradScaler's saved forms: ``state_dict``/``load_state_dict`` (torch's five keys,
so a dict loads into ``torch.amp.GradScaler`` and back; the whole dict checked before
anything changes) and pickling (the state block's counters and history kept, the
per-iteration records refused mid-iteration, as torch). A base class of
:class:`memfit.amp.GradScaler` (scaler.py), whose settings (``_settings``,
``_check_config``: _scaler_settings.py), state block (``get_scale``,
``_get_growth_tracker``, ``_state``) and per-iteration records it reads and sets."""

from __future__ import annotations

from collections import abc, defaultdict

from memfit._C import MemfitTypeError
from memfit.amp._grads import _as_float, _as_int
from memfit.amp._scaler_settings import ScalerConfigError, _check_scale
from memfit.amp._stage import _refresh_per_optimizer_state

_STATE_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")
_INT32_MAX = 2**31 - 1


class ScalerCheckpoint:
    """The state-dict and pickling half of :class:`memfit.amp.GradScaler` (a base class)."""

    def state_dict(self) -> dict:
        """torch's five keys: ``scale``, ``growth_factor``, ``backoff_factor``,
        ``growth_interval``, ``_growth_tracker`` (empty when disabled). Loads into
        ``torch.amp.GradScaler`` and back."""
        if not self._enabled:
            return {}
        values = (self.get_scale(), self._growth_factor, self._backoff_factor,
                  self._growth_interval, self._get_growth_tracker())
        return dict(zip(_STATE_KEYS, values))

    def load_state_dict(self, state_dict: dict) -> None:
        """Loads what :meth:`state_dict` (memfit's or torch's) returned. The whole dict is
        checked before anything changes: a refused dict leaves the scaler as it was.
        Raises RuntimeError for an empty dict (saved from a disabled scaler) and KeyError
        for a missing key, as torch does; a value of the wrong type raises
        MemfitTypeError, one out of range (NaN included) ScalerConfigError, each naming
        ``state_dict['key']``. Other keys are ignored, as torch ignores them."""
        if not self._enabled:
            return
        if not isinstance(state_dict, abc.Mapping):
            raise MemfitTypeError(f"state_dict: expected a dict (from GradScaler.state_dict()), "
                                  f"got {type(state_dict).__name__}")
        if len(state_dict) == 0:
            raise RuntimeError("The source state dict is empty, possibly because it was saved "
                               "from a disabled instance of GradScaler.")
        missing = [k for k in _STATE_KEYS if k not in state_dict]
        if missing:
            raise KeyError(f"state_dict: missing {', '.join(map(repr, missing))}; a GradScaler "
                           f"state dict has {', '.join(map(repr, _STATE_KEYS))}")
        scale = _check_scale(state_dict["scale"], "state_dict['scale']")
        tracker = _as_int(state_dict["_growth_tracker"], "state_dict['_growth_tracker']")
        if not 0 <= tracker <= _INT32_MAX:  # the state block holds it as an int32
            raise ScalerConfigError(f"state_dict['_growth_tracker']: must be >= 0 and <= "
                                    f"{_INT32_MAX}, got {tracker}")
        settings = dict(self._settings(),
                        growth_factor=_as_float(state_dict["growth_factor"],
                                                "state_dict['growth_factor']"),
                        backoff_factor=_as_float(state_dict["backoff_factor"],
                                                 "state_dict['backoff_factor']"),
                        growth_interval=_as_int(state_dict["growth_interval"],
                                                "state_dict['growth_interval']"))
        self._check_config(settings, "state_dict['{}']")
        # checked: from here on nothing raises
        self._growth_factor = settings["growth_factor"]
        self._backoff_factor = settings["backoff_factor"]
        self._growth_interval = settings["growth_interval"]
        self._init_scale = scale
        self._init_growth_tracker = tracker
        if self._state is not None:
            self._state[0].fill_(scale)
            self._growth_tracker.fill_(tracker)

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        if self._enabled:
            if len(self._per_optimizer_states) != 0 or self._clip_unscaled:
                raise AssertionError(
                    "A GradScaler instance may only be pickled at the beginning of an iteration, "
                    "or at the end after scaler.update().")
            state["_init_scale"] = self.get_scale()
            state["_init_growth_tracker"] = self._get_growth_tracker()
            if self._state is not None:
                state["_saved_words"] = self._state.detach().cpu().numpy().copy()
        state["_state"] = None
        state["_scale_view"] = None
        state["_loss_flag"] = None
        state["_pending"] = None
        state["_per_optimizer_states"] = None
        state["_process_group"] = None  # a process group does not pickle: the default group
        state["_unscaled_lists"] = []
        state["_clip_unscaled"] = {}
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)
