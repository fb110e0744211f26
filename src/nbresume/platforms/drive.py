"""Google Drive on Colab, the platform's part: mount it, flush it, and report what reached it.

A file written under ``/content/drive`` lands in DriveFS's local cache and is uploaded later.
The checkpoint backend for folders on the mount, which counts a checkpoint as saved only when
Drive itself reports every file of it, is :class:`~nbresume.checkpoint.backends.drive.DriveStore`
(the backend registry picks it for every folder inside the mounted ``MyDrive``, so
``Checkpointer("/content/drive/MyDrive/x")`` gets it too). Here:

- :func:`mount_drive` mounts Drive (once) and returns the ``MyDrive`` folder.
- :func:`drive_status` says what Drive holds of each checkpoint of a folder.
- :func:`flush` wraps ``drive.flush_and_unmount()`` and reports which checkpoints Drive then
  holds.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from pathlib import Path

from nbresume import knobs
from nbresume.checkpoint.backends import DriveApi, DriveStore, Durability
from nbresume.checkpoint.store import CheckpointStore
from nbresume.errors import StorageError

#: What ``drive_status`` reports per checkpoint (an alias: the state is generic).
DriveStatus = Durability

DEFAULT_FLUSH_TIMEOUT_MS = 24 * 60 * 60 * 1000  # Colab's own default


# -- mounting ---------------------------------------------------------------------------------


def mount_drive(mountpoint: str | os.PathLike[str]) -> Path:
    """Mount Google Drive at ``mountpoint`` (Colab asks the browser for permission the first
    time) and return its ``MyDrive`` folder.

    An existing mount is kept: remounting kills Colab's DriveFS process, and with it every
    upload still pending. After mounting, the Drive API is authorised too (a second prompt the
    first time), so that checkpoints can be confirmed on Drive itself.
    """
    mount = os.path.expanduser(os.fspath(mountpoint))
    my_drive = Path(mount) / "MyDrive"
    if my_drive.is_dir():
        return my_drive
    try:
        from google.colab import drive
    except ImportError:
        raise StorageError(
            "Google Drive can be mounted only in a Colab runtime (google.colab is missing)",
            where=mount,
            fix="pass dir= to nbresume.init: a local folder or an fsspec URL",
        ) from None
    try:
        drive.mount(mount)
    except NotImplementedError as exc:
        raise StorageError(
            f"this runtime cannot mount Google Drive: {exc}",
            where=mount,
            fix="pass dir= to nbresume.init: a local folder or an fsspec URL",
        ) from None
    except ValueError as exc:
        raise StorageError(
            f"mounting Google Drive failed: {exc}", where=mount, fix=_mount_fix(str(exc))
        ) from None
    if not my_drive.is_dir():
        raise StorageError(
            "Google Drive was mounted but shows no MyDrive folder",
            where=mount,
            fix="Runtime → Disconnect and delete runtime, then run the notebook again",
        )
    try:
        DriveApi.shared()
    except StorageError as exc:
        warnings.warn(
            f"nbresume: {exc}. Checkpoints in Drive will show as syncing, never saved, until "
            "the Drive API can be asked",
            RuntimeWarning,
            stacklevel=2,
        )
    return my_drive


def _mount_fix(message: str) -> str:
    if "timeout" in message:
        return (
            "Drive took too long to list your files (often: very many files at the top of My "
            "Drive); run the cell again, or move files into folders"
        )
    if "already contain files" in message:
        return (
            "the mount point holds files from an earlier mount: Runtime → Disconnect and "
            f"delete runtime, or set {knobs.DRIVE_MOUNT.name} to an empty folder"
        )
    return "run the cell again and allow access to Google Drive when the browser asks"


# -- status and flush -------------------------------------------------------------------------


def drive_status(location: str | os.PathLike[str] | DriveStore) -> dict[int, Durability]:
    """{step: what Drive holds of it} for every committed checkpoint in a Drive folder."""
    store = location if isinstance(location, DriveStore) else DriveStore(location)
    return {info.step: store.durability(info.name, info.manifest)
            for info in CheckpointStore(store).list()}  # fmt: skip


@dataclass(frozen=True)
class FlushResult:
    """One checkpoint after a flush: where it was, its step, and what Drive holds of it."""

    location: str
    step: int
    status: Durability

    def __str__(self) -> str:
        return f"{'SAVED' if self.status.saved else 'NOT SAVED':9}  step {self.step}  " + (
            self.location if self.status.saved else f"{self.location}: {self.status}"
        )


@dataclass(frozen=True)
class FlushReport:
    """What Drive holds after ``flush_and_unmount``: checked through the API, per checkpoint.

    Attributes:
        results: every checkpoint that was in the folders before the flush.
        error: the flush's own failure (``flush_and_unmount failed``), or ``""``.
    """

    results: tuple[FlushResult, ...]
    error: str = ""

    @property
    def saved(self) -> list[FlushResult]:
        return [r for r in self.results if r.status.saved]

    @property
    def not_saved(self) -> list[FlushResult]:
        return [r for r in self.results if not r.status.saved]

    @property
    def ok(self) -> bool:
        """The flush succeeded and Drive holds every checkpoint."""
        return not self.error and not self.not_saved

    @property
    def summary(self) -> str:
        text = f"on Google Drive: {len(self.saved)}/{len(self.results)} checkpoints saved"
        return text + (f"; the flush failed: {self.error}" if self.error else "")

    def __str__(self) -> str:
        return "\n".join([self.summary, *(str(r) for r in self.results)])


def flush(
    *locations: str | os.PathLike[str] | DriveStore,
    timeout_ms: int = DEFAULT_FLUSH_TIMEOUT_MS,
) -> FlushReport:
    """Push every pending upload (``google.colab.drive.flush_and_unmount``, which also
    unmounts Drive), then ask Drive which checkpoints it holds.

    ``locations`` are checkpoint folders on the mount (default: every run under
    ``MyDrive/nbresume``). Their checkpoints are listed before the flush, since the mount's
    files are gone after it. A failed flush is reported in ``error``, never raised: the report
    still says what landed.
    """
    if not locations:
        runs = knobs.drive_mount() / "MyDrive" / "nbresume"
        locations = tuple(sorted(p for p in runs.iterdir() if p.is_dir())) if runs.is_dir() else ()
    stores = [loc if isinstance(loc, DriveStore) else DriveStore(loc) for loc in locations]
    pending = []
    for store in stores:
        for info in CheckpointStore(store).list():
            try:
                expected = store.expected(info.name, info.manifest)
            except OSError:
                continue  # vanished while we looked: retention, or a concurrent writer
            pending.append((store, info, expected))
    from google.colab import drive

    error = ""
    try:
        drive.flush_and_unmount(timeout_ms=timeout_ms)
    except ValueError as exc:
        error = str(exc) or "flush_and_unmount failed"
    results = tuple(
        FlushResult(store.child(info.name), info.step, store.drive_state(info.name, expected))
        for store, info, expected in pending
    )
    return FlushReport(results, error)


__all__ = [
    "DriveApi",
    "DriveStatus",
    "DriveStore",
    "FlushReport",
    "FlushResult",
    "drive_status",
    "flush",
    "mount_drive",
]
