"""The offloading optimizer against the same optimizer on the device (issues 32 §5, 40 §6).

A GPT (memfit.models) in bfloat16 with activation checkpointing per block is trained
for a few steps by each recipe, from the same weights on the same batches:

    device     memfit AdamW8bit on the device (states, gradients, parameters there)
    offload    CPUOffloadOptimizer(AdamW8bit, offload_gradients=True): states and
               master weights on the host, stepped there
    offload+sib  the same with step_in_backward=True (each tensor steps during backward)
    torchao    torchao's CPUOffloadOptimizer(torch.optim.AdamW, offload_gradients=True),
               where torchao imports
    device+clip, offload+clip  device and offload with the gradients clipped to --clip
               first (torch's clip_grad_norm_; the offloader's, over the host gradients)

Printed, the tables last, and written to --out (JSON, with the run's metadata):

1. Host step alone: the wrapped optimizer's host step by itself over the model's tensor
   shapes (capped at --alone-params, bf16 and fp32 parameters, random gradients) at
   1, 2, cores/2, cores-1 and cores threads, memfit AdamW8bit against torch's AdamW
   (fused where torch has it for the CPU, else foreach), interleaved medians: seconds,
   ns and core-ns per parameter, memfit's time over torch's.
2. Pinned copy bandwidth both ways (one 256 MiB pinned buffer, CUDA events; GPU only).
3. Per step (medians over the timed steps; sums for the allocation counts), from
   benchmarks/_offload_probe.py and the offloader's event log: forward and backward
   time; bytes each way (one gradient out and one parameter back per tensor whose
   gradient hook ran), their GB/s over the span the copies can run in (GPU: d2h from
   backward's start to the last gradient copy's end, h2d from the first host step's
   start to the last copy back's end: effective rates, at most the link's) and the part
   of each copy exposed (d2h: its end after backward's last kernel; h2d: its end after
   both backward and the host step); the host step's start and end against backward's
   end (negative: during backward), its busy time, ns and core-ns per parameter,
   threads and CPU kernel variant; step() and zero_grad() as the caller waits for them;
   the device's idle gap between backward's end and the next forward (GPU: CUDA events
   on the compute stream; the CPU: until step() and zero_grad() return, as a training
   loop calls them); the hooks' time on the autograd thread; the offloader's staging
   allocations and, on a GPU, torch's pinned allocator requests and new blocks during
   the timed steps (0 once the arena is made).
4. Predicted against measured, per recipe with a host step, from this model:

       predicted = forward + max(backward, d2h_bytes / d2h_bw, host_step) + tail
       tail      = (host_step + h2d_bytes / h2d_bw) * c,  c = min(1, 64 MiB / h2d_bytes)
       measured  = forward + backward + device idle gap

   issue 40's pipeline: gradients leave during backward and each 64 MiB chunk steps as
   it lands, so backward, the copies out and the host step overlap and the slowest sets
   the pace; the last chunk's step and copy back cannot overlap. bw: the pinned
   bandwidth (GPU) or host memcpy bandwidth (the CPU as the device: copy_bandwidth / 2,
   bytes copied per second). Also printed: "serial", the same parts one after another
   (forward + backward + exposed d2h + host step + all copies back): an offloader
   without overlap. A measured step near serial and far above predicted is overlap
   missing; near predicted, the parts themselves are the cost.
5. Per recipe: seconds per step (median), x the device recipe, tokens/s, peak device
   memory, the host bytes the optimizer holds, and whether the final parameters equal
   the device recipe's bit for bit (offload and offload+sib must, docs/offload.md).

On the CPU (the CPU as the device, as in CI) the copies are memcpy inside the hooks and
the host step, so the per-step GB/s and pinned columns print "-" (the reason is printed
under the table). Timings on a shared machine are noisy: read ratios within one run.

    python benchmarks/bench_offload.py                 # the CPU, a tiny GPT (seconds)
    python benchmarks/bench_offload.py --size small --steps 4
    python benchmarks/bench_offload.py --size 1b       # a lent GPU: about 1B parameters
    python benchmarks/bench_offload.py --size 3b --recipes device,offload,device+clip,offload+clip
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common
import memfit
import memfit.optim as mo
import torch
from _offload_probe import StepProbe, measured_ms, predicted_ms
from memfit.checkpoint import checkpoint
from memfit.models import GPT, GPTConfig

SIZES = {  # (n_layer, d_model, n_head, vocab, seq, batch)
    "tiny": (2, 64, 4, 256, 32, 4),
    "small": (4, 256, 4, 1024, 128, 4),
    "1b": (20, 2048, 16, 32768, 1024, 4),
    # issue 40's second target: >= 3B parameters with a backward of about 1 s or more on
    # an H200 (estimate: 6 x N x tokens of backward and recompute at ~400 TFLOP/s); it
    # fits there without offload (~35 GB), so the device step is measured beside it
    "3b": (26, 3072, 24, 32768, 2048, 12),
}
NOT_ON_CPU = ("the CPU is the device here: the copies are memcpy inside the hooks and the "
              "host step, with no copy engine to time")


class CheckpointedGPT(GPT):
    """memfit.models.GPT with each block recomputed in backward."""

    def forward(self, idx, targets):
        b, s = idx.shape
        x = self.wte(idx) + self.wpe(torch.arange(s, device=idx.device))
        for block in self.blocks:
            x = checkpoint(block, x)
        logits = torch.nn.functional.linear(self.ln_f(x), self.wte.weight)
        return torch.nn.functional.cross_entropy(logits.float().view(-1, logits.size(-1)),
                                                 targets.reshape(-1))


def storage_bytes(tensors) -> int:
    seen = {}
    for t in tensors:
        if torch.is_tensor(t):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def make_optimizer(recipe, params, lr):
    recipe = recipe.removesuffix("+clip")  # clipping is done in the loop (run)
    if recipe == "device":
        return mo.AdamW8bit(params, lr=lr)
    if recipe == "offload":
        return mo.CPUOffloadOptimizer(params, mo.AdamW8bit, offload_gradients=True, lr=lr)
    if recipe == "offload+sib":
        return mo.CPUOffloadOptimizer(params, mo.AdamW8bit, offload_gradients=True,
                                      step_in_backward=True, lr=lr)
    from torchao.optim import (
        CPUOffloadOptimizer,  # raises ImportError where it is missing
    )
    return CPUOffloadOptimizer(params, torch.optim.AdamW, offload_gradients=True, lr=lr)


def host_bytes(recipe, opt) -> int | None:
    """Bytes of the host tensors the optimizer keeps (copies, gradient buffers, states)."""
    if recipe.startswith("device"):
        return 0
    if recipe == "torchao":
        return None
    inner = opt.optimizer
    params = [p for g in inner.param_groups for p in g["params"]]
    staging = getattr(getattr(opt, "_staging", None), "nbytes", 0)
    # the gradients live in the offloader's host buffers (kept across zero_grad)
    return storage_bytes([*params, *(v for st in inner.state.values() for v in st.values())]
                         ) + staging


def thread_counts(cores: int) -> list:
    """1, 2, cores/2, cores-1 and cores, those the machine has, once each."""
    return sorted({t for t in (1, 2, cores // 2, cores - 1, cores) if 1 <= t <= cores})


def alone_shapes(cfg, max_params: int) -> list:
    """The model's tensor shapes in its order, each taken while the total stays within
    max_params (so a 1B model gives its position table, a whole block and its vectors:
    the mix of matrices and vectors a GPT steps, at a size the host steps in seconds)."""
    with torch.device("meta"):
        shapes = [tuple(p.shape) for p in CheckpointedGPT(cfg).parameters()]
    chosen, total = [], 0
    for s in shapes:
        n = math.prod(s)
        if total + n <= max_params:
            chosen.append(s)
            total += n
    return chosen or [min(shapes, key=math.prod)]


def host_step_alone(shapes, threads_list, reps, progress) -> list:
    """The host step by itself (no device, no copies): memfit AdamW8bit and torch's AdamW
    over the same random tensors, each with its own parameters and the same gradients,
    at each thread count, bf16 and fp32 parameters; interleaved medians (wall time)."""
    rows = []
    before_m, before_t = memfit.get_num_threads(), torch.get_num_threads()
    n = sum(math.prod(s) for s in shapes)
    try:
        for dtype in (torch.bfloat16, torch.float32):
            g = torch.Generator().manual_seed(0)
            base = [torch.randn(s, generator=g).to(dtype) for s in shapes]
            grads = [torch.randn(s, generator=g).mul_(1e-2).to(dtype) for s in shapes]
            ours = [p.clone().requires_grad_(True) for p in base]
            theirs = [p.clone().requires_grad_(True) for p in base]
            for a, b, gr in zip(ours, theirs, grads):
                a.grad, b.grad = gr, gr
            del base
            m = mo.AdamW8bit(ours, lr=1e-4)
            try:
                t, variant = torch.optim.AdamW(theirs, lr=1e-4, fused=True), "fused"
                t.step()  # fused=True is refused at the first step where torch lacks it
            except (RuntimeError, ValueError):
                t, variant = torch.optim.AdamW(theirs, lr=1e-4, foreach=True), "foreach"
            for threads in threads_list:
                memfit.set_num_threads(threads)
                torch.set_num_threads(threads)
                med = _common.interleaved_medians({"memfit": m.step, "torch": t.step}, reps,
                                                  "cpu", warmup=1)
                name = str(dtype).replace("torch.", "")
                for who, label, kernel in (("memfit", "memfit AdamW8bit", memfit.optim_kernel()),
                                           ("torch", f"torch AdamW {variant}", variant)):
                    rows.append({"step": label, "dtype": name, "threads": threads,
                                 "kernel": kernel, "params": n, "s": med[who],
                                 "ns_per_param": med[who] * 1e9 / n,
                                 "core_ns_per_param": med[who] * 1e9 * threads / n,
                                 "x_torch": med[who] / med["torch"]})
                progress.step(f"host step alone {name} x{threads}")
            del m, t, ours, theirs, grads
    finally:
        memfit.set_num_threads(before_m)
        torch.set_num_threads(before_t)
    return rows


def pinned_bandwidth(device, nbytes=256 << 20, repeats=3) -> dict:
    """GB/s of one pinned host buffer to the GPU and back (CUDA events); on the CPU the
    reason there is none."""
    if device.type != "cuda":
        return {"h2d_gb_s": None, "d2h_gb_s": None, "note": NOT_ON_CPU}
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    out = {"note": f"one {nbytes >> 20} MiB pinned buffer, median of {repeats}"}
    for name, dst, src in (("h2d_gb_s", dev, host), ("d2h_gb_s", host, dev)):
        times = []
        for _ in range(repeats + 1):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            dst.copy_(src, non_blocking=True)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        out[name] = nbytes / statistics.median(times[1:]) / 1e9
    return out


def model_bandwidth(device, pinned) -> tuple:
    """The link rates the step-time model uses (GB/s each way, and where they came from):
    the pinned bandwidth on a GPU; on the CPU, host memcpy (bytes copied per second)."""
    if device.type == "cuda":
        return pinned["d2h_gb_s"], pinned["h2d_gb_s"], "pinned copies (measured above)"
    bw = _common.copy_bandwidth("cpu", nbytes=64 << 20, reps=5) / 2 / 1e9
    return bw, bw, "host memcpy, 64 MiB (the CPU as the device)"


def _median(values):
    vals = [v for v in values if v is not None]
    if not vals:
        return None
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in vals):
        return statistics.median(vals)
    return vals[-1]


SUMMED = ("staging_allocs", "pinned_requests", "pinned_new_blocks")


def run(recipe, cfg, args, device, batches, progress=None):
    torch.manual_seed(0)
    with torch.device(device):  # made where it trains: a 3B model in seconds on a GPU
        model = CheckpointedGPT(cfg).to(dtype=torch.bfloat16)
    clip = recipe.endswith("+clip")
    sizes = [(p.numel(), p.element_size()) for p in model.parameters()]
    opt = make_optimizer(recipe, model.parameters(), args.lr)
    threads = getattr(opt, "host_threads", None)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times, phases = [], []
    for i, (x, y) in enumerate(batches):
        probe = StepProbe(opt, device)
        probe.begin()
        loss = model(x, y)
        probe.forward_done()
        loss.backward()
        probe.backward_done()
        if clip:  # the global norm over every gradient first (the offloader's: on the host)
            if isinstance(opt, mo.CPUOffloadOptimizer):
                opt.clip_grad_norm_(args.clip)
            else:
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        probe.step_done()
        opt.zero_grad(set_to_none=True)
        probe.iteration_done()
        if i >= args.warmup:  # the first step allocates the states
            times.append((probe.t_end - probe.t0) / 1e9)
            phases.append(probe.phases(sizes, threads))
        if progress is not None:
            progress.step(f"{recipe} step {i + 1}/{len(batches)}")
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    final = [p.detach().to("cpu", copy=True) for p in model.parameters()]
    row = {"recipe": recipe, "params": sum(n for n, _ in sizes),
           "param_bytes": sum(n * e for n, e in sizes),
           "s_per_step": statistics.median(times),
           "tokens_per_s": x.numel() / statistics.median(times),
           "peak_device_bytes": peak, "host_bytes": host_bytes(recipe, opt)}
    b = {k: (sum(p[k] for p in phases) if all(p[k] is not None for p in phases) else None)
         if k in SUMMED else _median(p[k] for p in phases) for k in phases[0]}
    offloaded = isinstance(opt, mo.CPUOffloadOptimizer)
    b["kernel"] = memfit.optim_kernel() if offloaded else None
    row["breakdown"] = b
    del model, opt
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row, final


COLUMNS = [  # (breakdown key, header, format)
    ("forward_ms", "fwd ms", ".1f"), ("backward_ms", "bwd ms", ".1f"),
    ("step_after_backward_ms", "step() after bwd ms", ".1f"),
    ("zero_grad_ms", "zero_grad ms", ".1f"),
    ("d2h_bytes", "d2h MB", "mb"), ("d2h_gb_s", "d2h GB/s", ".1f"),
    ("d2h_exposed_ms", "d2h exposed ms", ".2f"),
    ("h2d_bytes", "h2d MB", "mb"), ("h2d_gb_s", "h2d GB/s", ".1f"),
    ("h2d_exposed_ms", "h2d exposed ms", ".2f"),
    ("host_start_vs_backward_end_ms", "host start vs bwd end ms", "+.1f"),
    ("host_end_vs_backward_end_ms", "host end vs bwd end ms", "+.1f"),
    ("host_step_ms", "host step ms", ".1f"), ("host_calls", "host calls", "d"),
    ("host_ns_per_param", "host ns/param", ".2f"),
    ("host_core_ns_per_param", "host core-ns/param", ".2f"),
    ("threads", "threads", "d"), ("kernel", "kernel", "s"),
    ("device_idle_ms", "device idle ms", ".1f"),
    ("hook_ms", "hooks ms", ".1f"), ("hooks", "hooks", "d"),
    ("staging_allocs", "staging allocs", "d"),
    ("pinned_requests", "pinned requests", "d"), ("pinned_new_blocks", "pinned new blocks", "d"),
]


def fmt(v, spec) -> str:
    if v is None:
        return "-"
    if spec == "mb":
        return f"{v / 1e6:.1f}"
    if spec == "d":
        return str(int(round(v)))
    if spec == "s":
        return str(v)
    return format(v, spec)


def print_tables(args, device, rows, alone, pinned, bw_note):
    print(f"\nhost step alone ({alone[0]['params'] / 1e6:.1f}M parameters of the model's "
          f"shapes, random gradients; interleaved medians, wall time)" if alone else "")
    if alone:
        print(_common.markdown_table(
            ["step", "dtype", "threads", "kernel", "s", "ns/param", "core-ns/param", "x torch"],
            [[r["step"], r["dtype"], r["threads"], r["kernel"], f"{r['s']:.4f}",
              f"{r['ns_per_param']:.2f}", f"{r['core_ns_per_param']:.2f}", f"{r['x_torch']:.2f}"]
             for r in alone]))
    if pinned.get("d2h_gb_s") is None:
        print(f"\npinned copies: - ({pinned['note']})")
    else:
        print(f"\npinned copies: host->device {pinned['h2d_gb_s']:.1f} GB/s, "
              f"device->host {pinned['d2h_gb_s']:.1f} GB/s ({pinned['note']})")
    print("\nper step (medians of the timed steps; allocation counts summed over them; "
          "vs bwd end: negative = during backward)")
    cells = [[r["recipe"]] + [fmt(r["breakdown"].get(k), f) for k, _, f in COLUMNS] for r in rows]
    print(_common.markdown_table(["recipe"] + [h for _, h, _ in COLUMNS], cells))
    if device.type != "cuda":
        print(f"GB/s and pinned columns: - ({NOT_ON_CPU}); d2h exposed: the last hook's end "
              "after backward's; device idle: until step() and zero_grad() return")
    print(f"\nmodel: predicted = fwd + max(bwd, d2h bytes/bw, host step) + tail (the last "
          f"64 MiB chunk's step and copy back); bw: {bw_note}")
    for r in rows:
        m = r.get("model")
        if m is None:
            continue
        print(f"{r['recipe']}: predicted {m['predicted_ms']:.1f} ms, measured "
              f"{m['measured_ms']:.1f} ms (x{m['measured_ms'] / m['predicted_ms']:.2f}), "
              f"serial {m['serial_ms']:.1f} ms (d2h {m['model_d2h_ms']:.1f}, h2d "
              f"{m['model_h2d_ms']:.1f}, tail {m['model_tail_ms']:.1f} ms)")
    base = {}  # clipped or not -> the first device run of the same clipping
    for r in rows:
        if r["recipe"].startswith("device"):
            base.setdefault(r["recipe"].endswith("+clip"), r)
    gb = lambda b: "-" if b is None else f"{b / 1e9:.2f}"
    print(f"\nGPT {args.size}, bf16, checkpointed blocks, {device}, "
          f"{rows[0]['params'] / 1e6:.1f}M parameters" if rows else "no recipe ran")
    table = []
    for r in rows:
        ref = base.get(r["recipe"].endswith("+clip"))
        ratio = f"{r['s_per_step'] / ref['s_per_step']:.2f}" if ref else "-"
        r["x_device"] = r["s_per_step"] / ref["s_per_step"] if ref else None
        exact = {None: "-", True: "yes", False: "no"}[r["bit_exact_vs_device"]]
        table.append([r["recipe"], f"{r['s_per_step']:.3f}", ratio, f"{r['tokens_per_s']:.0f}",
                      gb(r["peak_device_bytes"]), gb(r["host_bytes"]), exact])
    print(_common.markdown_table(["recipe", "s/step", "x device", "tokens/s", "peak device GB",
                                  "host GB", "bit-exact"], table))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny",
                    help="the GPT: tiny (CI, seconds), small (the CPU, a minute), 1b, 3b (a GPU)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="where the model trains (default: cuda when there is one)")
    ap.add_argument("--steps", type=int, default=4, help="timed steps per recipe")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first (states made)")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--recipes", default="device,offload,offload+sib,torchao",
                    help="comma-separated: device, offload, offload+sib, torchao (skipped "
                    "where it does not import), device+clip, offload+clip (clip_grad_norm_ "
                    "to --clip before each step); name device twice to see whether the "
                    "device repeats itself bit for bit")
    ap.add_argument("--clip", type=float, default=1.0, help="max_norm of the +clip recipes")
    ap.add_argument("--batch", type=int, default=None,
                    help="sequences per batch (default: the size's; a 3B model's backward "
                    "should take >= 1 s: raise it if the run shows less)")
    ap.add_argument("--alone-params", type=int, default=60_000_000,
                    help="parameters of the host-step-alone table (the model's shapes up to "
                    "this many; default 60M: of a 1B GPT a block and its neighbours, not its "
                    "67M embedding); 0 skips the table")
    ap.add_argument("--alone-threads", default=None,
                    help="comma-separated thread counts of that table (default 1, 2, cores/2, "
                    "cores-1, cores)")
    ap.add_argument("--alone-reps", type=int, default=3, help="its interleaved repetitions")
    ap.add_argument("--out", default=str(_common.OUT_DIR / "bench_offload.json"),
                    help="the JSON written (default benchmarks/out/bench_offload.json)")
    ap.add_argument("--deterministic", action="store_true",
                    help="torch.use_deterministic_algorithms(True): without it a GPU's "
                    "backward (atomic adds) differs from run to run, and so do the "
                    "parameters; name 'device' twice in --recipes to see that")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        ap.error("--steps must be at least 1 and --warmup at least 0")
    if args.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    device = torch.device(args.device)
    n_layer, d_model, n_head, vocab, seq, batch = SIZES[args.size]
    batch = args.batch or batch
    cfg = GPTConfig(n_layer=n_layer, d_model=d_model, n_head=n_head, vocab=vocab, max_pos=seq)
    g = torch.Generator().manual_seed(1)
    batches = [tuple(torch.randint(vocab, (batch, seq), generator=g).to(device) for _ in "xy")
               for _ in range(args.steps + args.warmup)]
    recipes = args.recipes.split(",")
    cores = len(os.sched_getaffinity(0))
    threads_list = ([int(t) for t in args.alone_threads.split(",")] if args.alone_threads
                    else thread_counts(cores))
    shapes = alone_shapes(cfg, args.alone_params) if args.alone_params > 0 else []
    progress = _common.Progress(1 + len(recipes) * len(batches)
                                + (2 * len(threads_list) if shapes else 0), "bench_offload")
    load_before = os.getloadavg()
    # untimed: the first run of a process pays for lazy initialisation (kernels, threads)
    try:
        run(recipes[0], cfg, argparse.Namespace(**{**vars(args), "warmup": 0}), device,
            batches[:1])
    except ImportError:
        pass  # torchao first and missing: said below, when its turn comes
    progress.step("warm-up run")
    rows, refs = [], {}
    for recipe in recipes:
        try:
            row, final = run(recipe, cfg, args, device, batches, progress)
        except ImportError as e:
            print(f"{recipe}: skipped ({e})")
            progress.done += len(batches)
            continue
        clipped = recipe.endswith("+clip")
        if recipe.startswith("device") and clipped not in refs:
            refs[clipped] = final
        rows.append((row, final))
    # against the first device run of the same clipping, whatever the order (a second
    # device run shows whether the device repeats itself)
    for row, final in rows:
        ref = refs.get(row["recipe"].endswith("+clip"))
        row["bit_exact_vs_device"] = (None if ref is None or final is ref else
                                      all(torch.equal(a, b) for a, b in zip(ref, final)))
    rows = [row for row, _ in rows]
    del refs
    pinned = pinned_bandwidth(device)
    d2h_bw, h2d_bw, bw_note = model_bandwidth(device, pinned)
    for r in rows:
        b = r["breakdown"]
        m = predicted_ms(b, d2h_bw, h2d_bw)
        if m is not None:
            m["measured_ms"] = measured_ms(b)
        r["model"] = m
    alone = host_step_alone(shapes, threads_list, args.alone_reps, progress) if shapes else []
    load_after = os.getloadavg()
    print_tables(args, device, rows, alone, pinned, bw_note)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = _common.metadata(str(device))
    meta["loadavg_before_after"] = [list(load_before), list(load_after)]
    meta["command"] = " ".join(["python benchmarks/bench_offload.py",
                                *(sys.argv[1:] if argv is None else argv)])
    out.write_text(json.dumps({
        "meta": meta, "size": args.size, "steps": args.steps, "warmup": args.warmup,
        "rows": rows, "host_step_alone": alone, "pinned_bandwidth": pinned,
        "model_bandwidth_gb_s": {"d2h": d2h_bw, "h2d": h2d_bw, "source": bw_note},
        "model": "predicted = forward + max(backward, d2h_bytes/d2h_bw, host_step) + "
                 "(host_step + h2d_bytes/h2d_bw) * min(1, 64 MiB / h2d_bytes); "
                 "measured = forward + backward + device_idle"}, indent=1))
    print(f"wrote {out}")
    return rows


if __name__ == "__main__":
    main()
