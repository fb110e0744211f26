"""How a Checkpointer saves, restores and agrees at a step boundary: one strategy per mode.

The protocol every :class:`Strategy` implements, for the :class:`Checkpointer` that owns it
(and gives it a :class:`Host`: what a strategy uses of it):

- ``save(step, epoch, metrics, background=...)``: capture the state and write one
  checkpoint; return the verified :class:`CheckpointInfo` of a blocking save where this
  process wrote it, else ``None``.
- ``restore()``: load the newest checkpoint that verifies and fits into every object, all or
  nothing; return the step to continue from (0 when the folder holds no checkpoint).
- ``agree(flags)``: the step boundary's decision, combined over the job (a flag raised by any
  process counts for all); ``leads``: whether this process takes the job's once-only actions
  (the time-based cadence, the after-stop action).
- ``raise_background_error()``: raise the failure of the last background save, on every
  process of the job.
- ``share_loader_seeds(loaders)``: give every process the first process's data seeds.

Three implementations: :class:`OneProcess`, :class:`DataParallel` (``torch.distributed``,
replicated state: rank 0 writes one checkpoint, see
:mod:`nbresume.checkpoint.parallel.distributed`) and :class:`Sharded` (FSDP2 / DTensor state:
every rank writes its own shards, see :mod:`nbresume.checkpoint.parallel.sharded`).
:func:`choose` picks one, once per Checkpointer, at its first save or restore (every loop
restores first): by then the process group is up and the model is sharded, which may both
happen after the Checkpointer was made.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from nbresume.checkpoint.format import capture_rng
from nbresume.checkpoint.loop.saver import Saver, background_failure, raiser
from nbresume.checkpoint.parallel import (
    Gather,
    distributed,
    load_sharded,
    loadable_state,
    save_sharded,
)
from nbresume.checkpoint.state import (
    RNG_GROUP,
    STATE_FILE,
    DoesNotFit,
    ResumableLoader,
    Snapshot,
    Stateful,
    optimizer_extras,
    restoring,
)
from nbresume.checkpoint.store import CheckpointInfo, CheckpointStore, LoadedCheckpoint
from nbresume.errors import CheckpointError, NoCheckpointError


class Host(Protocol):
    """What a strategy uses of the Checkpointer that owns it (given by the Checkpointer as
    a small object of its own; a strategy never reaches into the Checkpointer itself)."""

    store: CheckpointStore
    saver: Saver
    #: Whether this Checkpointer restored (or found nothing to restore) already.
    restored: bool

    @property
    def step(self) -> int: ...

    @property
    def objects(self) -> Mapping[str, Stateful]: ...

    def wrapped_loaders(self) -> list[ResumableLoader]: ...

    def sharded_objects(self) -> dict[str, Any]: ...

    def any_committed(self) -> bool: ...

    def capture(
        self,
        step: int,
        epoch: int,
        metrics: dict[str, float],
        *,
        copy: bool,
        ranks: list[Any] | None = None,
        sharded: Mapping[str, Any] | None = None,
    ) -> Snapshot: ...

    def mark_saved(self, step: int) -> None: ...

    def apply_plan(self, plan: restoring.RestorePlan) -> None: ...


class Strategy:
    """What every mode shares; a mode's class adds its own ``save`` and ``restore``."""

    def __init__(self, host: Host, group: distributed.Group) -> None:
        self.host = host
        self.group = group
        self.saver = host.saver

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.group!r})"

    @property
    def leads(self) -> bool:
        """Whether this process takes the job's once-only actions (rank 0)."""
        return self.group.rank == 0

    def save(
        self, step: int, epoch: int, metrics: dict[str, float], *, background: bool
    ) -> CheckpointInfo | None:
        raise NotImplementedError

    def restore(self) -> int:
        raise NotImplementedError

    def agree(self, flags: Sequence[int]) -> list[int]:
        """The element-wise maximum of every process's ``flags``."""
        return self.group.agree(flags)

    def raise_background_error(self) -> None:
        """Raise the first process's background failure (if any) on every process."""
        error = self.saver.background.take_error()
        # A close() after destroy_process_group() has no job left to tell.
        group = self.group if distributed.current() is not None else distributed.Solo()
        problem = group.broadcast_error(background_failure(error))
        if problem is not None:
            raise problem from error

    def share_loader_seeds(self, loaders: Sequence[ResumableLoader]) -> None:
        """Give every process the first one's data seeds. A restored loader gets rank 0's
        seed from the checkpoint anyway; sharing it from the start makes a resumed run draw
        the same per-sample randomness as one that was never interrupted, even when each
        process seeded torch differently."""
        if not loaders:
            return
        seeds = self.group.broadcast_ints([loader.seed for loader in loaders])
        for loader, seed in zip(loaders, seeds, strict=True):
            loader.seed = seed

    # -- shared steps ----------------------------------------------------------------------

    def _done_restoring(self) -> int:
        """The end of a restore: the Checkpointer counts as restored, the seeds are shared."""
        self.host.restored = True
        self.share_loader_seeds(self.host.wrapped_loaders())
        return self.host.step

    def _checker(
        self,
        misfits: list[DoesNotFit],
        *,
        plans: list[restoring.RestorePlan] | None = None,
        apply: bool = False,
    ) -> Callable[[LoadedCheckpoint], None]:
        """The check the store's reader runs on each candidate: plan it against the live
        objects (and with ``apply``, put it into them, all or nothing). Checkpoints that do not
        fit are collected in ``misfits``, plans in ``plans``."""

        def check(loaded: LoadedCheckpoint) -> None:
            try:
                plan, gather = self._prepare(loaded)
            except DoesNotFit as exc:
                misfits.append(exc)
                raise
            if plans is not None:
                plans.append(plan)
            if apply:
                self._apply(plan, gather)
            elif gather is not None:
                gather.undo()  # checked only: the objects stay as they were

        return check

    def _fits(self, misfits: list[DoesNotFit]) -> Callable[[LoadedCheckpoint], None]:
        """The check the store's reader runs on each candidate's headers, before its tensors
        are read: compare what they declare with the live objects (changing nothing), so
        that a checkpoint that does not fit costs no memory for its tensors. Checkpoints
        that do not fit are collected in ``misfits``."""

        def fits(heads: LoadedCheckpoint) -> None:
            try:
                self.check_fits(heads)
            except DoesNotFit as exc:
                misfits.append(exc)
                raise

        return fits

    def check_fits(self, heads: LoadedCheckpoint) -> None:
        """Raise :class:`DoesNotFit` when the checkpoint ``heads`` describes (its tensors as
        their files' headers declare them: no bytes) cannot be put into the live objects the
        way this strategy restores; change nothing. What a restore passes over as not
        fitting before it reads a tensor, and what ``Checkpointer.verify()`` reports."""
        restoring.check_fits(heads, self.host.objects)
        if self.gathers and heads.state is not None and heads.state.sharded:
            Gather(heads, self.host.objects).undo()  # the sharded objects fit too

    def _plan(self, loaded: LoadedCheckpoint) -> restoring.RestorePlan:
        return restoring.plan(
            loaded, self.host.objects, rank=self.group.rank, world_size=self.group.world_size
        )

    #: Whether this strategy puts a checkpoint's sharded state into plain objects (it has
    #: every rank's shards in memory: one process, or each process of a replicated job).
    gathers = True

    def _prepare(self, loaded: LoadedCheckpoint) -> tuple[restoring.RestorePlan, Gather | None]:
        """The plan of ``loaded`` and, for a checkpoint of sharded state, the gathering of
        that state into the plain objects, both checked and nothing changed: a sharded
        checkpoint is loaded whole or not at all, never its unsharded part alone."""
        plan = self._plan(loaded)
        if not (self.gathers and plan.saved.sharded):
            return plan, None
        try:
            return plan, Gather(loaded, self.host.objects)
        except BaseException:
            optimizer_extras.shrink_groups(plan.grown)
            raise

    def _apply(self, plan: restoring.RestorePlan, gather: Gather | None) -> None:
        """Put a prepared checkpoint into the objects: the plan, then the sharded state."""
        self.host.apply_plan(plan)
        if gather is not None:
            gather.load()

    def _newest(
        self, load: Callable[[], LoadedCheckpoint], misfits: list[DoesNotFit]
    ) -> LoadedCheckpoint | None:
        """``load()`` the newest checkpoint that verifies and fits; ``None`` when the folder
        holds none at all."""
        try:
            return load()
        except NoCheckpointError:
            if self.host.any_committed():
                raise  # checkpoints exist but none verifies: starting over would hide that
            return None
        except DoesNotFit as exc:
            raise restoring.no_fit(exc, misfits, self.host.store.location) from None

    def _after(self, earlier: BaseException | None, *, background: bool) -> None:
        """A save begins after the last background one ended with ``earlier``: an async save
        raises that failure (on every process), a blocking one tries again (a stop or the
        final save must not be given up for an older failure)."""
        if background:
            problem = self.group.broadcast_error(background_failure(earlier))
            if problem is not None:
                raise problem from earlier
        else:
            self.saver.retry_after(earlier)

    def _ranks_rng(self) -> list[Any] | None:
        """Every rank's RNG states on rank 0, gathered before anything is written."""
        return distributed.gather(
            self.group, capture_rng(), name=RNG_GROUP, where=self.host.store.location
        )


class OneProcess(Strategy):
    """One process: capture, then write now or in the background."""

    def save(
        self, step: int, epoch: int, metrics: dict[str, float], *, background: bool
    ) -> CheckpointInfo | None:
        earlier = self.saver.background.drain()  # one save in flight at most
        self._after(earlier, background=background)
        snapshot = self.host.capture(step, epoch, metrics, copy=background)
        self.host.mark_saved(step)
        return self.saver.finish(snapshot, background=background)

    def restore(self) -> int:
        self.raise_background_error()
        if self.host.restored:
            return self.host.step
        misfits: list[DoesNotFit] = []
        check = self._checker(misfits, apply=True)
        placed = restoring.devices(self.host.objects)
        fits = self._fits(misfits)
        objects = self.host.objects
        self._newest(
            lambda: self.host.store.load(
                check=check,
                devices=placed,
                fits=fits,
                targets=lambda heads: restoring.targets(heads, objects),
            ),
            misfits,
        )
        self.host.restored = True
        return self.host.step


class DataParallel(Strategy):
    """Replicated state under ``torch.distributed``: every rank sends its RNG states to rank 0,
    which writes the one checkpoint. A blocking save ends with rank 0 telling every rank the
    outcome; a background one is reported at a later step boundary or by ``wait()``. A
    restore loads, on every rank, the step rank 0 picked."""

    def save(
        self, step: int, epoch: int, metrics: dict[str, float], *, background: bool
    ) -> CheckpointInfo | None:
        group = self.group
        earlier = self.saver.background.drain() if self.leads else None
        # An async save also makes this the point every rank reaches before the write.
        self._after(earlier, background=background)
        ranks = self._ranks_rng()
        self.host.mark_saved(step)
        if not self.leads:
            if not background:
                problem = group.broadcast_error(None)
                if problem is not None:
                    raise problem
            return None
        try:
            snapshot = self.host.capture(step, epoch, metrics, copy=background, ranks=ranks)
        except Exception as exc:
            if not background:
                group.broadcast_error(exc)
                raise
            # The other ranks went on training: fail like a write would, so that every rank
            # learns of it at the next step boundary.
            self.saver.background.start(raiser(exc))
            return None
        if background:
            return self.saver.finish(snapshot, background=True)
        try:
            info = self.saver.write(snapshot)
        except BaseException as exc:
            group.broadcast_error(exc)
            raise
        group.broadcast_error(None)
        return info

    def restore(self) -> int:
        """Rank 0 picks the checkpoint (the newest that verifies), every rank loads that step."""
        if self.host.restored:
            return self.host.step
        group, store = self.group, self.host.store
        chosen: LoadedCheckpoint | None = None
        error: BaseException | None = None
        if self.leads:
            misfits: list[DoesNotFit] = []
            check = self._checker(misfits)
            try:
                fits = self._fits(misfits)
                chosen = self._newest(lambda: store.load(check=check, fits=fits), misfits)
            except Exception as exc:  # shared below, so that no rank waits for rank 0 alone
                error = exc
        problem = group.broadcast_error(error)
        if problem is not None:
            raise problem
        (step,) = group.broadcast_ints([-1 if chosen is None else chosen.step])
        if step < 0:
            self._done_restoring()
            return 0
        plan: restoring.RestorePlan | None = None
        gather: Gather | None = None
        try:
            if not self.leads:
                chosen = store.load(step)
            assert chosen is not None
            plan, gather = self._prepare(chosen)
        except Exception as exc:
            error = exc
        group.raise_any(
            error,
            CheckpointError(
                f"another process of the job could not load the checkpoint of step {step}",
                where=store.location,
                fix="every process must see the same checkpoint folder: on several machines, "
                "put it on a shared file system or an object store; see the failing rank's log",
            ),
        )
        assert plan is not None
        self._apply(plan, gather)
        return self._done_restoring()


class Sharded(Strategy):
    """Sharded state (FSDP2, DTensor): every rank writes and loads its own shards of the
    sharded objects, rank 0 the rest of the state, in one checkpoint. Saves always block:
    the write is a collective of all ranks, which must not run in a background thread."""

    gathers = False  # each rank loads its own shards through DCP

    def _prepare(self, loaded: LoadedCheckpoint) -> tuple[restoring.RestorePlan, Gather | None]:
        plan, _ = super()._prepare(loaded)
        try:
            self._check_sharded_here(loaded, plan.saved.sharded)
        except DoesNotFit:
            optimizer_extras.shrink_groups(plan.grown)
            raise
        return plan, None

    def check_fits(self, heads: LoadedCheckpoint) -> None:
        super().check_fits(heads)
        assert heads.state is not None  # else the check above raised
        self._check_sharded_here(heads, heads.state.sharded)
        # The sharded objects against the metadata's names, global sizes and dtypes, as a
        # gathering restore checks them (here a restore's DCP load refuses what differs).
        Gather(heads, self.host.sharded_objects()).undo()

    def _check_sharded_here(self, loaded: LoadedCheckpoint, saved_sharded: Sequence[str]) -> None:
        """Refuse a checkpoint that holds an object sharded which is here a plain object
        while other objects are sharded: its shards would have nowhere to go."""
        sharded = self.host.sharded_objects()
        plain = [n for n in saved_sharded if n in self.host.objects and n not in sharded]
        if plain:
            raise DoesNotFit(
                f"the checkpoint of step {loaded.step} holds {plain[0]!r} sharded, and here it "
                "is not sharded while other objects are",
                where=loaded.location,
                fix=f"shard {plain[0]!r} as in the run that saved it, or restore it in a job "
                "without sharded objects (one process, or data parallel), which gathers it",
                step=loaded.step,
                differences=[f"{plain[0]} is sharded in the checkpoint, not here"],
            )

    def save(
        self, step: int, epoch: int, metrics: dict[str, float], *, background: bool
    ) -> CheckpointInfo | None:

        sharded = self.host.sharded_objects()
        self.saver.retry_after(self.saver.background.drain())
        ranks = self._ranks_rng() if self.group.world_size > 1 else None
        snapshot = None
        error: BaseException | None = None
        if self.leads:
            try:
                snapshot = self.host.capture(
                    step, epoch, metrics, copy=False, ranks=ranks, sharded=sharded
                )
            except Exception as exc:
                error = exc
        problem = self.group.broadcast_error(error)
        if problem is not None:
            raise problem
        self.host.mark_saved(step)
        return self.saver.run_reported(
            step,
            lambda on_committed: save_sharded(
                self.host.store,
                step,
                {name: obj.state_dict() for name, obj in sharded.items()},
                tensors=snapshot.tensors if snapshot else None,
                data={STATE_FILE: snapshot.state} if snapshot else None,
                metrics=metrics,
                on_committed=on_committed,
            ),
            report=snapshot is not None,
        )

    def restore(self) -> int:
        """Every rank loads its shards in place and the rest of the state (its own RNGs) from
        the newest checkpoint that verifies; rank 0 picks it for all."""

        if self.host.restored:
            return self.host.step
        sharded = self.host.sharded_objects()
        states = {name: loadable_state(obj) for name, obj in sharded.items()}
        misfits: list[DoesNotFit] = []
        plans: list[restoring.RestorePlan] = []
        # The rest of the state is checked before any shard is loaded in place.
        check = self._checker(misfits, plans=plans)
        if (
            self._newest(lambda: load_sharded(self.host.store, states, check=check), misfits)
            is None
        ):
            self._done_restoring()
            return 0
        self.host.apply_plan(plans[-1])
        self.host.restored = True
        for name, state in states.items():
            restoring.load_object(name, sharded[name], state)
        return self._done_restoring()


def choose(host: Host) -> Strategy:
    """The strategy for the Checkpointer behind ``host`` now: sharded objects make it
    :class:`Sharded`, a process group of more than one process :class:`DataParallel`, else
    :class:`OneProcess`."""
    group = distributed.current()
    if host.sharded_objects():
        return Sharded(host, group or distributed.Solo())
    if group is not None:
        return DataParallel(host, group)
    return OneProcess(host, distributed.Solo())
