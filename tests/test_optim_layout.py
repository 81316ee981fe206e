"""Parameters that are dense but not row-major (channels_last convolutions, transposed
weights): the optimizers run over the storage in memory order, so the states follow the
parameter's storage order and states of the parameter's shape keep its layout.

The exact check: a channels_last weight P of shape (O, I, H, W) is stored as the
row-major tensor Q = P.permute(0, 2, 3, 1) of shape (O, H, W, I). Stepping P with
channels_last gradients must give, bit for bit, what stepping Q with the same gradients
permuted gives: the same parameters, the same codes, the same absmax per block.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import memfit.optim as mo
from memfit.optim import functional as F
from memfit.optim import _core

CL = torch.channels_last
TO_NHWC = (0, 2, 3, 1)  # (O, I, H, W) -> the storage order of channels_last
TO_NCHW = (0, 3, 1, 2)


def _cl_and_flat(seed, shape=(12, 5, 3, 3)):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=gen)
    p = torch.nn.Parameter(w.contiguous(memory_format=CL))
    q = torch.nn.Parameter(w.permute(*TO_NHWC).contiguous())
    grads = [torch.randn(shape, generator=gen) * 0.1 for _ in range(4)]
    return p, q, grads


@pytest.mark.parametrize("cls,kw", [
    (mo.AdamW8bit, {"block_size": 64}),
    (mo.AdamW4bit, {}),
    (mo.AdamW, {}),
    (mo.Lion8bit, {"block_size": 128}),
    (mo.Adagrad8bit, {"initial_accumulator_value": 0.1}),
    (mo.AdEMAMix8bit, {"t_alpha": 2}),
], ids=["AdamW8bit", "AdamW4bit", "AdamW", "Lion8bit", "Adagrad8bit", "AdEMAMix8bit"])
def test_channels_last_steps_as_its_storage_order(cls, kw):
    p, q, grads = _cl_and_flat(11)
    op = cls([p], lr=1e-2, min_8bit_size=0, **kw)
    oq = cls([q], lr=1e-2, min_8bit_size=0, **kw)
    for g in grads:
        p.grad = g.contiguous(memory_format=CL)
        q.grad = g.permute(*TO_NHWC).contiguous()
        op.step()
        oq.step()
    assert p.is_contiguous(memory_format=CL)  # the layout is kept
    assert torch.equal(p.detach().permute(*TO_NHWC), q.detach())
    sp, sq = op.state[p], oq.state[q]
    assert set(sp) == set(sq)
    for key, v in sp.items():
        if v.shape == p.shape:  # states of p's shape: p's layout, same values per element
            assert v.is_contiguous(memory_format=CL), key
            assert torch.equal(v.permute(*TO_NHWC), sq[key]), key
        else:  # step, absmax, 4-bit codes: (rows, per row), over the storage
            assert torch.equal(v, sq[key]), key
    dp, dq = mo.dequantized_state(op, p), mo.dequantized_state(oq, q)
    for key in dp:
        assert dp[key].shape == p.shape
        assert torch.equal(dp[key].permute(*TO_NHWC), dq[key]), key


def _reference_dequantize(codes, absmax, bits, signed, block_size, rows, row_len):
    """code[index] * absmax[block], element by element in float32, from the definition
    of the row layout (csrc/include/memfit/optim.h): element c of row r has block (r,
    c // block_size) and, with 4 bits, its index in byte (r, c // 2), the low nibble for
    even c. Returns (rows, row_len) values in storage order."""
    code = _core.code_table(bits, signed)
    codes, absmax = codes.numpy(), absmax.numpy()
    r = np.arange(rows)[:, None]
    c = np.arange(row_len)[None, :]
    if bits == 4:
        byte = codes[r, c // 2].astype(np.int64)
        idx = np.where(c % 2 == 0, byte & 15, byte >> 4)
    else:
        idx = codes.reshape(rows, row_len)[r, c].astype(np.int64)
    return (code[idx] * absmax[r, c // block_size]).astype(np.float32)


@pytest.mark.parametrize("shape", [(7, 143), (3, 333)])
@pytest.mark.parametrize("cls,bits", [(mo.AdamW8bit, 8), (mo.AdamW4bit, 4), (mo.RMSprop8bit, 8)],
                         ids=["AdamW8bit", "AdamW4bit", "RMSprop8bit"])
def test_dequantized_state_is_code_times_absmax(cls, bits, shape):
    # rows of odd length: a partial block per row and, with 4 bits, a half byte per row
    # (rows of 143: one partial block; of 333: two or three blocks, the last partial)
    gen = torch.Generator().manual_seed(3)
    p = torch.nn.Parameter(torch.randn(shape, generator=gen))
    rows, row_len = shape
    kw = {"momentum": 0.9} if cls is mo.RMSprop8bit else {}
    opt = cls([p], lr=1e-3, min_8bit_size=0, **kw)
    for _ in range(3):
        p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    got = mo.dequantized_state(opt, p)
    names = _core.STATE_NAMES[opt._kind]
    bs = opt.param_groups[0]["block_size"]
    layout = _core.state_layout(opt._kind, bits, bs, p.numel(),
                                opt._hparams(opt.param_groups[0])["momentum"], rows)
    assert len(got) == layout["num_states"] == len(names)
    for k, name in enumerate(names, start=1):
        codes, absmax = opt.state[p][f"state{k}"], opt.state[p][f"absmax{k}"]
        assert codes.dtype == torch.uint8
        assert tuple(absmax.shape) == (rows, -(-row_len // bs))
        if bits == 4:
            assert tuple(codes.shape) == (rows, (row_len + 1) // 2)
            assert torch.all(codes[:, -1] >> 4 == 0)  # an odd row's last high nibble is 0
        else:
            assert codes.shape == p.shape
        ref = _reference_dequantize(codes, absmax, bits, layout["signed"][k - 1], bs, rows, row_len)
        assert got[name].shape == p.shape
        np.testing.assert_array_equal(got[name].numpy(), ref)


class _ConvNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = torch.nn.Conv2d(3, 16, 3, padding=1)
        self.c2 = torch.nn.Conv2d(16, 16, 3, padding=1)
        self.head = torch.nn.Linear(16, 4)

    def forward(self, x):
        x = torch.relu(self.c1(x))
        x = torch.relu(self.c2(x))
        return self.head(x.mean(dim=(2, 3)))


def _train(channels_last, steps, bits, block_size=64):
    torch.manual_seed(0)
    model = _ConvNet()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(8, 3, 8, 8, generator=gen)
    y = torch.randint(0, 4, (8,), generator=gen)
    if channels_last:
        model = model.to(memory_format=CL)
        x = x.contiguous(memory_format=CL)
    p0 = {n: p.detach().clone() for n, p in model.named_parameters()}
    cls = mo.AdamW8bit if bits == 8 else mo.AdamW
    opt = cls(model.parameters(), lr=1e-2, min_8bit_size=0,
              **({"block_size": block_size} if bits == 8 else {}))
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        losses.append(loss.item())
        opt.step()
    return model, opt, p0, losses


def _mean_abs(a, b):
    return (a.detach() - b.detach()).abs().mean().item()


def test_channels_last_conv_model_trains_like_contiguous():
    """A channels_last conv model trains with AdamW8bit and follows the contiguous
    model's run. The two runs differ in (a) conv backward's float32 summation order
    (channels_last kernels) and (b) which elements share a quantization block: a conv
    weight's blocks of 64 run over (in, kh, kw) in one run and (kh, kw, in) in the
    other, so each block's absmax, and with it the rounding of every 8-bit state,
    differs (c2's rows of 16*3*3 = 144 elements hold blocks of 64, 64 and 16; c1's rows
    of 27 are one block in both orders; the biases, 1-D, keep float32 states). With
    float32 states (AdamW) only (a) remains: the runs agree to float32
    rounding (1e-5 after 8 steps of lr 1e-2). With 8-bit states, (b) is the same kind of
    difference as regrouping the contiguous model's blocks (block size 64 vs 128), and
    the measured distances are of that size (about 0.5x to 1.6x here): we require the mean
    absolute distance per tensor to stay within 3x the block-size distance and within
    5% of the mean distance the parameters moved. States attached to the wrong elements
    would make the distance comparable to the movement itself."""
    steps = 8
    mc, _, _, lc = _train(False, steps, 32)
    ml, ol, _, ll = _train(True, steps, 32)
    for pc, pl in zip(mc.parameters(), ml.parameters()):
        torch.testing.assert_close(pl.detach(), pc.detach(), rtol=0, atol=1e-5)
        if pl.dim() == 4:  # the layout is kept: parameter, gradient, float32 states
            assert pl.is_contiguous(memory_format=CL) and not pl.is_contiguous()
            assert pl.grad.is_contiguous(memory_format=CL)
            for key in ("state1", "state2"):
                assert ol.state[pl][key].is_contiguous(memory_format=CL), key
    mc, _, p0, lc = _train(False, steps, 8)
    ml, ol, _, ll = _train(True, steps, 8)
    m128, _, _, _ = _train(False, steps, 8, block_size=128)
    assert ll[-1] < 0.9 * ll[0] and lc[-1] < 0.9 * lc[0]  # it trains
    for (name, pc), pl, pb in zip(mc.named_parameters(), ml.parameters(), m128.parameters()):
        if pl.dim() == 4:
            assert pl.is_contiguous(memory_format=CL)
            assert ol.state[pl]["state1"].is_contiguous(memory_format=CL)
        d_layout, d_blocks, moved = _mean_abs(pl, pc), _mean_abs(pb, pc), _mean_abs(pc, p0[name])
        assert d_layout <= 3 * d_blocks + 1e-6, (name, d_layout, d_blocks)
        assert d_layout <= 0.05 * moved, (name, d_layout, moved)
@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph")
def test_create_graph_gradients_are_accepted():
    """backward(create_graph=True) leaves gradients that require grad; the step takes
    them (their values, as a detached view) and matches a step on plain gradients."""
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(300, 20, generator=gen)
    x = torch.randn(20, generator=gen)
    a, b = torch.nn.Parameter(w.clone()), torch.nn.Parameter(w.clone())
    oa, ob = mo.AdamW8bit([a], min_8bit_size=0), mo.AdamW8bit([b], min_8bit_size=0)
    ((a @ x) ** 2).sum().backward(create_graph=True)
    assert a.grad.requires_grad
    b.grad = a.grad.detach().clone()
    oa.step()
    ob.step()
    assert torch.equal(a.detach(), b.detach())
    a.grad = None  # breaks the parameter <-> gradient cycle create_graph made


def test_layouts_that_cannot_be_stepped_are_refused():
    w = torch.randn(12, 5, 3, 3)
    # a channels_last parameter with a row-major gradient: the orders differ
    p = torch.nn.Parameter(w.contiguous(memory_format=CL))
    p.grad = torch.randn(w.shape)
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[0\] \(shape \(12, 5, 3, 3\)\): "
                                         r"must be contiguous \(row-major\), or dense "
                                         r"with a gradient of the same strides.*memory_format"):
        mo.AdamW8bit([p], min_8bit_size=0).step()
    # a parameter with gaps (every other column): not dense
    base = torch.randn(40, 60)
    q = torch.nn.Parameter(base[:, ::2])
    q.grad = torch.randn(q.shape)
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[0\] \(shape \(40, 30\)\): "
                                         r"must be contiguous \(this tensor has gaps"):
        mo.AdamW([q]).step()
    # overlapping elements (an expand): not dense either
    r = torch.nn.Parameter(torch.randn(1, 64).expand(4, 64))
    r.grad = torch.randn(4, 64)
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[0\] \(shape \(4, 64\)\): "
                                         r"must be contiguous \(this tensor has gaps or overlapping"):
        mo.AdamW([r]).step()
    # states made for a row-major parameter that became channels_last afterwards
    s = torch.nn.Parameter(w.clone())
    opt = mo.AdamW([s])
    s.grad = torch.randn(w.shape)
    opt.step()
    s.data = s.data.contiguous(memory_format=CL)
    s.grad = s.grad.contiguous(memory_format=CL)
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[0\] \(shape \(12, 5, 3, 3\)\): "
                                         r"state 'state1' has strides \(45, 9, 3, 1\), but holds one "
                                         r"value per element and must be laid out as the parameter"):
        opt.step()


def test_functional_steps_a_channels_last_tensor_over_its_storage():
    """The functional API's states are flat: for a channels_last parameter they run over
    its storage, as the optimizer classes' states do (the same bits)."""
    p, q, grads = _cl_and_flat(12)
    p, q = p.detach(), q.detach()
    sp, sq = F.adamw8bit_init(p, block_size=64), F.adamw8bit_init(q, block_size=64)
    for g in grads:
        F.adamw8bit_step(p, g.contiguous(memory_format=CL), sp, lr=1e-2)
        F.adamw8bit_step(q, g.permute(*TO_NHWC).contiguous(), sq, lr=1e-2)
    assert torch.equal(p.permute(*TO_NHWC), q)
    for key in ("state1", "absmax1", "state2", "absmax2"):
        assert torch.equal(sp[key], sq[key]), key
