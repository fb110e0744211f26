"""A wrapped loader's order follows the user's seeding: a script that seeds only Python's
``random`` (torch never) and shuffles with it gets the same epoch orders in every process, as
it does without nbresume, and a resumed run continues them exactly."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from testkit import warmfork

SCRIPT = Path(__file__).with_name("train_random_seeded.py")
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def batches(folder: Path, stop_after: int | None = None) -> list[str]:
    argv = [sys.executable, str(SCRIPT), str(folder)]
    if stop_after is not None:
        argv.append(str(stop_after))
    done = warmfork.run(argv, capture_output=True, text=True, env=ENV, timeout=300)
    assert done.returncode == 0, done.stderr
    return [line for line in done.stdout.splitlines() if line.startswith("batch ")]


@pytest.mark.slow  # four runs of a script that imports torch
def test_a_script_seeding_only_random_gets_the_same_orders_in_every_process(
    tmp_path: Path,
) -> None:
    first = batches(tmp_path / "first")
    assert len(first) == 8
    assert first[:4] != first[4:]  # each epoch shuffled anew
    assert batches(tmp_path / "second") == first

    stopped = batches(tmp_path / "resumed", stop_after=3)
    assert stopped == first[:3]
    assert batches(tmp_path / "resumed") == first[3:]
