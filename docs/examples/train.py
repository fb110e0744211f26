import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import nbresume

run = nbresume.init("getting-started")  # checks the machine; run.dir is the checkpoint folder

torch.manual_seed(0)
x = torch.randn(2048, 16)
y = x @ torch.randn(16, 1) + 0.1 * torch.randn(2048, 1)
loader = DataLoader(TensorDataset(x, y), batch_size=64, shuffle=True)
model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

ckpt = run.checkpointer(model=model, optimizer=optimizer, loader=loader, every=200)
batches = ckpt.loader().batches()  # resumes at the exact next batch
print("training from step", ckpt.restore())

for step in ckpt.steps(1_000):  # the steps that are left; saves on the way
    features, target = next(batches)
    loss = nn.functional.mse_loss(model(features), target)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()

print("finished:", ckpt.done, "at step", ckpt.step)
