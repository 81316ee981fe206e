"""The step of memfit's torch optimizers, a part of memfit.optim._torch._MemfitOptimizer:
every parameter with a gradient is checked and sorted into buckets (one call into the
core per device and state format) before anything changes (``_plan_step``); then the
states found missing are made (``_add_states``) and each bucket is stepped
(``_step_bucket``).

The class this is mixed into provides the state layout (``_format``, ``_rounding``,
``_new_states``, ``_where``), ``_group_kind``, ``_hparams`` and, for LAMB and LARS
(memfit.optim.trust), ``_trust_scratch``.
"""

from __future__ import annotations

import torch

from memfit.optim import _checks, _core, _dtensor
from memfit.optim._blocks import state_rows

# isinstance(x, _DTENSOR): whether x is a DTensor (always False without torch.distributed)
_DTENSOR = _dtensor.DTensor or ()
# A parameter's state tensors in the order the step passes them to the core (absent: None).
_STATE_KEYS = ("state1", "absmax1", "state2", "absmax2", "step", "kahan_comp", "state3",
               "absmax3")


class _StepMixin:
    """step() and the planning, checks and core calls under it."""

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
