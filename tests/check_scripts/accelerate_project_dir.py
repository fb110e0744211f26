"""An Accelerate loop whose framework writes into a fixed, relative folder: Accelerate's
``project_dir``, where ``save_state()`` refuses to write a checkpoint folder that exists."""

import torch
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import nbresume

accelerator = Accelerator(
    cpu=True,
    project_config=ProjectConfiguration(
        project_dir="accelerate_out", automatic_checkpoint_naming=True
    ),
)
torch.manual_seed(0)
x = torch.randn(64, 4)
y = x @ torch.randn(4, 1)
loader = DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True)
model = nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)

ckpt = nbresume.Checkpointer("runs/acc", model=model, optimizer=optimizer, loader=loader)
batches = ckpt.loader().batches()
ckpt.restore()
for _ in ckpt.steps(10):
    features, target = next(batches)
    loss = nn.functional.mse_loss(model(features), target)
    optimizer.zero_grad()
    accelerator.backward(loss)
    optimizer.step()

accelerator.save_state()  # accelerate_out/checkpoints/checkpoint_0: refused where it exists
print("finished:", ckpt.done, "at step", ckpt.step)
