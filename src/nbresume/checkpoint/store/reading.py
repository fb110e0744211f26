"""Reading checkpoints back: verified reads, verification, and the reading policy.

The protocol of a read (every function below keeps it):

1. A checkpoint is a folder named by its step that holds a manifest which parses
   (:func:`read_manifest`); a step folder without one is a save that never committed and is
   not a checkpoint. A folder moved aside while its step was being replaced stands in for
   the step when no folder of the step's name exists (:func:`checkpoint_folders`).
2. Every file is read once into memory while threads hash it; its size and hashes are
   checked against the manifest before a byte of it is parsed (:func:`read_verified`). The
   header of a safetensors file alone is checked against the file's size first, so that a
   file claiming more bytes than it holds is refused before memory is spent on it; only then
   is the rest of its memory faulted in at once and the rest of the file asked for from the
   disk (:func:`ready_for_rest`).
3. Verification (:func:`verify_folder`) reads every file back the same way, or, right after
   a save, compares it byte for byte with the bytes still in memory that were hashed into the
   manifest; it then checks what a load would parse (headers, JSON, ``state.json``). Right
   after a save on a local device's file system, where what reads back is the page cache
   (the bytes hashed as they were written), it checks the manifest and each file's size
   only (``read_back=False``).
4. Loading takes the newest checkpoint that verifies, passes over newer ones that do not with
   one warning naming each, and raises NoCheckpointError when none is usable
   (:func:`newest_that_loads`, used by every reader of the package, sharded loads included).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import itertools
import json
import os
import queue
import warnings
from collections.abc import Callable, Generator, Iterable, Mapping, Sequence
from typing import IO, Any

from nbresume.checkpoint.backends import (
    READ_CHUNK,
    Backend,
    handle_size,
    read_into,
    replaced_step,
)
from nbresume.checkpoint.forksafe import Workers
from nbresume.checkpoint.format import (
    MANIFEST_NAME,
    MAX_JSON_BYTES,
    MAX_MANIFEST_BYTES,
    STATE_FILE,
    FileEntry,
    Manifest,
    lightning_format,
    parse_manifest,
    parse_step_dirname,
    state_document,
    tensorfile,
)
from nbresume.checkpoint.store.hashing import (
    THREAD_MIN_BYTES,
    Buffer,
    Digests,
    Head,
    Prefault,
    ReadBackBuffers,
    can_prefault,
    check_hashes,
    check_size,
    new_buffer,
    read_hashing,
    read_unsized,
)
from nbresume.checkpoint.store.info import LoadedCheckpoint, VerifyResult
from nbresume.checkpoint.store.memory import is_out_of_memory, memory_error
from nbresume.checkpoint.store.streaming import Span, Streamed, fill_all
from nbresume.checkpoint.store.verdict import check_checkpoint, check_loaded
from nbresume.errors import (
    CheckpointError,
    CorruptCheckpointError,
    MemoryLimitError,
    NoCheckpointError,
    StorageError,
)


def checkpoint_folders(store: Backend) -> list[tuple[int, str]]:
    """(step, name) of every folder named like a checkpoint, newest first.

    A writer killed while replacing a step can leave the older copy moved aside and no
    folder of the step's name; that copy then stands in for the step (the next writer
    moves it back), so that a checkpoint reported as saved never drops out of view.
    """
    found = []
    stand_ins: dict[int, str] = {}
    for name in store.list_folders():
        step = parse_step_dirname(name)
        if step is not None:
            found.append((step, name))
        elif (step := parse_step_dirname(replaced_step(name) or "")) is not None:
            stand_ins.setdefault(step, name)
    present = {step for step, _ in found}
    found += [(step, name) for step, name in stand_ins.items() if step not in present]
    return sorted(found, reverse=True)


def read_manifest(store: Backend, name: str, step: int) -> Manifest:
    where = store.child(name, MANIFEST_NAME)
    try:
        raw = store.read_bytes(name, MANIFEST_NAME, limit=MAX_MANIFEST_BYTES)
    except FileNotFoundError:
        raise CorruptCheckpointError(
            "no manifest: the checkpoint was never committed", where=store.child(name)
        ) from None
    except StorageError:
        raise  # the store failed, not the checkpoint
    except OSError as exc:
        if exc.errno == errno.EINVAL:  # a FIFO, a link or a folder: never opened
            raise CorruptCheckpointError(
                "the manifest is not a regular file (a FIFO, a link or a folder)", where=where
            ) from None
        raise CorruptCheckpointError(f"cannot read the manifest: {exc}", where=where) from None
    return parse_manifest(bytes(raw), where=where, expected_step=step)


def verify_folder(
    store: Backend,
    name: str,
    expected_manifest: bytes | None = None,
    written: Mapping[str, Sequence[Buffer]] | None = None,
    *,
    read_back: bool = True,
) -> VerifyResult:
    """Check a checkpoint folder against its manifest.

    With ``expected_manifest`` (right after a save) the manifest must read back as those
    bytes, and a file whose bytes are in ``written`` (the very memory that was hashed into
    that manifest and written) is read back and compared with them byte for byte; every
    other file is read back and re-hashed. Without ``read_back`` (right after a save only)
    each file's size is checked instead of its bytes.
    """
    step = parse_step_dirname(replaced_step(name) or name)
    assert step is not None
    location = store.child(name)
    try:
        manifest = read_manifest(store, name, step)
        if expected_manifest is not None and manifest.to_bytes() != expected_manifest:
            raise CorruptCheckpointError("the manifest read back differs", where=location)
        buffers = ReadBackBuffers()
        heads: dict[str, bytes] = {}
        for file_name, entry in manifest.files.items():
            if expected_manifest is not None and not read_back:
                check_stored_size(store, name, file_name, entry)
            elif expected_manifest is not None and written and file_name in written:
                compare_file(store, name, file_name, entry, written[file_name], buffers=buffers)
            else:
                heads[file_name] = hash_file(store, name, file_name, entry)
        if expected_manifest is None:
            # What restore would refuse, verify reports: headers, JSON, references.
            check_contents(store, name, manifest, heads)
    except CorruptCheckpointError as exc:
        return VerifyResult(name, step, location, ok=False, problem=str(exc))
    except StorageError:
        raise  # the store failed, not the checkpoint
    except FileNotFoundError as exc:
        return VerifyResult(
            name, step, location, ok=False, problem=f"missing file: {exc.filename or exc}"
        )
    except OSError as exc:
        if is_out_of_memory(exc):  # not the checkpoint's fault: said, not reported as damage
            raise memory_error(exc, doing="verifying the checkpoint", where=location) from None
        return VerifyResult(name, step, location, ok=False, problem=f"cannot read: {exc}")
    return VerifyResult(name, step, location, ok=True, size=manifest.payload_bytes)


def read_failure(exc: BaseException, where: str) -> BaseException:
    """What a read that failed with ``exc`` raises: a refused allocation is memory
    (:class:`~nbresume.errors.MemoryLimitError`), never damage; another system error makes
    the file unreadable (CorruptCheckpointError: the checkpoint is passed over); anything
    else is raised as it is."""
    if is_out_of_memory(exc):
        return memory_error(exc, doing="reading the checkpoint", where=where)
    if isinstance(exc, OSError) and not isinstance(exc, StorageError):
        return CorruptCheckpointError(f"cannot read the file: {exc}", where=where)
    return exc


def check_stored_size(store: Backend, name: str, file_name: str, entry: FileEntry) -> None:
    """The file is there, a regular file of the manifest's size (nothing of it is read)."""
    where = store.child(name, file_name)
    with store.open_read(name, file_name) as handle:
        size = handle_size(handle)
        if size is None:
            size = len(handle.read(entry.size + 1))
    check_size(where, entry, size)


def compare_file(
    store: Backend,
    name: str,
    file_name: str,
    entry: FileEntry,
    written: Sequence[Buffer],
    *,
    buffers: ReadBackBuffers,
) -> None:
    """Read a file back and compare it with the bytes it was written from."""
    where = store.child(name, file_name)
    size = 0
    with store.open_read(name, file_name) as handle:
        for chunk in written:
            view = memoryview(chunk).cast("B")
            for start in range(0, view.nbytes, READ_CHUNK):
                piece = view[start : start + READ_CHUNK]
                buffer = buffers.get(piece.nbytes)
                count = read_into(handle, memoryview(buffer))
                size += count
                if count < piece.nbytes:
                    check_size(where, entry, size)  # the file is too short: says so
                # bytearray == buffer is one memcmp (a memoryview on the left is not).
                if buffer != piece:
                    raise CorruptCheckpointError(
                        "the bytes read back differ from the bytes written", where=where
                    )
        if handle.read(1):
            size += 1
    check_size(where, entry, size)


def hash_file(store: Backend, name: str, file_name: str, entry: FileEntry) -> bytes:
    """Read a file back and check its size and hashes against ``entry``: each piece is
    hashed in a thread while the next one is read. Returns the bytes that its contents
    check needs (the header of a safetensors file, all of a JSON file), kept as read."""
    where = store.child(name, file_name)
    check_json_size(where, file_name, entry)
    head = Head(file_name, entry.size)
    capacity = min(READ_CHUNK, entry.size + 1)  # one byte more shows a file too large
    ring: list[bytearray] = []
    digests = Digests(
        md5=entry.md5 is not None,
        threaded=entry.size >= THREAD_MIN_BYTES,
        algorithm=entry.algorithm,
    )
    size = 0
    try:
        with store.open_read(name, file_name) as handle:
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
    check_hashes(where, entry, size, sha256, md5)
    return bytes(head.data)


def check_contents(
    store: Backend, name: str, manifest: Manifest, heads: Mapping[str, bytes]
) -> None:
    """Check what a load would parse, from the heads :meth:`_hash_file` kept: every
    safetensors header against its file's size, every JSON file, and a Checkpointer's
    ``state.json`` with every tensor it refers to."""
    specs: dict[str, dict[str, Any]] = {}
    documents: dict[str, Any] = {}
    for file_name, head in heads.items():
        where = store.child(name, file_name)
        stem, kind = file_name.rsplit(".", 1)
        if kind == "safetensors":
            total = manifest.files[file_name].size
            _, specs[stem], _ = tensorfile.parse_header(head, where=where, total=total)
        else:
            documents[stem] = parse_json(head, where=where)
    rng = f"{RNG_FILE}.safetensors"
    if rng in heads:
        # The generator states are checked from their bytes, as a load checks them.
        where = store.child(name, rng)
        raw = read_verified(store, name, {rng: manifest.files[rng]})[rng]
        try:
            specs[RNG_FILE] = tensorfile.decode(raw, where=where, framework="numpy")
        except CheckpointError as exc:
            raise CorruptCheckpointError(exc.message, where=where) from None
    state = decode_state(documents, specs, where=store.child(name, f"{STATE_FILE}.json"))
    check_checkpoint(
        manifest, location=store.child(name), documents=documents, tensors=specs, state=state
    )


def read_verified(
    store: Backend,
    name: str,
    files: Mapping[str, FileEntry],
    devices: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Every file of ``files`` read once into a buffer of its own, its size and hashes
    checked against ``files`` before it is returned.

    Each file is read straight into its final buffer in pieces, each piece hashed as it is
    read (a slow hash in a thread while the next piece is read); the hashes of different
    files run in parallel (the largest file is read first, so that its hash, the longest,
    starts first). A tensor file's buffer is populated at once after its header is checked
    (:func:`ready_for_rest`). The buffers are memory of their own, never a mapping of the
    files: what is built on them holds no file open.

    A tensor file named in ``devices`` (file name -> torch device) is read into a byte
    tensor on that device instead (:class:`DeviceReader`): through a few pinned host
    buffers, each piece hashed while the one before is copied, so that no host memory as
    large as the file is needed. Nothing built on it is returned before its hash matched.
    """
    pending: list[tuple[str, FileEntry, Any, int, Digests]] = []
    placed = DeviceReader()
    ahead: Prefault | None = None
    try:
        for file_name, entry in sorted(files.items(), key=lambda item: -item[1].size):
            where = store.child(name, file_name)
            device = (devices or {}).get(file_name)
            try:
                with store.open_read(name, file_name) as handle:
                    known = handle_size(handle)
                    digests = Digests(
                        md5=entry.md5 is not None,
                        # A piece read for a device is hashed before its buffer is reused.
                        threaded=entry.size >= THREAD_MIN_BYTES and device is None,
                        algorithm=entry.algorithm,
                    )
                    pending.append((file_name, entry, memoryview(b""), 0, digests))
                    check_json_size(where, file_name, entry)
                    if known is None:
                        buffer, size = read_unsized(handle, entry.size, digests)
                    else:
                        buffer = new_buffer(min(known, entry.size))
                        size = 0
                        if file_name.endswith(".safetensors"):
                            size, checked = read_checked_head(
                                handle, buffer, entry.size, digests, where
                            )
                            on_device = None
                            if checked and device is not None:
                                on_device = placed.read(handle, buffer, size, digests, device)
                            if on_device is not None:
                                buffer, size = on_device
                            elif checked:
                                buffer, ahead = ready_for_rest(handle, buffer, size)
                        if isinstance(buffer, memoryview):  # else read to its end already
                            size += read_hashing(handle, buffer[size:], digests, ahead, size)
                        if ahead is not None:
                            ahead.close()
                            ahead = None
                        if size == entry.size and handle.read(1):
                            size += 1  # more bytes than the manifest says
            except FileNotFoundError:
                raise CorruptCheckpointError("the file is missing", where=where) from None
            except (OSError, MemoryError, RuntimeError) as exc:
                raise read_failure(exc, where) from None
            pending[-1] = (file_name, entry, buffer, size, digests)
        results = {item[0]: item for item in pending}
        out: dict[str, Any] = {}
        for file_name in files:  # checked in the manifest's order
            _, entry, buffer, size, digests = results[file_name]
            sha256, md5 = digests.result()
            check_hashes(store.child(name, file_name), entry, size, sha256, md5)
            out[file_name] = buffer
        return out
    finally:
        if ahead is not None:
            ahead.close()
        for *_, digests in pending:
            digests.cancel()


#: A read for a device: :data:`DEVICE_BUFFERS` host buffers of :data:`DEVICE_PIECE` bytes.
DEVICE_PIECE = 32 << 20
DEVICE_BUFFERS = 4


class DeviceReader:
    """Reads the rest of a file into a byte tensor on a device through a ring of a few host
    buffers. A reader thread fills the buffers from the file, one piece after another, so
    that the disk never waits; the caller hashes each piece and copies it to the device (from
    pinned memory, on a stream of its own, for CUDA) while the next pieces are read. A buffer
    is filled again only once its last copy is on the device. The host memory used is the
    ring's whatever the size of the file. The ring and the stream are made at the first read
    and kept for the next files of the same restore."""

    def __init__(self) -> None:
        self._ring: list[Any] = []
        self._copied: list[Any] = []  # per buffer: the event of its last copy, or None
        self._stream: Any = None

    def read(
        self, handle: IO[bytes], head: memoryview, start: int, digests: Digests, device: Any
    ) -> tuple[Any, int] | None:
        """The whole file as a byte tensor on ``device`` and the bytes read (the first
        ``start`` of them already in ``head``, hashed), or ``None`` where the device has no
        room for it (the file is then read into host memory, as any other)."""
        import torch

        device = torch.device(device)
        try:
            target = torch.empty(head.nbytes, dtype=torch.uint8, device=device)
        except torch.cuda.OutOfMemoryError:
            return None
        cuda = device.type == "cuda"
        if not self._ring:
            self._ring = [_host_buffer(cuda) for _ in range(DEVICE_BUFFERS)]
            self._copied = [None] * DEVICE_BUFFERS
            self._stream = torch.cuda.Stream(device) if cuda else None  # type: ignore[no-untyped-call]
        if cuda:  # the target's memory may still be in use by work queued before it was free
            self._stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(self._stream) if cuda else contextlib.nullcontext():
            if start:
                target[:start].copy_(torch.frombuffer(head, dtype=torch.uint8, count=start))
            size = start
            with contextlib.closing(self._pieces(handle, start, target.numel())) as pieces:
                for slot, count in pieces:
                    piece = self._ring[slot][:count]
                    digests.update(memoryview(piece.numpy()))
                    target[size : size + count].copy_(piece, non_blocking=cuda)
                    if cuda:
                        self._copied[slot] = torch.cuda.Event()  # type: ignore[no-untyped-call]
                        self._copied[slot].record(self._stream)
                    size += count
        if cuda:
            self._stream.synchronize()  # every byte is on the device before it is used
            self._copied = [None] * len(self._ring)
        return target, size

    def _pieces(self, handle: IO[bytes], start: int, end: int) -> Generator[tuple[int, int]]:
        """``(buffer, bytes)`` for each piece of the file from ``start`` up to ``end`` (or
        its end, if sooner), read by a reader thread ahead of the caller into the buffers
        the caller has handed back by asking for the next piece. Closing it early stops the
        reader before it returns: the handle is not used after that."""
        free: queue.SimpleQueue[int | None] = queue.SimpleQueue()
        filled: queue.SimpleQueue[tuple[int, int] | BaseException | None] = queue.SimpleQueue()
        for slot in range(len(self._ring)):
            free.put(slot)

        def read_ahead() -> None:
            try:
                position = start
                while position < end and (slot := free.get()) is not None:
                    if self._copied[slot] is not None:
                        self._copied[slot].synchronize()  # its last piece is on the device
                    piece = self._ring[slot][: min(DEVICE_PIECE, end - position)]
                    count = read_into(handle, memoryview(piece.numpy()))
                    if count:
                        filled.put((slot, count))
                        position += count
                    if count < piece.numel():
                        break
                filled.put(None)
            except BaseException as exc:  # raised in the caller
                filled.put(exc)

        if not _READERS.submit(read_ahead):  # no thread can start: read in turn
            for slot in itertools.cycle(range(len(self._ring))):
                if start >= end:
                    return
                if self._copied[slot] is not None:
                    self._copied[slot].synchronize()  # its last piece is on the device
                piece = self._ring[slot][: min(DEVICE_PIECE, end - start)]
                count = read_into(handle, memoryview(piece.numpy()))
                if count:
                    yield slot, count
                    start += count
                if count < piece.numel():
                    return
        finished = False
        try:
            while (item := filled.get()) is not None:
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                yield item
                free.put(item[0])  # the caller has hashed it and queued its copy
            finished = True
        finally:
            if not finished:  # the caller stopped early: stop the reader, wait until it has
                free.put(None)
                while not isinstance(item := filled.get(), BaseException) and item is not None:
                    pass


#: The reader threads of :class:`DeviceReader` (one read at a time, so one thread).
_READERS = Workers("nbresume-read", 1)


def _host_buffer(pinned: bool) -> Any:
    """A host buffer of :data:`DEVICE_PIECE` bytes, pinned where asked and possible (a low
    locked-memory limit refuses it: pageable memory is correct, only slower)."""
    import torch

    if pinned:
        with contextlib.suppress(RuntimeError):
            return torch.empty(DEVICE_PIECE, dtype=torch.uint8, pin_memory=True)
    return torch.empty(DEVICE_PIECE, dtype=torch.uint8)


#: Below this many bytes left to read after a file's header, its buffer is filled as it is.
READY_MIN_BYTES = 2 * READ_CHUNK


def ready_for_rest(
    handle: IO[bytes], buffer: memoryview, start: int
) -> tuple[memoryview, Prefault | None]:
    """Once a file's header is checked, get the disk and the memory ready for the rest of it:
    the file is asked for into the page cache (``posix_fadvise(WILLNEED)``, so that the disk
    reads while memory is prepared), and the bytes read so far move into fresh memory whose
    pages a thread faults in ahead of the read (:class:`~nbresume.checkpoint.hashing.Prefault`,
    returned: the read waits for each piece's pages), or, where that cannot run, all at once
    (:func:`new_buffer` with ``populate``); either costs less than a fault per page during the
    read. Returns the buffer to read the rest into. Only what the read fills anyway is asked
    for: it runs once the header is checked against the file's size."""
    if buffer.nbytes - start < READY_MIN_BYTES:
        return buffer, None
    with contextlib.suppress(AttributeError, OSError, ValueError):  # no descriptor, not Linux
        os.posix_fadvise(handle.fileno(), start, buffer.nbytes - start, os.POSIX_FADV_WILLNEED)
    if can_prefault():
        ready = new_buffer(buffer.nbytes)
        ready[:start] = buffer[:start]
        return ready, Prefault(ready)
    ready = new_buffer(buffer.nbytes, populate=True)
    ready[:start] = buffer[:start]
    return ready, None


def read_checked_head(
    handle: IO[bytes], buffer: memoryview, total: int, digests: Digests, where: str
) -> tuple[int, bool]:
    """Read the first piece of a safetensors file into ``buffer`` (more if its header is
    longer) and check the header against the file's ``total`` size; return the bytes read
    and whether the header was checked (not when the file ends before its header does).

    A file that claims more bytes than its tensors account for (a sparse file of gigabytes)
    is refused here, before the rest is read: memory is bounded by what is valid (the
    buffer's untouched pages cost nothing). The first read is a full piece, not the 8-byte
    prefix alone: a cold file is then read in large sequential pieces from its start.
    """
    size = read_hashing(handle, buffer[:READ_CHUNK], digests)
    if size < 8:
        return size, False  # too short: the size check says so
    end = 8 + tensorfile.header_length(buffer[:8], total, where=where)
    if size < end:
        size += read_hashing(handle, buffer[size:end], digests)
        if size < end:
            return size, False  # cut short: the size check says so
    tensorfile.parse_header(bytes(buffer[:end]), where=where, total=total)
    return size, True


def has_manifest(store: Backend, name: str) -> bool:
    """Whether the folder holds anything named ``manifest.json``. One that is not a
    regular file (a FIFO, a link, a folder) makes a broken checkpoint, never a save that
    did not commit: it is reported, not passed over in silence (and never opened)."""
    path = store.local_path(name, MANIFEST_NAME)
    if path is not None:
        try:
            os.lstat(path)
        except (FileNotFoundError, NotADirectoryError):
            return False
        except OSError:
            return True  # cannot tell: report the folder rather than pass over it
        return True
    try:
        return MANIFEST_NAME in store.list_files(name)
    except FileNotFoundError:
        return False
    except StorageError:
        raise  # the store failed: said, not guessed
    except OSError:
        return True  # cannot tell: report the folder rather than pass over it in silence


#: A Checkpointer's generator states (``rng.safetensors``), checked by load and verify alike
#: with its state document (``state.json``).
RNG_FILE = "rng"


def parse_json(buffer: Buffer, *, where: str) -> Any:
    """A JSON file of a checkpoint, its nesting bounded (nothing later can recurse too deep)
    and the memory its parse takes a small multiple of its size
    (:func:`~nbresume.checkpoint.format.state_document.check_parse_cost`)."""
    state_document.check_parse_cost(buffer, where=where)
    try:
        document = json.loads(str(buffer, "utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise CorruptCheckpointError("not valid JSON", where=where) from None
    state_document.check_depth(document, where=where)
    return document


def decode_state(
    documents: Mapping[str, Any], tensors: Mapping[str, Mapping[str, Any]], *, where: str
) -> state_document.SavedState | None:
    """A Checkpointer's ``state.json`` checked against the tensors it refers to (``None``
    when the checkpoint has none: a store user's own files). A ``state.json`` next to an
    ``rng.safetensors`` is a Checkpointer's whatever it holds, so that a document replaced
    by something else entirely is refused here too. A Lightning checkpoint's document is
    checked as its load checks it (:mod:`~nbresume.checkpoint.format.lightning_format`)."""
    folder = where.rsplit("/", 1)[0]
    if lightning_format.is_lightning(documents, folder):
        lightning_format.decode(
            documents[lightning_format.DOCUMENT],
            tensors.get(lightning_format.TENSORS, {}),
            where=folder,
        )
    if STATE_FILE not in documents:
        return None
    document = documents[STATE_FILE]
    if not state_document.is_state_document(document) and RNG_FILE not in tensors:
        return None
    return state_document.decode_state(document, tensors, where=where)


def check_json_size(where: str, file_name: str, entry: FileEntry) -> None:
    if file_name.endswith(".json") and entry.size > MAX_JSON_BYTES:
        raise CorruptCheckpointError(
            f"the manifest says {entry.size} bytes, more than the limit of {MAX_JSON_BYTES} "
            "for a JSON file",
            where=where,
        )


class Unfit(Exception):
    """A checkpoint that does not fit, found from its tensor files' headers before their
    tensors were read: passed over like one that a load's check finds not to fit."""

    def __init__(self, error: CheckpointError) -> None:
        super().__init__(str(error))
        self.error = error


def load_folder(
    store: Backend,
    step: int,
    name: str,
    framework: str,
    devices: Mapping[str, Any] | None = None,
    *,
    fits: Callable[[LoadedCheckpoint], None] | None = None,
    targets: Callable[[LoadedCheckpoint], Mapping[str, Mapping[Span, Any]]] | None = None,
) -> LoadedCheckpoint:
    """One checkpoint read, verified and decoded (raises CorruptCheckpointError); the tensor
    files named in ``devices`` are read onto those devices (:func:`read_verified`).

    ``fits`` is first called with the checkpoint as its headers describe it (its JSON files
    read and verified, each tensor a :class:`~nbresume.checkpoint.format.TensorSpec`):
    a CheckpointError it raises that is no CorruptCheckpointError (the checkpoint does not
    fit the objects it is for) is raised as :class:`Unfit` before any memory is taken for
    the tensors, whatever the size the headers declare.

    ``targets`` (with ``fits``) then names, per tensor file, the live tensors its tensors are
    to be read into (by their byte range in the file's data area): those files are checked
    now and their tensors without a target read (:class:`~.streaming.Streamed`); the targets
    themselves take the saved bytes only when ``loaded.fill()`` is called, once the restore's
    plan is checked. Until then the checkpoint's tensors for them are the live tensors, as
    they were.

    An allocation refused on the way raises :class:`~nbresume.errors.MemoryLimitError`:
    memory, never a damaged checkpoint to pass over."""
    try:
        return _load_folder(store, step, name, framework, devices, fits=fits, targets=targets)
    except (MemoryError, RuntimeError, OSError) as exc:
        if not is_out_of_memory(exc):
            raise
        where = store.child(name)
        raise memory_error(exc, doing="reading the checkpoint", where=where) from None


def _load_folder(
    store: Backend,
    step: int,
    name: str,
    framework: str,
    devices: Mapping[str, Any] | None,
    *,
    fits: Callable[[LoadedCheckpoint], None] | None,
    targets: Callable[[LoadedCheckpoint], Mapping[str, Mapping[Span, Any]]] | None,
) -> LoadedCheckpoint:
    manifest = read_manifest(store, name, step)
    loaded = LoadedCheckpoint(step, store.child(name), manifest)
    # Nothing is parsed before every file's hash matched (a safetensors header excepted:
    # it is checked against the file's size before the tensor bytes are read).
    files = manifest.files
    if fits is not None:  # the JSON files are read and verified first, then the headers
        tensors = {n: e for n, e in files.items() if n.endswith(".safetensors")}
        heads, buffers = _read_heads(store, step, name, manifest, framework)
        try:
            fits(heads)
        except CorruptCheckpointError:
            raise
        except CheckpointError as exc:
            raise Unfit(exc) from None
        wanted = targets(heads) if targets is not None else {}
        streamed = [
            Streamed(store, name, n, e, buffers[n].data_start, buffers[n], wanted[n])
            for n, e in tensors.items()
            if wanted.get(n) and n not in (devices or {})
        ]
        for item in streamed:
            item.check()
            buffers[item.file_name] = Decoded(item.tensors)
        rest = {n: e for n, e in tensors.items() if not isinstance(buffers[n], Decoded)}
        buffers.update(read_verified(store, name, rest, devices))
        if streamed:
            loaded.fill = lambda: fill_all(streamed)
        # The JSON documents are parsed once: the headers' state is let go before the state
        # is rebuilt with its tensors.
        loaded.data.update(heads.data)
        heads.state = None
        buffers = {n: b for n, b in buffers.items() if n in tensors}
    else:
        buffers = read_verified(store, name, files, devices)
    decode_files(store, name, buffers, loaded, framework)
    if fits is None:
        check_loaded(loaded)
    return loaded


def _read_heads(
    store: Backend, step: int, name: str, manifest: Manifest, framework: str
) -> tuple[LoadedCheckpoint, dict[str, Any]]:
    """The checkpoint ``name`` as its headers describe it: its JSON files read and verified,
    each tensor a :class:`~nbresume.checkpoint.format.TensorSpec` of its file's header (no
    tensor bytes read), checked complete and consistent; and the buffers read (the JSON
    files' bytes, the tensor files' :class:`SpecsOnly`)."""
    files = manifest.files
    tensors = {n: e for n, e in files.items() if n.endswith(".safetensors")}
    heads = LoadedCheckpoint(step, store.child(name), manifest)
    buffers = read_verified(store, name, {n: e for n, e in files.items() if n not in tensors})
    buffers.update({n: read_specs(store, name, n, e) for n, e in tensors.items()})
    decode_files(store, name, buffers, heads, framework)
    check_loaded(heads)  # complete and consistent, before a byte of a tensor is read
    return heads, buffers


def verify_fit(
    store: Backend, result: VerifyResult, fits: Callable[[LoadedCheckpoint], None]
) -> VerifyResult:
    """``result`` (a checkpoint that verified), failed when ``fits`` refuses the checkpoint as
    its headers describe it: the check a load's ``fits`` makes (:func:`load_folder`), from the
    same headers, so that a verification with the objects gives a restore's verdict without
    reading a tensor or taking memory for one."""
    try:
        manifest = read_manifest(store, result.name, result.step)
        fits(_read_heads(store, result.step, result.name, manifest, "torch")[0])
    except (MemoryLimitError, StorageError):
        raise  # memory or the store failed: not the checkpoint
    except CheckpointError as exc:  # it does not fit (or, read again, no longer verifies)
        return dataclasses.replace(result, ok=False, problem=str(exc))
    except (MemoryError, RuntimeError, OSError) as exc:
        if not is_out_of_memory(exc):
            raise
        where = store.child(result.name)
        raise memory_error(exc, doing="reading the checkpoint", where=where) from None
    return result


def read_specs(store: Backend, name: str, file_name: str, entry: FileEntry) -> SpecsOnly:
    """The header of the tensor file ``file_name`` (checked against the size the manifest
    records, as a load checks it), read alone: only its first bytes are read."""
    where = store.child(name, file_name)
    try:
        with store.open_read(name, file_name) as handle:
            prefix = memoryview(bytearray(8))
            read_into(handle, prefix)
            head = bytearray(8 + tensorfile.header_length(prefix, entry.size, where=where))
            head[:8] = prefix
            read_into(handle, memoryview(head)[8:])
    except FileNotFoundError:
        raise CorruptCheckpointError("the file is missing", where=where) from None
    except (OSError, MemoryError, RuntimeError) as exc:
        raise read_failure(exc, where) from None
    data_start, specs, _ = tensorfile.parse_header(head, where=where, total=entry.size)
    return SpecsOnly(specs, data_start=data_start)


class SpecsOnly(dict[str, tensorfile.TensorSpec]):
    """A tensor file as its header describes it: each tensor's dtype and shape, no bytes."""

    def __init__(self, specs: Mapping[str, tensorfile.TensorSpec], *, data_start: int) -> None:
        super().__init__(specs)
        #: Where the file's data area starts (the byte after its header).
        self.data_start = data_start


class Decoded(dict[str, Any]):
    """A tensor file's tensors, already built (:class:`~.streaming.Streamed`)."""


def decode_files(
    store: Backend,
    name: str,
    buffers: Mapping[str, Any],
    loaded: LoadedCheckpoint,
    framework: str = "torch",
) -> None:
    """Decode verified files into ``loaded`` by their kind (safetensors or JSON), then check
    a Checkpointer's ``state.json`` against the tensors it refers to. A tensor file read onto
    a device (a byte tensor: :class:`DeviceReader`) gives tensors on that device."""
    for file_name, buffer in buffers.items():
        where = store.child(name, file_name)
        stem, kind = file_name.rsplit(".", 1)
        if isinstance(buffer, (SpecsOnly, Decoded)):
            loaded.tensors[stem] = buffer
        elif kind == "safetensors" and tensorfile.is_device_bytes(buffer):
            loaded.tensors[stem] = tensorfile.decode_device(buffer, where=where)
        elif kind == "safetensors":
            view = buffer if isinstance(buffer, (bytearray, memoryview)) else memoryview(buffer)
            loaded.tensors[stem] = tensorfile.decode(view, where=where, framework=framework)
        else:
            loaded.data[stem] = parse_json(buffer, where=where)
    loaded.state = decode_state(
        loaded.data, loaded.tensors, where=store.child(name, f"{STATE_FILE}.json")
    )


def newest_that_loads(
    candidates: Iterable[tuple[int, str]],
    load_one: Callable[[int, str], LoadedCheckpoint | None],
    *,
    location: str,
    step: int | None,
    check: Callable[[LoadedCheckpoint], None] | None = None,
) -> LoadedCheckpoint:
    """The reading policy: the first of ``candidates`` (newest first) that loads.

    ``load_one`` returns the checkpoint, ``None`` for a folder that was never committed
    (not a checkpoint: passed over in silence), or raises CorruptCheckpointError (passed over
    with a warning). ``check`` validates a checkpoint that loaded: a CorruptCheckpointError
    passes it over as a failed verification; any other CheckpointError (it does not fit)
    passes it over too and is raised, the newest one, when no older checkpoint is usable.
    Raises NoCheckpointError when none is usable.
    """
    skipped: list[VerifyResult] = []
    misfit: CheckpointError | None = None
    for found_step, name in candidates:
        where = "/".join([location.rstrip("/"), name])
        try:
            loaded = load_one(found_step, name)
        except CorruptCheckpointError as exc:
            skipped.append(VerifyResult(name, found_step, where, False, str(exc)))
            continue
        except Unfit as unfit:  # found from its headers, before its tensors were read
            misfit = misfit or unfit.error
            skipped.append(VerifyResult(name, found_step, where, False, str(unfit.error)))
            continue
        if loaded is None:
            continue
        try:
            if check is not None:
                check(loaded)
        except CheckpointError as exc:
            if not isinstance(exc, CorruptCheckpointError):
                misfit = misfit or exc
            skipped.append(VerifyResult(name, found_step, where, False, str(exc)))
            continue
        loaded.skipped = skipped
        if skipped:
            message = "; ".join(r.problem for r in skipped)
            reason = "failed verification" + (" or do not fit" if misfit else "")
            warnings.warn(
                f"nbresume: skipped {len(skipped)} newer checkpoint(s) that {reason} "
                f"({message}); using step {found_step}",
                RuntimeWarning,
                stacklevel=3,
            )
        return loaded
    if misfit is not None:
        raise misfit  # the objects changed: that, not corruption, is what to report
    if step is not None and not skipped:
        raise NoCheckpointError(f"there is no checkpoint of step {step}", where=location)
    if skipped:
        raise NoCheckpointError(
            f"no checkpoint verifies ({len(skipped)} checked): "
            + "; ".join(r.problem for r in skipped),
            where=location,
            fix="run `nbresume verify` on the folder for details",
        )
    raise NoCheckpointError("there is no checkpoint yet", where=location)
