"""PyTorch Lightning with memfit optimizers: configure_optimizers returning an
AdamW8bit with a scheduler, memfit's precision plugin (memfit.amp.lightning) under
"bf16-mixed" and "16-mixed" on the CPU with gradient_clip_val (the scaler's found_inf
reaches the kernels: the on-device skip), "16-mixed" on a GPU, and a ModelCheckpoint
resumed with trainer.fit(ckpt_path=...) bit-exactly.

Each run is compared with a hand-written loop doing what Lightning documents it does
(autocast without the weight cache, clip_grad_norm_, step, scheduler step per batch):
the parameters must be equal bit for bit, so any step Lightning adds, drops or reorders
shows up.
"""

import pytest

torch = pytest.importorskip("torch")
pl = pytest.importorskip("pytorch_lightning")

import memfit.optim as mo  # noqa: E402
from memfit.amp.lightning import MixedPrecision  # noqa: E402

N_BATCHES, BATCH = 6, 8


def _data():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(N_BATCHES * BATCH, 32, generator=g)
    y = torch.randn(N_BATCHES * BATCH, 1, generator=g)
    return torch.utils.data.TensorDataset(x, y)


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.GELU(),
                               torch.nn.Linear(128, 64), torch.nn.GELU(), torch.nn.Linear(64, 1))


def _optimizer(params):
    opt = mo.AdamW8bit(params, lr=1e-2, weight_decay=0.01, min_8bit_size=1024)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    return opt, sched


class Lit(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = _net()
        self.losses = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x).float(), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        opt, sched = _optimizer(self.parameters())
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def _loader():
    return torch.utils.data.DataLoader(_data(), batch_size=BATCH, shuffle=False)


def _trainer(**kw):
    kw.setdefault("enable_checkpointing", False)
    return pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, num_sanity_val_steps=0, **kw)


def _fit(max_steps, **kw):
    model = Lit()
    _trainer(max_steps=max_steps, **kw).fit(model, _loader())
    return model


def _manual(steps, precision=None, clip=None):
    """The loop Lightning runs, written out (with torch's GradScaler under "16-mixed",
    as Lightning's plugin makes it). Returns (net, optimizer, losses, norms)."""
    net = _net()
    opt, sched = _optimizer(net.parameters())
    scaler = torch.amp.GradScaler("cpu") if precision == "16-mixed" else None
    half = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(precision)
    losses, norms = [], []
    it = iter(_loader())
    for _ in range(steps):
        x, y = next(it)
        with torch.autocast("cpu", dtype=half or torch.bfloat16, enabled=half is not None,
                            cache_enabled=False):
            loss = torch.nn.functional.mse_loss(net(x).float(), y)
        losses.append(loss.item())
        opt.zero_grad()
        (scaler.scale(loss) if scaler else loss).backward()
        if scaler:
            scaler.unscale_(opt)
        if clip is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(net.parameters(), clip).item())
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        sched.step()
    return net, opt, losses, norms


def _assert_params_equal(a, b):
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


def test_configure_optimizers_with_scheduler_matches_manual_loop():
    model = _fit(N_BATCHES)
    net, opt, losses, _ = _manual(N_BATCHES)
    _assert_params_equal(model.net, net)
    assert model.losses == losses and losses[-1] < losses[0]
    lit_opt = model.trainer.optimizers[0]
    assert isinstance(lit_opt, mo.AdamW8bit)
    assert lit_opt.state[model.net[0].weight]["state1"].dtype == torch.uint8  # 8-bit
    # the scheduler stepped per batch: lr = 1e-2 / (1 + steps)
    assert lit_opt.param_groups[0]["lr"] == pytest.approx(1e-2 / (1 + N_BATCHES))


def test_the_flag_has_torchs_meaning_for_every_caller():
    """_step_supports_amp_scaling is a plain True, whoever asks (it once answered
    False to Lightning's modules only): Lightning's own plugin therefore refuses to
    clip, as it does for torch's fused AdamW, and says what to use."""
    from lightning_fabric.plugins.precision.amp import _optimizer_handles_unscaling

    opt = _optimizer(_net().parameters())[0]
    assert mo.AdamW8bit._step_supports_amp_scaling is True
    assert _optimizer_handles_unscaling(opt) is True
    with pytest.raises(RuntimeError, match="does not allow for gradient clipping"):
        _fit(1, precision="bf16-mixed", gradient_clip_val=1.0)


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_memfit_plugin_with_gradient_clipping_matches_manual_loop(precision):
    """memfit's plugin: Lightning's MixedPrecision that unscales (16-mixed) and clips;
    bit for bit the loop torch documents (unscale_, clip_grad_norm_, scaler.step)."""
    clip = 0.05
    model = _fit(N_BATCHES, plugins=[MixedPrecision(precision, "cpu")], gradient_clip_val=clip)
    net, _, losses, norms = _manual(N_BATCHES, precision=precision, clip=clip)
    assert min(norms) > clip  # every step was clipped: the check below can see it
    _assert_params_equal(model.net, net)
    assert model.losses == losses and losses[-1] < losses[0]
    unclipped, *_ = _manual(N_BATCHES, precision=precision)
    assert not torch.equal(unclipped[0].weight, net[0].weight)
    if precision == "16-mixed":  # the scaler ran: its state is in the trainer's plugin
        assert model.trainer.precision_plugin.scaler.get_scale() > 0


class _Poisoned(Lit):
    """Records what the scaler hands each step (grad_scale, found_inf), gives step 2
    an inf gradient before the unscale, and snapshots the first layer's weight and
    step counter before steps 2 and 3."""

    def __init__(self):
        super().__init__()
        self.seen, self.snap = [], {}

    def configure_optimizers(self):
        cfg = super().configure_optimizers()
        opt = cfg["optimizer"]
        step = opt.step

        def spied(*a, **k):
            self.seen.append((getattr(opt, "grad_scale", "absent"), getattr(opt, "found_inf", None)))
            return step(*a, **k)

        opt.step = spied
        return cfg

    def on_after_backward(self):
        if self.global_step == 2:
            self.net[0].weight.grad[0, 0] = float("inf")

    def on_before_optimizer_step(self, optimizer):
        w = self.net[0].weight
        if self.global_step in (2, 3):
            self.snap[self.global_step] = (w.detach().clone(), optimizer.state[w]["step"].clone())


def _check_16_mixed_skip(accelerator, device):
    """Under "16-mixed" the plugin unscales once (no "unscale_() has already been
    called"), the scaler hands the kernels found_inf with grad_scale None, and the inf
    gradient skips the step on the device: weights and step counter unchanged."""
    model = _Poisoned()
    pl.Trainer(accelerator=accelerator, devices=1, plugins=[MixedPrecision("16-mixed", device)],
               gradient_clip_val=1.0, max_steps=N_BATCHES, logger=False, enable_progress_bar=False,
               enable_checkpointing=False, enable_model_summary=False,
               num_sanity_val_steps=0).fit(model, _loader())
    assert len(model.seen) == N_BATCHES
    for grad_scale, found_inf in model.seen:
        assert grad_scale is None and torch.is_tensor(found_inf)  # the fused skip path
    assert [bool(f) for _, f in model.seen] == [False, False, True, False, False, False]
    (w2, step2), (w3, step3) = model.snap[2], model.snap[3]
    assert torch.equal(w2, w3) and torch.equal(step2, step3)  # skipped on the device
    assert model.trainer.precision_plugin.scaler.get_scale() == 2.0**16 * 0.5  # backed off once


def test_memfit_plugin_16_mixed_keeps_the_on_device_skip():
    _check_16_mixed_skip("cpu", "cpu")


def test_memfit_plugin_leaves_other_optimizers_to_lightning():
    """An optimizer without the flag (torch's SGD) is unscaled by Lightning itself,
    once, and clipped: the plugin changes nothing for it."""
    class SGDLit(Lit):
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-2)

    model = SGDLit()
    _trainer(max_steps=3, plugins=[MixedPrecision("16-mixed", "cpu")],
             gradient_clip_val=0.05).fit(model, _loader())
    net = _net()
    opt, scaler = torch.optim.SGD(net.parameters(), lr=1e-2), torch.amp.GradScaler("cpu")
    for x, y in list(_loader())[:3]:
        with torch.autocast("cpu", dtype=torch.float16, cache_enabled=False):
            loss = torch.nn.functional.mse_loss(net(x).float(), y)
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(net.parameters(), 0.05)
        scaler.step(opt)
        scaler.update()
    _assert_params_equal(model.net, net)


def test_model_checkpoint_resume_is_bit_exact(tmp_path):
    # saved at the end of an epoch: Lightning restarts a map-style loader from its
    # first batch on a mid-epoch resume, which would change the data, not the optimizer
    n, m = N_BATCHES, 3
    from pytorch_lightning.callbacks import ModelCheckpoint

    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=n, save_top_k=-1,
                           filename="{step}")
    _fit(n, plugins=[MixedPrecision("bf16-mixed", "cpu")], gradient_clip_val=1.0, callbacks=[ckpt],
         enable_checkpointing=True)
    path = tmp_path / f"step={n}.ckpt"
    assert path.exists(), list(tmp_path.iterdir())

    resumed = Lit()
    trainer = _trainer(max_steps=n + m, plugins=[MixedPrecision("bf16-mixed", "cpu")],
                       gradient_clip_val=1.0)
    trainer.fit(resumed, _loader(), ckpt_path=str(path))
    straight = _fit(n + m, plugins=[MixedPrecision("bf16-mixed", "cpu")], gradient_clip_val=1.0)
    _assert_params_equal(resumed.net, straight.net)
    a, b = resumed.trainer.optimizers[0], straight.trainer.optimizers[0]
    for p, q in zip(resumed.net.parameters(), straight.net.parameters(), strict=True):
        sa, sb = a.state[p], b.state[q]
        assert sa.keys() == sb.keys()
        for k in sa:
            assert torch.equal(sa[k], sb[k]), k
    assert a.param_groups[0]["lr"] == b.param_groups[0]["lr"]


@pytest.mark.cuda
def test_16_mixed_on_gpu_clips_and_keeps_the_on_device_skip():
    _check_16_mixed_skip("gpu", "cuda")
