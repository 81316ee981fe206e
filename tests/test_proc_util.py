"""The suite's child-process helper (tests/proc_util.py): a child killed by a signal
fails the test and names the signal (issue 24 §7), whatever the caller checks."""

import signal
import sys

import pytest

import proc_util

_SUICIDE = "import os, signal; os.kill(os.getpid(), signal.{})"


@pytest.mark.parametrize("sig", ["SIGSEGV", "SIGABRT"])
def test_a_child_killed_by_a_signal_is_a_failure_that_names_it(sig):
    with pytest.raises(AssertionError, match=rf"killed by signal {int(getattr(signal, sig))} \({sig}\)"):
        proc_util.run([sys.executable, "-c", _SUICIDE.format(sig)])
    # check=False (the default) only leaves exit statuses to the caller, never signals
    with pytest.raises(proc_util.ChildKilled, match=sig):
        proc_util.run([sys.executable, "-c", _SUICIDE.format(sig)], check=False)


def test_exit_statuses_are_left_to_the_caller():
    r = proc_util.run([sys.executable, "-c", "import sys; print('out'); sys.exit(3)"])
    assert r.returncode == 3 and r.stdout == "out\n"
    with pytest.raises(Exception, match="non-zero exit status 3"):
        proc_util.run([sys.executable, "-c", "import sys; sys.exit(3)"], check=True)


def test_describe_exit():
    assert proc_util.describe_exit(0) == "exit status 0"
    assert proc_util.describe_exit(-11) == "killed by signal 11 (SIGSEGV)"
    assert proc_util.describe_exit(None) == "still running"
