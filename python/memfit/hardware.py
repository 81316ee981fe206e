"""What this CPU is, and which training precision suits it.

bfloat16 autocast only pays where the CPU computes bfloat16 natively: AMX-BF16 (Intel
Sapphire Rapids and later), AVX512-BF16 (Cooper Lake, Zen 4 and later) or Arm's
FEAT_BF16 (Graviton 3, Grace). Elsewhere (Zen 2 and 3, Skylake-SP, Cascade Lake) torch
converts every bf16 operand to float32 and back, and a bf16 matrix product is several
times slower than the float32 one. So :func:`cpu_precision` answers:

* ``MEMFIT_CPU_PRECISION=bf16`` or ``fp32`` in the environment: that, whatever the CPU;
* ``"bf16"`` where the CPU has native bfloat16 compute (CPUID / HWCAP2, read by the C core);
* otherwise a short measurement decides (a 1024x128 @ 128x512 matrix product in each
  dtype, a few of them, once per process): ``"bf16"`` only if it is at least
  ``BF16_MIN_SPEEDUP`` times faster than float32, else ``"fp32"``.

Each answer comes with its reason. :func:`choose_cpu_precision` is the rule itself, a pure
function of those inputs. Importing this module does not import torch; measuring does.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import platform
import time

ENV_PRECISION = "MEMFIT_CPU_PRECISION"
# bf16 must beat float32 by this factor before it is advised without native support:
# below it, the measurement's noise could flip the advice from run to run.
BF16_MIN_SPEEDUP = 1.1
MATMUL_SHAPE = (1024, 128, 512)  # (m, k, n) of the measured product: an MLP-sized block
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
                         forced: str | None = None) -> tuple:
    """The CPU precision rule as a pure function: ``(name, reason)``.

    ``bf16_features``: the CPU's native bfloat16 compute (empty: none); ``speedup``: the
    measured float32 time over the bfloat16 time of a matrix product (None: not
    measured); ``forced``: the value of ``MEMFIT_CPU_PRECISION`` (None or ``""``: unset).
    """
    if forced:
        name = forced.strip().lower()
        if name not in ("bf16", "fp32"):
            raise ValueError(f"{ENV_PRECISION}: expected bf16 or fp32, got {forced!r}")
        why = f"{ENV_PRECISION}={name} in the environment"
        return name, f"{why}; {_BF16_RANGE}" if name == "bf16" else why
    if bf16_features:
        return "bf16", (f"the CPU computes bfloat16 natively ({', '.join(bf16_features).upper()}); "
                        f"{_BF16_RANGE}")
    m, k, n = MATMUL_SHAPE
    if speedup is None:
        return "fp32", ("the CPU has no native bfloat16 compute (no AMX-BF16, AVX512-BF16 or Arm "
                        "BF16), so bf16 autocast would be emulated")
    measured = (f"a {m}x{k} @ {k}x{n} matrix product took {1 / speedup:.2f}x the float32 time in "
                f"bfloat16")
    if speedup >= BF16_MIN_SPEEDUP:
        return "bf16", (f"no native bfloat16 flag, but {measured} here; {_BF16_RANGE}")
    return "fp32", ("the CPU has no native bfloat16 compute (no AMX-BF16, AVX512-BF16 or Arm BF16) "
                    f"and {measured} here, so bf16 autocast would be slower; float32 is faster")


@functools.lru_cache(maxsize=1)
def measure_bf16_speedup(max_rounds: int = 3) -> float | None:
    """float32 time / bfloat16 time of one ``MATMUL_SHAPE`` product in torch's current
    threads (best of up to ``max_rounds`` interleaved rounds after a warm-up), or None
    without torch. Measured once per process. Stops after the first round whose answer
    no noise could flip (one dtype at least twice as fast): an emulated bf16 product is
    several times slower, and each round costs it again."""
    if importlib.util.find_spec("torch") is None:
        return None
    import torch

    m, k, n = MATMUL_SHAPE
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(m, k, generator=gen), torch.randn(k, n, generator=gen)
    pairs = {torch.float32: (a, b), torch.bfloat16: (a.bfloat16(), b.bfloat16())}
    best = {dt: float("inf") for dt in pairs}
    with torch.no_grad():
        for x, y in pairs.values():  # warm-up: the first call creates the kernels
            torch.mm(x, y)
        for _ in range(max_rounds):
            for dt, (x, y) in pairs.items():
                t0 = time.perf_counter()
                torch.mm(x, y)
                best[dt] = min(best[dt], time.perf_counter() - t0)
            speedup = best[torch.float32] / best[torch.bfloat16]
            if not 0.5 < speedup < 2.0:
                break
    return speedup


def cpu_precision() -> tuple:
    """``("bf16" | "fp32", reason)`` for training on this CPU (see the module's doc)."""
    forced = os.environ.get(ENV_PRECISION)
    if forced and forced.strip().lower() != "auto":
        return choose_cpu_precision(forced=forced)
    features = cpu_info()["bf16_features"]
    speedup = None if features else measure_bf16_speedup()
    return choose_cpu_precision(features, speedup)
