"""Does the loss curve stay where it was? A character-level language model trained on
Python's own standard-library source (it ships with every Python, so the data is real
and needs no download) with torch.optim.AdamW (fp32 states), memfit AdamW (fp32 states,
memfit's kernel), memfit AdamW8bit and memfit AdamW4bit, over 3 seeds.

    python benchmarks/bench_convergence.py            # ~2-4 minutes on 2 CPU cores
    python benchmarks/bench_convergence.py --steps 2000 --seeds 0 1 2 3 4

Model: the previous 32 bytes, each embedded in 48 dimensions, concatenated, then an MLP
1536 -> 512 -> 512 -> 128 (next byte); about 1.1M parameters, all weight matrices above
memfit's min_8bit_size, so their states are quantized. Batches of 128 random windows
from the training text (the stdlib's modules a..m); the held-out text is modules n..z.
Each optimizer sees exactly the same batches for a given seed.

Reported: the held-out loss at the end (mean over 40 fixed batches) and the training
loss averaged over the last 100 steps, per seed and averaged; the relative difference
to torch AdamW. Criterion of the issues: AdamW8bit within 2%, AdamW4bit within 5%; a pure-bf16 model
(bf16 weights and gradients, no fp32 master copy) with AdamW8bit and stochastic
rounding, or with a Kahan compensation buffer (kahan=True), within 3% (nearest rounding
shown for contrast). The offloaded recipes (CPUOffloadOptimizer over AdamW8bit, gradients
on the host) measure the quality cost of the one-step-delayed update (issue 40 §5:
"offload AdamW8bit delayed" against "offload AdamW8bit", which is memfit AdamW8bit bit
for bit; "... after 40": the first 40 steps undelayed, as ZeRO-Offload warms up):

    python benchmarks/bench_convergence.py --optimizers "offload AdamW8bit" \
        "offload AdamW8bit delayed" "offload AdamW8bit delayed after 40"
Writes benchmarks/out/bench_convergence-<time>.json and a PNG of the curves (when
matplotlib is installed).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import sysconfig
import time

import numpy as np
import torch

import memfit.optim as mo
from memfit.optim import CPUOffloadOptimizer

CONTEXT, EMB, HIDDEN, VOCAB = 32, 48, 512, 128


def load_text():
    root = sysconfig.get_paths()["stdlib"]
    files = sorted(f for f in os.listdir(root) if f.endswith(".py"))
    train, held = [], []
    for f in files:
        with open(os.path.join(root, f), "rb") as fh:
            data = bytes(b for b in fh.read() if b < VOCAB)
        (train if f[0].lower() <= "m" else held).append(data)
    return (np.frombuffer(b"".join(train), dtype=np.uint8).copy(),
            np.frombuffer(b"".join(held), dtype=np.uint8).copy())


class CharMLP(torch.nn.Module):
    def __init__(self, hidden=HIDDEN):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, EMB)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(CONTEXT * EMB, hidden), torch.nn.GELU(),
            torch.nn.Linear(hidden, hidden), torch.nn.GELU(),
            torch.nn.Linear(hidden, VOCAB))

    def forward(self, x):
        return self.net(self.emb(x).flatten(1))


def batches(text, n, batch, seed, context=CONTEXT):
    """n batches of ``batch`` random windows of ``context`` tokens of ``text`` (an
    array of token ids), each with the token that follows as the target."""
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(text) - context - 1, size=(n, batch))
    offs = np.arange(context + 1)
    for row in idx:
        w = torch.from_numpy(text[row[:, None] + offs].astype(np.int64))
        yield w[:, :context], w[:, context]


OPTIMIZERS = {
    "torch AdamW": lambda p, lr: torch.optim.AdamW(p, lr=lr),
    "memfit AdamW": lambda p, lr: mo.AdamW(p, lr=lr),
    "memfit AdamW8bit": lambda p, lr: mo.AdamW8bit(p, lr=lr),
    "memfit AdamW4bit": lambda p, lr: mo.AdamW4bit(p, lr=lr),
    # pure bf16: bf16 weights, gradients and activations, no fp32 master copy
    "bf16 AdamW8bit SR": lambda p, lr: mo.AdamW8bit(p, lr=lr, bf16_stochastic_round=True),
    "bf16 AdamW8bit RNE": lambda p, lr: mo.AdamW8bit(p, lr=lr, bf16_stochastic_round=False),
    "bf16 AdamW8bit Kahan": lambda p, lr: mo.AdamW8bit(p, lr=lr, kahan=True),
    # states on the host; delayed: each step's update reaches the model one step later
    "offload AdamW8bit": lambda p, lr: CPUOffloadOptimizer(p, mo.AdamW8bit, lr=lr,
                                                           offload_gradients=True),
    "offload AdamW8bit delayed": lambda p, lr: CPUOffloadOptimizer(
        p, mo.AdamW8bit, lr=lr, offload_gradients=True, delayed_update=True),
    "offload AdamW8bit delayed after 40": lambda p, lr: CPUOffloadOptimizer(
        p, mo.AdamW8bit, lr=lr, offload_gradients=True, delayed_update=40),
}
PARAM_DTYPE = {"bf16 AdamW8bit SR": torch.bfloat16, "bf16 AdamW8bit RNE": torch.bfloat16,
               "bf16 AdamW8bit Kahan": torch.bfloat16}


def run(name, seed, train, held, steps, batch, lr):
    torch.manual_seed(seed)
    model = CharMLP().to(PARAM_DTYPE.get(name, torch.float32))
    opt = OPTIMIZERS[name](model.parameters(), lr)
    return dict(optimizer=name, seed=seed, **fit(model, opt, train, held, steps, batch, seed))


def fit(model, opt, train, held, steps, batch, seed, context=CONTEXT):
    """Trains ``model`` with ``opt`` for ``steps`` batches drawn with ``seed`` (the same
    batches for every optimizer), then measures the held-out loss on 40 fixed batches
    of 512: the training curve, that loss, the training loss averaged over the last 100
    steps and the seconds taken."""
    curve = []
    t0 = time.perf_counter()
    for x, y in batches(train, steps, batch, seed + 1000, context):
        loss = torch.nn.functional.cross_entropy(model(x).float(), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        curve.append(loss.item())
    secs = time.perf_counter() - t0
    if hasattr(opt, "flush"):
        opt.flush()  # a delayed update: the last step's update reaches the model
    with torch.no_grad():
        held_loss = float(np.mean([torch.nn.functional.cross_entropy(model(x).float(), y).item()
                                   for x, y in batches(held, 40, 512, 4242, context)]))
    return {"curve": curve, "held_out_loss": held_loss,
            "train_loss_last100": float(np.mean(curve[-100:])), "seconds": secs}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=800)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--optimizers", nargs="+", default=list(OPTIMIZERS), choices=list(OPTIMIZERS),
                    help="which runs (torch AdamW, the reference, is always included)")
    args = ap.parse_args(argv)
    chosen = ["torch AdamW"] + [n for n in args.optimizers if n != "torch AdamW"]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                           text=True, cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    commit += "+dirty" if dirty else ""
    train, held = load_text()
    print(f"commit {commit}, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, torch {torch.__version__}")
    print(f"stdlib text: {len(train)} training bytes, {len(held)} held-out bytes; "
          f"{sum(p.numel() for p in CharMLP().parameters())} parameters")
    results = []
    for seed in args.seeds:
        for name in chosen:
            r = run(name, seed, train, held, args.steps, args.batch, args.lr)
            results.append(r)
            print(f"seed {seed} {name:20} held-out {r['held_out_loss']:.4f} "
                  f"train(last 100) {r['train_loss_last100']:.4f}  {r['seconds']:.1f}s", flush=True)
    summary = {}
    for name in chosen:
        rs = [r for r in results if r["optimizer"] == name]
        summary[name] = {"held_out_loss": float(np.mean([r["held_out_loss"] for r in rs])),
                         "train_loss_last100": float(np.mean([r["train_loss_last100"] for r in rs]))}
    ref = summary["torch AdamW"]
    print(f"\nmean over seeds {args.seeds}:")
    print(f"{'optimizer':20} {'held-out':>9} {'vs torch':>9} {'train':>8} {'vs torch':>9}")
    for name, s in summary.items():
        s["held_out_rel"] = s["held_out_loss"] / ref["held_out_loss"] - 1
        s["train_rel"] = s["train_loss_last100"] / ref["train_loss_last100"] - 1
        print(f"{name:20} {s['held_out_loss']:9.4f} {100 * s['held_out_rel']:+8.2f}% "
              f"{s['train_loss_last100']:8.4f} {100 * s['train_rel']:+8.2f}%")
    for name, bound in (("memfit AdamW8bit", 0.02), ("memfit AdamW4bit", 0.05), ("bf16 AdamW8bit SR", 0.03),
                        ("bf16 AdamW8bit Kahan", 0.03)):
        if name not in summary:
            continue
        s = summary[name]
        ok = abs(s["held_out_rel"]) < bound and abs(s["train_rel"]) < bound
        print(f"{name}: {'within' if ok else 'NOT within'} {100 * bound:.0f}% of torch AdamW")
    out_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")
    os.makedirs(out_dir, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = os.path.join(out_dir, f"bench_convergence-{stamp}.json")
    with open(path, "w") as f:
        json.dump({"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                   "commit": commit, "args": vars(args), "python": sys.version.split()[0],
                   "torch": torch.__version__, "summary": summary, "runs": results}, f)
    print(f"wrote {path}")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    fig, ax = plt.subplots(figsize=(8, 5))
    colors = dict(zip(OPTIMIZERS, ["black", "tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple",
                                   "tab:brown", "tab:gray", "tab:olive", "tab:cyan", "tab:pink"]))
    k = 25
    for r in results:
        c = np.convolve(r["curve"], np.ones(k) / k, mode="valid")
        ax.plot(np.arange(len(c)) + k, c, color=colors[r["optimizer"]], alpha=0.6, lw=1,
                label=r["optimizer"] if r["seed"] == args.seeds[0] else None)
    ax.set_xlabel("step")
    ax.set_ylabel(f"training loss (nats/byte, {k}-step mean)")
    ax.set_ylim(top=min(3.5, ax.get_ylim()[1]))
    ax.set_title(f"char MLP on the Python stdlib source, seeds {args.seeds}")
    ax.legend()
    png = os.path.join(out_dir, f"bench_convergence-{stamp}.png")
    fig.savefig(png, dpi=110, bbox_inches="tight")
    print(f"wrote {png}")


if __name__ == "__main__":
    main()
