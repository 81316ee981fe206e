"""PEFT LoRA with memfit's AdamW8bit on a small config-built GPT-2 (random weights, no
download): only the LoRA matrices get states; those of at least min_8bit_size elements
get 8-bit states, the smaller ones float32 (docs/optim.md); training lowers the loss
as torch.optim.AdamW does.
"""

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

import memfit.optim as mo  # noqa: E402

MIN_8BIT, STEPS = 1024, 12


def _lora_gpt2():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=32,
                                  vocab_size=128, use_cache=False)
    base = transformers.GPT2LMHeadModel(cfg)
    # c_attn: 64 -> 192; r=8 gives lora_A (8, 64) = 512 elements (float32 states) and
    # lora_B (192, 8) = 1536 elements (8-bit states at min_8bit_size=1024)
    lora = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["c_attn"], lora_dropout=0.0,
                           init_lora_weights="gaussian")
    model = peft.get_peft_model(base, lora)
    # lora_B starts at zero; give it values so that step one moves the loss already
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.02)
    return model


def _train(make_opt):
    model = _lora_gpt2()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = make_opt(params)
    ids = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(5))
    losses = []
    for _ in range(STEPS):
        loss = model(input_ids=ids, labels=ids).loss
        losses.append(loss.item())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model, opt, losses


def test_lora_states_8bit_on_large_matrices_and_loss_falls_like_torch_adamw():
    model, opt, losses = _train(lambda ps: mo.AdamW8bit(ps, lr=3e-2, min_8bit_size=MIN_8BIT))
    _, _, ref = _train(lambda ps: torch.optim.AdamW(ps, lr=3e-2))

    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    formats = {}
    for n, p in trainable.items():
        st = opt.state[p]
        formats.setdefault("lora_A" if "lora_A" in n else "lora_B", set()).add(st["state1"].dtype)
        if p.numel() >= MIN_8BIT:
            assert st["state1"].dtype == st["state2"].dtype == torch.uint8, n
            assert st["absmax1"].dtype == torch.float32
        else:
            assert st["state1"].dtype == torch.float32 and "absmax1" not in st, n
    assert formats == {"lora_A": {torch.float32}, "lora_B": {torch.uint8}}
    frozen = [p for p in model.parameters() if not p.requires_grad]
    assert frozen and not any(p in opt.state for p in frozen)

    assert losses[-1] < losses[0] - 0.2  # it learns (4.87 -> 4.58 here)
    # along torch's trajectory: 8-bit moments perturb fp32 ones slightly (the losses
    # differ by at most 4e-4 here, the loss falls by 0.02 per step)
    for a, b in zip(losses, ref, strict=True):
        assert abs(a - b) < 2e-3, (losses, ref)
