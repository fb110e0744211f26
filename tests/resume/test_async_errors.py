"""A background save that fails is never lost: the training thread gets it as a
CheckpointError at its next call, an exiting interpreter prints it, and the checkpoint before
it stays intact and loadable.

The failures are real ones from the operating system: the checkpoint folder replaced by a
file (a mount that went away and left something else at its path), and a small real file
system that fills up (a tmpfs in a private user and mount namespace).
"""

from __future__ import annotations

import json
import os
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import nbresume
from nbresume import CheckpointError, Event, StorageError
from testkit import warmfork
from testkit.tinydisk import on_a_tiny_disk

HERE = Path(__file__).parent


class Location:
    """A checkpoint folder that can be pulled away and put back, as a mount can."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.aside = root.with_name(root.name + ".away")

    def break_(self) -> None:
        os.rename(self.root, self.aside)
        self.root.write_text("something else now lives at this path\n")

    def repair(self) -> None:
        self.root.unlink()
        os.rename(self.aside, self.root)


def make_checkpointer(
    root: Path, callbacks: list[Callable[[Event], None]], **options: Any
) -> nbresume.Checkpointer:
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    ckpt = nbresume.Checkpointer(
        root, deadline=None, callbacks=callbacks, model=model, optimizer=optimizer,
        **{"every": None, **options},
    )  # fmt: skip
    ckpt.restore()
    return ckpt


def train_step(ckpt: nbresume.Checkpointer) -> None:
    model, optimizer = ckpt["model"], ckpt["optimizer"]
    loss = model(torch.randn(4, 8)).square().mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


@pytest.fixture
def location(tmp_path: Path) -> Iterator[Location]:
    place = Location(tmp_path / "run")
    yield place
    if place.root.is_file():
        place.repair()


def failed(events: list[Event]) -> list[int]:
    return [e.step for e in events if e.kind == "failed"]


SURFACES: dict[str, Callable[[nbresume.Checkpointer], object]] = {
    "wait": lambda ckpt: ckpt.wait(),
    "save": lambda ckpt: ckpt.save(3),
    "close": lambda ckpt: ckpt.close(),
    "verify": lambda ckpt: ckpt.verify(),
}


@pytest.mark.parametrize("call", list(SURFACES))
def test_the_next_call_raises_a_failed_background_save(location: Location, call: str) -> None:
    events: list[Event] = []
    ckpt = make_checkpointer(location.root, [events.append])
    train_step(ckpt)
    ckpt.save(1)
    ckpt.wait()
    location.break_()
    train_step(ckpt)
    assert ckpt.save(2) is None  # returned before the write: the failure comes later

    with pytest.raises(CheckpointError, match="background save failed") as raised:
        SURFACES[call](ckpt)
    assert isinstance(raised.value.__cause__, StorageError)
    message = str(raised.value)
    assert str(location.root) in message
    assert message.count("Fix:") == 1, message  # one fix, the cause's and the way on
    assert "previous checkpoint is intact" in message
    assert raised.value.__cause__.fix in message
    assert failed(events) == [2]
    assert not any(e.kind == "verified" and e.step == 2 for e in events)

    # Reported once, then the Checkpointer is usable again: the previous checkpoint is
    # intact, and once the cause is fixed the next save works.
    location.repair()
    ckpt.wait()
    assert [info.step for info in ckpt.list()] == [1]
    assert nbresume.verify(location.root).summary == "OK 1/1, errors 0"
    train_step(ckpt)
    info = ckpt.save(4, block=True)
    assert info is not None
    assert info.step == 4
    assert nbresume.verify(location.root).summary == "OK 2/2, errors 0"
    ckpt.close()


def test_a_failed_cadence_save_ends_the_loop_before_the_next_save(location: Location) -> None:
    """In ``steps()``, a cadence save that failed in the background is raised out of the loop,
    at the latest when the next save is due: training does not go on as if it were saved."""
    events: list[Event] = []

    def break_after_first_save(event: Event) -> None:
        if event.kind == "verified" and event.step == 3:
            location.break_()  # from the writer thread, right after the first save

    ckpt = make_checkpointer(location.root, [events.append, break_after_first_save], every=3)
    trained: list[int] = []

    def train() -> None:
        for step in ckpt.steps(20):
            train_step(ckpt)
            trained.append(step + 1)

    with pytest.raises(CheckpointError, match="background save failed"):
        train()
    assert failed(events) == [6]
    assert 6 <= trained[-1] <= 9, trained
    assert not ckpt.done
    ckpt.close()

    location.repair()
    again = make_checkpointer(location.root, [])
    assert again.restore() == 3, "the run must resume from the last checkpoint that was saved"
    again.close()


def test_a_callback_that_breaks_things_does_not_hide_a_failure(location: Location) -> None:
    """The failed event reaches every callback, even after one of them raised."""
    seen: list[Event] = []

    def broken(event: Event) -> None:
        raise RuntimeError("a display that fails")

    ckpt = make_checkpointer(location.root, [broken, seen.append])
    ckpt.save(1)
    ckpt.wait()
    location.break_()
    ckpt.save(2)
    with pytest.raises(CheckpointError):
        ckpt.wait()
    assert failed(seen) == [2]
    ckpt.close()


AT_EXIT = textwrap.dedent(
    """
    import os, sys, torch
    import nbresume
    root = sys.argv[1]
    model = torch.nn.Linear(8, 4)
    ckpt = nbresume.Checkpointer(root, every=None, deadline=None, model=model)
    ckpt.save(1)
    ckpt.wait()
    os.rename(root, root + ".away")
    open(root, "w").close()
    ckpt.save(2)
    print("exiting", flush=True)
    """
)


def test_a_background_save_failing_while_the_interpreter_exits_is_printed(tmp_path: Path) -> None:
    root = tmp_path / "run"
    proc = warmfork.run(
        [sys.executable, "-c", AT_EXIT, str(root)], capture_output=True, text=True, timeout=300
    )
    assert proc.stdout.strip() == "exiting", proc.stderr
    assert "background save failed and is NOT on disk" in proc.stderr, proc.stderr
    assert str(root) in proc.stderr
    assert nbresume.verify(str(root) + ".away").summary == "OK 1/1, errors 0"


def test_a_disk_that_fills_up_fails_a_background_save_and_keeps_the_previous_one(
    tmp_path: Path,
) -> None:
    """On a real 4 MiB file system that something else fills up."""
    proc = on_a_tiny_disk(tmp_path / "tiny", [sys.executable, str(HERE / "disk_full_child.py")])
    assert proc.stdout.strip(), proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])

    assert report["save_returned"] == "None"
    raised = report["raised"]
    assert raised["type"] == "CheckpointError", raised
    assert raised["cause"] == "StorageFullError", raised
    assert "free" in raised["message"], raised
    kinds = [(kind, step) for kind, step, _ in report["events_after_failure"]]
    assert kinds[-2:] == [("save_started", 2), ("failed", 2)], kinds
    assert report["raised_again"] is False
    # The checkpoint before the failure is intact; nothing of the failed one is left behind.
    assert report["steps_after_failure"] == [1]
    assert report["verify_after_failure"] == "OK 1/1, errors 0"
    assert report["hidden_after_failure"] == []
    # Space back: saving works again.
    assert report["steps_after_recovery"] == [1, 3]
    assert report["verify_after_recovery"] == "OK 2/2, errors 0"
    # The save that failed while the interpreter exited was reported, not lost.
    assert "background save failed and is NOT on disk" in proc.stderr, proc.stderr
