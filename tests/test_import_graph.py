"""The shape of python/memfit, read from its source with ast (nothing is imported, so
this runs in well under a second and needs neither torch nor memfit._C):

* no import circle among memfit's modules. Every import counts: at module level, and
  deferred into a function or method (a deferred import dodges a circle at import
  time, but the two modules still cannot be understood, or moved, one without the
  other). ``from memfit.x import y`` is an edge to memfit.x.y when y is a module of its
  own, else to memfit.x; relative imports resolve against the importing module's
  package. Importing a submodule also runs its packages' ``__init__``, but that is
  not counted as an edge (every submodule would then "import" its package, and a
  package re-exporting its submodules is not a circle); an explicit ``from memfit.x
  import name`` of a package's attribute is. Calls of ``importlib.import_module`` with
  a computed name (the packages' lazy ``__getattr__``) cannot be read and do not count.
* no Python file over 700 lines (docs: one capability per file, readable on its own).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "python" / "memfit"
MAX_LINES = 700
# compiled modules: imports resolve to them (``from memfit import _C`` is not an import
# of the package memfit), and they import nothing of memfit's
EXTENSIONS = frozenset({"memfit._C"})

def module_name(path: Path) -> str:
    parts = ("memfit",) + path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict:
    """{dotted name: path} for every .py file under python/memfit."""
    return {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _resolve(name: str, known) -> str | None:
    """The deepest module of memfit that ``name`` (a dotted name) is or lies in."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        candidate = ".".join(parts[:n])
        if candidate in known:
            return candidate
    return None


def imports_of(name: str, path: Path, known) -> set:
    """The memfit modules (of ``known``, dotted names) that the module ``name`` (at
    ``path``) imports anywhere in it; compiled ones (EXTENSIONS) left out."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                if node.level > 1:
                    base = base[:-(node.level - 1)]
                if not base:
                    raise AssertionError(f"{path}:{node.lineno}: relative import above memfit")
                base = ".".join(base + ([node.module] if node.module else []))
            else:
                base = node.module
            # each imported name: a submodule when it is one, else an attribute of base
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
                       for alias in node.names]
        else:
            continue
        for target in targets:
            if target == "memfit" or target.startswith("memfit."):
                resolved = _resolve(target, known)
                if resolved is not None and resolved != name and resolved not in EXTENSIONS:
                    out.add(resolved)
    return out


def import_graph() -> dict:
    found = modules()
    known = set(found) | EXTENSIONS
    return {name: imports_of(name, path, known) for name, path in found.items()}


def strongly_connected(graph: dict) -> list:
    """The components of ``graph`` with a circle (Tarjan's algorithm, iterative), each
    a frozenset of module names, in a stable order."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    component.add(top)
                    if top == node:
                        break
                if len(component) > 1:
                    found.append(frozenset(component))
    return sorted(found, key=sorted)


def a_cycle(graph: dict, component: frozenset) -> list:
    """One circle through the component's first module, as the modules in order (the
    first repeated at the end): a shortest path back to it, by breadth-first search."""
    start = min(component)
    previous = {}
    frontier = [start]
    while frontier:
        nxt = []
        for node in frontier:
            for child in sorted(graph[node]):
                if child not in component:
                    continue
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return [start] + path[::-1][1:] + [start] if len(path) > 1 else [start, node, start]
                if child not in previous:
                    previous[child] = node
                    nxt.append(child)
        frontier = nxt
    raise AssertionError(f"no circle through {start} in {sorted(component)}")


def describe(graph: dict, component: frozenset) -> str:
    return (" -> ".join(a_cycle(graph, component))
            + f"  (all {len(component)} modules of this circle: {', '.join(sorted(component))})")


# ---- the checks of the checks -------------------------------------------------------------

def test_the_walk_sees_every_kind_of_import(tmp_path, monkeypatch):
    # a small package of its own, one import of each kind, and circles the walk must name
    pkg = tmp_path / "memfit"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from memfit import a\n")
    (pkg / "a.py").write_text("def f():\n    from memfit.sub import b  # deferred\n")
    (pkg / "sub" / "__init__.py").write_text("X = 1\n")
    (pkg / "sub" / "b.py").write_text("from .. import c\nfrom . import d\n")
    (pkg / "c.py").write_text("class K:\n    def m(self):\n        import memfit.a.thing\n")
    (pkg / "sub" / "d.py").write_text("from ..sub import X\nimport os\nfrom memfit import _C\n"
                                      "from memfit._C import Error\nimport memfit.sub.d\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", pkg)
    graph = import_graph()
    assert graph == {
        "memfit": {"memfit.a"},
        "memfit.a": {"memfit.sub.b"},
        "memfit.c": {"memfit.a"},
        "memfit.sub": set(),
        "memfit.sub.b": {"memfit.c", "memfit.sub.d"},
        "memfit.sub.d": {"memfit.sub"},
    }
    [component] = strongly_connected(graph)
    assert component == {"memfit.a", "memfit.sub.b", "memfit.c"}
    assert a_cycle(graph, component) == ["memfit.a", "memfit.sub.b", "memfit.c", "memfit.a"]
    graph["memfit.sub.d"].add("memfit.sub.d")  # a self-import is not a circle of two
    graph["memfit.sub"].add("memfit.sub.d")
    graph["memfit.sub.d"] = {"memfit.sub"}
    assert strongly_connected(graph) == [component, frozenset({"memfit.sub", "memfit.sub.d"})]
    assert a_cycle(graph, frozenset({"memfit.sub", "memfit.sub.d"})) == [
        "memfit.sub", "memfit.sub.d", "memfit.sub"]


# ---- the checks ---------------------------------------------------------------------------

def test_no_import_circles():
    graph = import_graph()
    assert len(graph) > 50 and "memfit.optim._torch" in graph  # the walk found the package
    components = strongly_connected(graph)
    assert not components, "import circles in python/memfit:\n" + "\n".join(
        describe(graph, c) for c in components)


def test_no_file_over_700_lines():
    lengths = {p.relative_to(ROOT).as_posix(): len(p.read_text(encoding="utf-8").splitlines())
               for p in ROOT.rglob("*.py")}
    long_files = {p: n for p, n in lengths.items() if n > MAX_LINES}
    assert not long_files, f"Python files over {MAX_LINES} lines (split them by capability): {long_files}"
