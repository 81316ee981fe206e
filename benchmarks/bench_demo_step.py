"""Where `memfit demo`'s step time goes: the demo's GPT on its own device, the usual
way and the memfit way, each step split into forward + backward and the optimizer step,
timed interleaved (baseline, memfit, baseline, ...) so machine noise hits both alike.

    python benchmarks/bench_demo_step.py                      # the memfit way in the demo's precision
    python benchmarks/bench_demo_step.py --precisions bf16,fp32   # the memfit way in each, same run

baseline     fp32, torch.optim.AdamW, no checkpointing
memfit-P     autocast in precision P (default "auto": what `memfit demo` picks, timing its
             GPT in both precisions: memfit.demo.precision_step), memfit.optim.AdamW8bit,
             blocks checkpointed by the planner to the demo's budget
             (profile.checkpoint_budget: 50% of their activation memory, 25% in fp32)

Prints the demo's precision choice with its reason, a markdown table of medians (ms) and
each memfit way's ratio to the baseline; writes benchmarks/out/demo_step.json with the
machine's metadata and the CPU facts.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch

import memfit.amp as mamp
import memfit.checkpoint as mck
from _common import markdown_table, metadata, write_json
from memfit.demo import SIZES, Batches, precision_step, stdlib_corpus
from memfit.hardware import cpu_info
from memfit.models import GPT, GPTConfig
from memfit.profile import checkpoint_budget, make_optimizer


def build(precision: str | None, device, batches, seed: int):
    """The baseline (precision None) or the memfit way in ``precision``."""
    kw, _, seq, _ = SIZES[device.type]
    torch.manual_seed(seed)
    model = GPT(GPTConfig(vocab=256, max_pos=seq, **kw)).to(device)
    opt = make_optimizer("adamw" if precision is None else "adamw8bit", model.parameters(), 3e-3)
    autocast = mamp.AutocastContext(device.type, torch.float32, enabled=False)
    if precision is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            autocast, _ = mamp.setup(model, opt, precision, device=device.type)
        x0, _ = batches()
        with autocast:
            mck.auto(model, x0, budget=checkpoint_budget("memfit", precision))
    return model, opt, autocast


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--precisions", default="auto",
                    help="comma-separated precisions of the memfit way: auto (the demo's choice), bf16, fp32, fp16")
    args = ap.parse_args()
    device = torch.device(args.device)
    _, batch, seq, _ = SIZES[device.type]
    corpus = torch.frombuffer(bytearray(stdlib_corpus()), dtype=torch.uint8)
    step, what = precision_step({"train": corpus}, device, args.seed) if device.type == "cpu" else (None, None)
    chosen = mamp.precision(device.type, step=step, what=what)
    batches = Batches(corpus, batch, seq, device, args.seed)
    precisions = [str(chosen) if p.strip() == "auto" else p.strip() for p in args.precisions.split(",")]
    runs = {"baseline": build(None, device, batches, args.seed)}
    runs.update({f"memfit-{p}": build(p, device, batches, args.seed) for p in dict.fromkeys(precisions)})
    samples = {name: {"forward_backward": [], "optimizer": []} for name in runs}

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    for rep in range(args.reps + 2):  # the first two are warm-up
        x, y = batches()
        for name, (model, opt, autocast) in runs.items():
            sync()
            t0 = time.perf_counter()
            with autocast:
                loss = model(x, y)[1]
            loss.backward()
            sync()
            t1 = time.perf_counter()
            opt.step()
            opt.zero_grad(set_to_none=True)
            sync()
            t2 = time.perf_counter()
            if rep >= 2:
                samples[name]["forward_backward"].append(t1 - t0)
                samples[name]["optimizer"].append(t2 - t1)
    med = {name: {phase: statistics.median(v) for phase, v in s.items()} for name, s in samples.items()}
    for m in med.values():
        m["step"] = m["forward_backward"] + m["optimizer"]
    ways = [n for n in runs if n != "baseline"]
    rows = []
    for phase in ("forward_backward", "optimizer", "step"):
        b = med["baseline"][phase]
        rows.append([phase.replace("_", " + "), f"{b * 1e3:.1f}"]
                    + [f"{med[n][phase] * 1e3:.1f} (x{med[n][phase] / b:.2f})" for n in ways])
    meta = metadata(device.type)
    print(f"# demo step breakdown: {meta['date']}, commit {meta['commit']}, {cpu_info()['model_name']}, "
          f"{meta['torch_threads']} torch threads, memfit kernels {meta['memfit_cpu_kernels']}, "
          f"{args.reps} interleaved reps (medians)")
    print(f"the demo's precision: {chosen} ({chosen.reason})")
    print(markdown_table(["phase", "baseline ms"] + [f"{n} ms (x baseline)" for n in ways], rows))
    path = write_json("demo_step", {"meta": {**meta, "cpu_info": cpu_info(), "precision": str(chosen),
                                             "precision_reason": chosen.reason},
                                    "reps": args.reps, "median_s": med})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
