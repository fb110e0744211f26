"""A long run (60,000 steps, a save after each under `nbresume check`) of a NumPy vector: its
whole run cannot be covered in a few seconds."""

import torch

import nbresume
from testkit.stateful import Weights

torch.manual_seed(0)
weights = Weights()
ckpt = nbresume.Checkpointer("runs/long", weights=weights, async_save=False, quiet=True)
ckpt.restore()
for step in ckpt.steps(60_000):
    weights.w += step
ckpt.close()
