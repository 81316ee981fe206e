"""The charts of `memfit demo` (loss curves) and `memfit profile` (memory per
configuration), drawn with matplotlib: a title, axis labels with units and a legend
that names every line or part, so a chart reads without its caption.

matplotlib comes with ``pip install ".[torch]"`` (and every Colab). Without it the
functions raise ImportError with the line that installs it; the commands print that
and write everything else. The figures are drawn on matplotlib's Agg canvas
(``matplotlib.figure.Figure``, not pyplot), so no window opens and a notebook's own
backend and figures are left alone.
"""

from __future__ import annotations

MISSING = ("no chart: matplotlib is not installed; pip install matplotlib "
           "(or pip install \".[torch]\", which includes it) and run the command again")


def _figure():
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise ImportError(MISSING) from None
    return Figure(figsize=(8, 4.5), dpi=100, layout="constrained")


def line_chart(series: dict, path, *, title: str, xlabel: str, ylabel: str):
    """One line per ``label -> y values`` (x: 0, 1, ...), named in the legend; writes a
    PNG to ``path`` and returns the matplotlib Figure."""
    if not series or not any(len(v) for v in series.values()):
        raise ValueError("series: nothing to plot")
    fig = _figure()
    ax = fig.add_subplot()
    for label, ys in series.items():
        ax.plot(range(len(ys)), ys, label=label, linewidth=1.8)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.savefig(path)
    return fig


def stacked_bars(bars: dict, parts: dict, path, *, title: str, xlabel: str, ylabel: str):
    """One stacked bar per ``bar name -> {part: value}``; ``parts`` maps each part, bottom
    first, to its legend label. Writes a PNG to ``path`` and returns the Figure."""
    if not bars:
        raise ValueError("bars: nothing to plot")
    fig = _figure()
    ax = fig.add_subplot()
    names = list(bars)
    bottom = [0.0] * len(names)
    for part, label in parts.items():
        values = [bars[n].get(part, 0.0) for n in names]
        ax.bar(names, values, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, values)]
    for x, total in enumerate(bottom):  # the total above each bar
        ax.annotate(f"{total:.1f}", (x, total), ha="center", va="bottom", fontsize=9)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.margins(y=0.1)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the bars, never over them
    fig.savefig(path)
    return fig
