"""The quickstart's loop with early stopping whose patience counter is a local variable: a
resumed run starts counting again, and stops at another step than an uninterrupted one."""

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import nbresume

torch.manual_seed(0)
x = torch.randn(256, 8)
y = x @ torch.randn(8, 1)
x_val, y_val = x[:64], y[:64]
loader = DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)

ckpt = nbresume.Checkpointer(
    "runs/early", model=model, optimizer=optimizer, loader=loader, every=200
)
ckpt["best"] = float("inf")  # kept in the checkpoint
patience = 0  # steps without an improvement: NOT in the checkpoint
batches = ckpt.loader().batches()
print("training from step", ckpt.restore())

for step in ckpt.steps(1_000):
    features, target = next(batches)
    loss = nn.functional.mse_loss(model(features), target)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    with torch.no_grad():
        val = nn.functional.mse_loss(model(x_val), y_val).item()
    if val < ckpt["best"] - 0.05:
        ckpt["best"], patience = val, 0
    else:
        patience += 1
    if patience >= 6:
        print("early stop at step", step)
        break

print("finished:", ckpt.done, "at step", ckpt.step)
