"""torch.optim.Optimizer subclasses on memfit's fused kernels."""

from __future__ import annotations

from collections import OrderedDict, defaultdict

import torch

from memfit._C import MemfitValueError
from memfit.optim import _checks, _core, _dtensor, _format, _registry, convert
# re-exported: their old home (tests and users import them from here)
from memfit.optim._format import dequantized_state, saved_format  # noqa: F401
from memfit.optim._blocks import state_rows

# isinstance(x, _DTENSOR): whether x is a DTensor (always False without torch.distributed)
_DTENSOR = _dtensor.DTensor or ()
# A parameter's state tensors in the order the step passes them to the core (absent: None).
_STATE_KEYS = ("state1", "absmax1", "state2", "absmax2", "step", "kahan_comp", "state3",
               "absmax3")


class _MemfitOptimizer(torch.optim.Optimizer, _format.MemfitOptimizerBase):
    """Base class: state layout, the step over param groups, state_dict checks.

    Subclasses set ``_kind`` and ``_bits`` and implement ``_hparams(group)``.

    Per-parameter state (``optimizer.state[p]``):
        ``step``: float32 tensor of shape () on p's device (steps taken; torch's format).
        ``state1``/``state2``: the states, uint8 codes (shape of p for 8 bits,
        ``(rows, ceil(L/2))`` for 4 bits) with ``absmax1``/``absmax2`` (float32,
        ``(rows, ceil(L/block_size))``: one per block), where rows = ``p.shape[0]`` and L
        the elements per row (see :func:`state_rows`; quantization blocks never cross a
        row, so sharding p along dim 0 shards every state with it), or float32 tensors
        of p's shape for 1-D tensors, tensors smaller than ``min_8bit_size`` and 32-bit
        optimizers. AdEMAMix keeps a third, ``state3``/``absmax3``, laid out alike. Use
        :func:`memfit.optim.dequantized_state` to read them as floats.
        ``kahan_comp``: with ``kahan=True`` and a float16/bfloat16 ``p``, the Kahan
        compensation (p's dtype and shape; the parameter's value is ``p + kahan_comp``).
    """

    _kind: int = _core.ADAMW
    _bits: int = 8

    # step() takes a GradScaler's grad_scale and found_inf: the kernels unscale and skip
    # on the device (after unscale_, grad_scale None, they still skip on found_inf).
    # memfit's protocol, read by memfit.amp.GradScaler only. torch's flag
    # (_step_supports_amp_scaling) stays unset: Lightning reads it as "cannot clip", so
    # torch's scaler unscales these as any optimizer, unless memfit.amp.scale_in_kernel
    # opts one in (memfit/amp/in_kernel.py).
    _memfit_scale_in_kernel = True

    # torch's flags that this class keeps in its param groups, as torch's class of the
    # same kind does (every class takes all four keywords: see
    # memfit.optim.optimizers), with their defaults: filled into a loaded or unpickled
    # group that lacks them, as torch's __setstate__ does
    _TORCH_FLAGS = dict(maximize=False, foreach=None, fused=None, capturable=False,
                        differentiable=False)
    # (group key, the only value memfit's math has, advice): options of torch's class
    # that memfit does not have, refused wherever they are given (keyword, param group,
    # loaded group) instead of being ignored; their values are the defaults of a group
    # that lacks them
    _fixed_options: tuple = ()

    def __init__(self, params, hyper, *, maximize=False, block_size=None, min_8bit_size=4096,
                 bf16_stochastic_round=None, kahan=False, foreach=None, fused=None,
                 capturable=False, differentiable=False):
        """``hyper``: the subclass's own hyperparameters (lr, betas, ...); the keyword
        options are the ones every memfit optimizer takes (see memfit.optim.optimizers)."""
        flags = dict(maximize=maximize, foreach=foreach, fused=fused, capturable=capturable,
                     differentiable=differentiable)
        _checks.check_torch_flags(flags)  # also those this class does not keep
        defaults = dict(hyper, min_8bit_size=min_8bit_size,
                        bf16_stochastic_round=bf16_stochastic_round, kahan=kahan,
                        **{k: v for k, v in flags.items() if k in self._TORCH_FLAGS})
        defaults.setdefault("bits", self._bits)
        defaults["block_size"] = (_core.DEFAULT_BLOCK[defaults["bits"]] if block_size is None
                                  else block_size)
        # bfloat16/float16 parameters are written with stochastic rounding (no fp32 master
        # copy needed); the seed and a per-group step counter live in the param group,
        # so a resumed run draws the same random bits. None: stochastic unless kahan.
        defaults.setdefault("sr_seed", 0)
        super().__init__(params, defaults)  # checks each group (add_param_group)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        # memfit.optim's public classes register their math: the converters look up the
        # class a state dict names there, without importing the class modules
        _registry.register(cls)

    def __setstate__(self, state):
        super().__setstate__(state)
        missing = {**self._TORCH_FLAGS, **{k: v for k, v, _ in self._fixed_options}}
        for group in self.param_groups:
            for key, value in missing.items():
                group.setdefault(key, value)

    # -- hyperparameters -------------------------------------------------------------

    def _hparams(self, group) -> dict:  # pragma: no cover - abstract
        raise NotImplementedError

    def add_param_group(self, param_group):
        """torch's add_param_group, then memfit's checks of the new group's values and
        parameters (dtype, layout); a refused group is not added."""
        super().add_param_group(param_group)
        gi = len(self.param_groups) - 1
        try:
            where = f"{type(self).__name__}: param_groups[{gi}]"
            _checks.check_group(self, self.param_groups[-1], where)
            for i, p in enumerate(self.param_groups[-1]["params"]):
                _checks.check_param(f"{where}['params'][{i}]", p)
        except Exception:
            self.param_groups.pop()
            raise

    # -- state layout ------------------------------------------------------------------

    @staticmethod
    def _rounding(group) -> str:
        """How this group writes float16/bfloat16 parameters: 'kahan', 'stochastic' or
        'nearest' (see :mod:`memfit.optim.optimizers`)."""
        if group.get("kahan", False):
            return "kahan"
        sr = group.get("bf16_stochastic_round")
        return "stochastic" if sr is None or sr else "nearest"

    @staticmethod
    def _format(group, p) -> int:
        """32, or the group's bits for parameters of two or more dimensions and at least
        min_8bit_size elements. Sizes are global (a DTensor's numel() is the whole
        tensor's), so sharding never changes a state's precision; 1-D tensors keep
        float32 states, as their dim-0 slices are single elements."""
        bits = group["bits"]
        return bits if bits != 32 and p.dim() >= 2 and p.numel() >= group["min_8bit_size"] else 32

    def _expected_state(self, group, p) -> dict:
        """{key: (shape, dtype)} of the state this parameter needs in this group, from
        the C core's layout (mf_optim_state_layout) with p's rows. A state of one value
        per element has p's shape (and, once made, p's memory layout); 4-bit codes and
        absmax are (rows, per row). Shapes are global for a DTensor p: dim 0 of every
        quantized state is p.shape[0]."""
        fmt = self._format(group, p)
        rows = state_rows(p) if fmt != 32 else 1
        layout = _core.state_layout(self._group_kind(group), fmt, group["block_size"], p.numel(),
                                    self._hparams(group)["momentum"], rows)
        out = {"step": ((), torch.float32)}
        shape = (rows, layout["state_row_numel"]) if fmt == 4 else tuple(p.shape)
        for k in range(1, layout["num_states"] + 1):
            out[f"state{k}"] = (shape, getattr(torch, layout["state_dtype"]))
            if layout["absmax_numel"]:
                out[f"absmax{k}"] = ((rows, layout["blocks_per_row"]), torch.float32)
        if self._rounding(group) == "kahan" and p.dtype in (torch.bfloat16, torch.float16):
            out["kahan_comp"] = (tuple(p.shape), p.dtype)
        return out

    def _zero_state(self, p, key, shape, dtype, row_major=False):
        """A zero state of global ``shape`` for ``p`` (step: a plain scalar on p's local
        device). States of p's shape follow p's memory layout (zeros_like keeps the
        strides of a dense tensor, channels_last included), unless ``row_major``
        (``_row_major_states``): the kernels run over the storage in memory order, the
        same for p, its grad and these."""
        if _dtensor.is_dtensor(p) and key != "step":
            # a DTensor of p's mesh and placements, of the global shape
            return _dtensor.zeros_state(p, shape, dtype, self._where)
        local = p.to_local() if _dtensor.is_dtensor(p) else p
        if shape == tuple(p.shape) and key != "step" and not row_major:
            return torch.zeros_like(local, dtype=dtype)
        return torch.zeros(shape, dtype=dtype, device=local.device)

    def _initial_state(self, group, p, key, shape, dtype):
        """The value a new state of p in ``group`` starts from: zeros (_zero_state), but
        for classes whose state starts elsewhere (Adagrad's initial_accumulator_value)."""
        return self._zero_state(p, key, shape, dtype, self._row_major_states(group))

    def _new_states(self, where, group, p, state) -> tuple:
        """(states to add, whether to drop kahan_comp) for p before its first step or
        after its layout changed (bits, dtype, shape, device): the missing states as
        they start (:meth:`_initial_state`); the states p already has are checked against the layout ``group`` needs
        (:func:`_state_problem`). Changes nothing: step adds them once every parameter
        of every group is checked."""
        state = state or {}
        expected = self._expected_state(group, p)
        if _dtensor.is_dtensor(p):
            _dtensor.check_param(p, self._where)
        added = {}
        for key, (shape, dtype) in expected.items():
            value = state.get(key)
            if value is None:
                added[key] = self._initial_state(group, p, key, shape, dtype)
                continue
            problem = _checks.state_problem(key, value, shape, dtype, p,
                                            self._row_major_states(group))
            if problem is not None:
                raise problem[0](f"{where}: {problem[1]}; nothing was updated")
        return added, "kahan_comp" in state and "kahan_comp" not in expected

    def _where(self, p) -> str:
        """Names parameter ``p`` in error messages: its place in param_groups."""
        for i, g in enumerate(self.param_groups):
            for j, q in enumerate(g["params"]):
                if q is p:
                    return f"{type(self).__name__}: param_groups[{i}]['params'][{j}]"
        return f"{type(self).__name__}: a parameter"

    # -- the step --------------------------------------------------------------------------

    # The kernels are C calls that torch.compile cannot trace: when a compiled function
    # reaches step() it runs eagerly (one graph break) instead of dynamo tracing the
    # Python around each C call and breaking, with a warning, at every one of them.
    @torch.compiler.disable
    @torch.no_grad()
    def step(self, closure=None):
        """Performs a single optimization step.

        Every parameter with a gradient, in every group, is checked (gradient dtype,
        device, shape and layout; the states' layout) before any is stepped: a step that
        raises has changed no parameter, state or step counter.

        Args:
            closure: a callable that re-evaluates the model and returns the loss.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad_scale = _dtensor.plain(getattr(self, "grad_scale", None))
        found_inf = _dtensor.plain(getattr(self, "found_inf", None))
        plan, new = self._plan_step()  # raises here, before anything changes
        self._add_states(new)
        for group, hp, rounding, buckets, halves in plan:
            sr_step = group.get("sr_step", 0)
            for b, ((device, fmt), items) in enumerate(buckets.items()):
                bhp = hp
                if rounding == "stochastic" and (device, fmt) in halves:
                    bhp = dict(hp, sr_seed=_core.sr_seed(group.get("sr_seed", 0), sr_step, b))
                self._step_bucket(group, bhp, device, fmt, items, grad_scale, found_inf)
        self._advance_sr_step()
        return loss

    def _advance_sr_step(self) -> None:
        """Once per optimizer step, in every group: the next step draws new random bits."""
        for group in self.param_groups:
            group["sr_step"] = group.get("sr_step", 0) + 1

    def _add_states(self, new) -> None:
        """Makes the states _plan_step found missing (``new``) and records the layouts
        it checked."""
        checked, state_of = self._state_checked, self.state
        for p, added, drop, seen in new:
            state = state_of[p]
            state.update(added)
            if drop:
                # kahan was switched off (or p is float32 now): p is already the nearest
                # value of p + kahan_comp, so the buffer is simply dropped
                del state["kahan_comp"]
            checked[id(p)] = seen

    # -- the step of a subset (memfit.optim.offload's step in backward) -------------------
    #
    # step() numbers its core calls per group by bucket (in the order of each bucket's
    # first parameter with a gradient) and the tensors of a call by their place in it;
    # stochastic rounding draws by both numbers. A step of some parameters at a time
    # (each as autograd finishes its gradient) gets step()'s bits when each parameter
    # keeps the numbers step() would give it: _sr_positions computes them once per step
    # (O(parameters)), _step_params steps a few parameters in O(those few).

    def _sr_positions(self, stepping) -> dict:
        """{id(p): (group index, index in the group, bucket, bucket index, position in
        the bucket)} for each parameter p whose id is in ``stepping``: the numbers step()
        gives p when exactly these parameters have gradients. Changes nothing."""
        out = {}
        for gi, group in enumerate(self.param_groups):
            counts = {}  # bucket -> [its index, parameters so far]
            for i, p in enumerate(group["params"]):
                if id(p) in stepping:
                    bucket = self._bucket(group, p)
                    at = counts.get(bucket)
                    if at is None:
                        at = counts[bucket] = [len(counts), 0]
                    out[id(p)] = (gi, i, bucket, at[0], at[1])
                    at[1] += 1
        return out

    @torch.compiler.disable
    @torch.no_grad()
    def _step_params(self, params, positions) -> None:
        """Internal (memfit.optim.offload's step in backward): steps the parameters of
        ``params`` that have a gradient, in O(len(params)), as step() steps them: the
        same checks of them all before any write, and the random bits step() draws for
        them when the parameters of ``positions`` (from :meth:`_sr_positions`, computed
        once per step) have gradients. Each is its own call into the core. Does not
        advance ``sr_step``: call :meth:`_advance_sr_step` once per optimizer step. No
        GradScaler (nothing here sees every gradient)."""
        members = {}  # group index -> [(index in the group, p)], as _plan_step takes them
        for p in params:
            if p.grad is not None:
                gi, i, *_ = positions[id(p)]
                members.setdefault(gi, []).append((i, p))
        members = dict(sorted(members.items()))  # _plan_step's order: by group
        plan, new = self._plan_step(members)  # raises here, before anything changes
        calls = []
        for (gi, entries), (group, hp, rounding, buckets, halves) in zip(members.items(), plan):
            # the items of each bucket, in the order of `entries` (_plan_step keeps it)
            numbers = {}
            for _, p in entries:
                _, _, bucket, b, k = positions[id(p)]
                numbers.setdefault(bucket, []).append((b, k))
            if {k: len(v) for k, v in numbers.items()} != {k: len(v) for k, v in buckets.items()}:
                raise RuntimeError(
                    f"{type(self).__name__}: param_groups[{gi}]: a parameter's state format or "
                    "device changed in the middle of a step (between the first gradient of a "
                    "backward and step(): bits, min_8bit_size or a parameter moved); change "
                    "them between steps; nothing was updated")
            base, sr_step = group.get("sr_seed", 0), group.get("sr_step", 0)
            for (device, fmt), items in buckets.items():
                for item, (b, k) in zip(items, numbers[(device, fmt)]):
                    bhp = hp
                    if rounding == "stochastic" and item[3][5]:  # a float16/bfloat16 p
                        seed = _core.sr_seed(base, sr_step, b)
                        bhp = dict(hp, sr_seed=_core.stream_seed(seed, k))
                    calls.append((group, bhp, device, fmt, [item]))
        self._add_states(new)
        for call in calls:
            self._step_bucket(*call, None, None)

    def _bucket(self, group, p) -> tuple:
        """The bucket p steps in within its group: one core call per (device, state
        format)."""
        return p.device, self._format(group, p)

    def _plan_step(self, members=None) -> tuple:
        """Checks every parameter that has a gradient and sorts them into buckets (one
        call into the core per device and state format); changes nothing. ``members``:
        None, or only these parameters, as {group index: [(index in the group, p)]}
        (:meth:`_step_params`).

        Returns (plan, new): plan is [(group, hparams, rounding, {(device, format):
        [(param, grad, states, seen)]}, {the (device, format) of buckets with float16 or
        bfloat16 parameters})], the tensors as the kernels take them (a DTensor's local
        ones), states the tuple of ``_STATE_KEYS``; new is [(param, states to add, drop
        kahan_comp, seen)] for parameters whose states are made or were replaced.

        ``seen`` (kept in ``self._state_checked`` by id(p): a tensor's own hash is a
        Python call): (key, format, rows, index_base, states, whether p is float16 or
        bfloat16, its bucket, storage marks, the DTensor p or None) of the layout p's
        states were last checked against, rows and index_base those of the tensor the
        kernels step (a DTensor's local shard), the state tensors checked and their
        storage (_storage_marks); the last, for a DTensor p, what its local shard is a
        shard of (its mesh, placements, global shape: Muon gathers the matrix). A step
        over a model of hundreds of tensors does not rebuild every expected layout every
        time: p's states are checked again only when the key changes, a state tensor was
        replaced or its storage changed in place. This loop runs per parameter per
        step, and is most of the step's time for models of many small tensors: it reads
        only metadata (no host sync) and stays lean.
        """
        checked = self.__dict__.setdefault("_state_checked", {})
        state_of = self.state
        dtensor_type = _dtensor.DTensor
        name = type(self).__name__
        plan, new = [], []
        for gi, group in enumerate(self.param_groups):
            if members is not None and gi not in members:
                continue
            # a group's values can change at any time (a schedule, a hand edit)
            hp = _checks.check_group(self, group, f"{name}.step: param_groups[{gi}]")
            rounding = self._rounding(group)
            layout = (self._group_kind(group), group["bits"], group.get("block_size"),
                      group["min_8bit_size"], rounding, hp["momentum"])
            buckets = {}  # (device, format) -> [(p, grad, states, seen)], in first-seen order
            halves = set()
            for i, p in (enumerate(group["params"]) if members is None else members[gi]):
                g = p.grad
                if g is None:
                    continue
                if g.is_sparse:
                    raise RuntimeError(f"{name} does not support sparse gradients")
                shape, dtype, device, contiguous = p.shape, p.dtype, p.device, p.is_contiguous()
                if g.shape != shape or g.dtype != dtype or g.device != device \
                        or not (contiguous or _checks.same_layout(g, p)):
                    _checks.refuse_grad(f"{name}.step: param_groups[{gi}]['params'][{i}]", p, g)
                state = state_of.get(p)
                seen = checked.get(id(p))
                key = (layout, dtype, shape, device, contiguous)
                if state is not None and seen is not None and seen[0] == key:
                    get, s = state.get, seen[4]
                    states = (get("state1"), get("absmax1"), get("state2"), get("absmax2"),
                              get("step"), get("kahan_comp"), get("state3"), get("absmax3"))
                    # (spelled out: the cheapest test that no state tensor was replaced)
                    fresh = states[0] is s[0] and states[1] is s[1] and states[2] is s[2] \
                        and states[3] is s[3] and states[4] is s[4] and states[5] is s[5] \
                        and states[6] is s[6] and states[7] is s[7] \
                        and _storage_marks(states) == seen[7]  # nor resized in place
                else:
                    fresh = False
                if not fresh:
                    _checks.check_param(f"{name}.step: param_groups[{gi}]['params'][{i}]", p,
                                        at_step=True)
                    where = f"{name}.step: param_groups[{gi}]['params'][{i}] (shape {tuple(shape)})"
                    if not contiguous:
                        _checks.check_dense(where, p)
                    added, drop = self._new_states(where, group, p, state)
                    merged = {**(state or {}), **added}
                    if drop:
                        del merged["kahan_comp"]
                    states = tuple(map(merged.get, _STATE_KEYS))
                    local = p.to_local() if _dtensor.is_dtensor(p) else p
                    bucket = self._bucket(group, p)
                    seen = (key, bucket[1], state_rows(local),
                            _dtensor.index_base(p, self._where), states, dtype != torch.float32,
                            bucket, _storage_marks(states),
                            p if _dtensor.is_dtensor(p) else None)
                    new.append((p, added, drop, seen))
                if dtensor_type is not None and isinstance(p, dtensor_type):
                    # FSDP2 & co.: the kernels step the local rows, in place
                    p, g, states = _dtensor.local_step_args(p, g, states, self._where)
                items = buckets.get(seen[6])
                if items is None:
                    items = buckets[seen[6]] = []
                items.append((p, g, states, seen))
                if seen[5]:
                    halves.add(seen[6])
            plan.append((group, hp, rounding, buckets, halves))
        return plan, new

    def _step_bucket(self, group, hp, device, fmt, items, grad_scale, found_inf):
        """One call into the core for the (parameter, gradient, states, checked layout)
        items of one device and state format (see _plan_step)."""
        params = [p.data for p, *_ in items]
        grads = [g if g.is_contiguous() and not g.requires_grad else _grad_view(p, g)
                 for p, g, *_ in items]
        s1, a1, s2, a2, steps, comps, s3, a3 = (list(x) for x in zip(*(st for _, _, st, _ in items)))
        # the core takes absmax lists as None in 32-bit buckets, comps as None without Kahan
        if fmt == 32:
            a1 = a2 = a3 = None
        if self._rounding(group) != "kahan":
            comps = None
        rows = [seen[2] for *_, seen in items] if fmt != 32 else None
        # a shard's element 0 is element index_base of the whole tensor (stochastic rounding)
        bases = [seen[3] for *_, seen in items]
        gs = _on(grad_scale, device)
        fi = _on(found_inf, device)
        stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
        # the trust ratio's scratch (memfit.optim.trust: LAMB, LARS)
        trust = self._trust_scratch(params) if hp.get("max_unorm", 0.0) > 0 else None
        _core.step(self._group_kind(group), fmt, group["block_size"], hp, params, grads, s1, a1, s2, a2,
                   steps, gs, fi, stream, comps, rows=rows, index_base=bases if any(bases) else None,
                   trust=trust, state3=s3 if s3[0] is not None else None, absmax3=a3)

    # -- state dict ------------------------------------------------------------------------

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


def _storage_marks(states) -> tuple:
    """(data pointer, shape) of each state tensor (a DTensor's local one, which the
    kernels write): what ``resize_()``, ``set_()`` or ``.data =`` change in place while
    the tensor object stays the same. Metadata only (no host sync)."""
    marks = []
    for s in states:
        if s is not None:
            if isinstance(s, _DTENSOR):
                s = s._local_tensor  # to_local() without its autograd call
            marks.append((s.data_ptr(), s.shape))
    return tuple(marks)


def _grad_view(p, g):
    """The gradient as the kernels take it: detached (a gradient made with
    create_graph=True requires grad; detach() is a view, not a copy) and, for a
    row-major parameter, row-major (a copy only where it is not). A parameter that is
    dense in another order (channels_last) needs a gradient of its own strides: the
    binding checks that and says what to do."""
    if g.requires_grad:
        g = g.detach()
    if not g.is_contiguous() and p.is_contiguous():
        g = g.contiguous()
    return g


def _on(t, device):
    if t is None:
        return None
    if t.device != device or t.dtype != torch.float32:
        # non_blocking only towards a GPU, where the kernel runs after the copy on the same
        # stream; a GPU scaler's grad_scale/found_inf read by the CPU kernels (FSDP2's
        # CPUOffloadPolicy) must have arrived first, or the step reads stale values
        t = t.to(device=device, dtype=torch.float32, non_blocking=device.type != "cpu")
    return t.reshape(1) if t.dim() != 1 else t
