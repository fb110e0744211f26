"""Gradient accumulation: one optimizer step every ACCUMULATE batches."""

import sys

import torch

import nbresume

ACCUMULATE = 4
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.1), torch.nn.Linear(16, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
data = torch.utils.data.TensorDataset(torch.randn(256, 8), torch.randn(256, 1))
ckpt = nbresume.Checkpointer(
    sys.argv[1] if len(sys.argv) > 1 else "runs/accumulate",
    every=10,  # any cadence: a save between two optimizer steps keeps the pending gradients
    model=model,
    optimizer=optimizer,
)
batches = ckpt.loader(torch.utils.data.DataLoader(data, batch_size=8, shuffle=True)).batches()

for step in ckpt.steps(200):  # a step is one batch
    x, y = next(batches)
    loss = torch.nn.functional.mse_loss(model(x), y) / ACCUMULATE
    loss.backward()
    if (step + 1) % ACCUMULATE == 0:
        optimizer.step()
        optimizer.zero_grad()
ckpt.close()
