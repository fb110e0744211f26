"""The quickstart's loop with noise from a NumPy generator that the Checkpointer is not given:
a resumed run draws the noise again from the generator's seed."""

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import nbresume

torch.manual_seed(0)
rng = np.random.default_rng(0)  # a stream of its own, not in the checkpoint
x = torch.randn(256, 8)
y = x @ torch.randn(8, 1)
loader = DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

ckpt = nbresume.Checkpointer(
    "runs/noise", model=model, optimizer=optimizer, loader=loader, every=200
)
batches = ckpt.loader().batches()
print("training from step", ckpt.restore())

for _ in ckpt.steps(1_000):
    features, target = next(batches)
    noise = torch.from_numpy(rng.normal(0.0, 0.1, size=tuple(features.shape)).astype(np.float32))
    loss = nn.functional.mse_loss(model(features + noise), target)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()

print("finished:", ckpt.done, "at step", ckpt.step)
