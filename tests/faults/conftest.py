"""Fixtures of the fault-injection tests: a reproducible random seed."""

from __future__ import annotations

import os
import random

import pytest


@pytest.fixture
def fault_rng(request: pytest.FixtureRequest) -> random.Random:
    """A seeded RNG; the seed is printed (shown when the test fails) and can be forced with
    NBRESUME_FAULT_SEED=<seed> to replay a failure."""
    seed = int(os.environ.get("NBRESUME_FAULT_SEED") or random.SystemRandom().randrange(10**9))
    print(f"{request.node.nodeid}: fault seed {seed} (replay: NBRESUME_FAULT_SEED={seed})")
    return random.Random(seed)
