"""The command line: every subcommand runs, prints what it says, writes its files,
and answers bad arguments with a usage error (exit 2) that names the problem."""

import json
import os
import sys

import pytest

import proc_util

pytest.importorskip("torch")


def run(*args, cwd=None, env=None):
    return proc_util.run([sys.executable, "-m", "memfit", *args], capture_output=True, text=True, cwd=cwd,
                          env=env)


def check_demo(stdout: str, out, want: str, steps: int):
    """What the demo printed and wrote, for a memfit way in precision `want`."""
    assert "| baseline | fp32 | AdamW | none |" in stdout
    assert f"| memfit | {want} | AdamW8bit |" in stdout
    assert f"memfit way's precision: {want} (" in stdout
    data = json.loads((out / "demo.json").read_text())
    assert data["precision"] == want and data["precision_reason"]
    assert data["cpu"]["model_name"] and data["cpu_kernels"]
    base, mf = data["rows"]
    total = lambda r: r["params_bytes"] + r["grads_bytes"] + r["optimizer_bytes"] + r["activation_bytes"]  # noqa: E731
    assert total(mf) < total(base)
    assert mf["optimizer_bytes"] < base["optimizer_bytes"] / 3  # 8-bit states
    assert mf["activation_bytes"] < base["activation_bytes"]  # checkpointing + bf16
    assert len(base["losses"]) == steps and all(l > 0 for l in base["losses"])
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "recipes.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # memfit.recipes, estimated
    assert "recipes.png (memfit estimate llama-1b --gpu t4 --host-memory colab" in stdout
    return total(mf) / total(base)


def test_demo_runs_and_measures(tmp_path):
    """The demo as a user runs it: the memfit way trains in the precision memfit measured
    faster for this GPT on this CPU (memfit.hardware: a few fp32 and bf16-autocast steps
    before training) and saves the same share of memory either way (about a third of the
    baseline's: in fp32 the planner checkpoints to half the share,
    profile.checkpoint_budget)."""
    from memfit.hardware import ENV_PRECISION

    env = {k: v for k, v in os.environ.items() if k != ENV_PRECISION}
    out = run("demo", "--steps", "6", "--out", str(tmp_path / "d"), env=env)
    assert out.returncode == 0, out.stderr
    chosen = json.loads((tmp_path / "d" / "demo.json").read_text())["precision"]
    assert chosen in ("bf16", "fp32")
    assert check_demo(out.stdout, tmp_path / "d", chosen, 6) < 0.35
    assert "a training step of this GPT (6 layers, d_model 128, batch 16 x 128, checkpointed to each precision's " \
           "budget) took " in out.stdout


@pytest.mark.parametrize("speedup,want", [(1 / 1.33, "fp32"), (1.6, "bf16")])
def test_demo_precision_follows_its_models_measurement(speedup, want, tmp_path, monkeypatch, capsys):
    """The demo times its own GPT (precision_step) and trains the memfit way in the
    precision that measurement picks; the measurement is injected (no timing asserted),
    but its step is run both ways, as the real measurement runs it."""
    from memfit import cli, demo, hardware

    monkeypatch.setitem(demo.SIZES, "cpu", (dict(n_layer=2, d_model=64, n_head=2), 8, 64, 200))
    monkeypatch.setattr(hardware, "cpu_info", lambda: {"bf16_features": ["amx-bf16"], "model_name": "test CPU"})
    asked = []

    def measured(step=None, what=None):
        step(False)
        step(True)
        asked.append(what)
        return speedup

    monkeypatch.setattr(hardware, "measure_bf16_speedup", measured)
    assert cli.main(["demo", "--steps", "5", "--device", "cpu", "--out", str(tmp_path / "d")]) == 0
    what = "this GPT (2 layers, d_model 64, batch 8 x 64, checkpointed to each precision's budget)"
    assert asked == [what]
    stdout = capsys.readouterr().out
    check_demo(stdout, tmp_path / "d", want, 5)
    line = next(l for l in stdout.splitlines() if l.startswith("memfit way's precision"))
    assert f"a training step of {what} took {1 / speedup:.2f}x the float32 time under bf16 autocast here" in line


def test_demo_forced_bf16(tmp_path, monkeypatch, capsys):
    """The bf16 path on every CPU (forced; emulated, so slow, where the CPU has no native
    bf16): the demo's command in this process, on a GPT a few times smaller in every
    dimension than the demo's."""
    from memfit import cli, demo
    from memfit.hardware import ENV_PRECISION

    monkeypatch.setenv(ENV_PRECISION, "bf16")
    monkeypatch.setitem(demo.SIZES, "cpu", (dict(n_layer=2, d_model=64, n_head=2), 8, 64, 200))
    assert cli.main(["demo", "--steps", "6", "--out", str(tmp_path / "d")]) == 0
    check_demo(capsys.readouterr().out, tmp_path / "d", "bf16", 6)


def test_profile_json_agrees_with_estimate(tmp_path):
    out = run("profile", "--steps", "2", "--configs", "baseline,adamw8bit,autocast", "--layers", "1",
              "--d-model", "64", "--heads", "2", "--seq", "32", "--batch", "2", "--json", "--out", str(tmp_path))
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)["rows"]
    assert [r["name"] for r in rows] == ["baseline", "adamw8bit", "autocast"]
    for r in rows:
        measured = r["params_bytes"] + r["grads_bytes"] + r["optimizer_bytes"] + r["activation_bytes"]
        assert abs(r["estimated_bytes"] / measured - 1) < 0.10, r["name"]
    assert (tmp_path / "profile.png").exists() and (tmp_path / "profile.json").exists()


@pytest.mark.parametrize("args,msg", [
    (("profile", "--configs", "nope"), "unknown configuration 'nope'"),
    (("profile", "--model", "llama-7b"), "only GPT-2-style presets"),
    (("profile", "--module", "no_colon"), "expected 'package.module:function'"),
    (("profile", "--steps", "1"), "steps: need at least 2"),
    (("demo", "--steps", "2"), "steps: need at least 5"),
    (("demo", "--device", "tpu"), "invalid choice"),
])
def test_bad_arguments(args, msg, tmp_path):
    out = run(*args, "--out", str(tmp_path))
    assert out.returncode == 2
    assert msg in out.stderr


def test_no_command_is_a_usage_error():
    out = run()
    assert out.returncode == 2 and "usage:" in out.stderr


def test_demo_without_torch_says_how_to_get_it(monkeypatch, capsys):
    import importlib.util

    from memfit import cli

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torch" else real(name, *a))
    assert cli.main(["demo"]) == 2
    assert 'pip install "memfit[torch]"' in capsys.readouterr().err


# ---- every command's numeric and path options (issue 24 §6) ---------------------------------

def cli_error(capsys, *args):
    """Runs the CLI in this process; returns its stderr, asserting an argparse-style
    error: exit status 2, no traceback, the last line saying what is wrong."""
    from memfit import cli

    try:
        rc = cli.main(list(args))
    except SystemExit as e:  # argparse's own errors
        rc = e.code
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("memfit") and ": error: " in last, err
    return last


@pytest.mark.parametrize("args,msg", [
    (("estimate", "gpt2", "--gpu=infGB"), "gpu: the memory size must be a finite number of GB > 0, got 'infGB'"),
    (("estimate", "gpt2", "--gpu=-1GB"), "gpu: the memory size must be a finite number of GB > 0, got '-1GB'"),
    (("estimate", "gpt2", "--gpu=nanGB"), "got 'nanGB'"),
    (("estimate", "gpt2", "--gpu=1e400GB"), "got '1e400GB'"),
    (("estimate", "gpt2", "--micro-batch", "0"), "argument --micro-batch: need at least 1, got 0"),
    (("estimate", "gpt2", "--micro-batch", "16"), "micro_batch: must be between 1 and batch"),
    (("estimate", "gpt2", "--batch", "0"), "argument --batch: need at least 1, got 0"),
    (("estimate", "gpt2", "--seq", "-4"), "argument --seq: need at least 1, got -4"),
    (("estimate", "no-such-model"), "model: expected a preset"),
    (("profile", "--heads", "0"), "argument --heads: need at least 1, got 0"),
    (("profile", "--seq", "-4"), "argument --seq: need at least 1, got -4"),
    (("profile", "--layers", "0"), "argument --layers: need at least 1, got 0"),
    (("profile", "--d-model", "0"), "argument --d-model: need at least 1, got 0"),
    (("profile", "--batch", "0"), "argument --batch: need at least 1, got 0"),
    (("profile", "--steps", "x"), "argument --steps: expected an integer, got 'x'"),
    (("profile", "--seed", "-1"), "argument --seed: need at least 0, got -1"),
    (("profile", "--configs", ","), "configs: expected at least one of"),
    (("profile", "--module", "nonexistent_memfit_module:fn"),
     "module: cannot import 'nonexistent_memfit_module' (No module named 'nonexistent_memfit_module')"),
    (("profile", "--module", "json:no_such_function"), "module: 'json' has no function 'no_such_function'"),
    (("demo", "--steps", "0"), "argument --steps: need at least 5, got 0"),
    (("demo", "--seed", str(2**64)), "argument --seed: must be at most 18446744073709551615, got 18446744073709551616"),
])
def test_bad_numbers_and_names_are_one_line_errors(args, msg, capsys, tmp_path):
    assert msg in cli_error(capsys, *args, *(("--out", str(tmp_path)) if args[0] != "estimate" else ()))


@pytest.mark.parametrize("command", ["demo", "profile"])
def test_device_cuda_without_a_gpu_is_a_one_line_error(command, capsys, tmp_path):
    import torch

    import memfit

    if torch.cuda.is_available() and memfit.build_info()["cuda"] and memfit.cuda_device_count():
        pytest.skip("a usable GPU is present: --device cuda is valid here")
    last = cli_error(capsys, command, "--device", "cuda", "--out", str(tmp_path))
    assert "device: --device cuda needs a CUDA GPU" in last and "--device cpu" in last


@pytest.mark.parametrize("command", ["demo", "profile"])
def test_unwritable_out_is_a_one_line_error_before_any_training(command, capsys, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    last = cli_error(capsys, command, "--device", "cpu", "--out", str(blocker / "sub"))
    assert f"out: cannot write to the folder {str(blocker / 'sub')!r}" in last and "--out" in last
    assert "[1/" not in capsys.readouterr().err  # nothing ran


@pytest.mark.parametrize("config,msg", [
    ({"num_attention_heads": 0}, "config: num_attention_heads: need at least 1, got 0"),
    ({"hidden_size": -768}, "config: hidden_size: need at least 1, got -768"),
    ({"vocab_size": "many"}, "config: vocab_size: expected an integer, got 'many'"),
    ({"num_key_value_heads": 5}, "config: num_key_value_heads: must divide"),
    ([1, 2], "config: expected a JSON object of model settings, got list"),
])
def test_estimate_bad_config_is_a_one_line_error(config, msg, capsys, tmp_path):
    base = {"num_hidden_layers": 2, "hidden_size": 768, "num_attention_heads": 12, "vocab_size": 1000}
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**base, **config} if isinstance(config, dict) else config))
    assert msg in cli_error(capsys, "estimate", str(path))


def test_estimate_unreadable_or_broken_config(capsys, tmp_path):
    path = tmp_path / "config.json"
    path.write_text("{not json")
    assert "is not valid JSON" in cli_error(capsys, "estimate", str(path))


def test_demo_api_refuses_zero_steps():
    from memfit import demo

    with pytest.raises(ValueError, match="steps: need at least 5"):
        demo.main(steps=0, device="cpu")


# ---- hostile values (issue 31 §6): one line, naming the option or the field, exit 2 ----------

HUGE = "9" * 400  # converts to no float; 5000 digits is past what int() converts


@pytest.mark.parametrize("args,msg", [
    (("estimate", "gpt2", "--batch", HUGE), "argument --batch: must be at most 281474976710656, got a number with 400 digits"),
    (("estimate", "gpt2", "--seq", HUGE), "argument --seq: must be at most 281474976710656, got a number with 400 digits"),
    (("estimate", "gpt2", "--seq", "-" + HUGE), "argument --seq: need at least 1, got a negative number with 400 digits"),
    (("estimate", "gpt2", "--seq", "9" * 5000), "argument --seq: must be at most 281474976710656, got a number with 5000 digits"),
    (("estimate", "gpt2", "--micro-batch", HUGE), "argument --micro-batch: must be at most"),
    (("estimate", "gpt2", "--gpu", ""), "gpu: expected one of t4,"),
    (("estimate", "gpt2", "--gpu", "1e-12GB"), "gpu: the memory size must be a finite number of GB > 0"),
    (("estimate", "x" * 5000), "model: expected a preset"),
    (("profile", "--d-model", HUGE), "argument --d-model: must be at most"),
    (("profile", "--layers", HUGE), "argument --layers: must be at most"),
    (("profile", "--steps", HUGE), "argument --steps: must be at most"),
    (("demo", "--steps", HUGE), "argument --steps: must be at most"),
    (("demo", "--seed", HUGE), "argument --seed: must be at most 18446744073709551615"),
    (("profile", "--d-model", "1000000000", "--device", "cpu"),
     "configs: baseline would need about"),
])
def test_hostile_numbers_are_one_line_errors(args, msg, capsys, tmp_path):
    last = cli_error(capsys, *args, *(("--out", str(tmp_path)) if args[0] != "estimate" else ()))
    assert msg in last
    assert len(last) < 300  # a 400-digit number is not echoed


def test_estimate_gpu_size_boundary(capsys):
    """The smallest and largest sizes are taken: the limit is not off by one."""
    from memfit import cli

    assert cli.main(["estimate", "gpt2", "--batch", "1", "--seq", "1", "--json"]) == 0
    assert cli.main(["estimate", "gpt2", "--batch", str(2**48), "--micro-batch", "1", "--json"]) == 0
    data = json.loads(capsys.readouterr().out.split("\n}\n")[1] + "\n}")
    assert data["rows"][0]["setup"]["batch"] == 2**48 and data["rows"][0]["total"] > 0
    assert "at most 281474976710656, got 281474976710657" in cli_error(
        capsys, "estimate", "gpt2", "--batch", str(2**48 + 1))


DEEP = "[" * 100_000 + "]" * 100_000


@pytest.mark.parametrize("config,msg", [
    ({"intermediate_size": [1]}, "config: intermediate_size: expected an integer, got [1]"),
    ({"intermediate_size": "3072"}, "config: intermediate_size: expected an integer, got '3072'"),
    ({"intermediate_size": 1.5}, "config: intermediate_size: expected an integer, got 1.5"),
    ({"intermediate_size": -5}, "config: intermediate_size: need at least 0, got -5"),
    ({"vocab_size": 10**400}, "config: vocab_size: must be at most 281474976710656, got a number with 401 digits"),
    ({"vocab_size": 1e300}, "config: vocab_size: must be at most 281474976710656, got 1e+300"),
    ({"vocab_size": True}, "config: vocab_size: expected an integer, got True"),
    ({"n_layer": -2, "num_hidden_layers": None}, "config: n_layer: need at least 1, got -2"),
    ({"max_position_embeddings": -100}, "config: max_position_embeddings: need at least 0, got -100"),
    ({"max_position_embeddings": False}, "config: max_position_embeddings: expected an integer, got False"),
    ({"num_key_value_heads": -4}, "config: num_key_value_heads: need at least 0, got -4"),
    ({"model_type": "bert", "type_vocab_size": "x"}, "config: type_vocab_size: expected an integer, got 'x'"),
    ({"attention_dropout": "x"}, "config: attention_dropout: must be a probability from 0 to 1, got 'x'"),
    ({"attn_pdrop": 2.0}, "config: attn_pdrop: must be a probability from 0 to 1, got 2.0"),
    ({"hidden_act": [1]}, "config: hidden_act: must be a string, got [1]"),
    ({"model_type": 5}, "config: model_type: must be a string, got 5"),
    ({"tie_word_embeddings": "false"}, "config: tie_word_embeddings: must be true or false, got 'false'"),
    ({"bias": 1}, "config: bias: must be true or false, got 1"),
])
def test_estimate_hostile_config_fields(config, msg, capsys, tmp_path):
    base = {"num_hidden_layers": 2, "hidden_size": 768, "num_attention_heads": 12, "vocab_size": 1000}
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**base, **config}))
    assert msg in cli_error(capsys, "estimate", str(path))


@pytest.mark.parametrize("text,msg", [
    (DEEP, "is nested too deeply to be a config.json"),  # RecursionError in json
    ('{"vocab_size": 1e400, "num_hidden_layers": 2, "hidden_size": 8, "num_attention_heads": 2}',
     "config: vocab_size: expected an integer, got inf"),
    (b"\xff\xfe\x00", "is not valid JSON"),
])
def test_estimate_hostile_config_files(text, msg, capsys, tmp_path):
    path = tmp_path / "config.json"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    assert msg in cli_error(capsys, "estimate", str(path))


def test_negative_sizes_are_refused_by_the_api_too():
    """Not negative parameter counts: memory.Setup and from_hf_config refuse them."""
    from memfit import memory as M

    with pytest.raises(ValueError, match="batch: need at least 1, got -8"):
        M.estimate(M.PRESETS["gpt2"], M.Setup(batch=-8))
    with pytest.raises(ValueError, match="micro_batch: need at least 1, got -1"):
        M.estimate(M.PRESETS["gpt2"], M.Setup(micro_batch=-1))
    with pytest.raises(ValueError, match="config: n_inner: need at least 0, got -3072"):
        M.from_hf_config({"n_layer": 2, "n_embd": 768, "n_head": 12, "vocab_size": 10, "n_inner": -3072})


FACTORIES = '''
import torch

def good():
    model = torch.nn.Linear(4, 4)
    return model, lambda: (torch.randn(2, 4), torch.randn(2, 4)), lambda m, x, y: ((m(x) - y) ** 2).mean()

def ints():
    return (1, 2, 3)

def pair():
    return (torch.nn.Linear(2, 2), None)

def needs(x):
    return x

def no_params():
    return torch.nn.ReLU(), lambda: (torch.ones(1), torch.ones(1)), lambda m, x, y: x.sum()

def not_callable():
    return torch.nn.Linear(2, 2), [torch.ones(2)], lambda m, x, y: x.sum()
'''


@pytest.mark.parametrize("fn,msg", [
    ("ints", "module: hostile_factories:ints must return (model, batches, loss_fn): a torch.nn.Module "
             "with parameters and two callables; its model is an int"),
    ("pair", "must return (model, batches, loss_fn): a torch.nn.Module with parameters and two "
             "callables, got a tuple of 2"),
    ("needs", "module: hostile_factories:needs must take no arguments (memfit profile calls it with "
              "none): missing a required argument: 'x'"),
    ("no_params", "its model is a ReLU without parameters"),
    ("not_callable", "its batches is a list"),
])
def test_profile_module_factory_is_checked(fn, msg, capsys, tmp_path, monkeypatch):
    (tmp_path / "hostile_factories.py").write_text(FACTORIES)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert msg in cli_error(capsys, "profile", "--module", f"hostile_factories:{fn}", "--device", "cpu",
                            "--out", str(tmp_path / "o"))
    from memfit import profile

    assert len(profile.load_factory("hostile_factories:good")) == 3  # the control is taken
