"""The digits experiment's data: shape, stratified split, and the message when scikit-learn is missing."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from experiments import digits
from runner import ConfigError


def test_digits_load_and_stratified_split():
    x, y = digits.load_digits()
    assert x.shape == (1797, 64) and y.shape == (1797,)
    assert x.min() == 0.0 and x.max() == 1.0
    train, val = digits.stratified_split(y, 0.2, seed=0)
    assert len(train) == 1438 and len(val) == 359  # per-class rounding of 20%
    assert not set(train) & set(val)
    # every class keeps its share (to within one sample) in the validation part
    for cls in range(10):
        share = np.mean(y == cls)
        assert abs(np.sum(y[val] == cls) - share * len(val)) <= 1


def test_each_load_gets_arrays_of_its_own():
    # the table is parsed once a process: a caller that scales or relabels its arrays must not change the next load's
    x, y = digits.load_digits()
    x *= 0
    y[:] = -1
    again_x, again_y = digits.load_digits()
    assert again_x.max() == 1.0 and again_y.min() == 0


def test_missing_scikit_learn_says_how_to_fix_it(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError, match=r'pip install -e "\.\[examples\]"'):
        digits.digits_splits()
