#!/usr/bin/env python3
"""Rewrites a CUDA source (cuda/*.cu) into C++ for mfemu, the CPU runtime in this folder.

Two rewrites, each keeping every line where it was (a `#line` directive names the
original file, so compiler messages and mfemu's barrier sites point into cuda/*.cu):

* ``kernel<<<grid, block[, smem[, stream]]>>>(args)`` becomes
  ``mfemu::launcher("kernel", __FILE__, __LINE__, kernel, grid, block[, ...])(args)``
  (templates such as ``optim_quant_kernel<BS, 8>`` and launches inside macros included);
* ``__shared__ T name[N];`` becomes ``MFEMU_SHARED(T name[N], name);``: a static the
  runtime registers, so it can fill it with 0xFF bytes at the start of every block.

The .cu files themselves stay as nvcc compiles them. Usage:
    rewrite_launches.py SRC.cu OUT.cpp
"""
import re
import sys

SHARED = re.compile(r"__shared__\s+([^;{}()]*?\b(\w+)\s*(?:\[[^\]]*\]\s*)*);")
KERNEL_TAIL = re.compile(r"([A-Za-z_]\w*)\s*$")


def _strip(src: str) -> str:
    """src with comments and string literals blanked (same length), for scanning."""
    out = list(src)
    i, n = 0, len(src)
    while i < n:
        if src.startswith("//", i):
            j = src.find("\n", i)
            j = n if j < 0 else j
        elif src.startswith("/*", i):
            j = src.find("*/", i + 2)
            j = n if j < 0 else j + 2
        elif src[i] in "\"'":
            j = i + 1
            while j < n and src[j] != src[i]:
                j += 2 if src[j] == "\\" else 1
            j += 1
        else:
            i += 1
            continue
        for k in range(i, min(j, n)):
            if out[k] != "\n":
                out[k] = " "
        i = j
    return "".join(out)


def _shared(decl: str) -> str:
    """`T a[N], b[M]` -> `MFEMU_SHARED(T a[N], a); MFEMU_SHARED(T b[M], b);`"""
    parts = decl.split(",")  # array bounds of __shared__ declarations hold no commas
    first = re.match(r"(.*?)\b(\w+)\s*((?:\[[^\]]*\]\s*)*)$", parts[0], re.S)
    if not first:
        raise SystemExit(f"rewrite_launches: cannot read the __shared__ declaration {decl!r}")
    type_ = first.group(1)
    out = []
    for i, part in enumerate(parts):
        d = part if i == 0 else type_ + part.strip()
        name = re.match(r".*?\b(\w+)\s*(?:\[[^\]]*\]\s*)*$", d, re.S).group(1)
        out.append(f"MFEMU_SHARED({d}, {name});")
    return " ".join(out)


def _kernel_start(code: str, end: int) -> int:
    """Start of the kernel expression that ends at `end` (a name, maybe <template args>)."""
    j = end
    while j > 0 and code[j - 1].isspace():
        j -= 1
    if j > 0 and code[j - 1] == ">":
        depth = 0
        while j > 0:
            j -= 1
            depth += code[j] == ">"
            depth -= code[j] == "<"
            if depth == 0:
                break
    m = KERNEL_TAIL.search(code, 0, j)
    if not m:
        raise SystemExit(f"rewrite_launches: cannot find the kernel before <<< at offset {end}")
    return m.start(1)


def rewrite(src: str) -> str:
    code = _strip(src)
    edits = []  # (start, end, replacement)
    for m in SHARED.finditer(code):
        edits.append((m.start(), m.end(), _shared(src[m.start(1):m.end(1)])))
    pos = 0
    while True:
        a = code.find("<<<", pos)
        if a < 0:
            break
        b = code.find(">>>", a)
        if b < 0:
            raise SystemExit(f"rewrite_launches: <<< without >>> at offset {a}")
        k = _kernel_start(code, a)
        kernel = src[k:a].strip()
        name = re.sub(r"\s+", " ", kernel)
        cfg = src[a + 3:b]
        edits.append((k, b + 3, f'mfemu::launcher("{name}", __FILE__, __LINE__, {kernel}, {cfg})'))
        pos = b + 3
    edits.sort()
    out, last = [], 0
    for s, e, rep in edits:
        if s < last:
            raise SystemExit("rewrite_launches: overlapping rewrites")
        out.append(src[last:s])
        out.append(rep)
        last = e
    out.append(src[last:])
    return "".join(out)


def main(argv):
    if len(argv) != 3:
        raise SystemExit(__doc__)
    src_path, out_path = argv[1], argv[2]
    with open(src_path, encoding="utf-8") as f:
        src = f.read()
    text = f'#line 1 "{src_path}"\n' + rewrite(src)
    try:
        with open(out_path, encoding="utf-8") as f:
            if f.read() == text:
                return  # unchanged: keep the timestamp, so the build does not recompile
    except OSError:
        pass
    with open(out_path, "w", encoding="utf-8") as f:
        f.write(text)


if __name__ == "__main__":
    main(sys.argv)
