"""Shared helpers for memfit's benchmark scripts: timing (interleaved medians, CUDA
events on a GPU), the measured copy-bandwidth floor, a progress bar, and run metadata
(machine, date, commit) so every JSON and table says where its numbers came from."""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

OUT_DIR = Path(__file__).resolve().parent / "out"


def metadata(device: str) -> dict:
    import memfit
    from memfit.hardware import cpu_info

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, cwd=Path(__file__).parent).stdout.strip() or "unknown"
    except OSError:
        commit = "unknown"
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": commit,
        "memfit": memfit.__version__,
        "python": platform.python_version(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_model": cpu_info()["model_name"],
        "cores": os.cpu_count(),
        "memfit_threads": memfit.get_num_threads(),
        "memfit_cpu_kernels": memfit.cpu_kernels(),
        "memfit_optim_kernel": memfit.optim_kernel(),
        "device": device,
    }
    from importlib import metadata as md

    for peer in ("bitsandbytes", "torchao"):
        try:
            meta[peer] = md.version(peer)
        except md.PackageNotFoundError:
            pass
    try:
        import torch

        meta["torch"] = torch.__version__
        meta["torch_threads"] = torch.get_num_threads()
        if device == "cuda":
            meta["gpu"] = torch.cuda.get_device_name()
    except ImportError:
        pass
    return meta


class Progress:
    """A one-line progress bar on stderr (silent when stderr is not a terminal and
    MEMFIT_PROGRESS is unset, so logs stay clean)."""

    def __init__(self, total: int, label: str):
        self.total, self.label, self.done = max(total, 1), label, 0
        self.enabled = sys.stderr.isatty() or bool(os.environ.get("MEMFIT_PROGRESS"))

    def step(self, what: str = ""):
        self.done += 1
        if self.enabled:
            width = 30
            filled = int(width * self.done / self.total)
            sys.stderr.write(f"\r{self.label} [{'#' * filled}{'.' * (width - filled)}] "
                             f"{self.done}/{self.total} {what[:40]:<40}")
            if self.done == self.total:
                sys.stderr.write("\n")
            sys.stderr.flush()


def per_core_line(before: dict, after: dict) -> str:
    """The per-core speed line of the optimizer benchmarks: {cpu: ms} of a single-thread
    AdamW8bit step over 262144 params pinned to each core, before and after the run."""
    def fmt(d):
        return ", ".join(f"cpu{c} {ms:.3f}" for c, ms in d.items())

    return (f"per-core speed (single-thread AdamW8bit step, 262144 params, ms): before {fmt(before)}; "
            f"after {fmt(after)}")


def make_timer(device: str, clock: str = "wall"):
    """Returns time_once(fn) -> seconds for one call, synchronised properly. On the CPU,
    clock="cpu" counts this process's CPU time instead of wall time: on a machine shared
    with other jobs it leaves out the time the scheduler gave to them (threads that
    spin-wait still count)."""
    if device == "cuda":
        import torch

        def time_once(fn):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3

        return time_once

    now = time.process_time if clock == "cpu" else time.perf_counter

    def time_once(fn):
        t0 = now()
        fn()
        return now() - t0

    return time_once


def interleaved_medians(fns: dict, reps: int, device: str, warmup: int = 2,
                        clock: str = "wall") -> dict:
    """Median seconds per call for each named function, calling them in turn
    (A B C A B C ...) so machine noise hits all of them alike."""
    time_once = make_timer(device, clock)
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    samples = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            samples[name].append(time_once(fn))
    return {name: statistics.median(s) for name, s in samples.items()}


def copy_bandwidth(device: str, nbytes: int = 1 << 28, reps: int = 10) -> float:
    """Measured copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    import torch

    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    t = interleaved_medians({"copy": lambda: dst.copy_(src)}, reps, device)["copy"]
    return 2 * nbytes / t


def write_json(name: str, payload: dict) -> Path:
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    path = OUT_DIR / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2))
    try:
        return path.relative_to(Path.cwd())
    except ValueError:
        return path


def markdown_table(headers: list, rows: list) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)
