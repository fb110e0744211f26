"""ResumableLoader: a run resumed mid-epoch sees exactly the batches, and exactly the
augmented samples, that the uninterrupted run saw; loading data never moves the training
loop's random streams."""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

import nbresume
from nbresume import ResumableLoader

SIZE = 20  # samples; with batches of 3: 7 batches per epoch, the last one short


class Augmented(Dataset[dict[str, Any]]):
    """Each sample draws from all three global RNGs, as augmentation code does."""

    def __len__(self) -> int:
        return SIZE

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {
            "index": index,
            "torch": torch.rand(2),
            "python": random.random(),
            "numpy": float(np.random.rand()),
        }


class Counting(Dataset[int]):
    """Records every index it is asked for (only meaningful in the main process)."""

    def __init__(self) -> None:
        self.fetched: list[int] = []

    def __len__(self) -> int:
        return SIZE

    def __getitem__(self, index: int) -> int:
        self.fetched.append(index)
        return index


class RandomChunks(Sampler[list[int]]):
    """A custom batch sampler: a random permutation cut into batches of 1, 2, 3, 4, 1, ..."""

    def __len__(self) -> int:
        return 8

    def __iter__(self) -> Iterator[list[int]]:
        order = torch.randperm(SIZE).tolist()
        start = 0
        for number in range(len(self)):
            size = number % 4 + 1
            yield order[start : start + size]
            start += size


def seed_all(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def plain(batch: Any) -> Any:
    """A batch as nested Python values, comparable with ==."""
    if isinstance(batch, torch.Tensor):
        return batch.tolist()
    if isinstance(batch, dict):
        return {k: plain(v) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return [plain(v) for v in batch]
    return batch


def take(loader: ResumableLoader, count: int) -> list[Any]:
    stream = loader.batches()
    return [plain(next(stream)) for _ in range(count)]


Build = Callable[[], DataLoader[Any]]

BUILDS: dict[str, Build] = {
    "shuffle": lambda: DataLoader(Augmented(), batch_size=3, shuffle=True),
    "shuffle-2-workers": lambda: DataLoader(Augmented(), batch_size=3, shuffle=True, num_workers=2),
    "drop-last": lambda: DataLoader(Augmented(), batch_size=3, shuffle=True, drop_last=True),
    "batch-size-none": lambda: DataLoader(Augmented(), batch_size=None, shuffle=True),
    "batch-sampler": lambda: DataLoader(Augmented(), batch_sampler=RandomChunks()),
}


def uninterrupted(build: Build, count: int) -> list[Any]:
    return take(ResumableLoader(build(), seed=7), count)


def resumed(build: Build, count: int, at: int) -> list[Any]:
    """Take ``at`` batches, save the position, then continue in a new wrapper and loader."""
    first = ResumableLoader(build(), seed=7)
    head = take(first, at)
    state = json.loads(json.dumps(first.state_dict()))  # as a checkpoint stores it
    del first
    seed_all(999)  # a new process would start from other global RNG states
    second = ResumableLoader(build(), seed=12345)  # the saved seed must win
    second.load_state_dict(state)
    return head + take(second, count - at)


@pytest.mark.proc  # DataLoader workers are processes
@pytest.mark.parametrize("kind", list(BUILDS))
def test_resumed_iteration_equals_uninterrupted(kind: str) -> None:
    build = BUILDS[kind]
    per_epoch = len(build())
    total = per_epoch * 5 // 2  # 2.5 epochs
    reference = uninterrupted(build, total)
    assert reference == uninterrupted(build, total), "the order must depend on the seed only"
    points = {0, 2, per_epoch, per_epoch + 1, total - 1}
    if kind != "shuffle-2-workers":  # the worker case is slower; a few points prove it
        points |= {1, per_epoch - 1, 2 * per_epoch}
    for at in sorted(points):
        assert resumed(build, total, at) == reference, f"resumed after {at} batches"


def test_epochs_are_shuffled_differently_and_cover_every_sample() -> None:
    batches = uninterrupted(BUILDS["shuffle"], 14)
    epochs = [
        [i for b in batches[:7] for i in b["index"]],
        [i for b in batches[7:] for i in b["index"]],
    ]
    assert sorted(epochs[0]) == sorted(epochs[1]) == list(range(SIZE))
    assert epochs[0] != epochs[1]


def test_resuming_at_an_epoch_end_reached_by_a_for_loop() -> None:
    reference = uninterrupted(BUILDS["shuffle"], 14)
    first = ResumableLoader(BUILDS["shuffle"](), seed=7)
    head = [plain(b) for b in first]  # one whole epoch, the iterator exhausted
    assert first.state_dict()["epoch"] == 1
    assert first.state_dict()["position"] == 0
    second = ResumableLoader(BUILDS["shuffle"](), seed=0)
    second.load_state_dict(first.state_dict())
    assert head + [plain(b) for b in second] == reference


def test_skipped_batches_are_never_loaded() -> None:
    def build() -> tuple[Counting, DataLoader[int]]:
        dataset = Counting()
        return dataset, DataLoader(dataset, batch_size=3, shuffle=True)

    _, loader = build()
    reference = uninterrupted(lambda: loader, 10)

    _, first_loader = build()
    first = ResumableLoader(first_loader, seed=7)
    take(first, 9)  # the third batch of the second epoch
    dataset, loader = build()
    second = ResumableLoader(loader, seed=0)
    second.load_state_dict(first.state_dict())
    rest = take(second, 1)
    assert rest == reference[9:]
    assert dataset.fetched == rest[0], "only the samples of the batch handed out are loaded"


@pytest.mark.proc  # DataLoader workers are processes
def test_augmentation_is_the_same_with_and_without_workers() -> None:
    in_process = uninterrupted(BUILDS["shuffle"], 10)
    with_workers = uninterrupted(BUILDS["shuffle-2-workers"], 10)
    assert in_process == with_workers
    # ...and it is real randomness: per sample and per epoch, not a constant.
    samples: dict[int, list[float]] = {}
    for batch in in_process:
        for index, value in zip(batch["index"], batch["python"], strict=True):
            samples.setdefault(index, []).append(value)
    assert len({v[0] for v in samples.values()}) == SIZE
    assert any(len(set(v)) == 2 for v in samples.values() if len(v) == 2)


def rng_states() -> tuple[Any, ...]:
    return (torch.get_rng_state(), random.getstate(), np.random.get_state())


def assert_same_rng_states(before: tuple[Any, ...], after: tuple[Any, ...]) -> None:
    assert torch.equal(before[0], after[0]), "torch's global generator moved"
    assert before[1] == after[1], "Python's random moved"
    assert before[2][0] == after[2][0]
    assert np.array_equal(before[2][1], after[2][1]), "NumPy's global generator moved"
    assert before[2][2:] == after[2][2:]


@pytest.mark.proc  # DataLoader workers are processes
@pytest.mark.parametrize("kind", ["shuffle", "shuffle-2-workers", "batch-sampler"])
def test_loading_data_does_not_move_the_training_rngs(kind: str) -> None:
    seed_all(5)
    before = rng_states()
    loader = ResumableLoader(BUILDS[kind]())
    assert len(take(loader, 9)) == 9  # more than an epoch, with a sample RNG in every item
    loader.load_state_dict(loader.state_dict())
    assert_same_rng_states(before, rng_states())


@pytest.mark.proc  # DataLoader workers are processes
@pytest.mark.slow
def test_a_spawned_worker_gets_the_same_samples() -> None:
    # Workers started with "spawn" (the default on macOS) receive the dataset pickled.
    def build() -> DataLoader[Any]:
        return DataLoader(
            Augmented(),
            batch_size=3,
            shuffle=True,
            num_workers=1,
            multiprocessing_context="spawn",
        )

    assert uninterrupted(build, 3) == uninterrupted(BUILDS["shuffle"], 3)


@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")
def test_a_stateful_dataloader_resumes_through_its_own_state(tmp_path: Path) -> None:
    stateful = pytest.importorskip("torchdata.stateful_dataloader")

    def build() -> Any:
        # No generator=: StatefulDataLoader saves its sampler's state, not that of a generator
        # handed to it, and draws each epoch's seed from the global RNG that nbresume restores.
        return stateful.StatefulDataLoader(Augmented(), batch_size=3, shuffle=True)

    def stream(loader: Any) -> Iterator[Any]:
        while True:
            yield from loader

    seed_all(0)
    reference = [plain(b) for b, _ in zip(stream(build()), range(17), strict=False)]
    options: dict[str, Any] = {"every": None, "deadline": None, "async_save": False}

    seed_all(0)
    loader = build()
    ckpt = nbresume.Checkpointer(tmp_path / "run", loader=loader, **options)
    assert ckpt["loader"] is loader, "a StatefulDataLoader is kept as it is, not wrapped"
    batches = stream(loader)
    head = [plain(next(batches)) for _ in range(9)]
    ckpt.save(step=9)
    ckpt.close()

    seed_all(55)
    loader = build()
    resumed_ckpt = nbresume.Checkpointer(tmp_path / "run", loader=loader, **options)
    assert resumed_ckpt.restore() == 9
    batches = stream(loader)
    rest = [plain(next(batches)) for _ in range(8)]
    assert [b["index"] for b in head + rest] == [b["index"] for b in reference]
    # Not the torch-drawn augmentation: creating the loader's iterator draws a base seed from
    # torch's global generator, once more in the resumed run than in the original one.
    assert [b["python"] for b in head + rest] == [b["python"] for b in reference]


def test_a_dataloader_given_its_own_batch_sampler_resumes_in_its_batches() -> None:
    """DataLoader(batch_sampler=BatchSampler(RandomSampler(...))), as Accelerate builds the
    loader it prepares: its batches come from that sampler, shuffled, and a resume after the
    first batch hands out the rest of the same epoch."""
    from torch.utils.data import BatchSampler, RandomSampler, TensorDataset

    data = TensorDataset(torch.arange(12))
    loader = DataLoader(data, batch_sampler=BatchSampler(RandomSampler(data), 4, False))
    first = ResumableLoader(loader, seed=5)
    epoch = [batch[0].tolist() for batch in first]
    assert [len(b) for b in epoch] == [4, 4, 4]
    assert sorted(i for b in epoch for i in b) == list(range(12))
    assert [i for b in epoch for i in b] != list(range(12)), "not shuffled"

    resumed = ResumableLoader(loader, seed=0)
    resumed.load_state_dict({**first.state_dict(), "epoch": 0, "position": 1})
    assert [batch[0].tolist() for batch in resumed] == epoch[1:]
