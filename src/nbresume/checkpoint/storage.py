"""Where checkpoints live: a POSIX folder, or any fsspec URL.

Two backends with one interface. :class:`LocalStore` has atomic rename and fsync and uses
them; :class:`FsspecStore` (S3, GCS, ``memory://``, ...) has neither, so there the manifest,
written last, is the only commit. :func:`open_store` picks one for a path or URL.

How a checkpoint is committed is described at the top of :mod:`nbresume.checkpoint.store`.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import shutil
import stat
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from nbresume.checkpoint.format import MANIFEST_NAME, RETIRED_PREFIX, TEMP_PREFIX, Manifest
from nbresume.errors import StorageError, UsageError

if TYPE_CHECKING:
    from nbresume.checkpoint.durability import Durability

READ_CHUNK = 8 << 20

# Folders a writer leaves behind when it is killed; each begins with a dot (hidden from `ls`).
REPLACED_PREFIX = RETIRED_PREFIX + "replaced-"  # an older copy of the same step, being replaced
DELETING_PREFIX = RETIRED_PREFIX + "deleting-"  # a checkpoint that retention is removing


@dataclass(frozen=True)
class FreeSpace:
    """Free bytes and inodes where the store writes (``None`` where the store cannot tell)."""

    bytes: int | None
    inodes: int | None


class Store(ABC):
    """A folder of checkpoint folders. Names passed in are single path components."""

    #: Whether a folder can be renamed into place atomically (POSIX) or the manifest alone
    #: commits (object stores).
    atomic_rename: bool
    #: Whether writes land in a local cache that uploads later (Google Drive's mount): there a
    #: checkpoint that reads back is only "syncing" until :meth:`durability` says "saved".
    write_back: bool = False
    #: Whether the durable store reports each file's MD5 (then manifests record MD5s too).
    reports_md5: bool = False
    #: Seconds between two :meth:`durability` checks of a checkpoint still uploading.
    durability_poll_s: float = 5.0
    #: Whether :meth:`create_small` is atomic (``O_EXCL`` on POSIX). On object stores two
    #: processes creating the same file can both succeed: the last write wins.
    atomic_create: bool = False
    #: Seconds after its last renewal at which a writer lease taken on this store counts as
    #: abandoned, when the holder's process cannot be looked at (another machine); ``None``:
    #: :data:`nbresume.checkpoint.lease.LEASE_EXPIRY_S`.
    lease_expiry_s: float | None = None
    #: Set by the writer that holds this folder's lease (:mod:`nbresume.checkpoint.lease`):
    #: called before anything that removes or commits a folder, it raises when that writer
    #: lost the lease. ``None`` (readers, and writers without a lease): nothing is checked.
    writer_check: Callable[[], None] | None = None

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

    def free_space(self) -> FreeSpace:
        """Free bytes and inodes, where the store can tell."""
        return FreeSpace(None, None)

    def durability(self, folder: str, manifest: Manifest) -> Durability:
        """What the durable store holds of a checkpoint that verified. Without a write-back
        cache, what reads back is the durable copy itself: saved."""
        from nbresume.checkpoint.durability import SAVED, Durability

        return Durability(SAVED)

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

    # -- small files directly below the root (the writer lease) ---------------------------

    @abstractmethod
    def read_small(self, name: str) -> bytes | None:
        """The bytes of the small file ``name`` directly below the root (at most
        :data:`SMALL_FILE_LIMIT`), or ``None`` when there is none."""

    @abstractmethod
    def create_small(self, name: str, data: bytes) -> bool:
        """Create the small file ``name`` below the root, creating the root if needed; return
        False, writing nothing, when it exists already (atomic where :attr:`atomic_create`)."""

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
    return name[len(REPLACED_PREFIX) :].split("-", 1)[0]


def _token() -> str:
    return f"{os.getpid()}-{secrets.token_hex(4)}"


#: The most bytes :meth:`Store.read_small` reads: a lease is a few hundred.
SMALL_FILE_LIMIT = 64 << 10


class LocalStore(Store):
    """A folder on a POSIX file system: temporary sibling folder, fsync, atomic rename."""

    atomic_rename = True
    atomic_create = True

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root).expanduser()

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


class FsspecStore(Store):
    """Any fsspec file system. No atomic rename: the manifest, written last, is the commit."""

    atomic_rename = False

    def __init__(
        self,
        url: str,
        fs: Any = None,
        root: str | None = None,
        *,
        storage_options: Mapping[str, Any] | None = None,
    ) -> None:
        """``storage_options`` go to the fsspec file system (credentials, ``endpoint_url``...)."""
        import fsspec

        self.url = url
        if fs is None:
            fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}))
        self.fs = fs
        self.root = (root or "").rstrip("/")
        # memory:// lives in this process alone: no other process can create a file between
        # our look and our write.
        protocol = getattr(fs, "protocol", "")
        self.atomic_create = "memory" in ((protocol,) if isinstance(protocol, str) else protocol)

    @property
    def location(self) -> str:
        return self.url

    def _path(self, *names: str) -> str:
        # An empty root (a bucket-less URL, a wrapped file system) must not add a leading "/".
        return "/".join(part for part in (self.root, *names) if part)

    def _ls(self, path: str) -> list[dict[str, Any]]:
        # Listings are cached by some backends (s3fs): another process may have written since.
        self.fs.invalidate_cache(path)
        try:
            entries: list[dict[str, Any]] = self.fs.ls(path, detail=True)
        except FileNotFoundError:
            return []
        return entries

    def list_folders(self) -> list[str]:
        return [
            e["name"].rstrip("/").rsplit("/", 1)[-1]
            for e in self._ls(self.root)
            if e.get("type") == "directory"
        ]

    def list_files(self, folder: str) -> list[str]:
        return [
            e["name"].rsplit("/", 1)[-1]
            for e in self._ls(self._path(folder))
            if e.get("type") == "file"
        ]

    def begin(self, final: str) -> str:
        # Writing in place: an earlier copy of this step is withdrawn (its manifest first, as
        # in delete()) and removed, so that until our manifest lands the folder is uncommitted
        # rather than mixed, and no file of the old copy lingers next to the new manifest.
        self.delete(final)
        self.fs.makedirs(self._path(final), exist_ok=True)
        return final

    def open_write(self, folder: str, name: str) -> IO[bytes]:
        handle: IO[bytes] = self.fs.open(self._path(folder, name), "wb")
        return handle

    def close_durably(self, handle: IO[bytes]) -> None:
        handle.close()

    def commit(self, folder: str, final: str) -> None:
        self._check_writer()
        if folder != final:
            raise AssertionError(f"an fsspec store writes in place, got {folder!r} for {final!r}")

    def open_read(self, folder: str, name: str) -> IO[bytes]:
        path = self._path(folder, name)
        # s3fs takes a file's size and ETag from a cached listing of its folder: after another
        # writer replaced the file, that would read too few bytes or fail as "expired".
        self.fs.invalidate_cache(path)
        handle: IO[bytes] = self.fs.open(path, "rb")
        return handle

    def delete(self, folder: str) -> None:
        # The manifest goes first: from then on the folder is not a checkpoint, whatever is
        # left of it if we are interrupted.
        self._check_writer()
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self._path(folder, MANIFEST_NAME))
        self.discard(folder)

    def discard(self, folder: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(self._path(folder), recursive=True)

    def recover(self, current: str) -> list[str]:
        # Step folders without a manifest are writes that never committed.
        from nbresume.checkpoint.format import parse_step_dirname

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

    def read_small(self, name: str) -> bytes | None:
        path = self._path(name)
        self.fs.invalidate_cache(path)
        try:
            data: bytes = self.fs.cat_file(path, start=0, end=SMALL_FILE_LIMIT)
        except FileNotFoundError:
            return None
        return data

    def create_small(self, name: str, data: bytes) -> bool:
        # No atomic create-if-absent across fsspec backends: between this look and the write
        # another process may create the file too, and the last write wins. Callers that need
        # to be the only creator read the file back after a pause (see the writer lease).
        if self.read_small(name) is not None:
            return False
        self.replace_small(name, data)
        return True

    def replace_small(self, name: str, data: bytes) -> None:
        if self.root:
            self.fs.makedirs(self.root, exist_ok=True)
        self.fs.pipe_file(self._path(name), data)

    def remove_small(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self._path(name))


#: Functions that may claim a local folder for a store of their own (importing
#: :mod:`nbresume.platforms.drive` registers one for folders on Google Drive's mount): the
#: first that returns a store gets the folder, else it is a plain :class:`LocalStore`.
LOCAL_STORE_HOOKS: list[Callable[[Path], Store | None]] = []


def open_store(
    location: str | os.PathLike[str], *, storage_options: Mapping[str, Any] | None = None
) -> Store:
    """The store for a local path, a ``file://`` URL, or any other fsspec URL.

    ``storage_options`` are passed to the fsspec file system of a URL, for example
    ``{"endpoint_url": ..., "key": ..., "secret": ...}`` for ``s3://``.
    """
    text = check_location(location)
    local = "://" not in text or text.split("://", 1)[0] in ("file", "local")
    if local and storage_options:
        raise UsageError(
            f"storage_options apply to fsspec URLs such as s3://, but {text} is a local folder",
            where=text,
            fix="drop storage_options, or give a URL of the store they are meant for",
        )
    if local:
        path = text.split("://", 1)[1] if "://" in text else text
        _register_platform_hooks(Path(path).expanduser())
        for hook in LOCAL_STORE_HOOKS:
            claimed = hook(Path(path).expanduser())
            if claimed is not None:
                return claimed
        return LocalStore(path)
    try:
        return FsspecStore(text, storage_options=storage_options)
    except ImportError as exc:
        module = exc.name or _protocol_module(text)
        extra = ' (or pip install "nbresume[s3]")' if module == "s3fs" else ""
        raise UsageError(
            f"the file system of {text} is not installed: {exc}",
            where=text,
            fix=f"pip install {module}{extra}" if module else "install fsspec's package for it",
        ) from None


def check_location(location: object, call: str = "Checkpointer", argument: str = "dir") -> str:
    """``location`` as a str: a local folder or an fsspec URL of a known scheme; anything
    else (``None``, ``""``, a number, ``"nosuchscheme://x"``) raises ArgumentError."""
    from nbresume.checkpoint.arguments import kind, refused

    fix = (
        f'{argument}="runs/exp1" (a folder, created when needed), a pathlib.Path, or a URL '
        f'such as {argument}="s3://bucket/exp1"'
    )
    if location is None:
        raise refused(call, argument, location, "a folder is needed for the checkpoints", fix)
    if not isinstance(location, (str, os.PathLike)):
        raise refused(call, argument, location, f"{kind(location)} is not a folder", fix)
    text = os.fspath(location)
    if not isinstance(text, str):
        raise refused(call, argument, location, "a path of bytes is not taken", fix)
    if not text.strip():
        # Path("") is the current folder: retention would then delete checkpoints there.
        raise refused(call, argument, location, "an empty path names no folder", fix)
    if "://" in text:
        import fsspec

        known = set(fsspec.available_protocols())
        for part in text.split("::"):
            scheme = part.split("://", 1)[0] if "://" in part else ""
            if scheme and scheme not in known:
                raise refused(
                    call,
                    argument,
                    location,
                    f"{scheme}:// is not a URL scheme fsspec knows",
                    f"use a local folder, or one of fsspec's schemes ({_some_schemes(known)})",
                )
    return text


def _some_schemes(known: set[str]) -> str:
    common = ["file", "memory", "s3", "gs", "az", "hf", "sftp", "http"]
    return ", ".join(f"{name}://" for name in common if name in known) + ", ..."


def _protocol_module(url: str) -> str:
    """The module that implements the scheme of ``url`` (``"s3fs"`` for ``s3://``), or ``""``."""
    from fsspec.registry import known_implementations

    scheme = url.split("::", 1)[0].split("://", 1)[0]
    entry = known_implementations.get(scheme, {})
    return str(entry.get("class", "")).split(".", 1)[0]


def _register_platform_hooks(path: Path) -> None:
    """A folder on Google Drive's mount gets Drive's own store (a checkpoint there is saved
    only once Drive confirms it), even when the script never called ``nbresume.init``."""
    from nbresume import knobs

    mount = os.path.realpath(knobs.drive_mount()).rstrip("/") + "/"
    if os.path.realpath(path).startswith(mount):
        import nbresume.platforms.drive  # noqa: F401 - importing it registers its hook


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
