"""The memory estimator: parameter counts against published numbers and real modules,
the activation formula against Korthikanti et al. and against bytes measured with
saved-tensor hooks, recommendations, and the `memfit estimate` command."""

import json
import os
import subprocess
import sys

import pytest

import memfit.memory as M

torch = pytest.importorskip("torch")
from memfit.models import GPT, GPTConfig  # noqa: E402
from memfit.profile import profile_steps  # noqa: E402

PUBLISHED = {  # parameter counts of the reference implementations
    "gpt2": 124_439_808, "gpt2-medium": 354_823_168, "gpt2-large": 774_030_080, "gpt2-xl": 1_557_611_200,
    "roberta-base": 124_645_632, "roberta-large": 355_359_744,
    "llama-7b": 6_738_415_616, "llama-1b": 1_235_814_400,
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_parameter_counts(name):
    assert M.PRESETS[name].n_params() == PUBLISHED[name]


def spec_of(cfg: GPTConfig) -> M.ModelSpec:
    return M.ModelSpec("test", cfg.n_layer, cfg.d_model, cfg.n_head, cfg.vocab, d_ff=cfg.d_ff or 0,
                       max_pos=cfg.max_pos, dropout=cfg.dropout > 0)


@pytest.mark.parametrize("cfg", [GPTConfig(2, 64, 4, 256, 128), GPTConfig(3, 96, 3, 1000, 64, d_ff=200)])
def test_formula_counts_real_module_parameters(cfg):
    model = GPT(cfg)
    assert spec_of(cfg).n_params() == sum(p.numel() for p in model.parameters())
    with torch.device("meta"):
        meta = GPT(cfg)
    assert M.from_module(meta).n_params() == spec_of(cfg).n_params()


def test_hf_configs():
    gpt2 = {"model_type": "gpt2", "n_layer": 12, "n_embd": 768, "n_head": 12, "vocab_size": 50257,
            "n_positions": 1024, "activation_function": "gelu_new", "attn_pdrop": 0.1}
    assert M.from_hf_config(gpt2).n_params() == PUBLISHED["gpt2"]
    llama = {"model_type": "llama", "num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
             "num_key_value_heads": 32, "intermediate_size": 11008, "vocab_size": 32000, "hidden_act": "silu",
             "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "max_position_embeddings": 4096,
             "rope_theta": 10000.0}
    assert M.from_hf_config(llama).n_params() == PUBLISHED["llama-7b"]
    roberta = {"model_type": "roberta", "num_hidden_layers": 12, "hidden_size": 768, "num_attention_heads": 12,
               "intermediate_size": 3072, "vocab_size": 50265, "max_position_embeddings": 514,
               "type_vocab_size": 1, "hidden_act": "gelu"}
    assert M.from_hf_config(roberta).n_params() == PUBLISHED["roberta-base"]
    with pytest.raises(ValueError, match="needs num_hidden_layers"):
        M.from_hf_config({"model_type": "x"})


def test_activation_formula_reduces_to_korthikanti():
    # GPT-2 layout, dropout, eager attention, 16-bit everything, on a GPU: the paper's
    # s*b*h*(34 + 5*a*s/h) per layer (plus 16 bytes/token of norm statistics).
    spec = M.PRESETS["gpt2"]
    s, b, h, a = 1024, 4, 768, 12
    acts = M.activation_bytes(spec, M.Setup(batch=b, seq=s, precision="bf16-pure", attention="eager"))
    assert acts["per_layer"] == s * b * h * 34 + 5 * a * s * s * b + 16 * s * b


CASES = [  # attention, dropout, autocast dtype
    ("sdpa", 0.0, None), ("eager", 0.0, None), ("eager", 0.1, None), ("sdpa", 0.1, None),
    ("sdpa", 0.0, torch.bfloat16), ("eager", 0.0, torch.bfloat16), ("eager", 0.1, torch.bfloat16),
]


@pytest.mark.parametrize("attention,dropout,amp", CASES)
def test_estimate_agrees_with_measurement(attention, dropout, amp):
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=3, d_model=96, n_head=4, vocab=300, max_pos=64, dropout=dropout, attention=attention)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters())
    b, s = 3, 64

    def batches():
        x = torch.randint(0, cfg.vocab, (b, s))
        return x, x

    measured = profile_steps(model, opt, batches, lambda m, x, y: m(x, y)[1], steps=1, autocast_dtype=amp)
    est = M.estimate(spec_of(cfg), M.Setup(batch=b, seq=s, attention=attention, gpu=False,
                                           precision="bf16" if amp else "fp32"))
    assert measured["params"] == est.weights
    assert measured["gradients"] == est.gradients
    assert abs(measured["optimizer"] - est.optimizer) <= 8 * len(list(model.parameters()))  # step counters
    assert abs(est.activations / measured["activations"] - 1) < 0.10, (est.activations, measured["activations"])


def test_checkpointing_and_optimizers_shrink_their_component():
    spec, base = M.PRESETS["gpt2-medium"], M.Setup(batch=8, seq=1024)
    plain = M.estimate(spec, base)
    every = M.estimate(spec, M.replace(base, checkpoint="every"))
    sqrt = M.estimate(spec, M.replace(base, checkpoint="sqrt"))
    assert every.activations < sqrt.activations < plain.activations
    eight = M.estimate(spec, M.replace(base, optimizer="adamw8bit"))
    # biases and norms (1-D) keep float32 states: a small share of gpt2-medium
    p, v = spec.n_params(), spec.vector_params()
    assert 0 < v < 0.002 * p
    assert eight.optimizer / plain.optimizer == pytest.approx(((p - v) * 2.03125 + v * 8) / (8 * p), rel=1e-6)
    half = M.estimate(spec, M.replace(base, micro_batch=4))
    assert half.activations < plain.activations and half.weights == plain.weights


def test_kahan_buffer_counted_for_pure_bf16():
    """kahan=True adds the bf16 compensation buffer (2 B/param) to the optimizer states of
    a pure-bf16 setting, nothing where the weights are float32; and the count matches
    the bytes memfit's AdamW8bit(kahan=True) holds on a real bf16 model."""
    spec = M.PRESETS["gpt2"]
    base = M.Setup(batch=8, seq=1024, precision="bf16-pure", optimizer="adamw8bit")
    plain, kahan = M.estimate(spec, base), M.estimate(spec, M.replace(base, kahan=True))
    assert kahan.optimizer - plain.optimizer == 2 * spec.n_params()
    assert kahan.total - plain.total == 2 * spec.n_params()
    for prec in ("fp32", "bf16", "fp16"):
        other = M.replace(base, precision=prec)
        assert M.estimate(spec, M.replace(other, kahan=True)).optimizer == M.estimate(spec, other).optimizer

    import memfit.optim as mo
    from memfit.profile import state_bytes

    cfg = GPTConfig(n_layer=2, d_model=256, n_head=4, vocab=512, max_pos=64)
    model = GPT(cfg).to(torch.bfloat16)
    params = list(model.parameters())
    opt = mo.AdamW8bit(params, kahan=True, min_8bit_size=0)
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()
    est = M.estimate(spec_of(cfg), M.Setup(batch=1, seq=64, precision="bf16-pure", optimizer="adamw8bit",
                                           kahan=True, gpu=False))
    # per tensor: a 4-byte step counter and a partial last absmax block the formula spreads out
    assert abs(state_bytes(opt) - est.optimizer) <= 12 * len(params), (state_bytes(opt), est.optimizer)
    assert sum(s["kahan_comp"].numel() * 2 for s in opt.state.values()) == 2 * spec_of(cfg).n_params()

    js = run_cli("estimate", "gpt2", "--json", "--precision", "bf16-pure", "--optimizer", "adamw8bit", "--kahan")
    data = json.loads(js.stdout)
    assert data["setting"]["optimizer"] == kahan.optimizer and data["setting"]["setup"]["kahan"] is True
    assert "Kahan" in data["rows"][-1]["label"]


def test_recommendation_fits_and_is_none_when_impossible():
    spec, base = M.PRESETS["gpt2-xl"], M.Setup(batch=8, seq=1024)
    setting, est, slow = M.recommend(spec, base, "a10")
    assert est.total <= M.parse_gpu("a10")[0]
    assert setting.precision in ("bf16", "bf16-pure") and slow >= 0
    heavy = M.recommend(spec, base, "t4")  # fits a T4 only with everything turned on
    assert heavy is not None and heavy[0].checkpoint != "none" and heavy[0].micro < 8
    assert M.recommend(M.PRESETS["llama-7b"], base, "t4") is None  # weights + grads alone exceed it
    t4 = M.recommend(M.PRESETS["gpt2"], base, "t4")
    assert t4 is not None and t4[0].precision == "fp16"  # no native bf16 on a T4
    with pytest.raises(ValueError, match="gpu: expected"):
        M.parse_gpu("tpu")
    assert M.parse_gpu("24GB")[0] == 24 * M.GB


def run_cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "memfit", *args], capture_output=True, text=True, env=env)


def test_comparison_in_fp32_has_no_autocast_row():
    """A CPU that would emulate bf16: the techniques without autocast, combined in fp32."""
    spec, base = M.PRESETS["gpt2"], M.Setup(batch=4, seq=512, gpu=False)
    rows = M.comparison(spec, base, half="fp32")
    labels = [label for label, _ in rows]
    assert labels == ["baseline (fp32, AdamW)", "+ AdamW8bit", "+ checkpoint every layer",
                      "memfit (fp32 + AdamW8bit + checkpoint)"]
    combo = rows[-1][1]
    assert combo.setup.precision == "fp32" and combo.setup.optimizer == "adamw8bit"
    assert combo.total < min(est.total for _, est in rows[:-1])
    assert combo.weights == rows[0][1].weights  # fp32 weights, as in the baseline
    bf16 = dict(M.comparison(spec, base, half="bf16"))
    assert "+ bf16 autocast" in bf16 and bf16["+ bf16 autocast"].setup.precision == "bf16"
    assert [label for label, _ in M.comparison(spec, base, bf16_native=True)] == list(bf16)
    with pytest.raises(ValueError, match="half: expected"):
        M.comparison(spec, base, half="int8")


@pytest.mark.parametrize("forced", [None, "fp32", "bf16"])
def test_cli_estimate_cpu_follows_cpu_precision(forced):
    """The --cpu rows follow the CPU precision the command chose. Unforced, each process
    times the two precisions itself (hardware.cpu_precision), and on a busy machine two
    processes can measure either side of the threshold: so each output is checked
    against the choice it reports, and only the forced runs against a fixed answer."""
    import re

    from memfit.hardware import ENV_PRECISION

    env = {k: v for k, v in os.environ.items() if k != ENV_PRECISION}
    if forced:
        env[ENV_PRECISION] = forced
    last_row = {"bf16": "memfit (bf16-pure + AdamW8bit + checkpoint)",
                "fp32": "memfit (fp32 + AdamW8bit + checkpoint)"}
    data = json.loads(run_cli("estimate", "gpt2", "--cpu", "--json", env=env).stdout)
    chosen = data["cpu_precision"]["precision"]
    assert chosen == (forced or chosen) and chosen in last_row and data["cpu_precision"]["reason"]
    labels = [r["label"] for r in data["rows"]]
    assert ("+ bf16 autocast" in labels) == (chosen == "bf16")
    assert labels[-1] == last_row[chosen]
    text = run_cli("estimate", "gpt2", "--cpu", env=env)
    assert text.returncode == 0, text.stderr
    said = re.search(r"CPU precision: (\w+): ", text.stdout)
    assert said and said.group(1) == (forced or said.group(1)) and said.group(1) in last_row
    assert last_row[said.group(1)] in text.stdout
    assert last_row["fp32" if said.group(1) == "bf16" else "bf16"] not in text.stdout
    # without --cpu the GPU rows are unchanged (bf16 unless the GPU lacks it)
    assert "cpu_precision" not in json.loads(run_cli("estimate", "gpt2", "--json", env=env).stdout)


def test_cli_estimate_text_and_json():
    out = run_cli("estimate", "gpt2", "--gpu", "t4")
    assert out.returncode == 0, out.stderr
    assert "baseline (fp32, AdamW)" in out.stdout and "Fits t4" in out.stdout
    js = run_cli("estimate", "gpt2-medium", "--gpu", "16GB", "--json", "--precision", "bf16")
    data = json.loads(js.stdout)
    assert data["params"] == PUBLISHED["gpt2-medium"]
    assert data["rows"][0]["total"] == sum(data["rows"][0][k] for k in
                                          ("weights", "gradients", "optimizer", "activations", "temporary"))
    assert "setting" in data and "recommendation" in data


@pytest.mark.parametrize("args,msg", [
    (("estimate", "no-such-model"), "model: expected a preset"),
    (("estimate", "gpt2", "--gpu", "tpu"), "gpu: expected"),
    (("estimate", "gpt2", "--optimizer", "adafactor"), "optimizer: expected one of"),
    (("estimate", "gpt2", "--micro-batch", "16"), "micro_batch: must be between 1 and batch"),
    (("estimate", "gpt2", "--batch", "x"), "--batch: expected an integer, got 'x'"),
])
def test_cli_estimate_bad_arguments(args, msg):
    out = run_cli(*args)
    assert out.returncode == 2
    assert msg in out.stderr


def test_muon_state_bytes_hand_computed_and_measured():
    """--optimizer muon8bit / muon: the hidden matrices at Muon's bytes (8-bit momentum +
    one float32 absmax per 256, or float32), the rest at AdamW8bit's / AdamW's (1-D
    tensors at 8 B); by hand for gpt2, and against the storages a real Muon8bit / Muon
    holds after a step on a small GPT split by muon_param_groups."""
    spec = M.PRESETS["gpt2"]
    hidden = 12 * (3 * 768 * 768 + 768 * 768 + 2 * 768 * 3072)  # c_attn, c_proj, c_fc, mlp_proj
    vectors = 12 * (4 * 768 + 3 * 768 + 768 + 3072 + 768) + 2 * 768  # ln_1/2, biases; ln_f
    embeddings = 50257 * 768 + 1024 * 768  # wte (tied head), wpe
    assert hidden + vectors + embeddings == PUBLISHED["gpt2"]
    base = M.Setup(batch=8, seq=1024, precision="fp32")
    muon8 = M.estimate(spec, M.replace(base, optimizer="muon8bit")).optimizer
    assert muon8 == int(hidden * (1 + 4 / 256) + embeddings * (2 + 8 / 256) + vectors * 8)
    assert M.estimate(spec, M.replace(base, optimizer="muon")).optimizer == hidden * 4 + (embeddings + vectors) * 8
    # about 1 byte per hidden-matrix parameter against AdamW8bit's 2.03
    adamw8 = M.estimate(spec, M.replace(base, optimizer="adamw8bit")).optimizer
    assert adamw8 - muon8 == pytest.approx(hidden * (2 + 8 / 256 - 1 - 4 / 256))
    # no known split for a model given by its parameter count: all of it at AdamW's bytes
    counted = M.replace(spec, params_override=spec.n_params())
    assert M.estimate(counted, M.replace(base, optimizer="muon8bit")).optimizer == \
        M.estimate(counted, M.replace(base, optimizer="adamw8bit")).optimizer

    import memfit.optim as mo
    from memfit.profile import state_bytes

    cfg = GPTConfig(n_layer=2, d_model=256, n_head=4, vocab=512, max_pos=64)
    for cls, name in ((mo.Muon8bit, "muon8bit"), (mo.Muon, "muon")):
        torch.manual_seed(0)
        model = GPT(cfg)
        params = list(model.parameters())
        opt = cls(mo.muon_param_groups(model, lr=1e-3), lr=0.02)
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
        est = M.estimate(spec_of(cfg), M.Setup(batch=1, seq=64, optimizer=name, gpu=False))
        # every storage the states hold, counted once; plus each tensor's float32 step
        assert state_bytes(opt) == est.optimizer + 4 * len(params), (name, state_bytes(opt), est.optimizer)

    out = run_cli("estimate", "gpt2", "--json", "--precision", "fp32", "--optimizer", "muon8bit")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["setting"]["optimizer"] == muon8


_STATE_CLASSES = {  # OPTIMIZER_BYTES name: memfit.optim class, its arguments
    "adamw8bit": ("AdamW8bit", {}), "adamw": ("AdamW", {}), "adamw4bit": ("AdamW4bit", {}),
    "lion8bit": ("Lion8bit", {}), "sgd8bit": ("SGD8bit", dict(momentum=0.9)),
    "rmsprop8bit": ("RMSprop8bit", {}), "adagrad8bit": ("Adagrad8bit", {}), "adagrad": ("Adagrad", {}),
    "lamb8bit": ("LAMB8bit", {}), "lamb": ("LAMB", {}), "lars8bit": ("LARS8bit", dict(momentum=0.9)),
    "lars": ("LARS", dict(momentum=0.9)), "ademamix8bit": ("AdEMAMix8bit", {}), "ademamix": ("AdEMAMix", {}),
}


@pytest.mark.parametrize("name", sorted(_STATE_CLASSES))
def test_state_bytes_match_the_optimizers_storages(name):
    """Every --optimizer name of a memfit class: the estimate's optimizer bytes are the
    storages the class holds after a step on a small GPT (1-D tensors at the 32-bit
    form's bytes, as the 8-bit classes keep them), plus each tensor's float32 step."""
    import memfit.optim as mo
    from memfit.profile import state_bytes

    cls_name, kwargs = _STATE_CLASSES[name]
    cfg = GPTConfig(n_layer=2, d_model=256, n_head=4, vocab=512, max_pos=64)
    torch.manual_seed(0)
    model = GPT(cfg)
    params = list(model.parameters())
    opt = getattr(mo, cls_name)(params, lr=1e-3, **kwargs)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    est = M.estimate(spec_of(cfg), M.Setup(batch=1, seq=64, optimizer=name, gpu=False))
    assert state_bytes(opt) == est.optimizer + 4 * len(params), (name, state_bytes(opt), est.optimizer)
