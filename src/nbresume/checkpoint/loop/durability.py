"""Saved where it counts: checkpoints whose durable copy lags behind the local write.

Most stores are durable once a checkpoint reads back (a local disk, S3). Google Drive's mount
is not: a write lands in a local cache and uploads later, and a disconnect loses whatever had
not uploaded. For such a backend (``Backend.write_back``), a checkpoint that verified locally
is *syncing* until the backend's :meth:`~nbresume.checkpoint.backends.base.Backend.durability`
says that the durable copy itself matches the manifest; only then is it *saved*.

:class:`DurabilityWatcher` asks that question in a background thread for each new checkpoint
and reports the answer through the checkpointer's events (``syncing``, then ``durable``).

**Confirmed** (``wait(durable=True)``): a checkpoint that verified was read back through the
same path it was written by. Whether the storage behind that path holds it is a separate
question, answered by each kind of store in its own way:

- Google Drive's mount (a write-back store): Drive's API reports every file with the manifest's
  size and MD5 (:meth:`~nbresume.checkpoint.backends.base.Backend.durability`); until then the
  upload may still be under way, and it is polled.
- an object store (any fsspec URL): its listing of the checkpoint's folder shows every file of
  the manifest with the manifest's size; polled too, since some stores list late.
- a local disk: every file and the folder are fsynced once more, so the kernel has written them
  to the device.

Each backend answers for itself (:meth:`~nbresume.checkpoint.backends.base.Backend.confirm`).

:func:`confirm` returns a :class:`Confirmation` that says which of these it saw, or raises a
:class:`~nbresume.errors.CheckpointError` when the store did not confirm before the timeout.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from nbresume.checkpoint import events as ev
from nbresume.checkpoint import forksafe

# The value a backend answers with lives with the backend protocol; named here too.
from nbresume.checkpoint.backends import FAILED, MISSING, SAVED, SYNCING, Durability
from nbresume.errors import CheckpointError, NoCheckpointError, StorageError

if TYPE_CHECKING:
    from nbresume.checkpoint.store import CheckpointInfo, CheckpointStore

__all__ = [
    "FAILED",
    "MISSING",
    "SAVED",
    "SYNCING",
    "Confirmation",
    "Durability",
    "DurabilityWatcher",
    "confirm",
]

log = logging.getLogger("nbresume")


class DurabilityWatcher:
    """Polls the store about checkpoints that verified locally until each one is durable.

    Emits ``syncing`` when a checkpoint starts being watched and whenever what the store says
    of it changes (its state, or how much of it the store confirms: "3 of 5 files"), and
    ``durable`` once the store confirms it. Checkpoints that disappear (retention, a newer
    copy of the same step) are dropped silently.
    """

    def __init__(self, store: CheckpointStore, events: ev.EventBus) -> None:
        self.store = store
        self.events = events
        #: step -> (the checkpoint, what the store last said of it, since when it is watched)
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
        waiting = f"verified where it was written; waiting for {self.store.backend.store_name}"
        self.events.emit(ev.SYNCING, info.step, location=info.location, state=SYNCING,
                         reason=f"{waiting} to confirm it")  # fmt: skip

    def check_now(self) -> None:
        """Ask the store about every pending checkpoint now (rather than at the next poll)."""
        with self._lock:
            pending = list(self._pending.values())
        for info, last_said, since in pending:
            self._check(info, last_said, since)

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

    def _check(self, info: CheckpointInfo, last_said: str, since: float) -> None:
        try:
            folders = self.store.backend.list_folders()
        except StorageError:
            raise  # the store's own error: the watcher reports it
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
        said = str(durability)  # the state and its reason: progress is news too
        if said != last_said:
            with self._lock:
                if self._pending.get(info.step, (None,))[0] is not info:
                    return
                self._pending[info.step] = (info, said, since)
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


# -- confirmed by the storage itself: wait(durable=True) ----------------------------------------

#: Seconds between two questions to a store that has not confirmed yet (a store's own
#: ``durability_poll_s`` is used when it is shorter).
POLL_S = 2.0


@dataclass(frozen=True)
class Confirmation:
    """What the storage confirmed about the newest checkpoint.

    Attributes:
        step: the checkpoint's step.
        location: where it is.
        how: what the storage itself reported, in words.
        seconds: how long the wait took.
    """

    step: int
    location: str
    how: str
    seconds: float

    def __str__(self) -> str:
        return f"step {self.step:,} at {self.location}: {self.how}"


def confirm(
    store: CheckpointStore, *, timeout: float | None = None, poll: float | None = None
) -> Confirmation:
    """Wait until the storage confirms the newest committed checkpoint of ``store``.

    ``timeout`` in seconds (``None``: as long as it takes). Raises
    :class:`~nbresume.errors.NoCheckpointError` when there is no checkpoint, and
    :class:`~nbresume.errors.CheckpointError` when the store did not confirm in time.
    """
    started = time.monotonic()
    info = store.latest()
    if info is None:
        raise NoCheckpointError(
            "no committed checkpoint to confirm",
            where=str(store.location),
            fix="save one first (ckpt.save(block=True)), then wait for it",
        )
    backend = store.backend
    interval = min(POLL_S, backend.durability_poll_s) if poll is None else poll
    while True:
        confirmed, seen = backend.confirm(info.name, info.manifest)
        seconds = time.monotonic() - started
        if confirmed:
            return Confirmation(info.step, info.location, seen, seconds)
        if timeout is not None and seconds + interval > timeout:
            raise CheckpointError(
                f"step {info.step:,} not confirmed by the storage after {seconds:.0f} s: {seen}",
                where=info.location,
                fix="wait longer (a larger timeout=) and keep the machine running meanwhile; "
                "the checkpoint is not safe to rely on until the storage confirms it",
            )
        time.sleep(interval)
