"""Every notebook opens with the one install cell of notebooks/install_cell.py, and the
README lists every notebook with its "Open in Colab" link (cheap: no notebook runs here;
tests/test_notebooks.py runs them). The cell's behaviour is run here too, in a child
Python: it skips where memfit imports, asks for MEMFIT_REPO rather than calling pip with
the placeholder, and hands pip a git URL or a local path."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import memfit

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("install_cell", ROOT / "notebooks" / "install_cell.py")
install_cell = importlib.util.module_from_spec(spec)
spec.loader.exec_module(install_cell)

NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def test_there_are_notebooks():
    assert len(NOTEBOOKS) >= 9 and install_cell.notebooks() == NOTEBOOKS


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_first_code_cell_is_the_install_cell(path):
    cells = json.loads(path.read_text())["cells"]
    code = [c for c in cells if c["cell_type"] == "code"]
    assert "".join(code[0]["source"]) == install_cell.CELL, (
        f"{path.name}: the first code cell is not notebooks/install_cell.py's CELL "
        "(run python notebooks/install_cell.py)")
    # nothing before it but the notebook's title and text
    assert all(c["cell_type"] == "markdown" for c in cells[:cells.index(code[0])])
    # no other cell installs memfit its own way
    for c in code[1:]:
        src = "".join(c["source"])
        assert "MEMFIT_REPO" not in src and "pip install" not in src, (path.name, src)


def test_the_url_is_written_once():
    # in install_cell.py, one definition; the notebooks and the README are written from it
    text = (ROOT / "notebooks" / "install_cell.py").read_text()
    assert text.count(install_cell.REPOSITORY) == 1


def test_readme_lists_every_notebook_with_its_colab_link():
    readme = (ROOT / "README.md").read_text()
    assert install_cell.readme_block() in readme, (
        "README's notebook table is not what notebooks/install_cell.py writes "
        "(run python notebooks/install_cell.py)")
    for nb in NOTEBOOKS:
        url = install_cell.colab_url(nb)
        assert url.startswith("https://colab.research.google.com/github/")
        assert url.endswith(f"/blob/main/notebooks/{nb.name}") and readme.count(url) == 1


def test_colab_url_from_a_git_url():
    nb = NOTEBOOKS[0]
    for repo in ("https://github.com/me/memfit", "git+https://github.com/me/memfit.git"):
        assert install_cell.colab_url(nb, repo) == (
            f"https://colab.research.google.com/github/me/memfit/blob/main/notebooks/{nb.name}")


def run_cell(tmp_path, source, memfit_importable, repo=None):
    """Runs the cell in a fresh Python whose `pip` is a stand-in that records its
    arguments (no network, nothing installed)."""
    fake = tmp_path / "fakepip"
    (fake / "pip").mkdir(parents=True)
    (fake / "pip" / "__init__.py").write_text("")  # a regular package: found before pip's own
    (fake / "pip" / "__main__.py").write_text(
        "import sys, pathlib\n"
        f"pathlib.Path({str(tmp_path / 'pip_args')!r}).write_text('\\n'.join(sys.argv[1:]))\n"
        "print('fake pip ran')\n")
    env = {k: v for k, v in os.environ.items() if k not in ("MEMFIT_REPO", "PYTHONPATH")}
    # where this process found memfit: the source tree with its build (a developer's
    # PYTHONPATH) or site-packages (the README's test command installs it there)
    paths = [str(fake)] + ([str(Path(memfit.__file__).resolve().parent.parent)] if memfit_importable else [])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    if repo is not None:
        env["MEMFIT_REPO"] = repo
    # -S: no site-packages, where the README's test command installs memfit; the cell's
    # pip child (the stand-in, first on PYTHONPATH) runs without it
    flags = [] if memfit_importable else ["-S"]
    return subprocess.run([sys.executable, *flags, "-c", source], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=120)


def test_cell_does_nothing_where_memfit_imports(tmp_path):
    r = run_cell(tmp_path, install_cell.CELL, memfit_importable=True, repo="https://x.invalid/m")
    assert r.returncode == 0, r.stderr
    assert not (tmp_path / "pip_args").exists() and "installing" not in r.stdout
    assert r.stdout.startswith("memfit ")


def test_cell_with_the_placeholder_asks_for_memfit_repo(tmp_path):
    r = run_cell(tmp_path, install_cell.CELL, memfit_importable=False)
    assert r.returncode != 0 and not (tmp_path / "pip_args").exists()
    assert "set os.environ['MEMFIT_REPO']" in r.stderr


@pytest.mark.parametrize("repo, expected", [
    ("https://github.com/me/memfit", "git+https://github.com/me/memfit"),
    ("git+https://github.com/me/memfit@v1", "git+https://github.com/me/memfit@v1"),
    ("/content/memfit", "/content/memfit"),
])
def test_cell_hands_pip_the_source(tmp_path, repo, expected):
    # memfit is not importable before or after the fake pip: the cell's last import fails,
    # after pip was called with the right arguments
    r = run_cell(tmp_path, install_cell.CELL, memfit_importable=False, repo=repo)
    args = (tmp_path / "pip_args").read_text().splitlines()
    assert args[0] == "install" and args[-1] == expected
    assert "fake pip ran" in r.stdout  # pip's output is printed by the cell
    assert "No module named 'memfit'" in r.stderr


def test_cell_for_a_fork_installs_from_its_url(tmp_path):
    cell = install_cell.cell_source("https://github.com/me/memfit")
    r = run_cell(tmp_path, cell, memfit_importable=False)
    assert (tmp_path / "pip_args").read_text().splitlines()[-1] == "git+https://github.com/me/memfit"
