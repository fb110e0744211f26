"""Every natural shape of a training loop saves on the cadence and resumes exactly.

The shapes (``train_loop_shapes.py``): a loader wrapped before ``epochs()``, wrapped inside
it each epoch, inside ``enumerate``, given to the constructor, two loaders in ``zip`` or one
after the other, a plain validation DataLoader inside the epoch, ``steps()`` with
``.batches()``, and a ``break`` that caps the batches of an epoch. Each is run in-process to
count its checkpoints, then killed with SIGKILL in a real process and restarted until done:
the final weights and optimizer state must be bit-identical to an uninterrupted run.
"""

from __future__ import annotations

import json
import random
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

import nbresume
import train_loop_shapes as shapes
from nbresume import Checkpointer, Event
from nbresume.checkpoint.store import CheckpointStore
from nbresume.errors import UsageError
from testkit.runs import replayable_rng, reported, steps_on_disk
from zygote import Zygote, reached

SCRIPT = Path(shapes.__file__)

SHAPES = list(shapes.SHAPES)


@pytest.fixture(autouse=True)
def _torch_threads_as_they_were() -> Iterator[None]:
    """The in-process runs train on one thread; later tests of this worker see torch's own."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def state_json(folder: Path, step: int) -> dict[str, Any]:
    document: dict[str, Any] = json.loads((folder / f"{step:012d}" / "state.json").read_text())
    return document


def batches_consumed(shape: str, loaders: dict[str, Any]) -> int:
    """How many steps the saved data positions stand for, by the shape's own arithmetic."""
    per_epoch = shapes.CAP if shape == "break" else shapes.BATCHES
    consumed = [state["epoch"] * per_epoch + state["position"] for state in loaders.values()]
    if shape == "zip":
        assert consumed[0] == consumed[1], f"the two loaders of a zip disagree: {loaders}"
        return int(consumed[0])
    return int(sum(consumed))


@pytest.mark.parametrize("shape", SHAPES)
def test_every_loop_shape_saves_on_the_cadence(tmp_path: Path, shape: str) -> None:
    folder = tmp_path / "run"
    reported: list[int] = []

    def record(event: Event) -> None:
        if event.kind == "step":
            reported.append(event.step)

    shapes.train(folder, shape, callbacks=[record])
    total = shapes.SHAPES[shape][1]
    on_disk = steps_on_disk(folder)
    assert on_disk == list(range(shapes.EVERY, total + 1, shapes.EVERY)), on_disk
    assert len(on_disk) >= 8
    assert on_disk[-1] == total
    assert reported == list(range(1, total + 1)), "one step boundary per step, in order"
    for step in on_disk:
        state = state_json(folder, step)
        assert state["step"] == step
        loaders = {k: v for k, v in state["objects"].items() if k.startswith("loader")}
        # The second loader of the sequential shape is wrapped when the body first reaches it.
        wrapped = 2 if shape == "zip" or (shape == "sequential" and step >= 12) else 1
        assert len(loaders) == wrapped, loaders
        # The saved position is exactly the batches trained on: the plain validation
        # DataLoader is not counted, and a capped epoch moves on to the next data epoch.
        assert batches_consumed(shape, loaders) == step, (step, loaders)


# -- SIGKILL and restart: bit-identical to an uninterrupted run ---------------------------------


class ShapeRuns(Zygote):
    """``train_loop_shapes.py``: one training process per run, torch imported
    once. Runs are real processes; a kill is a real SIGKILL."""

    def __init__(self, workdir: Path) -> None:
        super().__init__(workdir, SCRIPT)

    def train(self, folder: Path, shape: str, *, kill_at: int | None = None) -> tuple[int, str]:
        """Train ``shape`` in ``folder``; with ``kill_at``, SIGKILL the process once it has
        reported that step. Returns (exit status, what it printed)."""
        command = {"folder": str(folder), "shape": shape}
        kill_when = None if kill_at is None else reached(kill_at)
        return self.run(command, kill_when=kill_when, pause=0.004)


@pytest.fixture(scope="module")
def zygote(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ShapeRuns]:
    server = ShapeRuns(tmp_path_factory.mktemp("zygote"))
    yield server
    server.close()


@pytest.fixture
def kill_rng(request: pytest.FixtureRequest) -> random.Random:
    """Where the kills land; the seed is printed and NBRESUME_SHAPES_SEED replays it."""
    return replayable_rng(request, "NBRESUME_SHAPES_SEED")


@pytest.mark.slow
@pytest.mark.parametrize("shape", SHAPES)
def test_a_killed_run_of_every_shape_resumes_bit_identically(
    tmp_path: Path, shape: str, zygote: ShapeRuns, kill_rng: random.Random
) -> None:
    total = shapes.SHAPES[shape][1]
    status, text = zygote.train(tmp_path / "reference", shape)
    assert status == 0, text
    assert reported(text, "done") == [total], text
    reference = zygote.final()

    folder = tmp_path / "run"
    resume_from = 0
    for kill in range(2):
        # After at least two checkpoints of this run, leaving steps to train after the kill;
        # the first kill in the first half, so that the second has room.
        first, last = resume_from + 2 * shapes.EVERY + 1, total - 2 if kill else total // 2 + 1
        if first > last:
            break
        kill_at = kill_rng.randint(first, last)
        status, text = zygote.train(folder, shape, kill_at=kill_at)
        context = f"kill {kill + 1} of {shape} at step >= {kill_at}:\n{text}"
        assert status == -signal.SIGKILL, context
        assert reported(text, "start") == [resume_from], context
        assert "error " not in text, context
        report = CheckpointStore(folder, keep=None).verify()
        assert report.ok, f"{context}\n{report.summary}"
        committed = max(r.step for r in report.results)
        assert committed >= max(reported(text, "verified"), default=resume_from), context
        assert committed > resume_from, context
        resume_from = committed

    status, text = zygote.train(folder, shape)
    assert status == 0, text
    assert reported(text, "start") == [resume_from], text
    assert reported(text, "done") == [total], text
    final = zygote.final()
    assert final.keys() == reference.keys()
    for key, value in reference.items():
        assert torch.equal(final[key], value), f"{shape}: {key} differs after the kills"


@pytest.mark.parametrize("shape", SHAPES)
def test_a_stop_mid_epoch_in_every_shape_resumes_bit_identically(
    tmp_path: Path, shape: str, kill_rng: random.Random
) -> None:
    """A stop (the deadline, the panel's button, a signal) saves at the next step boundary
    and leaves the loop; the identical code run again continues exactly."""
    reference = shapes.train(tmp_path / "reference", shape)
    total = shapes.SHAPES[shape][1]
    stop_after = kill_rng.choice([s for s in range(2, total - 1) if s % shapes.EVERY])
    shapes.train(tmp_path / "run", shape, stop_after=stop_after)
    assert steps_on_disk(tmp_path / "run")[-1] == stop_after
    final = shapes.train(tmp_path / "run", shape)
    for key, value in reference.items():
        assert torch.equal(final[key], value), f"{shape}, stopped after {stop_after}: {key}"


# -- the rules, and the shapes that cannot work ------------------------------------------------


def numbers(count: int, batch_size: int = 4) -> DataLoader[Any]:
    return DataLoader(list(range(count)), batch_size=batch_size, shuffle=True)


def quiet(folder: Path, **state: Any) -> Checkpointer:
    return Checkpointer(folder, every=None, keep=None, deadline=None, async_save=False, **state)


def test_a_break_ends_the_epochs_data_and_the_next_epoch_starts_fresh(tmp_path: Path) -> None:
    dl = numbers(48)
    ckpt = quiet(tmp_path / "run")
    data = ckpt.loader(dl, seed=11)
    seen: list[list[int]] = []
    for _epoch in ckpt.epochs(2):
        for batch in data:
            seen.append(batch.tolist())
            if data.position == 5:
                break
    assert ckpt.step == 10
    # What a loader with the same seed hands out at the start of data epochs 0 and 1.
    expected = nbresume.ResumableLoader(dl, seed=11)
    first = [b.tolist() for b in expected][:5]
    second = [b.tolist() for b in expected][:5]
    assert seen == first + second


def test_zip_counts_one_step_per_pair_and_the_rule_is_the_same_for_sequential_loaders(
    tmp_path: Path,
) -> None:
    ckpt = quiet(tmp_path / "run")
    a, b = numbers(24), numbers(12, batch_size=2)
    pairs = 0
    for _epoch in ckpt.epochs(1):
        for _ in zip(ckpt.loader(a), ckpt.loader(b), strict=False):
            pairs += 1
    assert pairs == 6
    assert ckpt.step == 6
    ckpt = quiet(tmp_path / "sequential")
    for _epoch in ckpt.epochs(1):
        for _ in ckpt.loader(a):
            pass
        for _ in ckpt.loader(b):
            pass
    assert ckpt.step == 12


def test_a_loader_iterated_twice_in_one_epoch_is_refused(tmp_path: Path) -> None:
    ckpt = quiet(tmp_path / "run")
    data = ckpt.loader(numbers(12))

    def train() -> None:
        for _epoch in ckpt.epochs(1):
            for _ in data:
                pass
            for _ in data:
                pass

    with pytest.raises(UsageError, match="second time") as raised:
        train()
    assert "steps(" in raised.value.fix


def test_batches_inside_epochs_is_refused(tmp_path: Path) -> None:
    ckpt = quiet(tmp_path / "run")
    data = ckpt.loader(numbers(12))

    def train() -> None:
        for _epoch in ckpt.epochs(1):
            next(data.batches())

    with pytest.raises(UsageError, match="batches"):
        train()


def test_a_new_dataloader_each_epoch_is_refused_at_the_second_epoch(tmp_path: Path) -> None:
    ckpt = quiet(tmp_path / "run")
    dataset = list(range(12))
    epochs_run = []

    def train() -> None:
        for epoch in ckpt.epochs(3):
            for _ in ckpt.loader(DataLoader(dataset, batch_size=4, shuffle=True)):
                pass
            epochs_run.append(epoch)

    with pytest.raises(UsageError, match="new DataLoader") as raised:
        train()
    assert epochs_run == [0]
    assert "before the loop" in raised.value.fix


def test_a_loader_iterated_in_another_thread_is_refused(tmp_path: Path) -> None:
    ckpt = quiet(tmp_path / "run")
    data = ckpt.loader(numbers(12))
    errors: list[BaseException] = []

    def prefetch() -> None:
        try:
            next(iter(data))
        except BaseException as exc:
            errors.append(exc)

    for _epoch in ckpt.epochs(1):
        thread = threading.Thread(target=prefetch)
        thread.start()
        thread.join()
        for _ in data:
            pass
    assert len(errors) == 1
    assert isinstance(errors[0], UsageError)
    assert "another thread" in str(errors[0])


def test_an_iterator_kept_from_an_earlier_epoch_is_refused(tmp_path: Path) -> None:
    ckpt = quiet(tmp_path / "run")
    data = ckpt.loader(numbers(12))

    def train() -> None:
        kept = iter(data)
        for _epoch in ckpt.epochs(2):
            next(kept)  # epoch 0 starts the iterator; epoch 1 goes on with it

    with pytest.raises(UsageError, match="after the epoch"):
        train()
