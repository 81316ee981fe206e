"""The per-element conversions are inlined in the CPU's hot kernels.

The parameter store of the CPU optimizer step (stochastic rounding, nearest-even,
Kahan; csrc/core/optim_cpu.h, store_params) and the widening loads call small MF_HD
helpers of numeric.h, cast.h and optim.h once per element. GCC did not inline them
into the kernels compiled with target attributes (the fused AVX2 / AVX-512 kernels of
optim_fused.h) by its own size estimate: it kept a call per element, with the vector
registers saved around each one, and the bf16 stochastic-rounding step cost 6x the
round-to-nearest one on every tensor with 8-bit states (benchmarks/RESULTS.md,
"Stochastic-rounding store per kernel variant"). MF_HOST_INLINE forces them inline;
this test keeps it so, by reading the built extension's machine code: no hot kernel
calls one of the helpers, and the library holds no out-of-line copy of any (a copy
exists only if something calls it); and the AVX2 and generic kernels hold the
hand-written vector form of the bf16 stochastic-rounding store (store_sr.h). Skipped without objdump or where the extension has
no symbol table (a stripped wheel)."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

import memfit._C as _C

# The per-element helpers (GCC may suffix a copy: .constprop.0, .isra.0, .part.0), and
# the parameter store's own pieces (optim_cpu.h, store_sr.h): the hand-written
# stochastic-rounding loops of the AVX2 and generic kernels and their per-vector steps.
# Called out of line, the store loops would be a call per 64 elements in the fused
# kernels (with the constants set up again each time), the steps a call per vector.
HELPERS = ("mf_hash64", "mf_hash64_mix", "mf_f32_to_bf16_sr", "mf_f32_to_f16_sr",
           "mf_f32_to_bf16", "mf_f32_to_f16", "mf_bf16_to_f32", "mf_f16_to_f32",
           "mf_load_f32", "mf_store_f32", "mf_optim_kahan_split", "mf_optim_load_param",
           "mf_optim_store_param", "mf_cast_one",
           "store_params", "store_params_avx2", "store_params_avx512", "sr_state",
           "sr_store_bf16_scalar", "sr_store_f16_scalar", "sr_mix16_avx2", "sr_mix16_sse2",
           "sr_store_bf16_avx2", "sr_round8_avx2", "sr_store_f16_avx2", "sr_round8_f16_avx2",
           "sr_store_bf16_sse2", "sr_round4_sse2", "sr_store_f16_sse2", "sr_round4_f16_sse2")
_HELPER = re.compile(r"^(%s)(\.[a-z]+\.\d+)*$" % "|".join(map(re.escape, HELPERS)))

# The hot kernels: the fused ones per ISA, the block kernel per ISA, and the OpenMP
# bodies of the step and the cast (which inline the generic kernel's loops).
_HOT = re.compile(r"^(mf_optim_fused[48]_\w+|block_step_\w+|mf_optim_step_cpu\._omp_fn\.\d+"
                  r"|mf_cast\._omp_fn\.\d+)$")
_FUNC = re.compile(r"^[0-9a-f]+ <([^>]+)>:$")
# a call (x86 call, AArch64 bl) or a tail jump to the start of a named function
_CALL = re.compile(r"\s(?:call|callq|bl|jmp|b)\s+[0-9a-f]+ <([^>+]+)>")


_MNEMONIC = re.compile(r"^\s*[0-9a-f]+:\s+([a-z][a-z0-9]*)")


def disassemble(path: str) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """({function: the functions it calls}, {function: its instruction mnemonics}) from
    `objdump -d` of the file at `path`."""
    out = subprocess.run([shutil.which("objdump"), "-d", "--no-show-raw-insn", path],
                         capture_output=True, text=True, check=True).stdout
    funcs: dict[str, set[str]] = {}
    mnemonics: dict[str, set[str]] = {}
    cur: set[str] | None = None
    ops: set[str] = set()
    for line in out.splitlines():
        m = _FUNC.match(line)
        if m:
            cur = funcs.setdefault(m.group(1), set())
            ops = mnemonics.setdefault(m.group(1), set())
            continue
        if cur is not None:
            c = _CALL.search(line)
            if c:
                cur.add(c.group(1).split("@")[0])
            o = _MNEMONIC.match(line)
            if o:
                ops.add(o.group(1))
    return funcs, mnemonics


@pytest.fixture(scope="module")
def disasm():
    if shutil.which("objdump") is None:
        pytest.skip("objdump not found")
    found, ops = disassemble(_C.__file__)
    if not any(_HOT.match(f) for f in found):
        pytest.skip(f"{_C.__file__}: no symbol table (stripped): the kernels cannot be found")
    return found, ops


@pytest.fixture(scope="module")
def funcs(disasm):
    return disasm[0]


def test_hot_kernels_call_no_per_element_helper(funcs):
    hot = {f: sorted(c for c in calls if _HELPER.match(c))
           for f, calls in funcs.items() if _HOT.match(f)}
    assert "mf_optim_step_cpu._omp_fn.0" in hot, sorted(hot)
    if any(f.startswith("mf_optim_fused8_") for f in funcs):  # x86: every fused variant
        for isa in ("avx512_vbmi", "avx512_gather", "avx2"):
            assert f"mf_optim_fused8_{isa}" in hot and f"mf_optim_fused4_{isa}" in hot, sorted(hot)
        for isa in ("generic", "avx2", "avx512"):  # and every block kernel
            assert f"block_step_{isa}" in hot, sorted(hot)
    offenders = {f: c for f, c in hot.items() if c}
    assert not offenders, f"per-element helpers called out of line: {offenders}"


def test_no_out_of_line_copy_of_a_helper(funcs):
    copies = sorted(f for f in funcs if _HELPER.match(f))
    callers = {c: sorted(f for f, calls in funcs.items() if c in calls) for c in copies}
    assert not copies, f"out-of-line copies (and their callers): {callers}"


def test_avx2_and_generic_kernels_hold_the_vector_hash(disasm):
    """The AVX2 and generic x86-64 kernels store bf16 and fp16 parameters with the
    hand-written stochastic-rounding loops of store_sr.h (GCC's own vector form of the scalar loop
    cost 1.7x and 1.4x the nearest-even step there): their one instruction that nothing
    else in those kernels uses, the vpmaddwd (pmaddwd) that takes the hash's cross
    products modulo 2^16, is in each of them; with AVX2 also the vpmulld of the first
    multiply. (Inlined and vectorised, not merely inlined: the scalar loop would pass
    the call check above too.)"""
    funcs, ops = disasm
    if "mf_optim_fused8_avx2" not in funcs:
        pytest.skip("not an x86-64 build with the vector kernels")
    for kernel in ("mf_optim_fused8_avx2", "mf_optim_fused4_avx2", "block_step_avx2",
                   # (fp16 only: bf16 keeps GCC's loop there)
                   "mf_optim_fused8_avx512_vbmi", "block_step_avx512"):
        assert {"vpmaddwd", "vpmulld"} <= ops[kernel], (kernel, sorted(ops[kernel]))
    assert "pmaddwd" in ops["block_step_generic"], sorted(ops["block_step_generic"])
