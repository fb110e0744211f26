"""A tiny deterministic training run, written in each of the loop shapes users write.

``train(folder, shape)`` trains a small model with dropout and SGD with momentum over a
shuffled DataLoader for two epochs of 12 batches (the break shape: three epochs capped at 8
batches; the sequential shape: two loaders of 12 batches one after the other), saving every
3 steps. Every shape makes the same number of steps per run as noted in :data:`SHAPES`.
With ``device`` (the GPU tests: ``tests/gpu/``) the same loop trains the way GPU code is
written: the model on that device, the batches moved there with ``non_blocking=True``, noise
drawn on the device in the loss, and ``deterministic=True``.

Run as a script (``python train_loop_shapes.py COMMAND_JSON``, forked from the suite's warm
server by ``zygote.Zygote``, so that a test can SIGKILL real training processes without paying
torch's import each time) it runs one command with its output appended to a log file:
``start S`` (the step it resumed from), ``step N`` after every update, ``verified N`` when a
checkpoint verified, ``done N`` at the end.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import nbresume
import zygote
from nbresume.checkpoint.events import Callback
from testkit.training import trained_tensors

EVERY = 3
BATCHES = 12  # per epoch of each loader
CAP = 8  # batches per epoch in the break shape

#: shape -> (epochs, steps of the whole run)
SHAPES: dict[str, tuple[int, int]] = {
    "wrapped-before": (2, 24),
    "wrapped-inside": (2, 24),
    "enumerate": (2, 24),
    "constructor": (2, 24),
    "zip": (2, 24),
    "sequential": (2, 48),
    "validation": (2, 24),
    "steps": (2, 24),
    "break": (3, 24),
}


def say(line: str) -> None:
    """One whole line per write: the background save thread prints too."""
    os.write(1, (line + "\n").encode())


def data(n: int, seed: int, batch_size: int, *, shuffle: bool = True) -> DataLoader[Any]:
    g = torch.Generator().manual_seed(seed)
    dataset = TensorDataset(torch.randn(n, 4, generator=g), torch.randn(n, 1, generator=g))
    return DataLoader(dataset, batch_size=batch_size, shuffle=shuffle)


def train(
    folder: Path,
    shape: str,
    *,
    pause: float = 0.0,
    callbacks: list[Callback] | None = None,
    stop_after: int | None = None,
    device: str | None = None,
) -> dict[str, torch.Tensor]:
    """Train in ``shape`` until done (resuming from ``folder``); the final weights and
    optimizer state, on the CPU. ``stop_after``: ask the loop to stop (``request_stop()``, as
    the panel's button and a deadline do) once that step is done. ``device``: train there,
    as GPU code does (see the module's docstring); None: plainly, on the CPU."""
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.2), nn.Linear(8, 1))
    if device is not None:
        model.to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.5)
    first = data(4 * BATCHES, 1, 4)
    second = data(2 * BATCHES, 2, 2)
    validation = data(20, 3, 5)  # a plain DataLoader: shuffled from the global torch RNG

    def forward(x: torch.Tensor) -> torch.Tensor:
        if device is None:
            return model(x)  # type: ignore[no-any-return]
        out = model(x.to(device, non_blocking=True))
        # The device's own random stream takes part (dropout draws from it too).
        return out + 0.1 * torch.randn(out.shape, device=device)  # type: ignore[no-any-return]

    def update(x: torch.Tensor, y: torch.Tensor) -> None:
        if device is not None:
            y = y.to(device, non_blocking=True)
        loss = nn.functional.mse_loss(forward(x), y)
        optimizer.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        if pause:
            time.sleep(pause)  # gives the test time to kill mid-run

    def done_step() -> None:
        # Inside epochs() the running step ends later; inside steps() ck.step is its index.
        say(f"step {ck.step + 1}")
        if ck.step + 1 == stop_after:
            ck.request_stop()

    events = [*(callbacks or [])]
    events.append(lambda e: say(f"verified {e.step}") if e.kind == "verified" else None)
    state: dict[str, Any] = {"model": model, "optimizer": optimizer}
    if shape == "constructor":
        state["loader"] = first
    ck = nbresume.Checkpointer(
        folder,
        every=EVERY,
        keep=100,
        deadline=None,
        callbacks=events,
        deterministic=device is not None,
        **state,
    )
    epochs = SHAPES[shape][0]
    if shape in {"wrapped-before", "validation", "break"}:
        loader = ck.loader(first)
    ck.restore()
    say(f"start {ck.step}")
    if shape == "steps":
        batches = ck.loader(first).batches()
        for _ in ck.steps(SHAPES[shape][1]):
            update(*next(batches))
            done_step()
    else:
        for _epoch in ck.epochs(epochs):
            if shape == "wrapped-before":
                for x, y in loader:
                    update(x, y)
                    done_step()
            elif shape == "wrapped-inside":
                for x, y in ck.loader(first):
                    update(x, y)
                    done_step()
            elif shape == "enumerate":
                for _i, (x, y) in enumerate(ck.loader(first)):
                    update(x, y)
                    done_step()
            elif shape == "constructor":
                for x, y in ck.loader():
                    update(x, y)
                    done_step()
            elif shape == "zip":
                for (x, y), (x2, y2) in zip(ck.loader(first), ck.loader(second), strict=False):
                    update(torch.cat([x, x2]), torch.cat([y, y2]))
                    done_step()
            elif shape == "sequential":
                for x, y in ck.loader(first):
                    update(x, y)
                    done_step()
                for x, y in ck.loader(second):
                    update(x, y)
                    done_step()
            elif shape == "validation":
                for x, y in loader:
                    update(x, y)
                    done_step()
                model.eval()
                with torch.no_grad():
                    loss = sum(
                        nn.functional.mse_loss(forward(x).cpu(), y).item() for x, y in validation
                    )
                model.train()
                ck.save(metric=loss)  # the checkpoint of the end of the epoch
            elif shape == "break":
                for x, y in loader:
                    update(x, y)
                    done_step()
                    if loader.position == CAP:  # the position in the epoch, kept on resume
                        break
            else:
                raise ValueError(shape)
    ck.close()
    assert ck.done or stop_after is not None
    say(f"done {ck.step}" if ck.done else f"stopped {ck.step}")
    return trained_tensors(model, optimizer)


def _train(command: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    return train(Path(command["folder"]), command["shape"], pause=command["pause"])


if __name__ == "__main__":
    zygote.main(lambda command: zygote.run_logged(command, _train))
