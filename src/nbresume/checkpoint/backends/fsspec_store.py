"""The fsspec backend: S3, GCS, Azure, ``memory://`` and any other fsspec file system.

Protocol (:class:`~nbresume.checkpoint.backends.base.Backend`): object stores have neither an
atomic rename nor fsync, so a checkpoint is written in place and its manifest, written last, is
the commit; a folder without a manifest is not a checkpoint, and deleting removes the manifest
first. Creating a small file is not atomic across processes (the writer lease reads it back).
"""

from __future__ import annotations

import contextlib
import errno
from collections.abc import Mapping
from typing import IO, Any

from nbresume.checkpoint.backends.base import SMALL_FILE_LIMIT, Backend, file_kind
from nbresume.checkpoint.format import (
    MANIFEST_NAME,
    Manifest,
)
from nbresume.errors import StorageError


class FsspecStore(Backend):
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

    @classmethod
    def from_location(
        cls, location: str, storage_options: Mapping[str, Any] | None = None
    ) -> FsspecStore:
        return cls(location, storage_options=storage_options)

    @property
    def location(self) -> str:
        return self.url

    def _path(self, *names: str) -> str:
        # An empty root (a bucket-less URL, a wrapped file system) must not add a leading "/".
        return "/".join(part for part in (self.root, *names) if part)

    def _special(self, path: str) -> str:
        """What ``path`` is when the file system can tell without opening it (SFTP) and it is
        not a regular file (``"a named pipe (FIFO)"``, ...); ``""`` otherwise. An SFTP server
        that opens a FIFO waits for a writer, and the reader with it, forever."""
        lstat = getattr(getattr(self.fs, "ftp", None), "lstat", None)  # paramiko's SFTPClient
        if lstat is None:
            return ""
        try:
            mode = lstat(path).st_mode
        except OSError:
            return ""  # missing, or not to be looked at: the open says so itself
        return file_kind(mode) if mode is not None else ""

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
        # One listing says whether there is one: removing what is not there costs an object
        # store several requests (s3fs looks for the folder, then for a file of that name).
        if self._ls(self._path(final)):
            self.delete(final)
        self.fs.makedirs(self._path(final), exist_ok=True)
        return final

    def open_write(self, folder: str, name: str) -> IO[bytes]:
        handle: IO[bytes] = self.fs.open(self._path(folder, name), "wb")
        return handle

    def confirm(self, folder: str, manifest: Manifest) -> tuple[bool, str]:
        """Whether the store's own listing of ``folder`` shows every file of the manifest with
        the manifest's size (some stores list late: asked again until they do)."""
        path = self._path(folder)
        self.fs.invalidate_cache(path)
        try:
            listing = self.fs.ls(path, detail=True)
        except FileNotFoundError:
            listing = []
        sizes = {str(e["name"]).rstrip("/").rsplit("/", 1)[-1]: e.get("size") for e in listing}
        missing = [n for n in [*manifest.files, MANIFEST_NAME] if n not in sizes]
        wrong = [n for n, entry in manifest.files.items() if n in sizes and sizes[n] != entry.size]
        if missing or wrong:
            problems = [f"not listed: {', '.join(missing)}"] if missing else []
            problems += [f"another size: {', '.join(wrong)}"] if wrong else []
            return False, "the store's listing " + "; ".join(problems)
        count = len(manifest.files)
        return (
            True,
            f"the store lists all {count} files and the manifest, with the manifest's sizes",
        )

    def close_durably(self, handle: IO[bytes]) -> None:
        handle.close()

    def commit(self, folder: str, final: str) -> None:
        self._check_writer()
        if folder != final:
            raise AssertionError(f"an fsspec store writes in place, got {folder!r} for {final!r}")

    def open_read(self, folder: str, name: str) -> IO[bytes]:
        path = self._path(folder, name)
        kind = self._special(path)
        if kind:
            raise OSError(errno.EINVAL, f"not a regular file but {kind}", self.child(folder, name))
        # s3fs takes a file's size and ETag from a cached listing of its folder: after another
        # writer replaced the file, that would read too few bytes or fail as "expired".
        self.fs.invalidate_cache(path)
        handle: IO[bytes] = self.fs.open(path, "rb")
        return handle

    def read_bytes(self, folder: str, name: str, *, limit: int | None = None) -> bytearray:
        """A whole file of at most ``limit`` bytes (a manifest) in one request: a ranged read
        of ``limit + 1`` bytes. Opening it first asks for its size (on S3 a HEAD before the
        GET), which doubles the round trips of every listing, load and verification."""
        path = self._path(folder, name)
        if limit is None or self._special(path):
            return super().read_bytes(folder, name, limit=limit)
        self.fs.invalidate_cache(path)  # as in open_read: another writer may have replaced it
        try:
            data: bytes = self.fs.cat_file(path, start=0, end=limit + 1)
        except FileNotFoundError:
            raise
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            # S3 refuses a range of an empty object (416, which s3fs raises as EINVAL).
            return super().read_bytes(folder, name, limit=limit)
        return bytearray(data)

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
        return self._discard_uncommitted(current)

    def read_small(self, name: str) -> bytes | None:
        path = self._path(name)
        self.fs.invalidate_cache(path)
        kind = self._special(path)
        if kind:
            move = f"mv {path} SOMEWHERE" if kind == "a folder" else f"rm {path}"
            raise StorageError(
                f"{self.child(name)} is {kind}, not a file: nbresume keeps its writer lease in "
                "a small file of its own under this name",
                where=self.child(name),
                fix=f"on the machine that holds the folder, {move}; nbresume makes the file "
                "itself when it writes here",
            )
        try:
            data: bytes = self.fs.cat_file(path, start=0, end=SMALL_FILE_LIMIT)
        except FileNotFoundError:
            if self.fs.isdir(path):
                # Writing the file there would fail, or hide the objects under that name.
                raise StorageError(
                    f"{self.child(name)} is a folder, not a file: nbresume keeps its writer "
                    "lease in a small file of its own under this name",
                    where=self.child(name),
                    fix="move the objects under that name elsewhere; nbresume makes the file "
                    "itself when it writes here",
                ) from None
            return None
        return data

    def replace_small(self, name: str, data: bytes) -> None:
        if self.root:
            self.fs.makedirs(self.root, exist_ok=True)
        self.fs.pipe_file(self._path(name), data)

    def remove_small(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self._path(name))
