"""Saved where it counts: checkpoints whose durable copy lags behind the local write.

Most stores are durable once a checkpoint reads back (a local disk, S3). Google Drive's mount
is not: a write lands in a local cache and uploads later, and a disconnect loses whatever had
not uploaded. For such a backend (``Backend.write_back``), a checkpoint that verified locally
is *syncing* until the backend's :meth:`~nbresume.checkpoint.backends.base.Backend.durability`
says that the durable copy itself matches the manifest; only then is it *saved*.

:class:`DurabilityWatcher` asks that question in a background thread for each new checkpoint
and reports the answer through the checkpointer's events (``syncing``, then ``durable``).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

from nbresume.checkpoint import events as ev
from nbresume.checkpoint import forksafe

# The value a backend answers with lives with the backend protocol; named here too.
from nbresume.checkpoint.backends.base import FAILED, MISSING, SAVED, SYNCING, Durability

if TYPE_CHECKING:
    from nbresume.checkpoint.store import CheckpointInfo, CheckpointStore

__all__ = ["FAILED", "MISSING", "SAVED", "SYNCING", "Durability", "DurabilityWatcher"]

log = logging.getLogger("nbresume")


class DurabilityWatcher:
    """Polls the store about checkpoints that verified locally until each one is durable.

    Emits ``syncing`` when a checkpoint starts being watched and whenever its state changes,
    and ``durable`` once the store confirms it. Checkpoints that disappear (retention, a newer
    copy of the same step) are dropped silently.
    """

    def __init__(self, store: CheckpointStore, events: ev.EventBus) -> None:
        self.store = store
        self.events = events
        self._pending: dict[int, tuple[CheckpointInfo, str, float]] = {}
        self._claimed: set[int] = set()  # id() of checkpoints being confirmed (see _claim)
        self._lock = forksafe.lock()
        self._wake = forksafe.event()
        self._closed = False
        self._thread: threading.Thread | None = None

    @property
    def pending(self) -> list[int]:
        """Steps that verified locally but are not confirmed durable yet, oldest first."""
        with self._lock:
            return sorted(self._pending)

    def track(self, info: CheckpointInfo) -> None:
        """Watch ``info`` (just verified) until the durable store confirms it."""
        with self._lock:
            self._pending[info.step] = (info, SYNCING, time.monotonic())
            if self._thread is None or not self._thread.is_alive():
                # A daemon: an exiting interpreter must not wait for an upload it cannot speed up.
                self._thread = threading.Thread(
                    target=self._run, name="nbresume-durability", daemon=True
                )
                self._thread.start()
        self.events.emit(ev.SYNCING, info.step, location=info.location, state=SYNCING,
                         reason="verified in the local cache; waiting for the upload")  # fmt: skip

    def check_now(self) -> None:
        """Ask the store about every pending checkpoint now (rather than at the next poll)."""
        with self._lock:
            pending = list(self._pending.values())
        for info, last_state, since in pending:
            self._check(info, last_state, since)

    def close(self) -> None:
        self._closed = True
        self._wake.set()

    def _run(self) -> None:
        interval = self.store.backend.durability_poll_s
        while not self._closed:
            self._wake.wait(interval)
            if self._closed:
                return
            try:
                self.check_now()
            except Exception:  # a watcher must never take training down
                log.exception("nbresume: checking whether checkpoints reached the store failed")
            with self._lock:
                if not self._pending:
                    self._thread = None
                    return

    def _check(self, info: CheckpointInfo, last_state: str, since: float) -> None:
        try:
            folders = self.store.backend.list_folders()
        except OSError:
            folders = [info.name]
        if info.name not in folders:
            self._drop(info)  # deleted by retention, or replaced
            return
        durability = self.store.backend.durability(info.name, info.manifest)
        if durability.saved:
            if self._claim(info):
                # Emitted before the step leaves `pending`: whoever waits for `pending` to
                # empty (wait(durable=True)) finds every callback of `durable` already run.
                try:
                    self.events.emit(ev.DURABLE, info.step, location=info.location,
                                     seconds=time.monotonic() - since)  # fmt: skip
                finally:
                    self._drop(info)
            return
        if durability.state != last_state:
            with self._lock:
                if self._pending.get(info.step, (None,))[0] is not info:
                    return
                self._pending[info.step] = (info, durability.state, since)
            self.events.emit(ev.SYNCING, info.step, location=info.location,
                             state=durability.state, reason=durability.reason)  # fmt: skip

    def _claim(self, info: CheckpointInfo) -> bool:
        """Whether this caller is the one to confirm ``info`` (the watcher thread and a
        ``check_now`` may find it durable at the same time: one of them says so)."""
        with self._lock:
            if self._pending.get(info.step, (None,))[0] is not info or id(info) in self._claimed:
                return False
            self._claimed.add(id(info))
            return True

    def _drop(self, info: CheckpointInfo) -> bool:
        with self._lock:
            self._claimed.discard(id(info))
            if self._pending.get(info.step, (None,))[0] is info:
                del self._pending[info.step]
                return True
            return False
