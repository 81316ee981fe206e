"""A dependency-free PNG line chart, so `memfit demo` can draw its loss curves on any
machine (no matplotlib needed). Lines only: axes, ticks as short marks, one colour
per series, and a legend of coloured swatches; labels go into the caption printed
beside the file."""

from __future__ import annotations

import struct
import zlib

PALETTE = [(31, 119, 180), (214, 39, 40), (44, 160, 44), (148, 103, 189), (255, 127, 14)]


def _png(width: int, height: int, rows: list) -> bytes:
    raw = b"".join(b"\x00" + bytes(r) for r in rows)

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b"")


class _Canvas:
    """A white RGB image with what both charts draw the same way: the plot area's two
    axes, the legend's swatches (one row per series or part) and the PNG file."""

    def __init__(self, width: int, height: int):
        self.width, self.height = width, height
        self.img = [[255] * (3 * width) for _ in range(height)]
        self.left, self.right, self.top, self.bottom = 50, width - 20, 20, height - 40
        for x in range(self.left, self.right + 1):
            self.put(x, self.bottom, (0, 0, 0))
        for y in range(self.top, self.bottom + 1):
            self.put(self.left, y, (0, 0, 0))

    def put(self, x: int, y: int, c) -> None:
        if 0 <= x < self.width and 0 <= y < self.height:
            self.img[y][3 * x:3 * x + 3] = c

    def swatch(self, k: int, c) -> None:
        for dx in range(12):
            for dy in range(6):
                self.put(self.right - 20 + dx, self.top + 12 * k + dy, c)

    def save(self, path) -> None:
        with open(path, "wb") as f:
            f.write(_png(self.width, self.height, self.img))


def line_chart(series: dict, path, width: int = 640, height: int = 400) -> dict:
    """Draws each ``name -> list of y values`` (x = index) and writes a PNG.

    Returns the axis ranges and the colour of each series (for a caption)."""
    if not series or not any(series.values()):
        raise ValueError("series: nothing to plot")
    canvas = _Canvas(width, height)
    put, left, right, top, bottom = canvas.put, canvas.left, canvas.right, canvas.top, canvas.bottom
    ys = [v for vals in series.values() for v in vals]
    y0, y1 = min(ys), max(ys)
    if y1 == y0:
        y1 = y0 + 1.0
    xmax = max(len(v) for v in series.values()) - 1 or 1
    for i in range(6):  # tick marks
        tx = left + (right - left) * i // 5
        ty = bottom - (bottom - top) * i // 5
        for d in range(5):
            put(tx, bottom + d, (0, 0, 0))
            put(left - d, ty, (0, 0, 0))

    def to_px(i, v):
        return (left + round((right - left) * i / xmax), bottom - round((bottom - top) * (v - y0) / (y1 - y0)))

    colours = {}
    for k, (name, vals) in enumerate(series.items()):
        c = PALETTE[k % len(PALETTE)]
        colours[name] = c
        pts = [to_px(i, v) for i, v in enumerate(vals)]
        for (xa, ya), (xb, yb) in zip(pts, pts[1:]):
            steps = max(abs(xb - xa), abs(yb - ya), 1)
            for s in range(steps + 1):
                x = xa + (xb - xa) * s // steps
                y = ya + (yb - ya) * s // steps
                for dx in (0, 1):
                    put(x + dx, y, c)
                    put(x, y + dx, c)
        canvas.swatch(k, c)
    canvas.save(path)
    return {"x": (0, xmax), "y": (y0, y1), "colours": colours}


def stacked_bars(bars: dict, parts: list, path, width: int = 640, height: int = 400) -> dict:
    """One stacked bar per ``name -> {part: value}``, parts in the order given
    (bottom first), one colour per part. Writes a PNG; returns the colours."""
    if not bars:
        raise ValueError("bars: nothing to plot")
    canvas = _Canvas(width, height)
    put, left, right, top, bottom = canvas.put, canvas.left, canvas.right, canvas.top, canvas.bottom
    top_value = max(sum(v.get(p, 0) for p in parts) for v in bars.values()) or 1
    colours = {p: PALETTE[i % len(PALETTE)] for i, p in enumerate(parts)}
    slot = (right - left) // len(bars)
    for i, values in enumerate(bars.values()):
        x0, x1 = left + i * slot + slot // 4, left + (i + 1) * slot - slot // 4
        level = 0.0
        for p in parts:
            v = values.get(p, 0)
            ya = bottom - round((bottom - top) * level / top_value)
            level += v
            yb = bottom - round((bottom - top) * level / top_value)
            for y in range(yb, ya):
                for x in range(x0, x1):
                    put(x, y, colours[p])
    for k, p in enumerate(parts):
        canvas.swatch(k, colours[p])
    canvas.save(path)
    return {"colours": colours, "max": top_value}


# ---- charts for the command line: matplotlib when installed, else the writers above ----

def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def _caption(colours: dict, labels: dict | None = None) -> str:
    return "built-in plotter: " + ", ".join(f"{(labels or {}).get(k, k)} rgb{v}" for k, v in colours.items())


def _save(plt, fig, ax, path) -> str:
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return "matplotlib"


def plot_lines(series: dict, path, xlabel: str, ylabel: str) -> str:
    """Line chart of ``name -> y values``; returns how it was drawn (for a caption)."""
    plt = _pyplot()
    if plt is None:
        return _caption(line_chart(series, path)["colours"])
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, ys in series.items():
        ax.plot(ys, label=name)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    return _save(plt, fig, ax, path)


def plot_stacked(bars: dict, parts: list, labels: dict, path, ylabel: str) -> str:
    """Stacked bars ``name -> {part: value}``, parts bottom first, named by ``labels``."""
    plt = _pyplot()
    if plt is None:
        return _caption(stacked_bars(bars, parts, path)["colours"], labels)
    fig, ax = plt.subplots(figsize=(7, 4))
    bottom = [0.0] * len(bars)
    for part in parts:
        vals = [v.get(part, 0) for v in bars.values()]
        ax.bar(list(bars), vals, bottom=bottom, label=labels.get(part, part))
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_ylabel(ylabel)
    return _save(plt, fig, ax, path)
