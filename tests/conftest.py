"""Shared test configuration.

Tests marked ``@pytest.mark.cuda`` need a GPU and a CUDA build of memfit; they are
skipped cleanly (with the reason) everywhere else.
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


def pytest_collection_modifyitems(config, items):
    reason = None
    checked = False
    for item in items:
        if "cuda" in item.keywords:
            if not checked:
                reason, checked = _cuda_reason(), True
            if reason:
                item.add_marker(pytest.mark.skip(reason=reason))
