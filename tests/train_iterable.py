"""A tiny deterministic training run over an IterableDataset, in the two loop shapes.

``train(folder, shape, workers)`` trains a small model with dropout and SGD with momentum
for two epochs of 16 batches of a stream that shuffles per epoch in ``set_epoch``, shards
itself over the DataLoader's workers, and augments every item with torch's, Python's and
NumPy's global random generators inside ``__iter__``. ``shape`` is ``"epochs"`` (the loader
iterated inside ``ckpt.epochs()``) or ``"steps"`` (``ckpt.steps()`` with ``.batches()``);
``workers`` is the DataLoader's ``num_workers`` (forked workers). It saves every 4 steps,
each save committed before the next step starts (a kill lands between saves: the step a
killed run resumes from is known).

Run as a script (``python train_iterable.py COMMAND_JSON``, as ``train_loop_shapes.py`` is)
it runs one command with its output appended to a log file (``start S``, ``step N`` after
every update, ``done N`` at the end).
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

import nbresume
import zygote
from testkit.training import trained_tensors

EVERY = 4
ITEMS = 48
BATCH = 3  # 16 batches per epoch, with or without two workers (24 items each)
EPOCHS = 2
TOTAL = EPOCHS * ITEMS // BATCH
SHAPES = ("epochs", "steps")


class AugmentedStream(IterableDataset[tuple[torch.Tensor, torch.Tensor]]):
    """Items in an order shuffled per epoch (``set_epoch``), split over the workers, each
    augmented with draws from the three global random generators."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(ITEMS, 4, generator=g)
        self.y = torch.randn(ITEMS, 1, generator=g)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        order = torch.randperm(ITEMS, generator=torch.Generator().manual_seed(self.epoch))
        worker = get_worker_info()
        if worker is not None:
            order = order[worker.id :: worker.num_workers]
        for index in order.tolist():
            noise = 0.1 * torch.rand(4) + random.gauss(0.0, 0.1) + float(np.random.rand())
            yield self.x[index] + noise, self.y[index]


def say(line: str) -> None:
    """One whole line per write: the background save thread prints too."""
    os.write(1, (line + "\n").encode())


def data(workers: int) -> DataLoader[Any]:
    context = "fork" if workers else None
    return DataLoader(
        AugmentedStream(), batch_size=BATCH, num_workers=workers, multiprocessing_context=context
    )


def train(
    folder: Path,
    shape: str,
    workers: int,
    *,
    pause: float = 0.0,
    stop_after: int | None = None,
) -> dict[str, torch.Tensor]:
    """Train until done (resuming from ``folder``); the final weights and optimizer state.
    ``stop_after``: ``request_stop()`` once that step is done (saved there, then left)."""
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.2), nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.5)
    ck = nbresume.Checkpointer(
        folder,
        every=EVERY,
        keep=100,
        deadline=None,
        async_save=False,
        model=model,
        optimizer=optimizer,
    )
    loader = ck.loader(data(workers))
    ck.restore()
    say(f"start {ck.step}")

    def update(x: torch.Tensor, y: torch.Tensor) -> None:
        loss = nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        # Inside epochs() the running step ends later; inside steps() ck.step is its index.
        step = ck.step + 1
        say(f"step {step}")
        if step == stop_after:
            ck.request_stop()
        if pause:
            time.sleep(pause)  # gives the test time to kill mid-run

    if shape == "steps":
        batches = loader.batches()
        for _ in ck.steps(TOTAL):
            update(*next(batches))
    else:
        for _epoch in ck.epochs(EPOCHS):
            for x, y in loader:
                update(x, y)
    ck.close()
    assert ck.done or stop_after is not None
    say(f"done {ck.step}" if ck.done else f"stopped {ck.step}")
    return trained_tensors(model, optimizer)


def _train(command: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    return train(
        Path(command["folder"]), command["shape"], command["workers"], pause=command["pause"]
    )


if __name__ == "__main__":
    zygote.main(lambda command: zygote.run_logged(command, _train))
