"""A small training run whose model, optimizer, DataLoader and scheduler went through
``accelerator.prepare()`` and are given, as prepared, to a Checkpointer.

    python accelerate_train.py FOLDER [--kill-at STEP]
    accelerate launch --cpu --num_processes 2 accelerate_train.py FOLDER [--kill-at STEP]

The model has dropout, the optimizer momentum, the scheduler lowers the rate every 4 steps,
and the shuffled DataLoader augments every sample from the global RNGs: a resume is exact
only if all of it continues. ``--kill-at STEP``: the process kills itself with SIGKILL once
STEP is done (every rank, under ``accelerate launch``). Rank 0 writes the final weights and
optimizer state to ``FOLDER/final.pt``; each rank prints ``rank R start S`` and
``rank R done N``.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

import torch
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader

import nbresume
from testkit.training import Augmented

EPOCHS = 2
EVERY = 3


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("folder", type=Path)
    parser.add_argument("--kill-at", type=int, default=None)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    accelerator = Accelerator(cpu=True)
    rank = accelerator.process_index
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.2), nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.5)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.8)
    loader = DataLoader(Augmented(48), batch_size=4, shuffle=True)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    ck = nbresume.Checkpointer(
        args.folder,
        every=EVERY,
        keep=100,
        deadline=None,
        quiet=True,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
    )
    ck.restore()
    print(f"rank {rank} start {ck.step}\n", end="", flush=True)  # one write
    for _epoch in ck.epochs(EPOCHS):
        for x, y in ck.loader(loader):
            loss = nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            if ck.step + 1 == args.kill_at:
                # The save before the kill has committed (on a loaded machine a background
                # save can still be in flight): this kill tests the resume from it; kills in
                # the middle of a save are the fault tests' part.
                ck.wait()
                os.kill(os.getpid(), signal.SIGKILL)
    ck.close()
    print(f"rank {rank} done {ck.step}\n", end="", flush=True)  # one write
    if accelerator.is_main_process:
        inner = accelerator.unwrap_model(model)
        tensors = {f"model.{k}": v.detach().clone() for k, v in inner.state_dict().items()}
        for index, values in optimizer.optimizer.state_dict()["state"].items():
            for key, value in values.items():
                tensors[f"optimizer.{index}.{key}"] = value.detach().clone()
        torch.save(tensors, args.folder / "final.pt")
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main(sys.argv[1:])
