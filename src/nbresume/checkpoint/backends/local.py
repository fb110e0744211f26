"""The local backend: a folder on a POSIX file system.

Protocol (:class:`~nbresume.checkpoint.backends.base.Backend`): a checkpoint is written into a
hidden sibling folder, every file and the folder are fsynced, and one atomic rename makes it
visible; a step saved again moves the old copy aside first, and :meth:`LocalStore.recover` puts
it back if the writer was killed in between. Deleting is a rename out of view, then removal.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

from nbresume.checkpoint.backends.base import (
    DELETING_PREFIX,
    REPLACED_PREFIX,
    SMALL_FILE_LIMIT,
    Backend,
    FreeSpace,
    _token,
)
from nbresume.checkpoint.format import MANIFEST_NAME, RETIRED_PREFIX, TEMP_PREFIX
from nbresume.errors import StorageError


class LocalStore(Backend):
    """A folder on a POSIX file system: temporary sibling folder, fsync, atomic rename."""

    atomic_rename = True
    atomic_create = True

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root).expanduser()

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
        (self.root / name).mkdir()
        return name

    def open_write(self, folder: str, name: str) -> IO[bytes]:
        return open(self.root / folder / name, "xb")

    def close_durably(self, handle: IO[bytes]) -> None:
        try:
            handle.flush()
            os.fsync(handle.fileno())
        finally:
            handle.close()

    def commit(self, folder: str, final: str) -> None:
        self._check_writer()
        _fsync_dir(self.root / folder)
        target = self.root / final
        replaced: Path | None = None
        if target.exists():
            # Saving a step that already exists: move the old copy aside first. If we are killed
            # before the new copy is in place, recover() puts the old one back.
            replaced = self.root / f"{REPLACED_PREFIX}{final}-{_token()}"
            os.rename(target, replaced)
        os.rename(self.root / folder, target)
        _fsync_dir(self.root)
        if replaced is not None:
            # The manifest first: a copy cut short by a kill is then never put back by recover().
            with contextlib.suppress(OSError):
                os.unlink(replaced / MANIFEST_NAME)
            shutil.rmtree(replaced, ignore_errors=True)

    def open_read(self, folder: str, name: str) -> IO[bytes]:
        path = self.root / folder / name
        # Only regular files: opening a planted FIFO would wait forever for a writer.
        if not stat.S_ISREG(os.lstat(path).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        # O_NOFOLLOW: a planted symlink must not make us read a file outside the checkpoint.
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        return os.fdopen(fd, "rb")

    def delete(self, folder: str) -> None:
        # One atomic rename takes the checkpoint out of every reader's view; the slow removal
        # happens afterwards, and a kill in the middle of it leaves only a hidden folder.
        self._check_writer()
        doomed = self.root / f"{DELETING_PREFIX}{folder}-{_token()}"
        os.rename(self.root / folder, doomed)
        _fsync_dir(self.root)
        shutil.rmtree(doomed, ignore_errors=True)

    def discard(self, folder: str) -> None:
        shutil.rmtree(self.root / folder, ignore_errors=True)

    def recover(self, current: str) -> list[str]:
        self._check_writer()
        cleaned = []
        for name in self.list_folders():
            if name == current or not name.startswith((TEMP_PREFIX, RETIRED_PREFIX)):
                continue
            if name.startswith(REPLACED_PREFIX):
                final = name[len(REPLACED_PREFIX) :].split("-", 1)[0]
                if not (self.root / final).exists() and (self.root / name / MANIFEST_NAME).exists():
                    os.rename(self.root / name, self.root / final)
                    _fsync_dir(self.root)
                    cleaned.append(name)
                    continue
            shutil.rmtree(self.root / name, ignore_errors=True)
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
        try:
            with self.open_read("", name) as handle:
                return handle.read(SMALL_FILE_LIMIT)
        except FileNotFoundError:
            return None
        except NotADirectoryError:
            raise self._not_a_folder() from None

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


_FSYNC_REFUSED = {errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EBADF, errno.EACCES}


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    except OSError as exc:
        # Some file systems (certain FUSE mounts) refuse fsync on a folder; the data files
        # themselves were fsynced, and verification still reads everything back. Any other
        # error (EIO) means the rename may not survive a crash: never report that as saved.
        if exc.errno not in _FSYNC_REFUSED:
            raise
    finally:
        os.close(fd)
