"""Asking the storage itself whether the newest checkpoint is there: ``wait(durable=True)``.

A checkpoint that verified was read back through the same path it was written by. Whether the
storage behind that path holds it is a separate question, answered by each kind of store in its
own way:

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

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from nbresume.errors import CheckpointError, NoCheckpointError

if TYPE_CHECKING:
    from nbresume.checkpoint.store import CheckpointStore

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
