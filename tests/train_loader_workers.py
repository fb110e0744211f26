"""A tiny training run whose DataLoader loads in two worker processes, started by the start
method a command names (fork, spawn or forkserver).

The dataset augments every sample from the three global RNGs (torch, random, NumPy) and the
model has dropout, so a resume is exact only if every sample's randomness and the training
loop's own stream continue exactly. ``train(folder, start_method)`` trains one epoch of
:data:`BATCHES` batches, saving every :data:`EVERY` steps, resuming from ``folder``. One
epoch: every pass over the data starts its workers again, which under spawn costs each of
them torch's import.

Under spawn and forkserver a worker is a new interpreter: it unpickles the dataset and the
``worker_init_fn``, so both are defined at the top of this module, which the worker imports
again (as ``__mp_main__``) when this file is the program being run.

Run as ``python train_loader_workers.py COMMAND_JSON``, as ``train_loop_shapes.py`` is, it
runs one command (in a process group of its own) with its output appended to a log file:
``start S``, ``worker fresh=F parent=P`` from each worker, ``step N``, ``done N``.
"""

from __future__ import annotations

import os
import random
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy
import torch
from torch import nn
from torch.utils.data import DataLoader

import nbresume
import zygote
from testkit.training import Augmented, Points, trained_tensors

EVERY = 3
BATCHES = 10  # per epoch
EPOCHS = 1
BATCH_SIZE = 4


def say(line: str) -> None:
    """One whole line per write: workers and the background save thread write too."""
    os.write(1, (line + "\n").encode())


def batch_noise(rows: int) -> torch.Tensor:
    """Noise for a batch of ``rows`` samples, drawn from torch, random and NumPy."""
    return 0.1 * torch.rand(rows, 4) + 0.1 * random.random() + 0.1 * float(numpy.random.rand())


def noisy_collate(
    samples: list[tuple[torch.Tensor, torch.Tensor]],
) -> tuple[torch.Tensor, torch.Tensor]:
    """A ``collate_fn`` that augments the whole batch from the global RNGs."""
    x = torch.stack([s[0] for s in samples])
    y = torch.stack([s[1] for s in samples])
    return x + batch_noise(len(samples)), y


class BatchedNoise(Points):
    """Loads a batch at once (``__getitems__``) and adds noise to it from the global RNGs."""

    def __getitems__(self, indices: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        x = self.x[indices] + batch_noise(len(indices))
        return list(zip(x, self.y[indices], strict=True))


def announce(worker_id: int) -> None:
    """The user's ``worker_init_fn``: says whether the worker is a new interpreter (spawn,
    forkserver) and whether the trainer is its parent (not under forkserver)."""
    fresh = sys.modules["__main__"].__name__ == "__mp_main__"
    parent = "trainer" if os.getppid() == int(os.environ["TRAINER_PID"]) else "other"
    say(f"worker fresh={fresh} parent={parent}")


def train(
    folder: Path, start_method: str, *, pause: float = 0.0, kind: str = "sample"
) -> dict[str, torch.Tensor]:
    """Train until done, resuming from ``folder``; the final weights and optimizer state.
    ``kind``: where the data's randomness is drawn: per sample (``__getitem__``), per batch in
    the ``collate_fn`` (``collate``) or per batch in ``__getitems__`` (``getitems``)."""
    os.environ["TRAINER_PID"] = str(os.getpid())
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.2), nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.5)
    count = BATCHES * BATCH_SIZE
    datasets = {"sample": Augmented, "collate": Points, "getitems": BatchedNoise}
    loader = DataLoader(
        datasets[kind](count),
        batch_size=BATCH_SIZE,
        collate_fn=noisy_collate if kind == "collate" else None,
        shuffle=True,
        num_workers=2,
        multiprocessing_context=start_method,
        worker_init_fn=announce,
    )
    ck = nbresume.Checkpointer(
        folder, every=EVERY, keep=100, deadline=None, model=model, optimizer=optimizer
    )
    data = ck.loader(loader)
    ck.restore()
    say(f"start {ck.step}")
    for _epoch in ck.epochs(EPOCHS):
        for x, y in data:
            loss = nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()  # type: ignore[no-untyped-call]
            optimizer.step()
            say(f"step {ck.step + 1}")
            if pause:
                time.sleep(pause)  # gives the test time to kill mid-epoch
    ck.close()
    say(f"done {ck.step}")
    return trained_tensors(model, optimizer)


def _train(command: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    # The trainer leads a process group (and session) of its own, as the warm server starts
    # it: its workers and the fork server are in it, one group to clean up.
    assert os.getpgid(0) == os.getpid()
    return train(
        Path(command["folder"]),
        command["start_method"],
        pause=command["pause"],
        kind=command.get("kind", "sample"),
    )


if __name__ == "__main__":
    zygote.main(lambda command: zygote.run_logged(command, _train))
