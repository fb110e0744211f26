"""Capturing the training state and writing it: one save, from the live objects to a commit.

The protocol of one save, whatever the distributed mode:

1. **Capture** (:func:`capture`): every stateful object's ``state_dict()``, the plain values,
   the RNG states (of every rank, under ``torch.distributed``) and the loop's counters become a
   :class:`Snapshot`: tensor groups (one safetensors file each) and one ``state.json``
   document. For a background save the tensors are copied into :class:`HostBuffers` first,
   reused from one save to the next (pinned when the tensor lives on CUDA), so that training
   is blocked only for that copy.
2. **Write** (:meth:`Saver.write`): the store writes, commits and verifies the checkpoint;
   the events ``save_started``, ``committed``, ``verified`` (or ``failed``) are emitted, the
   cadence learns the save's cost, and on a write-back store the durability watcher follows
   the checkpoint until the durable copy matches.
3. **In the background** (:class:`BackgroundSave`): at most one save runs in a thread; the
   next one waits for it, which bounds memory to one copy. Its failure is kept until the
   training thread asks (:func:`background_failure` is how it is reported).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any

from nbresume.checkpoint import events as ev
from nbresume.checkpoint import reporting
from nbresume.checkpoint.cadence import Cadence
from nbresume.checkpoint.durability import DurabilityWatcher
from nbresume.checkpoint.state import STATE_VERSION, capture_rng, flatten
from nbresume.checkpoint.store import CheckpointInfo, CheckpointStore
from nbresume.checkpoint.workers import Workers
from nbresume.errors import CheckpointError, NbresumeError

log = logging.getLogger("nbresume")

#: The JSON document of a checkpoint's state, and the tensor groups of RNGs and plain values.
STATE_FILE = "state"
RNG_GROUP = "rng"
VALUES_GROUP = "values"


class Snapshot:
    """Everything one checkpoint holds, detached from the live training objects."""

    def __init__(self, step: int, tensors: dict[str, dict[str, Any]], state: dict[str, Any],
                 metrics: dict[str, float]) -> None:  # fmt: skip
        self.step = step
        self.tensors = tensors
        self.state = state
        self.metrics = metrics


class HostBuffers:
    """Host copies of tensors, reused across saves so that a save allocates nothing new."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, str], Any] = {}

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
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
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
) -> Snapshot:
    """The snapshot of the live state. ``pending``: restored state of objects not registered
    yet, carried on; ``ranks``: every rank's RNG states (under ``torch.distributed``);
    ``sharded``: objects each rank saves itself, left out here."""
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
        self.background = BackgroundSave()

    def write(self, snapshot: Snapshot) -> CheckpointInfo:
        """Write, commit and verify ``snapshot`` through the store."""
        return self.commit(
            snapshot.step,
            lambda on_committed: self.store.save(
                snapshot.step,
                tensors=snapshot.tensors,
                data={STATE_FILE: snapshot.state},
                metrics=snapshot.metrics,
                on_committed=on_committed,
            ),
        )

    def finish(self, snapshot: Snapshot, *, background: bool) -> CheckpointInfo | None:
        """Write ``snapshot`` now (the verified checkpoint), or in the background (``None``)."""
        if background:
            self.background.start(lambda: self.write(snapshot))
            return None
        return self.write(snapshot)

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


# -- pinned host memory, with a fallback -----------------------------------------------------

#: Set when pinning host memory failed once: later buffers are pageable without trying again.
_PINNING_FAILED: list[str] = []


def host_buffer(source: Any) -> Any:
    """An empty CPU tensor shaped like ``source``: pinned when ``source`` is on CUDA (the copy
    then runs asynchronously), pageable when pinning fails (a low locked-memory limit in a
    container, no host memory left to lock). A pageable buffer is correct, only slower: the
    copy into it waits for the GPU."""
    import torch

    if source.is_cuda and not _PINNING_FAILED:
        try:
            return torch.empty(source.shape, dtype=source.dtype, device="cpu", pin_memory=True)
        except RuntimeError as exc:
            _PINNING_FAILED.append(str(exc))
            log.warning(
                "nbresume: pinned host memory is not available (%s); snapshots of CUDA "
                "tensors use ordinary memory and wait for the copy",
                str(exc).splitlines()[0] if str(exc) else type(exc).__name__,
            )
    return torch.empty(source.shape, dtype=source.dtype, device="cpu")
