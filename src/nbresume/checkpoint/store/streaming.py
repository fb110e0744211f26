"""A restore that reads tensors straight into the memory of the objects they are restored into.

A restore that reads every tensor file into fresh memory while the model's own parameters
still exist needs twice the state: inside a memory limit that held the save, it is killed.
Where the live objects already hold a tensor of the saved dtype and shape in plain host
memory (a module's parameters and buffers, an optimizer's state once it has some), the saved
bytes are read into that memory instead, so that a restore takes the state plus a few small
buffers.

The live tensors are overwritten only once the checkpoint is known to be whole, so that a
restore that fails still leaves every object as it was. Each file with such targets
(:class:`Streamed`) is read twice, each time hashed piece by piece and checked against its
manifest entry:

1. **Check** (:meth:`Streamed.check`, while the checkpoint is read and verified): the bytes
   of the tensors without a live target go into memory of their own (an optimizer without
   state yet: its state, allocated once); the others are only hashed, through a few small
   buffers. A file that does not match its manifest is refused here, before anything is
   changed: the checkpoint is passed over like any damaged one.
2. **Fill** (:meth:`Streamed.fill`, when the checked plan is applied, before anything else
   is changed): the file is read again, the targets' bytes straight into the live tensors,
   and hashed again. The second read comes from the page cache where memory allows.

A file that matches the first time and not the second was changed on disk during the
restore (a committed checkpoint is never written again by nbresume): the fill raises
:class:`~nbresume.errors.CorruptCheckpointError` and the checkpoint is passed over, and the
older one that is loaded instead writes every live tensor again. Only where no older
checkpoint loads are the live tensors left partly written, and the error says so.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO, Any

from nbresume.checkpoint.backends import READ_CHUNK, Backend, read_into
from nbresume.checkpoint.format import FileEntry, TensorSpec, tensorfile
from nbresume.checkpoint.store.hashing import THREAD_MIN_BYTES, Digests, check_hashes, new_buffer
from nbresume.checkpoint.store.memory import is_out_of_memory, memory_error
from nbresume.errors import CorruptCheckpointError, StorageError

#: The small buffers the bytes that are only hashed go through (each :data:`READ_CHUNK`).
SCRATCH_BUFFERS = 3

#: A tensor's byte range in its file's data area, ``(start, end)``, as its header says.
Span = tuple[int, int]


def writable_bytes(tensor: Any) -> memoryview:
    """The bytes of a contiguous host tensor, as writable memory (shared, not copied)."""
    import torch

    flat = tensor.detach().reshape(-1).view(torch.uint8)
    return memoryview(flat.numpy()).cast("B")


class Scratch:
    """The buffers of ``size`` bytes that bytes read only to be hashed go through: one where
    every hash runs in the caller, a few where a slow hash runs in a thread (a buffer is used
    again once its last piece is hashed)."""

    def __init__(self, digests: Digests, size: int = READ_CHUNK) -> None:
        self._digests = digests
        self._size = size
        self._count = SCRATCH_BUFFERS if digests.threaded else 1
        self._ring: list[bytearray] = []
        self._used: list[int] = []  # per buffer: the count of pieces hashed when it was last given
        self.given = 0  # pieces handed to the hash so far, in every buffer and target

    def hashed(self, piece: memoryview) -> None:
        self._digests.update(piece)
        self.given += 1

    def buffer(self) -> memoryview:
        if len(self._ring) < self._count:
            self._ring.append(bytearray(self._size))
            self._used.append(0)
            slot = len(self._ring) - 1
        else:
            slot = min(range(len(self._ring)), key=self._used.__getitem__)
            self._digests.wait(self._used[slot])  # its last piece is hashed: reuse it
        self._used[slot] = self.given + 1
        return memoryview(self._ring[slot])


def read_segments(
    handle: IO[bytes], segments: Iterable[memoryview | int], scratch: Scratch
) -> tuple[int, bool]:
    """Read a file from its start in order: into each memoryview given, in pieces of at most
    :data:`READ_CHUNK`, or, for a count, that many bytes through ``scratch``; every piece is
    hashed once read. Returns the bytes read and whether the file ended before the segments
    did (the size check then says so)."""
    size = 0
    for segment in segments:
        length = segment if isinstance(segment, int) else segment.nbytes
        done = 0
        while done < length:
            count = min(READ_CHUNK, length - done)
            if isinstance(segment, int):
                piece = scratch.buffer()[:count]
            else:
                piece = segment[done : done + count]
            got = read_into(handle, piece)
            if got:
                scratch.hashed(piece[:got])
            done += got
            size += got
            if got < count:
                return size, True
    return size, False


@dataclass
class Streamed:
    """One tensor file whose tensors are read into the live ones that ``targets`` names (by
    their byte range in the file's data area); its other tensors are read into memory of
    their own by :meth:`check`."""

    store: Backend
    folder: str
    file_name: str
    entry: FileEntry
    data_start: int
    specs: Mapping[str, TensorSpec]
    targets: Mapping[Span, Any]
    #: The tensors of the file, once checked: each live target itself, the others on memory
    #: of their own.
    tensors: dict[str, Any] = field(default_factory=dict)

    @property
    def where(self) -> str:
        return self.store.child(self.folder, self.file_name)

    def _order(self) -> list[tuple[str, TensorSpec]]:
        return sorted(self.specs.items(), key=lambda item: (item[1].start, item[1].end))

    def _own_spans(self) -> list[tuple[str, TensorSpec]]:
        """The tensors read into memory of their own: every one without a live target."""
        return [
            (key, spec)
            for key, spec in self._order()
            if spec.end > spec.start and (spec.start, spec.end) not in self.targets
        ]

    def check(self) -> None:
        """Read the file once, hashing it: the tensors without a live target into memory of
        their own (kept in :attr:`tensors`), the rest hashed only. Raises
        CorruptCheckpointError where the file does not match its manifest entry; nothing
        live is changed."""
        own = self._own_spans()
        try:
            memory = new_buffer(sum(spec.end - spec.start for _, spec in own))
        except (OSError, MemoryError) as exc:
            if not is_out_of_memory(exc):
                raise
            raise memory_error(exc, doing="reading the checkpoint", where=self.where) from None
        places: dict[Span, memoryview] = {}
        offset = 0
        for _, spec in own:
            places[(spec.start, spec.end)] = memory[offset : offset + spec.end - spec.start]
            offset += spec.end - spec.start
        self._read(places.get)
        self.tensors = self._build(memory, own)

    def fill(self) -> None:
        """Read the file again, each target's bytes straight into its live tensor, hashing
        it: raises CorruptCheckpointError where the file no longer matches its manifest
        entry (it changed after :meth:`check`)."""
        views = {span: writable_bytes(tensor) for span, tensor in self.targets.items()}
        try:
            self._read(views.get)
        except CorruptCheckpointError as exc:
            raise CorruptCheckpointError(
                f"{exc.message}, after it was checked: the file changed while it was being "
                "restored, and the live tensors read from it are partly written (a restore "
                "of an older checkpoint writes them all again)",
                where=self.where,
            ) from None

    def _read(self, target: Callable[[Span], memoryview | None]) -> None:
        digests = Digests(
            md5=self.entry.md5 is not None,
            threaded=self.entry.size >= THREAD_MIN_BYTES,
            algorithm=self.entry.algorithm,
        )
        try:
            segments: list[memoryview | int] = [self.data_start]
            for _, spec in self._order():
                if spec.end > spec.start:
                    view = target((spec.start, spec.end))
                    segments.append(spec.end - spec.start if view is None else view)
            largest = max((n for n in segments if isinstance(n, int)), default=1)
            scratch = Scratch(digests, min(READ_CHUNK, largest))
            try:
                with self.store.open_read(self.folder, self.file_name) as handle:
                    size, short = read_segments(handle, segments, scratch)
                    if not short and handle.read(1):
                        size += 1  # more bytes than the manifest says
            except FileNotFoundError:
                raise CorruptCheckpointError("the file is missing", where=self.where) from None
            except StorageError:
                raise  # the store failed, not the checkpoint
            except OSError as exc:
                if is_out_of_memory(exc):
                    raise memory_error(
                        exc, doing="reading the checkpoint", where=self.where
                    ) from None
                raise CorruptCheckpointError(
                    f"cannot read the file: {exc}", where=self.where
                ) from None
            digest, md5 = digests.result()
        finally:
            digests.cancel()
        check_hashes(self.where, self.entry, size, digest, md5)

    def _build(self, memory: memoryview, own: Sequence[tuple[str, TensorSpec]]) -> dict[str, Any]:
        """Every tensor of the file: the live targets, and the others on ``memory``, where
        :meth:`check` put them one after the other."""
        compact: dict[str, TensorSpec] = {}
        offset = 0
        for key, spec in own:
            compact[key] = TensorSpec(
                spec.dtype, spec.shape, offset, offset + spec.end - spec.start
            )
            offset += spec.end - spec.start
        empty = {
            key: TensorSpec(spec.dtype, spec.shape, 0, 0)
            for key, spec in self.specs.items()
            if spec.end == spec.start
        }
        out = tensorfile.decode_specs(memory, {**compact, **empty}, where=self.where)
        for key, spec in self.specs.items():
            live = self.targets.get((spec.start, spec.end))
            if live is not None and spec.end > spec.start:
                out[key] = live
        return out


def fill_all(streamed: Sequence[Streamed]) -> None:
    """:meth:`Streamed.fill` of every file, in turn."""
    for item in streamed:
        item.fill()
