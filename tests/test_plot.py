"""The charts of `memfit demo` and `memfit profile` read without a caption (title,
axis labels with units, a legend naming every line or part), are PNG files drawn by
matplotlib, and without matplotlib the commands say how to get it; progress goes
through tqdm when it is installed and memfit's own bar when it is not."""

import io
import sys

import pytest

pytest.importorskip("matplotlib")

from memfit import _plot, _progress  # noqa: E402

PNG = b"\x89PNG\r\n\x1a\n"


def texts(fig):
    ax = fig.axes[0]
    return {"title": ax.get_title(), "x": ax.get_xlabel(), "y": ax.get_ylabel(),
            "legend": [t.get_text() for t in ax.get_legend().get_texts()]}


def png_size(path):
    data = path.read_bytes()
    assert data[:8] == PNG and data[12:16] == b"IHDR"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def demo_rows():
    rows = []
    for name, precision, opt, ck, scale in (("baseline", "fp32", "AdamW", "none", 1.0),
                                            ("memfit", "bf16", "AdamW8bit", "3 of 6 blocks", 1.02)):
        rows.append(dict(name=name, precision=precision, optimizer=opt, checkpoint=ck,
                         losses=[scale * (5.5 - 3 * i / 40) for i in range(40)]))
    return rows


def test_demo_loss_chart_names_its_lines_and_axes(tmp_path):
    from memfit import demo

    fig = demo.plot(demo_rows(), tmp_path / "loss.png")
    t = texts(fig)
    assert t["title"] == "memfit demo: training loss, 40 steps"
    assert t["x"] == "training step"
    assert t["y"] == "training loss (nats per byte, 10-step mean)"
    assert t["legend"] == ["baseline: fp32, AdamW, checkpointing none",
                           "memfit: bf16, AdamW8bit, checkpointing 3 of 6 blocks"]
    lines = fig.axes[0].get_lines()
    assert [len(line.get_xdata()) for line in lines] == [40, 40]
    assert lines[0].get_color() != lines[1].get_color()
    assert png_size(tmp_path / "loss.png") == (800, 450)


def test_profile_memory_chart_names_its_parts_and_units(tmp_path):
    from memfit import profile

    rows = [dict(name=n, params_bytes=4 * 2**20, grads_bytes=4 * 2**20, optimizer_bytes=o * 2**20,
                 activation_bytes=a * 2**20) for n, o, a in (("baseline", 8, 10), ("memfit", 2, 3))]
    fig = profile.chart(rows, tmp_path / "profile.png")
    t = texts(fig)
    assert t["title"] == "memfit profile: training memory measured per configuration"
    assert t["x"] == "configuration" and t["y"] == "memory (MiB, measured)"
    assert t["legend"] == ["parameters", "gradients", "optimizer states", "activations (saved for backward)"]
    ax = fig.axes[0]
    assert [tick.get_text() for tick in ax.get_xticklabels()] == ["baseline", "memfit"]
    # the stacks: 4 + 4 + 8 + 10 and 4 + 4 + 2 + 3 MiB, their totals written above them
    tops = sorted({round(p.get_y() + p.get_height(), 6) for p in ax.patches})
    assert tops[-1] == 26.0 and 13.0 in tops
    assert {a.get_text() for a in ax.texts} == {"26.0", "13.0"}
    assert png_size(tmp_path / "profile.png") == (800, 450)


def test_recipes_chart_pairs_device_and_host(tmp_path):
    """`memfit estimate --plot`: per recipe a GPU bar and a hatched host bar, stacked by
    part, totals above them, the GPU's and the host's memory as dashed lines."""
    from memfit import memory as M
    from memfit import recipes as R

    pls = R.placements(M.PRESETS["llama-1b"], M.Setup(batch=1, seq=2048, checkpoint="every"))
    fig = R.chart(pls, tmp_path / "recipes.png", title="llama-1b per recipe", gpu=("t4", 15 * M.GB),
                  host_bytes=R.parse_host_memory("colab"))
    t = texts(fig)
    assert t["title"] == "llama-1b per recipe"
    assert t["x"] == "recipe (left bar: GPU, hatched right bar: host)" and t["y"] == "memory (GiB, estimated)"
    assert t["legend"] == ["GPU memory (t4, 15.00 GiB)", "host memory (12.70 GiB)",
                           "parameters\n(host: master weights)", "gradients\n(host: staging)", "optimizer states",
                           "activations\n(saved for backward)", "temporary buffers\n(host: the process)"]
    ax = fig.axes[0]
    pair = [a for a in ax.artists if a is not ax.get_legend()]
    assert [[x.get_text() for x in a.get_texts()] for a in pair] == [["GPU: plain bar", "host: hatched bar"]]
    assert [tick.get_text() for tick in ax.get_xticklabels()] == [
        "torch AdamW", "memfit 8-bit", "8-bit + step\nin backward", "8-bit +\noffload", "8-bit +\noffload,\ngradients\nkept"]
    assert sorted(line.get_ydata()[0] for line in ax.get_lines()) == pytest.approx([12.7, 15.0])
    stacks = {}  # bar centre -> (summed height, hatched)
    for bar in ax.patches:
        x = round(bar.get_x() + bar.get_width() / 2, 6)
        total, _ = stacks.get(x, (0.0, None))
        stacks[x] = (total + bar.get_height(), bool(bar.get_hatch()))
    assert len(ax.patches) == 2 * len(pls) * len(R.PARTS)
    for i, pl in enumerate(pls):
        assert stacks[round(i - 0.19, 6)] == (pytest.approx(pl.device_total / M.GB), False)
        assert stacks[round(i + 0.19, 6)] == (pytest.approx(pl.host_total / M.GB), True)
    assert sorted(a.get_text() for a in ax.texts) == sorted(
        f"{n / M.GB:.1f}" for pl in pls for n in (pl.device_total, pl.host_total))
    assert png_size(tmp_path / "recipes.png") == (1000, 600)


def test_demo_recipes_chart_is_the_estimate_it_names(tmp_path):
    from memfit import cli, demo
    from memfit import memory as M
    from memfit import recipes as R

    fig = demo.recipes_chart(tmp_path / "recipes.png")
    assert texts(fig)["title"] == "memfit demo: llama-1b on a free Colab T4, per recipe (estimated)"
    args = cli.build_parser().parse_args(["estimate", *demo.RECIPES_EXAMPLE])
    pls = R.placements(M.PRESETS["llama-1b"], cli.estimate_setup(args))
    heights = {}
    for bar in fig.axes[0].patches:
        x = round(bar.get_x() + bar.get_width() / 2, 6)
        heights[x] = heights.get(x, 0.0) + bar.get_height()
    assert heights[round(3 - 0.19, 6)] == pytest.approx(pls[3].device_total / M.GB)  # 8-bit + offload, on the T4
    assert pls[3].device_total < 15 * M.GB and args.checkpoint == "every" and args.batch == 1


def test_nothing_to_plot():
    with pytest.raises(ValueError, match="nothing to plot"):
        _plot.line_chart({"a": []}, "x.png", title="t", xlabel="x", ylabel="y")
    with pytest.raises(ValueError, match="nothing to plot"):
        _plot.stacked_bars({}, {"a": "a"}, "x.png", title="t", xlabel="x", ylabel="y")
    with pytest.raises(ValueError, match="nothing to plot"):
        _plot.paired_stacked_bars({}, {"a": "a"}, "x.png", title="t", xlabel="x", ylabel="y")


def test_without_matplotlib_the_demo_says_how_to_get_it(tmp_path, monkeypatch, capsys):
    pytest.importorskip("torch")
    from memfit import demo

    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # import fails
    with pytest.raises(ImportError, match="pip install matplotlib"):
        demo.plot(demo_rows(), tmp_path / "loss.png")
    assert not (tmp_path / "loss.png").exists()


def test_progress_uses_tqdm_when_installed(monkeypatch):
    tqdm = pytest.importorskip("tqdm.auto").tqdm
    monkeypatch.delenv("MEMFIT_PROGRESS", raising=False)
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    bar = _progress.Progress(3, "memfit")
    assert isinstance(bar.bar, tqdm)
    for loss in (3.0, 2.5, 2.0):
        bar.update(loss)
    assert bar.bar.n == 3  # and closed (tqdm disables a closed bar)
    assert "memfit" in err.getvalue() and "3/3" in err.getvalue() and "loss=2.000" in err.getvalue()


def test_progress_without_tqdm_draws_its_own_bar(monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)
    monkeypatch.setenv("MEMFIT_PROGRESS", "1")
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    bar = _progress.Progress(2, "baseline")
    assert bar.bar is None
    bar.update(4.0)
    bar.update(3.5)
    out = err.getvalue()
    assert "\rbaseline  [###############...............] 1/2 loss 4.000" in out
    assert out.endswith("\rbaseline  [##############################] 2/2 loss 3.500\n")


def test_progress_off(monkeypatch):
    monkeypatch.setenv("MEMFIT_PROGRESS", "0")
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    bar = _progress.Progress(2, "x")
    bar.update(1.0)
    bar.update(1.0)
    assert bar.bar is None and err.getvalue() == ""
