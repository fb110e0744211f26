"""Files written and read while they are hashed: the byte-level half of the commit protocol.

Writing (:func:`write_files`): every file is written from the bytes in memory while threads
of their own hash the same bytes (SHA-256, and MD5 where the store compares MD5s), and each
written file is made durable (fsync) in a thread while the next one is written. Reading
(:class:`Digests` with :func:`read_hashing`): each piece read is hashed in a thread while the
next piece is read. The sizes and hashes are then checked against a manifest's entry
(:func:`check_hashes`); nothing read is parsed before it matched.
"""

from __future__ import annotations

import contextlib
import hashlib
import mmap
import queue
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import IO, Any

from nbresume.checkpoint import tensorfile
from nbresume.checkpoint.format import FileEntry
from nbresume.checkpoint.storage import READ_CHUNK, Store, read_into
from nbresume.errors import CorruptCheckpointError

#: Files smaller than this are hashed in the calling thread: starting a thread costs more.
THREAD_MIN_BYTES = 1 << 20
#: Files from this size on are loaded into memory in huge pages (where the system has them).
_HUGE_PAGE_MIN_BYTES = 2 << 20
#: Buffers kept for comparing pieces of files read back (one per piece size).
_READ_BACK_BUFFERS = 4

Buffer = bytes | bytearray | memoryview


def write_files(
    store: Store,
    folder: str,
    files: Sequence[tuple[str, Iterable[bytes | memoryview]]],
    *,
    md5: bool,
) -> dict[str, FileEntry]:
    """Write each file from its chunks and make it durable; return their entries.

    Three things overlap: the files are written one after the other; each file is made
    durable (fsync) in a thread while the next one is written; and every file's hashes
    are computed from the same memory in threads of their own that all start at once.
    Only when every file is durable and hashed does this return.
    """
    started: list[tuple[str, Sequence[bytes | memoryview], int, Digests]] = []
    closer: DurableCloser | None = None
    try:
        for name, given in files:
            chunks = given if isinstance(given, Sequence) else list(given)
            size = sum(len(c) if isinstance(c, bytes) else c.nbytes for c in chunks)
            digests = Digests(md5=md5, threaded=size >= THREAD_MIN_BYTES)
            started.append((name, chunks, size, digests))
            for chunk in chunks:
                digests.update(chunk)
        total = sum(size for _, _, size, _ in started)
        closer = DurableCloser(store, threaded=len(files) > 1 and total >= THREAD_MIN_BYTES)
        for name, chunks, _, _ in started:
            closer.check()  # an earlier file failed to become durable: stop here
            handle: IO[bytes] = store.open_write(folder, name)
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
            sha256, md5_hex = digests.result()
            entries[name] = FileEntry(size=size, sha256=sha256, md5=md5_hex)
        return entries
    finally:
        if closer is not None:
            closer.abandon()  # after a failure: every handle closed before the cleanup
        for *_, digests in started:
            digests.cancel()


def check_file(where: str, entry: FileEntry, size: int, sha256: str, md5: Any) -> None:
    """Size and hashes against the manifest's entry (``md5``: a hash object or ``None``)."""
    check_hashes(where, entry, size, sha256, None if md5 is None else md5.hexdigest())


def check_size(where: str, entry: FileEntry, size: int) -> None:
    if size != entry.size:
        relation = "larger" if size > entry.size else "smaller"
        raise CorruptCheckpointError(
            f"size mismatch: the manifest says {entry.size} bytes, the file is {relation}"
            + ("" if size > entry.size else f" ({size} bytes)"),
            where=where,
        )


def check_hashes(where: str, entry: FileEntry, size: int, sha256: str, md5: str | None) -> None:
    check_size(where, entry, size)
    if sha256 != entry.sha256:
        raise CorruptCheckpointError("sha256 mismatch: the file's bytes have changed", where=where)
    if md5 is not None and md5 != entry.md5:
        raise CorruptCheckpointError("md5 mismatch: the file's bytes have changed", where=where)


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


class Head:
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


def new_buffer(size: int) -> memoryview:
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


def read_hashing(handle: IO[bytes], buffer: memoryview, digests: Digests) -> int:
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


def read_unsized(handle: IO[bytes], limit: int, digests: Digests) -> tuple[memoryview, int]:
    """A file whose size its file object cannot tell, read up to one byte past ``limit``."""
    pieces = []
    size = 0
    while size <= limit and (chunk := handle.read(min(READ_CHUNK, limit + 1 - size))):
        digests.update(chunk)
        pieces.append(chunk)
        size += len(chunk)
    return memoryview(bytearray(b"".join(pieces))), size


def _start_thread(target: Callable[[], None], name: str) -> threading.Thread | None:
    """A daemon thread running ``target``, or ``None`` where none can start (an interpreter
    far in its shutdown): the caller then does the work itself."""
    thread = threading.Thread(target=target, name=name, daemon=True)
    try:
        thread.start()
    except RuntimeError:
        return None
    return thread


class HashThread:
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
        self._thread = _start_thread(self._run, "nbresume-hash") if threaded else None

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


class Digests:
    """SHA-256, and optionally MD5, of one file's bytes, each in a thread of its own."""

    def __init__(self, *, md5: bool, threaded: bool) -> None:
        self._threads = [HashThread(hashlib.sha256(), threaded=threaded)]
        if md5:
            self._threads.append(HashThread(hashlib.md5(usedforsecurity=False), threaded=threaded))

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


class DurableCloser:
    """Makes written files durable (:meth:`Store.close_durably`) one after the other in a
    thread of its own, so that the next file is written meanwhile. The first failure is
    raised in the caller (by :meth:`check` or :meth:`finish`); later files are only closed."""

    def __init__(self, store: Store, *, threaded: bool) -> None:
        self._store = store
        self._queue: queue.SimpleQueue[IO[bytes] | None] = queue.SimpleQueue()
        self._error: BaseException | None = None
        self._thread = _start_thread(self._run, "nbresume-fsync") if threaded else None

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


class ReadBackBuffers:
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
