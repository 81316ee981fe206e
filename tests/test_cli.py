"""The command line: every subcommand runs, prints what it says, writes its files,
and answers bad arguments with a usage error (exit 2) that names the problem."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")


def run(*args, cwd=None, env=None):
    return subprocess.run([sys.executable, "-m", "memfit", *args], capture_output=True, text=True, cwd=cwd,
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
    return total(mf) / total(base)


def test_demo_runs_and_measures(tmp_path):
    """The demo as a user runs it: the memfit way trains in the precision memfit advises
    for this CPU (fp32 where bf16 would be emulated) and saves the same share of memory
    either way (about a third of the baseline's: in fp32 the planner checkpoints to half
    the share, profile.checkpoint_budget)."""
    from memfit.hardware import ENV_PRECISION, cpu_precision

    env = {k: v for k, v in os.environ.items() if k != ENV_PRECISION}
    out = run("demo", "--steps", "6", "--out", str(tmp_path / "d"), env=env)
    assert out.returncode == 0, out.stderr
    assert check_demo(out.stdout, tmp_path / "d", cpu_precision()[0], 6) < 0.35


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
