"""The vector CPU loops of quantize_blockwise / dequantize_blockwise (csrc/core/quant.c)
against the plain C loops (MEMFIT_CPU_ISA=generic) and the NumPy reference: the same
bytes for every dtype, block size and tail length, for NaN/Inf blocks, and for a code
whose values lie so close together that the lookup table falls back to the search."""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import memfit.quant as q
from quant_reference import reference_dequantize, reference_quantize

ISAS = ("generic", "avx2", "avx512")


def clustered_code():
    """A sorted code in [-1, 1] with four values within 1e-4 of 0.3: closer together
    than 1/128 of a binade, so the exact table marks their bucket slow."""
    c = np.asarray(q.linear_map(True), np.float32).copy()
    c[200:204] = np.float32([0.3, 0.30002, 0.30004, 0.30006])
    return np.sort(c)


# Run in a subprocess per ISA (the choice is read once per process). Prints one SHA-256
# of every output.
_CASES = r"""
import hashlib, sys, numpy as np, torch, memfit.quant as q
sys.path.insert(0, sys.argv[1])
from test_quant_simd import clustered_code
rng = np.random.default_rng(11)
out = []
for numel in (40001, 65536 + 7):                  # >= 32768: the lookup-table path; odd tails
    x = (rng.standard_normal(numel) * 2).astype(np.float32)
    x[1000:1064] = 0.0                           # an all-zero block (at block size 64)
    # non-finite blocks: in either 8-lane half of the 16-element absmax step, and in
    # the tail of the last (partial) block
    x[5000] = np.nan; x[6500] = np.nan; x[9000] = np.inf; x[13000] = -np.inf; x[-1] = np.inf
    # one 4096-block near the cluster of clustered_code(), every 64-block's absmax 1
    x[24576:28672] = np.float32(0.3) + rng.uniform(-1e-4, 1e-4, 4096).astype(np.float32)
    x[24576:28672:64] = 1.0
    # tiny blocks (absmax below 2^-64; 1/absmax overflows below 2^-128): subnormal
    # values, zeros among them, and a block of the smallest subnormal and zeros
    x[32768:36864] = rng.standard_normal(4096).astype(np.float32) * np.float32(1e-40)
    x[32768:36864:3] = 0.0
    x[32768:32832] = np.float32(1e-45) * rng.integers(-1, 2, 64).astype(np.float32)
    for code in (None, q.dynamic_map(False), clustered_code()):
        for bs in (64, 4096):
            for dt in (torch.float32, torch.bfloat16, torch.float16):
                xt = torch.from_numpy(x).to(dt)
                s = q.quantize_blockwise(xt, block_size=bs, code=code)
                out += [s.codes.numpy().tobytes(), s.absmax.numpy().tobytes()]
                for odt in (torch.float32, torch.bfloat16, torch.float16):
                    y = torch.empty(numel, dtype=odt)
                    q.dequantize_blockwise(s, out=y)
                    out.append(y.view(torch.int16 if odt != torch.float32 else torch.int32).numpy().tobytes())
sys.stdout.write(hashlib.sha256(b"".join(out)).hexdigest())
"""


def test_isa_variants_give_identical_bytes():
    """Codes, absmax and dequantized values (float32, bfloat16, float16) are the same
    bytes under MEMFIT_CPU_ISA=generic, avx2 and avx512 (each capped to what the CPU
    has), including tails, zero and non-finite blocks and slow buckets."""
    here = os.path.dirname(os.path.abspath(__file__))
    digests = {}
    for isa in ISAS:
        env = {**os.environ, "MEMFIT_CPU_ISA": isa}
        r = subprocess.run([sys.executable, "-c", _CASES, here], env=env, capture_output=True,
                           text=True)
        assert r.returncode == 0, r.stderr
        digests[isa] = r.stdout
    assert len(digests["generic"]) == 64
    assert len(set(digests.values())) == 1, digests


@pytest.mark.parametrize("numel", [32768, 40001, 70001])
@pytest.mark.parametrize("block_size", [64, 4096])
def test_clustered_code_matches_reference(numel, block_size):
    """Values near a cluster of code values (the table's slow buckets) still get the
    nearest code, as the exhaustive NumPy search says."""
    rng = np.random.default_rng(5)
    x = rng.uniform(-1, 1, numel).astype(np.float32)
    x[::3] = np.float32(0.3) + rng.uniform(-1e-4, 1e-4, x[::3].size).astype(np.float32)
    x[::64] = 1.0  # absmax 1 in every block: x is its own normalised value
    code = clustered_code()
    cluster = set(np.nonzero((code >= np.float32(0.3)) & (code <= np.float32(0.30006)))[0].tolist())
    assert len(cluster) == 4
    s = q.quantize_blockwise(x, block_size=block_size, code=code)
    ref_codes, ref_absmax, ties = reference_quantize(x, code, block_size)
    np.testing.assert_array_equal(s.absmax, ref_absmax)
    assert np.array_equal(s.codes[~ties], ref_codes[~ties])
    assert len(set(s.codes[::3].tolist()) & cluster) >= 3  # the cluster is used


@pytest.mark.parametrize("odt", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("numel", [7, 8, 263, 65536 + 5])
def test_dequantize_every_code_matches_reference(odt, numel):
    """Every one of the 256 codes, in every lane position, times a per-block absmax
    (one block NaN), rounded to the output dtype as torch rounds (nearest even)."""
    block_size = 64
    codes = (np.arange(numel) * 37 % 256).astype(np.uint8)
    nb = -(-numel // block_size)
    absmax = np.random.default_rng(3).uniform(0.1, 1e4, nb).astype(np.float32)
    absmax[nb // 2] = np.nan
    code = np.asarray(q.dynamic_map(True), np.float32)
    state = q.quantize_blockwise(np.zeros(numel, np.float32), block_size=block_size)
    state.codes[...] = codes
    state.absmax[...] = absmax
    y = torch.empty(numel, dtype=odt)
    q.dequantize_blockwise(state, out=y)
    want = torch.from_numpy(reference_dequantize(codes, absmax, code, block_size)).to(odt)
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(y), nan)
    assert torch.equal(y[~nan], want[~nan])
    if odt == torch.bfloat16:  # the canonical quiet NaN, as mf_f32_to_bf16
        assert set(y[nan].view(torch.int16).tolist()) <= {0x7fc0}
