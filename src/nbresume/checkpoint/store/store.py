"""The verified checkpoint store: write, commit, verify, keep, load.

The commit protocol (the code of :mod:`~nbresume.checkpoint.store.pending` does exactly this, in
this order, for every checkpoint the package writes; :meth:`CheckpointStore.save` is its
shortest use):

1. Clean up after a killed writer: hidden temporary folders are removed; an older copy of a
   step that was being replaced is put back if the new copy never landed.
2. Check free bytes and inodes against the exact size of the checkpoint (every byte of it is
   known before the first write of a ``save``). Refuse with both numbers and the fix when it
   does not fit.
3. Write every payload file from the bytes in memory, hashing the same bytes (XXH3-128 piece
   by piece as it is written; SHA-256 and MD5, for stores that compare MD5s such as Google
   Drive, in threads of their own), and make each file durable
   (:mod:`~nbresume.checkpoint.store.hashing`). The bytes are not changed during a save: a
   synchronous save holds the training thread, an asynchronous one writes host copies that
   nothing else touches. GPU tensors too large to copy to the host whole come through a few
   small staging buffers, piece by piece (``stage=``); such a file is re-hashed in 6. On a
   POSIX folder this happens in a temporary sibling folder ``.nbresume-tmp-<step>-...`` that
   no reader takes: there each file's fsync runs in a worker thread while the next files and
   the manifest are written, and Linux is told to start writing a file's pages to the disk
   every 32 MiB as it is written; on an object store, in place, after the manifest of any
   earlier copy was withdrawn, each file closed (durable) before the next.
4. Write ``manifest.json`` last: every file with its size and hash. It is the commit marker.
5. POSIX only: wait until every file (the manifest included) is fsynced, fsync the temporary
   folder, rename it into place, fsync the parent folder.
6. Verify: read the manifest back and compare it with the one written, then read every file
   back from the store and compare it byte for byte with the bytes in memory that were hashed
   into the manifest (this proves what re-hashing would, at the speed of memory); files that
   were not written from memory are re-hashed. Only now is the checkpoint reported as saved.
   ``verify()`` and ``load()``, which have no copy in memory, re-hash every byte
   (:mod:`~nbresume.checkpoint.store.reading`).
7. Retention: delete checkpoints beyond the policy, oldest first, each withdrawn from view in
   one step (a rename on POSIX, the manifest first on object stores), so a kill at any moment
   leaves only whole checkpoints. On POSIX the renamed folder's files are removed in the
   background (:func:`~nbresume.checkpoint.backends.local.remove_in_background`); the next save
   waits for that first.

Any failure in 3-5 removes the partial folder and leaves every earlier checkpoint untouched.
One writer per folder at a time is assumed (a second writer's leftovers would be cleaned).
"""

from __future__ import annotations

import builtins
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from nbresume.checkpoint.arguments import check_bool, check_storage_options
from nbresume.checkpoint.backends import Backend, check_location, open_store, wait_for_removals
from nbresume.checkpoint.format import FileEntry, Manifest
from nbresume.checkpoint.store import reading
from nbresume.checkpoint.store.hashing import default_hash, read_header
from nbresume.checkpoint.store.info import (
    CheckpointInfo,
    LoadedCheckpoint,
    VerifyReport,
    VerifyResult,
)
from nbresume.checkpoint.store.pending import PendingCheckpoint, encode, size_of
from nbresume.checkpoint.store.reading import verify_fit, verify_folder
from nbresume.checkpoint.store.retention import KeepBest, KeepPolicy
from nbresume.checkpoint.store.streaming import Span
from nbresume.checkpoint.units import format_bytes
from nbresume.errors import CheckpointError, CorruptCheckpointError


class CheckpointStore:
    """A folder (path or fsspec URL) of verified checkpoints.

    Args:
        location: a local path, ``file://``, ``memory://`` or any fsspec URL.
        keep: how many of the newest checkpoints to keep (``None`` keeps all).
        keep_best: ``(metric, "min" | "max"[, count])``: also keep the best ``count``
            (default: ``keep``) checkpoints by that metric.
        md5: also record MD5 hashes (for stores that report MD5s, such as Google Drive).
        check_space: refuse to start a save that would not fit (where free space is known).
        hash: the hash of new checkpoints, ``"xxh3-128"`` or ``"sha256"``; default: the
            ``NBRESUME_HASH`` environment variable, else XXH3-128 where ``xxhash`` is installed.
            Checkpoints of either hash load whatever this says.
        storage_options: options for the fsspec file system of a URL location (credentials,
            ``endpoint_url``, ...), e.g. ``{"endpoint_url": "http://127.0.0.1:9000"}`` for
            an S3-compatible server. Not allowed with a local folder.
    """

    def __init__(
        self,
        location: str | os.PathLike[str] | Backend,
        *,
        keep: int | None = 3,
        keep_best: KeepBest | None = None,
        md5: bool = False,
        check_space: bool = True,
        storage_options: Mapping[str, Any] | None = None,
        hash: str | None = None,
    ) -> None:
        # Every argument is checked before the store is opened.
        call = "CheckpointStore"
        #: Which checkpoints retention keeps (``keep=``, ``keep_best=``).
        self.retention = KeepPolicy.of(call, keep, keep_best)
        md5 = check_bool(call, "md5", md5)
        self.check_space = check_bool(call, "check_space", check_space)
        #: The hash asked for (``None``: :func:`nbresume.checkpoint.store.default_hash`).
        self.hash = None if hash is None else default_hash(hash)
        storage_options = check_storage_options(call, storage_options)
        if isinstance(location, Backend):
            self.backend = location
        else:
            check_location(location, call, "location")
            self.backend = open_store(location, storage_options=storage_options)
        self.md5 = md5 or self.backend.reports_md5
        #: Steps of checkpoints that retention leaves alone (:meth:`protect_newer_than`).
        self.protected: frozenset[int] = frozenset()

    @property
    def location(self) -> str:
        return self.backend.location

    @property
    def keep(self) -> int | None:
        """How many of the newest checkpoints retention keeps (``None``: all)."""
        return self.retention.newest

    @property
    def keep_best(self) -> tuple[str, str, int] | None:
        """``(metric, mode, count)`` of ``keep_best=`` (count 0: as many as ``keep``)."""
        return self.retention.keep_best

    def __repr__(self) -> str:
        return f"CheckpointStore({self.location!r}, keep={self.keep})"

    # -- writing -------------------------------------------------------------------------

    def begin(self, step: int, *, size: int | None = None, files: int = 0) -> PendingCheckpoint:
        """Start the checkpoint of ``step``: a :class:`PendingCheckpoint` to write files into,
        then ``commit()`` (or ``discard()``; a ``with`` block discards on an exception).

        ``size`` (bytes, in ``files`` files), when known, is checked against the free space
        first (with ``check_space``). Cleans up what a killed writer left before it starts.
        """
        self.protected -= {step}  # replaced by this writer: its own from now on
        return PendingCheckpoint.start(self, step, size=size, files=files, retain=self._retain)

    def join(self, step: int, folder: str) -> PendingCheckpoint:
        """A handle on the pending ``folder`` that another process began for ``step`` (a rank
        of a sharded save): it writes files there; the process that began it commits."""
        return PendingCheckpoint(self, step, folder, coordinator=False)

    def save(
        self,
        step: int,
        *,
        tensors: Mapping[str, Mapping[str, Any]] | None = None,
        data: Mapping[str, Any] | None = None,
        metrics: Mapping[str, float] | None = None,
        on_committed: Callable[[CheckpointInfo], None] | None = None,
        stage: Callable[[Any], Iterable[memoryview]] | None = None,
    ) -> CheckpointInfo:
        """Write, commit and verify the checkpoint of ``step``, then apply retention.

        ``tensors`` maps a file stem to a flat ``{name: tensor}`` dict (one safetensors file
        each); ``data`` maps a file stem to a JSON-serialisable value (one JSON file each).
        ``on_committed`` is called between the commit and the verification. A GPU tensor is
        copied to host memory whole before its file is written, unless ``stage`` (a
        :class:`~nbresume.checkpoint.hostmemory.Stager`) takes its bytes through a small
        host buffer, piece by piece; the files are the same either way.
        Returns only after the checkpoint was read back and matched its manifest.
        """
        files = encode(tensors or {}, data or {}, stage=stage)
        if not files:
            raise CheckpointError("nothing to save: pass tensors= or data=", where=self.location)
        with self.begin(step, size=size_of(files), files=len(files)) as pending:
            pending.write_files(files)
            return pending.commit(metrics, on_committed=on_committed)

    # -- reading -------------------------------------------------------------------------

    def checkpoint_folders(self) -> builtins.list[tuple[int, str]]:
        """(step, name) of every folder named like a checkpoint, newest first, committed or
        not (a folder moved aside while its step was replaced stands in for the step)."""
        return reading.checkpoint_folders(self.backend)

    def read_manifest(self, name: str, step: int) -> Manifest:
        """The manifest of the checkpoint folder ``name`` (CorruptCheckpointError if none)."""
        return reading.read_manifest(self.backend, name, step)

    def has_manifest(self, name: str) -> bool:
        """Whether the folder ``name`` holds anything named ``manifest.json``."""
        return reading.has_manifest(self.backend, name)

    def read_files(self, name: str, files: Mapping[str, FileEntry]) -> dict[str, memoryview]:
        """The files of ``files`` in the checkpoint folder ``name``, each read once and
        returned only after its size and hashes matched (CorruptCheckpointError otherwise)."""
        return reading.read_verified(self.backend, name, files)

    def read_headers(self, name: str, files: Mapping[str, FileEntry]) -> dict[str, Any]:
        """The header of each tensor file of ``files`` in the checkpoint folder ``name``, by
        its stem: each tensor's dtype and shape
        (:class:`~nbresume.checkpoint.format.TensorSpec`), checked against the size ``files``
        records (CorruptCheckpointError otherwise); only the first bytes of each file are read."""
        return {
            file_name.rsplit(".", 1)[0]: reading.read_specs(self.backend, name, file_name, entry)
            for file_name, entry in files.items()
        }

    def list(self) -> builtins.list[CheckpointInfo]:
        """Committed checkpoints (a manifest that parses), oldest first. Nothing is hashed."""
        infos = []
        for step, name in reversed(self.checkpoint_folders()):
            try:
                manifest = self.read_manifest(name, step)
            except CorruptCheckpointError:
                continue
            infos.append(CheckpointInfo(step, name, self.backend.child(name), manifest))
        return infos

    def broken(self, listed: Iterable[CheckpointInfo] = ()) -> builtins.list[VerifyResult]:
        """Step folders that hold something named ``manifest.json`` that is not a valid
        manifest (one that is not a regular file, or does not parse), oldest first: broken
        checkpoints, which :meth:`list` leaves out. Nothing is hashed. ``listed``: what
        :meth:`list` returned just before, whose manifests are not read again."""
        return [
            VerifyResult(name, step, self.backend.child(name), False, str(exc))
            for step, name, exc in self.broken_manifests(listed)
        ]

    def broken_manifests(
        self, listed: Iterable[CheckpointInfo] = ()
    ) -> builtins.list[tuple[int, str, CorruptCheckpointError]]:
        """:meth:`broken` as ``(step, folder name, the error reading its manifest)``."""
        found = []
        skip = {info.name for info in listed}
        for step, name in reversed(self.checkpoint_folders()):
            if name in skip or not self.has_manifest(name):
                continue
            try:
                self.read_manifest(name, step)
            except CorruptCheckpointError as exc:
                found.append((step, name, exc))
        return found

    def latest(self) -> CheckpointInfo | None:
        """The newest committed checkpoint (its files are not re-hashed; see :meth:`verify`)."""
        infos = self.list()
        return infos[-1] if infos else None

    def verify(
        self,
        step: int | None = None,
        *,
        fits: Callable[[LoadedCheckpoint], None] | None = None,
    ) -> VerifyReport:
        """Read back every checkpoint (or the one of ``step``) and compare it with its manifest.

        ``fits`` is then called with each checkpoint that verified as its tensor files'
        headers describe it, as :meth:`load`'s ``fits`` is (no tensor is read): a
        :class:`CheckpointError` it raises (the checkpoint does not fit the objects it is
        for) fails the checkpoint with that error's text, as a restore passes it over."""
        results, uncommitted, removed = [], [], []
        for found_step, name in reversed(self.checkpoint_folders()):
            if step is not None and found_step != step:
                continue
            if self.has_manifest(name):
                result = verify_folder(self.backend, name)
                if result.ok and fits is not None:
                    result = verify_fit(self.backend, result, fits)
                if not result.ok and not self.has_manifest(name):
                    # A running writer's retention deleted it while it was read (a reader
                    # takes no lease): the checkpoint is gone, not damaged.
                    removed.append(name)
                    continue
                results.append(result)
            else:
                uncommitted.append(name)
        return VerifyReport(self.location, tuple(results), tuple(uncommitted), tuple(removed))

    def load(
        self,
        step: int | None = None,
        *,
        framework: str = "torch",
        check: Callable[[LoadedCheckpoint], None] | None = None,
        devices: Mapping[str, Any] | None = None,
        fits: Callable[[LoadedCheckpoint], None] | None = None,
        targets: Callable[[LoadedCheckpoint], Mapping[str, Mapping[Span, Any]]] | None = None,
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

        The tensor files named in ``devices`` (file name -> torch device) are read straight
        onto those devices (a restore into objects on a GPU).

        ``fits`` checks each candidate as its tensor files' headers describe it, before their
        tensors are read (:func:`~nbresume.checkpoint.store.reading.load_folder`): one that does
        not fit is passed over as ``check`` passes it over, without taking memory for the
        tensors it declares.

        ``targets`` names, for a candidate that fits, the live tensors its tensors are read
        into (a restore in the objects' own memory): the checkpoint's ``fill()`` writes
        them once its plan is checked (:mod:`~nbresume.checkpoint.store.streaming`).
        """

        def load_one(found_step: int, name: str) -> LoadedCheckpoint | None:
            try:
                return reading.load_folder(
                    self.backend, found_step, name, framework, devices, fits=fits, targets=targets
                )
            except CorruptCheckpointError:
                if not self.has_manifest(name):
                    # Never committed (what an interrupted write or deletion leaves on an
                    # object store): not a checkpoint, nothing was skipped, no warning.
                    return None
                raise

        candidates = [(s, n) for s, n in self.checkpoint_folders() if step is None or s == step]
        return reading.newest_that_loads(
            candidates, load_one, location=self.location, step=step, check=check
        )

    # -- retention -----------------------------------------------------------------------

    def protect_newer_than(self, step: int) -> None:
        """Leave every checkpoint newer than ``step`` (the one a run resumed from) out of
        retention from now on: neither deleted nor counted as kept. A restore passes over a
        newer checkpoint only when it fails verification or does not fit the objects given;
        deleting it would lose what the user may still want to inspect or resume."""
        self.protected = frozenset(s for s, _ in self.checkpoint_folders() if s > step)

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

        Returns once the deleted checkpoints' files are off the disk (the retention that runs
        after each save returns as soon as they are out of view: see :meth:`wait_removals`).
        """
        policy = self.retention.but("CheckpointStore.prune", keep, keep_best)
        verify_kept = check_bool("CheckpointStore.prune", "verify_kept", verify_kept)
        deleted = self._prune(policy, verify_kept=verify_kept)
        self.wait_removals()
        return deleted

    def _retain(self) -> None:
        """Retention after a commit, handed to the pending checkpoint: the checkpoints kept
        are not read back again (each was verified when it was written)."""
        self._prune(self.retention, verify_kept=False)

    def _prune(self, policy: KeepPolicy, *, verify_kept: bool) -> builtins.list[int]:
        """Delete the checkpoints beyond ``policy``, returning once they are out of view (on a
        local folder their files are still being removed, in the background)."""

        def counts(info: CheckpointInfo) -> bool:
            ok = not verify_kept or verify_folder(self.backend, info.name).ok
            # Behind a write-back cache (Drive's mount) only what the durable store itself
            # confirmed counts as kept: else a disconnect could leave no checkpoint at all.
            if ok and self.backend.write_back:
                ok = self.backend.durability(info.name, info.manifest).saved
            return ok

        infos = [i for i in self.list() if i.step not in self.protected]  # oldest first
        deleted = []
        for info in policy.doomed(infos, counts):
            self.backend.delete(info.name)
            deleted.append(info.step)
        return deleted

    def wait_removals(self) -> None:
        """Wait until the checkpoints that retention deleted are off the disk too.

        On a local folder the checkpoint that a save's retention deletes leaves every reader's
        view before :meth:`save` returns; its files are removed in the background. The next
        save waits for that removal before it checks free space, and so do :meth:`prune` and a
        normal exit of the interpreter; call this before copying or archiving the folder from
        this process. It waits for every such removal this process started.
        """
        wait_for_removals()


def verify(
    location: str | os.PathLike[str], *, storage_options: Mapping[str, Any] | None = None
) -> VerifyReport:
    """Check every checkpoint in ``location`` against its manifest (reads every byte once)."""
    return CheckpointStore(location, storage_options=storage_options).verify()


__all__ = [
    "CheckpointInfo",
    "CheckpointStore",
    "LoadedCheckpoint",
    "PendingCheckpoint",
    "VerifyReport",
    "VerifyResult",
    "format_bytes",
    "read_header",
    "verify",
]
