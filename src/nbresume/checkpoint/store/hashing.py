"""Files written and read while they are hashed: the byte-level half of the commit protocol.

The hash of a checkpoint (:func:`default_hash`) is XXH3-128 where the ``xxhash`` package is
installed (it hashes at memory speed: tens of GB/s per core) and SHA-256 otherwise, or when
``NBRESUME_HASH=sha256`` asks for it; MD5 is added where the store compares MD5s.

Writing (:func:`write_files`): every file is written from the bytes in memory in pieces; a
fast hash hashes each piece just before it is written (the piece is then in the CPU's cache
once for both), a slow one (SHA-256, MD5) runs in a thread of its own over the same memory;
each written file is made durable (fsync) in a thread while the next one is written. Reading
(:class:`Digests` with :func:`read_hashing`): each piece read is hashed right after it is
read (a slow hash: in a thread while the next piece is read). The sizes and hashes are then
checked against a manifest's entry (:func:`check_hashes`); nothing read is parsed before it
matched.
"""

from __future__ import annotations

import contextlib
import hashlib
import queue
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import IO, Any

from nbresume import knobs
from nbresume.checkpoint import forksafe
from nbresume.checkpoint.backends import READ_CHUNK, Backend, read_into
from nbresume.checkpoint.forksafe import Workers
from nbresume.checkpoint.format import HASH_ALGORITHM, HASH_DIGITS, FileEntry, tensorfile
from nbresume.errors import CheckpointError, CorruptCheckpointError, UsageError

#: Files smaller than this are hashed in the calling thread: starting a thread costs more.
THREAD_MIN_BYTES = 1 << 20
#: Buffers kept for comparing pieces of files read back (one per piece size).
_READ_BACK_BUFFERS = 4

Buffer = bytes | bytearray | memoryview

#: The fast hash, written by default where its package is installed.
XXH3_128 = "xxh3-128"
#: The environment variable that picks the hash of new checkpoints ("sha256" or "xxh3-128").
HASH_VARIABLE = knobs.HASH.name
#: Hashes fast enough to run inline, piece by piece, in the thread that writes or reads.
_INLINE = frozenset({XXH3_128})


def xxhash_installed() -> bool:
    """Whether the ``xxhash`` package (XXH3-128) can be imported."""
    try:
        import xxhash  # noqa: F401
    except ImportError:
        return False
    return True


def default_hash(requested: str | None = None) -> str:
    """The hash of new checkpoints: ``requested``, else ``NBRESUME_HASH``, else XXH3-128 where
    ``xxhash`` is installed and SHA-256 where it is not."""
    name = requested or knobs.HASH.raw()
    if not name:
        return XXH3_128 if xxhash_installed() else HASH_ALGORITHM
    if name not in HASH_DIGITS:
        raise UsageError(
            f"hash {name!r} is not one nbresume writes",
            where=HASH_VARIABLE if not requested else "hash=",
            fix=f"use one of {sorted(HASH_DIGITS)}",
        )
    if name == XXH3_128 and not xxhash_installed():
        raise _no_xxhash(HASH_VARIABLE if not requested else "hash=")
    return name


def new_hash(algorithm: str, *, where: str = "") -> Any:
    """A fresh hash object of ``algorithm`` (``update(buffer)``, ``hexdigest()``)."""
    if algorithm == HASH_ALGORITHM:
        return hashlib.sha256()
    if algorithm == XXH3_128:
        try:
            import xxhash
        except ImportError:
            raise _no_xxhash(where) from None
        return xxhash.xxh3_128()
    raise CorruptCheckpointError(f"unknown hash {algorithm!r}", where=where)


def _no_xxhash(where: str) -> CheckpointError:
    # Not corruption: the checkpoint is fine, this Python lacks the package to check it.
    return CheckpointError(
        "this checkpoint is hashed with XXH3-128 and the xxhash package is not installed",
        where=where,
        fix="pip install xxhash (or save with NBRESUME_HASH=sha256)",
    )


@dataclass(frozen=True)
class Streamed:
    """A file whose bytes are made piece by piece as it is written, each piece valid only
    until the next is asked for (a GPU tensor staged through a small host buffer): its
    exact size, and ``chunks()`` to make its pieces."""

    size: int
    chunks: Callable[[], Iterable[Buffer]]


def write_files(
    store: Backend,
    folder: str,
    files: Sequence[tuple[str, Iterable[bytes | memoryview] | Streamed]],
    *,
    md5: bool,
    algorithm: str = HASH_ALGORITHM,
    closer: DurableCloser | None = None,
) -> dict[str, FileEntry]:
    """Write each file from its chunks and make it durable; return their entries.

    Three things overlap: the files are written one after the other; each file is made
    durable (fsync) in a worker thread while the next one is written; and every file's hashes
    are computed from the same memory: a fast hash piece by piece just before each piece is
    written, a slow one in threads of their own that all start at once. Only when every file
    is durable and hashed does this return; with a ``closer`` given, once every file is
    hashed, and the files are durable after ``closer.finish()``. A :class:`Streamed` file's
    pieces are made one at a time, each hashed by every hash and written before the next.
    """
    started: list[tuple[str, Iterable[Buffer] | Streamed, int, Digests]] = []
    own_closer = closer is None
    try:
        for name, given in files:
            if isinstance(given, Streamed):
                # No slow hash may read a piece after it is written: its memory is reused.
                digests = Digests(md5=md5, threaded=False, algorithm=algorithm)
                started.append((name, given, given.size, digests))
                continue
            chunks = given if isinstance(given, Sequence) else list(given)
            size = sum(len(c) if isinstance(c, bytes) else c.nbytes for c in chunks)
            digests = Digests(md5=md5, threaded=size >= THREAD_MIN_BYTES, algorithm=algorithm)
            started.append((name, chunks, size, digests))
            for chunk in chunks:
                digests.update_threaded(chunk)
        total = sum(size for _, _, size, _ in started)
        if closer is None:
            closer = DurableCloser(store, threaded=len(files) > 1 and total >= THREAD_MIN_BYTES)
        for name, source, size, digests in started:
            closer.check()  # an earlier file failed to become durable: stop here
            handle: IO[bytes] = store.open_write(folder, name)
            try:
                written = 0
                for chunk in source.chunks() if isinstance(source, Streamed) else source:
                    view = memoryview(chunk).cast("B")
                    for start in range(0, view.nbytes, READ_CHUNK):
                        piece = view[start : start + READ_CHUNK]
                        digests.update_inline(piece)
                        handle.write(piece)
                    written += view.nbytes
                if written != size:  # the manifest would record a size the file does not have
                    raise CheckpointError(
                        f"{written} bytes were made for a file announced as {size} bytes",
                        where=name,
                    )
            except BaseException:
                handle.close()
                raise
            closer.close(handle)
        if own_closer:
            closer.finish()
        entries = {}
        for name, _, size, digests in started:
            digest, md5_hex = digests.result()
            entries[name] = FileEntry(size, digest, md5_hex, algorithm)
        return entries
    except BaseException:
        if closer is not None:
            closer.abandon()  # every handle closed before the cleanup
        raise
    finally:
        for *_, digests in started:
            digests.cancel()


def check_bytes(where: str, entry: FileEntry, data: Buffer) -> None:
    """The bytes of a whole file, held in memory, against the manifest's entry."""
    digests = Digests(md5=entry.md5 is not None, threaded=False, algorithm=entry.algorithm)
    digests.update(data)
    check_hashes(where, entry, memoryview(data).nbytes, *digests.result())


def check_size(where: str, entry: FileEntry, size: int) -> None:
    if size != entry.size:
        relation = "larger" if size > entry.size else "smaller"
        raise CorruptCheckpointError(
            f"size mismatch: the manifest says {entry.size} bytes, the file is {relation}"
            + ("" if size > entry.size else f" ({size} bytes)"),
            where=where,
        )


def check_hashes(where: str, entry: FileEntry, size: int, digest: str, md5: str | None) -> None:
    """Size, then the digest of ``entry.algorithm`` and the MD5 (where both are recorded)."""
    check_size(where, entry, size)
    if digest != entry.digest:
        raise CorruptCheckpointError(
            f"{entry.algorithm} mismatch: the file's bytes have changed", where=where
        )
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


def new_buffer(size: int, *, populate: bool = False) -> memoryview:
    """Writable memory for ``size`` bytes that a read fills (nothing is written to it first).

    An anonymous mapping of plain pages, not NumPy's memory: NumPy asks for transparent huge
    pages (``MADV_HUGEPAGE``) on every large array, and where the kernel's ``defrag``
    setting is ``madvise`` (a common default) the first touch of each 2 MiB page then
    compacts memory synchronously. Measured here under load, reading 336 MB from the page
    cache into NumPy's memory took 0.07 to 0.9 s (0.07 to 0.59 s in the kernel), into plain
    pages 0.25 to 0.39 s, into memory already touched 0.035 to 0.06 s. Untouched pages cost
    nothing, so a file refused after its header is read has not cost its size in memory.

    With ``populate`` (for memory the caller will fill anyway) every page is faulted in at
    once where the system can (``MAP_POPULATE``, Linux): measured here, reading 336 MB from
    the page cache into it took 0.22 s of CPU against 0.32 s faulting page by page, and
    unmapping it 0.04 s against 0.11 s.
    """
    import mmap

    if size == 0:
        return memoryview(bytearray())
    if populate and hasattr(mmap, "MAP_POPULATE"):
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE
        return memoryview(mmap.mmap(-1, size, flags=flags))
    return memoryview(mmap.mmap(-1, size))


def read_hashing(
    handle: IO[bytes],
    buffer: memoryview,
    digests: Digests,
    ahead: Prefault | None = None,
    offset: int = 0,
) -> int:
    """Fill ``buffer`` from ``handle`` in pieces, each handed to ``digests`` once read; with
    ``ahead`` (the pages of the memory ``buffer`` starts ``offset`` bytes into, being faulted
    in by a thread), each piece is read once its pages are in."""
    size = 0
    while size < buffer.nbytes:
        piece = buffer[size : size + READ_CHUNK]
        if ahead is not None:
            ahead.wait(offset + size + piece.nbytes)
        count = read_into(handle, piece)
        if count:
            digests.update(piece[:count])
            size += count
        if count < piece.nbytes:
            break
    return size


class Prefault:
    """Faults in the pages of fresh memory (a :func:`new_buffer`) in a thread, ahead of the
    read that fills it, so that the two overlap: the first write to a page of fresh memory
    costs a fault and a zeroed page, as much time as reading it from a fast disk (250 ms for
    500 MB on a 2-core virtual machine). Pages go in pieces of :data:`PREFAULT_PIECE` bytes
    through ``madvise(MADV_POPULATE_WRITE)`` (Linux 5.14 and later), which releases the GIL
    (ctypes) and writes nothing. Where that call is missing, nothing is faulted in ahead and
    the read faults each page itself. :meth:`close` stops the thread; the memory stays mapped
    until it has."""

    def __init__(self, buffer: memoryview) -> None:
        self._memory = buffer.obj  # kept mapped while the thread works on it
        self._size = buffer.nbytes
        self._done = 0
        self._stop = False
        self._finished = False
        self._changed = forksafe.condition()
        address = _address(buffer)
        if address is None or not _PREFAULTERS.submit(lambda: self._run(address)):
            self._finished = True

    def _run(self, address: int) -> None:
        try:
            while not self._stop and self._done < self._size:
                count = min(PREFAULT_PIECE, self._size - self._done)
                if not _populate(address + self._done, count):
                    break  # not supported here: the read faults its pages itself
                with self._changed:
                    self._done += count
                    self._changed.notify_all()
        finally:
            with self._changed:
                self._finished = True
                self._changed.notify_all()

    def wait(self, end: int) -> None:
        """Until the first ``end`` bytes are faulted in (or the thread stopped)."""
        with self._changed:
            self._changed.wait_for(lambda: self._done >= end or self._finished)

    def close(self) -> None:
        """Stop faulting in; return once the thread no longer touches the memory."""
        with self._changed:
            self._stop = True
            self._changed.wait_for(lambda: self._finished)


#: The pieces :class:`Prefault` faults in at a time.
PREFAULT_PIECE = 8 << 20
#: ``MADV_POPULATE_WRITE`` (Linux 5.14); cleared after it fails once (an older kernel).
_POPULATE_WRITE = [23]
_PREFAULTERS = Workers("nbresume-prefault", 1)


def can_prefault() -> bool:
    """Whether :class:`Prefault` can fault pages in ahead here (Linux, and the call not seen
    to fail)."""
    return bool(_POPULATE_WRITE) and _madvise() is not None


def _populate(address: int, count: int) -> bool:
    madvise = _madvise()
    if madvise is None or not _POPULATE_WRITE:
        return False
    if madvise(address, count, _POPULATE_WRITE[0]) == 0:
        return True
    import ctypes
    import errno

    if ctypes.get_errno() == errno.EINVAL:
        _POPULATE_WRITE.clear()  # a kernel before 5.14: no use asking again
    return False  # else (out of memory, a signal): this read faults its own pages


_LIBC: list[Any] = []


def _madvise() -> Any:
    """libc's ``madvise`` through ctypes (which releases the GIL around it), or ``None``."""
    if not _LIBC:
        import ctypes
        import sys

        function = None
        if sys.platform.startswith("linux"):
            with contextlib.suppress(OSError, AttributeError):
                function = ctypes.CDLL(None, use_errno=True).madvise
                function.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
                function.restype = ctypes.c_int
        _LIBC.append(function)
    return _LIBC[0]


def _address(buffer: memoryview) -> int | None:
    """The address of a writable buffer's first byte."""
    import ctypes

    try:
        anchor = ctypes.c_char.from_buffer(buffer)
    except (TypeError, ValueError):
        return None
    address = ctypes.addressof(anchor)
    del anchor  # the export ends here: the mapping can be closed later
    return address


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
        self._changed = forksafe.condition()
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

    @property
    def threaded(self) -> bool:
        """Whether the hashing happens in a thread of its own."""
        return self._thread is not None

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
    """The hash ``algorithm`` (SHA-256 by default), and optionally MD5, of one file's bytes.

    With ``threaded``, a slow hash (SHA-256, MD5) runs in a thread of its own; a fast one
    (XXH3-128) always runs in the caller, on each buffer as it is given: at memory speed a
    thread would cost more than it saves, and the buffer is still in the CPU's cache.
    """

    def __init__(self, *, md5: bool, threaded: bool, algorithm: str = HASH_ALGORITHM) -> None:
        inline = algorithm in _INLINE
        self._threads = [HashThread(new_hash(algorithm), threaded=threaded and not inline)]
        if md5:
            self._threads.append(HashThread(hashlib.md5(usedforsecurity=False), threaded=threaded))

    @property
    def threaded(self) -> bool:
        """Whether a hash runs in a thread of its own (a buffer given may be read later)."""
        return any(thread.threaded for thread in self._threads)

    def update(self, data: Buffer) -> None:
        for thread in self._threads:
            thread.update(data)

    def update_threaded(self, data: Buffer) -> None:
        """Hand ``data`` to the hashes that run in threads (the others: :meth:`update_inline`)."""
        for thread in self._threads:
            if thread.threaded:
                thread.update(data)

    def update_inline(self, data: Buffer) -> None:
        """Hash ``data`` now with the hashes that run in the caller."""
        for thread in self._threads:
            if not thread.threaded:
                thread.update(data)

    def wait(self, count: int) -> None:
        for thread in self._threads:
            thread.wait(count)

    def result(self) -> tuple[str, str | None]:
        """(digest, MD5 or ``None``) in hex, once every buffer given is hashed."""
        digest = self._threads[0].hexdigest()
        return digest, self._threads[1].hexdigest() if len(self._threads) > 1 else None

    def cancel(self) -> None:
        for thread in self._threads:
            thread.cancel()


#: Files made durable at the same time by :class:`DurableCloser`: their fsyncs overlap, and a
#: journaling file system (ext4, XFS) commits fsyncs that wait together in one journal commit.
DURABLE_WORKERS = 4
_WORKERS = Workers("nbresume-fsync", DURABLE_WORKERS)


class DurableCloser:
    """Makes written files durable (:meth:`Backend.close_durably`) in worker threads, several
    at once, while the caller writes the next file. The first failure is raised in the caller
    (by :meth:`check` or :meth:`finish`); files given after it are only closed. Without
    ``threaded``, each file is made durable in the caller as it is given.

    Each file given is a :class:`_Closing` that a worker claims before it starts on it, so
    that :meth:`abandon` (after an error or a ``KeyboardInterrupt``, which may arrive between
    any two lines, even while a file is being handed to the workers) waits only for files a
    worker is working on, and closes the unclaimed ones itself: it never waits for a file
    that no worker will take."""

    def __init__(self, store: Backend, *, threaded: bool) -> None:
        self._store = store
        self._threaded = threaded
        self._error: BaseException | None = None
        self._given: list[_Closing] = []
        self._changed = forksafe.condition()

    def close(self, handle: IO[bytes]) -> None:
        if not self._threaded:
            self._store.close_durably(handle)
            return
        closing = _Closing(handle)
        with self._changed:
            self._given.append(closing)
        if not _WORKERS.submit(lambda: self._run(closing)):
            self._run(closing)  # no worker can start: made durable here

    def _run(self, closing: _Closing) -> None:
        with self._changed:
            if closing.state != _Closing.GIVEN:  # abandoned before a worker took it
                return
            closing.state = _Closing.WORKING
        try:
            if self._error is not None:
                with contextlib.suppress(OSError):
                    closing.handle.close()
            else:
                self._store.close_durably(closing.handle)
        except BaseException as exc:
            with self._changed:
                self._error = self._error or exc
        finally:
            with self._changed:
                closing.state = _Closing.DONE
                self._changed.notify_all()

    def check(self) -> None:
        if self._error is not None:
            raise self._error

    def finish(self) -> None:
        """Wait until every file given is durable; raise the first failure."""
        with self._changed:
            self._changed.wait_for(lambda: all(c.state == _Closing.DONE for c in self._given))
        self.check()

    def abandon(self) -> None:
        """Close every file given, durable or not: wait for those a worker is making durable,
        close the others here."""
        with self._changed:
            unclaimed = [c for c in self._given if c.state == _Closing.GIVEN]
            for closing in unclaimed:
                closing.state = _Closing.DONE
        for closing in unclaimed:
            with contextlib.suppress(OSError):
                closing.handle.close()
        with self._changed:
            self._changed.wait_for(lambda: all(c.state == _Closing.DONE for c in self._given))


class _Closing:
    """One file given to a :class:`DurableCloser`, and how far it has got."""

    GIVEN, WORKING, DONE = "given", "working", "done"

    def __init__(self, handle: IO[bytes]) -> None:
        self.handle = handle
        self.state = _Closing.GIVEN


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
