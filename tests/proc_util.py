"""Running child processes in tests: a child killed by a signal (a segfault, an abort)
is a failure that names the signal, never a return code that some check happens to
accept or ignore (subprocess reports it as a negative return code, which ``!= 0``
tests catch but probes such as "the output if it succeeded, else None" swallow)."""

from __future__ import annotations

import signal
import subprocess


def describe_exit(returncode: int | None) -> str:
    """'exit status 2', 'killed by signal 11 (SIGSEGV)', or 'still running'."""
    if returncode is None:
        return "still running"
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = "unknown signal"
        return f"killed by signal {-returncode} ({name})"
    return f"exit status {returncode}"


class ChildKilled(AssertionError):
    """A child process ended by a signal."""


def check_not_killed(proc: subprocess.CompletedProcess, what: str | None = None) -> subprocess.CompletedProcess:
    """Raises ChildKilled (an AssertionError: the test fails) when ``proc`` was killed
    by a signal, with the signal's name and the child's output; returns ``proc``."""
    if proc.returncode is not None and proc.returncode < 0:
        cmd = what or (" ".join(map(str, proc.args)) if isinstance(proc.args, (list, tuple)) else str(proc.args))
        out = proc.stdout if isinstance(proc.stdout, str) else (proc.stdout or b"").decode(errors="replace")
        err = proc.stderr if isinstance(proc.stderr, str) else (proc.stderr or b"").decode(errors="replace")
        raise ChildKilled(f"{cmd}: {describe_exit(proc.returncode)}\n"
                          f"--- stdout (last 4000) ---\n{out[-4000:]}\n--- stderr (last 4000) ---\n{err[-4000:]}")
    return proc


def run(cmd, *, what: str | None = None, **kwargs) -> subprocess.CompletedProcess:
    """subprocess.run(cmd, capture_output=True, text=True, **kwargs), failing the test
    with the signal's name when the child was killed by one (whatever ``check`` says:
    a non-zero exit status is left to the caller, a signal never is)."""
    kwargs.setdefault("capture_output", True)
    kwargs.setdefault("text", True)
    check = kwargs.pop("check", False)
    proc = check_not_killed(subprocess.run(cmd, **kwargs), what)
    if check:
        proc.check_returncode()
    return proc
