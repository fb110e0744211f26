"""A checkpoint being written: the one way the package commits a checkpoint.

The lifecycle (:meth:`CheckpointStore.begin` starts it; every commit of the package, the
Checkpointer's, the sharded ones and :meth:`CheckpointStore.save` included, goes through it):

1. ``begin(step)``: clean up after a killed writer, check free space when the size is
   known, and create the pending folder: on a POSIX folder a hidden temporary sibling
   ``.nbresume-tmp-<step>-...`` that no reader takes; on an object store the step's folder
   itself, written in place after the manifest of any earlier copy was withdrawn.
2. Files go in, each durable (fsync) and hashed before it counts: :meth:`write_tensors`,
   :meth:`write_json` and :meth:`write_files` write bytes from memory (those bytes are kept
   and compared on read-back instead of being hashed again); :meth:`add_file` copies a file
   another library wrote; :meth:`adopt` takes in place the files another library wrote into
   the pending folder (or moves them there from a folder beside it); :meth:`add_entries`
   records files that other processes (the ranks of a sharded save) wrote into it.
3. :meth:`commit`: ``manifest.json`` is written last and is the commit marker; on POSIX the
   files' fsyncs, started as each file was written, are waited for, then the folder is
   fsynced, renamed into place and its parent fsynced. The checkpoint is then
   checked as the store has it (on a local device's file system the manifest and each file's
   size; elsewhere every byte read back and compared), and only then returned; retention
   applies after that.
4. :meth:`discard` (or any exception inside a ``with`` block, or any failure in 2-3) removes
   the pending folder: nothing a reader takes is left, and every earlier checkpoint is intact.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import math
import os
import shutil
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol

from nbresume.checkpoint.backends import READ_CHUNK, Backend
from nbresume.checkpoint.format import (
    MANIFEST_NAME,
    MAX_JSON_BYTES,
    FileEntry,
    Manifest,
    is_valid_file_name,
    step_dirname,
    tensorfile,
)
from nbresume.checkpoint.store.hashing import (
    Digests,
    DurableCloser,
    Streamed,
    default_hash,
    write_files,
)
from nbresume.checkpoint.store.info import CheckpointInfo
from nbresume.checkpoint.store.reading import verify_folder
from nbresume.checkpoint.units import format_bytes
from nbresume.checkpoint.version import __version__
from nbresume.errors import (
    CheckpointError,
    CorruptCheckpointError,
    StorageError,
    StorageFullError,
    UsageError,
)


class Owner(Protocol):
    """What a pending checkpoint uses of the store that started it
    (:class:`~nbresume.checkpoint.store.CheckpointStore`)."""

    backend: Backend
    #: Whether manifests record MD5s too.
    md5: bool
    #: The hash of the store's choice (``None``: the default).
    hash: str | None
    check_space: bool

    @property
    def keep(self) -> int | None: ...

    @property
    def location(self) -> str: ...


log = logging.getLogger("nbresume")

_NO_SPACE = {errno.ENOSPC, errno.EDQUOT}
#: Slack on top of the exact checkpoint size: the manifest and file system metadata.
SPACE_SLACK = 1 << 20

#: A file to write from memory: its name and the chunks of its bytes (or, :class:`Streamed`,
#: their size and how to make them piece by piece).
Encoded = tuple[str, Sequence[bytes | memoryview] | Streamed]


class PendingCheckpoint:
    """The checkpoint of ``step`` while it is written; see the module's protocol.

    Not made directly: :meth:`CheckpointStore.begin` starts one, :meth:`CheckpointStore.join`
    gives another process a handle on one that was started (it writes, never commits).
    """

    def __init__(
        self,
        owner: Owner,
        step: int,
        folder: str,
        *,
        coordinator: bool = True,
        retain: Callable[[], None] | None = None,
    ) -> None:
        self.step = step
        #: The name of the pending folder in the store (hidden until the commit on POSIX).
        self.folder = folder
        self._owner = owner
        self._backend: Backend = owner.backend
        #: The store's retention, run after the commit (the coordinator's only).
        self._retention = retain
        self._coordinator = coordinator
        self._entries: dict[str, FileEntry] = {}
        self._written: dict[str, Sequence[bytes | memoryview]] = {}
        #: The hash of every file written here (the store's choice, else the default).
        self.hash = default_hash(owner.hash)
        self._state = "open"
        #: Where a store shows the checkpoint only once the commit renames its folder into
        #: place (POSIX), files are made durable in the background while the next ones and
        #: the manifest are written; the commit waits for all of them before the rename.
        self._closer = (
            DurableCloser(self._backend, threaded=True)
            if coordinator and self._backend.atomic_rename
            else None
        )
        #: The committed manifest's bytes, once :meth:`commit` returned.
        self.manifest_bytes = b""

    @classmethod
    def start(
        cls,
        owner: Owner,
        step: int,
        *,
        size: int | None = None,
        files: int = 0,
        retain: Callable[[], None] | None = None,
    ) -> PendingCheckpoint:
        """Clean up after a killed writer, check the space ``size`` bytes in ``files`` files
        need (when given), and create the pending folder."""
        needed, inodes = (size or 0) + SPACE_SLACK, files + 2
        try:
            owner.backend.recover(current="")
            if owner.check_space and size is not None:
                check_space(owner, needed, inodes)
            folder = owner.backend.begin(step_dirname(step))
        except StorageError:
            raise  # the store's own error already says where and what to do
        except OSError as exc:
            # Cleaning up, and creating the folder, fail too on a full or failing disk.
            raise storage_error(owner, exc, needed, inodes) from exc
        return cls(owner, step, folder, retain=retain)

    def __repr__(self) -> str:
        return f"PendingCheckpoint(step={self.step}, {self.location!r}, {self._state})"

    @property
    def location(self) -> str:
        """Where the pending folder is (a path or a URL)."""
        return self._backend.child(self.folder)

    @property
    def path(self) -> Path | None:
        """The pending folder as a local path another library may write into (``None`` on
        an object store: write to :attr:`location` with its file system instead)."""
        return self._backend.local_path(self.folder)

    @property
    def entries(self) -> Mapping[str, FileEntry]:
        """The files recorded so far, by name: what the manifest will list."""
        return dict(self._entries)

    # -- files in ----------------------------------------------------------------------

    def write_tensors(self, stem: str, tensors: Mapping[str, Any]) -> FileEntry:
        """Write ``tensors`` (a flat ``{name: tensor}`` dict) as ``<stem>.safetensors``."""
        return self.write_files(encode({stem: tensors}, {}))[file_name(stem, "safetensors")]

    def write_json(self, stem: str, value: Any) -> FileEntry:
        """Write a JSON-serialisable ``value`` as ``<stem>.json``."""
        return self.write_files(encode({}, {stem: value}))[file_name(stem, "json")]

    def write_files(self, files: Sequence[Encoded], *, keep: bool = True) -> dict[str, FileEntry]:
        """Write files from bytes in memory, each durable and hashed; return their entries.

        With ``keep`` the bytes are kept (they must not change until the commit) and compared
        with what the store reads back after the commit; without, they may go at once, and
        the file is hashed again after the commit instead (always for a :class:`Streamed`
        file, whose pieces are gone once written)."""
        self._check_open()
        for name, chunks in files:
            self._check_new(name)
            check_json_size(name, size_of([(name, chunks)]))
        with self._failing(size_of(files), len(files)):
            entries = write_files(
                self._backend,
                self.folder,
                files,
                md5=self._owner.md5,
                algorithm=self.hash,
                closer=self._closer,
            )
        self._entries.update(entries)
        if keep:
            self._written.update((n, c) for n, c in files if not isinstance(c, Streamed))
        return entries

    def add_file(self, name: str, source: str | os.PathLike[str]) -> FileEntry:
        """Copy the local file ``source`` (written by another library) in as ``name``."""
        self._check_open()
        self._check_new(name)
        path = Path(source)
        with self._failing(_file_size(path), 1):
            digests = Digests(md5=self._owner.md5, threaded=False, algorithm=self.hash)
            size = 0
            with open(path, "rb") as src:
                handle = self._backend.open_write(self.folder, name)
                try:
                    while chunk := src.read(READ_CHUNK):
                        digests.update(chunk)
                        handle.write(chunk)
                        size += len(chunk)
                except BaseException:
                    handle.close()
                    raise
                self._backend.close_durably(handle)
            digest, md5 = digests.result()
        entry = FileEntry(size, digest, md5, self.hash)
        self._entries[name] = entry
        return entry

    def adopt(self, source: str | os.PathLike[str] | None = None) -> dict[str, FileEntry]:
        """Take in the files another library wrote; return their entries.

        Without ``source``: every file in the pending folder not recorded yet (the library
        wrote into :attr:`path`, or on an object store under :attr:`location`). With
        ``source``, a local folder: its files are first moved into the pending folder
        (renamed: on the same file system nothing is copied), and the emptied folder is
        removed. Each file is made durable (fsync on POSIX; on an object store a closed file
        already is) and hashed as it is in the store now, so the manifest names exactly the
        bytes there. Names must be checkpoint file names (``*.safetensors`` or ``*.json``,
        no subfolders): anything else is refused and nothing is taken.
        """
        self._check_open()
        if source is not None:
            self._move_in(Path(source))
        elif self.path is not None:
            _plain_files(self.path)  # a folder or a link in there would not be in the manifest
        names = [n for n in sorted(self._backend.list_files(self.folder)) if n not in self._entries]
        for name in names:
            self._check_new(name)
        with self._failing(0, len(names)):
            adopted = {name: self._hash_in_place(name) for name in names}
        self._entries.update(adopted)
        return adopted

    def add_entries(self, entries: Mapping[str, FileEntry]) -> None:
        """Record files that other processes wrote into this pending folder, each already
        durable and hashed (the ranks of a sharded save). A file recorded already must have
        the same entry."""
        self._check_open()
        for name, entry in entries.items():
            if entry.algorithm != self.hash:
                raise UsageError(
                    f"{name} is hashed with {entry.algorithm}, this checkpoint with {self.hash}",
                    fix="every process of a save must use the same hash (NBRESUME_HASH)",
                )
            if self._entries.get(name, entry) != entry:
                raise UsageError(f"{name} was recorded twice with different contents")
            if name not in self._entries:
                self._check_new(name)
                self._entries[name] = entry

    # -- the end ------------------------------------------------------------------------

    def commit(
        self,
        metrics: Mapping[str, float] | None = None,
        *,
        on_committed: Callable[[CheckpointInfo], None] | None = None,
    ) -> CheckpointInfo:
        """Write the manifest, commit, read back and verify, then apply retention.

        ``on_committed`` is called between the commit and the verification. Returns only
        after the checkpoint as the store has it matched its manifest; a checkpoint that
        does not is deleted and CorruptCheckpointError raised.
        """
        self._check_open()
        if not self._coordinator:
            raise UsageError("only the process that began a pending checkpoint commits it")
        if not self._entries:
            self.discard()
            raise CheckpointError("nothing to save: pass tensors= or data=", where=self.location)
        final = step_dirname(self.step)
        manifest = Manifest(
            step=self.step,
            files=dict(self._entries),
            created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
            metrics=_finite_metrics(metrics or {}),
            writer=_writer_tag(),
        )
        manifest_bytes = manifest.to_bytes()
        with self._failing(manifest.payload_bytes, len(self._entries), counted=True):
            manifest_file = [(MANIFEST_NAME, [manifest_bytes])]
            write_files(self._backend, self.folder, manifest_file, md5=False, closer=self._closer)
            if self._closer is not None:
                self._closer.finish()  # every file durable before the rename makes them visible
            self._backend.commit(self.folder, final)
        self._state = "committed"
        info = CheckpointInfo(self.step, final, self._backend.child(final), manifest)
        if on_committed is not None:
            on_committed(info)
        # Where the store says reading back proves nothing a write-time hash does not (the
        # page cache of a local disk), sizes and the manifest are checked, not the bytes.
        result = verify_folder(
            self._backend,
            final,
            expected_manifest=manifest_bytes,
            written=self._written,
            read_back=getattr(self._backend, "readback_after_save", True),
        )
        self._written = {}
        if not result.ok:
            # Committed but not what we wrote: never leave a known-bad checkpoint to be found.
            self._backend.delete(final)
            raise CorruptCheckpointError(
                f"checkpoint of step {self.step} did not verify after writing: {result.problem}",
                where=info.location,
                fix="the storage returned different bytes than were written; check the disk or "
                "mount, then save again",
            )
        self.manifest_bytes = manifest_bytes
        self._retain()
        return info

    def discard(self) -> None:
        """Remove the pending folder (on the coordinator); nothing a reader takes is left."""
        if self._closer is not None:
            self._closer.abandon()  # every file closed before its folder goes
        if self._state == "open" and self._coordinator:
            self._backend.discard(self.folder)
        if self._state == "open":
            self._state = "discarded"
        self._written = {}

    def __enter__(self) -> PendingCheckpoint:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        # An exception, or a block that ended without committing, discards.
        if self._state == "open":
            self.discard()

    # -- helpers ------------------------------------------------------------------------

    def _retain(self) -> None:
        if self._retention is None:
            return
        try:
            self._retention()  # the removal of the files goes on after
        except StorageError:
            raise  # the store's own error (a network store refused): said as it is
        except OSError as exc:
            # The checkpoint is saved and verified; failing the save now would report a saved
            # checkpoint as lost. The old one stays until the next save's retention.
            warnings.warn(
                f"nbresume: step {self.step} is saved, but retention could not delete an older "
                f"checkpoint ({exc}); it is kept for now and retried on the next save",
                RuntimeWarning,
                stacklevel=4,
            )

    def _check_open(self) -> None:
        if self._state != "open":
            raise UsageError(
                f"the pending checkpoint of step {self.step} is already {self._state}",
                fix="begin a new one with store.begin(step)",
            )

    def _check_new(self, name: str) -> None:
        if not is_valid_file_name(name):
            raise CheckpointError(
                f"{name!r} cannot name a checkpoint file",
                where=self.location,
                fix="use a *.safetensors or *.json name of letters, digits, '_', '-' and '.', "
                "not starting with '.'",
            )
        if name in self._entries:
            raise UsageError(f"{name} is already in the checkpoint of step {self.step}")

    @contextlib.contextmanager
    def _failing(self, size: int, files: int, *, counted: bool = False) -> Iterator[None]:
        """A failure inside discards the pending folder; an OSError becomes the store's error,
        naming the space the checkpoint needs (``size`` more bytes in ``files`` more files,
        or, ``counted``, exactly those)."""
        recorded = 0 if counted else sum(e.size for e in self._entries.values())
        needed = recorded + size + SPACE_SLACK
        inodes = files + (0 if counted else len(self._entries)) + 2
        try:
            yield
        except StorageError:
            self.discard()
            raise  # the store's own error already says where and what to do
        except OSError as exc:
            self.discard()
            raise storage_error(self._owner, exc, needed, inodes) from exc
        except BaseException:
            self.discard()
            raise

    def _move_in(self, source: Path) -> None:
        target = self.path
        if target is None:
            raise UsageError(
                "adopt(source) moves files between local folders",
                fix="on an object store, write the files under pending.location and call "
                "adopt(), or copy each one in with add_file()",
            )
        names = _plain_files(source)
        for name in names:
            self._check_new(name)
        for name in names:
            try:
                os.rename(source / name, target / name)
            except OSError as exc:
                if exc.errno != errno.EXDEV:
                    raise
                shutil.copyfile(source / name, target / name)  # another file system
                os.unlink(source / name)
        source.rmdir()

    def _hash_in_place(self, name: str) -> FileEntry:
        # Written by another library: made durable before it counts.
        self._backend.make_durable(self.folder, name)
        size = 0
        with self._backend.open_read(self.folder, name) as handle:
            digests = Digests(md5=self._owner.md5, threaded=False, algorithm=self.hash)
            while chunk := handle.read(READ_CHUNK):
                digests.update(chunk)
                size += len(chunk)
            digest, md5 = digests.result()
        return FileEntry(size, digest, md5, self.hash)


def encode(
    tensors: Mapping[str, Mapping[str, Any]],
    data: Mapping[str, Any],
    *,
    stage: Callable[[Any], Iterable[memoryview]] | None = None,
) -> list[Encoded]:
    """The files of ``tensors=`` (one safetensors file per stem) and ``data=`` (one JSON file
    per stem), encoded in memory; with ``stage``, a file that holds tensors outside host
    memory is :class:`Streamed` through it (see :func:`tensorfile.encode`)."""
    files: list[Encoded] = []
    for stem, group in tensors.items():
        encoded = tensorfile.encode(group, stage=stage)
        name = file_name(stem, "safetensors")
        if encoded.staged:
            files.append((name, Streamed(encoded.size, encoded.chunks)))
        else:
            files.append((name, list(encoded.chunks())))
    for stem, value in data.items():
        try:
            # Insertion order is kept: a restored dict must iterate as the saved one did.
            text = json.dumps(value, indent=1).encode()
        except (TypeError, ValueError) as exc:
            raise CheckpointError(
                f"the value saved as {stem!r} cannot be written as JSON: {exc}",
                where=stem,
                fix="save tensors in `tensors=` and keep `data=` to numbers, strings, "
                "lists and dicts",
            ) from None
        files.append((file_name(stem, "json"), [text]))
    return files


def check_json_size(name: str, size: int) -> None:
    """Refuse to write a JSON file larger than a reader takes (:data:`MAX_JSON_BYTES`): a
    checkpoint that is saved must load."""
    if name.endswith(".json") and size > MAX_JSON_BYTES:
        raise CheckpointError(
            f"{name} would be {size} bytes, more than the {MAX_JSON_BYTES} a checkpoint's JSON "
            "file may have",
            where=name,
            fix="save large values as tensors or NumPy arrays (they go into safetensors files) "
            "and keep plain values small",
        )


def size_of(files: Iterable[Encoded]) -> int:
    """The bytes of encoded files."""
    return sum(
        chunks.size if isinstance(chunks, Streamed) else sum(memoryview(c).nbytes for c in chunks)
        for _, chunks in files
    )


def file_name(stem: str, kind: str) -> str:
    name = f"{stem}.{kind}"
    if not is_valid_file_name(name):
        raise CheckpointError(
            f"{stem!r} cannot name a checkpoint file",
            fix="use letters, digits, '_', '-' and '.', not starting with '.'",
        )
    return name


def _plain_files(folder: Path) -> list[str]:
    """The names in ``folder``, all regular files (a checkpoint holds no folders or links)."""
    names = sorted(p.name for p in folder.iterdir())
    for name in names:
        if not (folder / name).is_file() or (folder / name).is_symlink():
            raise UsageError(
                f"{folder / name} is not a regular file",
                where=str(folder / name),
                fix="a checkpoint holds files only, directly in its folder",
            )
    return names


def _file_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def check_space(owner: Owner, needed: int, inodes: int) -> None:
    """Refuse a checkpoint that would not fit, with both numbers and the fix."""
    free = owner.backend.free_space()
    if free.bytes is not None and free.bytes < needed:
        raise StorageFullError(
            f"{owner.location} has {format_bytes(free.bytes)} free, "
            f"the next checkpoint needs {format_bytes(needed)}",
            where=owner.location,
            fix=_space_fix(owner),
            needed=needed,
            free=free.bytes,
        )
    if free.inodes is not None and free.inodes < inodes:
        raise StorageFullError(
            f"{owner.location} has {free.inodes} free inodes, the next checkpoint needs {inodes}",
            where=owner.location,
            fix="delete small files there (caches, logs) or choose another dir=",
            needed=needed,
            free=free.bytes,
        )


def _space_fix(owner: Owner) -> str:
    keep = "" if owner.keep is None else f" (now {owner.keep})"
    return (
        f"free space there, lower keep={keep} so fewer checkpoints are kept, "
        "or choose a dir= on a larger disk"
    )


def storage_error(owner: Owner, exc: OSError, needed: int, inodes: int) -> CheckpointError:
    """The error to raise for an OSError while a checkpoint was written."""
    if exc.errno in _NO_SPACE:
        space = owner.backend.free_space()
        free = space.bytes
        seen = f"has {format_bytes(free)} free" if free is not None else "is full"
        fix = _space_fix(owner)
        if free is not None and free >= needed:
            # Bytes are left, so what ran out is inodes (the number of files) or a quota.
            left = "no" if space.inodes is None else str(space.inodes)
            seen += f" but {left} free inodes (files) or a full quota"
            needed_text = f"{inodes} inodes and {format_bytes(needed)}"
            fix = "delete small files there (caches, logs), raise the quota, or choose another dir="
        else:
            needed_text = format_bytes(needed)
        return StorageFullError(
            f"{owner.location} ran out of space while writing a checkpoint: it {seen}, "
            f"the checkpoint needs {needed_text}; the partial checkpoint was removed "
            "and earlier ones are intact",
            where=owner.location,
            fix=fix,
            needed=needed,
            free=free,
        )
    return StorageError(
        f"writing a checkpoint failed: {exc}",
        where=owner.location,
        fix="check that the folder is writable and its mount is alive, then save again",
    )


def _finite_metrics(metrics: Mapping[str, float]) -> dict[str, float]:
    out = {}
    for key, value in metrics.items():
        number = float(value)
        if math.isfinite(number):
            out[str(key)] = number
        else:
            log.warning("nbresume: metric %r is %s and is not recorded", key, number)
    return out


def _writer_tag() -> str:
    return f"nbresume {__version__}"


__all__ = ["SPACE_SLACK", "PendingCheckpoint", "encode", "file_name", "size_of"]
