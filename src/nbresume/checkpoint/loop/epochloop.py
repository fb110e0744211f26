"""The loop of :meth:`Checkpointer.epochs` and what wrapped loaders tell it.

A Checkpointer holds one :class:`Epochs`, given the little of the Checkpointer it uses: its
public counters (:class:`Host`) and the steps of a loop it runs (:class:`LoopSteps`: the
registered objects, the lease, the step boundary, the end). The
protocol (:class:`nbresume.checkpoint.state.data.EpochLoop`, implemented here): a
:class:`~nbresume.checkpoint.state.ResumableLoader` reports to the epoch loop when a pass over
its data begins (``begin_pass``), when it is asked for a batch
(``wants_batch``, where the step it handed out a batch in ends and an owed step boundary
runs), when it hands one out (``batch_given``) and when its consumer leaves the pass early
(``pass_left``, settled at the next of those points). Every batch belongs to a step; a step
ends when a loader that already handed out a batch in it is asked for another, when such a
loader is left, or when the body of the epoch ends. :meth:`Epochs.position` says which (step,
epoch) a save made now records, inside either loop's body.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from nbresume.checkpoint.state import ResumableLoader, Stateful
from nbresume.errors import UsageError

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    from nbresume.checkpoint.loop.cadence import Cadence
    from nbresume.checkpoint.state import StepWatch


class EpochState:
    """What the running ``epochs()`` loop knows of the batches its wrapped loaders hand out."""

    def __init__(self, loop_id: int) -> None:
        self.id = loop_id
        self.thread = threading.current_thread()
        #: The loaders (by id) that handed out a batch in the running step; empty: none runs.
        self.step: set[int] = set()
        #: Loaders whose pass the consumer left early, not yet settled.
        self.left: list[ResumableLoader] = []
        #: A step ended where its boundary could not run yet.
        self.owed = False
        #: Batches handed out in this epoch.
        self.batches = 0
        #: True during a boundary run where a loader asks for a batch: mid-epoch.
        self.requesting = False


class Host(Protocol):
    """The public counters of the epoch loop's :class:`~nbresume.checkpoint.loop.Checkpointer`."""

    step: int
    epoch: int
    total: int | None
    done: bool

    @property
    def stop_reason(self) -> str: ...
    @property
    def cadence(self) -> Cadence: ...

    def restore(self) -> int: ...


class Boundary(Protocol):
    """A step boundary: ``True`` when the loop must end now (the state was saved)."""

    def __call__(self, *, final: bool) -> bool: ...


@dataclass(frozen=True)
class LoopSteps:
    """The steps of a loop that the Checkpointer runs for the epoch loop, and what it owns."""

    #: The registered stateful objects, by name (the wrapped loaders among them).
    objects: dict[str, Stateful]
    #: Which registered optimizers stepped in the running step.
    step_watch: StepWatch
    #: Hold the folder's writer lease before the first step.
    hold_lease: Callable[[], None]
    #: The running loop's context (its bound; signals as requests).
    loop: Callable[[tuple[str, int]], AbstractContextManager[None]]
    #: Whether the restored run ended early in this same loop (``(loop, bound)``).
    ends_here: Callable[[str, int], bool]
    #: The loop's body was left (``break`` or an exception).
    note_left: Callable[[], None]
    boundary: Boundary
    #: The loop ran to its end: save and report it.
    finish: Callable[[], None]


class Epochs:
    """The epoch loop of a :class:`~nbresume.checkpoint.loop.Checkpointer` (its ``host``)."""

    def __init__(self, host: Host, steps: LoopSteps) -> None:
        self.host = host
        self.steps = steps
        self.loops_started = 0
        #: The running epochs() loop, while it runs.
        self.state: EpochState | None = None
        self.batch_started: float | None = None
        #: Which loop body runs now ("step" or "epoch"), between a yield and the next boundary.
        self.body: str | None = None

    def position(self) -> tuple[int, int]:
        """The (step, epoch) a save made now records.

        Inside a loop body the body's own step counts as done: ``save()`` there is meant to
        be called after the step's update (or, in ``epochs()``, after the epoch's data), and
        the state it captures (weights, optimizer, data position) already includes it. In
        ``epochs()``, once every wrapped loader used in the epoch has ended its pass and none
        is partway through its data, the save is the checkpoint of the end of the epoch.
        """
        step, epoch = self.host.step, self.host.epoch
        if self.body == "step":
            return step + 1, epoch
        state = self.state
        if self.body == "epoch" and state is not None:
            loaders = self.wrapped_loaders()
            if not loaders:
                return step + 1, epoch + 1  # an epoch is the step unit
            if state.requesting:
                return step, epoch  # at a step boundary where a loader is asked for data
            self._settle(state)  # a pass left by a break ends here, before its state is taken
            step = self.host.step + (1 if state.step else 0)  # inside a step: that step's
            finished = any(loader.finished_in == epoch for loader in loaders)
            partway = any(loader.finished_in != epoch and loader.position > 0 for loader in loaders)
            if finished and not partway:
                epoch += 1  # after the epoch's data
        return step, epoch

    def run(self, count: int) -> Iterator[int]:
        """The loop of ``Checkpointer.epochs(count)``."""
        self.host.restore()
        self.host.total = None
        if self.host.epoch >= count or self.steps.ends_here("epochs", count):
            self.host.done = True
            return
        self.host.done = False
        self.steps.hold_lease()
        self.loops_started += 1
        state = EpochState(self.loops_started)
        self.state = state
        for loader in self.wrapped_loaders():
            loader.epoch_loop = self  # loaders wrapped later are attached by loader()
        with self.steps.loop(("epochs", count)):
            try:
                while self.host.epoch < count:
                    started = time.monotonic()
                    self.body = "epoch"
                    self.steps.step_watch.step_begins()  # the epoch is the step without loaders
                    try:
                        yield self.host.epoch
                    except GeneratorExit:
                        self.steps.note_left()
                        raise
                    self.body = None
                    if self.host.stop_reason:
                        return
                    self._end_epoch(state, started)
                    if self.steps.boundary(final=self.host.epoch >= count):
                        return
            finally:
                if self.state is state:  # not a loop started since (a generator closed late)
                    self.state = None
                    self.body = None
        self.steps.finish()

    # How a wrapped loader reports to the epoch loop (data.EpochLoop). Step boundaries run
    # only where the loop's own thread is in nbresume's code: when a loader is asked for a
    # batch, at the end of the body, in save(). A pass left at its yield (break) is only
    # noted when it happens and settled at the next of those points.

    def stopping_in_body(self) -> bool:
        """Whether the epoch loop saved and is stopping while its body still runs. The rest
        of the body (validation, a per-epoch scheduler step) runs again in the resumed epoch,
        so a save() there would record its effects twice: it is skipped."""
        state = self.state
        return (
            self.body == "epoch"
            and bool(self.host.stop_reason)
            and state is not None
            and not state.requesting  # the stop's own save, at a loader's request
        )

    def wrapped_loaders(self) -> list[ResumableLoader]:
        return [o for o in self.steps.objects.values() if isinstance(o, ResumableLoader)]

    def in_epoch_body(self) -> bool:
        return self.body == "epoch" and self.state is not None

    def begin_pass(self, loader: ResumableLoader) -> tuple[int, int] | None:
        """A pass over ``loader`` begins: its key (the loop and the epoch), or ``None``
        outside the body of an epoch loop, where the loader hands out batches uncounted."""
        state = self.state
        if state is None or self.body != "epoch":
            return None
        if threading.current_thread() is not state.thread:
            raise UsageError(
                "a wrapped loader was iterated in another thread than the one running "
                "ckpt.epochs()",
                fix="iterate it in the loop's own thread: a prefetching thread runs ahead of "
                "training, so the saved position would count batches never trained on "
                "(DataLoader(num_workers=N) already loads in parallel)",
            )
        key = (state.id, self.host.epoch)
        if loader.pass_key == key:
            raise UsageError(
                f"a wrapped loader was iterated a second time in epoch {self.host.epoch} of "
                "ckpt.epochs(); each wrapped loader makes one pass over its data per epoch",
                fix="iterate it once per epoch (to cap an epoch, break out of that one loop); "
                "for several passes per epoch, use ckpt.steps(total) with loader.batches()",
            )
        loader.pass_key = key
        return key

    def wants_batch(self, loader: ResumableLoader, key: tuple[int, int], exhausted: bool) -> bool:
        """``loader`` is asked for a batch (``exhausted``: its data epoch has none left).
        Ends the step it handed out a batch in, and runs the boundary owed; True: stop."""
        state = self.state
        if state is None or self.body != "epoch" or key != (state.id, self.host.epoch):
            raise UsageError(
                "an iterator over a wrapped loader was used after the epoch it was made in",
                fix="iterate the loader anew in each epoch (for batch in loader: ...) rather "
                "than keeping an iterator from one epoch to the next",
            )
        if self.host.stop_reason:
            return True  # stopped (and saved) earlier in this body: no more batches
        self._settle(state)
        if id(loader) in state.step:
            self._end_step(state)
        if not state.owed or exhausted:
            # A loader that ran out hands out nothing more: the boundary waits for the next
            # request or the end of the body, so that the end of the epoch's data is saved
            # with the epoch that follows, as an epoch boundary.
            return False
        state.owed = False
        state.requesting = True
        try:
            return self.steps.boundary(final=False)
        finally:
            state.requesting = False

    def batch_given(self, loader: ResumableLoader) -> None:
        state = self.state
        assert state is not None
        if not state.step:  # the first batch of a step: the step begins
            self.steps.step_watch.step_begins()
        state.step.add(id(loader))
        state.batches += 1

    def pass_left(self, loader: ResumableLoader, key: tuple[int, int]) -> None:
        state = self.state  # any thread (a generator closed by the garbage collector)
        if state is not None and key == (state.id, self.host.epoch):
            state.left.append(loader)

    def _settle(self, state: EpochState) -> None:
        """Passes left early: the step of their last batch ends, and the next pass of each
        starts its next data epoch."""
        left, state.left = state.left, []
        for loader in left:
            if id(loader) in state.step:
                self._end_step(state)
            if loader.finished_in != self.host.epoch:
                loader.end_pass(self.host.epoch)

    def _end_step(self, state: EpochState) -> None:
        now = time.monotonic()
        self.host.step += 1
        if self.batch_started is not None:
            self.host.cadence.observe_step(now - self.batch_started)
        self.batch_started = now
        state.step.clear()
        state.owed = True

    def _end_epoch(self, state: EpochState, started: float) -> None:
        """The body of an epoch ended: its last step ends, a loader left partway through
        its data (break, or zip ended on a shorter loader) moves to its next data epoch, and
        the epoch counter moves; the epoch boundary follows."""
        self._settle(state)
        if state.step:
            self._end_step(state)
        for loader in self.wrapped_loaders():
            if loader.finished_in != self.host.epoch and loader.position > 0:
                loader.end_pass(self.host.epoch)
        if not state.batches:
            self.host.step += 1  # no wrapped loader handed out a batch: the epoch is the step
            self.host.cadence.observe_step(time.monotonic() - started)
        state.batches = 0
        state.owed = False
        self.host.epoch += 1

    def refuse_a_remade_loader(self, dataloader: Any) -> tuple[int, int] | None:
        """Where a wrapper made now is made: (loop, epoch) inside an epoch body, else None.
        A new DataLoader over a dataset a wrapper made in an earlier epoch reads is refused:
        its wrapper would start over, and a resumed run could not find its position."""
        state = self.state
        if state is None or self.body != "epoch":
            return None
        dataset = getattr(dataloader, "dataset", None)
        for value in self.wrapped_loaders():
            made = value.created_in
            if (
                made
                and made[0] == state.id
                and made[1] < self.host.epoch
                and getattr(value.loader, "dataset", None) is dataset
            ):
                raise UsageError(
                    f"epoch {self.host.epoch} gave ckpt.loader() a new DataLoader over the dataset "
                    f"that a DataLoader of epoch {made[1]} reads; a new DataLoader each epoch "
                    "would start a new position each time",
                    fix="build the DataLoader once, before the loop, and pass that same "
                    "object to ckpt.loader() in every epoch (or give it to the Checkpointer "
                    "as loader=... and iterate ckpt.loader())",
                )
        return (state.id, self.host.epoch)
