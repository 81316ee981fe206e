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


@pytest.mark.parametrize("forced", [None, "bf16"])
def test_demo_runs_and_measures(tmp_path, forced):
    """The memfit way trains in the precision memfit advises for this CPU (fp32 where bf16
    would be emulated; forced to bf16 here to test that path on every CPU)."""
    from memfit.hardware import ENV_PRECISION, cpu_precision

    env = {k: v for k, v in os.environ.items() if k != ENV_PRECISION}
    if forced:
        env[ENV_PRECISION] = forced
    out = run("demo", "--steps", "6", "--out", str(tmp_path / "d"), env=env)
    assert out.returncode == 0, out.stderr
    assert "| baseline | fp32 | AdamW | none |" in out.stdout
    want = forced or cpu_precision()[0]
    assert f"| memfit | {want} | AdamW8bit |" in out.stdout
    assert f"memfit way's precision: {want} (" in out.stdout
    data = json.loads((tmp_path / "d" / "demo.json").read_text())
    assert data["precision"] == want and data["precision_reason"]
    assert data["cpu"]["model_name"] and data["cpu_kernels"]
    base, mf = data["rows"]
    total = lambda r: r["params_bytes"] + r["grads_bytes"] + r["optimizer_bytes"] + r["activation_bytes"]  # noqa: E731
    assert total(mf) < total(base)
    assert mf["optimizer_bytes"] < base["optimizer_bytes"] / 3  # 8-bit states
    assert mf["activation_bytes"] < base["activation_bytes"]  # checkpointing + bf16
    assert len(base["losses"]) == 6 and all(l > 0 for l in base["losses"])
    assert (tmp_path / "d" / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


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
