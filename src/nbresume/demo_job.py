"""The training job of ``nbresume demo`` (:mod:`nbresume.demo`), run as
``python -m nbresume.demo_job FOLDER STEPS`` in a child process that the demo kills and starts
again: the same code a user would write, from ``import nbresume`` on. It prints ``start N``,
``step N`` after each step and ``final SHA256`` (:func:`weights_hash`) at the end."""

from __future__ import annotations

import hashlib
import logging
import random
import sys
from typing import Any


def train(folder: str, total: int) -> None:
    """The training job: the same code a user would write (run in a child process)."""
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    import nbresume

    torch.manual_seed(0)
    random.seed(0)  # its state is saved too: seeded, every checkpoint has the same bytes each time
    torch.set_num_threads(1)
    features = torch.randn(512, 32)
    labels = (features[:, :4].sum(dim=1) > 0).long()
    loader = DataLoader(TensorDataset(features, labels), batch_size=32, shuffle=True)
    model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Dropout(0.2), nn.Linear(256, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total)

    # The demo tells the story itself: no status line, and the takeover of the writer lease
    # of the process it just killed is expected here, not worth a warning.
    logging.getLogger("nbresume").setLevel(logging.ERROR)
    ckpt = nbresume.Checkpointer(
        folder,
        every=10,
        keep=3,
        quiet=True,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
    )
    start = ckpt.restore()
    print(f"start {start}", flush=True)
    batches = ckpt.loader(loader).batches()
    for step in ckpt.steps(total):
        x, y = next(batches)
        noisy = x + 0.05 * torch.randn_like(x)  # randomness in the loop, restored exactly
        loss = nn.functional.cross_entropy(model(noisy), y)
        optimizer.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        scheduler.step()
        print(f"step {step + 1}", flush=True)
    ckpt.close()
    print(f"final {weights_hash(model)}", flush=True)


def weights_hash(model: Any) -> str:
    """SHA-256 over every parameter and buffer, in name order."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().contiguous().numpy().tobytes())
    return digest.hexdigest()


if __name__ == "__main__":
    train(sys.argv[1], int(sys.argv[2]))
