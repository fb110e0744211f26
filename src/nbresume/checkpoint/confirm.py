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

:func:`confirm` returns a :class:`Confirmation` that says which of these it saw, or raises a
:class:`~nbresume.errors.CheckpointError` when the store did not confirm before the timeout.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from nbresume.errors import CheckpointError, NoCheckpointError

if TYPE_CHECKING:
    from nbresume.checkpoint.backends.base import Backend
    from nbresume.checkpoint.backends.fsspec_store import FsspecStore
    from nbresume.checkpoint.info import CheckpointInfo
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
        confirmed, seen = _ask(backend, info)
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


def _ask(backend: Backend, info: CheckpointInfo) -> tuple[bool, str]:
    """(confirmed?, what the storage reported) for one checkpoint."""
    from nbresume.checkpoint.backends.fsspec_store import FsspecStore
    from nbresume.checkpoint.backends.local import LocalStore

    count = len(info.manifest.files)
    if backend.write_back:
        state = backend.durability(info.name, info.manifest)
        name = _store_name(backend)
        if state.saved:
            return True, f"{name} reports all {count} files with the manifest's size and MD5"
        return False, f"{name}: {state}"
    if isinstance(backend, FsspecStore):
        return _listed(backend, info)
    if isinstance(backend, LocalStore):
        _fsync_checkpoint(backend.root / info.name, info)
        return True, f"its {count} files and its folder are fsynced to the local disk"
    state = backend.durability(info.name, info.manifest)
    return state.saved, str(state)


def _store_name(backend: Backend) -> str:
    from nbresume.checkpoint.backends.drive import DriveStore

    return "Google Drive" if isinstance(backend, DriveStore) else "the durable store"


def _listed(backend: FsspecStore, info: CheckpointInfo) -> tuple[bool, str]:
    """Whether the store's own listing shows every file with the manifest's size."""
    from nbresume.checkpoint.format import MANIFEST_NAME

    folder = backend._path(info.name)
    backend.fs.invalidate_cache(folder)
    try:
        listing = backend.fs.ls(folder, detail=True)
    except FileNotFoundError:
        listing = []
    sizes = {str(e["name"]).rstrip("/").rsplit("/", 1)[-1]: e.get("size") for e in listing}
    missing = [n for n in [*info.manifest.files, MANIFEST_NAME] if n not in sizes]
    wrong = [n for n, entry in info.manifest.files.items() if n in sizes and sizes[n] != entry.size]
    if missing or wrong:
        problems = [f"not listed: {', '.join(missing)}"] if missing else []
        problems += [f"another size: {', '.join(wrong)}"] if wrong else []
        return False, "the store's listing " + "; ".join(problems)
    count = len(info.manifest.files)
    return True, f"the store lists all {count} files and the manifest, with the manifest's sizes"


def _fsync_checkpoint(folder: Path, info: CheckpointInfo) -> None:
    """fsync every file of the checkpoint, then its folder and the folder above."""
    from nbresume.checkpoint.format import MANIFEST_NAME

    for name in [*info.manifest.files, MANIFEST_NAME]:
        fd = os.open(folder / name, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    for directory in (folder, folder.parent):
        try:
            fd = os.open(directory, os.O_RDONLY)
        except OSError:  # a platform without directory handles
            continue
        try:
            os.fsync(fd)
        except OSError:  # some file systems refuse fsync on a directory; the files are done
            pass
        finally:
            os.close(fd)
