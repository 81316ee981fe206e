"""Shared test configuration.

Tests marked ``@pytest.mark.cuda`` need a GPU and a CUDA build of memfit; they are
skipped cleanly (with the reason) everywhere else.

The suite runs on pytest-xdist, one worker process per CPU (``-n auto --dist
loadgroup`` in pyproject.toml; ``-n 0`` runs in one process, as ``--pdb`` does): tests that
share a fixture living longer than one test (a module-, class- or session-scoped one of
this project, a build or a multi-process run, say) are put into one xdist group, so
one worker runs them all and the fixture is made once, not once per worker. A test
needs nothing else to be safe under xdist so long as it writes only under its tmp_path
(each worker has its own) or, for a build under <repo>/build, holds the folder's lock
(emulated_util.locked).
"""

import importlib.util
import os

import pytest
from hypothesis import HealthCheck, settings

import memfit

# Property-based tests (tests/test_properties.py): in CI a fixed, derandomized set of
# examples per property, small enough for the suite's time budget; set
# MEMFIT_HYPOTHESIS_PROFILE=thorough for a long randomized search (say, before a release).
settings.register_profile("ci", derandomize=True, max_examples=30, deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("thorough", max_examples=2000, deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("MEMFIT_HYPOTHESIS_PROFILE", "ci"))


def _cuda_reason():
    if not memfit.build_info()["cuda"]:
        return "memfit was built without CUDA"
    if memfit.cuda_device_count() == 0:
        return "no CUDA GPU visible"
    if importlib.util.find_spec("torch") is None:
        return "torch is not installed"
    import torch

    if not torch.cuda.is_available():
        return "torch has no CUDA support here"
    return None


@pytest.hookimpl(optionalhook=True)  # a hook of xdist's: no error where it is not loaded
def pytest_xdist_auto_num_workers(config):
    """-n auto: one worker per CPU this process may use (xdist's own default counts
    physical cores, which some 2-vCPU cloud machines report as one)."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return int(os.environ["PYTEST_XDIST_AUTO_NUM_WORKERS"])
    return _cpus()


def _cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def pytest_configure(config):
    """In an xdist worker, torch's own thread pool gets this worker's share of the CPUs
    (one each with one worker per CPU): torch is the reference and the harness here,
    its thread count is not what a test checks, and with every worker's pool as wide as
    the machine the spinning threads made the torch-heavy tests 2 to 3 times slower
    (tests/test_checkpoint.py and test_compile.py, 2 workers on 2 cores). torch's count
    is OpenMP's for this thread, which memfit's default (memfit.get_num_threads() with
    nothing set) follows too: in a worker memfit's kernels run on that share unless a
    test sets memfit.set_num_threads, as the tests of how the C core splits work across
    threads do (tests/test_optim.py); the C core's and the emulated kernels' own tests
    run in subprocesses with the machine's width."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers and importlib.util.find_spec("torch") is not None:
        import torch

        torch.set_num_threads(max(1, _cpus() // int(workers)))


def _shared_fixtures(item) -> set:
    """The project's fixtures longer-lived than a test that ``item`` asks for, directly
    or through other fixtures (autouse ones, which carry no shared result, excepted)."""
    defs = item._fixtureinfo.name2fixturedefs
    found, todo = set(), list(item._fixtureinfo.argnames)
    while todo:
        name = todo.pop()
        if name not in defs or name in found:
            continue
        fd = defs[name][-1]
        found.add(name)
        todo.extend(fd.argnames)
    return {(defs[n][-1].baseid, n) for n in found
            if defs[n][-1].scope != "function" and defs[n][-1].baseid}


def _group_by_shared_fixture(items) -> None:
    """One xdist_group per set of tests linked by a shared fixture (see the docstring
    at the top); tests already in a group keep theirs."""
    parent = {}

    def find(k):
        while parent.setdefault(k, k) != k:
            k = parent[k]
        return k

    shared = {}
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            keys = sorted(_shared_fixtures(item))
            shared[item] = keys
            for k in keys[1:]:
                parent[find(k)] = find(keys[0])
    for item, keys in shared.items():
        if keys:
            baseid, name = find(keys[0])
            item.add_marker(pytest.mark.xdist_group(f"{baseid}::{name}"))


# tryfirst: xdist's worker names each test by its group in its own hook, which runs
# before a conftest's otherwise
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    _group_by_shared_fixture(items)
    reason = None
    checked = False
    for item in items:
        if "cuda" in item.keywords:
            if not checked:
                reason, checked = _cuda_reason(), True
            if reason:
                item.add_marker(pytest.mark.skip(reason=reason))
