"""Fixtures every test file may use."""

import os
import time

import numpy as np
import pytest


@pytest.fixture
def rng():
    """A generator from $TIDEJAX_TEST_SEED, or from the clock; the seed is printed (pytest shows
    it when the test fails), so a failure replays with TIDEJAX_TEST_SEED=<seed>."""
    seed = int(os.environ.get("TIDEJAX_TEST_SEED", time.time_ns() % 2**32))
    print(f"random seed {seed} (TIDEJAX_TEST_SEED={seed} replays it)")
    return np.random.default_rng(seed)
