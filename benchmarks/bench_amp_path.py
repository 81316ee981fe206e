"""What a GradScaler step costs a memfit optimizer on each path: torch's default path
(the scaler unscales the gradients with its own kernel, syncs on the inf check, then
steps: what torch.amp.GradScaler and Lightning do with a memfit optimizer as it is)
against the in-kernel path (the kernels divide by grad_scale as they read and skip on
found_inf: torch's scaler after memfit.amp.scale_in_kernel(opt), or memfit's scaler).

Rows, per optimizer (AdamW8bit, AdamW), one iteration each, interleaved, medians:

* ``step`` (no scaler): the floor.
* ``torch scaler, default``: scaler.step(opt) + update(): unscale pass + sync + step.
* ``torch scaler, scale_in_kernel``: the same call on an opted-in optimizer (torch's
  scaler still runs a check-only pass for found_inf, then the step unscales).
* ``memfit scaler``: memfit.amp.GradScaler's step + update (in-kernel, automatic).
* ``+ clip`` rows: unscale_ + clip_grad_norm_ (max_norm 1e30: the norm pass, no
  multiply) + step + update, on the default and the in-kernel path (the unscale pass
  runs on both: what remains is the host sync), and with memfit's scaler (its unscale
  pass, then the step on found_inf).

Every iteration first restores the scaled gradients with one torch._foreach_copy_ (the
default path unscales them in place); that copy is in every row, the ``step`` row too.

    python benchmarks/bench_amp_path.py --device cpu --threads 2 --reps 31
    python benchmarks/bench_amp_path.py --device cpu --threads 1 --clock cpu   # shared machine

Prints a markdown table and writes benchmarks/out/bench_amp_path.json.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _common import interleaved_medians, markdown_table, metadata, write_json  # noqa: E402

import memfit  # noqa: E402
import memfit.amp  # noqa: E402
import memfit.optim as mo  # noqa: E402

SCALE = 2.0**12


def _setup(cls, device, numel, tensors, in_kernel):
    """Parameters with scaled gradients (and their saved copy) and the optimizer."""
    gen = torch.Generator().manual_seed(0)
    per = numel // tensors
    params = [torch.nn.Parameter(torch.randn(per // 1024, 1024, generator=gen).to(device))
              for _ in range(tensors)]
    saved = [(torch.randn(p.shape, generator=gen) * 1e-3 * SCALE).to(device) for p in params]
    for p, g in zip(params, saved):
        p.grad = g.clone()
    opt = cls(params, lr=1e-4)
    if in_kernel:
        memfit.amp.scale_in_kernel(opt)
    return params, saved, opt


def _scaler(kind, device):
    make = memfit.amp.GradScaler if kind == "memfit" else torch.amp.GradScaler
    s = make(device, init_scale=SCALE, growth_interval=10**9)
    s.scale(torch.ones((), device=device))  # the scaler is used: its state exists
    return s


def _row_fns(cls, device, numel, tensors):
    fns = {}

    def iteration(params, saved, opt, scaler=None, clip=False):
        grads = [p.grad for p in params]

        def run():
            torch._foreach_copy_(grads, saved)
            if scaler is None:
                opt.step()
                return
            if clip:
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(params, 1e30, foreach=True)
            scaler.step(opt)
            scaler.update()

        return run

    fns["step (no scaler)"] = iteration(*_setup(cls, device, numel, tensors, False))
    fns["torch scaler, default"] = iteration(*_setup(cls, device, numel, tensors, False),
                                             _scaler("torch", device))
    fns["torch scaler, scale_in_kernel"] = iteration(*_setup(cls, device, numel, tensors, True),
                                                     _scaler("torch", device))
    fns["memfit scaler"] = iteration(*_setup(cls, device, numel, tensors, False),
                                     _scaler("memfit", device))
    fns["torch scaler, default + clip"] = iteration(*_setup(cls, device, numel, tensors, False),
                                                    _scaler("torch", device), clip=True)
    fns["torch scaler, scale_in_kernel + clip"] = iteration(
        *_setup(cls, device, numel, tensors, True), _scaler("torch", device), clip=True)
    fns["memfit scaler + clip"] = iteration(*_setup(cls, device, numel, tensors, False),
                                            _scaler("memfit", device), clip=True)
    return fns


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--numel", type=int, default=None,
                   help="parameter elements (default 4M on the CPU, 256M on a GPU)")
    p.add_argument("--tensors", type=int, default=16)
    p.add_argument("--reps", type=int, default=None)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                   help="cpu: this process's CPU time (on a shared machine, leaves out the "
                        "time other jobs took; use with --threads 1)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    memfit.set_num_threads(torch.get_num_threads())
    devices = ["cpu"] if args.device == "cpu" else ["cuda"] if args.device == "cuda" else (
        ["cpu", "cuda"] if torch.cuda.is_available() and memfit.cuda_device_count() else ["cpu"])
    rows, meta = [], {}
    for dev in devices:
        numel = args.numel or (4 << 20 if dev == "cpu" else 256 << 20)
        reps = args.reps or (31 if dev == "cpu" else 50)
        for cls in (mo.AdamW8bit, mo.AdamW):
            t = interleaved_medians(_row_fns(cls, dev, numel, args.tensors), reps, dev,
                                    clock=args.clock if dev == "cpu" else "wall")
            floor = t["step (no scaler)"]
            for name, s in t.items():
                ref = (t["torch scaler, scale_in_kernel + clip"] if name.endswith("default + clip")
                       else t["torch scaler, scale_in_kernel"] if name == "torch scaler, default"
                       else None)
                rows.append({"device": dev, "optimizer": cls.__name__, "elements": numel,
                             "tensors": args.tensors, "row": name, "seconds": s,
                             "x_step": s / floor, "x_in_kernel": s / ref if ref else None})
        meta[dev] = dict(metadata(dev), reps=reps, clock=args.clock if dev == "cpu" else "cuda events")
    for dev, m in meta.items():
        print(f"{dev}: {m.get('gpu', m['cpu_model'])}, {m['cores']} cores, memfit {m['memfit']} @ "
              f"{m['commit']}, torch {m.get('torch')}, {m['date']}, threads memfit="
              f"{m['memfit_threads']} torch={m.get('torch_threads')}, median of {m['reps']}, "
              f"clock {m['clock']}")
    print(markdown_table(
        ["device", "optimizer", "elements", "row", "ms", "x step", "x in-kernel"],
        [[r["device"], r["optimizer"], r["elements"], r["row"], f"{r['seconds'] * 1e3:.2f}",
          f"{r['x_step']:.2f}", f"{r['x_in_kernel']:.2f}" if r["x_in_kernel"] else ""]
         for r in rows]))
    print(f"\nwrote {write_json('bench_amp_path', {'meta': meta, 'rows': rows})}")


if __name__ == "__main__":
    main()
