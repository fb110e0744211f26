"""A deadline (a session cap, a job's time limit) stops training cleanly before it comes.

The first run stops at a step boundary after a verified save and exits with status 0 and
``done`` false, so that a Kaggle commit or a batch job ends without an error; running the
identical command again without the deadline finishes the training, bit-identical to a run
that never stopped.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import Reference, epochs_total_steps
from .runner import Run, checkpoints, finished_cleanly, train

TOTAL = 40
EVERY = 4
NBRESUME = Path(sys.executable).with_name("nbresume")


def check_clean_stop(run: Run, folder: Path, total_steps: int) -> int:
    """The run stopped before the end, cleanly, with a verified checkpoint of its last step.
    Returns that step."""
    assert run.returncode == 0, run.describe()
    assert "Traceback" not in run.stderr, run.describe()
    assert run.done is not None, run.describe()
    done, stop = run.done
    assert not done, f"the run was not stopped by its deadline\n{run.describe()}"
    assert 0 < stop < total_steps, run.describe()
    assert run.steps == list(range(run.start + 1, stop + 1)), run.describe()
    saved = [kind for kind, step in run.events if step == stop]
    assert saved[-4:] == ["save_started", "committed", "verified", "stopping"], run.describe()
    assert "deadline" in run.stderr, f"the stop was not explained\n{run.describe()}"
    # What a user would run next: the command line says the checkpoints are good.
    verify = subprocess.run(
        [str(NBRESUME), "verify", str(folder)], capture_output=True, text=True, timeout=120
    )
    assert verify.returncode == 0, verify.stdout + verify.stderr
    found = checkpoints(folder)
    assert max(found) == stop, found
    return stop


def test_a_deadline_stops_cleanly_and_the_next_run_finishes_bit_exact(
    run_dir: Path, reference: Reference
) -> None:
    """Two seconds away. Until a save has been timed the Checkpointer budgets a second per
    save, so it stops at the first step boundary: it cannot be sure that another step and a
    save fit. (An epoch loop stops through the same boundary as for a signal, tested in
    test_signals; the torture variant below runs both loops.)"""
    options = ["--mode", "steps", "--every", str(EVERY)]
    first = train(run_dir, TOTAL, *options, "--deadline", "2")
    stop = check_clean_stop(first, run_dir, TOTAL)

    second = train(run_dir, TOTAL, *options)
    assert second.start == stop, second.describe()
    problem = finished_cleanly(second, TOTAL)
    assert not problem, f"{problem}\n{second.describe()}"
    assert second.final == reference("steps", TOTAL), (
        f"after a deadline stop, the training is not bit-identical\n{second.describe()}"
    )


@pytest.mark.torture
@pytest.mark.parametrize("mode", ["steps", "epochs"])
def test_a_deadline_after_timed_saves_torture(
    run_dir: Path, reference: Reference, mode: str
) -> None:
    """A run long enough that the deadline comes after several timed saves, so that the margin
    is the measured one; two deadline stops, then the end. The run is long enough (about 12 s
    of training on a quiet machine) that a fast machine still meets the deadline twice."""
    total = 2000
    total_steps = total if mode == "steps" else epochs_total_steps(total)
    options = ["--mode", mode, "--every", "25"]
    resume = 0
    for _ in range(2):
        run = train(run_dir, total, *options, "--deadline", "5")
        assert run.start == resume, run.describe()
        resume = check_clean_stop(run, run_dir, total_steps)
        assert ("verified", resume) in run.events
        assert any(kind == "verified" for kind, step in run.events if step < resume), (
            f"the deadline came before the first timed save\n{run.describe()}"
        )
    last = train(run_dir, total, *options)
    assert last.start == resume, last.describe()
    assert finished_cleanly(last, total_steps) == "", last.describe()
    assert last.final == reference(mode, total)
