"""Will it fit, with offload (memfit.recipes, issue 32 §3): each recipe's device and host
bytes against hand-computed counts for a 1B and an 8B llama-like config, the largest
model of a family per GPU (the one named fits, one more layer does not), and the
`memfit estimate` recipe tables, --host-memory and --plot under bad input. No torch:
the estimator is arithmetic."""

import json
from dataclasses import replace

import pytest

from memfit import cli
from memfit import memory as M
from memfit import recipes as R

LLAMA_1B = M.PRESETS["llama-1b"]  # Llama-3.2-1B: tied embeddings, 8 KV heads
LLAMA_8B = M.ModelSpec("llama-8b", 32, 4096, 32, 128256, d_ff=14336, n_kv_head=8, mlp="swiglu",
                       norm="rmsnorm", bias=False, tied_embeddings=False, dropout=False)  # Llama-3.1-8B
SETUP = M.Setup(batch=1, seq=2048, checkpoint="every")
GIB = M.GB


def by_key(spec, setup=SETUP):
    return {pl.recipe.key: pl for pl in R.placements(spec, setup)}


def test_llama_1b_bytes_by_hand():
    p = 1_235_814_400  # Llama-3.2-1B's published count
    v = 16 * 2 * 2048 + 2048  # 1-D tensors: two RMSNorm weights per layer and the final one
    states = (p - v) * 2 + (p - v) // 256 * 2 * 4 + v * 8  # two 8-bit moments + 2 absmax per 256; fp32 for 1-D
    assert states == 2_510_651_392
    emb, mlp = 128256 * 2048, 2048 * 8192  # the tied embedding, one MLP matrix
    pls = by_key(LLAMA_1B)
    assert {k: pl.n_params for k, pl in pls.items()} == dict.fromkeys(pls, p)

    torch_adamw = pls["torch-adamw"]
    assert (torch_adamw.device["parameters"], torch_adamw.device["gradients"], torch_adamw.device["states"]) == (
        4 * p, 4 * p, 8 * p)
    assert torch_adamw.per_param("device") == 16.0 and torch_adamw.per_param("host") == 0.0

    eight = pls["8bit"]
    assert (eight.device["parameters"], eight.device["gradients"], eight.device["states"]) == (2 * p, 2 * p, states)
    assert eight.per_param("device") == pytest.approx(6.03125, abs=5e-4)  # 2 + 2 + 2.03

    # step in backward: the tied embedding's gradient waits for its second use, the
    # largest other gradient (an MLP matrix) comes and goes on top of it
    backward = pls["8bit-backward"]
    assert backward.device["gradients"] == (emb + mlp) * 2 == 558_891_008
    assert backward.device["states"] == states and backward.per_param("device") == pytest.approx(4.03125, abs=5e-4)

    staging = 2 * emb * 2  # two 16-bit gradients of the largest tensor in flight
    # stepping as they land, the host holds the staging; kept for the step, every gradient
    for key, host_grads in (("8bit-offload", staging), ("8bit-offload-keep", 2 * p)):
        off = pls[key]
        assert off.device == {"parameters": 2 * p, "gradients": staging, "states": 0,
                              "activations": eight.device["activations"], "temporary": eight.device["temporary"]}
        assert off.host == {"parameters": 2 * p, "gradients": host_grads, "states": states, "activations": 0,
                            "temporary": R.HOST_RUNTIME_BYTES}
        assert off.per_param("device") == 2.0
    # issue 32 §5: host at most 4 B/param (masters in the parameter's dtype), but for the
    # absmax (2 * 4 / 256 B) and 1-D tensors' float32 states (0.0003 B/param here)
    assert pls["8bit-offload"].per_param("host") == 2 + states / p
    assert 4 + 2 * 4 / 256 < pls["8bit-offload"].per_param("host") < 4 + 2 * 4 / 256 + 5e-4
    assert pls["8bit-offload-keep"].per_param("host") == 4 + states / p
    # the activations and buffers are memfit.memory's for the recipe's precision
    est = M.estimate(LLAMA_1B, replace(SETUP, precision="bf16-pure", optimizer="adamw8bit"))
    assert (eight.device["activations"], eight.device["temporary"]) == (est.activations, est.temporary)
    est = M.estimate(LLAMA_1B, replace(SETUP, precision="bf16", optimizer="adamw"))
    assert torch_adamw.device["activations"] == est.activations
    assert torch_adamw.device["activations"] > eight.device["activations"]  # autocast keeps 16-bit weight copies


def test_llama_8b_bytes_by_hand():
    p = 8_030_261_248  # Llama-3.1-8B's published count
    assert LLAMA_8B.n_params() == p
    emb = 128256 * 4096  # embedding and head, untied: one at a time
    pls = by_key(LLAMA_8B)
    assert pls["torch-adamw"].device_total - pls["torch-adamw"].device["activations"] \
        - pls["torch-adamw"].device["temporary"] == 16 * p
    assert pls["8bit-backward"].device["gradients"] == emb * 2
    off = pls["8bit-offload"]
    assert off.device["parameters"] + off.device["gradients"] == 2 * p + 2 * emb * 2
    # the host: 16.3 GB of 8-bit states + 16 GB of bf16 masters + staging + the process
    assert off.host_total == 2 * p + 16_313_057_280 + 2 * emb * 2 + R.HOST_RUNTIME_BYTES
    assert pls["8bit-offload-keep"].host_total - off.host_total == 2 * p - 2 * emb * 2
    # an 8B full fine-tune fits a 24 GB card only offloaded, and the host then needs 34 GiB
    gpu = 24 * GIB
    fit = {k: R.fits(pl, gpu, None)[0] for k, pl in pls.items()}
    assert fit == {"torch-adamw": False, "8bit": False, "8bit-backward": False, "8bit-offload": True,
                   "8bit-offload-keep": True}
    assert 34 * GIB < off.host_total < 35 * GIB
    assert R.fits(off, gpu, R.parse_host_memory("colab")) == (True, False)


def test_accumulation_and_kahan():
    """Micro-batches: nothing steps before the last one, so step in backward keeps every
    gradient, and the offloader sums them on the host (2 B/param). kahan=True adds its
    2 B/param buffer to the states of 16-bit weights, wherever they live."""
    p = LLAMA_1B.n_params()
    plain = by_key(LLAMA_1B, M.Setup(batch=8, seq=512, checkpoint="every"))
    accum = by_key(LLAMA_1B, M.Setup(batch=8, micro_batch=2, seq=512, checkpoint="every"))
    assert accum["8bit-backward"].device["gradients"] == 2 * p == accum["8bit"].device["gradients"]
    assert accum["8bit-backward"].per_param("device") == accum["8bit"].per_param("device")
    assert accum["8bit-offload"].host["gradients"] == 2 * p == accum["8bit-offload-keep"].host["gradients"]
    assert accum["8bit-offload"].per_param("host") == pytest.approx(plain["8bit-offload"].per_param("host") + 2)
    assert accum["8bit-offload"].device["gradients"] == plain["8bit-offload"].device["gradients"]
    kahan = by_key(LLAMA_1B, M.Setup(batch=8, seq=512, checkpoint="every", kahan=True))
    for key, extra in (("8bit", 2), ("8bit-backward", 2), ("8bit-offload", 2), ("8bit-offload-keep", 2),
                       ("torch-adamw", 0)):
        side = "host" if key.startswith("8bit-offload") else "device"
        assert getattr(kahan[key], side)["states"] - getattr(plain[key], side)["states"] == extra * p, key


def test_gradients_alive():
    gpt2 = M.PRESETS["gpt2"]  # tied; the next largest is an MLP matrix (768 x 3072)
    assert R.gradients_alive(gpt2) == 50257 * 768 + 768 * 3072
    assert R.gradients_alive(M.PRESETS["llama-7b"]) == 32000 * 4096  # untied: one at a time
    by_count = M.ModelSpec("module", 0, 1, 1, 0, params_override=1000)
    assert R.gradients_alive(by_count) == 1000  # no layout known: every gradient


def layers_fit(spec, recipe, n, gpu, host):
    return all(R.fits(R.place(replace(spec, n_layer=n), SETUP, recipe), gpu, host))


@pytest.mark.parametrize("model", ["llama-1b", "gpt2-medium"])
def test_largest_fit_is_the_last_that_fits(model):
    spec = M.PRESETS[model]
    host = R.parse_host_memory("colab")
    previous = {}
    for cap in R.gpu_targets("24GB").values():
        for recipe in R.RECIPES:
            fit = R.largest_fit(spec, SETUP, recipe, cap, host)
            assert fit is not None
            assert layers_fit(spec, recipe, fit.n_layer, cap, host)
            assert not layers_fit(spec, recipe, fit.n_layer + 1, cap, host)
            assert fit.n_params == replace(spec, n_layer=fit.n_layer).n_params()
            gpu_alone = R.largest_fit(spec, SETUP, recipe, cap, None)
            assert gpu_alone.limit == "gpu" and gpu_alone.n_layer >= fit.n_layer
            if fit.limit == "host":  # the host stops it: the GPU alone would take more
                assert fit.gpu_only_layers == gpu_alone.n_layer > fit.n_layer
                assert not all(R.fits(R.place(replace(spec, n_layer=fit.n_layer + 1), SETUP, recipe), cap, host))
            else:
                assert fit.n_layer == gpu_alone.n_layer and fit.gpu_only_layers is None
            previous.setdefault(recipe.key, []).append((cap, gpu_alone.n_layer))
    for key, points in previous.items():  # more GPU memory, never fewer layers
        points.sort()
        assert [n for _, n in points] == sorted(n for _, n in points), key
    # on any GPU, each recipe takes at least the layers of the one before it (host unbounded)
    for cap in (15 * GIB, 80 * GIB):
        layers = [R.largest_fit(spec, SETUP, r, cap, None).n_layer for r in R.RECIPES]
        assert layers[0] < layers[1] < layers[2] <= layers[3] == layers[4], layers


@pytest.mark.parametrize("checkpoint", ["none", "sqrt", "every"])
def test_bytes_grow_with_layers(checkpoint):
    """The search bisects: every recipe's device and host bytes grow with the layer count."""
    setup = M.Setup(batch=2, seq=256, checkpoint=checkpoint)
    for recipe in R.RECIPES:
        totals = [R.place(replace(M.PRESETS["gpt2"], n_layer=n), setup, recipe) for n in range(1, 160)]
        device = [pl.device_total for pl in totals]
        host = [pl.host_total for pl in totals]
        assert device == sorted(device) and host == sorted(host), recipe.key
        assert device[-1] > device[0]


def test_nothing_fits_and_no_layout():
    assert R.largest_fit(M.PRESETS["llama-7b"], SETUP, R.RECIPES[0], 1 * GIB, None) is None  # not one layer
    with pytest.raises(ValueError, match="no layers to vary"):
        R.largest_fit(M.ModelSpec("m", 0, 1, 1, 0, params_override=10), SETUP, R.RECIPES[0], GIB, None)
    # a GPU beyond any model: the search stops at the largest size memfit takes
    huge = R.largest_fit(M.PRESETS["gpt2"], M.Setup(batch=1, seq=1), R.RECIPES[0], 2**120, None)
    assert huge.n_layer == M.MAX_SIZE


def test_a_host_too_small_for_one_layer():
    """The host, not the GPU, takes not one layer: a Fit of 0 layers that says so."""
    host = R.HOST_RUNTIME_BYTES + 1  # the process fits, no states do
    offload = R.RECIPES[3]
    fit = R.largest_fit(LLAMA_1B, SETUP, offload, 80 * GIB, host)
    assert (fit.n_layer, fit.n_params, fit.limit) == (0, 0, "host") and fit.gpu_only_layers > 0
    assert R.largest_fit(LLAMA_1B, SETUP, R.RECIPES[1], 80 * GIB, host).limit == "gpu"  # nothing on the host
    text = R.format_largest(LLAMA_1B, R.largest_table(LLAMA_1B, SETUP, {"h100": 80 * GIB}, host), host, "h100")
    assert "| - (host)" in text
    assert "8-bit + offload on h100: the host's 2.00 GiB take not one layer; the GPU alone would take" in text


def test_host_memory_values():
    assert R.parse_host_memory("colab") == int(12.7 * GIB)
    assert R.parse_host_memory(" Colab ") == int(12.7 * GIB)
    assert R.parse_host_memory("64GB") == 64 * GIB
    assert R.parse_host_memory("0.5gb") == GIB // 2
    import os

    if hasattr(os, "sysconf"):
        assert M.host_memory_bytes() == os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def run(capsys, *args):
    try:
        rc = cli.main(list(args))
    except SystemExit as e:  # argparse's own errors
        rc = e.code
    out = capsys.readouterr()
    return rc, out.out, out.err


HOSTILE = [
    ("", "host_memory: expected one of colab or a size like 12.7GB, got ''"),
    ("lots", "host_memory: expected one of colab or a size like 12.7GB, got 'lots'"),
    ("12.7", "host_memory: expected one of colab or a size like 12.7GB, got '12.7'"),
    ("0GB", "host_memory: the memory size must be a finite number of GB > 0, got '0GB'"),
    ("-4GB", "host_memory: the memory size must be a finite number of GB > 0, got '-4GB'"),
    ("nanGB", "got 'nanGB'"),
    ("infGB", "got 'infGB'"),
    ("1e-12GB", "host_memory: the memory size must be a finite number of GB > 0"),
    ("9" * 400 + "GB", "host_memory: the memory size must be a finite number of GB > 0, got '99999"),
    ("x" * 5000, "got 'xxxxxxxx"),
]


@pytest.mark.parametrize("value,msg", HOSTILE)
def test_hostile_host_memory_is_a_one_line_error(value, msg, capsys):
    rc, out, err = run(capsys, "estimate", "gpt2", "--gpu", "t4", f"--host-memory={value}")
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("memfit estimate: error: ") and msg in err
    assert len(err) < 300


def test_cli_recipe_tables(capsys):
    rc, out, err = run(capsys, "estimate", "llama-1b", "--gpu", "t4", "--host-memory", "colab", "--batch", "1",
                       "--seq", "2048", "--checkpoint", "every")
    assert rc == 0, err
    lines = out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("recipe "))
    assert [c.strip() for c in lines[head].split("|")] == [
        "recipe (16-bit: bf16, or fp16 on a T4)", "device GiB", "host GiB", "device B/param", "host B/param",
        "fits t4 (15.00 GiB), host 12.70 GiB"]
    rows = {c[0]: c[1:] for c in ([x.strip() for x in line.split("|")] for line in lines[head + 1:head + 6])}
    pls = by_key(LLAMA_1B)
    for r in R.RECIPES:
        pl = pls[r.key]
        assert rows[r.label][:4] == [M.fmt_gb(pl.device_total), M.fmt_gb(pl.host_total),
                                     f"{pl.per_param('device'):.2f}", f"{pl.per_param('host'):.2f}"]
    assert rows["torch AdamW"][1:] == ["2.00", "16.00", "0.00", "no: GPU too small"]
    assert rows["8-bit + offload"][2:] == ["2.00", "4.03", "yes"]
    assert rows["8-bit + offload, gradients kept"][2:] == ["2.00", "6.03", "yes"]
    big = lines.index(next(line for line in lines if line.startswith("Largest llama-1b-shaped model")))
    assert [c.strip() for c in lines[big + 1].split("|")] == ["GPU (GiB)"] + [r.short for r in R.RECIPES]
    t4 = [c.strip() for c in lines[big + 2].split("|")]
    assert t4[0] == "t4        15.00" and t4[1] == "749M (8 L)" and t4[4].endswith("(host)")
    assert len([line for line in lines[big + 2:] if line[:8].strip() in M.GPUS]) == len(M.GPUS)
    assert "8-bit + offload on t4: the host's 12.70 GiB stop it at" in out


def test_cli_recipe_json(capsys, monkeypatch):
    rc, out, _ = run(capsys, "estimate", "llama-1b", "--gpu", "20GB", "--host-memory", "64GB", "--json",
                     "--batch", "1", "--seq", "1024", "--checkpoint", "every")
    assert rc == 0
    data = json.loads(out)
    assert data["host_memory"] == 64 * GIB
    assert [r["recipe"] for r in data["recipes"]] == [r.key for r in R.RECIPES]
    for r in data["recipes"]:
        assert r["device"]["total"] == sum(v for k, v in r["device"].items() if k != "total")
        assert r["host"]["total"] == sum(v for k, v in r["host"].items() if k != "total")
        assert r["fits_gpu"] == (r["device"]["total"] <= 20 * GIB) and r["fits_host"] is True
    assert set(data["largest"]) == set(M.GPUS) | {"20GB"}  # the presets and the size asked for
    fit = data["largest"]["20GB"]["8bit"]
    assert fit["limit"] == "gpu" and fit["params"] == replace(LLAMA_1B, n_layer=fit["n_layer"]).n_params()
    # --cpu: training on the CPU has no recipes past the GPU
    from memfit.hardware import ENV_PRECISION

    monkeypatch.setenv(ENV_PRECISION, "fp32")  # not measured: the answer does not matter here
    rc, out, _ = run(capsys, "estimate", "gpt2", "--cpu", "--json")
    assert rc == 0 and "recipes" not in json.loads(out)
    rc, out, err = run(capsys, "estimate", "gpt2", "--cpu", "--plot")
    assert rc == 2 and out == "" and "plot: --plot draws the recipes of training on a GPU; not with --cpu" in err
    rc, out, err = run(capsys, "estimate", "gpt2", "--cpu", "--host-memory=64GB")
    assert rc == 2 and out == "" and "host_memory: --host-memory sizes the host side" in err
    rc, out, err = run(capsys, "estimate", "gpt2", "--host-memory=0GB")
    assert rc == 2 and out == "" and "host_memory: the memory size must be" in err
    # a preset's name in any case is that preset's row, not a GPU of its own
    rc, out, _ = run(capsys, "estimate", "llama-1b", "--gpu", " T4", "--host-memory", "colab", "--json")
    assert set(json.loads(out)["largest"]) == set(M.GPUS)


def test_cli_plot(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "fit.png"
    rc, out, err = run(capsys, "estimate", "gpt2-xl", "--gpu", "t4", "--host-memory", "colab", "--plot", str(path))
    assert rc == 0, err
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"wrote {path}" in out
    rc, out, err = run(capsys, "estimate", "gpt2", "--plot", str(tmp_path / "fit.svg"), "--json")
    assert rc == 0 and json.loads(out)["plot"] == str(tmp_path / "fit.svg")
    assert (tmp_path / "fit.svg").read_text().lstrip().startswith("<?xml")


def test_cli_plot_without_matplotlib_says_how_to_get_it(capsys, monkeypatch, tmp_path):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # import fails
    rc, out, err = run(capsys, "estimate", "gpt2", "--json", "--plot", str(tmp_path / "x.png"))
    assert rc == 0 and "plot" not in json.loads(out) and "pip install matplotlib" in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("path,msg", [
    ("missing-folder/x.png", "plot: cannot write '{tmp}/missing-folder/x.png' (No such file or directory)"),
    ("x.doc", "plot: cannot write '{tmp}/x.doc': matplotlib writes no 'doc' images (use .png, .svg or .pdf)"),
    ("a\0b.png", "plot: cannot write"),
])
def test_cli_plot_bad_path_prints_nothing_else(path, msg, capsys, tmp_path):
    pytest.importorskip("matplotlib")
    rc, out, err = run(capsys, "estimate", "gpt2", "--plot", f"{tmp_path}/{path}")
    assert rc == 2 and out == "" and err.count("\n") == 1
    assert msg.format(tmp=tmp_path) in err
    assert list(tmp_path.iterdir()) == []


def test_docs_example_is_the_commands_output(capsys):
    """The example in the docs (docs/_estimate_offload_section.md, or docs/offload.md once
    merged there): every line it shows is a line the command prints."""
    import pathlib
    import shlex

    docs = pathlib.Path(__file__).resolve().parent.parent / "docs"
    marker = "$ memfit estimate llama-1b --gpu t4 --host-memory colab"
    text = next(t for t in (p.read_text() for p in sorted(docs.glob("*.md"))) if marker in t)
    block = text[text.index(marker):].split("```")[0].splitlines()
    rc, out, _ = run(capsys, *shlex.split(block[0])[2:])
    assert rc == 0
    shown = [line for line in block[1:] if line.strip() and line != "..."]
    assert len(shown) >= 8 and all(line in out.splitlines() for line in shown)
    # and the text's claim: with 32 GB of host memory the T4 takes 5.7B offloaded
    rc, out, _ = run(capsys, *shlex.split(block[0])[2:], "--host-memory", "32GB")
    t4 = next(line for line in out.splitlines() if line.startswith("t4 "))
    assert t4.split("|")[4].strip() == "5.68B (89 L)"
