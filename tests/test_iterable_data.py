"""A wrapped DataLoader over an IterableDataset resumes exactly: the epoch's stream is rebuilt
(``set_epoch`` first) and the batches already trained on are loaded and dropped; its random
augmentation does not depend on where the run resumed, and iterating it never moves the
training loop's random streams.

The training runs (``train_iterable.py``: a stream shuffled per epoch, sharded over the
workers, augmented with torch, ``random`` and NumPy inside ``__iter__``) are stopped twice
mid-epoch, and killed twice with SIGKILL in real processes, without workers and with two
forked ones, inside ``epochs()`` and in ``steps()`` with ``.batches()``: the final weights
and optimizer state must be bit-identical to a run that was never interrupted.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import random
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

import train_iterable as runs
from nbresume import ResumableLoader
from nbresume.checkpoint.store import CheckpointStore
from nbresume.errors import UsageError
from nbresume.resumecheck.compare import RNG, compare, final_checkpoints
from testkit import warmfork
from testkit.paths import ROOT
from testkit.runs import replayable_rng, reported, steps_on_disk
from zygote import CHILD_ENV, Zygote

SCRIPT = Path(runs.__file__)
RECIPE = ROOT / "docs" / "recipes" / "iterable_dataset.py"

PER_EPOCH = runs.ITEMS // runs.BATCH
WORKERS = [0, 2]
#: (loop shape, num_workers) of the training runs.
CASES = [(shape, workers) for shape in runs.SHAPES for workers in WORKERS]
CASE_IDS = [f"{shape}-{workers}-workers" for shape, workers in CASES]
Tensors = dict[str, torch.Tensor]
needs_fork = pytest.mark.skipif(
    "fork" not in multiprocessing.get_all_start_methods(), reason="forked workers"
)


@pytest.fixture(autouse=True)
def _torch_threads_as_they_were() -> Iterator[None]:
    """The in-process runs train on one thread; later tests of this worker see torch's own."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def seed_all(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def take(loader: ResumableLoader, count: int) -> list[list[list[float]]]:
    stream = loader.batches()
    return [torch.cat(next(stream), dim=1).tolist() for _ in range(count)]


def resumed(workers: int, stops: list[int], count: int) -> list[Any]:
    """``count`` batches, the position saved and loaded into a new wrapper and DataLoader
    at each of ``stops`` (batches since the start)."""
    taken: list[Any] = []
    state: dict[str, Any] | None = None
    for stop in [*stops, count]:
        seed_all(len(taken))  # a new process starts from other global states
        loader = ResumableLoader(runs.data(workers), seed=12345)
        if state is not None:
            loader.load_state_dict(state)
        taken += take(loader, stop - len(taken))
        state = json.loads(json.dumps(loader.state_dict()))  # as a checkpoint stores it
    return taken


@pytest.mark.proc  # DataLoader workers are processes
@pytest.mark.parametrize("workers", WORKERS)
def test_a_stream_resumed_twice_hands_out_the_batches_of_the_uninterrupted_one(
    workers: int, caplog: pytest.LogCaptureFixture
) -> None:
    count = PER_EPOCH * 5 // 2
    reference = take(ResumableLoader(runs.data(workers), seed=12345), count)
    firsts = [batch[0][-1] for batch in reference]  # the targets: which items, in which order
    assert len(set(map(tuple, reference[0]))) == runs.BATCH
    assert sorted(firsts[:PER_EPOCH]) != firsts[:PER_EPOCH], "shuffled"
    assert firsts[:PER_EPOCH] != firsts[PER_EPOCH : 2 * PER_EPOCH], "set_epoch: a new order"
    # Twice in one epoch (the second resume skips what the first one trained too), at the
    # exact end of an epoch, and in the next epoch.
    for stops in ([5, 11], [3, PER_EPOCH], [PER_EPOCH + 2, PER_EPOCH + 7]):
        with caplog.at_level(logging.INFO, logger="nbresume"):
            caplog.clear()
            assert resumed(workers, stops, count) == reference, f"resumed after {stops}"
        skips = [r.getMessage() for r in caplog.records if "loaded and dropped" in r.message]
        assert len(skips) == len(stops), skips
        assert f"resumes at batch {stops[1] % PER_EPOCH or PER_EPOCH}:" in skips[1]


@pytest.mark.proc  # DataLoader workers are processes
@needs_fork
def test_one_worker_gives_the_stream_of_the_main_process() -> None:
    """The augmentation of the main process is that of worker 0: a stream's randomness
    depends on the seed, the epoch and the worker, never on where it runs."""
    alone = take(ResumableLoader(runs.data(0), seed=3), PER_EPOCH + 2)
    assert take(ResumableLoader(runs.data(1), seed=3), PER_EPOCH + 2) == alone
    assert take(ResumableLoader(runs.data(0), seed=4), PER_EPOCH + 2) != alone


def host_streams() -> tuple[Any, ...]:
    return (torch.get_rng_state(), random.getstate(), np.random.get_state())


def same_streams(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    return (
        torch.equal(a[0], b[0])
        and a[1] == b[1]
        and a[2][0] == b[2][0]
        and np.array_equal(a[2][1], b[2][1])
        and tuple(a[2][2:]) == tuple(b[2][2:])
    )


def training_draws() -> list[float]:
    """What a training step draws from the global streams (dropout, a shuffle, noise)."""
    return [torch.rand(()).item(), random.random(), float(np.random.rand())]


def test_a_stream_in_the_main_process_never_moves_the_users_random_streams() -> None:
    count = PER_EPOCH + 3
    reference = take(ResumableLoader(runs.data(0), seed=1), count + 1)
    seed_all(5)
    expected = [training_draws() for _ in range(count)]  # the loop's own draws, no data

    seed_all(5)
    loader = ResumableLoader(runs.data(0), seed=1)
    batches = loader.batches()
    seen, drawn = [], []
    for _ in range(count):
        seen.append(torch.cat(next(batches), dim=1).tolist())
        drawn.append(training_draws())  # between two batches, as a training step does
    assert drawn == expected, "loading data moved the training loop's random streams"
    assert seen == reference[:count], "the stream's randomness depends on the loop's draws"

    seed_all(6)
    before = host_streams()
    assert len([batch for batch in ResumableLoader(runs.data(0), seed=1)]) == PER_EPOCH
    assert same_streams(before, host_streams()), "a whole pass moved the user's streams"
    again = ResumableLoader(runs.data(0), seed=0)
    again.load_state_dict(json.loads(json.dumps(loader.state_dict())))
    assert take(again, 1) == reference[count:], "resumed after the batches it dropped"
    assert same_streams(before, host_streams()), "dropping the trained batches moved them"


class Shrinking(IterableDataset[int]):
    """A stream that is shorter in every new process: not a function of its epoch."""

    length = 12

    def __iter__(self) -> Iterator[int]:
        Shrinking.length -= 3
        return iter(range(Shrinking.length))


def test_a_stream_that_ended_before_the_saved_position_is_refused_with_the_fix() -> None:
    first = ResumableLoader(DataLoader(Shrinking(), batch_size=2), seed=0)
    head = next(first.batches())
    assert head.tolist() == [0, 1]
    first.position = 5  # as saved by a run whose stream was longer
    with pytest.raises(UsageError, match="ended after 3 batches") as raised:
        next(first.batches())
    assert "set_epoch" in raised.value.fix


def test_the_batch_size_of_a_stream_changes_in_its_epoch_only_without_workers() -> None:
    """Without workers the items of an epoch come in one order, whatever the batch size: a
    rerun with batches of 6 continues after the 4 batches of 3 trained. Read by two workers,
    a batch holds one worker's items, so the batch size is refused until the epoch ends."""

    def data(batch_size: int, workers: int = 0) -> ResumableLoader:
        dl = DataLoader(runs.AugmentedStream(), batch_size=batch_size, num_workers=workers)
        return ResumableLoader(dl, seed=2)

    def items(loader: ResumableLoader, count: int) -> torch.Tensor:
        batches = loader.batches()
        return torch.cat([torch.cat(next(batches), dim=1) for _ in range(count)])

    reference = items(data(3), PER_EPOCH)
    first = data(3)
    head = items(first, 4)
    second = data(6)
    second.load_state_dict(first.state_dict())  # 12 items: 2 batches of 6
    assert second.position == 2
    rest = items(second, PER_EPOCH // 2 - 2)
    assert torch.equal(torch.cat([head, rest]), reference)

    with pytest.raises(UsageError, match="several workers") as raised:
        data(6, workers=2).load_state_dict(first.state_dict())
    assert "batch_size=3" in raised.value.fix


# -- training: stopped, and killed, twice ------------------------------------------------------


@pytest.fixture
def kill_rng(request: pytest.FixtureRequest) -> random.Random:
    """Where the kills land; the seed is printed and NBRESUME_ITERABLE_SEED replays it."""
    return replayable_rng(request, "NBRESUME_ITERABLE_SEED")


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, int], Tensors]:
    """The uninterrupted run of every shape and worker count, computed once."""
    folder = tmp_path_factory.mktemp("reference")
    return {case: runs.train(folder / "-".join(map(str, case)), *case) for case in CASES}


def assert_same(final: Tensors, expected: Tensors, why: str) -> None:
    assert final.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(final[key], value), f"{why}: {key} differs"


@pytest.mark.proc  # DataLoader workers are processes
@needs_fork
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_a_run_stopped_twice_mid_epoch_resumes_bit_identically(
    tmp_path: Path, case: tuple[str, int], reference: dict[tuple[str, int], Tensors]
) -> None:
    shape, workers = case
    folder = tmp_path / "run"
    for stop in (6, 11):  # in the first epoch, off the cadence (every 4 steps)
        assert stop % runs.EVERY
        runs.train(folder, shape, workers, stop_after=stop)
        assert steps_on_disk(folder)[-1] == stop
    final = runs.train(folder, shape, workers)
    assert steps_on_disk(folder)[-1] == runs.TOTAL
    assert_same(final, reference[shape, workers], f"{shape}, {workers} workers, stopped twice")


class IterableRuns(Zygote):
    """``train_iterable.py``: one training process per run, torch imported once.
    Runs are real processes; a kill is a real SIGKILL of the trainer."""

    def __init__(self, workdir: Path) -> None:
        super().__init__(workdir, SCRIPT)

    def train(
        self, folder: Path, shape: str, workers: int, *, kill_at: int | None = None
    ) -> tuple[int, str]:
        """Train in ``folder``; with ``kill_at``, SIGKILL the process once it has reported
        that step. Returns (exit status, what it printed)."""
        command = {"folder": str(folder), "shape": shape, "workers": workers}
        kill_when = None if kill_at is None else (lambda text: kill_at in reported(text, "step"))
        return self.run(command, kill_when=kill_when, pause=0.02)


@pytest.fixture(scope="module")
def zygote(tmp_path_factory: pytest.TempPathFactory) -> Iterator[IterableRuns]:
    server = IterableRuns(tmp_path_factory.mktemp("zygote"))
    yield server
    server.close()


@pytest.mark.slow
@needs_fork
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_a_run_killed_twice_resumes_bit_identically(
    tmp_path: Path,
    case: tuple[str, int],
    zygote: IterableRuns,
    kill_rng: random.Random,
    reference: dict[tuple[str, int], Tensors],
) -> None:
    shape, workers = case
    folder = tmp_path / "run"
    resume_from = 0
    # Both kills in the first epoch, after a checkpoint of this run (each save is committed
    # before the next step): the second resume drops the batches that the first one dropped
    # and those trained since.
    for kill in range(2):
        low, high = (6, 9) if kill == 0 else (resume_from + runs.EVERY + 1, PER_EPOCH - 1)
        kill_at = kill_rng.randint(low, high)
        status, text = zygote.train(folder, shape, workers, kill_at=kill_at)
        context = f"killed at step {kill_at} of {shape} with {workers} workers:\n{text}"
        assert status == -signal.SIGKILL, context
        assert reported(text, "start") == [resume_from], context
        assert "error " not in text, context
        report = CheckpointStore(folder, keep=None).verify()
        assert report.ok, f"{context}\n{report.summary}"
        committed = max(r.step for r in report.results)
        assert resume_from < committed < PER_EPOCH, context
        resume_from = committed

    status, text = zygote.train(folder, shape, workers)
    assert status == 0, text
    assert reported(text, "start") == [resume_from], text
    assert reported(text, "done") == [runs.TOTAL], text
    assert_same(zygote.final(), reference[shape, workers], f"{shape}, {workers} workers, killed")


# -- the recipe of the docs ---------------------------------------------------------------------


@pytest.mark.slow
@needs_fork
def test_the_recipe_stopped_twice_ends_as_the_uninterrupted_run(tmp_path: Path) -> None:
    """docs/recipes/iterable_dataset.py, run as a script: uninterrupted, and stopped twice
    mid-epoch (``NBRESUME_SMOKE_STEPS``: each run saves and stops a few steps in, as before a
    deadline) then run to its end. The final checkpoints are compared tensor by tensor."""

    def script(root: Path, stop_after: int | None = None) -> str:
        env = {**CHILD_ENV, "NBRESUME_SMOKE_STEPS": str(stop_after)} if stop_after else CHILD_ENV
        done = warmfork.run(
            [sys.executable, str(RECIPE), str(root / "run")],
            capture_output=True, text=True, timeout=300, check=False, cwd=tmp_path, env=env,
        )  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    script(tmp_path / "uninterrupted")
    # Both stops in the first epoch (16 batches): the second resume drops 14 batches.
    assert "done=False at step 7" in script(tmp_path / "stopped", 7)
    assert "done=False at step 14" in script(tmp_path / "stopped", 7)
    assert "done=True at step 80" in script(tmp_path / "stopped")
    compared = compare(
        final_checkpoints(tmp_path / "uninterrupted"), final_checkpoints(tmp_path / "stopped")
    )
    assert compared.compared, "no final checkpoint"
    # The recipe seeds torch only: the python and NumPy streams of the trainer are never drawn
    # from (the stream's randomness runs in the workers), and differ between any two runs.
    differences = [
        d.line() for d in compared.differences if not (d.kind == RNG and d.name != "torch")
    ]
    assert not differences, differences
