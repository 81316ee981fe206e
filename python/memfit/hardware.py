"""What this CPU is, and which training precision suits it.

Whether bfloat16 autocast pays on a CPU depends on the CPU and on the model. Without
native bfloat16 compute (Zen 2 and 3, Skylake-SP, Cascade Lake) torch converts every
bf16 operand to float32 and back, and a bf16 matrix product is several times slower.
With it (AMX-BF16 on Sapphire Rapids and later, AVX512-BF16 on Cooper Lake and Zen 4,
Arm's FEAT_BF16), a large bf16 product is faster, but a small model's whole step can still be
slower under bf16 autocast (the casts of every weight and activation it multiplies, and
the ops that do not gain; the demo's GPT, d_model 128, on a Sapphire Rapids VM: 1.33x
the float32 step). The hardware alone cannot tell, so :func:`cpu_precision` measures:

* ``MEMFIT_CPU_PRECISION=bf16`` or ``fp32`` in the environment: that, whatever the CPU;
* otherwise a short timing of training steps (forward and backward) in float32 and
  under bf16 autocast decides: of the model at hand where the caller passes one (``step``,
  as ``memfit demo`` does), else of ``REPRESENTATIVE`` (one block of the demo's GPT).
  ``"bf16"`` where bf16 is at least ``BF16_NATIVE_MIN_SPEEDUP`` (native bf16) or
  ``BF16_MIN_SPEEDUP`` (emulated) times as fast, else ``"fp32"``. Measured once per model
  description and thread count per process;
* without torch (nothing to measure with): ``"bf16"`` where the CPU has native bfloat16
  compute, else ``"fp32"``.

Each answer comes with its reason. :func:`choose_cpu_precision` is the rule itself, a pure
function of those inputs (tests give it the measurement). Importing this module does not
import torch; measuring does.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import platform

ENV_PRECISION = "MEMFIT_CPU_PRECISION"
# bf16 must beat float32 by this factor before it is advised without native support:
# below it, the measurement's noise could flip the advice from run to run.
BF16_MIN_SPEEDUP = 1.1
# With native bf16, bf16 is advised unless measurably slower: at even speed it still
# halves the bytes of what autocast keeps for backward.
BF16_NATIVE_MIN_SPEEDUP = 0.95
# The step measured when the caller has no model at hand: one block of the demo's GPT
# (memfit.models), a size people train on a CPU.
REPRESENTATIVE = dict(n_layer=1, d_model=128, n_head=4, vocab=256, batch=16, seq=128)
REPRESENTATIVE_WHAT = "a one-block GPT (d_model 128, batch 16 x 128)"
_BF16_RANGE = "bfloat16 has float32's range, so no GradScaler is needed"

# Arm cores by (implementer, part) from /proc/cpuinfo: aarch64 has no brand string.
_ARM_PARTS = {
    (0x41, 0xD0C): "Arm Neoverse N1",  # Graviton 2, Ampere Altra
    (0x41, 0xD40): "Arm Neoverse V1",  # Graviton 3
    (0x41, 0xD49): "Arm Neoverse N2",
    (0x41, 0xD4F): "Arm Neoverse V2",  # Grace, Graviton 4
}


def _proc_cpuinfo() -> dict:
    """The first processor's fields of /proc/cpuinfo ({} where there is none)."""
    fields: dict = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if not line.strip():
                    if fields:
                        break
                    continue
                key, _, value = line.partition(":")
                fields.setdefault(key.strip().lower(), value.strip())
    except OSError:
        pass
    return fields


def _model_name(c_name: str, fields: dict) -> str:
    if c_name:
        return c_name
    if fields.get("model name"):
        return fields["model name"]
    try:
        part = (int(fields["cpu implementer"], 16), int(fields["cpu part"], 16))
        return _ARM_PARTS.get(part, f"Arm implementer {part[0]:#x} part {part[1]:#x}")
    except (KeyError, ValueError):
        return platform.processor() or platform.machine() or "unknown"


def _vector_isa(fields: dict) -> str:
    """torch's CPU capability ("AVX2", "AVX512", "DEFAULT", ...) where torch is installed,
    else the widest vector extension /proc/cpuinfo lists."""
    if importlib.util.find_spec("torch") is not None:
        try:
            import torch

            return torch.backends.cpu.get_cpu_capability()
        except Exception:  # an old or broken torch: fall back to the flags
            pass
    flags = set((fields.get("flags") or fields.get("features") or "").split())
    for flag, name in (("avx512f", "AVX512"), ("avx2", "AVX2"), ("sve", "SVE"), ("asimd", "NEON")):
        if flag in flags:
            return name
    return "unknown"


@functools.lru_cache(maxsize=1)
def cpu_info() -> dict:
    """``model_name``, ``vendor``, ``arch``, ``vector_isa``, ``bf16_features`` (list:
    ``"amx-bf16"``, ``"avx512-bf16"``, ``"bf16"`` on Arm) and ``bf16_native``."""
    from memfit import _C

    c = _C.cpu_info()
    fields = _proc_cpuinfo()
    features = c["bf16_features"].split()
    return {
        "model_name": _model_name(c["model_name"], fields),
        "vendor": c["vendor"] or fields.get("vendor_id", ""),
        "arch": platform.machine(),
        "vector_isa": _vector_isa(fields),
        "bf16_features": features,
        "bf16_native": bool(features),
    }


def choose_cpu_precision(bf16_features=(), speedup: float | None = None,
                         forced: str | None = None, what: str = REPRESENTATIVE_WHAT) -> tuple:
    """The CPU precision rule as a pure function: ``(name, reason)``.

    ``bf16_features``: the CPU's native bfloat16 compute (empty: none); ``speedup``: the
    measured float32 step time over the bf16-autocast step time of ``what`` (None: not
    measured, no torch); ``forced``: the value of ``MEMFIT_CPU_PRECISION`` (None or
    ``""``: unset).
    """
    if forced:
        name = forced.strip().lower()
        if name not in ("bf16", "fp32"):
            raise ValueError(f"{ENV_PRECISION}: expected bf16 or fp32, got {forced!r}")
        why = f"{ENV_PRECISION}={name} in the environment"
        return name, f"{why}; {_BF16_RANGE}" if name == "bf16" else why
    native = (f"the CPU computes bfloat16 natively ({', '.join(bf16_features).upper()})" if bf16_features
              else "the CPU has no native bfloat16 compute (no AMX-BF16, AVX512-BF16 or Arm BF16)")
    if speedup is None:
        if bf16_features:
            return "bf16", f"{native} (not measured: no torch); {_BF16_RANGE}"
        return "fp32", f"{native}, so bf16 autocast would be emulated"
    measured = f"a training step of {what} took {1 / speedup:.2f}x the float32 time under bf16 autocast here"
    if speedup >= (BF16_NATIVE_MIN_SPEEDUP if bf16_features else BF16_MIN_SPEEDUP):
        return "bf16", f"{native} and {measured}; {_BF16_RANGE}"
    if bf16_features:
        return "fp32", f"{native}, but {measured}, so float32 is faster for this model"
    return "fp32", f"{native} and {measured}, so bf16 autocast would be slower; float32 is faster"


_measured: dict = {}  # (what, torch threads) -> speedup, for this process


def _representative_step():
    """``step(bf16)`` for REPRESENTATIVE: forward and backward of a fresh one-block GPT."""
    import torch

    from memfit.models import GPT, GPTConfig

    r = REPRESENTATIVE
    gen = torch.Generator().manual_seed(0)
    model = GPT(GPTConfig(n_layer=r["n_layer"], d_model=r["d_model"], n_head=r["n_head"], vocab=r["vocab"],
                          max_pos=r["seq"]))
    x, y = (torch.randint(0, r["vocab"], (r["batch"], r["seq"]), generator=gen) for _ in range(2))

    def step(bf16: bool) -> None:
        with torch.autocast("cpu", torch.bfloat16, enabled=bf16):
            loss = model(x, y)[1]
        loss.backward()
        model.zero_grad(set_to_none=True)

    return step


def time_steps(step, max_rounds: int = 3) -> float:
    """float32 time / bf16 time of ``step(bf16)``: best of up to ``max_rounds``
    interleaved rounds after one warm-up of each (the first call builds kernels and
    caches). Stops after the first round whose answer no noise could flip (one
    precision at least 1.5x as fast)."""
    import time

    best = {False: float("inf"), True: float("inf")}
    for bf16 in best:
        step(bf16)
    for _ in range(max_rounds):
        for bf16 in best:
            t0 = time.perf_counter()
            step(bf16)
            best[bf16] = min(best[bf16], time.perf_counter() - t0)
        speedup = best[False] / best[True]
        if not 1 / 1.5 < speedup < 1.5:
            break
    return speedup


def measure_bf16_speedup(step=None, what: str | None = None) -> float | None:
    """float32 step time / bf16-autocast step time (:func:`time_steps`) of ``step`` (a
    callable ``step(bf16: bool)`` running one forward and backward of the model at hand,
    described by ``what``), or of REPRESENTATIVE without one; None without torch.
    Measured once per ``what`` and torch thread count per process."""
    if importlib.util.find_spec("torch") is None:
        return None
    import torch

    if step is None:
        what = REPRESENTATIVE_WHAT
    elif not what:
        raise ValueError("what: describe the model whose step is measured (the cache's key and the reason's words)")
    key = (what, torch.get_num_threads())
    if key not in _measured:
        with torch.random.fork_rng(devices=[]):  # the measurement leaves the caller's RNG alone
            _measured[key] = time_steps(step or _representative_step())
    return _measured[key]


def cpu_precision(step=None, what: str | None = None) -> tuple:
    """``("bf16" | "fp32", reason)`` for training on this CPU (see the module's doc);
    ``step`` and ``what``: the model at hand (:func:`measure_bf16_speedup`)."""
    forced = os.environ.get(ENV_PRECISION)
    if forced and forced.strip().lower() != "auto":
        return choose_cpu_precision(forced=forced)
    speedup = measure_bf16_speedup(step, what)
    return choose_cpu_precision(cpu_info()["bf16_features"], speedup,
                                what=REPRESENTATIVE_WHAT if step is None else what)
