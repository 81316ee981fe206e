"""The `memfit` command line (also `python -m memfit`)."""

from __future__ import annotations

import argparse
import os
import sys

# the estimate command's options (and Setup) live below demo, which reads them too
from memfit._estimate_args import POSITIVE as _POSITIVE
from memfit._estimate_args import add_estimate_arguments, estimate_setup  # noqa: F401 (memfit.cli.estimate_setup)
from memfit._estimate_args import int_at_least as _int_at_least

# torch's seed range
_seed = _int_at_least(0, maximum=2**64 - 1)


def _check_device(device: str) -> None:
    """--device cuda on a machine where torch or memfit cannot use a GPU."""
    if device != "cuda":
        return
    import torch

    import memfit

    if not (torch.cuda.is_available() and memfit.build_info()["cuda"] and memfit.cuda_device_count() > 0):
        raise ValueError(
            "device: --device cuda needs a CUDA GPU that torch and memfit can both use "
            f"(torch.cuda.is_available(): {torch.cuda.is_available()}, memfit built with CUDA: "
            f"{bool(memfit.build_info()['cuda'])}); use --device cpu or --device auto")


def _check_out(folder: str, files: tuple = ()) -> None:
    """--out: the folder must exist or be creatable, and take files, and none of the
    ``files`` the command writes there may be a directory or other non-regular file,
    checked before a run of minutes is spent on results that cannot be written."""
    import tempfile
    from pathlib import Path

    try:
        Path(folder).mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        raise ValueError(f"out: cannot write to the folder {folder!r} ({e.strerror or e}); choose "
                         "another with --out") from None
    for name in files:
        path = Path(folder) / name
        if path.exists() and not path.is_file():
            kind = "a directory" if path.is_dir() else "not a regular file"
            raise ValueError(f"out: {str(path)!r} is {kind}, and this command writes {', '.join(files)} in "
                             "--out: move it or choose another folder with --out")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="memfit", description="Train bigger models in less GPU memory.")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    d = sub.add_parser("doctor", help="show what memfit was built with and what it sees at run time")
    d.add_argument("--json", action="store_true", help="print JSON instead of text")
    m = sub.add_parser("demo", help="train a small GPT the usual way and the memfit way, side by side")
    m.add_argument("--steps", type=_int_at_least(5), default=None,
                   help="training steps per run, at least 5 (default: 200 CPU, 300 GPU)")
    m.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    m.add_argument("--out", default="memfit-demo", help="folder for loss.png and demo.json")
    m.add_argument("--seed", type=_seed, default=0)
    f = sub.add_parser("profile", help="measure training memory per component for real, per configuration")
    f.add_argument("--model", default="gpt2", help="a GPT-2-style preset built at small scale (default gpt2)")
    f.add_argument("--module", default=None,
                   help="instead of a preset: 'package.module:function' returning (model, batches, loss_fn)")
    f.add_argument("--layers", type=_POSITIVE, default=2)
    f.add_argument("--d-model", type=_POSITIVE, default=128)
    f.add_argument("--heads", type=_POSITIVE, default=4)
    f.add_argument("--batch", type=_POSITIVE, default=4)
    f.add_argument("--seq", type=_POSITIVE, default=128)
    f.add_argument("--steps", type=_int_at_least(2, " (one warm-up, one measured)"), default=3)
    f.add_argument("--configs", default="baseline,autocast,adamw8bit,checkpoint,memfit",
                   help="comma-separated: baseline, autocast, adamw8bit, checkpoint, memfit")
    f.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    f.add_argument("--seed", type=_seed, default=0)
    f.add_argument("--out", default="memfit-profile", help="folder for profile.png and profile.json")
    f.add_argument("--json", action="store_true", help="print JSON instead of the table")
    add_estimate_arguments(sub.add_parser("estimate", help="estimate training memory and whether it fits a GPU"))
    return p


def _estimate(args) -> int:
    import json

    from memfit import _plot
    from memfit import memory as M
    from memfit import recipes as R

    try:
        if args.cpu and args.plot is not None:
            raise ValueError("plot: --plot draws the recipes of training on a GPU; not with --cpu")
        if args.cpu and args.host_memory is not None:
            # the CPU trains in host memory: the table's totals are that memory; the offload
            # recipes, the only thing --host-memory sizes, are not drawn for --cpu
            raise ValueError("host_memory: --host-memory sizes the host side of the GPU offload recipes, "
                             "which --cpu does not draw; with --cpu, the table's totals are host memory")
        # the chart's file, checked before anything is computed (memfit._plot.target)
        plot = _plot.target(args.plot, "plot") if args.plot is not None else None
        spec = M.resolve_model(args.model)
        base = estimate_setup(args)
        M.validate(base)
        # "--gpu ''" is a GPU name too, and refused, not taken for "no --gpu"
        capacity, bf16 = M.parse_gpu(args.gpu) if args.gpu is not None else (None, True)
        cpu = None
        if args.cpu:  # the precision memfit advises for this CPU (memfit.hardware)
            from memfit.hardware import cpu_precision

            cpu = cpu_precision()
        rows = M.comparison(spec, base, bf16_native=bf16, half=cpu[0] if cpu else None)
        # --precision or --optimizer alone is a setting of its own (the other at its default)
        single = M.estimate(spec, base) if args.precision or args.optimizer else None
        rec = M.recommend(spec, base, args.gpu) if args.gpu is not None else None
        host = R.parse_host_memory(args.host_memory) if args.host_memory is not None else M.host_memory_bytes()
        recipes = None if args.cpu else _recipes(args, spec, base, capacity, host, plot)
    except ValueError as err:
        print(f"memfit estimate: error: {err}", file=sys.stderr)
        return 2
    if args.json:
        out = {"model": spec.name, "params": spec.n_params(),
               "rows": [dict(label=label, **est.as_dict()) for label, est in rows]}
        if single:
            out["setting"] = single.as_dict()
        if cpu:
            out["cpu_precision"] = {"precision": cpu[0], "reason": cpu[1]}
        if args.gpu is not None:
            out["gpu"] = {"name": args.gpu, "bytes": capacity}
            out["recommendation"] = None if rec is None else {
                "setup": M.asdict(rec[0]), "total": rec[1].total, "expected_slowdown": rec[2]}
        if recipes:
            out.update(recipes["json"])
        print(json.dumps(out, indent=2, default=str))
        return 0
    g = M.fmt_gb
    print(f"{spec.name}: {spec.n_params() / 1e6:.1f}M parameters, batch {base.batch} x seq {base.seq}"
          + (f", micro-batch {base.micro}" if base.micro != base.batch else ""))
    print(f"{'memory in GiB':<44}| weights | grads | optimizer | activations | temporary | total"
          + (" | fits" if capacity else ""))
    if cpu:
        print(f"CPU precision: {cpu[0]}: {cpu[1]}")
    listing = rows + ([(f"your setting ({base.precision}, {base.optimizer})", single)] if single else [])
    for label, est in listing:
        fits = (" | yes" if est.total <= capacity else " | no") if capacity else ""
        print(f"{label:<44.44}| {g(est.weights):>7} | {g(est.gradients):>5} | {g(est.optimizer):>9} | "
              f"{g(est.activations):>11} | {g(est.temporary):>9} | {g(est.total):>5}{fits}")
    if args.gpu is not None:
        if rec is None:
            print(f"\nNothing fits {args.gpu} ({g(capacity)} GiB) even with micro-batch 1, 4-bit states and "
                  "full checkpointing: use a larger GPU or a smaller model/sequence.")
        else:
            s, est, slow = rec
            print(f"\nFits {args.gpu} ({g(capacity)} GiB) with: precision {s.precision}, optimizer {s.optimizer}, "
                  f"checkpoint {s.checkpoint}, micro-batch {s.micro} (x{base.batch // s.micro} accumulation) "
                  f"-> {g(est.total)} GiB, expected slowdown about {slow:.0%}")
    if recipes:
        print("\n" + recipes["text"])
    return 0


def _recipes(args, spec, base, capacity, host, plot: str | None) -> dict:
    """The offload and step-in-backward recipes (memfit.recipes) as text and JSON, and
    --plot's chart into ``plot`` (memfit._plot.target's file), drawn before anything is
    printed: a path that cannot be written stops the command (ValueError) with nothing
    printed."""
    from memfit import memory as M
    from memfit import recipes as R

    pls = R.placements(spec, base)
    table = R.largest_table(spec, base, R.gpu_targets(args.gpu), host)
    texts = [R.format_recipes(pls, args.gpu, capacity, host), R.format_largest(spec, table, host, args.gpu)]
    data = {"host_memory": host, "recipes": [pl.as_dict() for pl in pls],
            "largest": {gpu: {key: None if fit is None else fit.as_dict() for key, fit in row.items()} for gpu, row in table.items()}}
    if capacity:
        for pl, d in zip(pls, data["recipes"]):
            d["fits_gpu"], d["fits_host"] = R.fits(pl, capacity, host)
    if plot is not None:
        title = f"memfit estimate: {spec.name}, batch {base.batch} x seq {base.seq}, per recipe"
        try:
            R.chart(pls, plot, title=title, gpu=(args.gpu, capacity) if capacity else None, host_bytes=host)
            texts.append(f"wrote {plot}")
            data["plot"] = plot
        except ImportError as e:  # matplotlib missing: say how to get it, print the rest
            print(e, file=sys.stderr)
        except OSError as e:
            raise ValueError(f"plot: cannot write {M.shown(plot, limit=240)} ({e.strerror or e})") from None
        except ValueError as e:  # a format matplotlib cannot write
            raise ValueError(f"plot: {e}") from None
    return {"text": "\n\n".join(texts), "json": data}


def _torch_missing(command: str) -> bool:
    import importlib.util

    if importlib.util.find_spec("torch") is not None:
        return False
    print(f"memfit {command}: needs PyTorch, which is not installed: pip install \"memfit[torch]\" "
          "(or pip install torch)", file=sys.stderr)
    return True


def main(argv=None) -> int:
    try:
        return _main(argv)
    except BrokenPipeError:
        # the reader went away (`memfit estimate ... | head`): what it wanted was printed;
        # point stdout at /dev/null so the interpreter's own flush at exit stays quiet too
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def _main(argv) -> int:
    args = build_parser().parse_args(argv)
    if args.command in ("demo", "profile") and _torch_missing(args.command):
        return 2
    if args.command == "doctor":
        from memfit import doctor

        return doctor.main(as_json=args.json)
    if args.command == "estimate":
        return _estimate(args)
    if args.command == "profile":
        from memfit import profile

        try:
            _check_device(args.device)
            _check_out(args.out, ("profile.png", "profile.json"))
            return profile.main(args)
        except ValueError as err:
            print(f"memfit profile: error: {err}", file=sys.stderr)
            return 2
    if args.command == "demo":
        from memfit import demo

        try:
            _check_device(args.device)
            _check_out(args.out, demo.OUTPUTS)
            return demo.main(steps=args.steps, device=args.device, out=args.out, seed=args.seed)
        except ValueError as err:
            print(f"memfit demo: error: {err}", file=sys.stderr)
            return 2
    return 2  # argparse rejects unknown commands before this


if __name__ == "__main__":
    sys.exit(main())
