"""The panel and the tracker behind it, in-process, fed by real Checkpointers on real folders.

What a user relies on: the panel shows the live step and the last checkpoint with its true
state (saved only when verified, syncing on a write-back store until the store confirms it),
"Save now" and "Stop and save" act at the next step boundary, and redraws are throttled.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("ipywidgets", reason="needs ipywidgets (the notebook extra)")

from nbresume import Checkpointer
from nbresume.checkpoint.backends import LocalStore
from nbresume.checkpoint.format import Manifest
from nbresume.checkpoint.loop.durability import SAVED, SYNCING, Durability
from nbresume.checkpoint.store import CheckpointStore
from nbresume.notebook.panel import Panel
from nbresume.notebook.progress import Tracker
from testkit.stateful import Weights


def steps_on_disk(folder: Path) -> list[int]:
    return [info.step for info in CheckpointStore(folder, keep=None).list()]


def data_state(html: str) -> tuple[str, str]:
    """The step and state the checkpoint line carries as data attributes."""
    step = html.split('data-step="', 1)[1].split('"', 1)[0]
    state = html.split('data-state="', 1)[1].split('"', 1)[0]
    return step, state


def trained(
    where: Path | CheckpointStore, steps: int, *, every: int | None = None, async_save: bool = False
) -> Checkpointer:
    """A Checkpointer of a small model over ``steps`` training steps, each changing the model."""
    model = Weights(4)
    ckpt = Checkpointer(where, every=every, async_save=async_save, deadline=None, model=model)
    for _ in ckpt.steps(steps):
        model.w += 1
    return ckpt


def test_panel_shows_progress_and_the_verified_checkpoint(
    tracker: Tracker, panel: Panel, tmp_path: Path
) -> None:
    ckpt = trained(tmp_path / "run", 25, every=10)

    assert ckpt.done
    snap = tracker.snapshot()
    assert (snap.step, snap.total, snap.finished, snap.running) == (25, 25, True, False)
    assert snap.last is not None
    assert (snap.last.step, snap.last.state) == (25, "saved")
    assert snap.last.size == CheckpointStore(tmp_path / "run").latest().size  # type: ignore[union-attr]
    # The widgets say the same, after the last (urgent) redraw.
    assert (panel.bar.value, panel.bar.max) == (25, 25)
    assert "step 25 of 25" in panel.progress.value
    assert data_state(panel.checkpoint.value) == ("25", "saved")
    assert str(tmp_path / "run") in panel.facts.value
    assert panel.stop_button.disabled  # nothing to stop any more


def test_panel_starts_with_the_checkpoint_already_in_the_folder(
    tracker: Tracker, tmp_path: Path
) -> None:
    model = Weights(4)
    first = Checkpointer(tmp_path / "run", every=None, async_save=False, deadline=None, model=model)
    for _ in first.steps(7):
        model.w += 1
    first.close()

    fresh = Tracker()  # a fresh kernel: nothing seen yet
    panel = Panel(fresh)
    fresh.add_view(panel)
    fresh.start()
    try:
        Checkpointer(tmp_path / "run", every=None, deadline=None, model=Weights(4))
        # Found in the folder, not verified by this process: never shown as "saved".
        assert data_state(panel.checkpoint.value) == ("7", "found")
        assert "step 7 in the folder" in panel.checkpoint.value
    finally:
        fresh.stop()


def test_save_now_saves_at_the_next_step_boundary(
    tracker: Tracker, panel: Panel, tmp_path: Path
) -> None:
    model = Weights(4)
    ckpt = Checkpointer(tmp_path / "run", every=None, async_save=False, deadline=None, model=model)
    for step in ckpt.steps(30):
        model.w += 1
        if step == 10:
            panel.save_button.click()  # what the pump does with a click that arrived
            assert "save requested" in panel.message.value

    assert steps_on_disk(tmp_path / "run") == [11, 30]
    loaded = CheckpointStore(tmp_path / "run").load(11)
    np.testing.assert_array_equal(loaded.tensors["model"]["w"], np.full(4, 11.0))


def test_stop_and_save_ends_the_loop_cleanly(
    tracker: Tracker, panel: Panel, tmp_path: Path
) -> None:
    model = Weights(4)
    ckpt = Checkpointer(tmp_path / "run", every=None, async_save=False, deadline=None, model=model)
    ran = []
    for step in ckpt.steps(1000):
        ran.append(step)
        model.w += 1
        if step == 15:
            assert not panel.stop_button.disabled
            panel.stop_button.click()

    assert ran == list(range(16))
    assert not ckpt.done
    assert "panel" in ckpt.stop_reason
    assert steps_on_disk(tmp_path / "run") == [16]
    snap = tracker.snapshot()
    assert snap.stopped
    assert not snap.running
    assert "stopped" in panel.progress.value
    assert data_state(panel.checkpoint.value) == ("16", "saved")

    # Running the cell again resumes from the stop and is not stopped by the old request.
    again = Checkpointer(tmp_path / "run", every=None, async_save=False, deadline=None,
                         model=Weights(4))  # fmt: skip
    assert list(again.steps(20)) == list(range(16, 20))
    assert again.done


def test_buttons_do_nothing_harmful_without_a_running_loop(
    tracker: Tracker, panel: Panel, tmp_path: Path
) -> None:
    panel.stop_button.click()
    assert "no training loop is running" in panel.message.value
    panel.save_button.click()
    assert "nothing to save" in panel.message.value

    model = Weights(4)
    ckpt = Checkpointer(tmp_path / "run", every=None, async_save=False, deadline=None, model=model)
    for _ in ckpt.steps(5):
        model.w += 1
    # Between cells, in the kernel's thread: "Save now" saves the current state at once.
    ckpt.step = 5
    model.w += 100
    panel.save_button.click()
    assert "saved step 5" in panel.message.value
    loaded = CheckpointStore(tmp_path / "run").load(5)
    np.testing.assert_array_equal(loaded.tensors["model"]["w"], np.full(4, 105.0))


def test_redraws_are_throttled_while_steps_go_by(tracker: Tracker, tmp_path: Path) -> None:
    interval = 0.25
    panel = Panel(tracker, interval=interval)
    tracker.add_view(panel)
    before = panel.renders
    model = Weights(4)
    ckpt = Checkpointer(tmp_path / "run", every=None, async_save=False, deadline=None, model=model)
    started = time.monotonic()
    for _ in ckpt.steps(3000):
        model.w += 1
    elapsed = time.monotonic() - started
    renders = panel.renders - before
    # One redraw per interval at most, plus the urgent ones (the final save and "done"), plus
    # the Checkpointer's arrival and a trailing one.
    assert renders <= elapsed / interval + 2 + 8
    assert renders < 3000
    assert "step 3,000 of 3,000" in panel.progress.value


class WriteBackStore(LocalStore):
    """A folder standing in for Google Drive's mount: what reads back locally is only the
    cache, and the durable copy is confirmed when the test says it has uploaded."""

    write_back = True
    durability_poll_s = 0.02

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.uploaded = threading.Event()

    def durability(self, folder: str, manifest: Manifest) -> Durability:
        if self.uploaded.is_set():
            return Durability(SAVED)
        return Durability(SYNCING, "uploading to Drive")


def three_steps_on_a_write_back_store(tmp_path: Path) -> tuple[WriteBackStore, Checkpointer]:
    """Three training steps saved to a write-back store that has not confirmed the upload yet."""
    store = WriteBackStore(tmp_path / "drive" / "run")
    ckpt = trained(store, 3)
    return store, ckpt


def test_write_back_store_shows_syncing_until_the_store_confirms(
    tracker: Tracker, panel: Panel, tmp_path: Path
) -> None:
    store, ckpt = three_steps_on_a_write_back_store(tmp_path)

    # Verified in the local cache: syncing, never "saved".
    assert data_state(panel.checkpoint.value) == ("3", "syncing")
    assert tracker.snapshot().last.state == "syncing"  # type: ignore[union-attr]
    store.uploaded.set()
    assert ckpt.durability is not None
    deadline = time.monotonic() + 30
    while data_state(panel.checkpoint.value)[1] != "saved":
        assert time.monotonic() < deadline, panel.checkpoint.value
        time.sleep(0.02)
    assert data_state(panel.checkpoint.value) == ("3", "saved")
    ckpt.durability.close()


def test_a_failed_save_is_shown_as_failed(tracker: Tracker, panel: Panel, tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the checkpoints should go")
    ckpt = Checkpointer(blocker, every=None, async_save=False, deadline=None, model=Weights(4))
    with pytest.raises(Exception, match="folder"):
        ckpt.save(step=1, block=True)
    assert "FAILED" in panel.checkpoint.value
    assert panel.bar.bar_style == "danger"


def test_unknown_event_kinds_change_nothing(tracker: Tracker, panel: Panel, tmp_path: Path) -> None:
    ckpt = trained(tmp_path / "run", 4)
    shown = (panel.progress.value, panel.checkpoint.value)
    ckpt.events.emit("a-kind-from-the-future", 4, anything={"nested": [1, 2]})
    assert (panel.progress.value, panel.checkpoint.value) == shown


def test_the_core_imports_no_ui(tmp_path: Path) -> None:
    import subprocess
    import sys

    code = (
        "import sys, nbresume\n"
        f"c = nbresume.Checkpointer({str(tmp_path / 'run')!r}, every=None, deadline=None)\n"
        "c.events.emit('step', 1)\n"
        "print([m for m in ('IPython', 'ipywidgets', 'nbresume.notebook.panel',"
        " 'nbresume.notebook.magics') if m in sys.modules])"
    )
    # A plain script's Checkpointer shows the terminal status line (nbresume.notebook's light
    # status_line module); the notebook's UI libraries and the panel stay out.
    # A new interpreter: what it imports is the question (a fork of the warm server has the
    # server's modules).
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_events_reach_the_tracker_from_the_background_writer(
    tracker: Tracker, panel: Panel, tmp_path: Path
) -> None:
    ckpt = trained(tmp_path / "run", 12, every=5, async_save=True)
    ckpt.close()
    kinds_seen = tracker.snapshot()
    assert kinds_seen.last is not None
    assert kinds_seen.last.step == 12
    assert kinds_seen.last.state == "saved"
    assert steps_on_disk(tmp_path / "run")[-1] == 12


def safe_line(panel: Panel, confirmed: str, timeout: float = 30) -> str:
    """The "safe to close the tab" row once it says ``confirmed`` ("true" / "false"); the
    storage is asked in the background, so this waits for its answer."""
    deadline = time.monotonic() + timeout
    while f'data-confirmed="{confirmed}"' not in panel.safe.value:
        assert time.monotonic() < deadline, panel.safe.value
        time.sleep(0.02)
    return panel.safe.value


def test_safe_to_close_line_shows_the_local_disk_confirmed(
    tracker: Tracker, panel: Panel, tmp_path: Path
) -> None:
    assert panel.safe.value == ""  # nothing asked before a checkpoint exists
    _ckpt = trained(tmp_path / "run", 5)  # alive while the panel asks, as in a notebook
    line = safe_line(panel, "true")
    assert 'data-step="5"' in line
    assert "safe to close the tab" in line
    assert "not yet" not in line
    assert "fsynced to the local disk" in line


def test_safe_to_close_line_waits_for_a_write_back_store(
    tracker: Tracker, panel: Panel, tmp_path: Path
) -> None:
    store, ckpt = three_steps_on_a_write_back_store(tmp_path)
    # Verified in the local cache, not yet on Drive: not safe to close the tab.
    line = safe_line(panel, "false")
    assert 'data-step="3"' in line
    assert "not yet safe to close the tab" in line
    assert "uploading to Drive" in line
    store.uploaded.set()  # Drive confirms: the durability watch says DURABLE, the panel asks
    line = safe_line(panel, "true")
    assert 'data-step="3"' in line
    assert "not yet" not in line
    assert "all" in line
    assert "MD5" in line
    assert ckpt.durability is not None
    ckpt.durability.close()


class SlowToAnswerStore(WriteBackStore):
    """A write-back store whose answer about an upload takes until the test says it has
    uploaded."""

    def durability(self, folder: str, manifest: Manifest) -> Durability:
        self.uploaded.wait(60)
        return Durability(SAVED)


def test_asking_the_storage_never_holds_up_the_training_loop(
    tracker: Tracker, panel: Panel, tmp_path: Path
) -> None:
    store = SlowToAnswerStore(tmp_path / "run")
    model = Weights(4)
    ckpt = Checkpointer(store, every=None, keep=None, async_save=False, deadline=None, model=model)
    # The save in the loop is verified in this thread, and the panel hears of it here: the
    # question to the storage must go elsewhere, or the loop would wait for the answer.
    for _ in ckpt.steps(5):
        model.w += 1
    assert ckpt.done
    assert panel.safe.value == ""  # no answer yet, so nothing is claimed
    store.uploaded.set()
    line = safe_line(panel, "true")
    assert 'data-step="5"' in line
    assert ckpt.durability is not None
    ckpt.durability.close()
