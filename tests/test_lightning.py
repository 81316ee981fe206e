"""PyTorch Lightning with memfit optimizers: configure_optimizers returning an
AdamW8bit with a scheduler; the plain configuration, Trainer(precision="bf16-mixed",
gradient_clip_val=1.0), and Lightning's own "16-mixed" plugin with clipping (the
optimizer swap is the only change: torch's scaler unscales, Lightning clips); the
in-kernel scaler path (memfit.amp.GradScaler, or memfit.amp.scale_in_kernel with
memfit's precision plugin) keeping the on-device skip; "16-mixed" on a GPU; and a
ModelCheckpoint resumed with trainer.fit(ckpt_path=...) bit-exactly.

Each run is compared with a hand-written loop doing what Lightning documents it does
(autocast without the weight cache, clip_grad_norm_, step, scheduler step per batch):
the parameters must be equal bit for bit, so any step Lightning adds, drops or reorders
shows up.
"""

import copy

import pytest

torch = pytest.importorskip("torch")
pl = pytest.importorskip("pytorch_lightning")

import memfit.amp  # noqa: E402
import memfit.optim as mo  # noqa: E402
from memfit.amp.lightning import MixedPrecision  # noqa: E402

# Lightning's own plugin: what Trainer(precision="16-mixed"/"bf16-mixed") builds (on the
# CPU Lightning turns precision="16-mixed" into "bf16-mixed", so "16-mixed" on the CPU
# is this class given directly)
LightningMixedPrecision = pl.plugins.precision.MixedPrecision

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


def _total_norm(params):
    return torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None]).item()


class Lit(pl.LightningModule):
    """Records the loss, the gradient norm Lightning's clipping sees (after the
    scaler's unscale, before clipping) and the norm of the gradients the optimizer
    stepped with (at the end of the batch: clipped, unscaled)."""

    def __init__(self, optimizer=None):
        super().__init__()
        self.net = _net()
        self.losses, self.norms, self.stepped_norms = [], [], []
        self.make_optimizer = optimizer or _optimizer

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x).float(), y)
        self.losses.append(loss.item())
        return loss

    def on_before_optimizer_step(self, optimizer):
        self.norms.append(_total_norm(self.parameters()))

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.stepped_norms.append(_total_norm(self.parameters()))

    def configure_optimizers(self):
        opt, sched = self.make_optimizer(self.parameters())
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def _loader():
    return torch.utils.data.DataLoader(_data(), batch_size=BATCH, shuffle=False)


def _trainer(**kw):
    kw.setdefault("enable_checkpointing", False)
    return pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, num_sanity_val_steps=0, **kw)


def _fit(max_steps, optimizer=None, **kw):
    model = Lit(optimizer)
    _trainer(max_steps=max_steps, **kw).fit(model, _loader())
    return model


def _manual(steps, precision=None, clip=None, optimizer=None):
    """The loop Lightning runs, written out (with torch's GradScaler under "16-mixed",
    as Lightning's plugin makes it). Returns (net, optimizer, losses, norms)."""
    net = _net()
    opt, sched = (optimizer or _optimizer)(net.parameters())
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


def _torch_adamw(params):
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))


def _memfit_adamw(params):
    opt = mo.AdamW(params, lr=1e-2, weight_decay=0.01)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))


def _plain(precision):
    """The Trainer arguments of the plain configuration: precision="bf16-mixed" as is;
    "16-mixed" as Lightning's own plugin (what precision="16-mixed" makes on a GPU)."""
    if precision == "16-mixed":
        return dict(plugins=[LightningMixedPrecision("16-mixed", "cpu")])
    return dict(precision=precision)


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_plain_trainer_clips_a_memfit_optimizer(precision):
    """Trainer(precision=..., gradient_clip_val=1.0) with AdamW8bit and no plugin: the
    optimizer swap is the only change. Lightning unscales (16-mixed: torch's scaler,
    its own kernel) and clips; bit for bit the loop torch documents; the gradients
    the optimizer stepped with have norm <= 1 and clipping changed the result."""
    model = _fit(N_BATCHES, gradient_clip_val=1.0, **_plain(precision))
    net, _, losses, norms = _manual(N_BATCHES, precision=precision, clip=1.0)
    assert model.norms == norms  # what Lightning clipped is what the loop clipped
    assert sum(n > 1.0 for n in norms) >= 4  # most steps were clipped: the checks can see it
    assert max(model.stepped_norms) <= 1.0 + 1e-6
    assert all(s == pytest.approx(n) for s, n in zip(model.stepped_norms, norms) if n <= 1.0)
    _assert_params_equal(model.net, net)
    assert model.losses == losses and losses[-1] < losses[0]
    unclipped, *_ = _manual(N_BATCHES, precision=precision)
    assert not torch.equal(unclipped[0].weight, net[0].weight)
    opt = model.trainer.optimizers[0]
    assert isinstance(opt, mo.AdamW8bit) and not hasattr(opt, "grad_scale")
    if precision == "16-mixed":  # the scaler ran (2**16, no overflow in 6 steps)
        assert model.trainer.precision_plugin.scaler.get_scale() == 2.0**16


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_plain_trainer_memfit_adamw_as_torch_adamw(precision):
    """The same plain configuration with memfit's 32-bit AdamW and with torch's AdamW:
    the same clipped norms and parameters (to float32 rounding: the kernels' order of
    operations is not torch's), as the swap of optimizer promises."""
    ours = _fit(N_BATCHES, _memfit_adamw, gradient_clip_val=1.0, **_plain(precision))
    ref = _fit(N_BATCHES, _torch_adamw, gradient_clip_val=1.0, **_plain(precision))
    assert ours.norms[0] == ref.norms[0]  # same weights, same data: the same first gradient
    torch.testing.assert_close(torch.tensor(ours.norms), torch.tensor(ref.norms), rtol=1e-6, atol=0)
    assert max(ours.stepped_norms) <= 1.0 + 1e-6 and sum(n > 1.0 for n in ours.norms) >= 4
    for p, q in zip(ours.net.parameters(), ref.net.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)  # measured: <= 1.5e-7 apart
    torch.testing.assert_close(ours.losses, ref.losses, rtol=1e-5, atol=0)
    assert ours.losses[-1] < ours.losses[0]


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_fabric_clips_a_memfit_optimizer(precision):
    """Fabric reads the same flag (clip_gradients raised NotImplementedError for an
    optimizer with it under "16-mixed"): its plain loop with clip_gradients is the
    hand-written loop, bit for bit."""
    from lightning_fabric import Fabric
    from lightning_fabric.plugins.precision.amp import MixedPrecision as FabricMixedPrecision

    fabric = Fabric(accelerator="cpu", devices=1,
                    plugins=[FabricMixedPrecision(precision, "cpu")])
    net = _net()
    opt, sched = _optimizer(net.parameters())
    model, opt = fabric.setup(net, opt)
    norms = []
    for x, y in _loader():
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
        opt.zero_grad()
        fabric.backward(loss)
        norms.append(fabric.clip_gradients(model, opt, max_norm=1.0).item())
        opt.step()
        sched.step()
    ref, _, _, ref_norms = _manual(N_BATCHES, precision=precision, clip=1.0)
    assert norms == ref_norms and sum(n > 1.0 for n in norms) >= 4
    _assert_params_equal(net, ref)


def _in_kernel_optimizer(params):
    opt, sched = _optimizer(params)
    return memfit.amp.scale_in_kernel(opt), sched


def test_torch_flag_is_unset_unless_opted_in():
    """memfit's optimizers do not set torch's _step_supports_amp_scaling (Lightning
    reads it as "cannot clip"); memfit.amp.scale_in_kernel sets it on one instance,
    and Lightning's own plugin then refuses to clip it, as for torch's fused AdamW,
    while memfit's plugin clips it. Bad arguments are refused by name."""
    from lightning_fabric.plugins.precision.amp import _optimizer_handles_unscaling

    opt = _optimizer(_net().parameters())[0]
    assert _optimizer_handles_unscaling(opt) is False
    assert memfit.amp.scale_in_kernel(opt) is opt
    assert _optimizer_handles_unscaling(opt) is True
    assert _optimizer_handles_unscaling(_optimizer(_net().parameters())[0]) is False  # one instance
    # the instance's setting, not its state's: a copy comes back on the default path
    assert _optimizer_handles_unscaling(copy.deepcopy(opt)) is False
    memfit.amp.scale_in_kernel(opt, enabled=False)
    assert _optimizer_handles_unscaling(opt) is False

    with pytest.raises(RuntimeError, match="does not allow for gradient clipping"):
        _fit(1, _in_kernel_optimizer, precision="bf16-mixed", gradient_clip_val=1.0)
    model = _fit(2, _in_kernel_optimizer, plugins=[MixedPrecision("bf16-mixed", "cpu")],
                 gradient_clip_val=1.0)
    assert max(model.stepped_norms) <= 1.0 + 1e-6
    with pytest.raises(TypeError, match="optimizer: expected a memfit optimizer"):
        memfit.amp.scale_in_kernel(torch.optim.AdamW(_net().parameters()))
    with pytest.raises(TypeError, match="enabled: expected True or False"):
        memfit.amp.scale_in_kernel(opt, enabled=1)


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_memfit_plugin_with_gradient_clipping_matches_manual_loop(precision):
    """memfit's plugin: Lightning's MixedPrecision that unscales (16-mixed) and clips
    an optimizer opted into the in-kernel path; bit for bit the loop torch documents
    (unscale_, clip_grad_norm_, scaler.step) on the default path. (An optimizer
    without the flag goes through Lightning's code: the SGD test below.)"""
    clip = 0.05
    model = _fit(N_BATCHES, _in_kernel_optimizer, plugins=[MixedPrecision(precision, "cpu")],
                 gradient_clip_val=clip)
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

    def __init__(self, optimizer=None):
        super().__init__(optimizer)
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


# the three ways "16-mixed" reaches a memfit optimizer: (Trainer arguments, optimizer)
def _16_mixed(way, accelerator, device):
    if way == "plain":  # torch's scaler unscales, skips on the host
        if accelerator == "gpu":
            return dict(precision="16-mixed"), None
        return dict(plugins=[LightningMixedPrecision("16-mixed", device)]), None
    if way == "memfit_scaler":  # Lightning's plugin with memfit's scaler: in-kernel, automatic
        scaler = memfit.amp.GradScaler(device)
        return dict(plugins=[LightningMixedPrecision("16-mixed", device, scaler=scaler)]), None
    assert way == "scale_in_kernel"  # torch's scaler, opted in; memfit's plugin clips it
    return dict(plugins=[MixedPrecision("16-mixed", device)]), _in_kernel_optimizer


def _check_16_mixed_skip(accelerator, device, way):
    """Under "16-mixed" with gradient_clip_val the gradients are unscaled once (no
    "unscale_() has already been called") and clipped, and the inf gradient skips the
    step: weights and step counter unchanged. On the in-kernel ways the scaler hands
    the kernels found_inf with grad_scale None and the skip happens on the device;
    on the plain way torch's scaler does not call the step at all."""
    trainer_kw, optimizer = _16_mixed(way, accelerator, device)
    model = _Poisoned(optimizer)
    pl.Trainer(accelerator=accelerator, devices=1, gradient_clip_val=1.0, max_steps=N_BATCHES,
               logger=False, enable_progress_bar=False, enable_checkpointing=False,
               enable_model_summary=False, num_sanity_val_steps=0,
               **trainer_kw).fit(model, _loader())
    if way == "plain":
        assert model.seen == [("absent", None)] * (N_BATCHES - 1)  # step 2 never called
    else:
        assert len(model.seen) == N_BATCHES
        for grad_scale, found_inf in model.seen:
            assert grad_scale is None and torch.is_tensor(found_inf)  # the in-kernel skip path
        assert [bool(f) for _, f in model.seen] == [False, False, True, False, False, False]
    (w2, step2), (w3, step3) = model.snap[2], model.snap[3]
    assert torch.equal(w2, w3) and torch.equal(step2, step3)  # skipped
    assert int(step3) == 2
    assert max(n for i, n in enumerate(model.stepped_norms) if i != 2) <= 1.0 + 1e-6  # clipped
    assert model.trainer.precision_plugin.scaler.get_scale() == 2.0**16 * 0.5  # backed off once


@pytest.mark.parametrize("way", ["plain", "memfit_scaler", "scale_in_kernel"])
def test_16_mixed_clips_and_skips_inf_steps(way):
    _check_16_mixed_skip("cpu", "cpu", way)


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
    _fit(n, precision="bf16-mixed", gradient_clip_val=1.0, callbacks=[ckpt], enable_checkpointing=True)
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
@pytest.mark.parametrize("way", ["plain", "memfit_scaler", "scale_in_kernel"])
def test_16_mixed_on_gpu_clips_and_skips_inf_steps(way):
    """On a GPU the plain way is Trainer(precision="16-mixed") itself."""
    _check_16_mixed_skip("gpu", "cuda", way)
