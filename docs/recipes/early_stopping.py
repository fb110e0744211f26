"""Early stopping with a patience counter kept in the checkpoint."""

import sys

import torch

import nbresume

torch.manual_seed(0)
model = torch.nn.Linear(8, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
data = torch.utils.data.TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
ckpt = nbresume.Checkpointer(
    sys.argv[1] if len(sys.argv) > 1 else "runs/early-stop",
    every=20,
    model=model,
    optimizer=optimizer,
)
ckpt["best"], ckpt["patience"] = float("inf"), 0  # restored by the loop when it resumes
loader = ckpt.loader(torch.utils.data.DataLoader(data, batch_size=16, shuffle=True))

for _epoch in ckpt.epochs(100):
    for x, y in loader:
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        val = torch.nn.functional.mse_loss(model(data.tensors[0]), data.tensors[1]).item()
    if val < ckpt["best"] - 1e-3:
        ckpt["best"], ckpt["patience"] = val, 0
    else:
        ckpt["patience"] += 1
    if ckpt["patience"] >= 3:
        break  # saved as the end of the run; the same command run again trains no further

ckpt.close()
print(f"done={ckpt.done} at epoch {ckpt.epoch}, best {ckpt['best']:.4f}")
