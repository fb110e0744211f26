"""The training-loop side of the core: full state, exact resume, async saves, stops.

A :class:`Checkpointer` owns named stateful objects (anything with ``state_dict()`` and
``load_state_dict()``) and plain values, and turns them into checkpoints of the store::

    <step>/model.safetensors       one tensor file per object that has tensors
    <step>/optimizer.safetensors
    <step>/rng.safetensors         torch CPU and CUDA generator states
    <step>/state.json              everything else: trees, step, epoch, RNGs, data position

Saves happen only at step boundaries. A background save first copies every tensor into host
buffers that are reused from one save to the next (pinned when the tensor lives on CUDA), so
training is blocked only for that copy; writing, committing and verifying run in a thread.
At most one save is in flight: the next one waits for it, which bounds memory to one copy.
"""

from __future__ import annotations

import atexit
import contextlib
import difflib
import inspect
import logging
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from types import FrameType
from typing import Any

from nbresume import knobs
from nbresume.checkpoint import distributed
from nbresume.checkpoint import events as ev
from nbresume.checkpoint.arguments import (
    check_bool,
    check_callbacks,
    check_int,
    check_keep,
    check_keep_best,
    check_metric,
    check_storage_options,
    kind,
    refused,
    show,
)
from nbresume.checkpoint.cadence import Cadence, parse_every
from nbresume.checkpoint.data import ResumableLoader
from nbresume.checkpoint.deadline import check_deadline, resolve_deadline
from nbresume.checkpoint.durability import DurabilityWatcher
from nbresume.checkpoint.format import parse_step_dirname
from nbresume.checkpoint.lease import acquire_writer_lease
from nbresume.checkpoint.state import (
    STATE_VERSION,
    SavedState,
    capture_rng,
    decode_state,
    flatten,
    is_state_document,
    restore_rng,
)
from nbresume.checkpoint.storage import Store, check_location
from nbresume.checkpoint.store import (
    CheckpointInfo,
    CheckpointStore,
    KeepBest,
    LoadedCheckpoint,
    VerifyReport,
)
from nbresume.checkpoint.trainable import TrainableOnly
from nbresume.errors import (
    CheckpointError,
    CorruptCheckpointError,
    NbresumeError,
    NoCheckpointError,
    StorageError,
    UsageError,
)

log = logging.getLogger("nbresume")

STATE_FILE = "state"
RNG_GROUP = "rng"
VALUES_GROUP = "values"
_RESERVED = {STATE_FILE, RNG_GROUP, VALUES_GROUP, "manifest"}


class _Snapshot:
    """Everything one checkpoint holds, detached from the live training objects."""

    def __init__(self, step: int, tensors: dict[str, dict[str, Any]], state: dict[str, Any],
                 metrics: dict[str, float]) -> None:  # fmt: skip
        self.step = step
        self.tensors = tensors
        self.state = state
        self.metrics = metrics


class _HostBuffers:
    """Host copies of tensors, reused across saves so that a save allocates nothing new."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, str], Any] = {}

    def copy(self, tensors: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        cuda = False
        for group, members in tensors.items():
            out[group] = {}
            for key, value in members.items():
                out[group][key] = self._copy_one((group, key), value)
                cuda = cuda or getattr(value, "is_cuda", False)
        if cuda:
            import torch

            torch.cuda.synchronize()  # the non-blocking copies must land before the write
        return out

    def _copy_one(self, slot: tuple[str, str], value: Any) -> Any:
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
            buffer = torch.empty(
                source.shape, dtype=source.dtype, device="cpu", pin_memory=source.is_cuda
            )
            self._buffers[slot] = buffer
        buffer.copy_(source, non_blocking=source.is_cuda)
        return buffer


class _BackgroundSave:
    """At most one save running in a thread; its failure is kept until someone asks."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self, work: Callable[[], None]) -> None:
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


class _EpochLoop:
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


class Checkpointer:
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
        **state: Any,
    ) -> None:
        # Everything is checked before anything is built: a refused call changes nothing.
        _check_arguments(
            dir,
            every=every,
            keep=keep,
            keep_best=keep_best,
            deadline=deadline,
            async_save=async_save,
            callbacks=callbacks,
            storage_options=storage_options,
            trainable_only=trainable_only,
            state=state,
        )
        self.store = CheckpointStore(
            dir, keep=keep, keep_best=keep_best, storage_options=storage_options
        )
        self.cadence = Cadence(every)
        self.async_save = async_save
        self.events = ev.EventBus(callbacks)
        #: Watches checkpoints on a write-back store (Drive) until the durable copy matches.
        self.durability = (
            DurabilityWatcher(self.store, self.events) if self.store.store.write_back else None
        )
        self.deadline, self.deadline_source = resolve_deadline(deadline)
        self._explicit_deadline = deadline not in (None, "auto")
        self._keep_best = keep_best
        self._objects: dict[str, Any] = {}
        self._trainable_only = trainable_only
        self._values: dict[str, Any] = {}
        for name, value in state.items():
            self._register(name, value)
        self.step = 0
        self.epoch = 0
        self.total: int | None = None
        self.done = False
        self.restored_step: int | None = None
        self.stop_reason = ""
        self._restored = False
        self._pending_objects: dict[str, Any] = {}  # restored state of objects not yet registered
        self._buffers = _HostBuffers()
        self._background = _BackgroundSave()
        self._last_saved_step: int | None = None
        self._last_save_time = time.monotonic()
        self._stop_signal: int | None = None
        self._in_loop = False
        self._save_requested = False  # set from any thread by request_save()
        self._stop_request = ""  # set from any thread by request_stop()
        # One live writer per folder: a second one is refused here, before it writes anything
        # (under torch.distributed only rank 0, the one that writes, takes the lease).
        self._lease = acquire_writer_lease(self.store.store, drain=self._background.wait)
        atexit.register(self._at_exit)
        ev.announce(self)  # a notebook panel or a status line subscribes here

    # -- registration ----------------------------------------------------------------------

    def _register(self, name: str, value: Any) -> None:
        _check_name(name)
        if self._trainable_only and _is_module(value):
            value = TrainableOnly(value)
        if _is_dataloader(value):
            value = ResumableLoader(value)
        if hasattr(value, "state_dict") and hasattr(value, "load_state_dict"):
            self._objects[name] = value
            if isinstance(value, ResumableLoader):
                value._on_batch = None
        else:
            flatten(value, name=name)  # refuse what cannot be stored, now rather than at save
            self._values[name] = value

    def __getitem__(self, name: str) -> Any:
        """A plain value (``ckpt["best_acc"]``), as restored or as last set."""
        if name in self._values:
            return self._values[name]
        if name in self._objects:
            return self._objects[name]
        raise KeyError(name)

    def __setitem__(self, name: str, value: Any) -> None:
        """Set a plain value that is saved with the next checkpoint."""
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
                value._on_batch = self
                return value
        if dataloader is None:
            raise UsageError("no DataLoader was given to the Checkpointer", fix="ckpt.loader(dl)")
        made_in = self._refuse_a_remade_loader(dataloader)
        name = "loader" if "loader" not in self._objects else f"loader{len(self._objects)}"
        wrapped = ResumableLoader(dataloader, seed=seed)
        wrapped._on_batch = self
        wrapped._created_in = made_in
        self._objects[name] = wrapped
        if name in self._pending_objects:
            self._load_object(name, wrapped, self._pending_objects.pop(name))
        group = distributed.current()
        if group is not None and self._restored:
            (wrapped.seed,) = group.broadcast_ints([wrapped.seed])  # see _share_loader_seeds
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
        sharded = self._sharded_objects()
        if sharded:
            return self._restore_sharded(sharded)
        group = distributed.current()
        if group is not None:
            return self._restore_distributed(group)
        self._raise_background_error()
        if self._restored:
            return self.step
        misfits: list[_DoesNotFit] = []
        try:
            self.store.load(check=self._restorer(rank=0, world_size=1, apply=True, misfits=misfits))
        except NoCheckpointError:
            if self._any_committed():
                raise  # checkpoints exist but none verifies: starting over would hide that
        except _DoesNotFit as exc:
            raise _no_fit(exc, misfits, self.store.location) from None
        self._restored = True
        return self.step

    def _restorer(
        self, *, rank: int, world_size: int, apply: bool, misfits: list[_DoesNotFit]
    ) -> Callable[[LoadedCheckpoint], None]:
        """The check :meth:`CheckpointStore.load` runs on each candidate: validate it against
        the live objects (and with ``apply``, put it into them, all or nothing). Checkpoints
        that do not fit are collected in ``misfits``."""

        def check(loaded: LoadedCheckpoint) -> None:
            try:
                plan = self._plan(loaded, rank=rank, world_size=world_size)
            except _DoesNotFit as exc:
                misfits.append(exc)
                raise
            if apply:
                self._apply_plan(plan)

        return check

    def _restore_distributed(self, group: distributed.Group) -> int:
        """Rank 0 picks the checkpoint (the newest that verifies), every rank loads that step."""
        if self._restored:
            return self.step
        chosen: LoadedCheckpoint | None = None
        error: BaseException | None = None
        if group.rank == 0:
            misfits: list[_DoesNotFit] = []
            try:
                chosen = self.store.load(
                    check=self._restorer(
                        rank=0, world_size=group.world_size, apply=False, misfits=misfits
                    )
                )
            except NoCheckpointError as exc:
                if self._any_committed():
                    error = exc  # checkpoints exist but none verifies
            except _DoesNotFit as exc:
                error = _no_fit(exc, misfits, self.store.location)
            except Exception as exc:  # shared below, so that no rank waits for rank 0 alone
                error = exc
        problem = group.broadcast_error(error)
        if problem is not None:
            raise problem
        (step,) = group.broadcast_ints([-1 if chosen is None else chosen.step])
        if step < 0:
            self._restored = True
            self._share_loader_seeds(group)
            return 0
        plan: _RestorePlan | None = None
        try:
            if group.rank != 0:
                chosen = self.store.load(step)
            assert chosen is not None
            plan = self._plan(chosen, rank=group.rank, world_size=group.world_size)
        except Exception as exc:
            error = exc
        (failed,) = group.agree([error is not None])
        if error is not None:
            raise error
        if failed:
            raise CheckpointError(
                f"another process of the job could not load the checkpoint of step {step}",
                where=self.store.location,
                fix="every process must see the same checkpoint folder: on several machines, "
                "put it on a shared file system or an object store; see the failing rank's log",
            )
        assert plan is not None
        self._apply_plan(plan)
        self._restored = True
        self._share_loader_seeds(group)
        return self.step

    def _plan(self, loaded: LoadedCheckpoint, *, rank: int, world_size: int) -> _RestorePlan:
        """Decode and check everything a restore needs from ``loaded`` without changing
        anything: the state document, this rank's RNG states, and the match between every
        saved object and the live one (names, shapes, dtypes)."""
        where = f"{loaded.location}/{STATE_FILE}.json"
        saved = loaded.state
        if saved is None:
            document = loaded.data.get(STATE_FILE)
            if not is_state_document(document):
                raise CorruptCheckpointError(
                    "state.json is missing or is not a Checkpointer's state", where=where
                )
            saved = decode_state(document, loaded.tensors, where=where)
        rng = _rank_rng(saved, rank=rank, world_size=world_size, where=loaded.location)
        differences: list[str] = []
        files: list[str] = []  # the tensor files of the objects that differ
        for name, tree in saved.objects.items():
            if name in self._objects:
                try:
                    found = _differences(name, self._objects[name], tree)
                except Exception as exc:  # a saved tree of an unexpected form
                    found = [f"{name}: the saved state cannot be compared with it ({exc!r})"]
                differences += found
                if found and f"{name}.safetensors" in loaded.manifest.files:
                    files.append(f"{loaded.location}/{name}.safetensors")
        if differences:
            shown = "; ".join(differences[:8])
            more = f"; and {len(differences) - 8} more" if len(differences) > 8 else ""
            raise _DoesNotFit(
                f"the checkpoint of step {loaded.step} does not fit the objects given: "
                f"{shown}{more}",
                where=", ".join(files) or where,
                fix=_NO_FIT_FIX,
                step=loaded.step,
                differences=differences,
            )
        missing = sorted(self._objects.keys() - saved.objects.keys() - set(saved.sharded))
        return _RestorePlan(loaded.location, saved, rng, missing)

    def _apply_plan(self, plan: _RestorePlan) -> None:
        """Put a checked plan into every object, value and RNG, all or nothing: objects whose
        state was not checked against a live copy are loaded first, each after a snapshot, and
        if one still fails, every one loaded so far and the RNGs are put back as they were."""
        saved = plan.saved
        rng_before = capture_rng()
        # Unchecked objects first (each can be put back), then optimizers, whose loading has
        # more ways to fail than a module's, and the modules last.
        order = sorted(
            (n for n in saved.objects if n in self._objects),
            key=lambda n: (_is_checked_kind(self._objects[n]), _is_module(self._objects[n])),
        )
        undo: list[tuple[str, Any, Any]] = []
        try:
            restore_rng(plan.rng)
            for name in order:
                obj = self._objects[name]
                before = None if _is_checked_kind(obj) else _snapshot(obj)
                if before is not None:
                    undo.append((name, obj, before))  # the failing one too: it may be half done
                self._load_object(name, obj, saved.objects[name])
        except BaseException:
            for _, obj, before in reversed(undo):
                with contextlib.suppress(Exception):
                    obj.load_state_dict(before)
            restore_rng(rng_before)
            raise
        for name, tree in saved.objects.items():
            if name not in self._objects:
                self._pending_objects[name] = tree
        for name in plan.missing:
            warnings.warn(
                f"nbresume: the checkpoint at {plan.where} holds no state for {name!r}; "
                "it keeps its current state",
                RuntimeWarning,
                stacklevel=5,
            )
        self._values.update(saved.values)
        self.step = saved.step
        self.epoch = saved.epoch
        self.done = saved.done and (saved.total is None or self.step >= saved.total)
        self.restored_step = self.step
        self._last_saved_step = self.step
        log.info("nbresume: resumed from step %d (%s)", self.step, plan.where)

    def _share_loader_seeds(self, group: distributed.Group) -> None:
        """Give every rank rank 0's data seeds. A restored loader gets rank 0's seed from the
        checkpoint anyway; sharing it from the start makes a resumed run draw the same
        per-sample randomness as one that was never interrupted, even when each rank seeded
        torch differently."""
        loaders = [o for o in self._objects.values() if isinstance(o, ResumableLoader)]
        if not loaders:
            return
        seeds = group.broadcast_ints([loader.seed for loader in loaders])
        for loader, seed in zip(loaders, seeds, strict=True):
            loader.seed = seed

    def _any_committed(self) -> bool:
        """Whether a checkpoint folder has a manifest. A folder without one never committed (an
        interrupted write on an object store) and does not count as a checkpoint."""
        # Anything named manifest.json counts: one that is not a regular file (a FIFO, a link)
        # is a broken checkpoint, and starting over would hide it.
        return any(
            parse_step_dirname(name) is not None and self.store._has_manifest(name)
            for name in self.store.store.list_folders()
        )

    @staticmethod
    def _load_object(name: str, obj: Any, tree: Any) -> None:
        try:
            obj.load_state_dict(tree)
        except NbresumeError:
            raise  # it names what is wrong and the fix already
        except Exception as exc:
            raise CheckpointError(
                f"restoring {name!r} failed: {exc}",
                fix="the object must be built exactly as in the run that saved it "
                "(same model, optimizer and parameter groups)",
            ) from exc

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
        if self._stopping_in_body():
            return self.store.latest()  # the stop's checkpoint is the one to continue from
        current_step, epoch = self._position()
        step = current_step if step is None else step
        background = self.async_save and not block
        group = distributed.current()
        sharded = self._sharded_objects()
        if sharded:
            return self._save_sharded(group, step, epoch, metrics=metrics, sharded=sharded)
        if group is not None:
            return self._save_distributed(group, step, epoch, metrics, background=background)
        self._background.wait()  # one save in flight at most; the buffers are reused
        if background:
            self._raise_background_error()
        else:
            earlier = self._background.take_error()
            if earlier is not None:
                log.warning("nbresume: a background save failed (%s); saving again now", earlier)
        snapshot = self._capture(step, epoch, metrics, copy=background)
        self._last_saved_step = step
        self._last_save_time = time.monotonic()
        if background:

            def write() -> None:
                self._write(snapshot)

            self._background.start(write)
            return None
        return self._write(snapshot)

    def _save_distributed(
        self,
        group: distributed.Group,
        step: int,
        epoch: int,
        metrics: dict[str, float],
        *,
        background: bool,
    ) -> CheckpointInfo | None:
        """Every rank sends its RNG states to rank 0, which writes the one checkpoint. A
        blocking save ends with rank 0 telling every rank the outcome; a background one is
        reported at a later step boundary or by :meth:`wait`."""
        earlier: BaseException | None = None
        if group.rank == 0:
            self._background.wait()
            earlier = self._background.take_error()
        if background:
            # As in one process: an async save raises the last background failure, now on
            # every rank (this is also the point every rank reaches before the write).
            problem = group.broadcast_error(_background_failure(earlier))
            if problem is not None:
                raise problem from earlier
        elif earlier is not None:
            log.warning("nbresume: a background save failed (%s); saving again now", earlier)
        packed = group.all_gather_bytes(distributed.pack(capture_rng(), name=RNG_GROUP))
        self._last_saved_step = step
        self._last_save_time = time.monotonic()
        if group.rank != 0:
            if not background:
                problem = group.broadcast_error(None)
                if problem is not None:
                    raise problem
            return None
        where = self.store.location
        try:
            ranks = [distributed.unpack(data, where=f"{where} (rank {r})") for r, data in
                     enumerate(packed)]  # fmt: skip
            snapshot = self._capture(step, epoch, metrics, copy=background, ranks=ranks)
        except Exception as exc:
            if not background:
                group.broadcast_error(exc)
                raise
            # The other ranks went on training: fail like a write would, so that every rank
            # learns of it at the next step boundary.
            self._background.start(_raiser(exc))
            return None
        if background:

            def write() -> None:
                self._write(snapshot)

            self._background.start(write)
            return None
        try:
            info = self._write(snapshot)
        except BaseException as exc:
            group.broadcast_error(exc)
            raise
        group.broadcast_error(None)
        return info

    # -- sharded state (FSDP2, DTensor): every rank saves and loads its own shards -----------

    def _sharded_objects(self) -> dict[str, Any]:
        """The objects whose state is sharded, by name (none, and nothing imported, in a
        program that has not imported DTensor or ShardedTensor)."""
        from nbresume.checkpoint.sharded import is_sharded_object

        return {n: o for n, o in self._objects.items() if is_sharded_object(o)}

    def _save_sharded(
        self,
        group: distributed.Group | None,
        step: int,
        epoch: int,
        *,
        metrics: dict[str, float],
        sharded: dict[str, Any],
    ) -> CheckpointInfo:
        """Every rank writes its shards of the sharded objects, rank 0 the rest of the state,
        into one checkpoint (see :mod:`nbresume.checkpoint.sharded`). Always blocking: the
        write is a collective of all ranks, which must not run in a background thread."""
        from nbresume.checkpoint.sharded import save_sharded

        self._background.wait()
        earlier = self._background.take_error()
        if earlier is not None:
            log.warning("nbresume: a background save failed (%s); saving again now", earlier)
        rank = 0 if group is None else group.rank
        ranks: list[Any] | None = None
        if group is not None:
            packed = group.all_gather_bytes(distributed.pack(capture_rng(), name=RNG_GROUP))
            if rank == 0:
                where = self.store.location
                ranks = [distributed.unpack(data, where=f"{where} (rank {r})") for r, data in
                         enumerate(packed)]  # fmt: skip
        snapshot: _Snapshot | None = None
        error: BaseException | None = None
        if rank == 0:
            try:
                snapshot = self._capture(
                    step, epoch, metrics, copy=False, ranks=ranks, sharded=sharded
                )
            except Exception as exc:
                error = exc
        if group is not None:
            problem = group.broadcast_error(error)
            if problem is not None:
                raise problem
        elif error is not None:
            raise error
        self._last_saved_step = step
        self._last_save_time = time.monotonic()
        started = time.monotonic()
        if snapshot is not None:
            self.events.emit(ev.SAVE_STARTED, step)
        try:
            info = save_sharded(
                self.store,
                step,
                {name: obj.state_dict() for name, obj in sharded.items()},
                tensors=snapshot.tensors if snapshot else None,
                data={STATE_FILE: snapshot.state} if snapshot else None,
                metrics=metrics,
                on_committed=lambda i: self.events.emit(
                    ev.COMMITTED, i.step, location=i.location, size=i.size
                ),
            )
        except BaseException as exc:
            if snapshot is not None:
                self.events.emit(ev.FAILED, step, error=str(exc))
            raise
        if snapshot is not None:
            seconds = time.monotonic() - started
            self.cadence.observe_save(seconds)
            self.events.emit(
                ev.VERIFIED, info.step, location=info.location, size=info.size, seconds=seconds
            )
            if self.durability is not None:
                self.durability.track(info)
        return info

    def _restore_sharded(self, sharded: dict[str, Any]) -> int:
        """Every rank loads its shards in place and the rest of the state (its own RNGs) from
        the newest checkpoint that verifies; rank 0 picks it for all."""
        from nbresume.checkpoint.sharded import load_sharded, loadable_state

        if self._restored:
            return self.step
        group = distributed.current()
        states = {name: loadable_state(obj) for name, obj in sharded.items()}
        plans: list[_RestorePlan] = []

        def check(loaded: LoadedCheckpoint) -> None:
            # The rest of the state is checked before any shard is loaded in place.
            plans.append(
                self._plan(
                    loaded,
                    rank=0 if group is None else group.rank,
                    world_size=1 if group is None else group.world_size,
                )
            )

        try:
            load_sharded(self.store, states, check=check)
        except NoCheckpointError:
            if self._any_committed():
                raise  # checkpoints exist but none verifies: starting over would hide that
            self._restored = True
            if group is not None:
                self._share_loader_seeds(group)
            return 0
        self._apply_plan(plans[-1])
        self._restored = True
        for name, state in states.items():
            self._load_object(name, sharded[name], state)
        if group is not None:
            self._share_loader_seeds(group)
        return self.step

    def _metrics(self, metric: float | Mapping[str, float] | None) -> dict[str, float]:
        """``save(metric=)`` as ``{name: number}``: one number is named by ``keep_best``."""
        name = self._keep_best[0] if self._keep_best else "metric"
        return check_metric("Checkpointer.save", metric, name)

    def _position(self) -> tuple[int, int]:
        """The (step, epoch) a save made now records.

        Inside a loop body the body's own step counts as done: ``save()`` there is meant to
        be called after the step's update (or, in ``epochs()``, after the epoch's data), and
        the state it captures (weights, optimizer, data position) already includes it. In
        ``epochs()``, once every wrapped loader used in the epoch has ended its pass and none
        is partway through its data, the save is the checkpoint of the end of the epoch.
        """
        step, epoch = self.step, self.epoch
        if self._body == "step":
            return step + 1, epoch
        state = self._epochs
        if self._body == "epoch" and state is not None:
            loaders = self._wrapped_loaders()
            if not loaders:
                return step + 1, epoch + 1  # an epoch is the step unit
            if state.requesting:
                return step, epoch  # at a step boundary where a loader is asked for data
            self._settle(state)  # a pass left by a break ends here, before its state is taken
            step = self.step + (1 if state.step else 0)  # inside a step: that step's
            finished = any(loader.finished_in == epoch for loader in loaders)
            partway = any(loader.finished_in != epoch and loader.position > 0 for loader in loaders)
            if finished and not partway:
                epoch += 1  # after the epoch's data
        return step, epoch

    def _capture(
        self,
        step: int,
        epoch: int,
        metrics: dict[str, float],
        *,
        copy: bool,
        ranks: list[Any] | None = None,
        sharded: Mapping[str, Any] | None = None,
    ) -> _Snapshot:
        tensors: dict[str, dict[str, Any]] = {}
        documents: dict[str, Any] = {}
        for name, obj in self._objects.items():
            if sharded and name in sharded:
                continue  # saved by every rank through sharded.save_sharded
            documents[name], group = flatten(obj.state_dict(), name=name)
            if group:
                tensors[name] = group
        for name, tree in self._pending_objects.items():
            # State restored for an object the script has not registered yet: carry it on.
            documents[name], group = flatten(tree, name=name)
            if group:
                tensors[name] = group
        values, value_tensors = flatten(self._values, name=VALUES_GROUP)
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
        if copy:
            tensors = self._buffers.copy(tensors)
        state = {
            "version": STATE_VERSION,
            "step": step,
            "epoch": epoch,
            "total": self.total,
            "done": self.done,
            "objects": documents,
            "values": values,
            "rng": rng,
        }
        if ranks is not None:
            state["world_size"] = len(ranks)
            state["rank_rng"] = rank_rng
        if sharded:
            state["sharded"] = sorted(sharded)
        return _Snapshot(step, tensors, state, metrics)

    def _write(self, snapshot: _Snapshot) -> CheckpointInfo:
        started = time.monotonic()
        self.events.emit(ev.SAVE_STARTED, snapshot.step)
        try:
            info = self.store.save(
                snapshot.step,
                tensors=snapshot.tensors,
                data={STATE_FILE: snapshot.state},
                metrics=snapshot.metrics,
                on_committed=lambda i: self.events.emit(
                    ev.COMMITTED, i.step, location=i.location, size=i.size
                ),
            )
        except BaseException as exc:
            self.events.emit(ev.FAILED, snapshot.step, error=str(exc))
            raise
        seconds = time.monotonic() - started
        self.cadence.observe_save(seconds)
        self.events.emit(
            ev.VERIFIED, info.step, location=info.location, size=info.size, seconds=seconds
        )
        if self.durability is not None:
            self.durability.track(info)  # "syncing" until the durable store confirms it
        return info

    def wait(self) -> None:
        """Block until the save in flight (if any) is committed and verified; raise its error.

        Under ``torch.distributed`` every rank calls it, and every rank raises rank 0's error.
        """
        self._background.wait()
        group = distributed.current()
        if group is None:
            self._raise_background_error()
        else:
            self._share_background_error(group)

    def _raise_background_error(self) -> None:
        error = self._background.take_error()
        failure = _background_failure(error)
        if failure is not None:
            raise failure from error

    def _share_background_error(self, group: distributed.Group) -> None:
        """Raise rank 0's background failure (if any) on every rank."""
        error = self._background.take_error()
        problem = group.broadcast_error(_background_failure(error))
        if problem is not None:
            raise problem from error

    # -- the loops -------------------------------------------------------------------------

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
        if self.step >= total:
            self.done = True
            return
        self.done = False  # a finished run given a larger total is unfinished again
        self._hold_lease()
        self._epochs = None  # wrapped loaders hand out batches as they are asked, uncounted
        with self._loop():
            while True:
                started = time.monotonic()
                self._body = "step"
                yield self.step
                self._body = None
                self.step += 1
                self.cadence.observe_step(time.monotonic() - started)
                if self._boundary(final=self.step >= total):
                    return
                if self.step >= total:
                    break
        self._finish()

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
        return self._epochs_of(count)  # a generator of its own: a bad count is refused here

    def _epochs_of(self, count: int) -> Iterator[int]:
        self.restore()
        self.total = None
        if self.epoch >= count:
            self.done = True
            return
        self.done = False
        self._hold_lease()
        self._loops_started += 1
        state = _EpochLoop(self._loops_started)
        self._epochs = state
        for loader in self._wrapped_loaders():
            loader._on_batch = self  # loaders wrapped later are attached by loader()
        with self._loop():
            try:
                while self.epoch < count:
                    started = time.monotonic()
                    self._body = "epoch"
                    yield self.epoch
                    self._body = None
                    if self.stop_reason:
                        return
                    self._end_epoch(state, started)
                    if self._boundary(final=self.epoch >= count):
                        return
            finally:
                if self._epochs is state:  # not a loop started since (a generator closed late)
                    self._epochs = None
                    self._body = None
        self._finish()

    # How a wrapped loader reports to the epoch loop (data.EpochLoop). Step boundaries run
    # only where the loop's own thread is in nbresume's code: when a loader is asked for a
    # batch, at the end of the body, in save(). A pass left at its yield (break) is only
    # noted when it happens and settled at the next of those points.

    _loops_started = 0
    #: The running epochs() loop, while it runs.
    _epochs: _EpochLoop | None = None

    def _stopping_in_body(self) -> bool:
        """Whether the epoch loop saved and is stopping while its body still runs. The rest
        of the body (validation, a per-epoch scheduler step) runs again in the resumed epoch,
        so a save() there would record its effects twice: it is skipped."""
        state = self._epochs
        return (
            self._body == "epoch"
            and bool(self.stop_reason)
            and state is not None
            and not state.requesting  # the stop's own save, at a loader's request
        )

    def _wrapped_loaders(self) -> list[ResumableLoader]:
        return [o for o in self._objects.values() if isinstance(o, ResumableLoader)]

    def _in_epoch_body(self) -> bool:
        return self._body == "epoch" and self._epochs is not None

    def _begin_pass(self, loader: ResumableLoader) -> tuple[int, int] | None:
        """A pass over ``loader`` begins: its key (the loop and the epoch), or ``None``
        outside the body of an epoch loop, where the loader hands out batches uncounted."""
        state = self._epochs
        if state is None or self._body != "epoch":
            return None
        if threading.current_thread() is not state.thread:
            raise UsageError(
                "a wrapped loader was iterated in another thread than the one running "
                "ckpt.epochs()",
                fix="iterate it in the loop's own thread: a prefetching thread runs ahead of "
                "training, so the saved position would count batches never trained on "
                "(DataLoader(num_workers=N) already loads in parallel)",
            )
        key = (state.id, self.epoch)
        if loader._pass_key == key:
            raise UsageError(
                f"a wrapped loader was iterated a second time in epoch {self.epoch} of "
                "ckpt.epochs(); each wrapped loader makes one pass over its data per epoch",
                fix="iterate it once per epoch (to cap an epoch, break out of that one loop); "
                "for several passes per epoch, use ckpt.steps(total) with loader.batches()",
            )
        loader._pass_key = key
        return key

    def _wants_batch(self, loader: ResumableLoader, key: tuple[int, int], exhausted: bool) -> bool:
        """``loader`` is asked for a batch (``exhausted``: its data epoch has none left).
        Ends the step it handed out a batch in, and runs the boundary owed; True: stop."""
        state = self._epochs
        if state is None or self._body != "epoch" or key != (state.id, self.epoch):
            raise UsageError(
                "an iterator over a wrapped loader was used after the epoch it was made in",
                fix="iterate the loader anew in each epoch (for batch in loader: ...) rather "
                "than keeping an iterator from one epoch to the next",
            )
        if self.stop_reason:
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
            return self._boundary(final=False)
        finally:
            state.requesting = False

    def _batch_given(self, loader: ResumableLoader) -> None:
        state = self._epochs
        assert state is not None
        state.step.add(id(loader))
        state.batches += 1

    def _pass_left(self, loader: ResumableLoader, key: tuple[int, int]) -> None:
        state = self._epochs  # any thread (a generator closed by the garbage collector)
        if state is not None and key == (state.id, self.epoch):
            state.left.append(loader)

    def _settle(self, state: _EpochLoop) -> None:
        """Passes left early: the step of their last batch ends, and the next pass of each
        starts its next data epoch."""
        left, state.left = state.left, []
        for loader in left:
            if id(loader) in state.step:
                self._end_step(state)
            if loader.finished_in != self.epoch:
                loader._end_pass(self.epoch)

    def _end_step(self, state: _EpochLoop) -> None:
        now = time.monotonic()
        self.step += 1
        if self._batch_started is not None:
            self.cadence.observe_step(now - self._batch_started)
        self._batch_started = now
        state.step.clear()
        state.owed = True

    def _end_epoch(self, state: _EpochLoop, started: float) -> None:
        """The body of an epoch ended: its last step ends, a loader left partway through
        its data (break, or zip ended on a shorter loader) moves to its next data epoch, and
        the epoch counter moves; the epoch boundary follows."""
        self._settle(state)
        if state.step:
            self._end_step(state)
        for loader in self._wrapped_loaders():
            if loader.finished_in != self.epoch and loader.position > 0:
                loader._end_pass(self.epoch)
        if not state.batches:
            self.step += 1  # no wrapped loader handed out a batch: the epoch is the step
            self.cadence.observe_step(time.monotonic() - started)
        state.batches = 0
        state.owed = False
        self.epoch += 1

    def _refuse_a_remade_loader(self, dataloader: Any) -> tuple[int, int] | None:
        """Where a wrapper made now is made: (loop, epoch) inside an epoch body, else None.
        A new DataLoader over a dataset a wrapper made in an earlier epoch reads is refused:
        its wrapper would start over, and a resumed run could not find its position."""
        state = self._epochs
        if state is None or self._body != "epoch":
            return None
        dataset = getattr(dataloader, "dataset", None)
        for value in self._wrapped_loaders():
            made = value._created_in
            if (
                made
                and made[0] == state.id
                and made[1] < self.epoch
                and getattr(value.loader, "dataset", None) is dataset
            ):
                raise UsageError(
                    f"epoch {self.epoch} gave ckpt.loader() a new DataLoader over the dataset "
                    f"that a DataLoader of epoch {made[1]} reads; a new DataLoader each epoch "
                    "would start a new position each time",
                    fix="build the DataLoader once, before the loop, and pass that same "
                    "object to ckpt.loader() in every epoch (or give it to the Checkpointer "
                    "as loader=... and iterate ckpt.loader())",
                )
        return (state.id, self.epoch)

    _batch_started: float | None = None
    #: Which loop body runs now ("step" or "epoch"), between a yield and the next boundary.
    _body: str | None = None
    _smoke_stop_at: int | None = None

    def _boundary(self, *, final: bool) -> bool:
        """At a step boundary: report progress, save when due, and stop when asked.
        Returns True when the loop must end now (the state was saved)."""
        self.events.emit(ev.STEP, self.step, total=self.total, epoch=self.epoch)
        if final:
            return False  # the final save is blocking: it retries an earlier failure itself
        group = distributed.current()
        if group is not None:
            return self._boundary_distributed(group)
        # A background save failed: say so now, not after `every` more steps of training that
        # could not be saved. A stop request goes first: its blocking save() tries again.
        if self._background.failed and not self._stop_requested():
            self._raise_background_error()
        reason = self._stop_requested()
        if reason:
            self.stop_reason = reason
            self.save(block=True)
            self.events.emit(ev.STOPPING, self.step, reason=reason)
            log.warning("nbresume: %s; saved step %d and stopped", reason, self.step)
            signum = self._stop_signal
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            if signum is not None:
                from nbresume.slurm import after_stop_save

                after_stop_save(signum, self.step)  # inside a Slurm job: ask to be requeued
                raise SystemExit(128 + signum)
            return True
        if self._save_requested:
            self._save_requested = False
            self.save()
            return False
        steps_since = self.step - (self._last_saved_step or 0)
        if self.cadence.due(steps_since, time.monotonic() - self._last_save_time):
            self.save()
        return False

    def _boundary_distributed(self, group: distributed.Group) -> bool:
        """:meth:`_boundary` for a job of several processes: a signal, a deadline, a request
        or a failed background save seen by any rank counts for all of them, at this same
        step, through one small all_reduce. The time-based cadence is rank 0's, whose clock
        measures the saves."""
        reason = self._stop_requested()
        cadence = group.rank == 0 and self.cadence.due(
            self.step - (self._last_saved_step or 0), time.monotonic() - self._last_save_time
        )
        stop, signum, save, due, failed = group.agree(
            [bool(reason), self._stop_signal or 0, self._save_requested, cadence,
             self._background.failed]
        )  # fmt: skip
        if failed and not stop:
            self._share_background_error(group)  # raises on every rank
        if stop:
            if signum and self._stop_signal is None:
                self._stop_signal = signum  # every rank ends the way the signalled one does
            self.stop_reason = reason or (
                f"another process of the job received {signal.Signals(signum).name}"
                if signum
                else "another process of the job is stopping"
            )
            self.save(block=True)
            self.events.emit(ev.STOPPING, self.step, reason=self.stop_reason)
            log.warning("nbresume: %s; saved step %d and stopped", self.stop_reason, self.step)
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            if signum:
                if group.rank == 0:
                    from nbresume.slurm import after_stop_save

                    after_stop_save(signum, self.step)  # one requeue for the whole job
                raise SystemExit(128 + signum)
            return True
        if save or due:
            self._save_requested = False
            self.save()
        return False

    def request_save(self) -> None:
        """Ask for a save at the next step boundary. Safe from any thread (a panel's button,
        a handler): the save itself always happens in the training loop."""
        self._save_requested = True

    def request_stop(self, reason: str = "stop requested") -> None:
        """Ask the running loop to save at the next step boundary and end cleanly, as before a
        deadline (:attr:`done` stays false). Safe from any thread; a request made while no loop
        runs is dropped when the next loop starts."""
        self._stop_request = reason or "stop requested"

    @property
    def stop_at(self) -> float | None:
        """When a loop saves and stops for the deadline (a Unix time), with the margin as
        measured now; ``None`` without a deadline."""
        return None if self.deadline is None else self.deadline - self._deadline_margin()

    def _stop_requested(self) -> str:
        if self._stop_request:
            return self._stop_request
        if self._smoke_stop_at is not None and self.step >= self._smoke_stop_at:
            return f"smoke run: stopped after the steps {knobs.SMOKE_STEPS.name} allows"
        if self._stop_signal is not None:
            return f"received {signal.Signals(self._stop_signal).name}"
        if self.deadline is not None:
            margin = self._deadline_margin()
            if time.time() + margin >= self.deadline:
                return f"stopping before the session deadline ({self.deadline_source})"
        return ""

    def _deadline_margin(self) -> float:
        """Enough time for one more step and a save, measured; a floor on platform caps."""
        save = self.cadence.save_cost_s if self.cadence.save_cost_s is not None else 1.0
        step = self.cadence.step_time_s or 0.0
        floor = 0.0 if self._explicit_deadline else 120.0
        return floor + 3.0 * save + 2.0 * step

    def _finish(self) -> None:
        self.done = True
        self.save(block=True)
        self.events.emit(ev.DONE, self.step)
        # A finished run writes nothing more: another process may use the folder now (a
        # later save of this one takes the lease again, or is refused by that process).
        self._release_lease()

    @contextlib.contextmanager
    def _loop(self) -> Iterator[None]:
        """Signals become stop requests handled at the next step boundary, never a write in
        the handler itself."""
        if not self._in_loop:
            # A stop asked for before this loop, or the reason the last one stopped, is not
            # meant for this one (epochs() ends early while stop_reason is set).
            self._stop_request = ""
            self.stop_reason = ""
            smoke = knobs.smoke_steps()  # `nbresume smoke`: every loop stops a few steps in
            self._smoke_stop_at = None if smoke is None else self.step + smoke
        if self._in_loop or threading.current_thread() is not threading.main_thread():
            yield
            return
        self._in_loop = True
        self._stop_signal = None
        self._batch_started = None
        previous: dict[int, Any] = {}

        def request(signum: int, frame: FrameType | None) -> None:
            if signum == signal.SIGINT and self._stop_signal == signal.SIGINT:
                raise KeyboardInterrupt  # a second interrupt: stop at once
            self._stop_signal = signum

        for signum in _STOP_SIGNALS:
            with contextlib.suppress(ValueError, OSError):
                previous[signum] = signal.signal(signum, request)
        try:
            yield
        finally:
            for number, handler in previous.items():
                with contextlib.suppress(ValueError, OSError):
                    signal.signal(number, handler)
            self._in_loop = False

    # -- inspection and lifetime -----------------------------------------------------------

    def latest(self) -> CheckpointInfo | None:
        """The newest committed checkpoint."""
        return self.store.latest()

    def list(self) -> list[CheckpointInfo]:
        """Committed checkpoints, oldest first."""
        return self.store.list()

    def verify(self) -> VerifyReport:
        """Read back every checkpoint and compare it with its manifest (waits for a save in
        flight first)."""
        self.wait()
        return self.store.verify()

    def close(self) -> None:
        """Finish the save in flight and raise its error, if any; give back the folder's
        writer lease (a later save takes it again)."""
        atexit.unregister(self._at_exit)
        try:
            self.wait()
        finally:
            self._release_lease()

    def _release_lease(self) -> None:
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
        if exc_info[0] is None:
            self.close()
        else:
            atexit.unregister(self._at_exit)
            self._background.wait()
            error = self._background.take_error()
            if error is not None:
                log.error("nbresume: a background save failed: %s", error)
            self._release_lease()

    def _at_exit(self) -> None:
        self._background.wait()
        error = self._background.take_error()
        if error is not None:
            print(
                f"nbresume: the last background save failed and is NOT on disk: {error}",
                file=sys.stderr,
            )
        self._release_lease()

    def __repr__(self) -> str:
        return f"Checkpointer({self.store.location!r}, step={self.step}, done={self.done})"


def _raiser(error: BaseException) -> Callable[[], None]:
    def fail() -> None:
        raise error

    return fail


def _background_failure(error: BaseException | None) -> CheckpointError | None:
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


def _rank_rng(saved: SavedState, *, rank: int, world_size: int, where: str) -> Any:
    """This rank's RNG states from a checked ``state.json``.

    A checkpoint of a job of N processes resumes only in a job of N processes: the data
    each rank sees (DistributedSampler) and its random stream depend on N. One process with
    no process group (a notebook loading weights to evaluate them) may load it: it gets rank
    0's RNG states, with a warning.
    """
    if saved.world_size != world_size and world_size > 1:
        raise CheckpointError(
            f"this checkpoint was saved by a job of {saved.world_size} process(es), and this "
            f"job has {world_size}",
            where=where,
            fix=f"resume with {saved.world_size} processes (torchrun --nproc_per_node "
            f"{saved.world_size} ...); to go on with {world_size} anyway, start a new run "
            "folder from these weights (the data split and the random streams depend on the "
            "number of processes, so the run would not continue exactly)",
        )
    if saved.world_size != world_size:
        warnings.warn(
            f"nbresume: the checkpoint at {where} was saved by {saved.world_size} processes and "
            "is loaded by one; it gets rank 0's random state, so training from here is not an "
            "exact continuation",
            RuntimeWarning,
            stacklevel=6,
        )
    return saved.rng if rank == 0 else saved.rank_rng[rank - 1]


# -- restore: the plan and the match with live objects ----------------------------------------

_NO_FIT_FIX = (
    "build the model and optimizer exactly as in the run that saved these checkpoints to "
    "resume it; to train the changed model from scratch, start a new run: a new run name or "
    "another dir= (nbresume never starts over on its own)"
)
#: Per-parameter optimizer state that has the parameter's shape in torch's own optimizers.
_PARAMETER_SHAPED = frozenset(
    {"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "square_avg", "acc_delta",
     "sum", "exp_inf", "ax", "prev", "step_size", "grad_avg"}
)  # fmt: skip


class _DoesNotFit(CheckpointError):
    """A checkpoint whose saved objects differ from the live ones (names, shapes, dtypes)."""

    def __init__(
        self, message: str, *, where: str, fix: str, step: int, differences: list[str]
    ) -> None:
        self.step = step
        self.differences = differences
        super().__init__(message, where=where, fix=fix)


def _no_fit(newest: _DoesNotFit, misfits: list[_DoesNotFit], location: str) -> CheckpointError:
    """The one error of a restore that found no checkpoint fitting the objects given."""
    steps = ", ".join(str(m.step) for m in misfits) or str(newest.step)
    shown = "; ".join(newest.differences[:8])
    more = f"; and {len(newest.differences) - 8} more" if len(newest.differences) > 8 else ""
    return CheckpointError(
        f"no checkpoint in {location} fits the objects given: the model or optimizer "
        f"changed (checked step(s) {steps}). Step {newest.step} differs: {shown}{more}",
        where=newest.where,
        fix=_NO_FIT_FIX,
    )


class _RestorePlan:
    """A checkpoint checked against the live objects, ready to be put into them."""

    def __init__(self, where: str, saved: SavedState, rng: Any, missing: list[str]) -> None:
        self.where = where
        self.saved = saved
        self.rng = rng
        self.missing = missing


def _is_checked_kind(obj: Any) -> bool:
    """Whether ``obj``'s saved state is checked against it before anything is loaded: torch
    modules and optimizers (compared here), and a trainable-only model (whose own load checks
    everything before it changes anything). Other objects are snapshotted instead."""
    if isinstance(obj, TrainableOnly):
        return True
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, (torch.nn.Module, torch.optim.Optimizer))


def _snapshot(obj: Any) -> Any:
    """A copy of a small object's state to put back if a restore fails (``None`` if it
    cannot be copied)."""
    import copy

    try:
        return copy.deepcopy(obj.state_dict())
    except Exception:
        return None


def _describe(value: Any) -> str:
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        return f"{list(value.shape)} {str(value.dtype).removeprefix('torch.')}"
    return type(value).__name__


def _same_tensor_kind(saved: Any, live: Any) -> bool:
    if not (hasattr(saved, "shape") and hasattr(saved, "dtype")):
        return False
    return tuple(saved.shape) == tuple(live.shape) and saved.dtype == live.dtype


def _differences(name: str, obj: Any, tree: Any) -> list[str]:
    """What differs between the saved state ``tree`` of ``name`` and the live ``obj``."""
    torch = sys.modules.get("torch")
    if torch is None:
        return []
    if isinstance(obj, torch.nn.Module):
        return _module_differences(name, obj.state_dict(), tree, torch)
    if isinstance(obj, torch.optim.Optimizer):
        return _optimizer_differences(name, obj, tree, torch)
    return []


def _module_differences(name: str, live: Mapping[str, Any], saved: Any, torch: Any) -> list[str]:
    if not isinstance(saved, Mapping):
        return [f"{name}: the checkpoint holds a {type(saved).__name__}, not a state_dict"]
    out = []
    for key, value in saved.items():
        if key not in live:
            out.append(f"{name}.{key} {_describe(value)} is in the checkpoint, not in the model")
        elif isinstance(live[key], torch.Tensor) and not _same_tensor_kind(value, live[key]):
            out.append(
                f"{name}.{key} is {_describe(value)} in the checkpoint, {_describe(live[key])} here"
            )
    out += [
        f"{name}.{key} {_describe(value)} is in the model, not in the checkpoint"
        for key, value in live.items()
        if key not in saved
    ]
    return out


def _optimizer_differences(name: str, obj: Any, saved: Any, torch: Any) -> list[str]:
    live = obj.state_dict()
    if (
        not isinstance(saved, Mapping)
        or not isinstance(saved.get("state"), Mapping)
        or not isinstance(saved.get("param_groups"), list)
        or not all(
            isinstance(g, Mapping)
            and isinstance(g.get("params"), list)
            and all(isinstance(p, int) and not isinstance(p, bool) for p in g["params"])
            for g in saved["param_groups"]
        )
    ):
        return [f"{name}: the checkpoint does not hold an optimizer's state_dict"]
    saved_groups, live_groups = saved["param_groups"], live["param_groups"]
    if len(saved_groups) != len(live_groups):
        return [
            f"{name}: {len(saved_groups)} parameter group(s) in the checkpoint, "
            f"{len(live_groups)} here"
        ]
    out = []
    # torch pairs saved and live parameters by position within the groups.
    parameters: dict[Any, tuple[Any, Any]] = {}
    for index, (saved_group, live_group, params) in enumerate(
        zip(saved_groups, live_groups, obj.param_groups, strict=True)
    ):
        if len(saved_group["params"]) != len(live_group["params"]):
            out.append(
                f"{name}: parameter group {index} has {len(saved_group['params'])} "
                f"parameter(s) in the checkpoint, {len(live_group['params'])} here"
            )
            continue
        for saved_id, live_id, parameter in zip(
            saved_group["params"], live_group["params"], params["params"], strict=True
        ):
            parameters[saved_id] = (live_id, parameter)
    if out:
        return out
    builtin = type(obj).__module__.startswith("torch.optim")
    for saved_id, saved_state in saved["state"].items():
        if saved_id not in parameters or not isinstance(saved_state, Mapping):
            out.append(f"{name}: state for parameter {saved_id!r}, which no group holds")
            continue
        live_id, parameter = parameters[saved_id]
        live_state = live["state"].get(live_id)
        for key, value in saved_state.items():
            if not isinstance(value, torch.Tensor):
                if live_state is not None and isinstance(live_state.get(key), torch.Tensor):
                    out.append(
                        f"{name}.state[{saved_id}].{key} is a {type(value).__name__} in the "
                        f"checkpoint, a tensor {_describe(live_state[key])} here"
                    )
                continue
            if live_state is not None and isinstance(live_state.get(key), torch.Tensor):
                expected = live_state[key]
                if not _same_tensor_kind(value, expected):
                    out.append(
                        f"{name}.state[{saved_id}].{key} is {_describe(value)} in the "
                        f"checkpoint, {_describe(expected)} here"
                    )
            elif builtin and key in _PARAMETER_SHAPED and value.shape != parameter.shape:
                out.append(
                    f"{name}.state[{saved_id}].{key} is {_describe(value)} in the checkpoint, "
                    f"its parameter is {_describe(parameter)} here"
                )
        if live_state is not None and set(live_state) != set(saved_state):
            out.append(
                f"{name}.state[{saved_id}] holds {sorted(map(str, saved_state))} in the "
                f"checkpoint, {sorted(map(str, live_state))} here"
            )
    return out


_STOP_SIGNALS = [signal.SIGTERM, signal.SIGINT] + (
    [signal.SIGUSR1] if hasattr(signal, "SIGUSR1") else []
)


def _check_arguments(
    dir: object,
    *,
    every: object,
    keep: object,
    keep_best: object,
    deadline: object,
    async_save: object,
    callbacks: object,
    storage_options: object,
    trainable_only: object,
    state: Mapping[str, Any],
) -> None:
    """Check every argument of ``Checkpointer(...)``; raise ArgumentError for the first wrong
    one, naming it, its value and the fix."""
    call = "Checkpointer"
    if not isinstance(dir, Store):
        check_location(dir, call, "dir")
    parse_every(every, call)
    check_keep(call, keep)
    check_keep_best(call, keep_best)
    check_deadline(deadline, call)
    check_bool(call, "async_save", async_save)
    check_bool(call, "trainable_only", trainable_only)
    check_callbacks(call, callbacks)
    check_storage_options(call, storage_options)
    for name, value in state.items():
        _check_state_keyword(name, value)


def _check_name(name: object) -> None:
    """A name of checkpointed state: an identifier, and not one of the checkpoint's own."""
    if not isinstance(name, str) or name in _RESERVED or not name.isidentifier():
        raise UsageError(
            f"{name!r} cannot name checkpointed state",
            fix=f"choose a Python identifier other than {sorted(_RESERVED)}",
        )


def _check_state_keyword(name: str, value: Any) -> None:
    """A keyword of ``Checkpointer(...)`` that is not an option must be a stateful object or
    a DataLoader. A plain value there is most often a misspelled option (``evry=2``), which
    would otherwise be saved as a value and change nothing: it is refused, and the option it
    resembles is named."""
    _check_name(name)
    if _is_dataloader(value) or (not isinstance(value, type) and _is_stateful(value)):
        return
    shown = show(value)
    close = difflib.get_close_matches(name, _options(), n=1)
    if close:
        raise refused(
            "Checkpointer",
            name,
            value,
            f"{name} is not an option of Checkpointer; did you mean {close[0]}=?",
            f"spell the option {close[0]}=; to save a plain value named {name!r} with the "
            f"checkpoints, set ckpt[{name!r}] = {shown} after creating the Checkpointer",
        )
    if isinstance(value, type) and _is_stateful(value):
        raise refused(
            "Checkpointer",
            name,
            value,
            "this is a class, not an object of it",
            f"pass the object: {name}={value.__name__}(...)",
        )
    if value is None:
        raise refused(
            "Checkpointer",
            name,
            value,
            "None is not an object to save",
            f"leave {name}= out when there is no such object",
        )
    raise refused(
        "Checkpointer",
        name,
        value,
        f"{kind(value)} is not a stateful object; the keywords after the options name "
        "objects with state_dict() and load_state_dict() (a model, an optimizer, ...) and "
        "DataLoaders",
        f"set a plain value after creating the Checkpointer: ckpt[{name!r}] = {shown}",
    )


def _is_stateful(value: Any) -> bool:
    return callable(getattr(value, "state_dict", None)) and callable(
        getattr(value, "load_state_dict", None)
    )


def _options() -> list[str]:
    """The names of Checkpointer's options (its parameters other than ``**state``)."""
    parameters = inspect.signature(Checkpointer.__init__).parameters.values()
    return [p.name for p in parameters if p.name != "self" and p.kind is not p.VAR_KEYWORD]


def _is_module(value: Any) -> bool:
    torch_nn = sys.modules.get("torch.nn")
    return torch_nn is not None and isinstance(value, torch_nn.Module)


def _is_dataloader(value: Any) -> bool:
    torch_data = sys.modules.get("torch.utils.data")
    return torch_data is not None and type(value) is torch_data.DataLoader
