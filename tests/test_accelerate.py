"""Hugging Face Accelerate with memfit optimizers: accelerator.prepare(model, optimizer,
loader), bf16 mixed precision on the CPU, accelerator.clip_grad_norm_, gradient
accumulation, and save_state/load_state resuming bit-exactly.

The reference is the loop Accelerate documents, written out by hand (autocast bf16,
outputs cast to float32, loss / accumulation steps, clip every accumulation boundary):
the parameters must be equal bit for bit.
"""

import pytest

torch = pytest.importorskip("torch")
accelerate = pytest.importorskip("accelerate")

import memfit.optim as mo  # noqa: E402

ACCUM, CLIP, N_BATCHES = 2, 0.05, 8


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.GELU(),
                               torch.nn.Linear(128, 64), torch.nn.GELU(), torch.nn.Linear(64, 1))


def _loader():
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(N_BATCHES * 8, 32, generator=g), torch.randn(N_BATCHES * 8, 1, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)


def _opt(params):
    return mo.AdamW8bit(params, lr=1e-2, weight_decay=0.01, min_8bit_size=1024)


def _accelerated(epochs=1, save_to=None, load_from=None):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)  # noqa: SLF001 - one Accelerator per run
    GradientState._reset_state()
    acc = Accelerator(cpu=True, mixed_precision="bf16", gradient_accumulation_steps=ACCUM)
    net = _net()
    model, opt, loader = acc.prepare(net, _opt(net.parameters()), _loader())
    if load_from is not None:
        acc.load_state(load_from)
    norms = []
    for _ in range(epochs):
        for x, y in loader:
            with acc.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(x), y)
                acc.backward(loss)
                if acc.sync_gradients:
                    norms.append(acc.clip_grad_norm_(model.parameters(), CLIP).item())
                opt.step()
                opt.zero_grad()
    if save_to is not None:
        acc.save_state(save_to)
    return net, opt.optimizer, norms


def _manual(epochs=1):
    net = _net()
    opt = _opt(net.parameters())
    for _ in range(epochs):
        for i, (x, y) in enumerate(_loader()):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = net(x)
            loss = torch.nn.functional.mse_loss(out.float(), y)
            (loss / ACCUM).backward()
            if (i + 1) % ACCUM == 0:
                torch.nn.utils.clip_grad_norm_(net.parameters(), CLIP)
                opt.step()
                opt.zero_grad()
    return net, opt


def _assert_same(a, b, opt_a, opt_b):
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
        sa, sb = opt_a.state[p], opt_b.state[q]
        assert sa.keys() == sb.keys()
        for k in sa:
            assert torch.equal(sa[k], sb[k]), k


def test_prepare_bf16_accumulation_clipping_matches_manual_loop():
    net, opt, norms = _accelerated()
    ref, ref_opt = _manual()
    assert len(norms) == N_BATCHES // ACCUM and min(norms) > CLIP  # every step clipped
    assert ref_opt.state[ref[0].weight]["step"].item() == N_BATCHES // ACCUM
    assert opt.state[net[0].weight]["state1"].dtype == torch.uint8
    _assert_same(net, ref, opt, ref_opt)


def test_save_state_load_state_resumes_bit_exactly(tmp_path):
    _accelerated(epochs=1, save_to=tmp_path / "ckpt")
    resumed, opt_r, _ = _accelerated(epochs=1, load_from=tmp_path / "ckpt")
    straight, opt_s, _ = _accelerated(epochs=2)
    _assert_same(resumed, straight, opt_r, opt_s)
    # and the resume is not trivially equal: a fresh one-epoch run differs
    fresh, _, _ = _accelerated(epochs=1)
    assert not torch.equal(fresh[0].weight, straight[0].weight)
