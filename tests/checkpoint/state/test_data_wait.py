"""The share of step time the loop spends waiting for the next batch.

A loader made slow on purpose (each sample sleeps) against a loop body that does nothing must
read as input-bound; a fast loader against a slow body must not. Only shares are compared, and
the margins are wide: a loaded machine makes a sleep longer, never shorter.
"""

from __future__ import annotations

import io
import time
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from nbresume import Checkpointer
from nbresume.checkpoint.state.health import INPUT_BOUND_SHARE, MIN_BATCHES, data_wait_of
from nbresume.notebook.progress import Tracker
from nbresume.notebook.status_line import StatusLine

SLEEP_S = 0.02
BATCHES = 20


class Sleepy(Dataset[torch.Tensor]):
    """A dataset whose every sample takes ``delay`` seconds to read (a slow disk, a heavy
    transform)."""

    def __init__(self, delay: float, size: int = 64) -> None:
        self.delay = delay
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> torch.Tensor:
        if self.delay:
            time.sleep(self.delay)
        return torch.full((2,), float(index))


def _checkpointer(folder: Path, delay: float) -> Checkpointer:
    loader = DataLoader(Sleepy(delay), batch_size=1, shuffle=True)
    return Checkpointer(
        folder, every=None, deadline=None, async_save=False, quiet=True, loader=loader
    )


def test_a_slow_loader_reads_as_input_bound_with_advice(tmp_path: Path) -> None:
    ckpt = _checkpointer(tmp_path, SLEEP_S)
    batches = ckpt.loader().batches()
    for _ in ckpt.steps(BATCHES):
        next(batches)  # the step itself takes no time
    wait = data_wait_of(ckpt)
    ckpt.close()
    assert wait is not None
    assert wait.batches >= MIN_BATCHES
    assert wait.share > INPUT_BOUND_SHARE
    assert wait.input_bound
    assert wait.short().startswith("INPUT-BOUND: ")
    advice = wait.advice()
    assert "num_workers (now 0)" in advice
    assert "pin_memory=True" in advice
    assert "local disk" in advice


def test_a_slow_step_with_a_fast_loader_is_not_input_bound(tmp_path: Path) -> None:
    ckpt = _checkpointer(tmp_path, 0.0)
    batches = ckpt.loader().batches()
    for _ in ckpt.steps(BATCHES):
        next(batches)
        time.sleep(SLEEP_S)  # the GPU (or CPU) working on the batch
    wait = data_wait_of(ckpt)
    ckpt.close()
    assert wait is not None
    assert wait.share < INPUT_BOUND_SHARE
    assert not wait.input_bound
    assert wait.short().startswith("data wait ")


def test_the_epoch_loop_measures_it_too(tmp_path: Path) -> None:
    ckpt = _checkpointer(tmp_path, SLEEP_S)
    loader = ckpt.loader()
    for _ in ckpt.epochs(1):
        for _batch in loader:
            pass
    wait = data_wait_of(ckpt)
    ckpt.close()
    assert wait is not None
    assert wait.input_bound


def test_the_status_line_says_input_bound_and_what_to_change(tmp_path: Path) -> None:
    ckpt = _checkpointer(tmp_path, SLEEP_S)
    tracker = Tracker()
    tracker.attach(ckpt)
    stream = io.StringIO()
    status = StatusLine(tracker, stream, tty=False, interval=3600.0)
    tracker.add_view(status)
    batches = ckpt.loader().batches()
    for _ in ckpt.steps(BATCHES):
        next(batches)
    line = status.line(tracker.snapshot())
    ckpt.close()
    # Before the checkpoint facts, next to the progress whose slow rate it explains.
    assert "INPUT-BOUND: " in line
    assert line.index("INPUT-BOUND: ") < line.index("last checkpoint")
    assert "of step time waits for data" in line


def test_the_panel_says_input_bound_and_what_to_change(tmp_path: Path) -> None:
    pytest.importorskip("ipywidgets", reason="needs ipywidgets (the notebook extra)")
    from nbresume.notebook.panel import Panel

    ckpt = _checkpointer(tmp_path, SLEEP_S)
    tracker = Tracker()
    tracker.attach(ckpt)
    panel = Panel(tracker)
    batches = ckpt.loader().batches()
    for _ in ckpt.steps(BATCHES):
        next(batches)
    panel.render()
    ckpt.close()
    html = panel.progress.value
    assert 'data-input-bound="true"' in html
    assert "INPUT-BOUND: " in html
    assert "num_workers" in html
