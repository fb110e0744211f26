"""Pieces of the small torch training runs that the tests and their child scripts share."""

from __future__ import annotations

import random

import numpy
import torch
from torch import nn
from torch.utils.data import Dataset


class Points(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """``count`` fixed points (4 features, 1 target), loaded as they are."""

    def __init__(self, count: int) -> None:
        generator = torch.Generator().manual_seed(1)
        self.x = torch.randn(count, 4, generator=generator)
        self.y = torch.randn(count, 1, generator=generator)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[index], self.y[index]


class Augmented(Points):
    """Fixed points with noise drawn from torch, random and NumPy at every load."""

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        noise = 0.1 * torch.rand(4) + 0.1 * random.random() + 0.1 * float(numpy.random.rand())
        return self.x[index] + noise, self.y[index]


def trained_tensors(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Copies, on the CPU, of every tensor of the model and of the optimizer's state, by name
    (``model.<key>``, ``optimizer.<index>.<key>``): what a run ended with, to compare."""
    tensors = {f"model.{k}": v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    for index, values in optimizer.state_dict()["state"].items():
        for key, value in values.items():
            tensors[f"optimizer.{index}.{key}"] = value.detach().to("cpu", copy=True)
    return tensors


def assert_restored_exactly(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    restored: nn.Module,
    restored_optimizer: torch.optim.Optimizer,
) -> None:
    """``restored`` and ``restored_optimizer`` hold exactly the tensors of ``model`` and
    ``optimizer``, each optimizer tensor on its device (a step count stays on the host)."""
    for key, value in model.state_dict().items():
        assert torch.equal(restored.state_dict()[key], value), key
    for index, state in optimizer.state_dict()["state"].items():
        again = restored_optimizer.state_dict()["state"][index]
        for key, value in state.items():
            assert torch.equal(again[key], value), (index, key)
            assert again[key].device == value.device, (index, key)


def train_steps(
    model: nn.Module, optimizer: torch.optim.Optimizer, steps: range, batch: int
) -> None:
    """One optimizer step for each of ``steps``, on ``batch`` rows of 8 random features drawn
    from a generator seeded with the step: the same steps give the same updates."""
    for step in steps:
        generator = torch.Generator().manual_seed(step)
        loss = model(torch.randn(batch, 8, generator=generator)).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
