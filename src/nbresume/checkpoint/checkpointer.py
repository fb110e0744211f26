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
from nbresume.checkpoint.cadence import Cadence
from nbresume.checkpoint.data import ResumableLoader
from nbresume.checkpoint.deadline import resolve_deadline
from nbresume.checkpoint.durability import DurabilityWatcher
from nbresume.checkpoint.format import MANIFEST_NAME, parse_step_dirname
from nbresume.checkpoint.state import capture_rng, flatten, restore_rng, unflatten
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
    UsageError,
)

log = logging.getLogger("nbresume")

STATE_FILE = "state"
RNG_GROUP = "rng"
VALUES_GROUP = "values"
_RESERVED = {STATE_FILE, RNG_GROUP, VALUES_GROUP, "manifest"}
STATE_VERSION = 1


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


class Checkpointer:
    """Save and resume full training state, exactly.

    Args:
        dir: where checkpoints live: a local path or an fsspec URL.
        every: save cadence: steps (``500``), a duration (``"15min"``), ``"auto"`` (the
            Young/Daly interval from the measured save cost) or ``None`` (only at the end, at a
            deadline or on a signal).
        keep: how many of the newest checkpoints to keep.
        keep_best: ``(metric, "min" | "max")``: also keep the best checkpoints by a metric
            passed to :meth:`save`.
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
            StatefulDataLoader, a DataLoader) and plain JSON values.
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
        atexit.register(self._at_exit)
        ev.announce(self)  # a notebook panel or a status line subscribes here

    # -- registration ----------------------------------------------------------------------

    def _register(self, name: str, value: Any) -> None:
        if name in _RESERVED or not name.isidentifier():
            raise UsageError(
                f"{name!r} cannot name checkpointed state",
                fix=f"choose another keyword than {sorted(_RESERVED)}",
            )
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
                return value
        if dataloader is None:
            raise UsageError("no DataLoader was given to the Checkpointer", fix="ckpt.loader(dl)")
        name = "loader" if "loader" not in self._objects else f"loader{len(self._objects)}"
        wrapped = ResumableLoader(dataloader, seed=seed)
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
        changes nothing."""
        sharded = self._sharded_objects()
        if sharded:
            return self._restore_sharded(sharded)
        group = distributed.current()
        if group is not None:
            return self._restore_distributed(group)
        self._raise_background_error()
        if self._restored:
            return self.step
        self._restored = True
        try:
            loaded = self.store.load()
        except NoCheckpointError:
            if self._any_committed():
                raise  # checkpoints exist but none verifies: starting over would hide that
            return 0
        self._apply(loaded, rank=0, world_size=1)
        return self.step

    def _restore_distributed(self, group: distributed.Group) -> int:
        """Rank 0 picks the checkpoint (the newest that verifies), every rank loads that step."""
        if self._restored:
            return self.step
        self._restored = True
        chosen: LoadedCheckpoint | None = None
        error: BaseException | None = None
        if group.rank == 0:
            try:
                chosen = self.store.load()
            except NoCheckpointError as exc:
                if self._any_committed():
                    error = exc  # checkpoints exist but none verifies
            except Exception as exc:  # shared below, so that no rank waits for rank 0 alone
                error = exc
        problem = group.broadcast_error(error)
        if problem is not None:
            raise problem
        (step,) = group.broadcast_ints([-1 if chosen is None else chosen.step])
        if step < 0:
            self._share_loader_seeds(group)
            return 0
        if group.rank != 0:
            try:
                chosen = self.store.load(step)
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
        assert chosen is not None
        self._apply(chosen, rank=group.rank, world_size=group.world_size)
        self._share_loader_seeds(group)
        return self.step

    def _apply(self, loaded: LoadedCheckpoint, *, rank: int, world_size: int) -> None:
        """Put a loaded checkpoint into every object, value and RNG (this rank's own)."""
        state = loaded.data.get(STATE_FILE)
        where = loaded.location
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            raise CorruptCheckpointError(
                "state.json is missing or of an unknown version", where=where
            )
        rng = _rank_rng(state, rank=rank, world_size=world_size, where=where)
        try:
            objects = state["objects"]
            for name, document in objects.items():
                tree = unflatten(document, loaded.tensors.get(name, {}), where=where)
                if name in self._objects:
                    self._load_object(name, self._objects[name], tree)
                else:
                    self._pending_objects[name] = tree
            for name in self._objects.keys() - objects.keys() - set(state.get("sharded", [])):
                warnings.warn(
                    f"nbresume: the checkpoint at {where} holds no state for {name!r}; "
                    "it keeps its current state",
                    RuntimeWarning,
                    stacklevel=4,
                )
            values = unflatten(state.get("values", {}), loaded.tensors.get(VALUES_GROUP, {}),
                               where=where)  # fmt: skip
            self._values.update(values)
            restore_rng(unflatten(rng, loaded.tensors.get(RNG_GROUP, {}), where=where))
            self.step = int(state["step"])
            self.epoch = int(state["epoch"])
            saved_total = state.get("total")
        except (KeyError, TypeError, ValueError) as exc:
            raise CorruptCheckpointError(f"state.json is incomplete: {exc}", where=where) from None
        self.done = bool(state.get("done")) and (saved_total is None or self.step >= saved_total)
        self.restored_step = self.step
        self._last_saved_step = self.step
        log.info("nbresume: resumed from step %d (%s)", self.step, where)

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
        store = self.store.store
        for name in store.list_folders():
            if parse_step_dirname(name) is None:
                continue
            try:
                if MANIFEST_NAME in store.list_files(name):
                    return True
            except FileNotFoundError:
                continue
        return False

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
        current_step, epoch = self._position()
        step = current_step if step is None else step
        metrics = self._metrics(metric)
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
        self._restored = True
        group = distributed.current()
        states = {name: loadable_state(obj) for name, obj in sharded.items()}
        try:
            loaded = load_sharded(self.store, states)
        except NoCheckpointError:
            if self._any_committed():
                raise  # checkpoints exist but none verifies: starting over would hide that
            if group is not None:
                self._share_loader_seeds(group)
            return 0
        self._apply(
            loaded,
            rank=0 if group is None else group.rank,
            world_size=1 if group is None else group.world_size,
        )
        for name, state in states.items():
            self._load_object(name, sharded[name], state)
        if group is not None:
            self._share_loader_seeds(group)
        return self.step

    def _metrics(self, metric: float | Mapping[str, float] | None) -> dict[str, float]:
        if metric is None:
            return {}
        if isinstance(metric, Mapping):
            return {str(k): float(v) for k, v in metric.items()}
        name = self._keep_best[0] if self._keep_best else "metric"
        return {name: float(metric)}

    def _position(self) -> tuple[int, int]:
        """The (step, epoch) a save made now records.

        Inside a loop body the body's own step counts as done: ``save()`` there is meant to
        be called after the step's update (or, in ``epochs()``, after the epoch's data), and
        the state it captures (weights, optimizer, data position) already includes it.
        """
        step, epoch = self.step, self.epoch
        if self._body == "step":
            return step + 1, epoch
        if self._body == "epoch":
            loaders = [o for o in self._objects.values() if isinstance(o, ResumableLoader)]
            if not loaders:
                return step + 1, epoch + 1  # an epoch is the step unit
            if any(loader._holding for loader in loaders):
                step += 1  # inside a batch: that batch's step
            if any(loader.epoch > epoch for loader in loaders):
                epoch += 1  # after the epoch's last batch
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
        """
        self.restore()
        self.total = total
        if self.step >= total:
            self.done = True
            return
        self.done = False  # a finished run given a larger total is unfinished again
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

        Iterate ``ckpt.loader(dataloader)`` inside: every batch it hands out is a step, and
        saves happen at those step boundaries as in :meth:`steps`.
        """
        self.restore()
        self.total = None
        if self.epoch >= count:
            self.done = True
            return
        self.done = False
        loaders = [o for o in self._objects.values() if isinstance(o, ResumableLoader)]
        with self._loop():
            for loader in loaders:
                loader._on_batch = self._on_batch
            try:
                while self.epoch < count:
                    started = time.monotonic()
                    self._body = "epoch"
                    yield self.epoch
                    self._body = None
                    if self.stop_reason:
                        return
                    self.epoch += 1
                    if not loaders:
                        self.step += 1  # without a wrapped loader, an epoch is the step unit
                        self.cadence.observe_step(time.monotonic() - started)
                    if self._boundary(final=self.epoch >= count):
                        return
            finally:
                for loader in loaders:
                    loader._on_batch = None
        self._finish()

    def _on_batch(self, end_of_epoch: bool) -> bool:
        """Called by a wrapped loader when the previous batch is done; True means stop."""
        now = time.monotonic()
        self.step += 1
        if self._batch_started is not None:
            self.cadence.observe_step(now - self._batch_started)
        self._batch_started = now
        if end_of_epoch:
            # The epoch loop saves after the epoch counter moves, so that a checkpoint never
            # holds a finished loader position with an unfinished epoch; its boundary also
            # reports this step.
            return False
        return self._boundary(final=False)

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
        """Finish the save in flight and raise its error, if any."""
        atexit.unregister(self._at_exit)
        self.wait()

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

    def _at_exit(self) -> None:
        self._background.wait()
        error = self._background.take_error()
        if error is not None:
            print(
                f"nbresume: the last background save failed and is NOT on disk: {error}",
                file=sys.stderr,
            )

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


def _rank_rng(state: Mapping[str, Any], *, rank: int, world_size: int, where: str) -> Any:
    """This rank's RNG document of ``state.json``.

    A checkpoint of a job of N processes resumes only in a job of N processes: the data
    each rank sees (DistributedSampler) and its random stream depend on N. One process with
    no process group (a notebook loading weights to evaluate them) may load it: it gets rank
    0's RNG states, with a warning.
    """
    saved = state.get("world_size", 1)
    if not isinstance(saved, int) or isinstance(saved, bool) or saved < 1:
        raise CorruptCheckpointError(f"state.json has an invalid world_size {saved!r}", where=where)
    if saved != world_size and world_size > 1:
        raise CheckpointError(
            f"this checkpoint was saved by a job of {saved} process(es), and this job has "
            f"{world_size}",
            where=where,
            fix=f"resume with {saved} processes (torchrun --nproc_per_node {saved} ...); to go "
            f"on with {world_size} anyway, start a new run folder from these weights (the "
            "data split and the random streams depend on the number of processes, so the "
            "run would not continue exactly)",
        )
    if saved != world_size:
        warnings.warn(
            f"nbresume: the checkpoint at {where} was saved by {saved} processes and is loaded "
            "by one; it gets rank 0's random state, so training from here is not an exact "
            "continuation",
            RuntimeWarning,
            stacklevel=5,
        )
    if rank == 0:
        return state["rng"]
    others = state.get("rank_rng")
    if not isinstance(others, list) or len(others) != saved - 1:
        raise CorruptCheckpointError("state.json lacks the RNG states of every rank", where=where)
    return others[rank - 1]


_STOP_SIGNALS = [signal.SIGTERM, signal.SIGINT] + (
    [signal.SIGUSR1] if hasattr(signal, "SIGUSR1") else []
)


def _is_module(value: Any) -> bool:
    torch_nn = sys.modules.get("torch.nn")
    return torch_nn is not None and isinstance(value, torch_nn.Module)


def _is_dataloader(value: Any) -> bool:
    torch_data = sys.modules.get("torch.utils.data")
    return torch_data is not None and type(value) is torch_data.DataLoader
