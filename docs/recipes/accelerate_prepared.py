"""Accelerate's prepared objects given to a Checkpointer as they are: exact mid-epoch."""

import sys

import torch
from accelerate import Accelerator

import nbresume

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.1), torch.nn.Linear(16, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=50, gamma=0.5)
data = torch.utils.data.TensorDataset(torch.randn(256, 8), torch.randn(256, 1))
loader = torch.utils.data.DataLoader(data, batch_size=8, shuffle=True, num_workers=2)

accelerator = Accelerator()
model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
ckpt = nbresume.Checkpointer(
    sys.argv[1] if len(sys.argv) > 1 else "runs/accelerate",
    every=10,
    model=model,
    optimizer=optimizer,  # the AcceleratedOptimizer: nbresume takes the optimizer it wraps
    scheduler=scheduler,
)

for _epoch in ckpt.epochs(3):
    for x, y in ckpt.loader(loader):  # the prepared loader, resumed at the exact batch
        loss = torch.nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
ckpt.close()
