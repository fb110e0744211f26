"""Signals end a run cleanly: the Checkpointer saves at the next step boundary and stops.

SIGTERM (``kill``, ``docker stop``, Kubernetes, Slurm at the end of a job), SIGUSR1 (Slurm's
``--signal`` warning before the time limit) and SIGINT (a notebook's interrupt button,
Ctrl-C) each stop a real training run; the checkpoint of the step it stopped at verifies, and
the identical command resumes from it. After a chain of such stops the final state is
bit-identical to an uninterrupted run's, which could not be if a checkpoint had been taken
inside a signal handler, halfway through a step.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from .conftest import Reference, SeededRandom, epochs_total_steps
from .runner import Run, after_line, checkpoints, finished_cleanly, train

TOTAL = 40
EVERY = 4


def stop_with(
    folder: Path,
    mode: str,
    signum: int,
    rng: SeededRandom,
    *,
    to_group: bool = False,
    twice: bool = False,
) -> Run:
    """Run the script, send ``signum`` a few steps (and a few milliseconds) after it resumed,
    and check that it stopped at a step boundary with a verified checkpoint of that step."""
    before = checkpoints(folder) if folder.exists() else {}
    resume = max(before, default=0)
    at = resume + rng.randint(2, 8)
    delay = rng.uniform(0.0, 0.01)
    name = signal.Signals(signum).name
    run = train(
        folder,
        TOTAL,
        "--mode",
        mode,
        "--every",
        str(EVERY),
        trigger=after_line(f"step {at}"),
        signum=signum,
        delay=delay,
        to_group=to_group,
        repeat=rng.uniform(0.0, 0.03) if twice else None,
    )
    context = f"{rng.replay()}\n{name} {delay * 1000:.1f} ms after step {at}\n{run.describe()}"
    assert run.start == resume, context
    assert run.signalled, f"the run ended before the signal\n{context}"
    # The DataLoader workers were shut down with the trainer, none left running or hanging.
    assert not run.leftovers, f"processes {run.leftovers} outlived the run\n{context}"
    if twice:
        return run
    stopping = [step for kind, step in run.events if kind == "stopping"]
    assert len(stopping) == 1, f"no clean stop\n{context}"
    stop = stopping[0]
    # At a step boundary: the step that had just completed, never before the signal.
    assert run.steps[-1] == stop >= at, context
    assert run.events[-4:] == [
        ("save_started", stop),
        ("committed", stop),
        ("verified", stop),
        ("stopping", stop),
    ], context
    assert run.done is None, f"the run went on after the stop\n{context}"
    found = checkpoints(folder)
    assert max(found) == stop, f"the newest checkpoint is not the stop's\n{context}"
    assert all(found.values()), f"checkpoints {found} do not all verify\n{context}"
    return run


def finish(folder: Path, mode: str, start: int, reference: Reference, context: str) -> None:
    total_steps = TOTAL if mode == "steps" else epochs_total_steps(TOTAL)
    run = train(folder, TOTAL, "--mode", mode, "--every", str(EVERY))
    assert run.start == start, f"{context}\n{run.describe()}"
    assert run.start > 0
    problem = finished_cleanly(run, total_steps)
    assert not problem, f"{problem}\n{context}\n{run.describe()}"
    assert run.final == reference(mode, TOTAL), (
        f"resumed after signals, the training is not bit-identical\n{context}\n{run.describe()}"
    )


def test_sigterm_sigusr1_sigint_each_save_and_stop_then_resume_bit_exact(
    run_dir: Path, resume_rng: SeededRandom, reference: Reference
) -> None:
    """Sent to the training process only, as ``kill``, Kubernetes and a notebook kernel's
    interrupt do."""
    term = stop_with(run_dir, "steps", signal.SIGTERM, resume_rng)
    # The Checkpointer raises SystemExit(128 + signal): the status a shell reports for a
    # process killed by that signal, so a scheduler sees the job as terminated.
    assert term.returncode == 128 + signal.SIGTERM, term.describe()
    assert "Traceback" not in term.stderr, term.describe()

    usr1 = stop_with(run_dir, "steps", signal.SIGUSR1, resume_rng)
    assert usr1.returncode == 128 + signal.SIGUSR1, usr1.describe()
    assert "Traceback" not in usr1.stderr, usr1.describe()

    # SIGINT becomes KeyboardInterrupt after the save, as a notebook user expects; the script
    # does not catch it, so Python prints the traceback and ends by SIGINT (status -2).
    interrupt = stop_with(run_dir, "steps", signal.SIGINT, resume_rng)
    assert interrupt.returncode == -signal.SIGINT, interrupt.describe()
    assert interrupt.stderr.rstrip().endswith("KeyboardInterrupt"), interrupt.describe()

    stopped_at = interrupt.steps[-1]
    finish(run_dir, "steps", stopped_at, reference, resume_rng.replay())


def test_signals_to_the_whole_job_then_a_double_interrupt_in_an_epoch_loop(
    run_dir: Path, resume_rng: SeededRandom, reference: Reference
) -> None:
    """Slurm (``scancel``, the time limit) and Ctrl-C in a terminal signal every process of
    the job, DataLoader workers included: the trainer must still save and stop cleanly.
    Then two interrupts in quick succession: the second does not wait for the boundary;
    whatever it cut short, every checkpoint on disk verifies and the run resumes exactly."""
    term = stop_with(run_dir, "epochs", signal.SIGTERM, resume_rng, to_group=True)
    assert term.returncode == 128 + signal.SIGTERM, term.describe()
    assert "Traceback" not in term.stderr, term.describe()

    interrupt = stop_with(run_dir, "epochs", signal.SIGINT, resume_rng, to_group=True)
    assert interrupt.returncode == -signal.SIGINT, interrupt.describe()
    assert interrupt.stderr.rstrip().endswith("KeyboardInterrupt"), interrupt.describe()

    twice = stop_with(run_dir, "epochs", signal.SIGINT, resume_rng, twice=True)
    assert twice.returncode == -signal.SIGINT, twice.describe()
    assert "KeyboardInterrupt" in twice.stderr, twice.describe()
    found = checkpoints(run_dir)
    assert all(found.values()), f"{found}\n{resume_rng.replay()}\n{twice.describe()}"

    finish(run_dir, "epochs", max(found), reference, resume_rng.replay())


@pytest.mark.torture
@pytest.mark.parametrize("mode", ["steps", "epochs"])
def test_random_signal_chains_torture(
    tmp_path: Path, resume_rng: SeededRandom, reference: Reference, mode: str
) -> None:
    signals = [signal.SIGTERM, signal.SIGUSR1, signal.SIGINT]
    for repetition in range(5):
        folder = tmp_path / f"run{repetition}"
        stopped_at = 0
        for _ in range(3):
            signum = resume_rng.choice(signals)
            run = stop_with(folder, mode, signum, resume_rng, to_group=resume_rng.random() < 0.5)
            stopped_at = run.steps[-1]
        finish(folder, mode, stopped_at, reference, resume_rng.replay())
