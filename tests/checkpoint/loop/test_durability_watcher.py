"""The watcher that confirms checkpoints on a store with a write-back cache (Drive): a step
leaves ``pending`` only once every ``durable`` callback for it has run, so that whoever waits
for ``pending`` to empty (``wait(durable=True)``, a script about to exit) misses none."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import torch

from nbresume.checkpoint import events as ev
from nbresume.checkpoint.loop import DurabilityWatcher
from nbresume.checkpoint.store import CheckpointStore


def test_a_step_stays_pending_until_its_durable_callbacks_have_run(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep=None)
    store.backend.durability_poll_s = 0.05  # type: ignore[misc]
    info = store.save(5, tensors={"model": {"w": torch.ones(4)}})
    delivering = threading.Event()
    release = threading.Event()
    delivered: list[int] = []

    def slow_callback(event: ev.Event) -> None:
        if event.kind == ev.DURABLE:
            delivering.set()
            release.wait(30)
            delivered.append(event.step)

    watcher = DurabilityWatcher(store, ev.EventBus([slow_callback]))
    try:
        watcher.track(info)
        assert delivering.wait(30), "the store never confirmed the checkpoint"
        assert watcher.pending == [5]  # confirmed, but its callback is still running
        watcher.check_now()  # a second look meanwhile says nothing twice
        release.set()
        deadline = time.monotonic() + 30
        while watcher.pending and time.monotonic() < deadline:
            time.sleep(0.01)
        assert watcher.pending == []
        assert delivered == [5]
    finally:
        release.set()
        watcher.close()
