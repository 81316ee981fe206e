"""memfit.optim's imports run one way (classes -> _torch -> checks, format, convert ->
core: no circle, at module level or inside a function), and the converters find every
optimizer class through memfit.optim._registry, imported or not."""

import ast
import pathlib
import subprocess
import sys

import pytest

PYTHON = pathlib.Path(__file__).resolve().parent.parent / "python"


def import_graph(root: pathlib.Path, package: str) -> dict:
    """{module: {modules of ``package`` it imports}}, every import statement counted
    (module level, in functions, under ``if``), read with ast. ``from a import b`` is an
    edge to ``a.b`` where that is a module, else to ``a`` (import-linter's reading)."""
    modules = {}
    for path in (root / package.replace(".", "/")).rglob("*.py"):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path

    def owner(name):  # the module of `package` that `name` is, or is in
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name

    graph = {}
    for mod, path in modules.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the package of `mod`
                    here = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
                    here = here[:len(here) - node.level + 1]
                    base = ".".join(here + ([base] if base else []))
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                         for a in node.names]
            else:
                continue
            deps.update(d for d in map(owner, names) if d and d != mod)
        graph[mod] = deps
    return graph


def cycles(graph: dict) -> list:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_walker_sees_deferred_imports_and_finds_a_circle(tmp_path):
    """The check below can fail: a circle closed by an import inside a function, and one
    through a relative import, are found."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg import b\n")
    (pkg / "b.py").write_text("def f():\n    from pkg.sub import c\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "c.py").write_text("from .. import a\nimport pkg.d\n")
    (pkg / "d.py").write_text("import os\n")
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg.b"] == {"pkg.sub.c"}
    assert graph["pkg.sub.c"] == {"pkg.a", "pkg.d"}
    assert cycles(graph) == [["pkg.a", "pkg.b", "pkg.sub.c"]]


def test_optim_has_no_import_circle():
    graph = import_graph(PYTHON, "memfit.optim")
    # the layering the walker must see (so that an empty answer means something)
    assert "memfit.optim.convert" in graph["memfit.optim._torch_state_dict"]
    assert "memfit.optim._torch_step" in graph["memfit.optim._torch"]
    assert "memfit.optim._torch" in graph["memfit.optim.optimizers"]
    found = cycles(graph)
    assert not found, "import circles in memfit.optim: " + "; ".join(
        " <-> ".join(c) + " (" + ", ".join(f"{m} -> {sorted(graph[m] & set(c))}" for m in c) + ")"
        for c in found)


def test_the_converters_never_import_a_class_module():
    """convert/ and _registry ask the registry; they import no module that defines
    optimizer classes (which import them)."""
    graph = import_graph(PYTHON, "memfit.optim")
    classes = {"memfit.optim._torch", "memfit.optim.optimizers", "memfit.optim.muon",
               "memfit.optim.trust", "memfit.optim.bnb"}
    for mod, deps in graph.items():
        if mod.startswith("memfit.optim.convert") or mod == "memfit.optim._registry":
            assert not deps & classes, f"{mod} imports {sorted(deps & classes)}"


def run(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                          text=True).stdout


def test_import_memfit_optim_imports_no_torch():
    assert run("import sys, memfit.optim; print('torch' in sys.modules)").strip() == "False"


def test_the_registry_fills_itself_for_a_user_of_convert_only():
    """A process that imported only memfit.optim.convert finds every class by the name a
    state dict records, the shims' too: the registry imports the class modules on the
    first name it does not know."""
    out = run("import sys\n"
              "import memfit.optim.convert\n"
              "from memfit.optim import _registry\n"
              "assert 'memfit.optim.bnb' not in sys.modules and 'memfit.optim.optimizers' not in sys.modules\n"
              "shim = _registry.saver_class('bnb.AdamW8bit')\n"
              "print(shim.__module__, shim.__name__)\n"
              "names = _registry.classes()\n"
              "print(sorted(n for n in names if not n.startswith('bnb.')))\n"
              "print(_registry.saver_class('AdamW32bit').__module__, _registry.saver_class('Nope'))\n")
    lines = out.splitlines()
    assert lines[0] == "memfit.optim.bnb AdamW8bit"
    assert eval(lines[1]) == sorted(  # every public class of memfit.optim, under its own name
        ["Adagrad", "Adagrad8bit", "AdEMAMix", "AdEMAMix8bit", "Adam", "Adam8bit", "AdamW",
         "AdamW4bit", "AdamW8bit", "LAMB", "LAMB8bit", "LARS", "LARS8bit", "Lion8bit", "Muon",
         "Muon8bit", "RMSprop8bit", "SGD8bit"])
    # a shim's bare name (dicts saved before records named the shim), and an unknown one
    assert lines[2] == "memfit.optim.bnb None"


def test_registered_classes_match_the_public_names():
    torch = pytest.importorskip("torch")  # noqa: F841
    import memfit.optim as mo
    import memfit.optim.bnb as bnb
    from memfit.optim import _core, _registry

    names = _registry.classes()
    for n in mo.__all__:
        value = getattr(mo, n)
        if isinstance(value, type) and n != "CPUOffloadOptimizer":
            assert names[n] is value
            assert _registry.math_of(value) == (value._kind, value._bits,
                                                _core.STATE_NAMES[value._kind])
    for n in bnb.__all__:
        value = getattr(bnb, n)
        if n != "GlobalOptimManager":
            assert names["bnb." + n] is value and _registry.record_name(value) == "bnb." + n

    class Mine(mo.AdamW8bit):  # a user's subclass: not memfit's, not registered
        pass

    assert _registry.saver_class("Mine") is None


def test_a_shim_checkpoint_loads_in_a_process_that_never_imported_the_shim(tmp_path):
    torch = pytest.importorskip("torch")
    import memfit.optim as mo
    import memfit.optim.bnb as bnb

    torch.manual_seed(0)
    model = torch.nn.Linear(64, 80)
    shim = bnb.AdamW8bit(model.parameters(), lr=1e-2, min_8bit_size=100)
    for _ in range(2):
        model(torch.randn(4, 64)).square().sum().backward()
        shim.step()
    sd = shim.state_dict()
    assert sd["memfit"]["optimizer"] == "bnb.AdamW8bit"
    torch.save({"model": model.state_dict(), "opt": sd}, tmp_path / "ckpt.pt")
    here = mo.AdamW8bit(model.parameters(), lr=1e-2, min_8bit_size=100)
    here.load_state_dict(sd)
    run("import sys, torch\n"
        "from memfit.optim.optimizers import AdamW8bit\n"
        f"ck = torch.load({str(tmp_path / 'ckpt.pt')!r})\n"
        "model = torch.nn.Linear(64, 80)\n"
        "model.load_state_dict(ck['model'])\n"
        "opt = AdamW8bit(model.parameters(), lr=1e-2, min_8bit_size=100)\n"
        "assert 'memfit.optim.bnb' not in sys.modules\n"
        "opt.load_state_dict(ck['opt'])\n"
        f"torch.save(opt.state_dict(), {str(tmp_path / 'out.pt')!r})\n")
    there = torch.load(tmp_path / "out.pt")
    mine = here.state_dict()
    assert there["memfit"] == mine["memfit"] and there["param_groups"] == mine["param_groups"]
    assert there["state"].keys() == mine["state"].keys()
    for pid, st in mine["state"].items():
        assert st.keys() == there["state"][pid].keys()
        for k, v in st.items():
            assert torch.equal(v, there["state"][pid][k]), (pid, k)
