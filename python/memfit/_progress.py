"""Progress of `memfit demo` and `memfit profile`: tqdm's bar when tqdm is installed
(``tqdm.auto``: a widget in notebooks, a text bar in a terminal; tqdm comes with
``pip install ".[torch]"``), else a one-line bar of memfit's own on stderr, drawn only
on a terminal or when ``MEMFIT_PROGRESS`` is set, so logs stay clean.
``MEMFIT_PROGRESS=0`` turns both off."""

from __future__ import annotations

import os
import sys


def _tqdm():
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm


class Progress:
    """A bar over ``total`` steps named ``label``; ``update(loss)`` after each step."""

    def __init__(self, total: int, label: str):
        self.total, self.label, self.done = max(int(total), 1), label, 0
        setting = os.environ.get("MEMFIT_PROGRESS")
        tqdm = _tqdm() if setting != "0" else None
        self.bar = tqdm(total=self.total, desc=label, unit="step") if tqdm is not None else None
        self.text = self.bar is None and setting != "0" and (bool(setting) or sys.stderr.isatty())

    def update(self, loss: float | None = None) -> None:
        self.done += 1
        if self.bar is not None:
            if loss is not None:
                self.bar.set_postfix(loss=f"{loss:.3f}", refresh=False)
            self.bar.update(1)
            if self.done >= self.total:
                self.bar.close()
        elif self.text:
            width = 30
            filled = int(width * self.done / self.total)
            tail = f" loss {loss:.3f}" if loss is not None else ""
            sys.stderr.write(f"\r{self.label:<9} [{'#' * filled}{'.' * (width - filled)}] "
                             f"{self.done}/{self.total}{tail}")
            if self.done >= self.total:
                sys.stderr.write("\n")
            sys.stderr.flush()
