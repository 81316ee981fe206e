"""Quantization blocks within rows (csrc/include/memfit/optim.h, mf_optim_row).

A parameter of shape (R, ...) keeps its quantized states in blocks that never cross a
dim-0 row, so cutting it into row ranges (what FSDP2's Shard(0) does, with uneven
splits) and stepping every range as a parameter of its own must give, bit for bit, the
rows of the whole tensor's parameter, codes and absmax. These checks run in one process;
tests/test_distributed_optim.py runs the same property under FSDP2.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch

import memfit.optim as mo
from memfit.optim import _core
from memfit.optim import functional as F


def _seed(name: str) -> int:
    return zlib.crc32(name.encode())


CASES = [
    # (class, options, shape, row splits): rows that are not whole blocks, odd rows for
    # 4 bits, splits that leave a rank one row or none, and aligned rows
    (mo.AdamW8bit, {}, (37, 300), [0, 10, 19, 37]),
    (mo.AdamW8bit, {"block_size": 64}, (23, 5, 13), [0, 1, 12, 12, 23]),
    (mo.AdamW4bit, {}, (29, 301), [0, 8, 15, 22, 29]),
    (mo.AdamW4bit, {"block_size": 64}, (16, 512), [0, 5, 16]),
    (mo.Lion8bit, {}, (9, 1000), [0, 3, 6, 9]),
    (mo.SGD8bit, {"momentum": 0.9}, (11, 257), [0, 6, 11]),
    (mo.RMSprop8bit, {"momentum": 0.5}, (11, 257), [0, 2, 11]),
    (mo.Adagrad8bit, {"initial_accumulator_value": 0.1}, (13, 300), [0, 4, 13]),
    (mo.AdEMAMix8bit, {"t_alpha": 2, "t_beta3": 2}, (19, 257), [0, 7, 7, 19]),
]


@pytest.mark.parametrize("cls,kw,shape,splits", CASES,
                         ids=[f"{c.__name__}-{'x'.join(map(str, s))}" for c, _, s, _ in CASES])
def test_row_ranges_step_like_the_whole_tensor(cls, kw, shape, splits):
    gen = torch.Generator().manual_seed(_seed(f"{cls.__name__}{shape}"))
    w = torch.randn(shape, generator=gen)
    whole = torch.nn.Parameter(w.clone())
    parts = [torch.nn.Parameter(w[a:b].clone()) for a, b in zip(splits, splits[1:])]
    ow = cls([whole], lr=1e-2, min_8bit_size=0, **kw)
    op = cls(parts, lr=1e-2, min_8bit_size=0, **kw)
    for _ in range(3):
        g = torch.randn(shape, generator=gen) * 0.1
        whole.grad = g.clone()
        for p, a, b in zip(parts, splits, splits[1:]):
            p.grad = g[a:b].clone()
        ow.step()
        op.step()
    assert torch.equal(whole.detach(), torch.cat([p.detach() for p in parts]))
    sw = ow.state[whole]
    assert sw["state1"].dtype == torch.uint8
    for key, v in sw.items():
        if key == "step":
            continue
        got = torch.cat([op.state[p][key] for p in parts if p.numel()])
        assert got.shape == v.shape and torch.equal(got, v), key
    # and the whole tensor's states hold blocks of rows: absmax is (rows, blocks per row)
    bs = ow.param_groups[0]["block_size"]
    row_len = whole.numel() // shape[0]
    assert sw["absmax1"].shape == (shape[0], -(-row_len // bs))


def test_rows_that_are_whole_blocks_keep_the_flat_bytes():
    """Where the block size divides the row length, the row layout is the flat one: the
    same codes and absmax as one row of all the elements (format_version 1's bytes)."""
    rng = np.random.default_rng(_seed("flat"))
    p2 = rng.standard_normal((8, 512)).astype(np.float32)
    p1 = p2.reshape(-1).copy()
    s2, s1 = F.adamw4bit_init(p2), F.adamw4bit_init(p1)
    assert s2["rows"] == 8 and s1["rows"] == 1
    for _ in range(2):
        g = (rng.standard_normal((8, 512)) * 0.01).astype(np.float32)
        F.adamw4bit_step(p2, g, s2, lr=1e-2)
        F.adamw4bit_step(p1, g.reshape(-1), s1, lr=1e-2)
    np.testing.assert_array_equal(p2.reshape(-1), p1)
    for key in ("state1", "absmax1", "state2", "absmax2"):
        np.testing.assert_array_equal(s2[key], s1[key])


def _core_step(params, grads, states, rows, index_base, sr_seed):
    hp = _core.hparams(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01,
                       sr_seed=sr_seed)
    _core.step(_core.ADAMW, 8, 256, hp, params, grads, [s["state1"] for s in states],
               [s["absmax1"] for s in states], [s["state2"] for s in states],
               [s["absmax2"] for s in states], [s["step"] for s in states],
               rows=rows, index_base=index_base)


def _zero_states(p, rows):
    lay = _core.state_layout(_core.ADAMW, 8, 256, p.numel(), 0.0, rows)
    z = lambda n, dt: torch.zeros(n, dtype=dt)  # noqa: E731
    return {"state1": z(lay["state_numel"], torch.uint8), "state2": z(lay["state_numel"], torch.uint8),
            "absmax1": z(lay["absmax_numel"], torch.float32),
            "absmax2": z(lay["absmax_numel"], torch.float32), "step": z(1, torch.float32)}


def test_stochastic_rounding_draws_by_the_global_element_index():
    """bfloat16 parameters with stochastic rounding: a row range given its first
    element's index in the whole tensor (index_base) rounds every element as the whole
    tensor does; without it, the random bits would repeat per shard."""
    gen = torch.Generator().manual_seed(_seed("sr"))
    shape, splits = (13, 300), [0, 4, 13]
    w = (torch.randn(shape, generator=gen) * 0.1).to(torch.bfloat16)
    g = (torch.randn(shape, generator=gen) * 1e-3).to(torch.bfloat16)
    whole = w.clone()
    st = _zero_states(whole, shape[0])
    _core_step([whole.view(-1)], [g.view(-1)], [st], [shape[0]], None, sr_seed=12345)
    parts = [w[a:b].clone() for a, b in zip(splits, splits[1:])]
    parts0 = [w[a:b].clone() for a, b in zip(splits, splits[1:])]
    for p, p0, a, b in zip(parts, parts0, splits, splits[1:]):
        # one call per range, as each rank makes its own (the stream is the tensor's
        # position in the call, the same on every rank)
        _core_step([p.view(-1)], [g[a:b].reshape(-1)], [_zero_states(p, b - a)], [b - a],
                   [a * shape[1]], sr_seed=12345)
        _core_step([p0.view(-1)], [g[a:b].reshape(-1)], [_zero_states(p0, b - a)], [b - a], None,
                   sr_seed=12345)
    assert torch.equal(torch.cat(parts), whole)
    assert not torch.equal(whole, w)  # the step moved something
    # without index_base the second range draws the first one's random bits
    assert torch.equal(parts0[0], parts[0]) and not torch.equal(parts0[1], parts[1])


@pytest.mark.parametrize("bits,n,rows,bs,row_numel,bpr", [
    (8, 37 * 300, 37, 256, 300, 2),
    (4, 29 * 301, 29, 128, 151, 3),
    (4, 10, 1, 128, 5, 1),
    (8, 0, 1, 256, 0, 0),
    (32, 12, 3, 256, 4, 0),
])
def test_layout_per_row(bits, n, rows, bs, row_numel, bpr):
    lay = _core.state_layout(_core.ADAMW, bits, bs, n, 0.0, rows)
    assert (lay["rows"], lay["state_row_numel"], lay["blocks_per_row"]) == (rows, row_numel, bpr)
    assert lay["state_numel"] == rows * row_numel and lay["absmax_numel"] == rows * bpr


def test_bad_rows_and_index_base_are_refused():
    with pytest.raises(ValueError, match="rows: 3 rows do not split 10 elements"):
        _core.state_layout(_core.ADAMW, 8, 256, 10, 0.0, 3)
    p = torch.zeros(12)
    g = torch.zeros(12)
    st = _zero_states(p, 1)
    with pytest.raises(ValueError, match=r"rows\[0\]: 5 rows do not split the 12 elements"):
        _core_step([p], [g], [st], [5], None, 0)
    with pytest.raises(ValueError, match=r"index_base\[0\]: must be >= 0"):
        _core_step([p], [g], [st], [1], [-1], 0)
    with pytest.raises(ValueError, match="rows: expected 1 entries"):
        _core_step([p], [g], [st], [1, 1], None, 0)
    with pytest.raises(TypeError, match=r"rows\[0\]: expected an int"):
        _core_step([p], [g], [st], ["x"], None, 0)
    assert float(st["step"][0]) == 0.0  # nothing was stepped
