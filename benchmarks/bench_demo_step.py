"""Where `memfit demo`'s step time goes: the demo's GPT on its own device, the usual
way and the memfit way, each step split into forward + backward and the optimizer step,
timed interleaved (baseline, memfit, baseline, ...) so machine noise hits both alike.

    python benchmarks/bench_demo_step.py                   # CPU, precision by memfit's rule
    MEMFIT_CPU_PRECISION=bf16 python benchmarks/bench_demo_step.py   # the old CPU advice

baseline  fp32, torch.optim.AdamW, no checkpointing
memfit    memfit.amp.setup("auto") (the precision memfit advises for the device),
          memfit.optim.AdamW8bit, blocks checkpointed by the planner to the demo's budget
          (profile.checkpoint_budget: 50% of their activation memory, 25% in fp32)

Prints a markdown table of medians (ms) and the memfit/baseline ratios; writes
benchmarks/out/demo_step.json with the machine's metadata and the CPU facts.
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
from memfit.demo import SIZES, Batches, stdlib_corpus
from memfit.hardware import cpu_info
from memfit.models import GPT, GPTConfig
from memfit.profile import checkpoint_budget, make_optimizer


def build(name: str, device, batches, seed: int):
    kw, _, seq, _ = SIZES[device.type]
    torch.manual_seed(seed)
    model = GPT(GPTConfig(vocab=256, max_pos=seq, **kw)).to(device)
    opt = make_optimizer("adamw" if name == "baseline" else "adamw8bit", model.parameters(), 3e-3)
    autocast = mamp.AutocastContext(device.type, torch.float32, enabled=False)
    if name == "memfit":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            autocast, _ = mamp.setup(model, opt, "auto", device=device.type)
        x0, _ = batches()
        with autocast:
            mck.auto(model, x0, budget=checkpoint_budget("memfit", str(mamp.precision(device.type))))
    return model, opt, autocast


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    device = torch.device(args.device)
    _, batch, seq, _ = SIZES[device.type]
    corpus = torch.frombuffer(bytearray(stdlib_corpus()), dtype=torch.uint8)
    batches = Batches(corpus, batch, seq, device, args.seed)
    runs = {name: build(name, device, batches, args.seed) for name in ("baseline", "memfit")}
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
    precision = str(mamp.precision(device.type))
    rows = []
    for phase in ("forward_backward", "optimizer", "step"):
        b, m = med["baseline"][phase], med["memfit"][phase]
        rows.append([phase.replace("_", " + "), f"{b * 1e3:.1f}", f"{m * 1e3:.1f}", f"x{m / b:.2f}"])
    meta = metadata(device.type)
    print(f"# demo step breakdown: {meta['date']}, commit {meta['commit']}, {cpu_info()['model_name']}, "
          f"{meta['torch_threads']} torch threads, memfit kernels {meta['memfit_cpu_kernels']}, "
          f"memfit precision {precision}, {args.reps} interleaved reps (medians)")
    print(markdown_table(["phase", "baseline ms", "memfit ms", "memfit / baseline"], rows))
    path = write_json("demo_step", {"meta": {**meta, "cpu_info": cpu_info(), "precision": precision},
                                    "reps": args.reps, "median_s": med})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
