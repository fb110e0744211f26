"""An epoch loop whose sampler shuffles with Python's global ``random``: the wrapped loader
reads every epoch's order under that epoch's own seed, so a resumed epoch has the same order."""

import random

import torch
from torch import nn
from torch.utils.data import DataLoader, Sampler, TensorDataset

import nbresume


class ShuffledSampler(Sampler[int]):
    def __init__(self, size: int) -> None:
        self.size = size

    def __iter__(self):
        order = list(range(self.size))
        random.shuffle(order)
        return iter(order)

    def __len__(self) -> int:
        return self.size


random.seed(0)
torch.manual_seed(0)
x = torch.randn(64, 8)
y = x @ torch.randn(8, 1)
loader = DataLoader(TensorDataset(x, y), batch_size=16, sampler=ShuffledSampler(64))
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

ckpt = nbresume.Checkpointer("runs/sampler", model=model, optimizer=optimizer, every=200)
print("training from step", ckpt.restore())

for _ in ckpt.epochs(100):
    for features, target in ckpt.loader(loader):
        loss = nn.functional.mse_loss(model(features), target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

print("finished:", ckpt.done, "at epoch", ckpt.epoch)
