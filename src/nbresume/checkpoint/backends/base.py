"""The backend protocol: a folder of checkpoint folders, and what a checkpoint store needs of it.

A backend (:class:`Backend`) lists folders, writes a new checkpoint into a folder of its own
choosing (:meth:`~Backend.begin`), makes it visible in one step (:meth:`~Backend.commit`: an
atomic rename on POSIX, the manifest written last on object stores), removes checkpoints so that
no reader sees part of one, repairs what a killed writer left (:meth:`~Backend.recover`), and
keeps small files directly below the root for the writer lease (:meth:`~Backend.read_small`,
:meth:`~Backend.create_small`, :meth:`~Backend.replace_small`, :meth:`~Backend.remove_small`,
:attr:`~Backend.writer_check`). It knows nothing of manifests' contents or tensors: that is the
checkpoint store's job (:mod:`nbresume.checkpoint.store.store`), which commits through it.

The backends themselves (local, fsspec, Google Drive) are found through
:mod:`nbresume.checkpoint.backends.registry`.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from nbresume.checkpoint.format import (
    MANIFEST_NAME,
    RETIRED_PREFIX,
    TEMP_PREFIX,
    Manifest,
    parse_step_dirname,
)
from nbresume.checkpoint.units import format_bytes

READ_CHUNK = 8 << 20

# Folders a writer leaves behind when it is killed; each begins with a dot (hidden from `ls`).
REPLACED_PREFIX = RETIRED_PREFIX + "replaced-"  # an older copy of the same step, being replaced
DELETING_PREFIX = RETIRED_PREFIX + "deleting-"  # a checkpoint that retention is removing


#: Every file of the checkpoint is in the durable store, with the manifest's size and hash.
SAVED = "saved"
#: Part of it is there, or some of it is there with other bytes: the upload is under way.
SYNCING = "syncing"
#: Nothing of it is in the durable store yet.
MISSING = "missing"
#: The durable store could not be asked (an API error, no credentials); ``reason`` says why.
FAILED = "failed"


#: Files another library wrote into a checkpoint folder, as ``{name: (size, MD5)}``, listed
#: when asked (see :meth:`Backend.durability_with`).
FileSums = Callable[[], Mapping[str, tuple[int, str]]]


@dataclass(frozen=True)
class Durability:
    """What the durable store holds of one checkpoint. Only ``state == "saved"`` is saved."""

    state: str
    reason: str = ""

    @property
    def saved(self) -> bool:
        return self.state == SAVED

    def __str__(self) -> str:
        return f"{self.state}: {self.reason}" if self.reason else self.state


def syncing(
    total: int, waiting: list[str], says: str, *, size: tuple[int, int] | None = None
) -> Durability:
    """:data:`SAVED` when no file of ``total`` is ``waiting``, else :data:`SYNCING` with how
    many arrived (with ``size``, how many of how many bytes), ``says`` and the first three
    files waited for."""
    if not waiting:
        return Durability(SAVED)
    arrived = f"{total - len(waiting)} of {total} files"
    if size is not None:
        arrived += f" ({format_bytes(size[0])} of {format_bytes(size[1])})"
    return Durability(
        SYNCING,
        f"{arrived} {says}"
        + ", ".join(waiting[:3])
        + (f" and {len(waiting) - 3} more" if len(waiting) > 3 else ""),
    )


@dataclass(frozen=True)
class FreeSpace:
    """Free bytes and inodes where the store writes (``None`` where the store cannot tell)."""

    bytes: int | None
    inodes: int | None


class Backend(ABC):
    """A folder of checkpoint folders. Names passed in are single path components."""

    #: Whether a folder can be renamed into place atomically (POSIX) or the manifest alone
    #: commits (object stores).
    atomic_rename: bool
    #: Whether writes land in a local cache that uploads later (Google Drive's mount): there a
    #: checkpoint that reads back is only "syncing" until :meth:`durability` says "saved".
    write_back: bool = False
    #: Whether the durable store reports each file's MD5 (then manifests record MD5s too).
    reports_md5: bool = False
    #: What a confirmation calls the storage behind a write-back cache (:meth:`confirm`).
    store_name: str = "the durable store"
    #: Seconds between two :meth:`durability` checks of a checkpoint still uploading.
    durability_poll_s: float = 5.0
    #: Whether :meth:`create_small` is atomic (``O_EXCL`` on POSIX). On object stores two
    #: processes creating the same file can both succeed: the last write wins.
    atomic_create: bool = False
    #: Seconds after its last renewal at which a writer lease taken on this store counts as
    #: abandoned, when the holder's process cannot be looked at (another machine); ``None``:
    #: :data:`nbresume.checkpoint.store.lease.LEASE_EXPIRY_S`.
    lease_expiry_s: float | None = None
    #: Set by the writer that holds this folder's lease (:mod:`nbresume.checkpoint.store.lease`):
    #: called before anything that removes or commits a folder, it raises when that writer
    #: lost the lease. ``None`` (readers, and writers without a lease): nothing is checked.
    writer_check: Callable[[], None] | None = None

    @classmethod
    @abstractmethod
    def from_location(
        cls, location: str, storage_options: Mapping[str, Any] | None = None
    ) -> Backend:
        """The backend for ``location`` as the registry hands it over (a local path without
        ``file://``, or a URL); ``storage_options`` only where the backend takes them."""

    @property
    @abstractmethod
    def location(self) -> str:
        """The store's root as the user would write it (a path or a URL)."""

    def child(self, *names: str) -> str:
        """The location of a folder or file below the root, for messages."""
        return "/".join([self.location.rstrip("/"), *names])

    @abstractmethod
    def list_folders(self) -> list[str]:
        """Names of the folders directly below the root (none when the root does not exist)."""

    @abstractmethod
    def list_files(self, folder: str) -> list[str]:
        """Names of the files in ``folder``."""

    @abstractmethod
    def begin(self, final: str) -> str:
        """Prepare a folder to write the checkpoint ``final`` into; return its name."""

    @abstractmethod
    def open_write(self, folder: str, name: str) -> IO[bytes]:
        """A new binary file in ``folder``; close it with :meth:`close_durably`."""

    @abstractmethod
    def close_durably(self, handle: IO[bytes]) -> None:
        """Flush, make durable (fsync where there is such a thing) and close."""

    @abstractmethod
    def commit(self, folder: str, final: str) -> None:
        """Make ``folder`` visible as ``final``, its manifest already written."""

    @abstractmethod
    def open_read(self, folder: str, name: str) -> IO[bytes]:
        """Open a file of a committed checkpoint for reading."""

    @abstractmethod
    def delete(self, folder: str) -> None:
        """Remove a checkpoint so that no reader ever sees part of it."""

    @abstractmethod
    def discard(self, folder: str) -> None:
        """Remove an uncommitted or leftover folder, whatever it holds."""

    @abstractmethod
    def recover(self, current: str) -> list[str]:
        """Repair or remove what a killed writer left; ``current`` is a folder being written
        now and is left alone. Return the names that were cleaned."""

    def check_writable(self) -> None:
        """Raise :class:`~nbresume.errors.StorageError` unless this process may write here,
        asking the store without writing anything, where the store can tell (a bucket asks the
        Hub for a write token); by default nothing is asked: the first save finds out."""
        return None

    def free_space(self) -> FreeSpace:
        """Free bytes and inodes, where the store can tell."""
        return FreeSpace(None, None)

    @property
    def local_root(self) -> Path | None:
        """The folder on this machine's file system that holds the store's folders, or
        ``None`` on a store that has no such path (an object store)."""
        return None

    def local_path(self, folder: str, name: str | None = None) -> Path | None:
        """``folder`` (or its file ``name``) as a path on this machine's file system, for
        another library to write into or for a look without opening; ``None`` on a store
        that has no such path (an object store)."""
        return None

    def make_durable(self, folder: str, name: str) -> None:
        """Make a file that another library wrote into ``folder`` durable (fsync where
        there is such a thing; an object store's file is durable once it was written)."""
        return None

    def confirm(self, folder: str, manifest: Manifest) -> tuple[bool, str]:
        """Whether the storage itself confirms the committed checkpoint ``folder``
        (``wait(durable=True)`` asks it until it does), and what the storage reported, in
        words. By default, what :meth:`durability` says."""
        state = self.durability(folder, manifest)
        if self.write_back and state.saved:
            count = len(manifest.files)
            return (
                True,
                f"{self.store_name} reports all {count} files with the manifest's size and MD5",
            )
        if self.write_back:
            return False, f"{self.store_name}: {state}"
        return state.saved, str(state)

    def durability(self, folder: str, manifest: Manifest) -> Durability:
        """What the durable store holds of a checkpoint that verified. Without a write-back
        cache, what reads back is the durable copy itself: saved."""
        return Durability(SAVED)

    def durability_with(self, folder: str, manifest: Manifest, more: FileSums) -> Durability:
        """:meth:`durability`, where the durable copy must also hold files that the manifest
        does not name (another library's, in the same folder): ``more`` lists them as
        ``{name: (size, MD5)}``, and is called only by a store that compares each file (Google
        Drive). By default, :meth:`durability`."""
        return self.durability(folder, manifest)

    def read_bytes(self, folder: str, name: str, *, limit: int | None = None) -> bytearray:
        """A whole file, refusing to read more than ``limit`` bytes."""
        with self.open_read(folder, name) as handle:
            data = bytearray()
            while chunk := handle.read(READ_CHUNK):
                data += chunk
                if limit is not None and len(data) > limit:
                    break
            return data

    def iter_chunks(self, folder: str, name: str) -> Iterator[bytes]:
        with self.open_read(folder, name) as handle:
            while chunk := handle.read(READ_CHUNK):
                yield chunk

    def _check_writer(self) -> None:
        if self.writer_check is not None:
            self.writer_check()

    def _discard_uncommitted(self, current: str) -> list[str]:
        """:meth:`recover` for a store without renames: discard every temporary or retired
        folder and every step folder without a manifest (a write that never committed), all
        but ``current``; return their names."""
        self._check_writer()
        cleaned = []
        for name in self.list_folders():
            if name == current:
                continue
            hidden = name.startswith((TEMP_PREFIX, RETIRED_PREFIX))
            if hidden or (
                parse_step_dirname(name) is not None and MANIFEST_NAME not in self.list_files(name)
            ):
                self.discard(name)
                cleaned.append(name)
        return cleaned

    # -- small files directly below the root (the writer lease) ---------------------------

    @abstractmethod
    def read_small(self, name: str) -> bytes | None:
        """The bytes of the small file ``name`` directly below the root (at most
        :data:`SMALL_FILE_LIMIT`), or ``None`` when there is none."""

    def create_small(self, name: str, data: bytes) -> bool:
        """Create the small file ``name`` below the root, creating the root if needed; return
        False, writing nothing, when it exists already (atomic where :attr:`atomic_create`).

        By default a look and then a write: between the two another process may create the
        file too, and the last write wins. Callers that need to be the only creator read the
        file back after a pause (see the writer lease)."""
        if self.read_small(name) is not None:
            return False
        self.replace_small(name, data)
        return True

    @abstractmethod
    def replace_small(self, name: str, data: bytes) -> None:
        """Write the small file ``name`` below the root, replacing any earlier one (readers see
        the old bytes or the new, never a mix, on POSIX)."""

    @abstractmethod
    def remove_small(self, name: str) -> None:
        """Remove the small file ``name`` below the root, if it is there."""


def read_into(handle: IO[bytes], view: memoryview) -> int:
    """Fill ``view`` from ``handle``; return how many bytes were read (fewer only at the end
    of the file). Reads straight into ``view`` where the file object can (``readinto``)."""
    readinto = getattr(handle, "readinto", None)
    done, size = 0, view.nbytes
    while done < size:
        if readinto is not None:
            count = readinto(view[done:])
        else:
            chunk = handle.read(size - done)
            count = len(chunk)
            view[done : done + count] = chunk
        if not count:
            break
        done += count
    return done


def replaced_step(name: str) -> str | None:
    """The checkpoint folder that ``name`` is an older copy of, moved aside while a new copy
    of the same step was being committed (``None`` for any other name)."""
    if not name.startswith(REPLACED_PREFIX):
        return None
    # The name ends with "-<pid>-<token>" (_token); the step's folder name may hold dashes
    # itself (a Trainer's "checkpoint-12").
    return name[len(REPLACED_PREFIX) :].rsplit("-", 2)[0]


def _token() -> str:
    return f"{os.getpid()}-{secrets.token_hex(4)}"


#: The most bytes :meth:`Backend.read_small` reads: a lease is a few hundred.
SMALL_FILE_LIMIT = 64 << 10


def file_kind(mode: int) -> str:
    """What a file of ``mode`` (``st_mode``) is, in words; ``""`` for a regular file."""
    if stat.S_ISREG(mode):
        return ""
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    if stat.S_ISFIFO(mode):
        return "a named pipe (FIFO)"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "a device file"


def handle_size(handle: IO[bytes]) -> int | None:
    """The size of an open file where its file object can tell without reading it."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        info = os.fstat(handle.fileno())
        if stat.S_ISREG(info.st_mode):
            return info.st_size
    size = getattr(handle, "size", None)  # fsspec's buffered files
    if isinstance(size, int) and not isinstance(size, bool):
        return size
    with contextlib.suppress(OSError, ValueError, AttributeError):
        if handle.seekable():
            here = handle.tell()
            end = handle.seek(0, os.SEEK_END)
            handle.seek(here)
            return end
    return None
