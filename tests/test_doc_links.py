"""Every relative link in the Markdown documentation (README.md, docs/, benchmarks/
RESULTS.md and its history/) points at a file that exists and, with a #fragment, at a
heading of that file (GitHub's anchors: lower case, punctuation dropped, spaces to
hyphens, -1, -2 ... for repeats)."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "RESULTS.md",
        *sorted((ROOT / "benchmarks" / "history").glob("*.md"))]


def anchors(path: Path) -> set:
    out, seen = set(), {}
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    for line in text.splitlines():
        m = re.match(r"#{1,6}\s+(.*)", line)
        if m:
            slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def links(path: Path):
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    for m in re.finditer(r"\]\(([^)\s]+)\)", text):
        if not re.match(r"[a-z]+:", m.group(1)):  # not http:, mailto: ...
            yield m.group(1)


def test_anchor_rule():
    p = ROOT / "benchmarks" / "RESULTS.md"
    assert "bench_amp-memfitamp" in anchors(p) and "amd-epyc-zen-5-avx-512--vbmi" in anchors(p)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc):
    bad = []
    for link in links(doc):
        path, _, fragment = link.partition("#")
        target = (doc.parent / path).resolve() if path else doc
        if not target.exists():
            bad.append(f"{link}: no such file")
        elif fragment and target.suffix == ".md" and fragment not in anchors(target):
            bad.append(f"{link}: no heading with that anchor in {target.name}")
    assert not bad, f"{doc.relative_to(ROOT)}: " + "; ".join(bad)
