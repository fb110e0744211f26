"""Fixtures of the exact-resume tests: a reproducible seed and the uninterrupted runs."""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from pathlib import Path

import pytest

from .runner import finished_cleanly, train

#: The hash of an uninterrupted run, by (mode, total steps asked for).
Reference = Callable[[str, int], str]


def epochs_total_steps(total: int, steps_per_epoch: int = 12) -> int:
    """The steps a ``--mode epochs`` run makes: whole epochs covering ``total`` steps."""
    return -(-total // steps_per_epoch) * steps_per_epoch


class SeededRandom(random.Random):
    """A random.Random that remembers its seed, for failure messages."""

    def __init__(self, seed: int) -> None:
        super().__init__(seed)
        self.seed_value = seed

    def replay(self) -> str:
        return f"seed {self.seed_value} (replay: NBRESUME_RESUME_SEED={self.seed_value})"


@pytest.fixture
def resume_rng(request: pytest.FixtureRequest) -> SeededRandom:
    """A seeded RNG for kill moments; the seed is printed (shown when the test fails) and can
    be forced with NBRESUME_RESUME_SEED=<seed> to replay a failure."""
    seed = int(os.environ.get("NBRESUME_RESUME_SEED") or random.SystemRandom().randrange(10**9))
    rng = SeededRandom(seed)
    print(f"{request.node.nodeid}: {rng.replay()}")
    return rng


@pytest.fixture(scope="session")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Reference:
    """The final hash of a run that was never interrupted (computed once per session).

    It runs with the script's default cadence, so it also stands for "the cadence and the
    sync/async choice do not change the training".
    """
    cache: dict[tuple[str, int], str] = {}

    def get(mode: str, total: int) -> str:
        if (mode, total) not in cache:
            folder = tmp_path_factory.mktemp("reference") / "run"
            run = train(folder, total, "--mode", mode)
            steps = total if mode == "steps" else epochs_total_steps(total)
            problem = finished_cleanly(run, steps)
            assert not problem, f"the uninterrupted run failed: {problem}\n{run.describe()}"
            assert run.start == 0, run.describe()
            assert run.steps == list(range(1, steps + 1)), run.describe()
            assert run.final is not None
            cache[mode, total] = run.final
        return cache[mode, total]

    return get


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return tmp_path / "run"
