"""The functional optimizer API's argument errors (issue 24 §6): a state that is not
what init returned, and betas that are not a pair, are named with what is expected,
before anything changes."""

import numpy as np
import pytest

from memfit.optim import functional as F


def _param():
    return np.random.default_rng(0).standard_normal(4096).astype(np.float32)


def _grad():
    return np.random.default_rng(1).standard_normal(4096).astype(np.float32)


@pytest.mark.parametrize("state,error,message", [
    (None, TypeError, r"state: expected the dict that adamw's init returned .*got NoneType"),
    ([], TypeError, r"state: expected the dict that adamw's init returned .*got list"),
    ({}, ValueError, r"state: has no 'step', 'bits', 'block_size', 'state1'"),
])
def test_state_that_is_not_inits_dict_is_named(state, error, message):
    p = _param()
    before = p.copy()
    with pytest.raises(error, match=message):
        F.adamw8bit_step(p, _grad(), state)
    assert np.array_equal(p, before)


@pytest.mark.parametrize("key", ["bits", "block_size", "state2"])
def test_state_without_a_key_names_the_key(key):
    p = _param()
    st = F.adamw8bit_init(p)
    del st[key]
    before = p.copy()
    with pytest.raises(ValueError, match=rf"state: has no '{key}'; pass the dict that adamw's init returned"):
        F.adamw8bit_step(p, _grad(), st)
    assert np.array_equal(p, before)


@pytest.mark.parametrize("step,init", [(F.adamw8bit_step, F.adamw8bit_init), (F.adam_step, F.adam_init),
                                       (F.lion8bit_step, F.lion8bit_init)])
@pytest.mark.parametrize("betas,error", [((0.9, 0.99, 0.1), ValueError), ((0.9,), ValueError),
                                         (0.9, TypeError), ("ab", ValueError)])
def test_betas_that_are_not_a_pair_are_named(step, init, betas, error):
    p = _param()
    st = init(p)
    before = p.copy()
    with pytest.raises(error, match=r"betas: expected a pair \(beta1, beta2\), got"):
        step(p, _grad(), st, betas=betas)
    assert np.array_equal(p, before) and float(st["step"][0]) == 0.0
