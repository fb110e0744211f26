"""The local backend: a folder on a POSIX file system.

Protocol (:class:`~nbresume.checkpoint.backends.base.Backend`): a checkpoint is written into a
hidden sibling folder, every file and the folder are fsynced, and one atomic rename makes it
visible; the parent folder is then fsynced so that the rename survives a power cut. A step
saved again moves the old copy aside first, and :meth:`LocalStore.recover` puts it back if the
writer was killed in between. Deleting is a rename out of view (fsynced), then the removal of the
hidden folder, in the background (:func:`remove_in_background`): the next save, and the
interpreter's exit, wait for it.

**Removal in the background.** Deleting a checkpoint is one rename to a hidden
``.nbresume-old-deleting-...`` folder, with the parent folder fsynced (every reader stops
seeing the checkpoint, durably, before :meth:`~nbresume.checkpoint.store.CheckpointStore.save`
returns), then the removal of that folder's files, which costs tens of milliseconds for a
checkpoint of 50 MB and hundreds for 500 MB. That removal runs in a kept thread
(:class:`~nbresume.checkpoint.forksafe.Workers`) so that a save does not wait for it. What
needs the disk space back waits for it first:

- the next save of this process, before it cleans up, checks free space and writes
  (:meth:`LocalStore.recover`, which every ``begin`` follows, calls :func:`wait_for_removals`),
  and a framework's save that writes its own folder (``Watch.save_started``);
- :meth:`CheckpointStore.wait_removals <nbresume.checkpoint.store.CheckpointStore.wait_removals>`
  and a Checkpointer giving back its writer lease (``close()``, the end of a run);
- a normal interpreter exit (an ``atexit`` hook; removals started after it run in the caller),
  so that a script or a notebook kernel that ends leaves no hidden folder behind.

A kill in the middle of a removal leaves the hidden folder, which the next writer's
``recover()`` removes. A forked child does not wait for its parent's removals.

Every file-system call of that protocol goes through one :class:`Files` object (the seam where
the power-cut tests put a layer that loses what was not synced when the power goes).
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import functools
import io
import logging
import os
import shlex
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, Any

from nbresume import knobs
from nbresume.checkpoint import forksafe
from nbresume.checkpoint.backends.base import (
    DELETING_PREFIX,
    REPLACED_PREFIX,
    SMALL_FILE_LIMIT,
    Backend,
    FreeSpace,
    _token,
    file_kind,
    replaced_step,
)
from nbresume.checkpoint.forksafe import Workers
from nbresume.checkpoint.format import MANIFEST_NAME, RETIRED_PREFIX, TEMP_PREFIX, Manifest
from nbresume.errors import StorageError

log = logging.getLogger("nbresume")


class Files:
    """The file-system calls of the local commit protocol, as the operating system does them.

    One object per store; a test may pass another (``LocalStore(root, files=...)``) that
    models a power cut: writes and folder changes not yet synced are lost.
    """

    def make_folder(self, path: Path) -> None:
        os.mkdir(path)

    def open_new(self, path: Path) -> IO[bytes]:
        """A new file, open for writing (refused when the name exists); its pages start
        going to the disk while it is written (:class:`WriteBehindFile`)."""
        return io.BufferedWriter(WriteBehindFile(path, "xb"))

    def sync(self, handle: IO[bytes]) -> None:
        """Make a file's bytes durable (its name is durable once its folder is synced)."""
        handle.flush()
        os.fsync(handle.fileno())

    def sync_folder(self, path: Path) -> None:
        """Make a folder's entries (files created, renamed or removed in it) durable."""
        fsync_folder(path)

    def rename(self, source: Path, target: Path) -> None:
        os.rename(source, target)

    def unlink(self, path: Path) -> None:
        os.unlink(path)

    def remove_tree(self, path: Path) -> None:
        shutil.rmtree(path, ignore_errors=True)


#: Bytes written to a file between two starts of its writeback (:class:`WriteBehindFile`).
WRITE_BEHIND_BYTES = 32 << 20


class WriteBehindFile(io.FileIO):
    """A file being written whose pages are handed to the disk every
    :data:`WRITE_BEHIND_BYTES` (Linux ``sync_file_range(SYNC_FILE_RANGE_WRITE)``, which starts
    the writeback and returns at once), so that the disk writes while the next bytes are still
    being copied, and the final fsync finds most of the file on the disk already. Without it,
    a large checkpoint is all dirty pages when its fsync starts: the disk then writes all of it
    after the copy, not during. Where the call does not exist (not Linux), only the fsync
    writes. This starts writes earlier; the fsync is still what makes the file durable."""

    _written = 0
    _started = 0

    def write(self, data: Any) -> int:
        count = super().write(data)
        if count:
            self._written += count
            if self._written - self._started >= WRITE_BEHIND_BYTES:
                _start_writeback(self.fileno(), self._started, self._written - self._started)
                self._started = self._written
        return count or 0


@functools.cache
def _libc_sync_file_range() -> Any:
    """libc's ``sync_file_range`` (``None`` where there is none), looked up at the first
    large write rather than when nbresume is imported."""
    import ctypes

    try:
        call = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError, TypeError):  # not Linux
        return None
    call.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    call.restype = ctypes.c_int
    return call


_SYNC_FILE_RANGE_WRITE = 2


def _start_writeback(fd: int, offset: int, length: int) -> None:
    """Start writing ``length`` bytes from ``offset`` to the disk, without waiting; a hint
    only: a refusal (a file system without it) changes nothing, the fsync comes anyway."""
    call = _libc_sync_file_range()
    if call is not None:
        call(fd, offset, length, _SYNC_FILE_RANGE_WRITE)


#: File systems on a local device: there, what reads back right after a save comes from the
#: page cache, the very bytes that were hashed as they were written, so reading it proves
#: nothing more. Anything else (FUSE mounts, NFS, SMB, 9p) is read back.
LOCAL_FILE_SYSTEMS = frozenset(
    {"ext2", "ext3", "ext4", "xfs", "btrfs", "zfs", "f2fs", "jfs", "reiserfs", "bcachefs",
     "tmpfs", "ramfs", "overlay"}
)  # fmt: skip


class LocalStore(Backend):
    """A folder on a POSIX file system: temporary sibling folder, fsync, atomic rename."""

    atomic_rename = True
    atomic_create = True
    #: Whether :meth:`delete` removes the folder it took out of view in the background
    #: (:func:`remove_in_background`) rather than before it returns.
    remove_in_background = True

    def __init__(self, root: str | os.PathLike[str], *, files: Files | None = None) -> None:
        self.root = Path(root).expanduser()
        #: Where every call of the commit protocol goes (:class:`Files`).
        self.files = files or Files()
        self._file_system: str | None = None

    @property
    def file_system(self) -> str:
        """The type of the file system the root is on (``"ext4"``, ``"fuse.gcsfuse"``, ...),
        from the mount table; ``""`` where the system does not tell (not Linux)."""
        if self._file_system is None:
            self._file_system = mount_type(self.root)
        return self._file_system

    @property
    def readback_after_save(self) -> bool:
        """Whether a save reads its files back: on a local device's file system the bytes
        that read back come from the page cache (see :data:`LOCAL_FILE_SYSTEMS`); a mount
        whose type is unknown or remote, or a write-back cache (Drive), is read back and
        compared."""
        return self.write_back or self.file_system not in LOCAL_FILE_SYSTEMS

    @classmethod
    def from_location(
        cls, location: str, storage_options: Mapping[str, Any] | None = None
    ) -> LocalStore:
        return cls(location)

    @property
    def location(self) -> str:
        return str(self.root)

    def list_folders(self) -> list[str]:
        try:
            with os.scandir(self.root) as entries:
                return [e.name for e in entries if e.is_dir(follow_symlinks=False)]
        except FileNotFoundError:
            return []
        except NotADirectoryError:
            raise self._not_a_folder() from None

    def _not_a_folder(self) -> StorageError:
        return StorageError(
            "this is a file, not a folder",
            where=str(self.root),
            fix="choose a folder for the checkpoints (it is created if it does not exist)",
        )

    def _make_root(self) -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError):
            raise self._not_a_folder() from None

    def list_files(self, folder: str) -> list[str]:
        with os.scandir(self.root / folder) as entries:
            return [e.name for e in entries if e.is_file(follow_symlinks=False)]

    def begin(self, final: str) -> str:
        self.root.mkdir(parents=True, exist_ok=True)
        name = f"{TEMP_PREFIX}{final}-{_token()}"
        self.files.make_folder(self.root / name)
        return name

    def open_write(self, folder: str, name: str) -> IO[bytes]:
        return self.files.open_new(self.root / folder / name)

    @property
    def local_root(self) -> Path:
        return self.root

    def local_path(self, folder: str, name: str | None = None) -> Path:
        return self.root / folder if name is None else self.root / folder / name

    def make_durable(self, folder: str, name: str) -> None:
        fd = os.open(self.root / folder / name, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def confirm(self, folder: str, manifest: Manifest) -> tuple[bool, str]:
        """Every file of the checkpoint, then its folder and the folder above, fsynced once
        more: the kernel has written them to the device. (A write-back cache, Drive's mount,
        asks the durable store instead.)"""
        if self.write_back:
            return super().confirm(folder, manifest)
        path = self.root / folder
        for name in [*manifest.files, MANIFEST_NAME]:
            fd = os.open(path / name, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_folder(path)
        fsync_folder(path.parent)
        count = len(manifest.files)
        return True, f"its {count} files and its folder are fsynced to the local disk"

    def close_durably(self, handle: IO[bytes]) -> None:
        try:
            self.files.sync(handle)
        finally:
            handle.close()

    def commit(self, folder: str, final: str) -> None:
        self._check_writer()
        # The files' names in the pending folder: without this, a power cut after the rename
        # can leave the checkpoint's folder in place and its files gone.
        self.files.sync_folder(self.root / folder)
        target = self.root / final
        replaced: Path | None = None
        if target.exists():
            # Saving a step that already exists: move the old copy aside first. If we are killed
            # before the new copy is in place, recover() puts the old one back.
            replaced = self.root / f"{REPLACED_PREFIX}{final}-{_token()}"
            self.files.rename(target, replaced)
        self.files.rename(self.root / folder, target)
        # The rename itself: without this, a power cut can take back a checkpoint reported saved.
        self.files.sync_folder(self.root)
        if replaced is not None:
            # The manifest first: a copy cut short by a kill is then never put back by recover().
            with contextlib.suppress(OSError):
                self.files.unlink(replaced / MANIFEST_NAME)
            self.files.remove_tree(replaced)

    def open_read(self, folder: str, name: str) -> IO[bytes]:
        path = self.root / folder / name
        kind = _open_regular(path)
        if isinstance(kind, str):
            raise OSError(errno.EINVAL, f"not a regular file but {kind}", str(path))
        return kind

    def delete(self, folder: str) -> None:
        # One atomic rename takes the checkpoint out of every reader's view, durably before
        # this returns; the slow removal happens afterwards, in the background, and a kill in
        # the middle of it leaves only a hidden folder that the next recover() removes.
        self._check_writer()
        doomed = self._out_of_view(folder)
        if self.remove_in_background:
            remove_in_background(functools.partial(self.files.remove_tree, doomed))
        else:
            self.files.remove_tree(doomed)

    def _out_of_view(self, folder: str) -> Path:
        """Rename ``folder`` to a hidden name that no reader takes, durably; the new path."""
        doomed = self.root / f"{DELETING_PREFIX}{folder}-{_token()}"
        self.files.rename(self.root / folder, doomed)
        self.files.sync_folder(self.root)
        return doomed

    def discard(self, folder: str) -> None:
        self.files.remove_tree(self.root / folder)

    def recover(self, current: str) -> list[str]:
        self._check_writer()
        # The space of what retention deleted is back before the next save checks it and
        # writes (every begin() follows a recover()), and no folder is removed twice at once.
        wait_for_removals()
        cleaned = []
        for name in self.list_folders():
            if name == current or not name.startswith((TEMP_PREFIX, RETIRED_PREFIX)):
                continue
            if name.startswith(REPLACED_PREFIX):
                final = replaced_step(name) or ""
                if not (self.root / final).exists() and (self.root / name / MANIFEST_NAME).exists():
                    self.files.rename(self.root / name, self.root / final)
                    self.files.sync_folder(self.root)
                    cleaned.append(name)
                    continue
            self.files.remove_tree(self.root / name)
            cleaned.append(name)
        return cleaned

    def free_space(self) -> FreeSpace:
        probe = self.root
        while not probe.exists() and probe != probe.parent:
            probe = probe.parent
        try:
            st = os.statvfs(probe)
        except OSError:
            return FreeSpace(None, None)
        # f_favail is 0 on file systems without inode accounting (some FUSE mounts): unknown.
        inodes = st.f_favail if st.f_files else None
        return FreeSpace(st.f_bavail * st.f_frsize, inodes)

    def read_small(self, name: str) -> bytes | None:
        path = self.root / name
        try:
            opened = _open_regular(path)
        except FileNotFoundError:
            return None
        except NotADirectoryError:
            raise self._not_a_folder() from None
        if isinstance(opened, str):
            # nbresume never makes one, and never removes what it did not make.
            shown = shlex.quote(str(path))
            if opened == "a folder":
                move = f"move that folder elsewhere (mv {shown} SOMEWHERE)"
            elif opened == "a symbolic link":
                move = f"remove the link (rm {shown}; what it points to stays)"
            else:
                move = f"remove it (rm {shown})"
            raise StorageError(
                f"{path} is {opened}, not a file: nbresume keeps its writer lease in a small "
                "file of its own under this name",
                where=str(path),
                fix=f"{move}; nbresume makes the file itself when it writes here",
            )
        with opened as handle:
            return handle.read(SMALL_FILE_LIMIT)

    def create_small(self, name: str, data: bytes) -> bool:
        self._make_root()
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
        try:
            fd = os.open(self.root / name, flags, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)  # a few hundred bytes: one write
        return True

    def replace_small(self, name: str, data: bytes) -> None:
        self._make_root()
        # Written aside, then renamed over: readers never see a half-written file. A kill in
        # between leaves only the small file aside (a file: recover() looks at folders only).
        aside = self.root / f"{name}.{_token()}.tmp"
        try:
            with open(aside, "xb") as handle:
                handle.write(data)
            os.replace(aside, self.root / name)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(aside)

    def remove_small(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.root / name)


def _open_regular(path: Path) -> IO[bytes] | str:
    """``path`` open for reading when it is a regular file, else what it is (``"a folder"``,
    ``"a named pipe (FIFO)"``, ...). Other files are never opened: a FIFO would wait forever
    for a writer, a device may act on being opened, a symbolic link may lead out of the
    folder. The open itself takes no symbolic link and never waits, should another file have
    taken the name since it was looked at."""
    kind = file_kind(os.lstat(path).st_mode)
    if kind:
        return kind
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EMLINK):
            return "a symbolic link"
        raise
    kind = file_kind(os.fstat(fd).st_mode)
    if kind:
        os.close(fd)
        return kind
    return os.fdopen(fd, "rb")


_FSYNC_REFUSED = {errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EBADF, errno.EACCES}


def mount_type(path: Path) -> str:
    """The file-system type of the mount that holds ``path`` (the longest mount point that
    contains it, from /proc/self/mountinfo, or ``NBRESUME_MOUNTINFO``), or ``""`` where there
    is no such table."""
    probe = Path(os.path.realpath(path))
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        with open(knobs.MOUNTINFO.raw(), encoding="utf-8", errors="replace") as table:
            lines = table.read().splitlines()
    except OSError:
        return ""
    best, kind = "", ""
    for line in lines:
        fields = line.split()
        if " - " not in line or len(fields) < 5:
            continue
        # Field 5 is the mount point (spaces escaped as \040); the type follows " - ".
        point = fields[4].replace("\\040", " ")
        inside = str(probe) == point or str(probe).startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, kind = point, line.split(" - ", 1)[1].split()[0]
    return kind


def fsync_folder(path: Path) -> None:
    """Make ``path``'s entries (files created, renamed or removed in it) durable: the one
    folder fsync of nbresume. A file system that refuses fsync on a folder (certain FUSE
    mounts: EINVAL, ENOTSUP, EBADF, EACCES) is accepted, since the files themselves were
    fsynced and verification reads everything back; any other error (EIO) is raised, since
    the entries may not survive a crash and must never be reported as saved."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in _FSYNC_REFUSED:
            raise
    finally:
        os.close(fd)


# -- removal in the background ------------------------------------------------------------------


class Removals:
    """Removals started by this process and not yet finished."""

    def __init__(self) -> None:
        self._changed = forksafe.condition()
        self._pending = 0
        self._exiting = False
        # One thread: removals of one disk go no faster side by side, and each is waited for.
        self._workers = Workers("nbresume-remove", 1)
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=self._forget)

    def _forget(self) -> None:
        """In a forked child: the parent's removals are not this process's to wait for."""
        self._pending = 0

    def start(self, remove: Callable[[], None]) -> None:
        """Run ``remove`` in the background; in the caller once the interpreter is exiting,
        or where no thread can start. ``remove`` must not raise for a folder it could not
        remove (a leftover hidden folder is removed by the next writer's ``recover()``)."""
        with self._changed:
            background = not self._exiting
            if background:
                self._pending += 1
        if background:
            if self._workers.submit(lambda: self._run(remove)):
                return
            self._finished()
        remove()

    def _run(self, remove: Callable[[], None]) -> None:
        try:
            remove()
        except BaseException as exc:  # a job that raises would end the worker thread
            log.debug("nbresume: a background removal failed: %r", exc)
        finally:
            self._finished()

    def _finished(self) -> None:
        with self._changed:
            self._pending -= 1
            self._changed.notify_all()

    def wait(self) -> None:
        """Return once every removal started so far has finished."""
        with self._changed:
            self._changed.wait_for(lambda: self._pending == 0)

    def at_exit(self) -> None:
        """At interpreter exit: finish the removals; any later one runs in its caller."""
        with self._changed:
            self._exiting = True
        self.wait()


REMOVALS = Removals()
# Registered when nbresume's store is imported (it imports this backend), before any
# Checkpointer registers its own exit hook: hooks run last-registered first, so a
# Checkpointer's final background save (and its retention) has finished before this one waits.
atexit.register(REMOVALS.at_exit)


def remove_in_background(remove: Callable[[], None]) -> None:
    """Run ``remove`` (a folder's removal) in the background; see :class:`Removals`."""
    REMOVALS.start(remove)


def wait_for_removals() -> None:
    """Return once every removal this process started has finished."""
    REMOVALS.wait()
