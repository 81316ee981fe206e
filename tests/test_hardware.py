"""memfit.hardware: what the CPU is (checked against the kernel's own /proc/cpuinfo), and
the CPU precision rule: bf16 only where a training step measured faster under bf16
autocast (or, with native bfloat16 compute, not slower), else fp32, always with the
reason; forced by MEMFIT_CPU_PRECISION. The rule's tests give it the measurement; no
test asserts a timing."""

import json
import platform
import re
import subprocess
import sys

import pytest

from memfit import _C, hardware

ENV = hardware.ENV_PRECISION


def proc_flags() -> set:
    return set((hardware._proc_cpuinfo().get("flags") or "").split())


@pytest.fixture(autouse=True)
def no_forced_precision(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)


# ---- the CPU facts ---------------------------------------------------------------------------


def test_cpu_info_fields_and_types():
    info = hardware.cpu_info()
    assert set(info) == {"model_name", "vendor", "arch", "vector_isa", "bf16_features", "bf16_native"}
    assert info["model_name"] and isinstance(info["model_name"], str)
    assert info["arch"] == platform.machine()
    assert set(info["bf16_features"]) <= {"amx-bf16", "avx512-bf16", "bf16"}
    assert info["bf16_native"] == bool(info["bf16_features"])
    assert hardware.cpu_info() is info  # computed once


@pytest.mark.skipif(platform.machine() != "x86_64" or not proc_flags(),
                    reason="needs Linux on x86-64 (/proc/cpuinfo flags)")
def test_cpuid_agrees_with_linux():
    """The C core reads CPUID itself; Linux's own reading of the same CPU must agree."""
    c = _C.cpu_info()
    flags, fields = proc_flags(), hardware._proc_cpuinfo()
    features = c["bf16_features"].split()
    assert ("avx512-bf16" in features) == ("avx512_bf16" in flags)
    assert ("amx-bf16" in features) == ("amx_bf16" in flags and "amx_tile" in flags)
    assert c["vendor"] == fields["vendor_id"]
    assert c["model_name"] == fields["model name"]
    isa = hardware.cpu_info()["vector_isa"]
    if "avx512f" not in flags:
        assert "AVX512" not in isa


def test_arm_facts_from_proc_cpuinfo(monkeypatch):
    """aarch64 has no brand string: the model comes from /proc/cpuinfo's part number, and
    without torch the vector ISA from its feature list."""
    fields = {"cpu implementer": "0x41", "cpu part": "0xd4f", "features": "fp asimd evtstrm sve"}
    assert hardware._model_name("", fields) == "Arm Neoverse V2"
    assert hardware._model_name("", {"cpu implementer": "0x41", "cpu part": "0xabc"}) == \
        "Arm implementer 0x41 part 0xabc"
    assert hardware._model_name("AMD EPYC 7B13", fields) == "AMD EPYC 7B13"
    real = hardware.importlib.util.find_spec
    monkeypatch.setattr(hardware.importlib.util, "find_spec",
                        lambda name, *a: None if name == "torch" else real(name, *a))
    assert hardware._vector_isa(fields) == "SVE"
    assert hardware._vector_isa({"features": "fp asimd"}) == "NEON"
    assert hardware._vector_isa({"flags": "sse2 avx avx2 fma"}) == "AVX2"
    assert hardware._vector_isa({}) == "unknown"


# ---- the rule, with its inputs faked ----------------------------------------------------------


def test_rule_native_flag_needs_the_step_not_to_be_slower():
    """Native bf16 (AMX, AVX512-BF16) is not enough: the demo's GPT on a Sapphire Rapids
    VM took 1.33x the float32 step under bf16 autocast. The measurement decides."""
    name, why = hardware.choose_cpu_precision(["amx-bf16", "avx512-bf16"], speedup=1 / 1.33, what="this GPT")
    assert name == "fp32"
    assert why == ("the CPU computes bfloat16 natively (AMX-BF16, AVX512-BF16), but a training step of this GPT "
                   "took 1.33x the float32 time under bf16 autocast here, so float32 is faster for this model")
    name, why = hardware.choose_cpu_precision(["amx-bf16"], speedup=1.6)
    assert name == "bf16" and "natively (AMX-BF16) and a training step of a one-block GPT" in why
    assert "0.62x the float32 time" in why and "GradScaler" in why
    # at even speed bf16 still halves what autocast keeps: taken unless measurably slower
    assert hardware.choose_cpu_precision(["bf16"], speedup=hardware.BF16_NATIVE_MIN_SPEEDUP)[0] == "bf16"
    assert hardware.choose_cpu_precision(["bf16"], speedup=hardware.BF16_NATIVE_MIN_SPEEDUP * 0.99)[0] == "fp32"
    # no torch, nothing measured: the hardware's word
    name, why = hardware.choose_cpu_precision(["avx512-bf16"], speedup=None)
    assert name == "bf16" and "not measured" in why


def test_rule_measured_speed_decides_without_native_flag():
    name, why = hardware.choose_cpu_precision([], speedup=1.5)
    assert name == "bf16" and "0.67x the float32 time" in why
    name, why = hardware.choose_cpu_precision([], speedup=1 / 5.9)
    assert name == "fp32" and "5.90x the float32 time" in why and "no native bfloat16" in why
    # just below the margin: not worth the risk of noise
    assert hardware.choose_cpu_precision([], speedup=hardware.BF16_MIN_SPEEDUP * 0.99)[0] == "fp32"
    assert hardware.choose_cpu_precision([], speedup=hardware.BF16_MIN_SPEEDUP)[0] == "bf16"
    name, why = hardware.choose_cpu_precision([], speedup=None)  # no torch to measure with
    assert name == "fp32" and "emulated" in why


def test_rule_forced_by_environment():
    for value, want in (("bf16", "bf16"), ("fp32", "fp32"), (" BF16 ", "bf16")):
        name, why = hardware.choose_cpu_precision([], speedup=0.1, forced=value)
        assert name == want and f"{ENV}={want}" in why
    assert hardware.choose_cpu_precision(["amx-bf16"], speedup=2.0, forced="fp32")[0] == "fp32"
    with pytest.raises(ValueError, match=ENV):
        hardware.choose_cpu_precision([], forced="fp16")


def test_cpu_precision_reads_environment(monkeypatch):
    def no_measuring(*a):
        raise AssertionError("a forced answer must not measure")

    monkeypatch.setattr(hardware, "measure_bf16_speedup", no_measuring)
    monkeypatch.setenv(ENV, "bf16")
    assert hardware.cpu_precision()[0] == "bf16"
    monkeypatch.setenv(ENV, "fp32")
    assert hardware.cpu_precision()[0] == "fp32"
    monkeypatch.setenv(ENV, "int8")
    with pytest.raises(ValueError, match=ENV):
        hardware.cpu_precision()
    monkeypatch.setenv(ENV, "auto")  # the same as unset: measured
    monkeypatch.setattr(hardware, "measure_bf16_speedup", lambda *a: 0.75)
    monkeypatch.setattr(hardware, "cpu_info", lambda: {"bf16_features": ["avx512-bf16"]})
    assert hardware.cpu_precision()[0] == "fp32"


@pytest.mark.parametrize("native", [[], ["amx-bf16"]])
def test_cpu_precision_measures_native_or_not(native, monkeypatch):
    monkeypatch.setattr(hardware, "cpu_info", lambda: {"bf16_features": native})
    asked = []

    def measured(step=None, what=None):
        asked.append((step, what))
        return speedup

    monkeypatch.setattr(hardware, "measure_bf16_speedup", measured)
    speedup = 2.0
    assert hardware.cpu_precision()[0] == "bf16"
    speedup = 0.2
    assert hardware.cpu_precision()[0] == "fp32"
    step = object()
    name, why = hardware.cpu_precision(step, "the model at hand")
    assert name == "fp32" and "a training step of the model at hand took 5.00x" in why
    assert asked == [(None, None), (None, None), (step, "the model at hand")]


def test_time_steps_is_interleaved_and_takes_the_best_round(monkeypatch):
    """time_steps with a fake clock: each step(bf16) advances it by a scripted amount."""
    import time

    clock = [0.0]
    costs = {False: [5, 1.0, 1.2, 1.0, 9], True: [9, 1.4, 1.3, 1.35, 9]}  # warm-up first
    order = []

    def step(bf16):
        order.append(bf16)
        clock[0] += costs[bf16].pop(0)

    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])
    speedup = hardware.time_steps(step, max_rounds=3)
    assert order == [False, True] * 4  # one warm-up each, then three interleaved rounds
    assert speedup == pytest.approx(1.0 / 1.3)
    # a decisive first round stops early
    costs = {False: [1, 1.0], True: [1, 3.0]}
    order.clear()
    assert hardware.time_steps(step, max_rounds=3) == pytest.approx(1 / 3)
    assert order == [False, True, False, True]


def test_measurement_needs_a_description_of_the_model():
    pytest.importorskip("torch")
    with pytest.raises(ValueError, match="what: describe the model"):
        hardware.measure_bf16_speedup(lambda bf16: None)


# ---- on this machine -------------------------------------------------------------------------


def test_measurement_is_cached_per_model_and_positive(monkeypatch):
    torch = pytest.importorskip("torch")
    s = hardware.measure_bf16_speedup()
    assert s > 0 and hardware.measure_bf16_speedup() == s
    calls = []

    def step(bf16):
        calls.append(bf16)
        torch.ones(64, 64) @ torch.ones(64, 64)

    s1 = hardware.measure_bf16_speedup(step, "a test's product")
    n = len(calls)
    assert s1 > 0 and 4 <= n <= 8 and hardware.measure_bf16_speedup(step, "a test's product") == s1
    assert len(calls) == n  # cached: not measured again
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1 if before > 1 else 2)  # another thread count is another answer
        hardware.measure_bf16_speedup(step, "a test's product")
        assert len(calls) > n
    finally:
        torch.set_num_threads(before)


def test_measurement_leaves_the_rng_alone():
    torch = pytest.importorskip("torch")
    torch.manual_seed(5)
    want = torch.rand(3)
    torch.manual_seed(5)
    hardware.measure_bf16_speedup(lambda bf16: torch.rand(100), "an RNG user")
    assert torch.equal(torch.rand(3), want)


def test_advice_on_this_machine():
    """Here: the measured step decides, native bf16 or not (the reason says which)."""
    torch = pytest.importorskip("torch")
    from memfit import amp

    p = amp.precision("cpu")
    speedup = hardware.measure_bf16_speedup()
    native = hardware.cpu_info()["bf16_native"]
    want = "bf16" if speedup >= (hardware.BF16_NATIVE_MIN_SPEEDUP if native else hardware.BF16_MIN_SPEEDUP) \
        else "fp32"
    assert p == want and ("natively" if native else "no native bfloat16") in p.reason
    assert f"{1 / speedup:.2f}x the float32 time" in p.reason and hardware.REPRESENTATIVE_WHAT in p.reason
    assert p.dtype is {"bf16": torch.bfloat16, "fp32": torch.float32}[str(p)]
    ctx, scaler = amp.setup(torch.nn.Linear(2, 2), precision="auto")
    assert ctx.dtype is p.dtype and ctx.enabled == (p == "bf16") and not scaler.is_enabled()


def test_amp_follows_forced_precision(monkeypatch):
    torch = pytest.importorskip("torch")
    from memfit import amp

    monkeypatch.setenv(ENV, "fp32")
    p = amp.precision("cpu")
    assert p == "fp32" and ENV in p.reason
    ctx, _ = amp.setup(torch.nn.Linear(2, 2))
    with ctx:
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype is torch.float32
    monkeypatch.setenv(ENV, "bf16")
    assert amp.precision("cpu") == "bf16" and amp.autocast("cpu").dtype is torch.bfloat16


def test_doctor_reports_the_cpu():
    pytest.importorskip("torch")
    out = subprocess.run([sys.executable, "-m", "memfit", "doctor", "--json"],
                         capture_output=True, text=True, check=True)
    cpu = json.loads(out.stdout)["runtime"]["cpu"]
    info = hardware.cpu_info()
    for key in ("model_name", "vendor", "vector_isa", "bf16_native", "bf16_features"):
        assert cpu[key] == info[key], key
    assert cpu["precision"] in ("bf16", "fp32") and cpu["precision_reason"]
    assert ("natively" if info["bf16_native"] else "no native bfloat16") in cpu["precision_reason"]
    text = subprocess.run([sys.executable, "-m", "memfit", "doctor"], capture_output=True,
                          text=True, check=True).stdout
    assert f"CPU          : {info['model_name']}" in text and f"vector ISA {info['vector_isa']}" in text
    assert ("bf16 native" if info["bf16_native"] else "bf16 not native") in text
    # each doctor run times the two precisions itself: two processes on a busy machine can
    # land either side of the threshold, so the text run is checked against a valid answer
    assert re.search(r"CPU precision: (bf16|fp32): ", text)
    kernel = _C.optim_kernel()
    assert kernel in ("avx512-vbmi", "avx512-gather", "avx2-gather", "avx2-scalar", "generic")
    assert json.loads(out.stdout)["runtime"]["optim_kernel"] == kernel
    assert f"CPU kernels  : {_C.cpu_kernels()}; 8/4-bit optimizer kernel {kernel}" in text
