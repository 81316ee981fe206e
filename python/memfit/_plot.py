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


def _figure(size=(8, 4.5)):
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise ImportError(MISSING) from None
    return Figure(figsize=size, dpi=100, layout="constrained")


def target(path, name: str = "path") -> str:
    """The file a chart for ``path`` goes to: ``path`` itself, or ``path + ".png"`` when
    it names no format (matplotlib's own rule, made visible so that the commands print
    and record the file they wrote). Checked before anything is drawn, with ValueError
    naming ``name``: an empty path, a path ending in a separator or a dot, a directory,
    an existing file that is not a regular one (/dev/null, a FIFO: matplotlib would
    write beside it, e.g. /dev/null.png), a format matplotlib cannot write, and .pgf
    without the TeX program matplotlib runs for it."""
    import os
    import shutil
    from pathlib import Path

    from memfit.memory import shown

    text = os.fspath(path)
    what = shown(text, limit=240)
    if not text:
        raise ValueError(f"{name}: empty; give a file name like chart.png")
    if text.endswith((os.sep, "/")) or os.path.isdir(text):
        inside = shown(os.path.join(text, "chart.png"), limit=240)
        raise ValueError(f"{name}: {what} names a directory; give a file name in it, like {inside}")
    if os.path.basename(text).endswith("."):
        raise ValueError(f"{name}: {what} ends with a dot and names no format; end it with .png, .svg or .pdf")
    if not Path(text).suffix:  # as matplotlib does: no suffix, a PNG named with one
        if os.path.exists(text) and not os.path.isfile(text):
            raise ValueError(f"{name}: {what} is not a regular file (a device or a pipe); give a file name "
                             "like chart.png")
        text += ".png"
        what = shown(text, limit=240)
    if os.path.exists(text) and not os.path.isfile(text):
        kind = "a directory" if os.path.isdir(text) else "not a regular file (a device or a pipe)"
        raise ValueError(f"{name}: {what} is {kind}; give a file name like chart.png")
    suffix = Path(text).suffix[1:].lower()
    try:
        import matplotlib
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:  # the chart function says how to install it
        return text
    if suffix not in FigureCanvasBase.get_supported_filetypes():
        raise ValueError(f"{name}: cannot write {what}: matplotlib writes no {suffix!r} images "
                         "(use .png, .svg or .pdf)")
    tex = matplotlib.rcParams["pgf.texsystem"]
    if suffix == "pgf" and shutil.which(tex) is None:
        raise ValueError(f"{name}: cannot write {what}: matplotlib's .pgf output runs {tex} (TeX), which is "
                         "not installed here (use .png, .svg or .pdf)")
    return text


def save(fig, path) -> str:
    """``fig.savefig`` to :func:`target`'s file for ``path`` (none: PNG); returns that
    file's path. ValueError naming the path for a path or format refused there, or a
    format whose writer fails (matplotlib's RuntimeError: TeX missing or failing);
    OSError for a path that cannot be written (a NUL byte in it included)."""
    real = target(path)
    try:
        fig.savefig(real)
    except ValueError as e:  # "embedded null byte" from open()
        raise OSError(str(e)) from None
    except RuntimeError as e:  # e.g. the pgf or usetex writers without a working TeX
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ValueError(f"cannot write {real}: {first}") from None
    return real


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
    save(fig, path)
    return fig


def _stack(ax, xs, stacks, parts: dict, *, width=0.8, hatch=None, legend=True):
    """One stacked bar at each x of ``stacks`` ({part: value} each), part i in colour
    C{i} (the same colour for a part in every call), bottom first, with its total
    written above it; ``legend``: label the parts for the legend."""
    bottom = [0.0] * len(xs)
    for i, (part, label) in enumerate(parts.items()):
        values = [s.get(part, 0.0) for s in stacks]
        ax.bar(xs, values, width, bottom=bottom, color=f"C{i}", hatch=hatch, edgecolor="white" if hatch else None,
               linewidth=0, label=label if legend else None)
        bottom = [b + v for b, v in zip(bottom, values)]
    for x, total in zip(xs, bottom):
        ax.annotate(f"{total:.1f}", (x, total), ha="center", va="bottom", fontsize=9)


def _finish(fig, ax, path, title, xlabel, ylabel):
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.margins(y=0.1)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the bars, never over them
    save(fig, path)
    return fig


def stacked_bars(bars: dict, parts: dict, path, *, title: str, xlabel: str, ylabel: str):
    """One stacked bar per ``bar name -> {part: value}``; ``parts`` maps each part, bottom
    first, to its legend label. Writes a PNG to ``path`` and returns the Figure."""
    if not bars:
        raise ValueError("bars: nothing to plot")
    fig = _figure()
    ax = fig.add_subplot()
    names = list(bars)
    _stack(ax, names, [bars[n] for n in names], parts)
    return _finish(fig, ax, path, title, xlabel, ylabel)


def paired_stacked_bars(groups: dict, parts: dict, path, *, title: str, xlabel: str, ylabel: str,
                        pair: tuple = ("left", "right"), limits: dict | None = None):
    """Two stacked bars side by side per ``group name -> ({part: value}, {part: value})``,
    the right one hatched (``pair`` names the two in the legend); ``limits``: legend
    label -> value, each drawn as a dashed horizontal line. Writes the file and returns
    the Figure."""
    import textwrap

    if not groups:
        raise ValueError("groups: nothing to plot")
    from matplotlib.patches import Patch

    fig = _figure((10, 6))
    ax = fig.add_subplot()
    names = list(groups)
    xs = range(len(names))
    width = 0.38
    _stack(ax, [x - width / 2 for x in xs], [groups[n][0] for n in names], parts, width=width)
    _stack(ax, [x + width / 2 for x in xs], [groups[n][1] for n in names], parts, width=width, hatch="//",
           legend=False)
    for i, (label, value) in enumerate((limits or {}).items()):
        ax.axhline(value, color="black" if i == 0 else "0.45", linestyle="--" if i == 0 else ":",
                   linewidth=1.2, label=label)
    ax.set_xticks(list(xs), [textwrap.fill(n, 13) for n in names])
    ax.add_artist(ax.legend(handles=[Patch(facecolor="0.6", label=f"{pair[0]}: plain bar"),
                                     Patch(facecolor="0.6", hatch="//", edgecolor="white",
                                           label=f"{pair[1]}: hatched bar")],
                            loc="lower left", bbox_to_anchor=(1.01, 0.0)))
    return _finish(fig, ax, path, title, xlabel, ylabel)
