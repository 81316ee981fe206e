"""`memfit demo`: train a small GPT twice, the usual way and the memfit way, on text
every Python installation has (its own standard library), and show what changed.

baseline  float32 weights and activations, torch.optim.AdamW, no checkpointing
memfit    autocast in the best precision for the device (memfit.amp.precision: bf16
          on GPUs that have it, fp16 + memfit's GradScaler on a T4; on a CPU, the faster
          of fp32 and bf16 autocast for this GPT, timed on a few of its steps before
          training: precision_step), memfit.optim.AdamW8bit, and memfit's planner checkpointing the
          blocks to half of their activation memory in half precision, a quarter in fp32
          (profile.checkpoint_budget: the same activation bytes either way)

Everything in the table is measured in this run: bytes of parameters, gradients and
optimizer states from the tensors, activation bytes from saved-tensor hooks (what
autograd keeps for backward, checkpoint boundaries included), peak CUDA memory on a
GPU, the median step time, and the validation loss at the end. A PNG of both loss
curves and a JSON of everything go to the output folder, with a chart of what the
recipes past one GPU's memory (step in backward, offload: memfit.recipes) would take
for a 1B model on a free Colab T4: RECIPES_EXAMPLE, the `memfit estimate` it draws.
"""

from __future__ import annotations

import json
import statistics
import sys
import sysconfig
from pathlib import Path

SIZES = {  # device -> (GPT config kwargs, batch, seq, default steps)
    "cpu": (dict(n_layer=6, d_model=128, n_head=4), 16, 128, 200),
    "cuda": (dict(n_layer=8, d_model=384, n_head=6), 32, 256, 300),
}


# the files the demo writes into its --out folder (checked before training by memfit.cli,
# which imports this module: never the other way)
OUTPUTS = ("loss.png", "recipes.png", "demo.json")

# The recipes chart's case: a 1B model on a free Colab (T4, 12.7 GB host), one sequence
# of 2048 tokens per step, every layer checkpointed; the same as this command line.
RECIPES_EXAMPLE = ["llama-1b", "--gpu", "t4", "--host-memory", "colab", "--batch", "1", "--seq", "2048",
                   "--checkpoint", "every"]


def stdlib_corpus(max_bytes: int = 2_000_000) -> bytes:
    """The first `max_bytes` of the standard library's own .py sources, in sorted
    order: the same text on every machine with the same Python version."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = ("site-packages", "dist-packages", "test", "idlelib", "lib2to3")
    # the left-out folders are not walked at all (site-packages can be most of the tree)
    files = [p for top in root.iterdir() if top.name not in skip
             for p in ([top] if top.is_file() else top.rglob("*.py")) if p.suffix == ".py"]
    chunks, total = [], 0
    for path in sorted(files):
        try:
            data = path.read_bytes()
        except OSError:
            continue
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    if total < 100_000:
        raise RuntimeError(f"found only {total} bytes of standard-library source under {root}")
    return b"".join(chunks)[:max_bytes]


class Batches:
    """Random windows of a byte corpus: inputs and next-byte targets."""

    def __init__(self, data, batch: int, seq: int, device, seed: int):
        import torch

        self.data, self.batch, self.seq, self.device = data, batch, seq, device
        self.gen = torch.Generator().manual_seed(seed)

    def __call__(self):
        import torch

        starts = torch.randint(0, self.data.numel() - self.seq - 1, (self.batch,), generator=self.gen)
        idx = starts[:, None] + torch.arange(self.seq + 1)[None, :]
        chunk = self.data[idx].long()
        return chunk[:, :-1].to(self.device), chunk[:, 1:].to(self.device)


def precision_step(corpus, device, seed: int = 0):
    """``(step, what)`` for memfit.amp.precision: ``step(bf16)`` runs one forward and
    backward of the memfit way's model on one training batch in that precision (bf16
    autocast or fp32): a fresh copy of the demo's GPT with its blocks checkpointed to
    that precision's budget (profile.checkpoint_budget: fp32 checkpoints more blocks to
    keep the same activation bytes), so the timing includes the recompute each
    precision brings. ``what`` describes it (the reason's words, the cache's key). The
    copies are built under their own RNG state: the runs train from the same weights."""
    import torch

    from memfit.models import GPT, GPTConfig
    from memfit.profile import checkpoint_budget, plan_checkpoints

    kw, batch, seq, _ = SIZES[device.type]
    x, y = Batches(corpus["train"], batch, seq, device, seed)()
    models = {}
    with torch.random.fork_rng(devices=[]):
        for bf16 in (False, True):
            torch.manual_seed(seed)
            model = GPT(GPTConfig(vocab=256, max_pos=seq, **kw)).to(device)
            with torch.autocast(device.type, torch.bfloat16, enabled=bf16):
                plan_checkpoints(model, x, checkpoint_budget("memfit", "bf16" if bf16 else "fp32"))
            models[bf16] = model

    def step(bf16: bool) -> None:
        model = models[bf16]
        with torch.autocast(device.type, torch.bfloat16, enabled=bf16):
            loss = model(x, y)[1]
        loss.backward()
        model.zero_grad(set_to_none=True)

    return step, (f"this GPT ({kw['n_layer']} layers, d_model {kw['d_model']}, batch {batch} x {seq}, checkpointed "
                  "to each precision's budget)")


def train(name: str, corpus, device, steps: int, seed: int = 0, precision: str = "auto") -> dict:
    """Trains one configuration (memfit.profile.CONFIGS) from the same initial
    weights and data order, measures it, and adds the final validation loss;
    ``precision``: the autocast precision of the memfit way ("auto": memfit.amp's)."""
    import torch

    from memfit._progress import Progress
    from memfit.models import GPT, GPTConfig
    from memfit.profile import run_config

    kw, batch, seq, _ = SIZES[device.type]
    torch.manual_seed(seed)
    model = GPT(GPTConfig(vocab=256, max_pos=seq, **kw)).to(device)
    bar = Progress(steps, name)
    row = run_config(name, model, Batches(corpus["train"], batch, seq, device, seed),
                     lambda m, x, y: m(x, y)[1], steps,
                     progress=lambda i, n, loss: bar.update(loss), precision=precision)
    model.eval()
    val_batches = Batches(corpus["val"], batch, seq, device, seed + 1)
    with torch.no_grad(), row.pop("autocast"):
        row["final_val_loss"] = statistics.mean(float(model(*val_batches())[1].float()) for _ in range(8))
    return row


def smooth(xs, k=10):
    out, acc = [], []
    for x in xs:
        acc.append(x)
        if len(acc) > k:
            acc.pop(0)
        out.append(sum(acc) / len(acc))
    return out


def plot(rows, path):
    """The loss curves of both runs (PNG; see memfit._plot), each line named by its
    configuration; returns the matplotlib Figure."""
    from memfit._plot import line_chart

    series = {f"{r['name']}: {r['precision']}, {r['optimizer']}, checkpointing {r['checkpoint']}":
              smooth(r["losses"]) for r in rows}
    return line_chart(series, path, title=f"memfit demo: training loss, {len(rows[0]['losses'])} steps",
                      xlabel="training step", ylabel="training loss (nats per byte, 10-step mean)")


def recipes_chart(path):
    """The bytes of each recipe (device and host) for RECIPES_EXAMPLE, as `memfit estimate
    ... --plot` counts them; returns the matplotlib Figure."""
    from memfit import memory, recipes
    from memfit._estimate_args import estimate_setup, parse_estimate

    args = parse_estimate(RECIPES_EXAMPLE)
    spec, setup = memory.resolve_model(args.model), estimate_setup(args)
    return recipes.chart(recipes.placements(spec, setup), path,
                         title=f"memfit demo: {spec.name} on a free Colab {args.gpu.upper()}, per recipe (estimated)",
                         gpu=(args.gpu, memory.parse_gpu(args.gpu)[0]),
                         host_bytes=recipes.parse_host_memory(args.host_memory))


def main(steps: int | None = None, device: str = "auto", out: str = "memfit-demo", seed: int = 0) -> int:
    import torch

    import memfit
    from memfit import memory
    from memfit.profile import format_rows, total_bytes

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() and memfit.cuda_device_count() > 0 else "cpu"
    dev = torch.device(device)
    if dev.type not in SIZES:
        raise ValueError(f"device: expected cpu or cuda, got {device!r}")
    kw, batch, seq, default_steps = SIZES[dev.type]
    steps = memory.check_size(default_steps if steps is None else steps, "steps", minimum=5)
    raw = torch.frombuffer(bytearray(stdlib_corpus()), dtype=torch.uint8)
    split = int(0.95 * raw.numel())
    corpus = {"train": raw[:split], "val": raw[split:]}
    print(f"memfit demo: GPT ({kw['n_layer']} layers, d_model {kw['d_model']}) on {raw.numel() / 1e6:.1f} MB of "
          f"Python's standard library, byte-level, batch {batch} x {seq}, {steps} steps, on {device}")
    from memfit.amp import precision

    step, what = precision_step(corpus, dev, seed) if dev.type == "cpu" else (None, None)
    chosen = precision(dev.type, step=step, what=what)
    print(f"memfit way's precision: {chosen} ({chosen.reason})")
    rows = [train("baseline", corpus, dev, steps, seed), train("memfit", corpus, dev, steps, seed, str(chosen))]
    print(format_rows(rows, {"val loss": lambda r: f"{r['final_val_loss']:.3f}"}))
    base, mf = rows
    print(f"\nmemfit used {total_bytes(mf) / total_bytes(base):.0%} of the baseline's training memory "
          f"(optimizer states {mf['optimizer_bytes'] / base['optimizer_bytes']:.0%}, activations "
          f"{mf['activation_bytes'] / base['activation_bytes']:.0%}); step time "
          f"x{mf['step_time_s'] / base['step_time_s']:.2f}; validation loss {mf['final_val_loss']:.3f} "
          f"vs {base['final_val_loss']:.3f}.")
    outdir = Path(out)
    outdir.mkdir(parents=True, exist_ok=True)
    written, failed = [], []

    def write(name: str, draw, label: str = "") -> None:
        """One output file: a file that cannot be written (a directory of its name, a full
        disk) is reported and the others are still written."""
        path = outdir / name
        if path.exists() and not path.is_file():  # made so while the demo trained
            failed.append(f"could not write {path} (it is {'a directory' if path.is_dir() else 'not a regular file'})")
            return
        try:
            draw(path)
            written.append(f"{path}{label}")
        except (OSError, ValueError) as e:
            failed.append(f"could not write {path} ({getattr(e, 'strerror', None) or e})")

    try:
        write("loss.png", lambda p: plot(rows, p))
        write("recipes.png", recipes_chart, f" (memfit estimate {' '.join(RECIPES_EXAMPLE)} --plot)")
    except ImportError as e:  # matplotlib missing: say how to get it, write the rest
        print(e)
    from memfit.hardware import cpu_info

    meta = {"device": device, "steps": steps, "precision": str(chosen), "precision_reason": chosen.reason,
            "cpu": cpu_info(), "cpu_kernels": memfit.cpu_kernels(), "threads": torch.get_num_threads()}
    write("demo.json", lambda p: p.write_text(json.dumps({**meta, "rows": rows}, indent=2)))
    if written:
        print(f"wrote {', '.join(written[:-1])}{' and ' if len(written) > 1 else ''}{written[-1]}")
    for line in failed:  # one line each; the command fails (2) though the run itself is done
        print(f"memfit demo: error: {line}; the results above are complete", file=sys.stderr)
    return 2 if failed else 0
