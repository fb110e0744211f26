"""The training-loop side of the core: full state, exact resume, async saves, stops.

A :class:`Checkpointer` owns named stateful objects (anything with ``state_dict()`` and
``load_state_dict()``) and plain values, and turns them into checkpoints of the store::

    <step>/model.safetensors       one tensor file per object that has tensors
    <step>/optimizer.safetensors
    <step>/rng.safetensors         torch CPU and CUDA generator states
    <step>/state.json              everything else: trees, step, epoch, RNGs, data position

The Checkpointer keeps the loop: steps, epochs, the data position, the cadence, the deadline,
signals, events and the folder's writer lease. Saves happen only at step boundaries. How a
save, a restore and a step boundary's decision run (one process, ``torch.distributed``,
sharded state) is the part of one :class:`~nbresume.checkpoint.loop.strategies.Strategy`,
chosen at the first save or restore; :mod:`~nbresume.checkpoint.state.snapshot` captures and
:mod:`~nbresume.checkpoint.loop.saver` writes (in the background: training is blocked only for
a copy into host memory), and :mod:`~nbresume.checkpoint.state.restoring` checks a checkpoint
against the live objects before it puts it into them, all or nothing. The loop of
:meth:`Checkpointer.epochs` is an object of its own (:mod:`~nbresume.checkpoint.loop.epochloop`).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from nbresume.checkpoint import events as ev
from nbresume.checkpoint import hooks
from nbresume.checkpoint.arguments import check_bool, check_int, check_metric
from nbresume.checkpoint.format import flatten, parse_step_dirname
from nbresume.checkpoint.loop.control import ControlledLoop, LoopControl
from nbresume.checkpoint.loop.durability import Confirmation, confirm
from nbresume.checkpoint.loop.epochloop import Epochs, LoopSteps
from nbresume.checkpoint.loop.keywords import (
    check_arguments,
    check_name,
    is_dataloader,
    option_names,
)
from nbresume.checkpoint.loop.saver import Saver
from nbresume.checkpoint.loop.strategies import Strategy, choose
from nbresume.checkpoint.parallel import is_sharded_object
from nbresume.checkpoint.state import (
    GeneratorState,
    ResumableLoader,
    Snapshot,
    Stateful,
    TrainableOnly,
    capture,
    determinism,
    health,
    is_generator,
    is_stateful,
    optimizer_extras,
    restoring,
    unwrap,
    unwrap_loader,
)
from nbresume.checkpoint.store import (
    CheckpointInfo,
    CheckpointStore,
    KeepBest,
    VerifyReport,
    acquire_writer_lease,
)
from nbresume.errors import FolderInUseError, LeaseLostError, StorageError, UsageError

log = logging.getLogger("nbresume")


class Checkpointer(ControlledLoop):
    """Save and resume full training state, exactly.

    Args:
        dir: where checkpoints live: a local path or an fsspec URL.
        every: save cadence: steps (``500``), a duration (``"15min"``; a float is seconds),
            ``"auto"`` (the Young/Daly interval from the measured save cost) or ``None`` (only
            at the end, at a deadline or on a signal).
        keep: how many of the newest checkpoints to keep (at least 1; ``None`` keeps all).
        keep_best: ``(metric, "min" | "max"[, count])``: also keep the best checkpoints by a
            metric passed to :meth:`save`.
        deadline: ``"auto"`` (the platform's session cap), seconds from now, a duration, or
            ``None``. Before it, :meth:`steps` saves and returns cleanly, leaving ``done`` false.
        async_save: write, commit and verify in the background (training waits only for a copy
            of the state into host memory).
        callbacks: callables that receive every :class:`~nbresume.checkpoint.events.Event`.
        storage_options: options for the fsspec file system of a URL ``dir`` (credentials,
            ``endpoint_url``, ...).
        trainable_only: save only what trains of every ``nn.Module`` (see
            :func:`nbresume.trainable_only`): for fine-tuning with frozen weights.
        quiet: show no progress. Without it, a Checkpointer that no panel or ``nbresume.init``
            shows prints a status line on stderr (log lines when stderr is not a terminal).
        deterministic: make PyTorch's CUDA kernels repeatable (see
            :func:`nbresume.checkpoint.state.determinism.enable`), so that a resumed run continues
            bit for bit on a GPU too; slower. Set it before the first CUDA operation.
        **state: named stateful objects (model, optimizer, scheduler, GradScaler, a
            StatefulDataLoader: anything with ``state_dict()`` and ``load_state_dict()``) and
            DataLoaders. Plain values are set with ``ckpt["name"] = value``.

    Every argument is checked here, before anything is created: a wrong one (a misspelled
    option such as ``evry=2`` included) raises :class:`~nbresume.errors.ArgumentError`.
    """

    def __init__(
        self,
        dir: str | Any,
        *,
        every: int | float | str | None = "auto",
        keep: int | None = 3,
        keep_best: KeepBest | None = None,
        deadline: float | int | str | None = "auto",
        async_save: bool = True,
        callbacks: list[ev.Callback] | None = None,
        storage_options: Mapping[str, Any] | None = None,
        trainable_only: bool = False,
        quiet: bool = False,
        deterministic: bool = False,
        **state: Any,
    ) -> None:
        # Everything is checked before anything is built: a refused call changes nothing.
        check_arguments(
            dir,
            every=every,
            keep=keep,
            keep_best=keep_best,
            deadline=deadline,
            async_save=async_save,
            callbacks=callbacks,
            storage_options=storage_options,
            trainable_only=trainable_only,
            quiet=quiet,
            state=state,
            options=option_names(Checkpointer.__init__),
        )
        check_bool("Checkpointer", "deterministic", deterministic)
        determinism.apply(deterministic, "Checkpointer")
        if (sandbox := hooks.steering().folder(dir)) is not None:  # `nbresume check`'s own
            dir, storage_options = sandbox, None
        self.store = CheckpointStore(
            dir, keep=keep, keep_best=keep_best, storage_options=storage_options
        )
        #: When the loops save and stop: the cadence, the deadline, signals, requests, events.
        self.control = LoopControl(self.store, every=every, deadline=deadline, callbacks=callbacks)
        self.async_save = async_save
        #: No progress display follows this Checkpointer (its callbacks still get every event).
        self.quiet = quiet
        control = self.control
        self._saver = Saver(self.store, control.events, control.cadence, control.durability)
        #: How saves, restores and step boundaries run; chosen at the first save or restore.
        self._chosen: Strategy | None = None
        self._objects: dict[str, Stateful] = {}
        #: Which registered optimizers stepped in the running step (pending gradients).
        self._step_watch = optimizer_extras.StepWatch()
        #: The loop of epochs(), and what the wrapped loaders tell it.
        self._epoch_loop = Epochs(
            self,
            LoopSteps(
                objects=self._objects,
                step_watch=self._step_watch,
                hold_lease=self._hold_lease,
                loop=self._loop,
                ends_here=self._ends_here,
                note_left=self._note_left,
                boundary=self._boundary,
                finish=self._finish,
            ),
        )
        #: The parameter groups each optimizer had when registered, by id.
        self._initial_groups: dict[int, int] = {}
        self._trainable_only = trainable_only
        self._values: dict[str, Any] = {}
        for name, value in state.items():
            self._register(name, value)
        self.step = 0
        self.epoch = 0
        self.total: int | None = None
        self.done = False
        self.restored_step: int | None = None
        #: The number of processes of the job that saved the restored checkpoint, and of this
        #: one, where they differ (``None``: the same, or nothing restored).
        self.reshaped: tuple[int, int] | None = None
        #: What the strategy is given of this Checkpointer (it records whether it restored).
        self._host = StrategyHost(
            store=self.store,
            saver=self._saver,
            counters=self,
            objects=self._objects,
            capture=self._capture,
            mark_saved=self._mark_saved,
            apply_plan=self._apply_plan,
            any_committed=self._any_committed,
            sharded_objects=self._sharded_objects,
            wrapped_loaders=self._epoch_loop.wrapped_loaders,
        )
        self._pending_objects: dict[str, Any] = {}  # restored state of objects not yet registered
        #: The run finished by leaving its loop early (``break``): that loop and its bound.
        self._ended_early: dict[str, Any] | None = None
        #: The metrics last given to save(), with their step: a later save of the same step
        #: (the loop's final save, a stop) keeps them.
        self._step_metrics: tuple[int, dict[str, float]] | None = None
        # One live writer per folder: a second one is refused here, before it writes anything
        # (under torch.distributed only rank 0, the one that writes, takes the lease).
        self._lease = acquire_writer_lease(self.store.backend, drain=self._saver.background.wait)
        atexit.register(self._at_exit)
        ev.announce(self)  # a notebook panel or a status line subscribes here

    # -- the loop control's, as the Checkpointer's own -------------------------------------

    @property
    def started(self) -> bool:
        """Whether it has restored or saved (what it restores from is decided)."""
        return self._chosen is not None

    @property
    def stop_reason(self) -> str:
        """Why the last loop stopped early (``""``: it did not)."""
        return self.control.stop_reason

    # -- registration ----------------------------------------------------------------------

    def _register(self, name: str, value: Any) -> None:
        check_name(name)
        value = unwrap(name, value)  # what accelerator.prepare() wrapped
        if self._trainable_only and restoring.is_module(value):
            value = TrainableOnly(value)
        if is_dataloader(value):
            value = ResumableLoader(value)
        if is_generator(value):
            value = GeneratorState(value)  # restored into the same object
        if optimizer_extras.is_optimizer(value):
            self._step_watch.watch(value)
            self._initial_groups.setdefault(id(value), len(value.param_groups))
        if is_stateful(value):
            self._objects[name] = value
            if isinstance(value, ResumableLoader):
                value.epoch_loop = None
        else:
            flatten(value, name=name)  # refuse what cannot be stored, now rather than at save
            self._values[name] = value

    def __getitem__(self, name: str) -> Any:
        """A plain value (``ckpt["best_acc"]``), as restored or as last set."""
        if name in self._values:
            return self._values[name]
        if name in self._objects:
            value = self._objects[name]
            return value.generator if isinstance(value, GeneratorState) else value
        raise KeyError(name)

    def __setitem__(self, name: str, value: Any) -> None:
        """Set a plain value that is saved with the next checkpoint, or a random generator
        (``torch.Generator``, NumPy's ``Generator`` or ``RandomState``, ``random.Random``)
        whose state is saved with every checkpoint and restored into it."""
        if name in self._objects:
            raise UsageError(f"{name!r} is a stateful object; it cannot be replaced by a value")
        self._register(name, value)

    def loader(self, dataloader: Any = None, *, seed: int | None = None) -> ResumableLoader:
        """A wrapper around ``dataloader`` that resumes mid-epoch at the exact next batch.

        Without an argument, the DataLoader given to the constructor. A torchdata
        StatefulDataLoader needs no wrapper: pass it as a stateful object instead.
        """
        for value in self._objects.values():
            if isinstance(value, ResumableLoader) and (
                dataloader is None or value.loader is dataloader
            ):
                value.epoch_loop = self._epoch_loop
                return value
        if dataloader is None:
            raise UsageError("no DataLoader was given to the Checkpointer", fix="ckpt.loader(dl)")
        dataloader, place = unwrap_loader("dataloader", dataloader)  # Accelerate's loader
        for value in self._objects.values():
            if isinstance(value, ResumableLoader) and value.loader is dataloader:
                value.epoch_loop = self._epoch_loop
                return value
        made_in = self._epoch_loop.refuse_a_remade_loader(dataloader)
        name = "loader" if "loader" not in self._objects else f"loader{len(self._objects)}"
        wrapped = ResumableLoader(dataloader, seed=seed)
        wrapped.place = place
        wrapped.epoch_loop = self._epoch_loop
        wrapped.created_in = made_in
        self._objects[name] = wrapped
        if name in self._pending_objects:
            restoring.load_object(name, wrapped, self._pending_objects.pop(name))
        if self._host.restored:
            self._strategy().share_loader_seeds([wrapped])
        return wrapped

    # -- restore ---------------------------------------------------------------------------

    def restore(self) -> int:
        """Load the newest checkpoint that verifies into every object; return the step to
        continue from (0 when there is none). Unconditional and idempotent: calling it again
        changes nothing.

        Each checkpoint is checked whole before anything is copied (its files, its state, and
        that it fits every object: names, shapes, dtypes); one that does not is passed over
        for the next older one with a warning. When none is usable this raises and leaves
        every object, value, step and RNG as it was."""
        return self._strategy().restore()

    def _strategy(self) -> Strategy:
        """The strategy of this Checkpointer, chosen once: at the first save or restore (see
        :mod:`nbresume.checkpoint.loop.strategies`)."""
        if self._chosen is None:
            self._chosen = choose(self._host)
        return self._chosen

    def _apply_plan(self, plan: restoring.RestorePlan) -> None:
        """Put a checked plan into every object and RNG (all or nothing), then take its
        values and counters."""
        grads = optimizer_extras.plan_gradients_back(
            self._objects, plan.saved.gradients, where=plan.where
        )
        restoring.apply(plan, self._objects, self._pending_objects)
        optimizer_extras.put_gradients_back(grads)
        saved = plan.saved
        self._values.update(saved.values)
        self.step = saved.step
        self.epoch = saved.epoch
        self._ended_early = saved.ended_early
        self.done = saved.done and (
            saved.total is None or self.step >= saved.total or saved.ended_early is not None
        )
        self.restored_step = self.step
        self.control.saved_step = self.step
        # Checkpoints newer than this one were passed over (they fail verification or do not
        # fit): retention never deletes them.
        self.store.protect_newer_than(self.step)
        log.info("nbresume: resumed from step %d (%s)", self.step, plan.where)
        if plan.reshaped:
            self._announce_reshape(saved.world_size, plan.world_size, plan.rank)

    def _announce_reshape(self, before: int, after: int, rank: int) -> None:
        """Say once (the log on the leading process, every process's callbacks, the status
        line) that the run continues with another number of processes, and what that means."""
        text = restoring.reshaped_notice(before, after, self.step)
        self.reshaped = (before, after)
        # The views first (a live terminal line makes room for it), then the log.
        self.events.emit(ev.RESHAPED, self.step, before=before, after=after, text=text)
        if rank == 0:
            log.warning("nbresume: %s", text)

    def _any_committed(self) -> bool:
        """Whether a checkpoint folder has a manifest. A folder without one never committed (an
        interrupted write on an object store) and does not count as a checkpoint."""
        # Anything named manifest.json counts: one that is not a regular file (a FIFO, a link)
        # is a broken checkpoint, and starting over would hide it.
        return any(
            parse_step_dirname(name) is not None and self.store.has_manifest(name)
            for name in self.store.backend.list_folders()
        )

    # -- save ------------------------------------------------------------------------------

    def save(
        self,
        step: int | None = None,
        *,
        metric: float | Mapping[str, float] | None = None,
        block: bool = False,
    ) -> CheckpointInfo | None:
        """Save the state now.

        Inside a loop body, call it after the step's update: the running step counts as done
        (the checkpoint is that of ``step + 1``; in ``epochs()``, after the epoch's last batch,
        that of the next epoch).

        With ``async_save`` and ``block=False`` this returns once the state is copied to host
        memory and the write runs in the background; otherwise it returns the verified
        checkpoint. ``metric`` is a number (named by ``keep_best``) or a dict of numbers.

        A background save that failed is raised here; a blocking save instead tries again
        first (a stop or the final save must not be given up for an older failure), and
        raises only if it fails too.
        """
        if step is not None:
            step = check_int(
                "Checkpointer.save",
                "step",
                step,
                minimum=0,
                fix="ckpt.save() saves the current step; ckpt.save(step=1500) names the step",
            )
        block = check_bool("Checkpointer.save", "block", block)
        metrics = self._metrics(metric)
        if self._epoch_loop.stopping_in_body():
            return self.store.latest()  # the stop's checkpoint is the one to continue from
        current_step, epoch = self._epoch_loop.position()
        step = current_step if step is None else step
        background = self.async_save and not block
        return self._save_at(step, epoch, metrics, background=background)

    def _save_at(
        self, step: int, epoch: int, metrics: dict[str, float], *, background: bool
    ) -> CheckpointInfo | None:
        """Save ``step``; without metrics, the ones last given for this same step (a
        ``save(metric=...)`` at the last step is not lost to the loop's final save)."""
        if metrics:
            self._step_metrics = (step, metrics)
        elif self._step_metrics is not None and self._step_metrics[0] == step:
            metrics = self._step_metrics[1]
        return self._strategy().save(step, epoch, metrics, background=background)

    def _mark_saved(self, step: int) -> None:
        """A save of ``step`` starts now: the cadence counts from here."""
        self.control.saved(step)

    def _sharded_objects(self) -> dict[str, Any]:
        """The objects whose state is sharded, by name (none, and nothing imported, in a
        program that has not imported DTensor or ShardedTensor)."""

        return {n: o for n, o in self._objects.items() if is_sharded_object(o)}

    def _metrics(self, metric: float | Mapping[str, float] | None) -> dict[str, float]:
        """``save(metric=)`` as ``{name: number}``: one number is named by ``keep_best``."""
        return check_metric("Checkpointer.save", metric, self.store.retention.metric_name)

    def _capture(
        self,
        step: int,
        epoch: int,
        metrics: dict[str, float],
        *,
        copy: bool,
        ranks: list[Any] | None = None,
        sharded: Mapping[str, Any] | None = None,
    ) -> Snapshot:
        """The snapshot of the live state (with ``copy``, its tensors copied into host buffers
        where that copy fits in memory: :meth:`Saver.mirror`)."""
        snapshot = capture(
            step,
            epoch,
            metrics,
            objects=self._objects,
            pending=self._pending_objects,
            values=self._values,
            total=self.total,
            done=self.done,
            ranks=ranks,
            sharded=sharded,
            ended_early=self._ended_early if self.done else None,
            gradients=self._pending_gradients(one_process=ranks is None and not sharded),
            added_groups=optimizer_extras.added_groups(self._objects, self._initial_groups),
        )
        if copy:
            self._saver.mirror(snapshot)
        return snapshot

    _warned_gradients = False

    def _pending_gradients(self, *, one_process: bool) -> dict[str, dict[str, Any]]:
        """The gradients accumulated since the last optimizer step (see
        :mod:`nbresume.checkpoint.state.optimizer_extras`); under torch.distributed each rank
        holds its own, which one checkpoint cannot carry: said once."""
        found = optimizer_extras.pending_gradients(self._objects, self._step_watch)
        if found and not one_process:
            if not self._warned_gradients:
                self._warned_gradients = True
                log.warning(
                    "nbresume: a save at step %d falls between two steps of %s: under "
                    "torch.distributed the gradients accumulated since are not saved, and the "
                    "resumed run repeats those micro-batches' update without them; save on an "
                    "accumulation boundary (every= a multiple of it)",
                    self.step,
                    ", ".join(found),
                )
            return {}
        return found

    def wait(self, *, durable: bool = False, timeout: float | None = None) -> Confirmation | None:
        """Block until the save in flight (if any) is committed and verified; raise its error.

        With ``durable=True``, then wait until the storage itself confirms the newest
        checkpoint (Google Drive reports its MD5s, an object store lists its files, a local
        disk has fsynced them) and return what it confirmed: the moment it is safe to close
        the tab or stop the machine. ``timeout`` (seconds) bounds that wait; past it,
        :class:`~nbresume.errors.CheckpointError` says what the storage reported.

        Under ``torch.distributed`` every rank calls it, and every rank raises rank 0's error.
        """
        self._saver.background.wait()
        if self._chosen is not None:  # else nothing was ever saved
            self._chosen.raise_background_error()
        return confirm(self.store, timeout=timeout) if durable else None

    # -- the loops -------------------------------------------------------------------------

    def epochs(self, count: int) -> Iterator[int]:
        """Yield epoch indices from where the restored checkpoint ended up to ``count``.

        Iterate ``ckpt.loader(dataloader)`` inside (wrapped before the loop or inside it,
        given to the constructor, in ``enumerate``, in ``zip``): every batch a wrapped loader
        hands out belongs to a step, and saves happen at step boundaries as in :meth:`steps`.
        A step ends when a wrapped loader that already handed out a batch in it is asked for
        another (so ``zip`` of two loaders makes one step per pair), when such a loader is
        left (``break``), or when the body of the epoch ends. Each wrapped loader makes one
        pass per epoch; a pass left early ends there, and the next epoch starts the loader's
        next epoch of data. An epoch in which no wrapped loader hands out a batch is one step.
        ``count`` is a whole number of epochs, 0 or more.
        """
        count = check_int(
            "Checkpointer.epochs",
            "count",
            count,
            minimum=0,
            fix="ckpt.epochs(90) runs the epochs up to 90 that are left",
        )
        return self._epoch_loop.run(count)  # a generator of its own: a bad count is refused here

    def steps(self, total: int) -> Iterator[int]:
        """Yield step indices from where the restored checkpoint ended up to ``total``.

        Saves on cadence at step boundaries, saves and stops before the deadline and on
        SIGTERM / SIGUSR1 / an interrupt, and saves at the end, setting :attr:`done`.
        ``total`` is a whole number of steps, 0 or more. Take batches with
        ``ckpt.loader(dataloader).batches()``.
        """
        total = check_int(
            "Checkpointer.steps",
            "total",
            total,
            minimum=0,
            fix="ckpt.steps(10_000) runs the steps up to 10000 that are left",
        )
        return self._steps(total)  # a generator of its own: a bad total is refused right here

    def _steps(self, total: int) -> Iterator[int]:
        self.restore()
        self.total = total
        if self.step >= total or self._ends_here("steps", total):
            self.done = True
            return
        self.done = False  # a finished run given a larger total is unfinished again
        self._hold_lease()
        self._epoch_loop.state = None  # wrapped loaders hand out batches as asked, uncounted
        with self._loop(("steps", total)):
            while True:
                started = time.monotonic()
                self._epoch_loop.body = "step"
                self._step_watch.step_begins()
                try:
                    yield self.step
                except GeneratorExit:
                    self._note_left()
                    raise
                self._epoch_loop.body = None
                self.step += 1
                self.cadence.observe_step(time.monotonic() - started)
                if self._boundary(final=self.step >= total):
                    return
                if self.step >= total:
                    break
        self._finish()

    def _boundary(self, *, final: bool) -> bool:
        """At a step boundary: report progress, save when due, and stop when asked.
        Returns True when the loop must end now (the state was saved).

        Under ``torch.distributed``, a signal, a deadline, a request or a failed background
        save seen by any rank counts for all of them, at this same step, through one small
        agreement (see :mod:`nbresume.checkpoint.parallel.distributed`). The time-based cadence
        is the leading process's, whose clock measures the saves."""
        try:
            return self._step_boundary(final=final)
        finally:
            optimizer_extras.release_groups()

    def _step_boundary(self, *, final: bool) -> bool:
        self.events.emit(ev.STEP, self.step, total=self.total, epoch=self.epoch)
        if final:
            return False  # the final save is blocking: it retries an earlier failure itself
        strategy = self._strategy()
        control = self.control
        decision = control.decide(
            self.step,
            strategy.agree,
            on_cadence=strategy.leads,
            failed=self._saver.background.failed,
        )
        # A background save failed: say so now, not after `every` more steps of training that
        # could not be saved. A stop goes first: its blocking save() tries again.
        if decision.failed and not decision.stop:
            strategy.raise_background_error()
        if decision.stop:
            control.stop_reason = decision.stop
            self.save(block=True)
            control.stopped(self.step, decision.stop)
            if decision.signum:
                control.end_for_signal(decision.signum, self.step, leads=strategy.leads)
            return True
        if decision.save:
            self.save()
        return False

    def _finish(self) -> None:
        self.done = True
        self.save(block=True)
        self.events.emit(ev.DONE, self.step)
        # A finished run writes nothing more: another process may use the folder now (a
        # later save of this one takes the lease again, or is refused by that process).
        self._release_lease()

    # -- a loop left early (break): early stopping ------------------------------------------

    def _ends_here(self, loop: str, bound: int) -> bool:
        """Whether the restored run ended early in this same loop: it trains no further. Asked
        for another bound, it is unfinished again."""
        if self._ended_early is None:
            return False
        if self._ended_early == {"loop": loop, "bound": bound}:
            return True
        self._ended_early = None
        return False

    def _note_left(self) -> None:
        """The loop's generator is closed while its body runs: the body was left (``break``,
        or an exception; CPython closes it at once). close() decides which it was."""
        if self.control.exit.left_at is None:
            self.control.exit.left_at = self._epoch_loop.position()

    def _end_left_loop(self) -> None:
        """At close() (or the interpreter's exit): a loop body left by ``break`` is the run's
        end. Its step is saved as finished, and the same code run again trains no further
        (with ``request_stop()`` before the break, it is saved as stopped, not finished). A
        body left by an exception saves nothing: the newest checkpoint is where to resume."""
        ended = self.control.exit
        left, ended.left_at = ended.left_at, None
        if left is None or ended.bound is None or self.done:
            return
        if self.stop_reason or self.control.signum is not None:
            return  # a stop (a signal, the deadline) saved, or stops at once: not a break
        if sys.exc_info()[1] is not None or _unhandled() is not ended.unhandled_at_start:
            return  # an exception left the body: the newest checkpoint is where to resume
        if self._lease is not None:
            try:
                self._lease.check()
            except (LeaseLostError, FolderInUseError) as exc:
                # A newer Checkpointer (a cell run again) or another process writes here now.
                log.debug("nbresume: the loop left at step %d is not saved: %s", left[0], exc)
                return
            except (OSError, StorageError):
                pass  # the save itself reports what is wrong with the folder
        self._epoch_loop.body = None
        loop, bound = ended.bound
        step, epoch = left
        self.step, self.epoch = step, epoch
        stopped = self.control.stop_asked
        if stopped:
            self.control.stop_reason = stopped
        else:
            self.done = True
            self._ended_early = {"loop": loop, "bound": bound}
        self._save_at(step, epoch, {}, background=False)
        if stopped:
            self.control.stopped(step, stopped)
        else:
            log.info(
                "nbresume: the loop was left at step %d (break): saved as the end of the run; "
                "run again, it trains no further (call ckpt.request_stop() before a break to "
                "keep the run unfinished)",
                step,
            )
            self.events.emit(ev.DONE, step)

    @contextlib.contextmanager
    def _loop(self, bound: tuple[str, int]) -> Iterator[None]:
        """Signals become stop requests handled at the next step boundary, never a write in
        the handler itself."""
        health.watch_oom(self)  # an out-of-memory error leaving the body gets the advice
        ended = self.control.exit
        if not ended.running:
            ended.bound = bound
            ended.left_at = None
            ended.unhandled_at_start = _unhandled()
            # A stop asked for before this loop, or the reason the last one stopped, is not
            # meant for this one (epochs() ends early while stop_reason is set).
            self.control.begin(self.step)
        if ended.running or threading.current_thread() is not threading.main_thread():
            yield
            return
        ended.running = True
        self._epoch_loop.batch_started = None
        try:
            with self.control.signals():
                yield
        finally:
            ended.running = False

    # -- inspection and lifetime -----------------------------------------------------------

    def latest(self) -> CheckpointInfo | None:
        """The newest committed checkpoint."""
        return self.store.latest()

    def list(self) -> list[CheckpointInfo]:
        """Committed checkpoints, oldest first."""
        return self.store.list()

    def verify(self) -> VerifyReport:
        """Read back every checkpoint and compare it with its manifest (waits for a save in
        flight first); then check each whole one against the registered objects as
        :meth:`restore` checks it before it reads a tensor (names, shapes, dtypes, from the
        tensor files' headers). One that does not fit fails with the reason restore would
        pass it over for, and its fix. Without registered objects, only wholeness is checked
        (as ``nbresume verify`` checks it)."""
        self.wait()
        if not self._objects:
            return self.store.verify()
        # The restore's own strategy, or the one it would choose now (not kept: the first
        # save or restore chooses, once the job and the sharding are set up).
        strategy = self._chosen or choose(self._host)
        return self.store.verify(fits=strategy.check_fits)

    def close(self) -> None:
        """Finish the save in flight and raise its error, if any; wait until the checkpoints
        retention deleted are off the disk; take nbresume's hooks off the registered
        optimizers; give back the folder's writer lease (a later save or loop takes both
        again)."""
        atexit.unregister(self._at_exit)
        try:
            self._end_left_loop()
            self.wait()
        finally:
            self._step_watch.unhook()
            optimizer_extras.release_groups()
            self._release_lease()

    def _release_lease(self) -> None:
        # The folder becomes another process's to use: what retention deleted is gone first.
        self.store.wait_removals()
        if self._lease is not None:
            self._lease.release()

    def _hold_lease(self) -> None:
        """At the start of a loop: hold the folder's writer lease (given back when the last
        loop finished, or never taken), so that a second live writer is refused before the
        first step rather than at the first save."""
        if self._lease is None:
            return
        try:
            self._lease.check()  # FolderInUseError / LeaseLostError: refused, before any step
        except (OSError, StorageError) as exc:
            # A folder that cannot be written now: the save reports that itself.
            log.debug("nbresume: writer lease of %s deferred to the save: %s", self.store, exc)

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if isinstance(exc_info[1], BaseException):
            health.advise_oom(exc_info[1], self)
        if exc_info[0] is None:
            self.close()
        else:
            atexit.unregister(self._at_exit)
            self._saver.background.wait()
            error = self._saver.background.take_error()
            if error is not None:
                log.error("nbresume: a background save failed: %s", error)
            self._release_lease()

    def _at_exit(self) -> None:
        try:
            self._end_left_loop()
        except Exception as exc:  # the interpreter is exiting: say it, never raise
            print(f"nbresume: the early stop could not be saved: {exc}", file=sys.stderr)
        self._saver.background.wait()
        error = self._saver.background.take_error()
        if error is not None:
            print(
                f"nbresume: the last background save failed and is NOT on disk: {error}",
                file=sys.stderr,
            )
        self._release_lease()

    def __repr__(self) -> str:
        return f"Checkpointer({self.store.location!r}, step={self.step}, done={self.done})"


def _unhandled() -> object:
    """The last exception that reached the top of the interpreter unhandled (a script's, or a
    notebook cell's), or None."""
    return getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)


class StrategyHost:
    """What a Checkpointer gives its strategy
    (:class:`~nbresume.checkpoint.loop.strategies.Host`): the store, the saver and the steps of a
    save and a restore, and nothing else of it."""

    def __init__(
        self,
        *,
        store: CheckpointStore,
        saver: Saver,
        counters: Checkpointer,
        objects: Mapping[str, Stateful],
        capture: Callable[..., Snapshot],
        mark_saved: Callable[[int], None],
        apply_plan: Callable[[restoring.RestorePlan], None],
        any_committed: Callable[[], bool],
        sharded_objects: Callable[[], dict[str, Any]],
        wrapped_loaders: Callable[[], list[ResumableLoader]],
    ) -> None:
        self.store = store
        self.saver = saver
        self.objects = objects
        self.capture = capture
        self.mark_saved = mark_saved
        self.apply_plan = apply_plan
        self.any_committed = any_committed
        self.sharded_objects = sharded_objects
        self.wrapped_loaders = wrapped_loaders
        #: Whether the Checkpointer restored (or found nothing to restore) already.
        self.restored = False
        self._counters = counters

    @property
    def step(self) -> int:
        """The Checkpointer's step."""
        return self._counters.step
