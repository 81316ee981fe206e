"""The command line's files and option combinations (issue 38 §16-19): `estimate --plot`
writes and reports the file it names (with ".png" added where the path names no format,
as matplotlib does), refuses paths it cannot write before computing anything, counts
--optimizer alone, refuses --host-memory with --cpu; `demo` checks its output files
before training and, when one still cannot be written, writes the others and says so in
one line. Every refusal: one line on stderr, exit status 2, no traceback."""

import json
import os

import pytest

from memfit import cli


def run(capsys, *args):
    try:
        rc = cli.main(list(args))
    except SystemExit as e:  # argparse's own errors
        rc = e.code
    out = capsys.readouterr()
    return rc, out.out, out.err


def one_line_error(capsys, *args) -> str:
    rc, out, err = run(capsys, *args)
    assert rc == 2 and out == "", (rc, out, err)
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("memfit ") and ": error: " in err
    return err.strip()


# ---- §16: --plot's file ----------------------------------------------------------------------

def test_plot_without_suffix_reports_the_png_it_writes(capsys, tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    monkeypatch.chdir(tmp_path)
    rc, out, err = run(capsys, "estimate", "gpt2", "--plot", "chart")
    assert rc == 0, err
    assert "wrote chart.png" in out.splitlines()
    assert sorted(os.listdir(tmp_path)) == ["chart.png"]
    assert (tmp_path / "chart.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rc, out, _ = run(capsys, "estimate", "gpt2", "--plot", "other", "--json")
    assert rc == 0 and json.loads(out)["plot"] == "other.png" and (tmp_path / "other.png").is_file()


@pytest.mark.parametrize("path,msg", [
    ("", "plot: empty; give a file name like chart.png"),
    ("/dev/null", "plot: '/dev/null' is not a regular file (a device or a pipe)"),
    ("{tmp}", "plot: '{tmp}' names a directory; give a file name in it, like '{tmp}/chart.png'"),
    ("{tmp}/missing/", "plot: '{tmp}/missing/' names a directory"),
    ("{tmp}/x.", "plot: '{tmp}/x.' ends with a dot and names no format"),
    ("{tmp}/d", "plot: '{tmp}/d.png' is a directory"),  # "d" is free, but "d.png" is a folder
])
def test_plot_refuses_targets_it_cannot_write_before_computing(path, msg, capsys, tmp_path):
    (tmp_path / "d.png").mkdir()
    before = sorted(os.listdir(tmp_path))
    err = one_line_error(capsys, "estimate", "gpt2", "--plot", path.format(tmp=tmp_path))
    assert msg.format(tmp=tmp_path) in err
    assert sorted(os.listdir(tmp_path)) == before


# ---- §18: a format whose writer needs TeX; --host-memory with --cpu ------------------------

def test_plot_pgf_without_tex_is_one_line(capsys, tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import shutil

    import matplotlib

    tex = matplotlib.rcParams["pgf.texsystem"]
    real = shutil.which
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: None if name == tex else real(name, *a, **k))
    err = one_line_error(capsys, "estimate", "gpt2", "--plot", str(tmp_path / "x.pgf"))
    assert f"plot: cannot write '{tmp_path}/x.pgf': matplotlib's .pgf output runs {tex} (TeX)" in err
    assert list(tmp_path.iterdir()) == []


def test_a_writer_failing_at_save_time_is_one_line(capsys, tmp_path, monkeypatch):
    """The check up front cannot foresee every writer's failure (a TeX that is installed
    but broken): matplotlib's RuntimeError becomes the same one-line refusal."""
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    def broken(self, path, *a, **k):
        raise RuntimeError("LaTeX was not able to process the following string:\nb'lp'\nmore")

    monkeypatch.setattr(Figure, "savefig", broken)
    err = one_line_error(capsys, "estimate", "gpt2", "--plot", str(tmp_path / "x.svg"))
    assert err.endswith(f"plot: cannot write {tmp_path}/x.svg: LaTeX was not able to process the following "
                        "string:")


def test_host_memory_with_cpu_is_refused(capsys, monkeypatch):
    from memfit.hardware import ENV_PRECISION

    monkeypatch.setenv(ENV_PRECISION, "fp32")  # not measured: the answer does not matter here
    err = one_line_error(capsys, "estimate", "gpt2", "--cpu", "--host-memory", "64GB")
    assert "host_memory: --host-memory sizes the host side of the GPU offload recipes, which --cpu does " \
           "not draw" in err
    rc, out, _ = run(capsys, "estimate", "gpt2", "--cpu", "--json")  # the control: --cpu alone runs
    assert rc == 0 and "host_memory" not in json.loads(out)


# ---- §17: --optimizer alone --------------------------------------------------------------------

@pytest.mark.parametrize("optimizer", ["muon8bit", "adamw4bit", "sgd"])
def test_optimizer_alone_is_counted(optimizer, capsys):
    from memfit import memory as M

    rc, out, _ = run(capsys, "estimate", "gpt2", "--optimizer", optimizer, "--json")
    assert rc == 0
    setting = json.loads(out)["setting"]
    spec = M.resolve_model("gpt2")
    assert setting["optimizer"] == M.optimizer_state_bytes(spec, optimizer)
    assert setting["optimizer"] != M.optimizer_state_bytes(spec, "adamw")
    assert setting["setup"]["precision"] == "fp32" and setting["setup"]["optimizer"] == optimizer
    rc, out, _ = run(capsys, "estimate", "gpt2", "--optimizer", optimizer)
    line = next(l for l in out.splitlines() if l.startswith("your setting"))
    assert line.startswith(f"your setting (fp32, {optimizer})")
    assert f"| {M.fmt_gb(setting['optimizer']):>9} |" in line


def test_no_setting_line_without_precision_or_optimizer(capsys):
    rc, out, _ = run(capsys, "estimate", "gpt2", "--json")
    assert rc == 0 and "setting" not in json.loads(out)
    assert "optimizer: expected one of" in one_line_error(capsys, "estimate", "gpt2", "--optimizer", "nope")


# ---- §19: the demo's files ---------------------------------------------------------------------

@pytest.mark.parametrize("name", ["loss.png", "recipes.png", "demo.json"])
def test_demo_refuses_a_blocked_output_before_training(name, capsys, tmp_path):
    pytest.importorskip("torch")
    (tmp_path / name).mkdir()
    err = one_line_error(capsys, "demo", "--device", "cpu", "--out", str(tmp_path))
    assert f"out: '{tmp_path / name}' is a directory, and this command writes loss.png, recipes.png, " \
           "demo.json in --out" in err
    assert sorted(os.listdir(tmp_path)) == [name]  # nothing trained, nothing written


def test_demo_writes_what_it_can_when_a_file_is_blocked_after_the_check(capsys, tmp_path, monkeypatch):
    """recipes.png turns into a folder while the demo trains (after the check): the
    loss chart and demo.json are still written, one line names what was not, and the
    command fails (2) though its printed results are complete."""
    pytest.importorskip("torch")
    pytest.importorskip("matplotlib")
    from memfit import demo
    from memfit.hardware import ENV_PRECISION

    monkeypatch.setenv(ENV_PRECISION, "fp32")
    monkeypatch.setitem(demo.SIZES, "cpu", (dict(n_layer=1, d_model=32, n_head=2), 4, 32, 200))
    real_train = demo.train

    def train_then_block(name, *a, **k):
        row = real_train(name, *a, **k)
        (tmp_path / "recipes.png").mkdir(exist_ok=True)
        return row

    monkeypatch.setattr(demo, "train", train_then_block)
    rc, out, err = run(capsys, "demo", "--device", "cpu", "--steps", "5", "--out", str(tmp_path))
    assert rc == 2 and "Traceback" not in err
    last = err.strip().splitlines()[-1].split("\r")[-1]  # after the progress bars
    assert err.count("memfit demo: error:") == 1
    assert last == (f"memfit demo: error: could not write {tmp_path / 'recipes.png'} (it is a directory); the "
                    "results above are complete")
    assert f"wrote {tmp_path / 'loss.png'} and {tmp_path / 'demo.json'}" in out
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads((tmp_path / "demo.json").read_text())
    assert [r["name"] for r in data["rows"]] == ["baseline", "memfit"] and len(data["rows"][0]["losses"]) == 5


def test_a_reader_that_goes_away_is_no_traceback():
    """`memfit estimate ... | head -1`: the reader closes the pipe; the command ends
    quietly (exit 1, as Python's docs advise for SIGPIPE), no BrokenPipeError traceback.
    The pipe is closed before the command prints anything, so every write fails."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "memfit", "estimate", "llama-7b"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # the reader is gone: every write raises EPIPE
    err = proc.stderr.read().decode()
    rc = proc.wait(timeout=120)
    assert "Traceback" not in err and "BrokenPipe" not in err, err
    assert rc == 1
