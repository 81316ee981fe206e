"""memfit.optim's imports run one way (classes -> _torch -> checks, format, convert ->
core; tests/test_import_graph.py fails on any circle in python/memfit), and the
converters find every optimizer class through memfit.optim._registry, imported or not."""

import subprocess
import sys

import pytest
from test_import_graph import import_graph


def test_the_converters_never_import_a_class_module():
    """convert/ and _registry ask the registry; they import no module that defines
    optimizer classes (which import them)."""
    graph = import_graph()  # tests/test_import_graph.py's walk, which also fails on any circle
    # the layering the walk must see (so that an empty answer below means something)
    assert "memfit.optim.convert" in graph["memfit.optim._torch_state_dict"]
    assert "memfit.optim._torch" in graph["memfit.optim.optimizers"]
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
