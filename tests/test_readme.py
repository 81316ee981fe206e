"""Every Python example in README.md runs as written (on the CPU here), and gives what
its comments and the text around it say it gives."""

import ast
import math
import re
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def run_block(code: str):
    """Runs a README block statement by statement, as a reader pasting it would, and
    returns its namespace and the value of each bare expression (the lines whose
    result the README shows in a comment), keyed by the expression's source text."""
    ns = {"__name__": "__readme__"}
    shown = {}
    for stmt in ast.parse(code).body:
        if isinstance(stmt, ast.Expr):
            text = ast.get_source_segment(code, stmt)
            shown[text] = eval(compile(ast.Expression(stmt.value), "README.md", "eval"), ns)
        else:
            exec(compile(ast.Module([stmt], []), "README.md", "exec"), ns)
    return ns, shown


def check_quickstart(ns, shown):
    # "budget='50%'": half of the store-everything memory, and the blocks it recomputes
    plan = ns["plan"]
    assert plan.memory_bytes <= 0.5 * plan.full_memory_bytes
    assert 0 < len(plan.checkpointed_stages) < plan.n_stages
    assert type(ns["opt"]).__name__ == "AdamW8bit"
    assert math.isfinite(ns["loss"].item())
    assert ns["opt"].state  # the optimizer stepped (its 8-bit states exist)


def check_quant(ns, shown):
    import memfit.quant as q

    assert shown["state.codes.dtype, state.absmax.shape"] == (torch.uint8, torch.Size([16384]))
    y = ns["y"]
    assert y.dtype == torch.float32 and tuple(y.shape) == (4096, 1024)
    err = shown["(x - y).abs().mean()"].item()
    assert err == pytest.approx(0.0085, rel=0.1)  # "about 0.0085 for standard normal data"
    st = shown['q.quantize_blockwise(x, rounding="stochastic", seed=0)']
    assert st.codes.dtype == torch.uint8
    assert (q.dequantize_blockwise(st) - ns["x"]).abs().mean().item() < 2 * err
    unsigned = shown["q.dynamic_map(signed=False)"]
    assert len(unsigned) == 256 and min(unsigned) >= 0 and max(unsigned) == 1.0


def check_cast(ns, shown):
    nearest = shown["memfit.cast(w, torch.bfloat16)"]
    assert nearest.dtype == torch.bfloat16
    assert torch.equal(nearest, ns["w"].to(torch.bfloat16))  # "bit-identical to .to()"
    assert bool((nearest == 1.0).all())  # "all 1.0, update lost"
    sr = shown['memfit.cast(w, torch.bfloat16, rounding="stochastic", seed=0)']
    # "mean stays 1.0001": the mean of 10**6 draws has a standard deviation near 1e-6
    assert sr.double().mean().item() == pytest.approx(1.0001, abs=1e-5)


def check_linear(ns, shown):
    layer, y = ns["layer"], ns["y"]
    assert isinstance(layer, torch.nn.Linear) and tuple(y.shape) == (8, 128, 3072)
    x = torch.randn(4, 768)
    ref = torch.nn.functional.gelu(torch.nn.functional.linear(x, layer.weight, layer.bias))
    torch.testing.assert_close(layer(x), ref, rtol=1e-4, atol=1e-4)
    assert layer.weight.grad is not None and layer.weight.grad.shape == layer.weight.shape


def check_gemm_backend(ns, shown):
    import memfit

    info = ns["info"]
    cuda = memfit.cuda_device_count() > 0
    assert info["device"] == ("cuda" if cuda else "cpu")  # "cuda when a GPU is visible"
    assert info["backend"] in ("cpu", "portable", "cublaslt")
    assert isinstance(info["reason"], str) and "version" in info["cublaslt"]
    assert set(info["last"]) >= {"backend", "reason"}


def check_switch_optimizers(ns, shown):
    import memfit.optim as mo

    opt, t, w = ns["opt"], ns["torch_adamw"], ns["model"].weight
    assert opt.state[w]["state1"].dtype == torch.uint8  # "quantizes"
    assert t.state[w]["step"].item() == 2  # one step in torch, one in memfit
    assert torch.equal(t.state[w]["exp_avg"], mo.dequantized_state(opt, w)["exp_avg"])


# Each block is recognised by a line it must contain, so a block added to the README
# without a check here fails test_every_block_is_checked.
def check_offload(ns, shown):
    # "each gradient leaves the device": the model holds no gradient; the host stepped
    opt, model = ns["opt"], ns["model"]
    assert all(p.grad is None for p in model.parameters())
    assert type(opt.optimizer).__name__ == "AdamW8bit" and opt.optimizer.state
    host = {p.data_ptr() for g in opt.optimizer.param_groups for p in g["params"]}
    assert host.isdisjoint(p.data_ptr() for p in model.parameters())


CHECKS = {
    "plan = memfit.checkpoint.auto(": check_quickstart,
    "state = q.quantize_blockwise(x, block_size=256)": check_quant,
    "w = torch.ones(1_000_000) + 1e-4": check_cast,
    'layer = memfit.nn.Linear(768, 3072, activation="gelu")': check_linear,
    "info = memfit.nn.gemm_backend()": check_gemm_backend,
    "opt.load_state_dict(torch_adamw.state_dict())": check_switch_optimizers,
    "opt = memfit.optim.CPUOffloadOptimizer(": check_offload,
}


def check_for(code):
    found = [fn for key, fn in CHECKS.items() if key in code]
    assert len(found) == 1, f"README block without exactly one check:\n{code}"
    return found[0]


def test_readme_has_examples():
    assert len(BLOCKS) >= 4


def test_every_block_is_checked():
    assert sorted(check_for(b).__name__ for b in BLOCKS) == sorted(f.__name__ for f in CHECKS.values())


@pytest.mark.parametrize("code", BLOCKS, ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_readme_example_gives_what_it_says(code):
    check = check_for(code)
    torch.manual_seed(0)
    ns, shown = run_block(code)
    check(ns, shown)


# -- the comparison tables -----------------------------------------------------------------

COMPARISON = (Path(__file__).resolve().parents[1] / "docs" / "comparison.md").read_text()


def table_after(heading: str) -> list:
    """The rows (lists of cells) of the first markdown table after the line starting with
    ``heading``."""
    lines = README.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(heading))
    rows = []
    for line in lines[start + 1:]:
        if line.startswith("|"):
            rows.append([c.strip() for c in line.strip("|").split("|")])
        elif rows:
            break
    return [r for r in rows if not set("".join(r)) <= set("-")]


def test_every_peer_limitation_is_cited_and_sourced():
    """A peer's cell that says what it does not do (or does only partly) cites an issue
    or pull request, and docs/comparison.md links every citation of the table."""
    rows = table_after("How it compares")
    head = rows[0]
    assert head[1:] == ["memfit", "bitsandbytes", "torchao", "torch"]
    limiting = re.compile(r"\b(no|not|crash\w*|skipped|only|before)\b")
    # an issue or pull request, or a file of the peer's own source
    citation = re.compile(r"([\w-]+/[\w-]+#\d+|[\w-]+#\d+)")
    source_file = re.compile(r"pytorch/pytorch `([\w/.]+)`")
    for row in rows[1:]:
        for peer, cell in zip(head[2:], row[2:]):
            if limiting.search(cell):
                assert citation.search(cell) or source_file.search(cell), f"{row[0]} / {peer}: {cell!r} cites nothing"
            for path in source_file.findall(cell):
                assert path in COMPARISON, path
            for ref in citation.findall(cell):
                repo, num = ref.split("#")
                assert f"#{num}" in COMPARISON and (repo.split("/")[-1] in COMPARISON), ref


def test_state_bytes_table_is_the_estimators():
    from memfit.memory import OPTIMIZER_BYTES

    rows = table_after("Optimizer state per parameter")[1:]
    names = ["adamw", "adamw-bf16", "adamw8bit", "adamw4bit"]
    assert [float(r[1]) for r in rows] == [round(OPTIMIZER_BYTES[n], 2) for n in names]


# -- the test command: README, .ci/run and the pinned versions agree ---------------------------

ROOT = Path(__file__).resolve().parents[1]


def _pip_command(text: str) -> str:
    """The `pip install ... && python -m pytest` line in text, written one way
    (`python3 -m pip` and `pip`, `python3` and `python` are the same command)."""
    lines = [line for line in text.splitlines() if "pip install -r requirements-test.txt" in line]
    assert len(lines) == 1, lines
    return re.sub(r"\bpython3\b", "python", lines[0].replace("python3 -m pip", "pip")).strip()


def test_ci_runs_the_readme_test_command():
    assert _pip_command((ROOT / ".ci" / "run").read_text()) == _pip_command(README.read_text())
    assert "-c constraints-test.txt" in _pip_command(README.read_text())


def test_constraints_pin_every_test_requirement_within_its_range():
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    pins = {}
    for line in (ROOT / "constraints-test.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, sep, version = line.partition("==")
            assert sep and version.strip(), f"constraints-test.txt: not an exact pin: {line!r}"
            pins[canonicalize_name(name)] = version.strip()
    assert "memfit" not in pins
    lines = [line.split("#")[0].strip() for line in (ROOT / "requirements-test.txt").read_text().splitlines()]
    for req in (Requirement(line) for line in lines if line):
        name = canonicalize_name(req.name)
        assert name in pins, f"constraints-test.txt pins no {req.name} (run .ci/lock_test_deps.py)"
        assert req.specifier.contains(pins[name], prereleases=True), (
            f"constraints-test.txt pins {req.name}=={pins[name]}, outside requirements-test.txt's {req}")
