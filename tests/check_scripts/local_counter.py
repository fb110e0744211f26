"""A loop whose own step counter, a local variable, lowers the learning rate after 30 steps:
a resumed run counts again from zero and lowers it later. The difference begins at step 30,
after a budget of 20 steps ends."""

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import nbresume

torch.manual_seed(0)
x = torch.randn(128, 8)
y = x @ torch.randn(8, 1)
loader = DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True)
model = nn.Linear(8, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)

ckpt = nbresume.Checkpointer("runs/counter", model=model, optimizer=optimizer, loader=loader)
batches = ckpt.loader().batches()
print("training from step", ckpt.restore())

trained = 0  # the steps this process trained: NOT in the checkpoint
for _ in ckpt.steps(40):
    features, target = next(batches)
    loss = nn.functional.mse_loss(model(features), target)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    trained += 1  # noqa: SIM113 - the counter a user keeps, as written
    if trained == 30:
        for group in optimizer.param_groups:
            group["lr"] = 1e-3

print("finished:", ckpt.done, "at step", ckpt.step)
