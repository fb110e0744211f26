"""The verified checkpoint store: write, commit, verify, keep, load.

The commit protocol (the code below does exactly this, in this order):

1. Clean up after a killed writer: hidden temporary folders are removed; an older copy of a
   step that was being replaced is put back if the new copy never landed.
2. Check free bytes and inodes against the exact size of the checkpoint (every byte of it is
   known before the first write). Refuse with both numbers and the fix when it does not fit.
3. Write every payload file from the bytes in memory while threads of their own hash the same
   bytes (SHA-256, and MD5 for stores that compare MD5s, such as Google Drive), and make each
   file durable. The bytes are not changed during a save: a synchronous save holds the
   training thread, an asynchronous one writes host copies that nothing else touches.
   On a POSIX folder this happens in a temporary sibling folder ``.nbresume-tmp-<step>-...``;
   on an object store, in place, after the manifest of any earlier copy was withdrawn.
4. Write ``manifest.json`` last: every file with its size and hash. It is the commit marker.
5. POSIX only: fsync the temporary folder, rename it into place, fsync the parent folder.
6. Verify: read the manifest back and compare it with the one written, then read every file
   back from the store and compare it byte for byte with the bytes in memory that were hashed
   into the manifest (this proves what re-hashing would, at the speed of memory). Only now
   is the checkpoint reported as saved. ``verify()`` and ``load()``, which have no copy in
   memory, re-hash every byte.
7. Retention: delete checkpoints beyond the policy, oldest first, each withdrawn from view in
   one step (a rename on POSIX, the manifest first on object stores), so a kill at any moment
   leaves only whole checkpoints.

Any failure in 3-5 removes the partial folder and leaves every earlier checkpoint untouched.
One writer per folder at a time is assumed (a second writer's leftovers would be cleaned).
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import hashlib
import itertools
import json
import logging
import math
import mmap
import os
import queue
import threading
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import IO, Any

from nbresume.checkpoint import state as state_document
from nbresume.checkpoint import tensorfile
from nbresume.checkpoint.arguments import (
    check_bool,
    check_keep,
    check_keep_best,
    check_storage_options,
)
from nbresume.checkpoint.format import (
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    FileEntry,
    Manifest,
    is_valid_file_name,
    parse_manifest,
    parse_step_dirname,
    step_dirname,
)
from nbresume.checkpoint.storage import (
    READ_CHUNK,
    LocalStore,
    Store,
    check_location,
    handle_size,
    open_store,
    read_into,
    replaced_step,
)
from nbresume.errors import (
    CheckpointError,
    CorruptCheckpointError,
    NoCheckpointError,
    StorageError,
    StorageFullError,
)

log = logging.getLogger("nbresume")

_NO_SPACE = {errno.ENOSPC, errno.EDQUOT}
#: Slack on top of the exact checkpoint size: the manifest and file system metadata.
SPACE_SLACK = 1 << 20
#: Files smaller than this are hashed in the calling thread: starting a thread costs more.
THREAD_MIN_BYTES = 1 << 20
#: Files from this size on are loaded into memory in huge pages (where the system has them).
_HUGE_PAGE_MIN_BYTES = 2 << 20
#: Buffers kept for comparing pieces of files read back (one per piece size).
_READ_BACK_BUFFERS = 4
#: Largest JSON file of a checkpoint (a sharded checkpoint's metadata is the largest one).
MAX_JSON_BYTES = 256 << 20

Buffer = bytes | bytearray | memoryview


@dataclass(frozen=True)
class CheckpointInfo:
    """A committed checkpoint as its manifest describes it (not yet re-verified)."""

    step: int
    name: str
    location: str
    manifest: Manifest

    @property
    def size(self) -> int:
        return self.manifest.payload_bytes

    @property
    def metrics(self) -> Mapping[str, float]:
        return self.manifest.metrics

    @property
    def created(self) -> str:
        return self.manifest.created


@dataclass(frozen=True)
class VerifyResult:
    """The outcome of checking one checkpoint folder against its manifest."""

    name: str
    step: int
    location: str
    ok: bool
    problem: str = ""
    size: int = 0

    def __str__(self) -> str:
        if self.ok:
            return f"OK    {self.name}  step {self.step}  {format_bytes(self.size)}"
        return f"FAIL  {self.name}  {self.problem}"


@dataclass(frozen=True)
class VerifyReport:
    """Every checkpoint of a folder, checked."""

    location: str
    results: tuple[VerifyResult, ...]
    #: Step folders without a manifest: saves that never committed (on an object store, what
    #: an interrupted write leaves until the next save cleans it). Not checkpoints, not errors.
    uncommitted: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        """True when there is at least one checkpoint and every one verified."""
        return bool(self.results) and all(r.ok for r in self.results)

    @property
    def summary(self) -> str:
        good = sum(r.ok for r in self.results)
        return f"OK {good}/{len(self.results)}, errors {len(self.results) - good}"


@dataclass
class LoadedCheckpoint:
    """A checkpoint read back and verified: its tensors, its JSON documents and its manifest."""

    step: int
    location: str
    manifest: Manifest
    tensors: dict[str, dict[str, Any]] = field(default_factory=dict)
    data: dict[str, Any] = field(default_factory=dict)
    #: Newer checkpoints that failed verification and were passed over, newest first.
    skipped: list[VerifyResult] = field(default_factory=list)
    #: ``state.json`` checked and rebuilt, when it is a Checkpointer's (else ``None``).
    state: state_document.SavedState | None = None


KeepBest = tuple[str, str] | tuple[str, str, int]


class CheckpointStore:
    """A folder (path or fsspec URL) of verified checkpoints.

    Args:
        location: a local path, ``file://``, ``memory://`` or any fsspec URL.
        keep: how many of the newest checkpoints to keep (``None`` keeps all).
        keep_best: ``(metric, "min" | "max"[, count])``: also keep the best ``count``
            (default: ``keep``) checkpoints by that metric.
        md5: also record MD5 hashes (for stores that report MD5s, such as Google Drive).
        check_space: refuse to start a save that would not fit (where free space is known).
        storage_options: options for the fsspec file system of a URL location (credentials,
            ``endpoint_url``, ...), e.g. ``{"endpoint_url": "http://127.0.0.1:9000"}`` for
            an S3-compatible server. Not allowed with a local folder.
    """

    def __init__(
        self,
        location: str | os.PathLike[str] | Store,
        *,
        keep: int | None = 3,
        keep_best: KeepBest | None = None,
        md5: bool = False,
        check_space: bool = True,
        storage_options: Mapping[str, Any] | None = None,
    ) -> None:
        # Every argument is checked before the store is opened.
        call = "CheckpointStore"
        self.keep = check_keep(call, keep)
        self.keep_best = _check_keep_best(keep_best, call)
        md5 = check_bool(call, "md5", md5)
        self.check_space = check_bool(call, "check_space", check_space)
        storage_options = check_storage_options(call, storage_options)
        if isinstance(location, Store):
            self.store = location
        else:
            check_location(location, call, "location")
            self.store = open_store(location, storage_options=storage_options)
        self.md5 = md5 or self.store.reports_md5

    @property
    def location(self) -> str:
        return self.store.location

    def __repr__(self) -> str:
        return f"CheckpointStore({self.location!r}, keep={self.keep})"

    # -- writing -------------------------------------------------------------------------

    def save(
        self,
        step: int,
        *,
        tensors: Mapping[str, Mapping[str, Any]] | None = None,
        data: Mapping[str, Any] | None = None,
        metrics: Mapping[str, float] | None = None,
        on_committed: Callable[[CheckpointInfo], None] | None = None,
    ) -> CheckpointInfo:
        """Write, commit and verify the checkpoint of ``step``, then apply retention.

        ``tensors`` maps a file stem to a flat ``{name: tensor}`` dict (one safetensors file
        each); ``data`` maps a file stem to a JSON-serialisable value (one JSON file each).
        ``on_committed`` is called between the commit and the verification.
        Returns only after the checkpoint was read back and matched its manifest.
        """
        files = self._encode(tensors or {}, data or {})
        final = step_dirname(step)
        needed = sum(size for _, size, _ in files) + SPACE_SLACK
        try:
            self.store.recover(current="")
            if self.check_space:
                self._check_space(needed, len(files) + 2)
            folder = self.store.begin(final)
        except OSError as exc:
            # Cleaning up, and creating the temporary folder, fail too on a full or failing disk.
            raise self._translate(exc, needed, len(files) + 2) from exc
        try:
            entries = self._write_files(folder, [(name, chunks) for name, _, chunks in files])
        except OSError as exc:
            self.store.discard(folder)
            raise self._translate(exc, needed, len(files) + 2) from exc
        except BaseException:
            self.store.discard(folder)
            raise
        info, _ = self._commit(
            step,
            folder,
            entries,
            metrics=metrics,
            on_committed=on_committed,
            written={name: chunks for name, _, chunks in files},
        )
        return info

    def _commit(
        self,
        step: int,
        folder: str,
        entries: Mapping[str, FileEntry],
        *,
        metrics: Mapping[str, float] | None,
        on_committed: Callable[[CheckpointInfo], None] | None,
        written: Mapping[str, Sequence[bytes | memoryview]] | None = None,
    ) -> tuple[CheckpointInfo, bytes]:
        """Write the manifest of ``entries`` (the files already durable in the temporary
        ``folder``), commit the folder as the checkpoint of ``step``, verify it, then apply
        retention. Returns the checkpoint and its manifest's bytes.

        ``written`` holds the bytes of files still in memory: those are compared with what
        the store reads back instead of being hashed again. A failed commit discards
        ``folder``; a checkpoint that does not verify is deleted.
        """
        final = step_dirname(step)
        manifest = Manifest(
            step=step,
            files=dict(entries),
            created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
            metrics=_finite_metrics(metrics or {}),
            writer=_writer_tag(),
        )
        manifest_bytes = manifest.to_bytes()
        try:
            self._write_file(folder, MANIFEST_NAME, [manifest_bytes])
            self.store.commit(folder, final)
        except OSError as exc:
            self.store.discard(folder)
            raise self._translate(
                exc, manifest.payload_bytes + SPACE_SLACK, len(entries) + 2
            ) from exc
        except BaseException:
            self.store.discard(folder)
            raise
        info = CheckpointInfo(step, final, self.store.child(final), manifest)
        if on_committed is not None:
            on_committed(info)
        result = self._verify_folder(final, expected_manifest=manifest_bytes, written=written)
        if not result.ok:
            # Committed but not what we wrote: never leave a known-bad checkpoint to be found.
            self.store.delete(final)
            raise CorruptCheckpointError(
                f"checkpoint of step {step} did not verify after writing: {result.problem}",
                where=info.location,
                fix="the storage returned different bytes than were written; check the disk or "
                "mount, then save again",
            )
        try:
            self.prune(verify_kept=False)
        except OSError as exc:
            # The checkpoint is saved and verified; failing the save now would report a saved
            # checkpoint as lost. The old one stays until the next save's retention.
            warnings.warn(
                f"nbresume: step {step} is saved, but retention could not delete an older "
                f"checkpoint ({exc}); it is kept for now and retried on the next save",
                RuntimeWarning,
                stacklevel=3,
            )
        return info, manifest_bytes

    def _encode(
        self, tensors: Mapping[str, Mapping[str, Any]], data: Mapping[str, Any]
    ) -> list[tuple[str, int, Sequence[bytes | memoryview]]]:
        files: list[tuple[str, int, Sequence[bytes | memoryview]]] = []
        for stem, group in tensors.items():
            encoded = tensorfile.encode(group)
            files.append(
                (self._file_name(stem, "safetensors"), encoded.size, list(encoded.chunks()))
            )
        for stem, value in data.items():
            try:
                # Insertion order is kept: a restored dict must iterate as the saved one did.
                text = json.dumps(value, indent=1).encode()
            except (TypeError, ValueError) as exc:
                raise CheckpointError(
                    f"the value saved as {stem!r} cannot be written as JSON: {exc}",
                    fix="save tensors in `tensors=` and keep `data=` to numbers, strings, "
                    "lists and dicts",
                ) from None
            files.append((self._file_name(stem, "json"), len(text), [text]))
        if not files:
            raise CheckpointError("nothing to save: pass tensors= or data=")
        return files

    @staticmethod
    def _file_name(stem: str, kind: str) -> str:
        name = f"{stem}.{kind}"
        if not is_valid_file_name(name):
            raise CheckpointError(
                f"{stem!r} cannot name a checkpoint file",
                fix="use letters, digits, '_', '-' and '.', not starting with '.'",
            )
        return name

    def _write_file(
        self, folder: str, name: str, chunks: Iterable[bytes | memoryview]
    ) -> FileEntry:
        """Write ``chunks`` to a new file and make it durable; see :meth:`_write_files`."""
        return self._write_files(folder, [(name, chunks)])[name]

    def _write_files(
        self, folder: str, files: Sequence[tuple[str, Iterable[bytes | memoryview]]]
    ) -> dict[str, FileEntry]:
        """Write each file from its chunks and make it durable; return their entries.

        Three things overlap: the files are written one after the other; each file is made
        durable (fsync) in a thread while the next one is written; and every file's hashes
        are computed from the same memory in threads of their own that all start at once.
        Only when every file is durable and hashed does this return.
        """
        started: list[tuple[str, Sequence[bytes | memoryview], int, _Digests]] = []
        closer: _DurableCloser | None = None
        try:
            for name, given in files:
                chunks = given if isinstance(given, Sequence) else list(given)
                size = sum(len(c) if isinstance(c, bytes) else c.nbytes for c in chunks)
                digests = _Digests(md5=self.md5, threaded=size >= THREAD_MIN_BYTES)
                started.append((name, chunks, size, digests))
                for chunk in chunks:
                    digests.update(chunk)
            total = sum(size for _, _, size, _ in started)
            closer = _DurableCloser(
                self.store, threaded=len(files) > 1 and total >= THREAD_MIN_BYTES
            )
            for name, chunks, _, _ in started:
                closer.check()  # an earlier file failed to become durable: stop here
                handle: IO[bytes] = self.store.open_write(folder, name)
                try:
                    for chunk in chunks:
                        handle.write(chunk)
                except BaseException:
                    handle.close()
                    raise
                closer.close(handle)
            closer.finish()
            entries = {}
            for name, _, size, digests in started:
                sha256, md5 = digests.result()
                entries[name] = FileEntry(size=size, sha256=sha256, md5=md5)
            return entries
        finally:
            if closer is not None:
                closer.abandon()  # after a failure: every handle closed before the cleanup
            for *_, digests in started:
                digests.cancel()

    def _check_space(self, needed: int, inodes: int) -> None:
        free = self.store.free_space()
        if free.bytes is not None and free.bytes < needed:
            raise StorageFullError(
                f"{self.location} has {format_bytes(free.bytes)} free, "
                f"the next checkpoint needs {format_bytes(needed)}",
                where=self.location,
                fix=self._space_fix(),
                needed=needed,
                free=free.bytes,
            )
        if free.inodes is not None and free.inodes < inodes:
            raise StorageFullError(
                f"{self.location} has {free.inodes} free inodes, "
                f"the next checkpoint needs {inodes}",
                where=self.location,
                fix="delete small files there (caches, logs) or choose another dir=",
                needed=needed,
                free=free.bytes,
            )

    def _space_fix(self) -> str:
        keep = "" if self.keep is None else f" (now {self.keep})"
        return (
            f"free space there, lower keep={keep} so fewer checkpoints are kept, "
            "or choose a dir= on a larger disk"
        )

    def _translate(self, exc: OSError, needed: int, inodes: int) -> CheckpointError:
        if exc.errno in _NO_SPACE:
            space = self.store.free_space()
            free = space.bytes
            seen = f"has {format_bytes(free)} free" if free is not None else "is full"
            fix = self._space_fix()
            if free is not None and free >= needed:
                # Bytes are left, so what ran out is inodes (the number of files) or a quota.
                left = "no" if space.inodes is None else str(space.inodes)
                seen += f" but {left} free inodes (files) or a full quota"
                needed_text = f"{inodes} inodes and {format_bytes(needed)}"
                fix = (
                    "delete small files there (caches, logs), "
                    "raise the quota, or choose another dir="
                )
            else:
                needed_text = format_bytes(needed)
            return StorageFullError(
                f"{self.location} ran out of space while writing a checkpoint: it {seen}, "
                f"the checkpoint needs {needed_text}; the partial checkpoint was removed "
                "and earlier ones are intact",
                where=self.location,
                fix=fix,
                needed=needed,
                free=free,
            )
        return StorageError(
            f"writing a checkpoint failed: {exc}",
            where=self.location,
            fix="check that the folder is writable and its mount is alive, then save again",
        )

    # -- reading -------------------------------------------------------------------------

    def _checkpoint_folders(self) -> list[tuple[int, str]]:
        """(step, name) of every folder named like a checkpoint, newest first.

        A writer killed while replacing a step can leave the older copy moved aside and no
        folder of the step's name; that copy then stands in for the step (the next writer
        moves it back), so that a checkpoint reported as saved never drops out of view.
        """
        found = []
        stand_ins: dict[int, str] = {}
        for name in self.store.list_folders():
            step = parse_step_dirname(name)
            if step is not None:
                found.append((step, name))
            elif (step := parse_step_dirname(replaced_step(name) or "")) is not None:
                stand_ins.setdefault(step, name)
        present = {step for step, _ in found}
        found += [(step, name) for step, name in stand_ins.items() if step not in present]
        return sorted(found, reverse=True)

    def _read_manifest(self, name: str, step: int) -> Manifest:
        where = self.store.child(name, MANIFEST_NAME)
        try:
            raw = self.store.read_bytes(name, MANIFEST_NAME, limit=MAX_MANIFEST_BYTES)
        except FileNotFoundError:
            raise CorruptCheckpointError(
                "no manifest: the checkpoint was never committed", where=self.store.child(name)
            ) from None
        except OSError as exc:
            if exc.errno == errno.EINVAL:  # a FIFO, a link or a folder: never opened
                raise CorruptCheckpointError(
                    "the manifest is not a regular file (a FIFO, a link or a folder)", where=where
                ) from None
            raise CorruptCheckpointError(f"cannot read the manifest: {exc}", where=where) from None
        return parse_manifest(bytes(raw), where=where, expected_step=step)

    def list(self) -> builtins.list[CheckpointInfo]:
        """Committed checkpoints (a manifest that parses), oldest first. Nothing is hashed."""
        infos = []
        for step, name in reversed(self._checkpoint_folders()):
            try:
                manifest = self._read_manifest(name, step)
            except CorruptCheckpointError:
                continue
            infos.append(CheckpointInfo(step, name, self.store.child(name), manifest))
        return infos

    def broken(self) -> builtins.list[VerifyResult]:
        """Step folders that hold something named ``manifest.json`` that is not a valid
        manifest (one that is not a regular file, or does not parse), oldest first: broken
        checkpoints, which :meth:`list` leaves out. Nothing is hashed."""
        found = []
        for step, name in reversed(self._checkpoint_folders()):
            if not self._has_manifest(name):
                continue
            try:
                self._read_manifest(name, step)
            except CorruptCheckpointError as exc:
                found.append(VerifyResult(name, step, self.store.child(name), False, str(exc)))
        return found

    def latest(self) -> CheckpointInfo | None:
        """The newest committed checkpoint (its files are not re-hashed; see :meth:`verify`)."""
        infos = self.list()
        return infos[-1] if infos else None

    def verify(self, step: int | None = None) -> VerifyReport:
        """Read back every checkpoint (or the one of ``step``) and compare it with its manifest."""
        results, uncommitted = [], []
        for found_step, name in reversed(self._checkpoint_folders()):
            if step is not None and found_step != step:
                continue
            if self._has_manifest(name):
                results.append(self._verify_folder(name))
            else:
                uncommitted.append(name)
        return VerifyReport(self.location, tuple(results), tuple(uncommitted))

    def _verify_folder(
        self,
        name: str,
        expected_manifest: bytes | None = None,
        written: Mapping[str, Sequence[Buffer]] | None = None,
    ) -> VerifyResult:
        """Check a checkpoint folder against its manifest.

        With ``expected_manifest`` (right after a save) the manifest must read back as those
        bytes, and a file whose bytes are in ``written`` (the very memory that was hashed into
        that manifest and written) is read back and compared with them byte for byte; every
        other file is read back and re-hashed.
        """
        step = parse_step_dirname(replaced_step(name) or name)
        assert step is not None
        location = self.store.child(name)
        try:
            manifest = self._read_manifest(name, step)
            if expected_manifest is not None and manifest.to_bytes() != expected_manifest:
                raise CorruptCheckpointError("the manifest read back differs", where=location)
            buffers = _ReadBackBuffers()
            heads: dict[str, bytes] = {}
            for file_name, entry in manifest.files.items():
                if expected_manifest is not None and written and file_name in written:
                    self._compare_file(name, file_name, entry, written[file_name], buffers)
                else:
                    heads[file_name] = self._hash_file(name, file_name, entry)
            if expected_manifest is None:
                # What restore would refuse, verify reports: headers, JSON, references.
                self._check_contents(name, manifest, heads)
        except CorruptCheckpointError as exc:
            return VerifyResult(name, step, location, ok=False, problem=str(exc))
        except FileNotFoundError as exc:
            return VerifyResult(
                name, step, location, ok=False, problem=f"missing file: {exc.filename or exc}"
            )
        except OSError as exc:
            return VerifyResult(name, step, location, ok=False, problem=f"cannot read: {exc}")
        return VerifyResult(name, step, location, ok=True, size=manifest.payload_bytes)

    def _compare_file(
        self,
        name: str,
        file_name: str,
        entry: FileEntry,
        written: Sequence[Buffer],
        buffers: _ReadBackBuffers,
    ) -> None:
        """Read a file back and compare it with the bytes it was written from."""
        where = self.store.child(name, file_name)
        size = 0
        with self.store.open_read(name, file_name) as handle:
            for chunk in written:
                view = memoryview(chunk).cast("B")
                for start in range(0, view.nbytes, READ_CHUNK):
                    piece = view[start : start + READ_CHUNK]
                    buffer = buffers.get(piece.nbytes)
                    count = read_into(handle, memoryview(buffer))
                    size += count
                    if count < piece.nbytes:
                        _check_size(where, entry, size)  # the file is too short: says so
                    # bytearray == buffer is one memcmp (a memoryview on the left is not).
                    if buffer != piece:
                        raise CorruptCheckpointError(
                            "the bytes read back differ from the bytes written", where=where
                        )
            if handle.read(1):
                size += 1
        _check_size(where, entry, size)

    def _hash_file(self, name: str, file_name: str, entry: FileEntry) -> bytes:
        """Read a file back and check its size and hashes against ``entry``: each piece is
        hashed in a thread while the next one is read. Returns the bytes that its contents
        check needs (the header of a safetensors file, all of a JSON file), kept as read."""
        where = self.store.child(name, file_name)
        _check_json_size(where, file_name, entry)
        head = _Head(file_name, entry.size)
        capacity = min(READ_CHUNK, entry.size + 1)  # one byte more shows a file too large
        ring: list[bytearray] = []
        digests = _Digests(md5=entry.md5 is not None, threaded=entry.size >= THREAD_MIN_BYTES)
        size = 0
        try:
            with self.store.open_read(name, file_name) as handle:
                for index in itertools.count():
                    if len(ring) < 3:
                        ring.append(bytearray(capacity))
                    else:
                        digests.wait(index - len(ring) + 1)  # the buffer is hashed: reuse it
                    buffer = memoryview(ring[index % len(ring)])
                    count = read_into(handle, buffer)
                    if count:
                        digests.update(buffer[:count])
                        head.feed(buffer[:count])
                        size += count
                    if count < capacity or size > entry.size:
                        break
            sha256, md5 = digests.result()
        finally:
            digests.cancel()
        _check_hashes(where, entry, size, sha256, md5)
        return bytes(head.data)

    def _check_contents(self, name: str, manifest: Manifest, heads: Mapping[str, bytes]) -> None:
        """Check what a load would parse, from the heads :meth:`_hash_file` kept: every
        safetensors header against its file's size, every JSON file, and a Checkpointer's
        ``state.json`` with every tensor it refers to."""
        specs: dict[str, dict[str, Any]] = {}
        documents: dict[str, Any] = {}
        for file_name, head in heads.items():
            where = self.store.child(name, file_name)
            stem, kind = file_name.rsplit(".", 1)
            if kind == "safetensors":
                total = manifest.files[file_name].size
                _, specs[stem], _ = tensorfile.parse_header(head, where=where, total=total)
            else:
                documents[stem] = _parse_json(head, where=where)
        _decode_state(documents, specs, where=self.store.child(name, f"{_STATE_FILE}.json"))

    def _read_verified(self, name: str, files: Mapping[str, FileEntry]) -> dict[str, memoryview]:
        """Every file of ``files`` read once into a buffer of its own, its size and hashes
        checked against ``files`` before it is returned.

        Each file is read straight into its final buffer in pieces, each piece hashed in a
        thread while the next is read; the hashes of different files run in parallel (the
        largest file is read first, so that its hash, the longest, starts first).
        """
        pending: list[tuple[str, FileEntry, memoryview, int, _Digests]] = []
        try:
            for file_name, entry in sorted(files.items(), key=lambda item: -item[1].size):
                where = self.store.child(name, file_name)
                try:
                    with self.store.open_read(name, file_name) as handle:
                        known = handle_size(handle)
                        digests = _Digests(
                            md5=entry.md5 is not None, threaded=entry.size >= THREAD_MIN_BYTES
                        )
                        pending.append((file_name, entry, memoryview(b""), 0, digests))
                        _check_json_size(where, file_name, entry)
                        if known is None:
                            buffer, size = _read_unsized(handle, entry.size, digests)
                        else:
                            # A safetensors header is read and checked against the size
                            # first: a file that claims more bytes than its tensors account
                            # for (a sparse file of gigabytes) is refused before the rest is
                            # read, so memory is bounded by what is valid.
                            head = b""
                            if file_name.endswith(".safetensors"):
                                head = read_header(handle, entry.size, where=where)
                            buffer = _new_buffer(min(known, entry.size))
                            buffer[: len(head)] = head
                            if head:
                                digests.update(buffer[: len(head)])
                            size = len(head) + _read_hashing(handle, buffer[len(head) :], digests)
                            if size == entry.size and handle.read(1):
                                size += 1  # more bytes than the manifest says
                except FileNotFoundError:
                    raise CorruptCheckpointError("the file is missing", where=where) from None
                except OSError as exc:
                    raise CorruptCheckpointError(
                        f"cannot read the file: {exc}", where=where
                    ) from None
                pending[-1] = (file_name, entry, buffer, size, digests)
            results = {item[0]: item for item in pending}
            out: dict[str, memoryview] = {}
            for file_name in files:  # checked in the manifest's order
                _, entry, buffer, size, digests = results[file_name]
                sha256, md5 = digests.result()
                _check_hashes(self.store.child(name, file_name), entry, size, sha256, md5)
                out[file_name] = buffer
            return out
        finally:
            for *_, digests in pending:
                digests.cancel()

    def load(
        self,
        step: int | None = None,
        *,
        framework: str = "torch",
        check: Callable[[LoadedCheckpoint], None] | None = None,
    ) -> LoadedCheckpoint:
        """The newest checkpoint that verifies (or exactly the one of ``step``).

        Every file is read once: its hash is checked against the manifest before it is parsed.
        A newer checkpoint that fails is skipped with a warning naming the file and the reason.
        Raises :class:`NoCheckpointError` when none verifies.

        ``check`` is called with each checkpoint that verified, before it is returned (a
        restore validates it against the live objects there). A
        :class:`CorruptCheckpointError` it raises passes the checkpoint over like a failed
        verification; any other :class:`CheckpointError` (the checkpoint does not fit) passes
        it over too, and is raised, the newest one, when no older checkpoint is usable.
        """
        skipped: list[VerifyResult] = []
        misfit: CheckpointError | None = None
        candidates = [(s, n) for s, n in self._checkpoint_folders() if step is None or s == step]
        for found_step, name in candidates:
            try:
                loaded = self._load_folder(found_step, name, framework)
            except CorruptCheckpointError as exc:
                if not self._has_manifest(name):
                    # Never committed (what an interrupted write or deletion leaves on an object
                    # store): not a checkpoint, so nothing was skipped and there is no warning.
                    continue
                skipped.append(
                    VerifyResult(name, found_step, self.store.child(name), False, str(exc))
                )
                continue
            if check is not None:
                try:
                    check(loaded)
                except CheckpointError as exc:
                    if not isinstance(exc, CorruptCheckpointError):
                        misfit = misfit or exc
                    skipped.append(
                        VerifyResult(name, found_step, self.store.child(name), False, str(exc))
                    )
                    continue
            loaded.skipped = skipped
            if skipped:
                message = "; ".join(r.problem for r in skipped)
                reason = "failed verification" + (" or do not fit" if misfit else "")
                warnings.warn(
                    f"nbresume: skipped {len(skipped)} newer checkpoint(s) that {reason} "
                    f"({message}); using step {found_step}",
                    RuntimeWarning,
                    stacklevel=2,
                )
            return loaded
        if misfit is not None:
            raise misfit  # the objects changed: that, not corruption, is what to report
        if step is not None and not skipped:
            raise NoCheckpointError(f"there is no checkpoint of step {step}", where=self.location)
        if skipped:
            raise NoCheckpointError(
                f"no checkpoint verifies ({len(skipped)} checked): "
                + "; ".join(r.problem for r in skipped),
                where=self.location,
                fix="run `nbresume verify` on the folder for details",
            )
        raise NoCheckpointError("there is no checkpoint yet", where=self.location)

    def _has_manifest(self, name: str) -> bool:
        """Whether the folder holds anything named ``manifest.json``. One that is not a
        regular file (a FIFO, a link, a folder) makes a broken checkpoint, never a save that
        did not commit: it is reported, not passed over in silence (and never opened)."""
        if isinstance(self.store, LocalStore):
            try:
                os.lstat(self.store.root / name / MANIFEST_NAME)
            except (FileNotFoundError, NotADirectoryError):
                return False
            except OSError:
                return True  # cannot tell: report the folder rather than pass over it
            return True
        try:
            return MANIFEST_NAME in self.store.list_files(name)
        except FileNotFoundError:
            return False
        except OSError:
            return True  # cannot tell: report the folder rather than pass over it in silence

    def _load_folder(self, step: int, name: str, framework: str) -> LoadedCheckpoint:
        manifest = self._read_manifest(name, step)
        loaded = LoadedCheckpoint(step, self.store.child(name), manifest)
        # Nothing is parsed before every file's hash matched (a safetensors header excepted:
        # it is checked against the file's size before the tensor bytes are read).
        buffers = self._read_verified(name, manifest.files)
        for file_name, buffer in buffers.items():
            where = self.store.child(name, file_name)
            stem, kind = file_name.rsplit(".", 1)
            if kind == "safetensors":
                loaded.tensors[stem] = tensorfile.decode(buffer, where=where, framework=framework)
            else:
                loaded.data[stem] = _parse_json(buffer, where=where)
        loaded.state = _decode_state(
            loaded.data, loaded.tensors, where=self.store.child(name, f"{_STATE_FILE}.json")
        )
        return loaded

    # -- retention -----------------------------------------------------------------------

    def prune(
        self,
        keep: int | None = None,
        keep_best: KeepBest | None = None,
        *,
        verify_kept: bool = True,
    ) -> builtins.list[int]:
        """Delete checkpoints beyond the retention policy, oldest first; return their steps.

        The newest ``keep`` checkpoints are kept, plus the best by ``keep_best``. With
        ``verify_kept`` (the default) only checkpoints that verify count as kept, so nothing is
        deleted on the strength of a corrupt newer copy; folders that fail are reported by
        :meth:`verify` and never deleted here. On a write-back store (Google Drive's mount)
        only checkpoints that the durable store confirmed count as kept.
        """
        keep = self.keep if keep is None else check_keep("CheckpointStore.prune", keep)
        best = (
            self.keep_best
            if keep_best is None
            else _check_keep_best(keep_best, "CheckpointStore.prune")
        )
        verify_kept = check_bool("CheckpointStore.prune", "verify_kept", verify_kept)
        if keep is None:
            return []
        infos = self.list()  # oldest first
        verdicts: dict[str, bool] = {}

        def verified(info: CheckpointInfo) -> bool:
            if info.name not in verdicts:
                ok = not verify_kept or self._verify_folder(info.name).ok
                # Behind a write-back cache (Drive's mount) only what the durable store itself
                # confirmed counts as kept: else a disconnect could leave no checkpoint at all.
                if ok and self.store.write_back:
                    ok = self.store.durability(info.name, info.manifest).saved
                verdicts[info.name] = ok
            return verdicts[info.name]

        kept: list[CheckpointInfo] = []
        for info in reversed(infos):
            if len(kept) == keep:
                break
            if verified(info):
                kept.append(info)
        if best is not None:
            metric, mode, count = best
            ranked = sorted(
                (i for i in infos if metric in i.metrics),
                key=lambda i: i.metrics[metric],
                reverse=(mode == "max"),
            )
            kept += [i for i in ranked if verified(i)][: count or keep]
        kept_names = {i.name for i in kept}
        newest_kept = max((i.step for i in kept), default=-1)
        deleted = []
        for info in infos:
            # Never delete what is newer than every kept checkpoint, nor a checkpoint that
            # failed verification (it is reported by verify(), and left for the user to inspect).
            if (
                info.name in kept_names
                or info.step >= newest_kept
                or not verdicts.get(info.name, True)
            ):
                continue
            self.store.delete(info.name)
            deleted.append(info.step)
        return deleted


def _check_file(where: str, entry: FileEntry, size: int, sha256: str, md5: Any) -> None:
    """Size and hashes against the manifest's entry (``md5``: a hash object or ``None``)."""
    _check_hashes(where, entry, size, sha256, None if md5 is None else md5.hexdigest())


def _check_size(where: str, entry: FileEntry, size: int) -> None:
    if size != entry.size:
        relation = "larger" if size > entry.size else "smaller"
        raise CorruptCheckpointError(
            f"size mismatch: the manifest says {entry.size} bytes, the file is {relation}"
            + ("" if size > entry.size else f" ({size} bytes)"),
            where=where,
        )


def _check_hashes(where: str, entry: FileEntry, size: int, sha256: str, md5: str | None) -> None:
    _check_size(where, entry, size)
    if sha256 != entry.sha256:
        raise CorruptCheckpointError("sha256 mismatch: the file's bytes have changed", where=where)
    if md5 is not None and md5 != entry.md5:
        raise CorruptCheckpointError("md5 mismatch: the file's bytes have changed", where=where)


#: The Checkpointer's state document (``state.json``), checked by load and verify alike,
#: and its generator states (``rng.safetensors``).
_STATE_FILE = "state"
_RNG_FILE = "rng"


def _parse_json(buffer: Buffer, *, where: str) -> Any:
    """A JSON file of a checkpoint, its nesting bounded (nothing later can recurse too deep)."""
    try:
        document = json.loads(str(buffer, "utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise CorruptCheckpointError("not valid JSON", where=where) from None
    state_document.check_depth(document, where=where)
    return document


def _decode_state(
    documents: Mapping[str, Any], tensors: Mapping[str, Mapping[str, Any]], *, where: str
) -> state_document.SavedState | None:
    """A Checkpointer's ``state.json`` checked against the tensors it refers to (``None``
    when the checkpoint has none: a store user's own files). A ``state.json`` next to an
    ``rng.safetensors`` is a Checkpointer's whatever it holds, so that a document replaced
    by something else entirely is refused here too."""
    if _STATE_FILE not in documents:
        return None
    document = documents[_STATE_FILE]
    if not state_document.is_state_document(document) and _RNG_FILE not in tensors:
        return None
    return state_document.decode_state(document, tensors, where=where)


def _check_json_size(where: str, file_name: str, entry: FileEntry) -> None:
    if file_name.endswith(".json") and entry.size > MAX_JSON_BYTES:
        raise CorruptCheckpointError(
            f"the manifest says {entry.size} bytes, more than the limit of {MAX_JSON_BYTES} "
            "for a JSON file",
            where=where,
        )


def read_header(handle: IO[bytes], total: int, *, where: str) -> bytes:
    """The first bytes of a safetensors file up to the end of its header, the header checked
    against a file of ``total`` bytes. A file cut short returns what it has (its size check
    then says so)."""
    prefix = bytearray(8)
    if total < 8:
        tensorfile.header_length(prefix, total, where=where)  # raises: too short for a header
    count = read_into(handle, memoryview(prefix))
    if count < 8:
        return bytes(prefix[:count])
    header_len = tensorfile.header_length(prefix, total, where=where)
    head = prefix + bytearray(header_len)
    count = read_into(handle, memoryview(head)[8:])
    if count < header_len:
        return bytes(head[: 8 + count])
    tensorfile.parse_header(head, where=where, total=total)
    return bytes(head)


class _Head:
    """The start of a file as it is read in pieces: a safetensors file's length prefix and
    header, or a whole JSON file (other files: nothing)."""

    def __init__(self, file_name: str, size: int) -> None:
        self.data = bytearray()
        self._tensors = file_name.endswith(".safetensors")
        self._size = size
        self._want = 8 if self._tensors else size if file_name.endswith(".json") else 0

    def feed(self, piece: memoryview) -> None:
        offset = 0
        while len(self.data) < self._want and offset < piece.nbytes:
            take = self._want - len(self.data)
            self.data += piece[offset : offset + take]
            offset += take
            if self._tensors and self._want == 8 and len(self.data) == 8:
                length = int.from_bytes(self.data, "little")
                if length <= tensorfile.MAX_HEADER_BYTES and 8 + length <= self._size:
                    self._want = 8 + length  # else the header check refuses the 8 bytes


def _new_buffer(size: int) -> memoryview:
    """Writable memory for ``size`` bytes that a read fills (nothing is written to it first).

    Large buffers come in huge pages where the system offers them (Linux): a fresh buffer of
    4 KiB pages costs one page fault per 4 KiB while it is filled, which on a virtual machine
    can take longer than reading the file itself.
    """
    if size >= _HUGE_PAGE_MIN_BYTES and hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError, ValueError):
            area = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            with contextlib.suppress(OSError):
                area.madvise(mmap.MADV_HUGEPAGE)
            return memoryview(area)  # unmapped once the last tensor on it is gone
    import numpy as np

    return np.empty(size, np.uint8).data


def _read_hashing(handle: IO[bytes], buffer: memoryview, digests: _Digests) -> int:
    """Fill ``buffer`` from ``handle`` in pieces, each handed to ``digests`` once read."""
    size = 0
    while size < buffer.nbytes:
        piece = buffer[size : size + READ_CHUNK]
        count = read_into(handle, piece)
        if count:
            digests.update(piece[:count])
            size += count
        if count < piece.nbytes:
            break
    return size


def _read_unsized(handle: IO[bytes], limit: int, digests: _Digests) -> tuple[memoryview, int]:
    """A file whose size its file object cannot tell, read up to one byte past ``limit``."""
    pieces = []
    size = 0
    while size <= limit and (chunk := handle.read(min(READ_CHUNK, limit + 1 - size))):
        digests.update(chunk)
        pieces.append(chunk)
        size += len(chunk)
    return memoryview(bytearray(b"".join(pieces))), size


class _HashThread:
    """One hash of a stream of buffers, computed in a thread of its own.

    hashlib releases the GIL while it hashes a large buffer, so the caller writes or reads
    the next bytes meanwhile. Buffers must not change until they are hashed (:meth:`wait`).
    Without a thread (small files, or an interpreter too far in its shutdown to start one)
    the caller hashes each buffer itself.
    """

    def __init__(self, hasher: Any, *, threaded: bool) -> None:
        self._hash = hasher
        self._queue: queue.SimpleQueue[Buffer | None] = queue.SimpleQueue()
        self._hashed = 0
        self._changed = threading.Condition()
        self._cancelled = False
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        if threaded:
            thread = threading.Thread(target=self._run, name="nbresume-hash", daemon=True)
            try:
                thread.start()
            except RuntimeError:
                pass
            else:
                self._thread = thread

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            try:
                if not self._cancelled and self._error is None:
                    self._hash.update(item)
            except BaseException as exc:  # raised in the caller by hexdigest()
                self._error = exc
            with self._changed:
                self._hashed += 1
                self._changed.notify_all()

    def update(self, data: Buffer) -> None:
        if self._thread is None:
            self._hash.update(data)
            self._hashed += 1
        else:
            self._queue.put(data)

    def wait(self, count: int) -> None:
        """Until the first ``count`` buffers are hashed."""
        if self._thread is not None:
            with self._changed:
                self._changed.wait_for(lambda: self._hashed >= count)

    def hexdigest(self) -> str:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None
        if self._error is not None:
            raise self._error
        digest: str = self._hash.hexdigest()
        return digest

    def cancel(self) -> None:
        """Stop hashing (what is queued is skipped); the thread ends on its own."""
        if self._thread is not None:
            self._cancelled = True
            self._queue.put(None)
            self._thread = None


class _Digests:
    """SHA-256, and optionally MD5, of one file's bytes, each in a thread of its own."""

    def __init__(self, *, md5: bool, threaded: bool) -> None:
        self._threads = [_HashThread(hashlib.sha256(), threaded=threaded)]
        if md5:
            self._threads.append(_HashThread(hashlib.md5(usedforsecurity=False), threaded=threaded))

    def update(self, data: Buffer) -> None:
        for thread in self._threads:
            thread.update(data)

    def wait(self, count: int) -> None:
        for thread in self._threads:
            thread.wait(count)

    def result(self) -> tuple[str, str | None]:
        """(SHA-256, MD5 or ``None``) in hex, once every buffer given is hashed."""
        sha256 = self._threads[0].hexdigest()
        return sha256, self._threads[1].hexdigest() if len(self._threads) > 1 else None

    def cancel(self) -> None:
        for thread in self._threads:
            thread.cancel()


class _DurableCloser:
    """Makes written files durable (:meth:`Store.close_durably`) one after the other in a
    thread of its own, so that the next file is written meanwhile. The first failure is
    raised in the caller (by :meth:`check` or :meth:`finish`); later files are only closed."""

    def __init__(self, store: Store, *, threaded: bool) -> None:
        self._store = store
        self._queue: queue.SimpleQueue[IO[bytes] | None] = queue.SimpleQueue()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        if threaded:
            thread = threading.Thread(target=self._run, name="nbresume-fsync", daemon=True)
            try:
                thread.start()
            except RuntimeError:  # an interpreter in its shutdown: close in the caller
                pass
            else:
                self._thread = thread

    def _run(self) -> None:
        while (handle := self._queue.get()) is not None:
            if self._error is not None:
                with contextlib.suppress(OSError):
                    handle.close()
                continue
            try:
                self._store.close_durably(handle)
            except BaseException as exc:
                self._error = exc

    def close(self, handle: IO[bytes]) -> None:
        if self._thread is None:
            self._store.close_durably(handle)
        else:
            self._queue.put(handle)

    def check(self) -> None:
        if self._error is not None:
            raise self._error

    def finish(self) -> None:
        """Wait until every file given is durable; raise the first failure."""
        self.abandon()
        self.check()

    def abandon(self) -> None:
        """Wait until every file given is closed, durable or not."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None


class _ReadBackBuffers:
    """Reused buffers of exact sizes to read pieces of files back into: comparing a bytearray
    with another buffer of the same size is one memcmp, so each size needs its own."""

    def __init__(self) -> None:
        self._by_size: dict[int, bytearray] = {}

    def get(self, size: int) -> bytearray:
        buffer = self._by_size.pop(size, None)
        if buffer is None:
            buffer = bytearray(size)
            if len(self._by_size) >= _READ_BACK_BUFFERS:
                del self._by_size[next(iter(self._by_size))]  # the least recently used
        self._by_size[size] = buffer
        return buffer


def _check_keep_best(
    keep_best: object, call: str = "CheckpointStore"
) -> tuple[str, str, int] | None:
    """``(metric, mode, count)``, count 0 where not given (``keep`` applies); raises
    ArgumentError naming the value."""
    return check_keep_best(call, keep_best)


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
    from nbresume import __version__

    return f"nbresume {__version__}"


def format_bytes(count: int | None) -> str:
    """``1234567`` -> ``"1.2 MB"`` (decimal units, as disk tools and quotas show them)."""
    if count is None:
        return "unknown"
    value = float(count)
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(value) < 1000 or unit == "TB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    raise AssertionError("unreachable")


def verify(
    location: str | os.PathLike[str], *, storage_options: Mapping[str, Any] | None = None
) -> VerifyReport:
    """Check every checkpoint in ``location`` against its manifest (reads every byte once)."""
    return CheckpointStore(location, storage_options=storage_options).verify()
