"""Fixtures of the fault-injection tests: a reproducible random seed, a fast folder."""

from __future__ import annotations

import os
import random
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture
def fault_rng(request: pytest.FixtureRequest) -> random.Random:
    """A seeded RNG; the seed is printed (shown when the test fails) and can be forced with
    NBRESUME_FAULT_SEED=<seed> to replay a failure."""
    seed = int(os.environ.get("NBRESUME_FAULT_SEED") or random.SystemRandom().randrange(10**9))
    print(f"{request.node.nodeid}: fault seed {seed} (replay: NBRESUME_FAULT_SEED={seed})")
    return random.Random(seed)


@pytest.fixture
def ram_dir(tmp_path: Path) -> Iterator[Path]:
    """A folder in RAM (/dev/shm) where there is one, else ``tmp_path``: for tests that save
    hundreds of checkpoints to exercise error handling, where fsync on a busy disk would
    only cost time."""
    shm = Path("/dev/shm")
    if not (shm.is_dir() and os.access(shm, os.W_OK)):
        yield tmp_path
        return
    folder = Path(tempfile.mkdtemp(prefix="nbresume-faults-", dir=shm))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)
