"""Lightning's ``ddp`` strategy on two CPU processes:
``torchrun --nproc-per-node 2 ddp_lightning_train.py ROOT [--steps N] [--deadline-on-rank R:S]``.

The model and data of ``lightning_train.py`` (a small classifier with dropout), trained with
``nbresume.lightning.CheckpointIO()`` and ``nbresume.lightning.Callback()``, checkpoints in
``ROOT/ckpts`` (``last.ckpt`` only), resumed from ``nbresume.lightning.last_checkpoint``.
``--deadline-on-rank`` gives that one rank a deadline of S seconds from its start (the other
has none). Every rank prints the lines of ``ddp_hf_train.py``: ``rank R pid P``,
``rank R resume NAME``, ``rank R start S``, ``rank R step S``, ``rank R event KIND S``, then
``rank R final HASH`` or ``rank R stopped CODE``, then ``rank R teardown`` just before the
rank ends.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from ddp_rank import deadline_on, end_rank, say
from lightning_train import Net, data

import nbresume.lightning


class Report(L.Callback):
    def __init__(self, rank: int) -> None:
        self.rank = rank

    def on_train_start(self, trainer: L.Trainer, *args: Any) -> None:
        say(self.rank, f"start {trainer.global_step}")

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        say(self.rank, f"step {trainer.global_step}")


class Events(L.Callback):
    """Prints nbresume's events (but steps) of the callback's watch, from the start on."""

    def __init__(self, rank: int, watcher: nbresume.lightning.Callback) -> None:
        self.rank = rank
        self.watcher = watcher

    def on_train_start(self, trainer: L.Trainer, *args: Any) -> None:
        if self.watcher.watch is not None:
            self.watcher.watch.events.subscribe(self.trace)

    def trace(self, event: Any) -> None:
        if event.kind != "step":
            say(self.rank, f"event {event.kind} {event.step}")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("root", type=Path)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--deadline-on-rank", default="", help="RANK:SECONDS")
    options = parser.parse_args()
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    say(rank, f"pid {os.getpid()}")
    deadline = deadline_on(rank, options.deadline_on_rank)
    L.seed_everything(7, workers=True, verbose=False)
    ckpts = options.root / "ckpts"

    watcher = nbresume.lightning.Callback(deadline=deadline)
    last = L.pytorch.callbacks.ModelCheckpoint(dirpath=ckpts, save_top_k=0, save_last=True)
    trainer = L.Trainer(
        max_steps=options.steps,
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[last, watcher, Events(rank, watcher), Report(rank)],
        plugins=[nbresume.lightning.CheckpointIO()],
        default_root_dir=options.root,
    )
    train, _ = data(0)
    model = Net()
    resume = nbresume.lightning.last_checkpoint(ckpts)
    say(rank, f"resume {Path(resume).name if resume else None}")
    code = 0
    try:
        trainer.fit(model, train, ckpt_path=resume)
    except SystemExit as stop:  # stopped on a signal: the status that signal asks for
        code = stop.code if isinstance(stop.code, int) else 1
    if trainer.global_step < options.steps:
        say(rank, f"stopped {code}")
    else:
        digest = hashlib.sha256()
        for name, tensor in sorted(model.state_dict().items()):
            digest.update(name.encode() + tensor.detach().contiguous().numpy().tobytes())
        say(rank, f"final {digest.hexdigest()}")
    end_rank(rank, code)


if __name__ == "__main__":
    sys.exit(main())
