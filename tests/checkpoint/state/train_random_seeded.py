"""A script that seeds only Python's ``random`` and shuffles with it, through nbresume.

``python train_random_seeded.py FOLDER [STOP_AFTER]`` trains two epochs of four batches (or
stops after step STOP_AFTER, saving, as the panel's button does) and prints each batch of
indices it trained on as ``batch i j k``, resuming from FOLDER's checkpoint when there is one.
torch is never seeded: its initial seed differs in every process.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Iterator

import torch
from torch.utils.data import DataLoader, Sampler, TensorDataset

import nbresume


class ShuffledWithRandom(Sampler[int]):
    """Shuffles with the global ``random``, as many a bucketing sampler does."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __iter__(self) -> Iterator[int]:
        order = list(range(self.size))
        random.shuffle(order)
        return iter(order)


def main(folder: str, stop_after: int | None) -> None:
    random.seed(0)
    data = TensorDataset(torch.arange(12))
    ckpt = nbresume.Checkpointer(folder, every=None, deadline=None, async_save=False)
    loader = ckpt.loader(DataLoader(data, batch_size=3, sampler=ShuffledWithRandom(12)))
    ckpt.restore()
    for _epoch in ckpt.epochs(2):
        for (batch,) in loader:
            print("batch", *batch.tolist(), flush=True)
            if ckpt.step + 1 == stop_after:
                ckpt.request_stop()
    ckpt.close()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else None)
