"""Capturing the training state: from the live objects to a snapshot, and its host copies.

1. **Capture** (:func:`capture`): every stateful object's ``state_dict()``, the plain values,
   the RNG states (of every rank, under ``torch.distributed``) and the loop's counters become a
   :class:`Snapshot`: tensor groups (one safetensors file each) and one ``state.json``
   document. For a background save the tensors are copied into :class:`HostBuffers` first,
   reused from one save to the next (pinned when the tensor lives on CUDA), so that training
   is blocked only for that copy.
2. **Staged** (:class:`Stager`): a save written from the live tensors copies those on a GPU
   through a few small pinned buffers, piece by piece, each copied while the one before is
   written: the files are the same bytes as a copy of the whole state would give.

Writing a snapshot, now or in the background, and reporting the save is
:mod:`nbresume.checkpoint.loop.saver`'s.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from nbresume import knobs
from nbresume.checkpoint import forksafe
from nbresume.checkpoint.forksafe import Workers
from nbresume.checkpoint.format import STATE_VERSION, capture_rng, flatten
from nbresume.checkpoint.state.stateful import Stateful

log = logging.getLogger("nbresume")

#: The tensor groups of RNGs and plain values (the state document is format's STATE_FILE).
RNG_GROUP = "rng"
VALUES_GROUP = "values"
#: The tensor group (and state member) of gradients pending between two optimizer steps.
GRADIENTS_GROUP = "gradients"


class Snapshot:
    """Everything one checkpoint holds, detached from the live training objects (its tensors
    are the live ones until :meth:`~nbresume.checkpoint.loop.saver.Saver.mirror` copies them:
    ``live``)."""

    def __init__(self, step: int, tensors: dict[str, dict[str, Any]], state: dict[str, Any],
                 metrics: dict[str, float]) -> None:  # fmt: skip
        self.step = step
        self.tensors = tensors
        self.state = state
        self.metrics = metrics
        self.live = True
        #: Waits until the copies of GPU tensors into the host buffers have landed (they run
        #: on a stream of their own while training goes on: :class:`HostBuffers`).
        self.landed: Callable[[], None] = _nothing


def _nothing() -> None:
    return None


def tensor_bytes(tensors: dict[str, dict[str, Any]]) -> int:
    """The bytes of ``tensors``."""
    return sum(int(value.nbytes) for members in tensors.values() for value in members.values())


class HostBuffers:
    """Host copies of tensors, reused across saves so that a save allocates nothing new."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, str], Any] = {}

    def missing(self, tensors: dict[str, dict[str, Any]]) -> int:
        """The bytes a :meth:`copy` of ``tensors`` allocates: those of the tensors that no
        buffer held from an earlier copy takes."""
        needed = 0
        for group, members in tensors.items():
            for key, value in members.items():
                buffer = self._buffers.get((group, key))
                same = buffer is not None and (tuple(buffer.shape), str(buffer.dtype)) == (
                    tuple(value.shape),
                    str(value.dtype),
                )
                needed += 0 if same else int(value.nbytes)
        return needed

    def copy(
        self, tensors: dict[str, dict[str, Any]]
    ) -> tuple[dict[str, dict[str, Any]], Callable[[], None]]:
        """Copies of ``tensors`` in the host buffers, and a wait for the copies of GPU tensors
        to land (:func:`copy_from_gpus`): until it returns, the buffers must not be read."""
        out: dict[str, dict[str, Any]] = {}
        pieces = PieceCopy()
        from_gpu: list[tuple[Any, Any]] = []
        for group, members in tensors.items():
            out[group] = {}
            for key, value in members.items():
                out[group][key] = self._copy_one((group, key), value, pieces, from_gpu)
        pieces.run()
        return out, copy_from_gpus(from_gpu) if from_gpu else _nothing

    def _copy_one(
        self, slot: tuple[str, str], value: Any, pieces: PieceCopy, from_gpu: list[tuple[Any, Any]]
    ) -> Any:
        if type(value).__module__.startswith("numpy"):
            import numpy as np

            buffer = self._buffers.get(slot)
            if (
                not isinstance(buffer, np.ndarray)
                or buffer.shape != value.shape
                or (buffer.dtype != value.dtype)
            ):
                buffer = np.empty_like(value)
                self._buffers[slot] = buffer
            np.copyto(buffer, value)
            return buffer
        import torch

        source = value.detach()
        buffer = self._buffers.get(slot)
        if (
            not isinstance(buffer, torch.Tensor)
            or buffer.shape != source.shape
            or buffer.dtype != source.dtype
        ):
            buffer = host_buffer(source)  # pinned for a CUDA tensor, when pinning works
            self._buffers[slot] = buffer
        if source.is_cuda:
            from_gpu.append((buffer, source))
        elif not pieces.add(buffer, source):
            buffer.copy_(source)
        return buffer


def copy_from_gpus(copies: list[tuple[Any, Any]]) -> Callable[[], None]:
    """Start the copies of GPU tensors into their host buffers (``(buffer, source)`` pairs)
    and return a wait for them to land.

    Where the buffers are pinned and the device has room (:func:`stash_fits`), the tensors
    are first copied within the GPU, in the training's own stream (at the GPU's memory speed:
    under a millisecond per GB on an H100), then from there to the host on a stream of their
    own while training goes on: whatever the training does next comes after the first copy
    in its stream, so the checkpoint holds the state of its step, and training waits only
    for that first copy. Elsewhere they are copied to the host straight away, and this waits
    for them (the copy from a GPU into host memory runs at the bus's speed: about 20 ms per
    GB on a PCIe 5 card, 80 ms on a T4)."""
    import torch

    by_device: dict[Any, list[tuple[Any, Any]]] = {}
    for buffer, source in copies:
        by_device.setdefault(source.device, []).append((buffer, source))
    landings: list[Any] = []
    for device, pairs in by_device.items():
        stashed = knobs.gpu_snapshot() and all(
            buffer.is_pinned() and type(source) is torch.Tensor for buffer, source in pairs
        )
        stashes = _stash(device, [source for _, source in pairs]) if stashed else None
        if stashes is None:
            for buffer, source in pairs:
                buffer.copy_(source, non_blocking=True)
            torch.cuda.current_stream(device).synchronize()  # they land before the write
            continue
        side = _side_stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for (buffer, _), stash in zip(pairs, stashes, strict=True):
                buffer.copy_(stash, non_blocking=True)
                stash.record_stream(side)  # its memory is reused only after this copy
        landed = torch.cuda.Event()  # type: ignore[no-untyped-call]
        landed.record(side)
        landings.append(landed)
    if not landings:
        return _nothing

    def wait() -> None:
        for landed in landings:
            landed.synchronize()

    return wait


def _stash(device: Any, sources: list[Any]) -> list[Any] | None:
    """Copies of ``sources`` in the GPU's memory, queued in the current stream; ``None`` where
    the device has no room for them (:func:`stash_fits`)."""
    import torch

    needed = sum(int(source.nbytes) for source in sources)
    if not stash_fits(device, needed):
        return None
    try:
        stashes = [
            torch.empty(source.shape, dtype=source.dtype, device=device) for source in sources
        ]
    except torch.cuda.OutOfMemoryError:
        return None
    for stash, source in zip(stashes, sources, strict=True):
        stash.copy_(source.detach())
    return stashes


#: Room a copy on the GPU leaves free on top of the training's peak: the larger of these.
STASH_MARGIN_BYTES = 512 << 20
STASH_MARGIN_SHARE = 0.05


def stash_fits(device: Any, needed: int) -> bool:
    """Whether a copy of ``needed`` bytes in ``device``'s memory fits beside the training's
    peak (the most this process has had allocated on it) with a margin, in what this process
    can hold there (its own reserved memory and the device's free memory): a copy that lives
    while the next step runs must never make that step run out of memory."""
    import torch

    free, total = torch.cuda.mem_get_info(device)
    reserved = torch.cuda.memory_reserved(device)
    peak = max(torch.cuda.max_memory_allocated(device), torch.cuda.memory_allocated(device))
    margin = max(STASH_MARGIN_BYTES, int(STASH_MARGIN_SHARE * total))
    return peak + needed + margin <= free + reserved


_SIDE_STREAMS: dict[Any, Any] = {}


def _side_stream(device: Any) -> Any:
    """The stream the copies from the GPU's memory to the host run on, one per device."""
    import torch

    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
    return _SIDE_STREAMS[device]


#: The pieces a snapshot's copy is cut into (:class:`PieceCopy`).
COPY_PIECE = 8 << 20


class PieceCopy:
    """Copies of contiguous host tensors, cut into pieces of :data:`COPY_PIECE` bytes that the
    training thread and one helper thread take in turn, one memcpy each (NumPy releases the
    GIL while it copies).

    torch's own ``copy_`` splits a large copy across its intra-op threads, which wait for
    each other: on a machine whose cores are busy (2 cores, other processes running) copying
    504 MB that way took 0.15 to 2.8 s, against 0.09 to 0.13 s in one thread. Here nobody
    waits for a thread that is not running: the training thread copies every piece the helper
    has not taken, and waits at the end only for the pieces the helper is copying (one at
    most). With a free core the copy takes about half as long as in one thread.
    """

    def __init__(self) -> None:
        self._pieces: list[tuple[Any, Any]] = []
        self._lock = forksafe.lock()
        self._idle = forksafe.condition(self._lock)
        self._next = 0
        self._busy = 0
        self._closed = False
        self._failed: list[int] = []

    def add(self, buffer: Any, source: Any) -> bool:
        """Take the copy of ``source`` into ``buffer`` (done by :meth:`run`); ``False`` (not
        taken) for anything but a contiguous host tensor (a GPU tensor, another layout, a
        conjugate view)."""
        import torch

        if (
            source.device.type != "cpu"
            or type(source) is not torch.Tensor
            or not source.is_contiguous()
            or not buffer.is_contiguous()
            or source.is_conj()
            or source.is_neg()
            or source.numel() == 0
        ):
            return False
        target = buffer.reshape(-1).view(torch.uint8).numpy()
        data = source.reshape(-1).view(torch.uint8).numpy()
        for start in range(0, data.nbytes, COPY_PIECE):
            end = start + COPY_PIECE
            self._pieces.append((target[start:end], data[start:end]))
        return True

    def run(self) -> None:
        """Copy every piece taken; return when all are copied."""
        if len(self._pieces) > 1:
            _COPIER.submit(lambda: self._work(helper=True))  # else this thread copies all
        self._work(helper=False)
        with self._lock:
            self._closed = True
            self._idle.wait_for(lambda: self._busy == 0)
        import numpy as np

        for index in self._failed:  # a piece the helper failed to copy is copied here
            np.copyto(*self._pieces[index])

    def _take(self) -> int | None:
        with self._lock:
            if self._closed or self._next >= len(self._pieces):
                return None
            self._next += 1
            self._busy += 1
            return self._next - 1

    def _work(self, *, helper: bool) -> None:
        import numpy as np

        while (index := self._take()) is not None:
            try:
                np.copyto(*self._pieces[index])
            except BaseException:
                if not helper:
                    raise
                self._failed.append(index)  # copied again by the caller of run()
            finally:
                with self._lock:
                    self._busy -= 1
                    self._idle.notify_all()


#: The helper thread of :class:`PieceCopy`.
_COPIER = Workers("nbresume-copy", 1)


def capture(
    step: int,
    epoch: int,
    metrics: dict[str, float],
    *,
    objects: Mapping[str, Stateful],
    pending: Mapping[str, Any],
    values: Mapping[str, Any],
    total: int | None,
    done: bool,
    ranks: list[Any] | None = None,
    sharded: Mapping[str, Any] | None = None,
    ended_early: Mapping[str, Any] | None = None,
    gradients: Mapping[str, Mapping[str, Any]] | None = None,
    added_groups: Mapping[str, Any] | None = None,
) -> Snapshot:
    """The snapshot of the live state. ``pending``: restored state of objects not registered
    yet, carried on; ``ranks``: every rank's RNG states (under ``torch.distributed``);
    ``sharded``: objects each rank saves itself, left out here; ``ended_early``: the loop
    (``{"loop": "steps" | "epochs", "bound": N}``) a finished run left by ``break``;
    ``gradients``: the gradients pending between two optimizer steps, by optimizer;
    ``added_groups``: the parameter groups optimizers gained during training, by name."""
    tensors: dict[str, dict[str, Any]] = {}
    documents: dict[str, Any] = {}
    trees = [(n, o.state_dict()) for n, o in objects.items() if not (sharded and n in sharded)]
    for name, tree in [*trees, *pending.items()]:
        documents[name], group = flatten(tree, name=name)
        if group:
            tensors[name] = group
    flat_values, value_tensors = flatten(dict(values), name=VALUES_GROUP)
    rng, rng_tensors = flatten(capture_rng() if ranks is None else ranks[0], name=RNG_GROUP)
    rank_rng = []
    for rank, tree in enumerate(ranks or []):
        if rank:  # the other ranks' tensors go under "rank<N>/" in the same file
            document, extra = flatten({f"rank{rank}": tree}, name=RNG_GROUP)
            rank_rng.append(document[f"rank{rank}"])
            rng_tensors.update(extra)
    for group_name, group in ((VALUES_GROUP, value_tensors), (RNG_GROUP, rng_tensors)):
        if group:
            tensors[group_name] = group
    state = {
        "version": STATE_VERSION,
        "step": step,
        "epoch": epoch,
        "total": total,
        "done": done,
        "objects": documents,
        "values": flat_values,
        "rng": rng,
    }
    if ended_early is not None:
        state["ended_early"] = dict(ended_early)
    if added_groups:
        state["added_groups"] = dict(added_groups)
    if gradients:
        state[GRADIENTS_GROUP], tensors[GRADIENTS_GROUP] = flatten(
            {name: dict(grads) for name, grads in gradients.items()}, name=GRADIENTS_GROUP
        )
    if ranks is not None:
        state["world_size"] = len(ranks)
        state["rank_rng"] = rank_rng
    if sharded:
        state["sharded"] = sorted(sharded)
    return Snapshot(step, tensors, state, metrics)


# -- a save in bounded host memory --------------------------------------------------------------

#: A staged save's host memory: :data:`STAGE_BUFFERS` buffers of :data:`STAGE_PIECE` bytes.
STAGE_PIECE = 32 << 20
STAGE_BUFFERS = 4


class Stager:
    """Copies tensors that live outside host memory (on a GPU) to the host through a ring of
    a few small buffers, a piece at a time, for a save that writes each piece before its
    buffer takes another: such a save holds :data:`STAGE_BUFFERS` x :data:`STAGE_PIECE`
    bytes of host memory whatever the size of the state. The buffers are made at the first
    use and kept; pinned where pinning works, and then the next pieces are copied while
    this one is written."""

    def __init__(self) -> None:
        self._ring: list[Any] = []

    def __call__(self, tensor: Any) -> Iterator[memoryview]:
        """The bytes of ``tensor`` (contiguous, in its dtype's layout), piece by piece: each
        piece stays valid until the next one is asked for."""
        import torch

        source = tensor.detach()
        if source.is_conj() or source.is_neg():
            source = source.resolve_conj().resolve_neg()
        flat = source.contiguous().reshape(-1).view(torch.uint8)
        total = flat.numel()
        if not self._ring:
            self._ring = [host_buffer(flat, (STAGE_PIECE,)) for _ in range(STAGE_BUFFERS)]
        starts = iter(range(0, total, STAGE_PIECE))
        copies: deque[tuple[Any, Any, Any]] = deque()  # (buffer, its piece, copy done)

        def copy_next(buffer: Any) -> None:
            start = next(starts, None)
            if start is None:
                return
            piece = buffer[: min(STAGE_PIECE, total - start)]
            piece.copy_(flat[start : start + piece.numel()], non_blocking=piece.is_pinned())
            done = None
            if flat.is_cuda:
                done = torch.cuda.Event()  # type: ignore[no-untyped-call]
                done.record(torch.cuda.current_stream(flat.device))
            copies.append((buffer, piece, done))

        try:
            for buffer in self._ring:
                copy_next(buffer)
            while copies:
                buffer, piece, done = copies.popleft()
                if done is not None:
                    done.synchronize()
                yield memoryview(piece.numpy())
                copy_next(buffer)  # the caller wrote that piece: its buffer takes the next
        finally:
            for _, _, done in copies:  # a write that stopped: no copy still lands later
                if done is not None:
                    done.synchronize()


# -- pinned host memory, with a fallback -----------------------------------------------------

#: Set when pinning host memory failed once: later buffers are pageable without trying again.
_PINNING_FAILED: list[str] = []


def host_buffer(source: Any, shape: tuple[int, ...] | None = None) -> Any:
    """An empty CPU tensor shaped like ``source`` (or ``shape``, of its dtype): pinned when
    ``source`` is on CUDA (the copy then runs asynchronously), pageable when pinning fails (a
    low locked-memory limit in a container, no host memory left to lock). A pageable buffer is
    correct, only slower: the copy into it waits for the GPU."""
    import torch

    shape = tuple(source.shape) if shape is None else shape
    if source.is_cuda and not _PINNING_FAILED:
        try:
            return torch.empty(shape, dtype=source.dtype, device="cpu", pin_memory=True)
        except RuntimeError as exc:
            _PINNING_FAILED.append(str(exc))
            log.warning(
                "nbresume: pinned host memory is not available (%s); snapshots of CUDA "
                "tensors use ordinary memory and wait for the copy",
                str(exc).splitlines()[0] if str(exc) else type(exc).__name__,
            )
    return torch.empty(shape, dtype=source.dtype, device="cpu")
