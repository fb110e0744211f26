"""The acceptance test of the promise: SIGKILL a real training run at random moments (one
inside a save, one mid-epoch, one right after an epoch boundary), restart the identical
command each time, and the final parameters and optimizer state are bit-identical to those
of a run that was never interrupted.

The training script is ``train_cnn.py``: dropout, AdamW, OneCycleLR, gradient clipping, a
shuffled DataLoader with two worker processes and augmentation drawing from the global
torch, ``random`` and NumPy generators. Kills go to the whole process group (trainer and
workers), as a preemption does.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from .conftest import Reference, SeededRandom, epochs_total_steps
from .runner import STEPS_PER_EPOCH, Run, Trigger, after_line, checkpoints, finished_cleanly, train

TOTAL = 40  # three and a third epochs
EVERY = 4  # saves at 4, 8, 12, ...: some mid-epoch, some at an epoch boundary
KILLED = -signal.SIGKILL


@dataclass
class Target:
    """Where a kill is aimed."""

    kind: str
    trigger: Trigger
    label: str
    save_step: int | None = None  # for kills inside a save: the step being saved


def next_multiple(after: int, unit: int) -> int:
    return (after // unit + 1) * unit


def aim(kind: str, resume: int, total_steps: int, rng: SeededRandom) -> Target | None:
    """A kill of ``kind`` for a run that continues from ``resume`` (None: no room left)."""
    last_useful = total_steps - EVERY  # leave steps to train after the kill's checkpoint
    if kind == "save":
        # Not the first save of the run's history: a checkpoint must exist to resume from.
        first = max(next_multiple(resume, EVERY), 2 * EVERY)
        saves = list(range(first, last_useful, EVERY))[:2]
        if not saves:
            return None
        step = rng.choice(saves)
        return Target(kind, after_line(f"event save_started {step}"), f"inside save {step}", step)
    if kind == "mid-epoch":
        candidates = range(next_multiple(resume, EVERY), last_useful, EVERY)
        saves = [s for s in candidates if s % STEPS_PER_EPOCH][:2]
        if not saves:
            return None
        saved, extra = rng.choice(saves), rng.randint(0, EVERY - 2)
        return Target(
            kind,
            _after_save(saved, extra, latest=saved + EVERY - 1),
            f"mid-epoch, {extra} step(s) after save {saved}",
        )
    if kind == "epoch-boundary":
        boundary = next_multiple(resume, STEPS_PER_EPOCH)
        if boundary >= last_useful:
            return None
        extra = rng.randint(0, 1)
        return Target(
            kind,
            _after_save(boundary, extra, latest=boundary + 2),
            f"right after the epoch boundary at step {boundary} (+{extra})",
        )
    if kind == "anywhere":
        if resume + 1 > last_useful:
            return None
        steps = rng.randint(resume + 1, last_useful)
        return Target(kind, after_line(f"step {steps}"), f"after step {steps}")
    raise ValueError(kind)


def _after_save(step: int, extra: int, *, latest: int) -> Trigger:
    """``extra`` steps after ``step``, once its save is verified; but no later than step
    ``latest`` (on a loaded machine a background save can lag behind training), provided
    that the run has a checkpoint to resume from by then."""

    def fire(run: Run) -> bool:
        steps = run.steps
        last = steps[-1] if steps else 0
        if last >= step + extra and run.saw("verified", step):
            return True
        resumable = run.start > 0 or any(kind == "verified" for kind, _ in run.events)
        return last >= latest and resumable

    return fire


def kill_and_resume(
    folder: Path,
    mode: str,
    *,
    options: list[str],
    kinds: list[str],
    rng: SeededRandom,
    reference: Reference,
    total: int,
    every_kill: bool = True,
) -> list[Run]:
    """Kill one run per entry of ``kinds``, restarting from the folder each time; then let a
    run finish and compare its hash with the uninterrupted run's. Returns every run.
    ``every_kill``: a kind that finds no room left fails the test (else it is skipped)."""
    total_steps = total if mode == "steps" else epochs_total_steps(total)
    expected = reference(mode, total)
    argv = ["--mode", mode, "--every", str(EVERY), *options]
    runs: list[Run] = []
    history: list[str] = []
    inside_save = aimed_at_saves = 0

    def context() -> str:
        return f"{rng.replay()}\nhistory:\n  " + "\n  ".join(history)

    resume = 0
    queue = list(kinds)
    retries = 2  # a kill meant for inside a save that came after the save returned
    while queue:
        kind = queue.pop(0)
        target = aim(kind, resume, total_steps, rng)
        if target is None:
            assert not every_kill, f"no room left for a {kind} kill\n{context()}"
            history.append(f"{kind}: no room left, skipped")
            continue
        run = train(folder, total, *argv, trigger=target.trigger)
        runs.append(run)
        history.append(f"start {run.start}, killed {target.label}: {run.signalled}")
        assert run.signalled, f"the run ended before the kill\n{context()}\n{run.describe()}"
        assert run.returncode == KILLED, f"not killed\n{context()}\n{run.describe()}"
        check_run(run, resume, context)
        if target.save_step is not None:
            aimed_at_saves += 1
            if not run.saw("verified", target.save_step):
                inside_save += 1
            elif retries and not inside_save:
                retries -= 1
                queue.insert(0, "save")
                history[-1] += " (the save had returned: once more)"
        found = checkpoints(folder)
        bad = sorted(step for step, ok in found.items() if not ok)
        # Only a kill before the first save of the first run may leave nothing to resume from.
        assert found or resume == 0, f"after the kill, no checkpoint is there\n{context()}"
        assert not bad, f"after the kill, checkpoints {bad} do not verify\n{context()}"
        resume = max(found, default=0)
        history[-1] += f"; on disk {sorted(found)}"
        if target.save_step is not None:
            history[-1] += f"; save {target.save_step} committed: {target.save_step in found}"
    final = train(folder, total, *argv)
    runs.append(final)
    history.append(f"final run: start {final.start}")
    check_run(final, resume, context)
    problem = finished_cleanly(final, total_steps)
    assert not problem, f"the last run did not finish: {problem}\n{context()}\n{final.describe()}"
    assert final.final == expected, (
        f"resumed training is not bit-identical to the uninterrupted run\n"
        f"uninterrupted {expected}\nresumed       {final.final}\n{context()}"
    )
    if aimed_at_saves:
        assert inside_save, f"no kill landed inside a save\n{context()}"
    # What the kills left half-written was cleaned up by the runs after them.
    leftovers = [name for name in os.listdir(folder) if name.startswith(".")]
    assert not leftovers, f"{leftovers} were left behind\n{context()}"
    print("\n".join(history))
    return runs


def check_run(run: Run, resume: int, context: Callable[[], str]) -> None:
    """A run continues exactly where the newest verified checkpoint ends, step after step."""
    assert run.start == resume, (
        f"the run started at {run.start}, but the newest verified checkpoint is {resume}\n"
        f"{context()}\n{run.describe()}"
    )
    steps = run.steps
    assert steps == list(range(resume + 1, resume + 1 + len(steps))), (
        f"steps were skipped or repeated\n{run.describe()}"
    )
    assert not any(kind == "failed" for kind, _ in run.events), run.describe()


@pytest.mark.parametrize(
    ("mode", "options"),
    [
        pytest.param("steps", [], id="steps-async"),
        # Epoch loops killed at random points are covered by tests/test_loop_shapes.py in the
        # default suite; this longer run of three kills goes with the torture runs.
        pytest.param("epochs", [], id="epochs-async", marks=pytest.mark.torture),
        pytest.param("steps", ["--sync"], id="steps-sync"),
    ],
)
def test_sigkill_three_times_then_finish_bit_exact(
    run_dir: Path, resume_rng: SeededRandom, reference: Reference, mode: str, options: list[str]
) -> None:
    kinds = ["save", "mid-epoch", "epoch-boundary"]
    resume_rng.shuffle(kinds)
    runs = kill_and_resume(
        run_dir,
        mode,
        options=options,
        kinds=kinds,
        rng=resume_rng,
        reference=reference,
        total=TOTAL,
    )
    assert all(run.start > 0 for run in runs[1:]), "a restarted run began from scratch"

    if "--sync" in options:
        return  # what follows does not depend on how saves are written
    # The identical command once more: the run is finished and stays finished.
    total_steps = TOTAL if mode == "steps" else epochs_total_steps(TOTAL)
    again = train(run_dir, TOTAL, "--mode", mode, "--every", str(EVERY), *options)
    assert finished_cleanly(again, total_steps) == "", again.describe()
    assert again.start == total_steps, again.describe()
    assert again.steps == [], f"a finished run trained again\n{again.describe()}"
    assert again.events == [], f"a finished run saved again\n{again.describe()}"
    assert again.final == reference(mode, TOTAL)


@pytest.mark.torture
@pytest.mark.parametrize("mode", ["steps", "epochs"])
@pytest.mark.parametrize("sync", [False, True], ids=["async", "sync"])
def test_many_kills_torture(
    tmp_path: Path, resume_rng: SeededRandom, reference: Reference, mode: str, sync: bool
) -> None:
    """Five repetitions of eight kills of random kinds over a longer run."""
    for repetition in range(5):
        kinds = [
            resume_rng.choice(["save", "mid-epoch", "epoch-boundary", "anywhere"]) for _ in range(8)
        ]
        kill_and_resume(
            tmp_path / f"run{repetition}",
            mode,
            options=["--sync"] if sync else [],
            kinds=kinds,
            rng=resume_rng,
            reference=reference,
            total=120,
            every_kill=False,
        )
