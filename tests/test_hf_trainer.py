"""The Hugging Face Trainer building a memfit optimizer itself from
optimizer_cls_and_kwargs=(cls, kwargs): Trainer calls cls(grouped_params, **kwargs)
with its own two groups (weight decay on matrices, none on biases and LayerNorms,
either possibly empty), and steps it under its linear schedule. A config-built GPT-2
(random weights, no download).
"""

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import memfit.optim as mo  # noqa: E402

STEPS, WD = 4, 0.1


def _train(tmp_path, cls, kwargs):
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=32,
                                  vocab_size=128, use_cache=False)
    model = transformers.GPT2LMHeadModel(cfg)
    ids = torch.randint(0, 128, (16, 32), generator=torch.Generator().manual_seed(5))
    data = [{"input_ids": r, "labels": r} for r in ids]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / cls.__name__), per_device_train_batch_size=4,
        max_steps=STEPS, learning_rate=3e-3, weight_decay=WD, use_cpu=True, report_to=[],
        save_strategy="no", logging_steps=1, disable_tqdm=True, seed=0)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data,
                                   optimizer_cls_and_kwargs=(cls, dict(kwargs)))
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    opt = trainer.optimizer.optimizer  # under Accelerate's wrapper
    return model, opt, losses


def test_optimizer_cls_and_kwargs_builds_and_steps_memfit_optimizers(tmp_path):
    ref_model, ref_opt, ref = _train(tmp_path, torch.optim.AdamW, {"lr": 3e-3})
    model32, opt32, losses32 = _train(tmp_path, mo.AdamW, {"lr": 3e-3})
    model8, opt8, losses8 = _train(tmp_path, mo.AdamW8bit, {"lr": 3e-3, "min_8bit_size": 1024})

    for opt in (opt32, opt8):
        assert [g["weight_decay"] for g in opt.param_groups] == [WD, 0.0]
        assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"]  # the schedule ran
    # memfit's 32-bit AdamW under Trainer's groups and schedule is torch's AdamW, to
    # float rounding: Adam divides by sqrt(v) + eps, so where a gradient is near eps the
    # kernels' different (fused) rounding shows; 1e-5 is 0.3% of one step (lr 3e-3), a
    # wrong weight decay or lr would move weights by whole steps
    for p, q in zip(model32.parameters(), ref_model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-5)
    # AdamW8bit: 8-bit states on the big matrices, float32 on biases and LayerNorms
    wte = model8.transformer.wte.weight
    assert opt8.state[wte]["state1"].dtype == torch.uint8
    assert opt8.state[model8.transformer.ln_f.weight]["state1"].dtype == torch.float32
    # each logged loss is of another batch, so the curve need not fall in 4 steps:
    # compare it with torch AdamW's on the same batches, and check the steps moved the
    # weights (Adam moves each by about lr per step)
    torch.manual_seed(0)
    init = transformers.GPT2LMHeadModel(model8.config).transformer.wte.weight
    assert (wte - init).abs().max().item() > 3e-3
    for a, b in zip(losses8, ref, strict=True):
        assert abs(a - b) < 1e-2, (losses8, ref)


def test_empty_first_group_as_trainer_may_build_it():
    """A model with no decayed parameter gives Trainer an empty first group."""
    p = torch.nn.Parameter(torch.ones(64, 64))
    opt = mo.AdamW8bit([{"params": [], "weight_decay": WD},
                        {"params": [p], "weight_decay": 0.0}], lr=0.1, min_8bit_size=1024)
    p.grad = torch.ones_like(p)
    opt.step()
    # Adam's first step moves every element by lr (the sign of the gradient)
    torch.testing.assert_close(p.detach(), torch.full_like(p, 0.9), rtol=0, atol=1e-6)
