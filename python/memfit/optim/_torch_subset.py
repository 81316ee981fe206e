"""The step of a few parameters at a time with the random bits step() would draw for
them (memfit.optim.offload's step in backward, as autograd finishes each gradient), a
part of memfit.optim._torch._MemfitOptimizer, built on the step's planning and core calls
(memfit.optim._torch_step).

step() numbers its core calls per group by bucket (in the order of each bucket's first
parameter with a gradient) and the tensors of a call by their place in it; stochastic
rounding draws by both numbers. A step of some parameters at a time gets step()'s bits
when each parameter keeps the numbers step() would give it: ``_sr_positions`` computes
them once per step (O(parameters)), ``_step_params`` steps a few parameters in O(those
few).
"""

from __future__ import annotations

import torch

from memfit.optim import _core


class _SubsetStepMixin:
    """_sr_positions and _step_params (the offloader's; step() does not use them)."""

    def _sr_positions(self, stepping, by_format: bool = False) -> dict:
        """{id(p): (group index, index in the group, bucket, bucket index, position in
        the bucket)} for each parameter p whose id is in ``stepping``: the numbers step()
        gives p when exactly these parameters have gradients. Changes nothing.
        ``by_format``: the buckets are numbered by state format alone, as if every
        parameter were on one device (the offloader's tensors kept on the device draw
        the bits they would draw among the host copies); the bucket returned stays
        (device, format), what _step_params checks."""
        out = {}
        for gi, group in enumerate(self.param_groups):
            counts = {}  # bucket (or its format) -> [its index, parameters so far]
            for i, p in enumerate(group["params"]):
                if id(p) in stepping:
                    bucket = self._bucket(group, p)
                    key = bucket[1] if by_format else bucket
                    at = counts.get(key)
                    if at is None:
                        at = counts[key] = [len(counts), 0]
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
