"""Every Python example in README.md runs as written (on the CPU here)."""

import re
from pathlib import Path

import pytest

pytest.importorskip("torch")

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_examples():
    assert len(BLOCKS) >= 4


@pytest.mark.parametrize("code", BLOCKS, ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_readme_example_runs(code):
    exec(compile(code, "README.md", "exec"), {"__name__": "__readme__"})
