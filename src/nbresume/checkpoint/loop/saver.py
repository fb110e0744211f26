"""Writing a snapshot and reporting the save: now or in the background, then its events.

The protocol of one save, whatever the distributed mode, after the capture
(:func:`~nbresume.checkpoint.state.capture`):

1. **Host memory** (:meth:`Saver.mirror`, :meth:`Saver.write`): a copy of the state in host
   memory is made only where it takes at most :data:`HOST_SHARE` of the memory this process
   can still allocate (its cgroup's limit, the host's available memory), buffers it already
   holds counting as free: a full copy of a large state on a small machine (Colab's free VM
   has 12.7 GB) gets the process killed by the kernel. Where it would take more, the save is
   written now, in the training thread, from the live tensors. The first such save says so
   in a warning. Whatever is written now, tensors on a GPU go through a
   :class:`~nbresume.checkpoint.state.Stager`'s few small pinned buffers.
2. **Write** (:meth:`Saver.write`): the store writes, commits and verifies the checkpoint.
3. **Report** (:func:`report_save`): the Checkpointer's saves and a framework's
   (:class:`~nbresume.frameworks.watch.Watch`) report the same way: ``save_started``,
   ``committed``, ``verified`` (or ``failed``, and the error is raised); the cadence learns the
   save's cost, and on a write-back store (Google Drive's mount) the checkpoint is followed as
   ``syncing`` until the durable store confirms it.
4. **In the background** (:class:`BackgroundSave`): at most one save runs in a thread; the
   next one waits for it, which bounds memory to one copy. Its failure is kept until the
   training thread asks (:func:`background_failure` is how it is reported).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from nbresume.checkpoint import events as ev
from nbresume.checkpoint import hooks
from nbresume.checkpoint.loop.cadence import Cadence
from nbresume.checkpoint.loop.durability import DurabilityWatcher
from nbresume.checkpoint.state import (
    STAGE_BUFFERS,
    STAGE_PIECE,
    STATE_FILE,
    HostBuffers,
    Snapshot,
    Stager,
    tensor_bytes,
)
from nbresume.checkpoint.store import CheckpointInfo, CheckpointStore, is_out_of_memory
from nbresume.checkpoint.units import format_bytes
from nbresume.errors import CheckpointError, NbresumeError

log = logging.getLogger("nbresume")

#: The share of the memory this process can still allocate that a save's copy of the state
#: in host memory may take; a larger copy is not made (:meth:`Saver.mirror`).
HOST_SHARE = 0.5


#: What one save runs: given the callback of the commit, it commits and returns the verified
#: checkpoint (``pending.commit(on_committed=...)``, ``store.save(..., on_committed=...)``).
SaveFunction = Callable[[Callable[[CheckpointInfo], None]], CheckpointInfo]


def report_save(
    events: ev.EventBus,
    cadence: Cadence,
    step: int,
    save: SaveFunction,
    *,
    started: float | None = None,
    track: Callable[[CheckpointInfo], None] | None = None,
    report: bool = True,
) -> CheckpointInfo:
    """Run ``save`` and return its checkpoint. ``committed`` is always emitted; with
    ``report`` also ``save_started`` (unless ``started``, the :func:`time.monotonic` time the
    save began, says it was), ``verified`` or ``failed``, the cost taught to ``cadence``, and
    the checkpoint handed to ``track`` (the durability watcher's ``syncing``)."""
    if started is None:
        started = time.monotonic()
        if report:
            events.emit(ev.SAVE_STARTED, step)
    try:
        info = save(lambda i: events.emit(ev.COMMITTED, i.step, location=i.location, size=i.size))
    except BaseException as exc:
        if report:
            events.emit(ev.FAILED, step, error=str(exc))
        raise
    if hooks.after_save is not None:  # `nbresume check`: what each save held, noted
        hooks.after_save(info)
    if report:
        seconds = time.monotonic() - started
        cadence.observe_save(seconds)
        events.emit(ev.VERIFIED, info.step, location=info.location, size=info.size, seconds=seconds)
        if track is not None:
            track(info)
    return info


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
        needed = self.buffers.missing(snapshot.tensors)
        if self._copy_fits(needed, snapshot.tensors):
            try:
                snapshot.tensors, snapshot.landed = self.buffers.copy(snapshot.tensors)
                snapshot.live = False
                return
            except (MemoryError, RuntimeError, OSError) as exc:
                if not is_out_of_memory(exc):
                    raise
                # The memory was not there after all (a limit nothing reported): the save
                # is written from the live tensors, as where the copy is known not to fit.
                self.buffers = HostBuffers()
                self._tell(needed, snapshot.tensors, None, f"the allocation failed: {exc}")
        self.buffers = HostBuffers()  # what an earlier copy held goes back

    def write(self, snapshot: Snapshot) -> CheckpointInfo:
        """Write, commit and verify ``snapshot`` through the store, its GPU tensors through
        the :class:`Stager`: each piece is copied into a pinned buffer while the one before
        is written, so that a blocking save takes about as long as the write alone, where a
        copy of the whole state to the host first (into fresh, pageable memory: a page fault
        per page, and a copy that cannot overlap the write) would add its own time."""
        snapshot.landed()  # a background save's copies from the GPU are in its buffers
        return self.run_reported(
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
        self._tell(needed, tensors, available, bound or "as measured")
        return False

    def _tell(
        self, needed: int, tensors: dict[str, dict[str, Any]], available: int | None, bound: str
    ) -> None:
        """Say once that saves are written from the live tensors, and why."""
        if self._told:
            return
        self._told = True
        room = (
            f"over {round(HOST_SHARE * 100)}% of the {format_bytes(available)} this process "
            f"can still allocate ({bound})"
            if available is not None
            else f"more than this process could allocate ({bound})"
        )
        log.warning(
            "nbresume: the training state is %s; copying it into host memory would take %s "
            "more, %s. Saves are written straight from the live tensors instead, tensors on a "
            "GPU through %s of host buffers: the files are the same, but training waits for "
            "each save to be written, not only for a copy. Fix: a machine with more RAM, a "
            "smaller state (trainable_only=True), or fewer saves (a larger every=)",
            format_bytes(tensor_bytes(tensors)),
            format_bytes(needed),
            room,
            format_bytes(STAGE_BUFFERS * STAGE_PIECE),
        )

    def run_reported(
        self,
        step: int,
        save: Callable[[Callable[[CheckpointInfo], None]], CheckpointInfo],
        *,
        report: bool = True,
    ) -> CheckpointInfo:
        """Run ``save`` (given the callback of the commit) and, with ``report``, emit the
        save's events, teach the cadence its cost and follow its durability."""
        track = self.durability.track if self.durability is not None else None
        return report_save(self.events, self.cadence, step, save, track=track, report=report)

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


class BackgroundSave:
    """At most one save running in a thread; its failure is kept until someone asks."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

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
        """Whether the last save finished with an error that nobody has taken yet. The error
        is kept as the thread's last act, so it is known before the thread is seen to end
        (under load, a thread can be gone from ``threading.enumerate()`` and still be alive
        for a while)."""
        return self._error is not None

    def take_error(self) -> BaseException | None:
        error, self._error = self._error, None
        return error

    def drain(self) -> BaseException | None:
        """Wait for the save in flight and take its error (if any)."""
        self.wait()
        return self.take_error()
