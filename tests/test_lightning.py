"""PyTorch Lightning with memfit optimizers: configure_optimizers returning an
AdamW8bit with a scheduler, precision="bf16-mixed" on the CPU with gradient_clip_val,
"16-mixed" on a GPU (the scaler's found_inf reaches the kernels: the on-device skip),
and a ModelCheckpoint resumed with trainer.fit(ckpt_path=...) bit-exactly.

Each run is compared with a hand-written loop doing what Lightning documents it does
(autocast without the weight cache, clip_grad_norm_, step, scheduler step per batch):
the parameters must be equal bit for bit, so any step Lightning adds, drops or reorders
shows up.
"""

import pytest

torch = pytest.importorskip("torch")
pl = pytest.importorskip("pytorch_lightning")

import memfit.optim as mo  # noqa: E402

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
    """The loop Lightning runs, written out. Returns (net, optimizer, losses, norms)."""
    net = _net()
    opt, sched = _optimizer(net.parameters())
    losses, norms = [], []
    it = iter(_loader())
    for _ in range(steps):
        x, y = next(it)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed",
                            cache_enabled=False):
            loss = torch.nn.functional.mse_loss(net(x).float(), y)
        losses.append(loss.item())
        opt.zero_grad()
        loss.backward()
        if clip is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(net.parameters(), clip).item())
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


def test_bf16_mixed_with_gradient_clipping_matches_manual_loop():
    """Before: 'AdamW8bit does not allow for gradient clipping because it performs
    unscaling of gradients internally' at the first step."""
    clip = 0.05
    model = _fit(N_BATCHES, precision="bf16-mixed", gradient_clip_val=clip)
    net, _, losses, norms = _manual(N_BATCHES, precision="bf16-mixed", clip=clip)
    assert min(norms) > clip  # every step was clipped: the check below can see it
    _assert_params_equal(model.net, net)
    assert model.losses == losses and losses[-1] < losses[0]
    unclipped, *_ = _manual(N_BATCHES, precision="bf16-mixed")
    assert not torch.equal(unclipped[0].weight, net[0].weight)


def test_model_checkpoint_resume_is_bit_exact(tmp_path):
    # saved at the end of an epoch: Lightning restarts a map-style loader from its
    # first batch on a mid-epoch resume, which would change the data, not the optimizer
    n, m = N_BATCHES, 3
    from pytorch_lightning.callbacks import ModelCheckpoint

    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=n, save_top_k=-1,
                           filename="{step}")
    _fit(n, precision="bf16-mixed", gradient_clip_val=1.0, callbacks=[ckpt],
         enable_checkpointing=True)
    path = tmp_path / f"step={n}.ckpt"
    assert path.exists(), list(tmp_path.iterdir())

    resumed = Lit()
    trainer = _trainer(max_steps=n + m, precision="bf16-mixed", gradient_clip_val=1.0)
    trainer.fit(resumed, _loader(), ckpt_path=str(path))
    straight = _fit(n + m, precision="bf16-mixed", gradient_clip_val=1.0)
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
    """Lightning's scaler: unscale_ (so the clip sees true gradients), clip, then
    scaler.step hands the kernels found_inf (grad_scale None after unscale_), and an
    inf gradient skips the step on the device."""
    seen = []

    class Spy(Lit):
        def configure_optimizers(self):
            cfg = super().configure_optimizers()
            opt = cfg["optimizer"]
            step = opt.step

            def spied(*a, **k):
                seen.append((getattr(opt, "grad_scale", "absent"),
                             getattr(opt, "found_inf", None)))
                return step(*a, **k)

            opt.step = spied
            return cfg

        def on_before_optimizer_step(self, optimizer):
            if self.global_step == 2:  # poison one step's gradients
                self.net[0].weight.grad[0, 0] = float("inf")

    model = Spy()
    before = {}

    class Snap(pl.Callback):
        def on_before_optimizer_step(self, trainer, module, optimizer):
            if trainer.global_step == 2:
                before["w"] = module.net[0].weight.detach().clone()
                before["step"] = optimizer.state[module.net[0].weight]["step"].clone()

        def on_train_batch_end(self, trainer, module, *args):
            if trainer.global_step == 3 and "after" not in before:
                before["after"] = module.net[0].weight.detach().clone()
                before["step_after"] = module.trainer.optimizers[0].state[
                    module.net[0].weight]["step"].clone()

    pl.Trainer(accelerator="gpu", devices=1, precision="16-mixed", gradient_clip_val=1.0,
               max_steps=N_BATCHES, logger=False, enable_progress_bar=False,
               enable_checkpointing=False, enable_model_summary=False,
               callbacks=[Snap()]).fit(model, _loader())
    assert len(seen) == N_BATCHES
    for grad_scale, found_inf in seen:
        assert grad_scale is None and torch.is_tensor(found_inf)  # the fused skip path
    assert torch.equal(before["w"], before["after"])  # skipped on the device
    assert torch.equal(before["step"], before["step_after"])
