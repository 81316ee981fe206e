"""The install cell every notebook opens with, and the README's "Open in Colab" links:
the one place the repository's URL is written.

    python notebooks/install_cell.py                      # rewrite both from REPOSITORY
    python notebooks/install_cell.py --repository URL     # a fork: its own URL, then rewrite

tests/test_notebook_install.py checks that every notebook's first code cell is CELL and
that the README lists every notebook with its link, so neither can drift from this file.
"""

import argparse
import json
import re
import sys
from pathlib import Path

# Where the notebooks install memfit from. A placeholder until the project is published:
# with it, the cell asks for MEMFIT_REPO instead of failing inside pip; a fork sets its own
# URL with --repository. The environment variable MEMFIT_REPO (a git URL or a local path)
# overrides it at run time.
REPOSITORY = "https://github.com/OWNER/memfit"
PLACEHOLDER = "/OWNER/"
BRANCH = "main"

HERE = Path(__file__).resolve().parent
README = HERE.parent / "README.md"
BEGIN = "<!-- notebooks: written by notebooks/install_cell.py -->"
END = "<!-- end of notebooks -->"

CELL_TEMPLATE = '''\
# Installs memfit where `import memfit` fails (Colab, a fresh environment); does nothing
# where it works. Source: $MEMFIT_REPO if set (a git URL or a local path), else the URL
# below. The same cell opens every notebook (written by notebooks/install_cell.py).
# Installing compiles memfit (with CUDA kernels for this machine's GPU when nvcc is
# found): a few minutes.
import importlib, importlib.util, os, subprocess, sys
MEMFIT_REPOSITORY = "{repository}"
if importlib.util.find_spec("memfit") is None:
    source = os.environ.get("MEMFIT_REPO") or MEMFIT_REPOSITORY
    if "{placeholder}" in source:
        raise SystemExit("memfit is not installed and this copy does not name its repository: "
                         "set os.environ['MEMFIT_REPO'] = '<git URL or local path>' and rerun")
    if "://" in source and not source.startswith("git+"):
        source = "git+" + source
    print(f"installing memfit from {{source}} (compiling: a few minutes)", flush=True)
    pip = subprocess.Popen([sys.executable, "-m", "pip", "install", "--progress-bar", "off", source],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in pip.stdout:  # through print: a notebook does not show a child's own output
        print(line, end="")
    if pip.wait():
        raise SystemExit(f"pip install {{source}} failed (exit {{pip.returncode}}): see above")
    importlib.invalidate_caches()
import memfit
print("memfit", memfit.__version__, "| CUDA archs:", memfit.build_info()["cuda_archs"] or "none (CPU build)")'''


def cell_source(repository: str = REPOSITORY) -> str:
    return CELL_TEMPLATE.format(repository=repository, placeholder=PLACEHOLDER)


CELL = cell_source()


def notebooks() -> list:
    return sorted(HERE.glob("*.ipynb"))


def colab_url(notebook: Path, repository: str = REPOSITORY) -> str:
    owner_repo = re.sub(r"^(git\+)?https://github\.com/", "", repository).removesuffix(".git")
    return (f"https://colab.research.google.com/github/{owner_repo}/blob/{BRANCH}/"
            f"notebooks/{notebook.name}")


def title(notebook: Path) -> str:
    """The notebook's title: the first line of its first markdown cell, without '#'."""
    nb = json.loads(notebook.read_text())
    first = next(c for c in nb["cells"] if c["cell_type"] == "markdown")
    return "".join(first["source"]).splitlines()[0].lstrip("# ").strip()


def readme_block(repository: str = REPOSITORY) -> str:
    rows = [BEGIN, "", "| notebook | | |", "|---|---|---|"]
    for nb in notebooks():
        rows.append(f"| [{nb.stem}](notebooks/{nb.name}) | {title(nb)} | "
                    f"[![Open in Colab](https://colab.research.google.com/assets/colab-badge.svg)]"
                    f"({colab_url(nb, repository)}) |")
    return "\n".join(rows + ["", END])


def write_cell(notebook: Path, source: str) -> None:
    """Make `source` the notebook's first code cell: replace the first code cell if it is
    an install cell (an older one too), else insert it before the first code cell."""
    nb = json.loads(notebook.read_text())
    cells = nb["cells"]
    i = next(k for k, c in enumerate(cells) if c["cell_type"] == "code")
    lines = source.splitlines(keepends=True)
    new = {"cell_type": "code", "execution_count": None, "id": "memfit-install", "metadata": {},
           "outputs": [], "source": lines}
    if "memfit" in "".join(cells[i]["source"]) and "install" in "".join(cells[i]["source"]):
        new["metadata"] = cells[i].get("metadata", {})
        cells[i] = new
    else:
        cells.insert(i, new)
    notebook.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")


def write_readme(repository: str) -> None:
    text = README.read_text()
    start, end = text.index(BEGIN), text.index(END) + len(END)
    README.write_text(text[:start] + readme_block(repository) + text[end:])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repository", default=REPOSITORY,
                    help="the git URL the notebooks install from (https://github.com/OWNER/NAME)")
    args = ap.parse_args(argv)
    if args.repository != REPOSITORY:  # keep this file the one place the URL is written
        me = Path(__file__)
        me.write_text(me.read_text().replace(f'REPOSITORY = "{REPOSITORY}"',
                                             f'REPOSITORY = "{args.repository}"', 1))
    for nb in notebooks():
        write_cell(nb, cell_source(args.repository))
    write_readme(args.repository)
    print(f"{len(notebooks())} notebooks and README.md now install from {args.repository}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
