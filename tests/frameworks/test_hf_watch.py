"""The watch that makes a framework's loop look like a Checkpointer (``nbresume.frameworks``):
the panel follows it, signals and the deadline become stop requests, saves report events."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from nbresume.checkpoint.store import CheckpointStore
from nbresume.frameworks.watch import Watch
from nbresume.notebook.progress import SAVED, Tracker


def commit(watch: Watch, step: int) -> None:
    """A framework's save: its files, committed through the pending layer and the watch."""
    pending = watch.store.begin(step)
    pending.write_json("trainer_state", {"global_step": step})
    watch.commit_pending(pending)


def test_the_panel_follows_a_watched_loop_and_its_buttons_reach_it(tmp_path: Path) -> None:
    tracker = Tracker()
    tracker.start()
    try:
        watch = Watch(CheckpointStore(tmp_path / "out"), deadline=None)
        assert tracker.checkpointer is watch
        watch.start(step=0, total=10)
        for step in range(1, 4):
            watch.step_done(step)
        commit(watch, 3)
        shown = tracker.snapshot()
        assert shown.step == 3
        assert shown.total == 10
        assert shown.last is not None
        assert (shown.last.step, shown.last.state) == (3, SAVED)
        confirmed = watch.wait(durable=True, timeout=10)  # the local disk has it fsynced
        assert confirmed is not None

        tracker.request_save()
        assert watch.save_requested()
        assert not watch.save_requested()  # answered once
        tracker.request_stop("stop requested from the panel")
        assert watch.stop_reason() == "stop requested from the panel"
        watch.stopping(3, watch.stop_reason())
        watch.finish(3, done=False)
        assert tracker.snapshot().stopped == "stop requested from the panel"
    finally:
        tracker.stop()


def test_sigterm_becomes_a_stop_and_the_loop_ends_as_sigterm_asks(tmp_path: Path) -> None:
    before = signal.getsignal(signal.SIGTERM)
    watch = Watch(CheckpointStore(tmp_path / "out"), deadline=None, announce=False)
    actions: list[tuple[int, int]] = []
    watch.after_stop = lambda signum, step: actions.append((signum, step))
    watch.start(step=5)
    assert watch.stop_reason() == ""
    os.kill(os.getpid(), signal.SIGTERM)  # handled: a request, never a write in the handler
    assert watch.stop_reason() == "received SIGTERM"
    commit(watch, 6)
    with pytest.raises(SystemExit) as ended:
        watch.finish(6, done=False)
    assert ended.value.code == 128 + signal.SIGTERM
    assert actions == [(signal.SIGTERM, 6)]  # the after-stop action (a Slurm requeue)
    assert signal.getsignal(signal.SIGTERM) == before


def test_a_near_deadline_asks_for_a_stop_with_the_measured_margin(tmp_path: Path) -> None:
    watch = Watch(CheckpointStore(tmp_path / "out"), deadline=3600, announce=False)
    assert watch.stop_reason() == ""
    assert watch.stop_at is not None
    assert watch.deadline is not None
    assert watch.stop_at < watch.deadline  # a margin for one more step and a save
    soon = Watch(CheckpointStore(tmp_path / "soon"), deadline=0.5, announce=False)
    assert "deadline" in soon.stop_reason()  # less time left than a save takes


def test_a_notebook_interrupt_stops_after_the_save_and_then_interrupts(tmp_path: Path) -> None:
    before = signal.getsignal(signal.SIGINT)
    watch = Watch(CheckpointStore(tmp_path / "out"), deadline=None, announce=False)
    watch.start(step=0)
    os.kill(os.getpid(), signal.SIGINT)  # the notebook's interrupt button
    assert watch.stop_reason() == "received SIGINT"
    commit(watch, 1)
    with pytest.raises(KeyboardInterrupt):
        watch.finish(1, done=False)
    assert signal.getsignal(signal.SIGINT) == before
    assert [i.step for i in watch.store.list()] == [1]


def test_save_now_between_cells_says_nothing_is_training_and_names_the_newest(
    tmp_path: Path,
) -> None:
    """A framework saves only inside its loop: the panel's "Save now" between cells answers
    that, with the newest checkpoint, rather than claiming a save."""
    from nbresume.errors import UsageError

    watch = Watch(CheckpointStore(tmp_path / "out"), deadline=None, announce=False)
    with pytest.raises(UsageError) as refused:
        watch.save(block=True)
    assert "no training is running" in str(refused.value)
    assert "there is no checkpoint yet" in str(refused.value)
    commit(watch, 7)
    with pytest.raises(UsageError) as refused:
        watch.save(block=True)
    assert "the newest checkpoint is step 7" in str(refused.value)
