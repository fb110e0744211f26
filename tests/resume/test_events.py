"""Progress events, as a panel, a progress bar or a logger receives them through ``callbacks=``.

One ``step`` event per step; for each save ``save_started``, ``committed`` and ``verified`` in
that order, and each one true when it arrives (committed: a fresh reader finds the
checkpoint; verified: it matches its manifest); ``done`` last. A callback that raises is
logged and training goes on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import nbresume
from nbresume import Event

SAVE_KINDS = ["save_started", "committed", "verified"]


class Recorder:
    """A callback that also checks, at the moment an event arrives, what it claims."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.events: list[Event] = []
        self.claims: list[tuple[str, int, bool]] = []

    def __call__(self, event: Event) -> None:
        self.events.append(event)
        if event.kind == "committed":
            # A process starting now would find this checkpoint (and only complete ones).
            steps = [info.step for info in nbresume.CheckpointStore(self.root).list()]
            self.claims.append((event.kind, event.step, event.step in steps))
        elif event.kind == "verified":
            report = nbresume.CheckpointStore(self.root).verify(event.step)
            self.claims.append((event.kind, event.step, report.ok and bool(report.results)))

    def kinds(self, *kinds: str) -> list[tuple[str, int]]:
        return [(e.kind, e.step) for e in self.events if e.kind in kinds]


def train(
    root: Path, callbacks: list[Callable[[Event], None]], *, mode: str, async_save: bool
) -> nbresume.Checkpointer:
    """Seven steps (steps mode) or two epochs of three batches (epochs mode), saving every 2."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = TensorDataset(torch.randn(12, 4), torch.randn(12, 2))
    loader = DataLoader(data, batch_size=4, shuffle=True)
    ckpt = nbresume.Checkpointer(
        root, every=2, keep=2, deadline=None, async_save=async_save, callbacks=callbacks,
        model=model, optimizer=optimizer, loader=loader,
    )  # fmt: skip

    def step(batch: Any) -> None:
        x, y = batch
        loss = (model(x) - y).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    if mode == "steps":
        batches = ckpt.loader().batches()
        for _ in ckpt.steps(7):
            step(next(batches))
    else:
        for _ in ckpt.epochs(2):
            for batch in ckpt.loader():
                step(batch)
    ckpt.close()
    return ckpt


MODES = pytest.mark.parametrize(
    ("mode", "async_save"),
    [("steps", True), ("steps", False), ("epochs", True), ("epochs", False)],
    ids=["steps-async", "steps-sync", "epochs-async", "epochs-sync"],
)


@MODES
def test_events_of_a_run_in_order(tmp_path: Path, mode: str, async_save: bool) -> None:
    recorder = Recorder(tmp_path / "run")
    ckpt = train(recorder.root, [recorder], mode=mode, async_save=async_save)
    total = 7 if mode == "steps" else 6
    assert ckpt.done

    steps = [e.step for e in recorder.events if e.kind == "step"]
    assert steps == list(range(1, total + 1)), "one step event per step, in order"

    saves = recorder.kinds(*SAVE_KINDS)
    saved_steps = sorted({step for _, step in saves})
    assert saved_steps == sorted({2, 4, 6, total})
    for saved in saved_steps:
        assert [kind for kind, step in saves if step == saved] == SAVE_KINDS, saves
    # One save in flight at most: a save starts after the previous one was verified.
    assert [kind for kind, _ in saves] == SAVE_KINDS * len(saved_steps), saves
    assert all(ok for _, _, ok in recorder.claims), recorder.claims
    assert not recorder.kinds("failed")

    last = recorder.events[-1]
    assert (last.kind, last.step) == ("done", total)
    assert recorder.kinds("verified", "done")[-2:] == [("verified", total), ("done", total)]

    if not async_save:
        # A blocking save completes at its step boundary, before the next step begins.
        order = [(e.kind, e.step) for e in recorder.events if e.kind in ("step", "verified")]
        for saved in (2, 4):
            assert order.index(("verified", saved)) == order.index(("step", saved)) + 1, order

    verified = [e for e in recorder.events if e.kind == "verified"]
    assert all(e.data["size"] > 0 and e.data["location"] for e in verified)


@MODES
def test_a_callback_that_raises_does_not_break_training(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, mode: str, async_save: bool
) -> None:
    def broken(event: Event) -> None:
        raise ValueError(f"a display failed on {event.kind}")

    reference = Recorder(tmp_path / "reference")
    train(reference.root, [reference], mode=mode, async_save=async_save)
    recorder = Recorder(tmp_path / "run")
    with caplog.at_level(logging.ERROR, logger="nbresume"):
        ckpt = train(recorder.root, [broken, recorder], mode=mode, async_save=async_save)

    assert ckpt.done
    # The other callback saw the same run, event for event (a background save's events
    # interleave with the steps' at their own pace, so each stream is compared on its own).
    for kinds in (["step"], [*SAVE_KINDS, "failed"], ["done"]):
        assert recorder.kinds(*kinds) == reference.kinds(*kinds)
    assert recorder.events[-1].kind == "done"
    assert nbresume.verify(recorder.root).ok
    assert any("callback failed" in r.getMessage() for r in caplog.records), caplog.text
    failures = [r for r in caplog.records if r.exc_info and r.exc_info[0] is ValueError]
    assert failures, "the callback's own error is logged with its traceback"
