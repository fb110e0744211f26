"""A small but complete training run used to prove bit-exact resume.

Usage: python train_cnn.py DIR TOTAL_STEPS [--every N] [--workers N] [--deadline S]
        [--mode steps|epochs] [--sync] [--trace] [--out FILE] [--compile BACKEND]

Small CNN with dropout, AdamW, a OneCycle LR schedule, gradient clipping, a shuffled
DataLoader with worker processes and random augmentation inside the Dataset. Prints one line
per completed step ("step N") and, at the end, the SHA-256 of all parameters and optimizer
state ("final <hash>"), also written to --out. With --trace it also prints every event of
the Checkpointer except "step" ("event save_started 10", "event verified 10", ...), through
the public ``callbacks=`` API, so that a test can act at a known point of a save. With
--compile the model is trained as ``torch.compile(model, backend=BACKEND)`` (its state's names
carry ``_orig_mod.``; the hash is of the plain names, so compiled and plain runs compare).
"""

from __future__ import annotations

import argparse
import faulthandler
import hashlib
import random
import signal
import sys

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import nbresume

# A run the test runner finds hung gets SIGUSR2 first: every thread's stack goes to stderr,
# which the failure report shows.
faulthandler.register(signal.SIGUSR2, all_threads=True)


class NoisyDigits(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Synthetic 1x12x12 images; augmentation draws from the global torch, random and NumPy
    RNGs, as torchvision transforms do."""

    def __init__(self, n: int = 96) -> None:
        g = torch.Generator().manual_seed(1234)
        self.x = torch.randn(n, 1, 12, 12, generator=g)
        self.y = torch.randint(0, 4, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.x[i] + 0.1 * torch.randn(1, 12, 12)
        if random.random() < 0.5:
            x = torch.flip(x, dims=[2])
        x = x * float(np.random.uniform(0.9, 1.1))
        return x, self.y[i]


def say(line: str) -> None:
    """Print one line. The background writer prints events too: one write per line keeps
    lines whole (print() writes the text and the newline separately)."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def state_hash(model: nn.Module, optimizer: torch.optim.Optimizer) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.removeprefix("_orig_mod.").encode())
        digest.update(tensor.detach().contiguous().numpy().tobytes())
    for index, state in sorted(optimizer.state_dict()["state"].items()):
        for key, tensor in sorted(state.items()):
            digest.update(f"{index}/{key}".encode())
            digest.update(tensor.detach().contiguous().numpy().tobytes())
    return digest.hexdigest()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("dir")
    parser.add_argument("total", type=int)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--deadline", type=float, default=None)
    parser.add_argument("--mode", choices=["steps", "epochs"], default="steps")
    parser.add_argument("--sync", action="store_true")
    parser.add_argument("--trace", action="store_true")
    parser.add_argument("--out")
    parser.add_argument("--compile", default=None)
    args = parser.parse_args()

    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    torch.set_num_threads(1)
    model = nn.Sequential(
        nn.Conv2d(1, 8, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Dropout(0.25),
        nn.Flatten(), nn.Linear(8 * 5 * 5, 32), nn.ReLU(), nn.Dropout(0.5), nn.Linear(32, 4),
    )  # fmt: skip
    if args.compile:
        model = torch.compile(model, backend=args.compile)  # type: ignore[assignment]
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    loader = DataLoader(NoisyDigits(), batch_size=8, shuffle=True, num_workers=args.workers)
    steps_per_epoch = len(loader)
    epochs = -(-args.total // steps_per_epoch)
    schedule_steps = args.total if args.mode == "steps" else epochs * steps_per_epoch
    scheduler = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=1e-2, total_steps=schedule_steps
    )

    def trace(event: nbresume.Event) -> None:
        if event.kind != "step":
            say(f"event {event.kind} {event.step}")

    ckpt = nbresume.Checkpointer(
        args.dir, every=args.every, keep=2, deadline=args.deadline, async_save=not args.sync,
        callbacks=[trace] if args.trace else None,
        model=model, optimizer=optimizer, scheduler=scheduler, loader=loader,
    )  # fmt: skip
    data = ckpt.loader()
    ckpt.restore()
    say(f"start {ckpt.step}")

    def train_step(batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        x, y = batch
        loss = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()

    if args.mode == "steps":
        batches = data.batches()
        for step in ckpt.steps(args.total):
            train_step(next(batches))
            say(f"step {step + 1}")
    else:
        for _epoch in ckpt.epochs(epochs):
            for batch in data:
                train_step(batch)
                say(f"step {ckpt.step + 1}")
    ckpt.close()
    final = state_hash(model, optimizer)
    say(f"done {ckpt.done} step {ckpt.step}")
    say(f"final {final}")
    if args.out:
        with open(args.out, "w") as handle:
            handle.write(final)
    return 0


if __name__ == "__main__":
    sys.exit(main())
