"""Reading what a killed-and-resumed training run left: its output lines, its step folders,
and the random source that chose where it was killed."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest


def reported(text: str, kind: str) -> list[int]:
    """The numbers of the output lines ``<kind> <number> ...``, in order."""
    return [int(line.split()[1]) for line in text.splitlines() if line.startswith(kind + " ")]


def steps_on_disk(folder: Path) -> list[int]:
    """The steps whose folders are in ``folder``, in order."""
    return sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit())


def replayable_rng(request: pytest.FixtureRequest, variable: str) -> random.Random:
    """A random source for where the kills land: its seed is printed, and the environment
    variable ``variable`` set to it replays the same kills."""
    seed = int(os.environ.get(variable) or random.SystemRandom().randrange(10**9))
    print(f"{request.node.nodeid}: seed {seed} (replay: {variable}={seed})")
    return random.Random(seed)
