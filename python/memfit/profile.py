"""Measure training memory for real: what `memfit profile` runs, and what the
estimator in memfit.memory is checked against.

For a model, an optimizer and a batch, it runs a few training steps and reports, per
component: parameter bytes, gradient bytes and optimizer-state bytes (exact, from the
tensors), bytes saved for backward (counted by saved-tensor hooks: each storage once,
parameters excluded), peak CUDA memory on a GPU, and the median step time.
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from contextlib import nullcontext

import torch

from memfit.checkpoint.meter import ActivationMeter


def tensor_bytes(t) -> int:
    return t.numel() * t.element_size()


def state_bytes(optimizer) -> int:
    """Bytes of every tensor held in the optimizer's per-parameter state."""
    total, seen = 0, set()

    def visit(v):
        nonlocal total
        if torch.is_tensor(v):
            key = (v.untyped_storage().data_ptr(), v.device)
            if key not in seen:
                seen.add(key)
                total += v.untyped_storage().nbytes()
        elif isinstance(v, dict):
            for x in v.values():
                visit(x)
        elif isinstance(v, (list, tuple)):
            for x in v:
                visit(x)
        elif hasattr(v, "__dict__") and not isinstance(v, type):
            for x in vars(v).values():
                visit(x)

    for st in optimizer.state.values():
        visit(st)
    return total


def _backward_and_step(loss, optimizer, scaler) -> None:
    """One training step's backward and optimizer step, through the scaler if there is one."""
    if scaler is not None:
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    else:
        loss.backward()
        optimizer.step()


# The one saved-tensor meter lives in memfit.checkpoint (it also counts checkpoint
# boundaries and recomputes); this name is kept for code that imported it from here.
SavedTensorMeter = ActivationMeter


def profile_steps(model, optimizer, batches, loss_fn, steps: int = 3, autocast_dtype=None,
                  scaler=None, device=None) -> dict:
    """Runs `steps` training steps (after one warm-up) and measures each component.

    Args:
        model: a torch module.
        optimizer: its optimizer (torch's or memfit's).
        batches: callable returning (inputs, targets) for each step.
        loss_fn: callable (model, inputs, targets) -> scalar loss.
        autocast_dtype: torch.bfloat16 / torch.float16 to train under autocast.
        scaler: an optional GradScaler (torch's or memfit's) for float16.
    """
    device = device or next(model.parameters()).device
    params = list(model.parameters())
    cuda = device.type == "cuda"
    times, saved = [], 0
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
    for step in range(steps + 1):
        x, y = batches()
        t0 = time.perf_counter()
        ctx = torch.autocast(device.type, dtype=autocast_dtype) if autocast_dtype else nullcontext()
        meter = ActivationMeter(exclude=params)
        with meter, ctx:
            loss = loss_fn(model, x, y)
        saved = max(saved, meter.saved_bytes)
        _backward_and_step(loss, optimizer, scaler)
        grad_bytes = sum(tensor_bytes(p.grad) for p in params if p.grad is not None)
        optimizer.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        if step > 0:
            times.append(time.perf_counter() - t0)
    return {
        "params": sum(tensor_bytes(p) for p in params),
        "gradients": grad_bytes,
        "optimizer": state_bytes(optimizer),
        "activations": saved,
        "peak_cuda": torch.cuda.max_memory_allocated(device) if cuda else None,
        "step_time_s": statistics.median(times),
        "loss": float(loss.detach().float()),
    }


# ---- configurations: the usual way and memfit's techniques ------------------------------

CONFIGS = {  # name -> (autocast, optimizer, checkpoint budget)
    "baseline": (False, "adamw", None),
    "autocast": (True, "adamw", None),
    "adamw8bit": (False, "adamw8bit", None),
    "checkpoint": (False, "adamw", "50%"),
    "memfit": (True, "adamw8bit", "50%"),
}


def checkpoint_budget(name: str, precision: str):
    """The checkpoint budget of configuration `name` (CONFIGS) when its autocast runs in
    `precision`. A share ("50%") is of the activation memory measured under that
    autocast. Where the advised precision is fp32 (a CPU that would emulate bf16), the
    activations take twice half precision's bytes, so a configuration with autocast
    gets half the share: the memfit way keeps the activation bytes (and the saving) it
    has in bf16, by checkpointing more."""
    use_amp, _, budget = CONFIGS[name]
    if use_amp and precision == "fp32" and isinstance(budget, str) and budget.endswith("%"):
        return f"{float(budget[:-1]) / 2:g}%"
    return budget


def plan_checkpoints(model, x0, budget):
    """memfit.checkpoint.auto(model, x0, budget) under the caller's autocast; a short chain
    that cannot fit the share gets the least budget that fits. Returns the plan."""
    import memfit.checkpoint as mck

    try:
        return mck.auto(model, x0, budget=budget)
    except ValueError:
        m = mck.measure(model, x0)
        return mck.auto(model, x0, budget=mck.min_budget(m.input_bytes, m.saved_bytes))


def make_optimizer(name: str, params, lr: float):
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    import memfit.optim as mopt

    classes = {"adamw8bit": mopt.AdamW8bit, "adamw4bit": mopt.AdamW4bit}
    if name not in classes:
        raise ValueError(f"optimizer: expected adamw, adamw8bit or adamw4bit, got {name!r}")
    return classes[name](params, lr=lr, betas=(0.9, 0.95), weight_decay=0.1)


def run_config(name: str, model, batches, loss_fn, steps: int, *, lr: float = 3e-3, progress=None,
               schedule: bool = True, precision: str = "auto") -> dict:
    """Trains `model` for `steps` steps under configuration `name` (see CONFIGS) and
    measures every component. The model is modified in place (checkpoint wrappers,
    weights); build a fresh one per configuration.

    Returns a dict with the configuration, bytes of params / gradients / optimizer
    states / activations (ActivationMeter: saved tensors,
    checkpoint boundaries and the largest recompute), peak CUDA bytes, median step
    time and the loss of every step. ``precision``: the autocast precision of the
    configurations that use autocast ("auto": memfit.amp.precision's for the device;
    the demo passes the one it measured for its model)."""
    import warnings

    if name not in CONFIGS:
        raise ValueError(f"config: expected one of {', '.join(CONFIGS)}, got {name!r}")
    use_amp, opt_name, _ = CONFIGS[name]
    device = next(model.parameters()).device
    opt = make_optimizer(opt_name, model.parameters(), lr)
    autocast, scaler, plan = nullcontext(), None, None
    if use_amp:
        import memfit.amp as mamp

        precision = str(mamp.precision(device.type)) if precision == "auto" else str(precision)
        with warnings.catch_warnings():  # setup() explains once why bf16 needs no scaler
            warnings.simplefilter("ignore")
            autocast, scaler = mamp.setup(model, opt, precision, device=device.type)
    else:
        precision = "fp32"
    budget = checkpoint_budget(name, precision)
    if budget is not None:
        x0, _ = batches()
        with autocast:
            plan = plan_checkpoints(model, x0, budget)
    sched = None
    if schedule:
        # linear warm-up over 20 steps, then cosine decay to zero
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: min(1.0, (s + 1) / 20) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    params = list(model.parameters())
    losses, times, act_bytes, grad_bytes = [], [], 0, 0
    measure_at = 1 if steps > 1 else 0
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
    model.train()
    for step in range(steps):
        x, y = batches()
        t0 = time.perf_counter()
        meter = ActivationMeter(exclude=model) if step == measure_at else None
        with (meter or nullcontext()), autocast:
            loss = loss_fn(model, x, y)
        _backward_and_step(loss, opt, scaler)
        if meter is not None:
            act_bytes = meter.total_bytes  # after backward: includes the recompute peak
            grad_bytes = sum(tensor_bytes(p.grad) for p in params if p.grad is not None)
        opt.zero_grad(set_to_none=True)
        if sched is not None:
            sched.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss.detach().float()))
        if progress:
            progress(step, steps, losses[-1])
    return {
        "name": name, "precision": precision, "optimizer": type(opt).__name__,
        "checkpoint": "none" if plan is None else f"{len(plan.checkpointed_stages)} of {plan.n_stages} blocks",
        "params_bytes": sum(tensor_bytes(p) for p in params),
        "grads_bytes": grad_bytes,
        "optimizer_bytes": state_bytes(opt),
        "activation_bytes": act_bytes,
        "peak_cuda_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
        "step_time_s": statistics.median(times[1:] if len(times) > 1 else times),
        "losses": losses,
        "autocast": autocast,
    }


def total_bytes(row: dict) -> int:
    return row["params_bytes"] + row["grads_bytes"] + row["optimizer_bytes"] + row["activation_bytes"]


def format_rows(rows: list, extra: dict | None = None) -> str:
    """A markdown table of run_config results (MB = 2**20 bytes)."""
    mb = lambda n: "-" if n is None else f"{n / 2**20:.2f}"  # noqa: E731
    head = ["config", "precision", "optimizer", "checkpointed", "params MB", "grads MB", "optim MB",
            "activations MB", "total MB", "peak CUDA MB", "step ms"] + list(extra or {})
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["name"], r["precision"], r["optimizer"], r["checkpoint"], mb(r["params_bytes"]),
                 mb(r["grads_bytes"]), mb(r["optimizer_bytes"]), mb(r["activation_bytes"]), mb(total_bytes(r)),
                 mb(r["peak_cuda_bytes"]), f"{1000 * r['step_time_s']:.1f}"]
        cells += [fn(r) for fn in (extra or {}).values()]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ---- `memfit profile` ---------------------------------------------------------------------

PARTS = ("params_bytes", "grads_bytes", "optimizer_bytes", "activation_bytes")


def chart(rows: list, path):
    """Stacked bars of the measured components of each configuration (PNG; see
    memfit._plot); returns the matplotlib Figure."""
    from memfit._plot import stacked_bars

    labels = {"params_bytes": "parameters", "grads_bytes": "gradients", "optimizer_bytes": "optimizer states",
              "activation_bytes": "activations (saved for backward)"}
    bars = {r["name"]: {p: r[p] / 2**20 for p in PARTS} for r in rows}
    return stacked_bars(bars, labels, path, title="memfit profile: training memory measured per configuration",
                        xlabel="configuration", ylabel="memory (MiB, measured)")


def preset_config(preset: str, layers: int, d_model: int, heads: int, seq: int):
    """The GPTConfig of a GPT-2-family preset built at small scale (fewer layers,
    narrower), keeping its vocabulary; checked, nothing built."""
    from memfit import memory
    from memfit.models import GPTConfig

    spec = memory.resolve_model(preset)
    if spec.mlp != "gelu" or spec.norm != "layernorm":
        raise ValueError(f"model: only GPT-2-style presets can be built at small scale, not {preset!r}")
    if d_model % heads:
        raise ValueError(f"d_model: must be divisible by the number of heads ({heads})")
    return GPTConfig(n_layer=layers, d_model=d_model, n_head=heads, vocab=spec.vocab, max_pos=seq)


def preset_model(preset: str, layers: int, d_model: int, heads: int, seq: int):
    """A GPT-2-family preset built at small scale (see preset_config), as a memfit.models.GPT."""
    from memfit.models import GPT

    cfg = preset_config(preset, layers, d_model, heads, seq)
    return GPT(cfg), cfg


def machine_bytes(device: torch.device) -> int | None:
    """The memory a run on ``device`` can use at most: the GPU's, or the host's
    physical memory (None where the system does not say)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    from memfit.memory import host_memory_bytes

    return host_memory_bytes()


def check_fits(spec, configs: list, batch: int, seq: int, device: torch.device) -> None:
    """Refuses, before anything is allocated, a configuration whose estimated training
    memory (memfit.memory, with the least memory each could take: 16-bit autocast,
    every layer checkpointed) exceeds everything the device has: it cannot run, and
    torch would fail part-way with an allocator error (or overflow a size)."""
    from memfit import memory

    capacity = machine_bytes(device)
    if capacity is None:
        return
    for name in configs:
        use_amp, opt_name, budget = CONFIGS[name]
        setup = memory.Setup(batch=batch, seq=seq, precision="bf16" if use_amp else "fp32",
                             optimizer=opt_name, checkpoint="every" if budget else "none",
                             gpu=device.type == "cuda")
        need = memory.estimate(spec, setup).total
        if need > capacity:
            where = "GPU" if device.type == "cuda" else "machine"
            raise ValueError(
                f"configs: {name} would need about {memory.fmt_gb(need)} GiB (memfit estimate), "
                f"more than this {where}'s {memory.fmt_gb(capacity)} GiB; lower --d-model, --layers, "
                "--batch or --seq")


def load_factory(spec: str):
    """'package.module:function' -> the function's (model, batches, loss_fn), checked:
    the function must take no arguments and return a torch module with parameters and
    two callables."""
    import importlib
    import inspect

    mod_name, _, fn_name = spec.partition(":")
    if not mod_name or not fn_name:
        raise ValueError(f"module: expected 'package.module:function', got {spec!r}")
    try:
        fn = getattr(importlib.import_module(mod_name), fn_name)
    except ImportError as e:
        raise ValueError(f"module: cannot import {mod_name!r} ({e}); check the name and that it "
                         "is on PYTHONPATH") from None
    except AttributeError:
        raise ValueError(f"module: {mod_name!r} has no function {fn_name!r}") from None
    if not callable(fn):
        raise ValueError(f"module: {spec} is not a function")
    try:
        inspect.signature(fn).bind()
    except TypeError as e:
        raise ValueError(f"module: {spec} must take no arguments (memfit profile calls it "
                         f"with none): {e}") from None
    except ValueError:  # no signature (some built-ins): call it and see
        pass
    result = fn()
    want = "(model, batches, loss_fn): a torch.nn.Module with parameters and two callables"
    if not (isinstance(result, (tuple, list)) and len(result) == 3):
        raise ValueError(f"module: {spec} must return {want}, got {_kind(result)}")
    model, batches, loss_fn = result
    if not isinstance(model, torch.nn.Module) or next(model.parameters(), None) is None:
        raise ValueError(f"module: {spec} must return {want}; its model is {_kind(model)}"
                         + (" without parameters" if isinstance(model, torch.nn.Module) else ""))
    for what, v in (("batches", batches), ("loss_fn", loss_fn)):
        if not callable(v):
            raise ValueError(f"module: {spec} must return {want}; its {what} is {_kind(v)}")
    return tuple(result)


def _kind(v) -> str:
    """What v is, for a message: its type, and its length for a tuple or list."""
    name = type(v).__name__
    article = "an" if name[:1].lower() in "aeiou" else "a"
    return f"{article} {name}" + (f" of {len(v)}" if isinstance(v, (tuple, list)) else "")


def main(args) -> int:
    """Runs `memfit profile` (arguments from memfit.cli)."""
    import json
    from pathlib import Path

    import memfit
    from memfit import memory
    from memfit._progress import Progress

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() and memfit.cuda_device_count() > 0 else "cpu"
    dev = torch.device(device)
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    if not configs:
        raise ValueError(f"configs: expected at least one of {', '.join(CONFIGS)}")
    for c in configs:
        if c not in CONFIGS:
            raise ValueError(f"configs: unknown configuration {c!r} (choose from {', '.join(CONFIGS)})")
    memory.check_size(args.steps, "steps (one warm-up, one measured)", minimum=2)
    for name in ("layers", "d_model", "heads", "batch", "seq"):  # profile.main is public too
        memory.check_size(getattr(args, name), name)
    spec = None
    if not args.module:  # the preset's size is known before anything is built: check it fits
        cfg = preset_config(args.model, args.layers, args.d_model, args.heads, args.seq)
        spec = memory.ModelSpec(f"{args.model} (small)", cfg.n_layer, cfg.d_model, cfg.n_head, cfg.vocab,
                                max_pos=cfg.max_pos, dropout=False)
        check_fits(spec, configs, args.batch, args.seq, dev)
    rows = []
    for i, name in enumerate(configs):
        torch.manual_seed(args.seed)
        if args.module:
            model, batches, loss_fn = load_factory(args.module)
            model = model.to(dev)
        else:
            model, cfg = preset_model(args.model, args.layers, args.d_model, args.heads, args.seq)
            model = model.to(dev)
            gen = torch.Generator().manual_seed(args.seed)

            def batches(cfg=cfg, gen=gen):
                x = torch.randint(0, cfg.vocab, (args.batch, args.seq), generator=gen).to(dev)
                return x, x

            def loss_fn(m, x, y):
                return m(x, y)[1]

        bar = Progress(args.steps, f"[{i + 1}/{len(configs)}] {name}")
        row = run_config(name, model, batches, loss_fn, args.steps, schedule=False,
                         progress=lambda step, n, loss, bar=bar: bar.update(loss))
        row.pop("autocast")
        if spec is not None and CONFIGS[name][2] is None:  # the estimator has no planned budgets
            use_amp, opt_name, _ = CONFIGS[name]
            est = memory.estimate(spec, memory.Setup(batch=args.batch, seq=args.seq,
                                                     precision=row["precision"] if use_amp else "fp32",
                                                     optimizer=opt_name, gpu=dev.type == "cuda"))
            row["estimated_bytes"] = est.weights + est.gradients + est.optimizer + est.activations
        rows.append(row)
    est_col = {"estimate MB": lambda r: f"{r['estimated_bytes'] / 2**20:.2f}" if "estimated_bytes" in r else "-"}
    table = format_rows(rows, est_col)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        chart(rows, out / "profile.png")
        wrote = f"{out / 'profile.png'} and "
    except ImportError as e:  # matplotlib missing: say how to get it, write the rest
        print(e, file=sys.stderr)
        wrote = ""
    (out / "profile.json").write_text(json.dumps({"device": device, "rows": rows}, indent=2))
    if args.json:
        print(json.dumps({"device": device, "rows": rows}, indent=2))
    else:
        what = args.module or f"{args.model} at small scale ({args.layers} layers, d_model {args.d_model})"
        print(f"memfit profile: {what}, batch {args.batch} x {args.seq}, {args.steps} steps, on {device}")
        print(table)
        print(f"wrote {wrote}{out / 'profile.json'}")
    return 0
