"""The progress of a checkpoint's upload to a bucket, on the status line and the panel: how many
of its files, and how many bytes, the bucket confirms with the local ``xet_hash`` and size,
until it confirms them all and the checkpoint is saved. In-process, a real Checkpointer on the
stand-in Hub through the real client; the stand-in's listing reports other bytes for two files
at first (what a bucket reports while an upload has not landed), then for one, then none."""

from __future__ import annotations

import io
import re
from typing import Any

import numpy as np
import pytest

from nbresume import Checkpointer
from nbresume.checkpoint import events as ev
from nbresume.checkpoint.format import MANIFEST_NAME, step_dirname
from nbresume.notebook.progress import Tracker
from nbresume.notebook.status_line import StatusLine
from testkit.stateful import QUIET

from .conftest import URL
from .standin import HubStandIn

#: The checkpoint the loop ends with, and the two files whose upload the bucket confirms late.
STEP = 3
LATE = [f"{step_dirname(STEP)}/{MANIFEST_NAME}", f"{step_dirname(STEP)}/model.safetensors"]
PROGRESS = re.compile(r"(\d+) of (\d+) files \((.+?) of (.+?)\) of .+? confirmed by the bucket")


class Model:
    """One array that every step changes (a model file beside the state document)."""

    def __init__(self) -> None:
        self.w = np.zeros(1000)

    def state_dict(self) -> dict[str, Any]:
        return {"w": self.w.copy()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.w = np.asarray(state["w"]).copy()


def train_while_the_bucket_confirms_late(hub: HubStandIn, tracker: Tracker) -> Checkpointer:
    model = Model()
    ckpt = Checkpointer(URL, model=model, **QUIET)
    tracker.attach(ckpt)

    def late(event: ev.Event) -> None:
        # Once the save has read the checkpoint back (its downloads go by the listing's hash),
        # and before the durability watch first asks (it waits its poll interval first).
        if event.kind == ev.VERIFIED:
            hub.wrong_hash.update(dict.fromkeys(LATE, "0" * 64))

    ckpt.events.subscribe(late)
    for _ in ckpt.steps(STEP):
        model.w += 1
    return ckpt


def confirm_one_by_one(hub: HubStandIn, ckpt: Checkpointer, shown: Any) -> list[str]:
    """What ``shown()`` says after each question the durability watch asks the bucket."""
    assert ckpt.durability is not None
    said = []
    for late in [*LATE, None]:
        ckpt.durability.check_now()
        said.append(shown())
        if late is not None:
            del hub.wrong_hash[late]
    ckpt.durability.close()
    return said


def test_bucket_upload_progress_on_the_status_line(hub: HubStandIn) -> None:
    tracker = Tracker()
    stream = io.StringIO()
    tracker.add_view(StatusLine(tracker, stream, tty=False))
    ckpt = train_while_the_bucket_confirms_late(hub, tracker)
    confirm_one_by_one(hub, ckpt, stream.getvalue)

    lines = [line for line in stream.getvalue().splitlines() if f"step {STEP} " in line]
    progress = [PROGRESS.search(line) for line in lines]
    counted = [(int(m.group(1)), int(m.group(2))) for m in progress if m is not None]
    # Each step of the upload's progress is a line of its own, then the checkpoint is saved.
    files = len(ckpt.store.latest().manifest.files) + 1  # type: ignore[union-attr]
    assert counted == [(files - 2, files), (files - 1, files)], lines
    first, second = (m for m in progress if m is not None)
    assert first.group(4) == second.group(4)  # of the same total bytes
    assert first.group(3) != second.group(3)  # more of them confirmed
    assert "syncing" in lines[-2]
    assert "model.safetensors (other bytes: the bucket's xet_hash differs)" in lines[-2]
    assert f"step {STEP} saved" in lines[-1]


def test_bucket_upload_progress_on_the_panel(hub: HubStandIn) -> None:
    pytest.importorskip("ipywidgets", reason="needs ipywidgets (the notebook extra)")
    from nbresume.notebook.panel import Panel

    tracker = Tracker()
    panel = Panel(tracker)
    tracker.add_view(panel)
    ckpt = train_while_the_bucket_confirms_late(hub, tracker)
    shown = confirm_one_by_one(hub, ckpt, lambda: panel.checkpoint.value)

    counted = []
    for html in shown:
        found = PROGRESS.search(html)
        counted.append(None if found is None else (int(found.group(1)), int(found.group(2))))
    files = len(ckpt.store.latest().manifest.files) + 1  # type: ignore[union-attr]
    assert counted == [(files - 2, files), (files - 1, files), None], shown
    assert 'data-state="syncing"' in shown[0]
    assert 'data-state="syncing"' in shown[1]
    assert 'data-state="saved"' in shown[2]
