"""Capturing the training state and writing it: one save, from the live objects to a commit.

The protocol of one save, whatever the distributed mode:

1. **Capture** (:func:`capture`): every stateful object's ``state_dict()``, the plain values,
   the RNG states (of every rank, under ``torch.distributed``) and the loop's counters become a
   :class:`Snapshot`: tensor groups (one safetensors file each) and one ``state.json``
   document. For a background save the tensors are copied into :class:`HostBuffers` first,
   reused from one save to the next (pinned when the tensor lives on CUDA), so that training
   is blocked only for that copy.
2. **Host memory** (:meth:`Saver.mirror`, :meth:`Saver.write`): a copy of the state in host
   memory is made only where it takes at most :data:`HOST_SHARE` of the memory this process
   can still allocate (its cgroup's limit, the host's available memory), buffers it already
   holds counting as free: a full copy of a large state on a small machine (Colab's free VM
   has 12.7 GB) gets the process killed by the kernel. Where it would take more, the save is
   written now, in the training thread, from the live tensors. The first such save says so
   in a warning. Whatever is written now, tensors on a GPU go through a :class:`Stager`'s
   few small pinned buffers, piece by piece, each copied while the one before is written:
   the files are the same bytes as a copy of the whole state would give.
3. **Write** (:meth:`Saver.write`): the store writes, commits and verifies the checkpoint;
   the events ``save_started``, ``committed``, ``verified`` (or ``failed``) are emitted, the
   cadence learns the save's cost, and on a write-back store the durability watcher follows
   the checkpoint until the durable copy matches.
4. **In the background** (:class:`BackgroundSave`): at most one save runs in a thread; the
   next one waits for it, which bounds memory to one copy. Its failure is kept until the
   training thread asks (:func:`background_failure` is how it is reported).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from nbresume.checkpoint import events as ev
from nbresume.checkpoint import forksafe, hooks, reporting
from nbresume.checkpoint.cadence import Cadence
from nbresume.checkpoint.durability import DurabilityWatcher
from nbresume.checkpoint.forksafe import Workers
from nbresume.checkpoint.state import STATE_VERSION, capture_rng, flatten
from nbresume.checkpoint.store import CheckpointInfo, CheckpointStore
from nbresume.checkpoint.units import format_bytes
from nbresume.errors import CheckpointError, NbresumeError

log = logging.getLogger("nbresume")

#: The JSON document of a checkpoint's state, and the tensor groups of RNGs and plain values.
STATE_FILE = "state"
RNG_GROUP = "rng"
VALUES_GROUP = "values"
#: The tensor group (and state member) of gradients pending between two optimizer steps.
GRADIENTS_GROUP = "gradients"


class Snapshot:
    """Everything one checkpoint holds, detached from the live training objects (its tensors
    are the live ones until :meth:`Saver.mirror` copies them: ``live``)."""

    def __init__(self, step: int, tensors: dict[str, dict[str, Any]], state: dict[str, Any],
                 metrics: dict[str, float]) -> None:  # fmt: skip
        self.step = step
        self.tensors = tensors
        self.state = state
        self.metrics = metrics
        self.live = True


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

    def copy(self, tensors: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        cuda = False
        pieces = PieceCopy()
        for group, members in tensors.items():
            out[group] = {}
            for key, value in members.items():
                out[group][key] = self._copy_one((group, key), value, pieces)
                cuda = cuda or getattr(value, "is_cuda", False)
        pieces.run()
        if cuda:
            import torch

            torch.cuda.synchronize()  # the non-blocking copies must land before the write
        return out

    def _copy_one(self, slot: tuple[str, str], value: Any, pieces: PieceCopy) -> Any:
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
        if not pieces.add(buffer, source):
            buffer.copy_(source, non_blocking=source.is_cuda)
        return buffer


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


class BackgroundSave:
    """At most one save running in a thread; its failure is kept until someone asks."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self, work: Callable[[], object]) -> None:
        self.wait()

        def run() -> None:
            try:
                work()
            except BaseException as exc:  # kept and raised in the training thread
                self._error = exc

        # Not a daemon: an interpreter that is exiting still finishes the save in flight.
        self._thread = threading.Thread(target=run, name="nbresume-save", daemon=False)
        self._thread.start()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    @property
    def failed(self) -> bool:
        """Whether the last save finished with an error that nobody has taken yet."""
        return self._error is not None and not self.busy

    def take_error(self) -> BaseException | None:
        error, self._error = self._error, None
        return error

    def drain(self) -> BaseException | None:
        """Wait for the save in flight and take its error (if any)."""
        self.wait()
        return self.take_error()


def capture(
    step: int,
    epoch: int,
    metrics: dict[str, float],
    *,
    objects: Mapping[str, Any],
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


class Saver:
    """Writes snapshots into the store, now or in the background, and reports each save."""

    def __init__(
        self,
        store: CheckpointStore,
        events: ev.EventBus,
        cadence: Cadence,
        durability: DurabilityWatcher | None,
    ) -> None:
        self.store = store
        self.events = events
        self.cadence = cadence
        self.durability = durability
        self.buffers = HostBuffers()
        self.stager = Stager()
        self.background = BackgroundSave()
        self._told = False  # the warning that a copy does not fit is given once

    def mirror(self, snapshot: Snapshot) -> None:
        """Copy ``snapshot``'s tensors into the host buffers, for a write in the background,
        where that copy fits in memory; where it does not, the snapshot keeps the live
        tensors (it is written now, :meth:`finish`) and the buffers are let go."""
        if self._copy_fits(self.buffers.missing(snapshot.tensors), snapshot.tensors):
            snapshot.tensors = self.buffers.copy(snapshot.tensors)
            snapshot.live = False
        else:
            self.buffers = HostBuffers()  # what an earlier copy held goes back

    def write(self, snapshot: Snapshot) -> CheckpointInfo:
        """Write, commit and verify ``snapshot`` through the store, its GPU tensors through
        the :class:`Stager`: each piece is copied into a pinned buffer while the one before
        is written, so that a blocking save takes about as long as the write alone, where a
        copy of the whole state to the host first (into fresh, pageable memory: a page fault
        per page, and a copy that cannot overlap the write) would add its own time."""
        return self.commit(
            snapshot.step,
            lambda on_committed: self.store.save(
                snapshot.step,
                tensors=snapshot.tensors,
                data={STATE_FILE: snapshot.state},
                metrics=snapshot.metrics,
                on_committed=on_committed,
                stage=self.stager,
            ),
        )

    def finish(self, snapshot: Snapshot, *, background: bool) -> CheckpointInfo | None:
        """Write ``snapshot`` now (the verified checkpoint), or in the background (``None``).

        A background save whose snapshot could not be copied (:meth:`mirror`) is written
        now, and reported as a background save is: its failure at the next step boundary,
        on every process of a job."""
        if background and not snapshot.live:
            self.background.start(lambda: self.write(snapshot))
            return None
        if background:
            try:
                self.write(snapshot)
            except Exception as exc:
                self.background.start(raiser(exc))
            return None
        return self.write(snapshot)

    def _copy_fits(self, needed: int, tensors: dict[str, dict[str, Any]]) -> bool:
        """Whether a host copy of ``needed`` bytes takes at most :data:`HOST_SHARE` of the
        memory this process can still allocate (yes where that is unknown); the first time
        it does not, say so."""
        if needed <= 0:
            return True
        available, bound = hooks.available_memory()
        if available is None or needed <= HOST_SHARE * available:
            return True
        if not self._told:
            self._told = True
            log.warning(
                "nbresume: the training state is %s; copying it into host memory would take "
                "%s more, over %d%% of the %s this process can still allocate (%s). Saves are "
                "written straight from the live tensors instead, tensors on a GPU through %s "
                "of host buffers: the files are the same, but training waits for each save to "
                "be written, not only for a copy. Fix: a machine with more RAM, a smaller "
                "state (trainable_only=True), or fewer saves (a larger every=)",
                format_bytes(tensor_bytes(tensors)),
                format_bytes(needed),
                round(HOST_SHARE * 100),
                format_bytes(available),
                bound or "as measured",
                format_bytes(STAGE_BUFFERS * STAGE_PIECE),
            )
        return False

    def commit(
        self,
        step: int,
        save: Callable[[Callable[[CheckpointInfo], None]], CheckpointInfo],
        *,
        report: bool = True,
    ) -> CheckpointInfo:
        """Run ``save`` (given the callback of the commit) and, with ``report``, emit the
        save's events, teach the cadence its cost and follow its durability."""
        track = self.durability.track if self.durability is not None else None
        return reporting.commit(self.events, self.cadence, step, save, track=track, report=report)

    def retry_after(self, earlier: BaseException | None) -> None:
        """A blocking save goes on past an earlier background failure: say so."""
        if earlier is not None:
            log.warning("nbresume: a background save failed (%s); saving again now", earlier)


def raiser(error: BaseException) -> Callable[[], None]:
    """Work for :meth:`BackgroundSave.start` that fails with ``error``."""

    def fail() -> None:
        raise error

    return fail


def background_failure(error: BaseException | None) -> CheckpointError | None:
    """The error a failed background save is reported as, keeping the cause's own place and
    fix, rendered once (not "... Fix: ... Fix: ...")."""
    if error is None:
        return None
    if isinstance(error, NbresumeError):
        reason, where, fix = error.message, error.where, error.fix
    else:
        reason, where, fix = str(error), "", ""
    return CheckpointError(
        f"a background save failed: {reason}",
        where=where,
        fix=f"the previous checkpoint is intact; {fix or 'fix the cause and save again'}",
    )


# -- a save in bounded host memory --------------------------------------------------------------

#: The share of the memory this process can still allocate that a save's copy of the state
#: in host memory may take; a larger copy is not made (:meth:`Saver.mirror`).
HOST_SHARE = 0.5
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
