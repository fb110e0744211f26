"""A small Lightning run the tests start, kill and start again, unchanged: a classifier with
dropout over a shuffled, augmented DataLoader read by two workers.

    python lightning_train.py ROOT [--plain] [--epochs N] [--every N] [--workers N]
                                   [--epoch-end] [--drive]

Resumes from ``nbresume.lightning.last_checkpoint(ROOT/ckpts)`` and writes the final weights
to ``ROOT/final.safetensors``. ``--plain`` runs Lightning's own checkpoints (pickled .ckpt)
without resuming: the uninterrupted reference. ``--epoch-end`` saves ``last.ckpt`` at epoch
ends instead of every ``--every`` steps; ``--drive`` puts the checkpoints below the mounted
Google Drive (the stand-in's, in the tests).

``NBRESUME_TEST_KILL="save:3:0.01"`` kills the process with SIGKILL during the 3rd save, 0.01 s
after it began (``remove:N:S`` during the Nth removal, ``step:N:0`` after global step N): the
random moments the tests choose. ``ROOT/events.log`` records each step, save and removal, so a
test can tell where a run was killed.
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import nbresume.lightning


class Net(L.LightningModule):
    """A small classifier with dropout: randomness the resume has to carry over."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 2))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("val_loss", loss)
        # A score that goes up and down, so that save_top_k keeps and removes in turn.
        self.log("score", loss + 0.05 * ((self.global_step * 37) % 7))

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=0.01)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.9)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
        }


class Augmented(TensorDataset):
    """The training points with noise drawn from torch's global generator at every load."""

    def __getitem__(self, index: int) -> tuple[torch.Tensor, ...]:
        x, y = super().__getitem__(index)
        return x + 0.1 * torch.randn(x.shape), y


def data(workers: int) -> tuple[DataLoader[Any], DataLoader[Any]]:
    generator = torch.Generator().manual_seed(1234)
    x = torch.randn(320, 8, generator=generator)
    y = (x[:, 0] + x[:, 1] > 0).long()
    train = DataLoader(
        Augmented(x[:256], y[:256]), batch_size=16, shuffle=True, num_workers=workers
    )
    val = DataLoader(TensorDataset(x[256:], y[256:]), batch_size=32, num_workers=0)
    return train, val


class Events(L.Callback):
    """Records each finished step (and kills after one, when asked)."""

    def __init__(self, log: Path, kill_after_step: int | None) -> None:
        self.events = log
        self.kill_after_step = kill_after_step

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        record(self.events, f"step {trainer.global_step}")
        if self.kill_after_step is not None and trainer.global_step >= self.kill_after_step:
            os.kill(os.getpid(), signal.SIGKILL)


class KillingIO(nbresume.lightning.CheckpointIO):
    """The plugin, unchanged, that kills its process during the Nth save or removal."""

    def __init__(self, log: Path, plan: tuple[str, int, float] | None) -> None:
        super().__init__()
        self.events = log
        self.plan = plan
        self.calls = {"save": 0, "remove": 0}

    def _maybe_kill(self, kind: str) -> None:
        self.calls[kind] += 1
        if self.plan is not None and self.plan[0] == kind and self.plan[1] == self.calls[kind]:
            delay = self.plan[2]
            threading.Timer(delay, os.kill, (os.getpid(), signal.SIGKILL)).start()

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None
    ) -> None:
        self._maybe_kill("save")
        super().save_checkpoint(checkpoint, path, storage_options)
        record(self.events, f"saved {Path(path).name} {checkpoint['global_step']}")

    def remove_checkpoint(self, path: Any) -> None:
        self._maybe_kill("remove")
        super().remove_checkpoint(path)
        record(self.events, f"removed {Path(path).name}")


def record(log: Path, line: str) -> None:
    with open(log, "a") as handle:
        handle.write(line + "\n")


#: Seconds after which the run prints every thread's stack (the test waits 300 s).
STACKS_AFTER_S = 200


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("root", type=Path)
    parser.add_argument("--plain", action="store_true")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epoch-end", action="store_true", help="save last.ckpt at epoch ends")
    parser.add_argument("--drive", action="store_true", help="checkpoints below MyDrive")
    args = parser.parse_args(argv)
    # A run that should have ended (or been killed) long ago prints every thread's stack, even
    # one stuck holding the GIL: the test shows it when the run times out.
    faulthandler.dump_traceback_later(STACKS_AFTER_S, exit=False)
    torch.set_num_threads(1)
    L.seed_everything(7, workers=True, verbose=False)
    plan_text = os.environ.get("NBRESUME_TEST_KILL", "")
    plan = None
    if plan_text:
        kind, count, delay = plan_text.split(":")
        plan = (kind, int(count), float(delay))
    log = args.root / "events.log"
    args.root.mkdir(parents=True, exist_ok=True)
    ckpts = args.root / "ckpts"
    if args.drive:
        from nbresume import knobs
        from nbresume.platforms.drive import mount_drive

        ckpts = mount_drive(str(knobs.drive_mount())) / "lightning-run" / "ckpts"
    if args.epoch_end:
        last = L.pytorch.callbacks.ModelCheckpoint(
            dirpath=ckpts,
            filename="epoch-{epoch}",
            save_top_k=1,
            save_last=True,
            save_on_train_epoch_end=True,
        )
    else:
        last = L.pytorch.callbacks.ModelCheckpoint(
            dirpath=ckpts, every_n_train_steps=args.every, save_top_k=0, save_last=True
        )
    best = L.pytorch.callbacks.ModelCheckpoint(
        dirpath=ckpts, monitor="score", mode="min", save_top_k=2, filename="best-{step}"
    )
    kill_step = int(plan[1]) if plan is not None and plan[0] == "step" else None
    callbacks: list[Any] = [last, best, Events(log, kill_step)]
    plugins: list[Any] = []
    if not args.plain:
        callbacks.append(nbresume.lightning.Callback())
        plugins.append(KillingIO(log, plan))
    trainer = L.Trainer(
        max_epochs=args.epochs,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        val_check_interval=0.5,
        callbacks=callbacks,
        plugins=plugins,
        default_root_dir=args.root,
    )
    train, val = data(args.workers)
    model = Net()
    resume = None if args.plain else nbresume.lightning.last_checkpoint(ckpts)
    record(log, f"start {resume}")
    trainer.fit(model, train, val, ckpt_path=resume)
    from safetensors.torch import save_file

    save_file(
        {k: v.contiguous() for k, v in model.state_dict().items()}, args.root / "final.safetensors"
    )
    record(log, "done")


if __name__ == "__main__":
    main(sys.argv[1:])
