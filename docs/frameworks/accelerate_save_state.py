"""Accelerate's own checkpoints (save_state/load_state), one per epoch, each committed and
verified by nbresume; a rerun of the same script continues after the newest that verifies."""

from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration, set_seed
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import nbresume.hf

EPOCHS = 6

set_seed(0)
x = torch.randn(2048, 4)
dataset = TensorDataset(x, x.sum(1, keepdim=True))
loader = DataLoader(dataset, batch_size=8, shuffle=True)
model = nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.1), nn.Linear(16, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

folder = nbresume.hf.last_checkpoint("runs/exp/checkpoints")  # the newest that verifies
done = 0 if folder is None else int(Path(folder).name.split("_")[1]) + 1  # epochs saved
accelerator = Accelerator(
    project_config=ProjectConfiguration(
        project_dir="runs/exp",
        automatic_checkpoint_naming=True,
        iteration=done,  # the next save is checkpoint_<done>: Accelerate counts from 0
    )
)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
if folder is not None:
    accelerator.load_state(folder)  # weights, optimizer, random states

for _epoch in range(done, EPOCHS):
    for xb, yb in loader:
        loss = nn.functional.mse_loss(model(xb), yb)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    nbresume.hf.save_state(accelerator)  # instead of accelerator.save_state()
