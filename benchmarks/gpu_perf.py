"""The GPU step at memory speed (issue 39): bitwise checks, then timings, in one call.

    python benchmarks/gpu_perf.py --out OUT/gpu_perf.json       # on a GPU (gpu_validate.sh perf)
    python benchmarks/gpu_perf.py --dry-run --out /tmp/p.json   # on the CPU: the same path, tiny

1. Bitwise: every memfit kernel timed below (and quantize/dequantize) runs once on fresh
   random data at full size (parameters, gradients, random state codes and block maxima)
   on the GPU and once on the CPU core (the reference, csrc/), and every output byte is
   compared. Outputs that are not inputs (Muon's update, quantize's codes and absmax,
   dequantize's values) are poisoned first (0xFF bytes), so an element no thread wrote
   shows up.
2. Timings: CUDA events around each call, every candidate once per repetition in a
   rotating order (interleaved: a clock or thermal swing hits all alike), >= 15
   repetitions after two warm-ups, medians. The buffers (16 GB moved per 1B-parameter
   step) are far larger than L2 (50-60 MB), so no repetition finds its data in cache
   and one set of buffers per candidate is enough; --numel below 64 * L2 is refused on a
   GPU for that reason. Candidates of one parameter dtype share the parameters and
   gradients (each steps them in turn; the values stay finite), so everything fits an
   80 GB card at 1B.
3. One table last: ms, GB/s (the bytes each step must move at least: `bytes` below),
   % of the device-to-device copy in the same run, and x torch fused AdamW (its time over
   this row's, for the row's parameter dtype); the JSON has the same rows, the checks
   and the machine.

Rows: copy (D2D, 16 B per parameter moved), floor (one Triton kernel reading p, g and two
state bytes and writing p and the two bytes: AdamW8bit's traffic with no arithmetic),
memfit AdamW8bit/AdamW4bit (float32; bfloat16 with stochastic rounding), Lion8bit, the
Muon8bit momentum pass, AdamW8bit over the model layout (2000 tensors of 4096 + 8 large,
the same total), torch fused AdamW (float32, bfloat16), torch's Muon momentum (its two
lerps), bitsandbytes AdamW8bit and torchao AdamW8bit where importable, quantize and
dequantize at block 256 and 4096.

--dry-run: CPU tensors of 2^16 elements, memfit's CPU kernels, a host clock: runs the
checks (CPU against CPU), the table and the JSON end to end (tests/test_gpu_validate.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import numpy as np  # noqa: E402

from _common import metadata  # noqa: E402

LAYOUT_SMALL, LAYOUT_SMALL_NUMEL, LAYOUT_LARGE = 2000, 4096, 8


def _optional(name):
    try:
        return __import__(name)
    except Exception:  # noqa: BLE001 - any import failure means "not installed here"
        return None


# ---- memfit steps through the core entry (no per-parameter Python of the optimizer classes)
class MemfitStep:
    """A memfit step over `params` (one dtype) with its own quantized states."""

    def __init__(self, torch, kind, bits, params, grads, hp, out=None, rng_states=True):
        from memfit.optim import _core

        self.core, self.kind, self.bits, self.hp = _core, kind, bits, hp
        self.bs = _core.DEFAULT_BLOCK[bits]
        self.params, self.grads = params, grads
        self.out = out  # Muon: the update goes here, the params are not read
        self.s1, self.a1, self.s2, self.a2, self.steps = [], [], [], [], []
        for p in params:
            lay = _core.state_layout(kind, bits, self.bs, p.numel(), hp["momentum"])
            for k, (s, a) in enumerate(((self.s1, self.a1), (self.s2, self.a2))):
                if k < lay["num_states"]:
                    codes = torch.randint(0, 256, (lay["state_numel"],), dtype=torch.uint8, device=p.device)
                    am = torch.rand(lay["absmax_numel"], device=p.device) * 0.5 + 0.01
                    s.append(codes if rng_states else codes.zero_())
                    a.append(am)
                else:
                    s.append(None)
                    a.append(None)
            self.steps.append(torch.full((1,), 3.0, device=p.device))

    def __call__(self):
        self.core.step(self.kind, self.bits, self.bs, self.hp, self.out or self.params, self.grads, self.s1,
                       self.a1, self.s2, self.a2, self.steps)

    def tensors(self):
        ts = list(self.out or self.params)
        for xs in (self.s1, self.a1, self.s2, self.a2, self.steps):
            ts += [x for x in xs if x is not None]
        return ts

    def clone_to(self, torch, device):
        """The same step on copies of every tensor on `device`."""
        c = MemfitStep.__new__(MemfitStep)
        c.__dict__.update(self.__dict__)
        cp = lambda xs: [None if x is None else x.detach().to(device, copy=True) for x in xs]  # noqa: E731
        c.params, c.grads = cp(self.params), cp(self.grads)
        c.out = cp(self.out) if self.out is not None else None
        c.s1, c.a1, c.s2, c.a2, c.steps = cp(self.s1), cp(self.a1), cp(self.s2), cp(self.a2), cp(self.steps)
        return c


def _same_bytes(torch, a, b) -> bool:
    a, b = a.detach().contiguous().view(torch.uint8).cpu(), b.detach().contiguous().view(torch.uint8).cpu()
    return a.shape == b.shape and bool(torch.equal(a, b))


def check_step(torch, step: MemfitStep, dev) -> bool:
    """The step on `dev` and on the CPU core from the same inputs: every byte equal."""
    ref = step.clone_to(torch, "cpu")
    if step.out is not None:  # poison the output
        for o in step.out + ref.out:
            o.view(torch.uint8).fill_(0xFF)
    step()
    ref()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    return all(_same_bytes(torch, x, y) for x, y in zip(step.tensors(), ref.tensors()))


def check_quant(torch, x, block) -> bool:
    """quantize/dequantize of x on its device and on the CPU, outputs poisoned (quantize
    allocates its own outputs: the allocator hands back memory the poisoned copies just
    freed)."""
    import memfit.quant as mq

    for _ in range(2):  # poison what the next allocation of these sizes will get
        junk = torch.empty(x.numel(), dtype=torch.uint8, device=x.device).fill_(0xFF)
        del junk
    qd, qh = mq.quantize_blockwise(x, block), mq.quantize_blockwise(x.cpu(), block)
    out = torch.empty_like(x).view(torch.uint8).fill_(0xFF).view(x.dtype)
    yd, yh = mq.dequantize_blockwise(qd, out=out), mq.dequantize_blockwise(qh)
    return (_same_bytes(torch, qd.codes, qh.codes) and _same_bytes(torch, qd.absmax, qh.absmax)
            and _same_bytes(torch, yd, yh))


# ---- timing --------------------------------------------------------------------------------
def timed_interleaved(torch, cands: dict, reps: int, cuda: bool) -> dict:
    """{name: median ms}: every candidate once per repetition, in a rotating order."""
    names = []
    for n, fn in cands.items():  # warm-up: module load, JIT, allocations, first touch
        try:
            fn()
            fn()
            if cuda:
                torch.cuda.synchronize()
            names.append(n)
        except Exception as e:  # noqa: BLE001 - one broken peer must not cost the whole call
            print(f"{n}: dropped, {e!r}", file=sys.stderr)
    times = {n: [] for n in names}
    for r in range(reps):
        order = names[r % len(names):] + names[:r % len(names)]
        for n in order:
            if cuda:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                cands[n]()
                b.record()
                b.synchronize()
                times[n].append(a.elapsed_time(b))
            else:
                t0 = time.perf_counter()
                cands[n]()
                times[n].append((time.perf_counter() - t0) * 1e3)
    return {n: statistics.median(v) for n, v in times.items()}


def floor_kernel(torch):
    """A Triton kernel moving AdamW8bit's 16 bytes per parameter (p, g read; p written;
    two state bytes read and written), or None without Triton."""
    triton = _optional("triton")
    if triton is None:
        return None
    import triton.language as tl

    @triton.jit
    def _floor(p, g, m, v, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = i < n
        pv, gv = tl.load(p + i, mask=ok), tl.load(g + i, mask=ok)
        mv, vv = tl.load(m + i, mask=ok), tl.load(v + i, mask=ok)
        tl.store(p + i, pv + gv * 1e-30, mask=ok)
        tl.store(m + i, mv ^ 1, mask=ok)
        tl.store(v + i, vv + 1, mask=ok)

    def run(p, g, m, v):
        n = p.numel()
        _floor[(triton.cdiv(n, 4096),)](p, g, m, v, n, BLOCK=4096)

    return run


# ---- the run ---------------------------------------------------------------------------------
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--numel", type=int, default=1 << 30)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "out" / "gpu_perf.json"))
    ap.add_argument("--dry-run", action="store_true", help="CPU, 2^16 elements: the path, not the numbers")
    ap.add_argument("--skip-checks", action="store_true")
    args = ap.parse_args(argv)
    import torch

    import memfit
    import memfit.quant as mq
    from memfit.optim import _core

    cuda = not args.dry_run
    if cuda and not (torch.cuda.is_available() and memfit.build_info()["cuda"]):
        print("no GPU, or memfit without CUDA: use --dry-run on the CPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda" if cuda else "cpu")
    n = (1 << 16) if args.dry_run else args.numel
    reps = 3 if args.dry_run else max(args.reps, 15)
    if cuda:
        l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 60 << 20)
        if n * 4 < 64 * l2:
            print(f"--numel {n}: the buffers would sit in L2 ({l2} B); use >= {64 * l2 // 4}", file=sys.stderr)
            return 2
    meta = metadata("cuda" if cuda else "cpu")
    meta.update(numel=n, reps=reps, dry_run=args.dry_run)
    gen = torch.Generator(device=dev).manual_seed(39)

    def randn(k, dtype, scale):
        return (torch.randn(k, device=dev, generator=gen) * scale).to(dtype)

    hp_adam = _core.hparams(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
    hp_adam_sr = _core.hparams(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, sr_seed=1234)
    hp_lion = _core.hparams(lr=1e-4, beta1=0.9, beta2=0.99, weight_decay=0.1)
    hp_muon = _core.hparams(lr=0.02, momentum=0.95, nesterov=True)
    fp = {torch.float32: ([randn(n, torch.float32, 0.1)], [randn(n, torch.float32, 0.01)]),
          torch.bfloat16: ([randn(n, torch.bfloat16, 0.1)], [randn(n, torch.bfloat16, 0.01)])}
    scratch = torch.empty(2 * n, dtype=torch.float32, device=dev)  # copy target, Muon's output
    ADAMW, LION, MUON = _core.ADAMW, _core.LION, _core.MUON
    mem = {
        "memfit AdamW8bit fp32": MemfitStep(torch, ADAMW, 8, *fp[torch.float32], hp_adam),
        "memfit AdamW8bit bf16 SR": MemfitStep(torch, ADAMW, 8, *fp[torch.bfloat16], hp_adam_sr),
        "memfit AdamW4bit fp32": MemfitStep(torch, ADAMW, 4, *fp[torch.float32], hp_adam),
        "memfit AdamW4bit bf16 SR": MemfitStep(torch, ADAMW, 4, *fp[torch.bfloat16], hp_adam_sr),
        "memfit Lion8bit fp32": MemfitStep(torch, LION, 8, *fp[torch.float32], hp_lion),
        "memfit Muon8bit momentum fp32": MemfitStep(torch, MUON, 8, *fp[torch.float32], hp_muon,
                                                    out=[scratch[:n]]),
    }
    # the model layout: 2000 tensors of 4096 and 8 large ones, views of the float32 buffers
    small = LAYOUT_SMALL * LAYOUT_SMALL_NUMEL if n >= 4 * LAYOUT_SMALL * LAYOUT_SMALL_NUMEL else 0
    sizes = [LAYOUT_SMALL_NUMEL] * (LAYOUT_SMALL if small else 0)
    sizes += [(n - small) // LAYOUT_LARGE] * LAYOUT_LARGE
    cuts = np.cumsum([0] + sizes).tolist()
    views = lambda t: [t[a:b] for a, b in zip(cuts[:-1], cuts[1:])]  # noqa: E731
    mem["memfit AdamW8bit fp32 model layout"] = MemfitStep(
        torch, ADAMW, 8, views(fp[torch.float32][0][0]), views(fp[torch.float32][1][0]), hp_adam)

    checks = {}
    if not args.skip_checks:  # an error is a failed check; the timings still run
        todo = [(name, lambda st=st: check_step(torch, st, dev)) for name, st in mem.items()]
        todo += [(f"quantize/dequantize block {b}", lambda b=b: check_quant(torch, fp[torch.float32][0][0], b))
                 for b in (256, 4096)]
        for name, fn in todo:
            try:
                checks[name] = fn()
            except Exception as e:  # noqa: BLE001
                print(f"bitwise {name}: {e!r}", file=sys.stderr)
                checks[name] = False
            print(f"bitwise {name}: {'ok' if checks[name] else 'MISMATCH'}", flush=True)

    # candidates: name -> (fn, bytes moved at least, parameter dtype for the torch ratio)
    N = sum(sizes)
    p32, g32 = fp[torch.float32][0][0], fp[torch.float32][1][0]
    src8 = torch.empty(8 * n, dtype=torch.uint8, device=dev).fill_(7)
    dst8 = scratch.view(torch.uint8)[:8 * n]
    cands = {"copy D2D (16 B/param)": (lambda: dst8.copy_(src8), 16 * n, None)}
    floor = floor_kernel(torch) if cuda else None
    if floor is not None:
        st8 = mem["memfit AdamW8bit fp32"]
        cands["floor kernel (16 B/param)"] = (lambda: floor(p32, g32, st8.s1[0], st8.s2[0]), 16 * n, None)
    def q(bits, esz, ns, param_read=True):
        """Bytes a quantized step must move: the parameter read (unless it is an output)
        and written, the gradient read, each state's codes and block maxima read and written."""
        code, block = (1, 256) if bits == 8 else (0.5, 128)
        return n * ((3 if param_read else 2) * esz + 2 * ns * (code + 4 / block))

    bpp = {"memfit AdamW8bit fp32": q(8, 4, 2), "memfit AdamW8bit bf16 SR": q(8, 2, 2),
           "memfit AdamW4bit fp32": q(4, 4, 2), "memfit AdamW4bit bf16 SR": q(4, 2, 2),
           "memfit Lion8bit fp32": q(8, 4, 1), "memfit Muon8bit momentum fp32": q(8, 4, 1, param_read=False),
           "memfit AdamW8bit fp32 model layout": N / n * q(8, 4, 2)}
    for name, st in mem.items():
        cands[name] = (st, bpp[name], torch.bfloat16 if "bf16" in name else torch.float32)
    for dt, label in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        ps = [torch.nn.Parameter(fp[dt][0][0])]
        ps[0].grad = fp[dt][1][0]
        try:
            opt = torch.optim.AdamW(ps, lr=1e-3, fused=True)
            cands[f"torch AdamW fused {label}"] = (opt.step, n * (3 * ps[0].element_size() + 4 * ps[0].element_size()),
                                                   dt)
        except Exception as e:  # noqa: BLE001
            print(f"torch AdamW fused {label}: {e!r}", file=sys.stderr)
    buf = torch.zeros_like(g32)
    cands["torch Muon momentum fp32 (2 lerps)"] = (
        lambda: (buf.lerp_(g32, 0.05), torch.lerp(g32, buf, 0.95, out=scratch[:n])), 16 * n, torch.float32)
    # the 8-bit peers, where installed (__import__ of "torchao.optim" returns torchao)
    for label, module in (("bitsandbytes", "bitsandbytes"), ("torchao", "torchao.optim")):
        peer = _optional(module) if cuda else None
        if peer is None:
            continue
        pp = [torch.nn.Parameter(p32)]
        pp[0].grad = g32
        try:
            opt = peer.optim.AdamW8bit(pp, lr=1e-3)
            cands[f"{label} AdamW8bit fp32"] = (opt.step, bpp["memfit AdamW8bit fp32"], torch.float32)
        except Exception as e:  # noqa: BLE001
            print(f"{label}: {e!r}", file=sys.stderr)
    qstate = {}
    for block in (256, 4096):
        qstate[block] = mq.quantize_blockwise(p32, block)
        cands[f"quantize block {block}"] = (lambda b=block: mq.quantize_blockwise(p32, b), n * (5 + 4 / block), None)
        cands[f"dequantize block {block}"] = (
            lambda b=block: mq.dequantize_blockwise(qstate[b], out=scratch[:n]), n * (5 + 4 / block), None)

    ms = timed_interleaved(torch, {k: v[0] for k, v in cands.items()}, reps, cuda)
    copy_gbs = cands["copy D2D (16 B/param)"][1] / ms["copy D2D (16 B/param)"] / 1e6
    rows = []
    for name, (_, nbytes, dt) in cands.items():
        if name not in ms:  # dropped at its warm-up
            continue
        gbs = nbytes / ms[name] / 1e6
        ref = {torch.float32: "torch AdamW fused fp32", torch.bfloat16: "torch AdamW fused bf16"}.get(dt)
        rows.append({"row": name, "ms": ms[name], "bytes": nbytes, "GB_per_s": gbs,
                     "fraction_of_copy": gbs / copy_gbs,
                     "x_torch_fused": ms[ref] / ms[name] if ref in ms and "torch AdamW" not in name else None})
    result = {"meta": meta, "checks": checks, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1, default=str))
    print(render(result))
    return 0 if all(checks.values()) else 1


def render(result: dict) -> str:
    """The table (markdown) of a result dict: what the run prints last."""
    m = result["meta"]
    lines = [f"\n{m.get('gpu', m.get('device'))}, {m['numel']} elements, median of {m['reps']} interleaved reps"
             + (" (DRY RUN: CPU, not GPU numbers)" if m.get("dry_run") else ""),
             "checks: " + (", ".join(f"{k} {'ok' if v else 'MISMATCH'}" for k, v in result["checks"].items())
                           or "skipped"),
             "", "| row | ms | GB/s | % of copy | x torch fused |", "|---|---:|---:|---:|---:|"]
    for r in result["rows"]:
        x = "" if r["x_torch_fused"] is None else f"{r['x_torch_fused']:.2f}"
        lines.append(f"| {r['row']} | {r['ms']:.3f} | {r['GB_per_s']:.0f} | {100 * r['fraction_of_copy']:.0f}% | {x} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
