"""Exact data position: resume mid-epoch at the next batch, with the same samples and the
same augmentation an uninterrupted run would have seen.

Three things make a resumed epoch identical to the original:

1. The order of an epoch is a function of ``(seed, epoch)`` alone. The wrapper draws the
   sampler's indices under a private seed instead of the global RNG, and gives every
   DataLoader it builds its own generator, so creating an iterator never consumes the
   training loop's random stream (dropout would otherwise differ after a resume).
2. Consumed batches are skipped at the sampler level: their indices are dropped before any
   sample is loaded, so skipping costs nothing.
3. Each sample's randomness is a function of ``(seed, epoch, index)``: the dataset is wrapped
   so that the global RNGs (torch, random, NumPy) are seeded per sample around
   ``__getitem__``. Augmentation then does not depend on which worker loaded the sample or
   where the run resumed. In the main process the training loop's RNG state is saved and put
   back around the samples of each batch, so loading data never disturbs it (nor a rank's own seeded
   streams under ``torch.distributed``).

The position is kept in samples of the epoch's order, over the whole job: with a
``DistributedSampler``, whose order is a function of its seed and the epoch whatever the
number of processes, the samples trained are the first ``position x batch size x processes``
of that order. A resumed epoch with another batch size or another number of processes (a
leg on two GPUs, the next on one) continues at that sample where it starts a batch of the new
shape, and is refused with the fix where it does not.

An ``IterableDataset`` has no indices: its epoch is a stream. The stream of an epoch is
rebuilt from its start (``set_epoch(epoch)`` first, where the dataset has it) and the
consumed batches are loaded and dropped, which is exact when the stream of an epoch is a
function of the epoch. Its randomness is fixed too: each worker's global RNGs are seeded by
``(seed, epoch, worker id)`` before the worker starts the stream, and in the main process the
stream draws from RNG states of its own, carried from batch to batch and swapped with the
training loop's around each one.
"""

from __future__ import annotations

import hashlib
import logging
import random
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol

from nbresume.checkpoint import procfs
from nbresume.checkpoint.state.health import DataWait
from nbresume.errors import UsageError

log = logging.getLogger("nbresume")

_SAMPLE_CONTEXT: dict[str, int] = {"seed": 0, "epoch": 0}


def sample_seed(index: int, *, seed: int | None = None, epoch: int | None = None) -> int:
    """A 63-bit seed for sample ``index`` of the current epoch, the same in every worker and
    after every resume."""
    seed = _SAMPLE_CONTEXT["seed"] if seed is None else seed
    epoch = _SAMPLE_CONTEXT["epoch"] if epoch is None else epoch
    digest = hashlib.blake2b(f"{seed}:{epoch}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def sample_generator(index: int) -> Any:
    """A ``torch.Generator`` for sample ``index`` of the current epoch (see :func:`sample_seed`).

    Use it for augmentation inside ``Dataset.__getitem__`` when you prefer an explicit
    generator to the per-sample seeding nbresume already applies to the global RNGs.
    """
    import torch

    return torch.Generator().manual_seed(sample_seed(index))


#: Below this, torch's initial seed was set by the user (``torch.manual_seed``, Lightning's
#: ``seed_everything``, transformers' ``set_seed``): an unseeded torch starts from 64 bits of
#: the operating system's randomness, below 2**32 once in four billion processes.
_SEEDED_BELOW = 2**32


def users_seed() -> int:
    """The seed of a loader given none, from the streams the user seeds, read without drawing
    from them: torch's initial seed where the user seeded torch (as before), otherwise a hash
    of Python's ``random`` state. A script that seeds only ``random`` (and shuffles with it)
    then gets the same orders in every process, as it does without nbresume; one that seeds
    nothing gets other orders in each, as it does without nbresume."""
    import torch

    initial = torch.initial_seed()
    if initial < _SEEDED_BELOW:
        return initial
    state = repr(random.getstate()).encode()
    return int.from_bytes(hashlib.blake2b(b"random:" + state, digest_size=8).digest(), "big")


def epoch_seed(seed: int, epoch: int) -> int:
    digest = hashlib.blake2b(f"order:{seed}:{epoch}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class _SeededDataset:
    """Wraps a map-style dataset: the global RNGs are seeded per sample around ``__getitem__``."""

    def __init__(self, dataset: Any, seed: int, epoch: int) -> None:
        self.dataset = dataset
        self.seed = seed
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.dataset)

    def __getattr__(self, name: str) -> Any:
        if name == "dataset":
            # Unpickling in a spawned worker looks attributes up before __dict__ is filled.
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def __getitem__(self, index: int) -> Any:
        _SAMPLE_CONTEXT["seed"], _SAMPLE_CONTEXT["epoch"] = self.seed, self.epoch
        with _host_streams_seeded(sample_seed(index)):
            return self.dataset[index]

    def __getitems__(self, indices: list[int]) -> list[Any]:
        """The samples of one batch. In a worker, the host streams are first seeded for the
        batch (:class:`_Batch`): what the user's ``__getitems__`` and then the ``collate_fn``
        draw is the same whichever worker loads the batch and wherever the run resumed. In
        the main process they draw from the training loop's own stream, as without nbresume,
        which the checkpoint carries."""
        from torch.utils.data import get_worker_info

        _SAMPLE_CONTEXT["seed"], _SAMPLE_CONTEXT["epoch"] = self.seed, self.epoch
        if isinstance(indices, _Batch) and get_worker_info() is not None:
            _seed_host_streams(indices.seed)
        batched = getattr(self.dataset, "__getitems__", None)
        if batched:
            return batched(list(indices))  # type: ignore[no-any-return]
        return self.seeded_samples(indices)

    def seeded_samples(self, indices: list[int]) -> list[Any]:
        """``self[index]`` of each index: each sample on host streams seeded for it, as
        :meth:`__getitem__` does, with the caller's states read and put back once for the
        batch rather than once per sample (reading and setting them costs far more than
        seeding: a batch of small samples took milliseconds)."""
        numpy = sys.modules.get("numpy")
        saved = _host_states(numpy)
        try:
            samples = []
            for index in indices:
                _seed_host_streams(sample_seed(index))
                samples.append(self.dataset[index])
            return samples
        finally:
            _put_host_states(saved, numpy)


def batch_seed(seed: int, epoch: int, position: int, rank: int) -> int:
    """A 63-bit seed for batch ``position`` of ``epoch`` in process ``rank`` of the job."""
    digest = hashlib.blake2b(f"batch:{seed}:{epoch}:{position}:{rank}".encode(), digest_size=8)
    return int.from_bytes(digest.digest(), "little") >> 1


class _Batch(list[int]):
    """The indices of one batch, with the seed of the batch's position in its epoch: sent to
    the worker that loads it, which seeds its host streams with it before the fetch and the
    ``collate_fn`` (:meth:`_SeededDataset.__getitems__`)."""

    def __init__(self, indices: list[int], seed: int) -> None:
        super().__init__(indices)
        self.seed = seed

    def __reduce__(self) -> tuple[Any, ...]:
        return (_Batch, (list(self), self.seed))


def _batches_of(batches: list[list[int]], seed: int, epoch: int, first: int) -> list[_Batch]:
    """``batches``, from position ``first`` of the epoch on, each with its seed."""
    rank = job_rank()
    return [
        _Batch(batch, batch_seed(seed, epoch, first + offset, rank))
        for offset, batch in enumerate(batches)
    ]


class _WorkerInit:
    """The ``worker_init_fn`` of the DataLoaders nbresume builds: the worker ignores the
    signals that ask training to stop, then runs the user's own ``worker_init_fn``.

    Slurm (scancel, the time limit) and Ctrl-C in a terminal signal every process of the job.
    A worker that dies of SIGTERM makes PyTorch raise "DataLoader worker is killed by signal"
    in the trainer at any point, even inside the save the same signal asked for. The trainer
    alone decides: it saves at the next step boundary, stops, and shuts its workers down.
    That shutdown itself may end a worker with SIGTERM (``Process.terminate()``, at exit), so
    SIGTERM from the trainer still ends the worker at once, as PyTorch's own handler does.

    Made in the trainer and pickled into each worker under the spawn and forkserver start
    methods; under forkserver the worker's parent is the fork server, so the trainer is known
    by the process id taken here.
    """

    def __init__(self, user: Callable[[int], None] | None) -> None:
        import os

        self.user = user
        self.trainer = os.getpid()

    def __call__(self, worker_id: int) -> None:
        import signal
        import threading

        for name in ("SIGINT", "SIGUSR1"):
            if hasattr(signal, name):
                signal.signal(getattr(signal, name), signal.SIG_IGN)
        if hasattr(signal, "sigwaitinfo"):
            # Blocked here and in every thread started from here; one thread takes it.
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
            threading.Thread(
                target=_end_on_sigterm_from_trainer,
                args=(self.trainer,),
                name="nbresume-sigterm",
                daemon=True,
            ).start()
        if self.user is not None:
            self.user(worker_id)


def _end_on_sigterm_from_trainer(trainer: int) -> None:
    import os
    import signal

    parent = os.getppid()  # the trainer, or the fork server that forked this worker
    # PyTorch's own watchdog ends a worker whose parent is gone. A forkserver worker's parent
    # is the fork server, which outlives a killed trainer: without this watch, the workers of
    # a trainer killed by SIGKILL (an OOM kill, a preemption) would stay for good.
    watch = parent != trainer and hasattr(signal, "sigtimedwait")
    while True:
        if watch:
            info = signal.sigtimedwait({signal.SIGTERM}, 1.0)
            if info is None:
                if not procfs.process_runs(trainer):
                    os._exit(0)
                continue
        else:
            info = signal.sigwaitinfo({signal.SIGTERM})
        if info.si_pid in (trainer, parent) or os.getppid() != parent:
            os._exit(0)


#: The samplers of torch whose draws all come from their ``generator`` attribute (``None``:
#: torch's global CPU generator). Matched by exact type: a subclass may draw elsewhere.
_OWN_GENERATOR_SAMPLERS = (
    "RandomSampler",
    "SubsetRandomSampler",
    "WeightedRandomSampler",
)
#: torch's samplers that draw nothing (or only from their own seed and epoch).
_DRAWLESS_SAMPLERS = ("SequentialSampler", "BatchSampler", "DistributedSampler")


def _sampler_parts(source: Any) -> list[Any]:
    """``source`` and the samplers it wraps (``.sampler``, ``.batch_sampler``), outermost
    first."""
    parts: list[Any] = []
    while source is not None and all(source is not p for p in parts) and len(parts) < 8:
        parts.append(source)
        inner = getattr(source, "sampler", None)
        source = inner if inner is not None else getattr(source, "batch_sampler", None)
    return parts


def _is_torch_sampler(part: Any, names: tuple[str, ...]) -> bool:
    kind = type(part)
    return kind.__module__.startswith("torch.utils.data") and kind.__name__ in names


@contextmanager
def _private_generators(source: Any, seed: int) -> Iterator[bool]:
    """While the sampler tree ``source`` is read, every sampler's ``generator`` is one of
    nbresume's own, seeded from ``seed``; the user's generator objects are put back after,
    untouched. Yields whether some part may draw from the global streams (a sampler nbresume
    does not know, or one whose generator cannot be replaced)."""
    import torch

    swapped: list[tuple[Any, Any]] = []
    on_global_streams = False
    try:
        for part in _sampler_parts(source):
            if _is_torch_sampler(part, _DRAWLESS_SAMPLERS):
                continue
            known = _is_torch_sampler(part, _OWN_GENERATOR_SAMPLERS)
            current = getattr(part, "generator", None)
            if not known and not isinstance(current, torch.Generator):
                on_global_streams = True
                continue
            ours = torch.Generator().manual_seed(seed)
            if current is None and _is_torch_sampler(part, ("RandomSampler",)):
                # RandomSampler without a generator seeds a fresh one from a draw of the global
                # generator: the same draw from ours keeps every order nbresume gave before.
                first = int(torch.empty((), dtype=torch.int64).random_(generator=ours).item())
                ours = torch.Generator().manual_seed(first)
            try:
                part.generator = ours
            except AttributeError:  # a read-only property: read under the seed instead
                on_global_streams = True
                continue
            swapped.append((part, current))
            on_global_streams = on_global_streams or not known
        yield on_global_streams
    finally:
        for part, current in reversed(swapped):
            part.generator = current


def _read(source: Any, custom_batches: bool) -> tuple[list[list[int]] | None, list[int] | None]:
    if custom_batches:
        return [list(b) for b in source], None
    return None, [int(i) for i in source]


def _read_under_seed(
    source: Any, seed: int, custom_batches: bool
) -> tuple[list[list[int]] | None, list[int] | None]:
    """Read a sampler that draws from the global host streams (torch's CPU generator,
    ``random``, NumPy: a bucketing sampler that shuffles with ``random.shuffle``, say) under
    the epoch's seed, and put the user's states back exactly. A device's generator is never
    touched: such a sampler's order is a host matter."""
    with _host_streams_seeded(seed):
        return _read(source, custom_batches)


@contextmanager
def _host_streams_seeded(seed: int) -> Iterator[None]:
    """The host streams seeded with ``seed`` inside, exactly as they were after."""
    numpy = sys.modules.get("numpy")
    saved = _host_states(numpy)
    _seed_host_streams(seed)
    try:
        yield
    finally:
        _put_host_states(saved, numpy)


#: The states of the host streams: torch's CPU generator, ``random``, NumPy (None: not loaded).
_HostStates = tuple[Any, Any, Any]


def _host_states(numpy: Any) -> _HostStates:
    import torch

    return (
        torch.default_generator.get_state(),
        random.getstate(),
        numpy.random.get_state() if numpy is not None else None,
    )


def _put_host_states(states: _HostStates, numpy: Any) -> None:
    import torch

    torch.default_generator.set_state(states[0])
    random.setstate(states[1])
    if numpy is not None and states[2] is not None:
        numpy.random.set_state(states[2])


def _seed_host_streams(seed: int) -> None:
    """Seed torch's CPU generator, ``random`` and NumPy; never a device's generator."""
    import torch

    torch.default_generator.manual_seed(seed)
    random.seed(seed)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed(seed % (2**32))


def _stream_seed(seed: int, epoch: int, worker: int) -> int:
    """The seed of the host streams on which worker ``worker`` (0: the main process) iterates
    an IterableDataset in ``epoch``."""
    digest = hashlib.blake2b(f"stream:{seed}:{epoch}:{worker}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class _SeedWorkerStreams:
    """The ``worker_init_fn`` (under :class:`_WorkerInit`) of the workers of a stream: the
    user's own first, then the worker's host streams seeded for ``(seed, epoch, worker id)``,
    before the worker starts iterating the dataset. Each pass has workers of its own."""

    def __init__(self, user: Callable[[int], None] | None, seed: int, epoch: int) -> None:
        self.user = user
        self.seed = seed
        self.epoch = epoch

    def __call__(self, worker_id: int) -> None:
        if self.user is not None:
            self.user(worker_id)
        _SAMPLE_CONTEXT["seed"], _SAMPLE_CONTEXT["epoch"] = self.seed, self.epoch
        _seed_host_streams(_stream_seed(self.seed, self.epoch, worker_id))


class _OnOwnStreams:
    """Iterates ``batches`` (a DataLoader without workers) in this process on host streams of
    its own: seeded for the epoch before the first batch, carried from one batch to the next,
    and swapped with the caller's around each one, which are put back exactly."""

    def __init__(self, batches: Any, seed: int, epoch: int) -> None:
        self.batches = batches
        self.seed = seed
        self.epoch = epoch
        self.iterator: Iterator[Any] | None = None
        self.states: _HostStates | None = None  # the stream's own, between two batches

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        numpy = sys.modules.get("numpy")
        callers = _host_states(numpy)
        try:
            if self.states is None:
                _seed_host_streams(_stream_seed(self.seed, self.epoch, 0))
            else:
                _put_host_states(self.states, numpy)
            _SAMPLE_CONTEXT["seed"], _SAMPLE_CONTEXT["epoch"] = self.seed, self.epoch
            if self.iterator is None:
                self.iterator = iter(self.batches)  # may draw: a dataset's __iter__ runs here
            return next(self.iterator)
        finally:
            self.states = _host_states(numpy)
            _put_host_states(callers, numpy)


_NOTHING: Any = object()


class _Lookahead:
    """An iterator that can tell whether another item follows: it takes it one early."""

    def __init__(self, items: Iterator[Any]) -> None:
        self.items = items
        self.ahead: Any = _NOTHING
        self.ended = False

    def exhausted(self) -> bool:
        if self.ahead is _NOTHING and not self.ended:
            try:
                self.ahead = next(self.items)
            except StopIteration:
                self.ended = True
        return self.ended

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        if self.exhausted():
            raise StopIteration
        item, self.ahead = self.ahead, _NOTHING
        return item


def _position_for(
    state: dict[str, Any],
    *,
    batch_size: int | None,
    split: int | None,
    batches: int | None,
    global_order: bool = False,
) -> tuple[int, str, int]:
    """The saved position of a map-style loader in batches of this loader, what to log about
    it (``""``: nothing changed) and at which level.

    The position is kept in samples of the epoch's order: ``position x batch size x split``
    samples were trained (``split``: the number of processes a DistributedSampler splits the
    data across, 1 without one). They are a prefix of the epoch's order, which a
    DistributedSampler draws from its seed and the epoch alone, whatever the number of
    processes. So a rerun with another batch size or another number of processes continues
    the epoch at the same sample where that sample starts a batch of the new shape (the
    batch size of every process times their number); elsewhere it is refused, since the rest
    of the epoch would repeat or skip samples. ``batches``: this loader's batches per epoch;
    ``global_order``: the loader reads torch's own DistributedSampler in plain batches, whose
    order is the same for any number of processes (any other split is followed only while
    the number of processes stays the same).
    """
    position, epoch = int(state["position"]), state["epoch"]
    saved_batch = state.get("batch_size", batch_size)  # absent: saved before it was recorded
    saved_split = state.get("replicas", split)  # absent: saved before it was recorded
    if position == 0:
        return 0, "", logging.INFO
    if saved_split == split and (saved_batch is None or batch_size is None):
        return position, "", logging.INFO
    if saved_split == split and saved_batch == batch_size:
        return position, "", logging.INFO
    ended = state.get("batches")
    if isinstance(ended, int) and position >= ended and batches is not None:
        # Every batch of the epoch was handed out: it is over here too.
        return batches, "", logging.INFO
    if saved_split != split and (saved_split is None or split is None):
        raise _split_changed(epoch, saved_split, split)
    if saved_split != split and not global_order:
        raise UsageError(
            f"epoch {epoch} was trained partway with its data split across {saved_split} "
            f"process(es), and this job splits it across {split} with a sampler whose order "
            "nbresume cannot follow across a change in the number of processes (only torch's "
            "own DistributedSampler, in plain batches, has one order for any number)",
            fix=f"finish this epoch with {saved_split} process(es), or read the data through "
            "torch's DistributedSampler; a new number of processes from the start of an "
            "epoch needs nothing",
        )
    before = (saved_split or 1) * (saved_batch or 1)
    now = (split or 1) * (batch_size or 1)
    samples = position * before
    if samples % now:
        if saved_split == split:
            raise UsageError(
                f"the batch size changed from {saved_batch} to {batch_size} in the middle of "
                f"epoch {epoch}: {samples // (split or 1)} samples of it were trained, which "
                f"is not a whole number of batches of {batch_size}, so the rest of the epoch "
                "would repeat or skip samples",
                fix=f"keep batch_size={saved_batch} until this epoch ends, or choose a batch "
                f"size that divides {samples // (split or 1)}; a new batch size from the "
                "start of an epoch needs nothing",
            )
        raise UsageError(
            f"the global batch changed from {before} ({saved_split} process(es) x "
            f"batch_size={saved_batch}) to {now} ({split} x batch_size={batch_size}) in the "
            f"middle of epoch {epoch}: {samples} samples of it were trained, which is not a "
            f"whole number of global batches of {now}, so the rest of the epoch would repeat "
            "or skip samples",
            fix=f"keep the global batch: batch_size = {before} // world_size in each process, "
            f"with a number of processes that divides {before}; or finish this epoch with "
            f"{saved_split} process(es) of batch_size={saved_batch}; a new shape from the start "
            "of an epoch needs nothing",
        )
    level = logging.INFO if before == now else logging.WARNING
    if saved_split == split:
        said = (
            f"nbresume: the batch size changed from {saved_batch} to {batch_size}: epoch "
            f"{epoch} continues at sample {samples // (split or 1)} (batch {samples // now} of "
            f"{batch_size} samples), exactly where it stopped"
        )
    else:
        said = (
            f"nbresume: epoch {epoch} was trained by {saved_split} process(es) of batch_size="
            f"{saved_batch} up to sample {samples} of its order; it continues there, at batch "
            f"{samples // now} of {split} process(es) of batch_size={batch_size}"
        )
    return samples // now, said, level


def _split_changed(epoch: int, saved: int | None, split: int | None) -> UsageError:
    def how(replicas: int | None) -> str:
        if replicas is None:
            return "with no sampler that splits it across processes"
        return f"split across {replicas} process(es) by a DistributedSampler"

    return UsageError(
        f"epoch {epoch} was trained partway with its data {how(saved)}, and this loader reads "
        f"it {how(split)}: the two orders differ, so the rest of the epoch would repeat or "
        "skip samples",
        fix="feed the DataLoader from the same DistributedSampler(dataset, shuffle=..., "
        "seed=...) in every leg (num_replicas=1, rank=0 in one process without a process "
        "group), or finish this epoch as it began; a change from the start of an epoch needs "
        "nothing",
    )


def _stream_split_changed(epoch: int, saved: int, now: int) -> UsageError:
    return UsageError(
        f"epoch {epoch} of the IterableDataset was read partway by {saved} process(es), and "
        f"this job has {now}: how a stream is split across processes is the dataset's own, so "
        "nbresume cannot tell where the rest of the epoch begins",
        fix=f"finish this epoch with {saved} process(es); a new number of processes from the "
        "start of an epoch needs nothing",
    )


def _running_job() -> Any:
    """``torch.distributed`` where a job of processes runs in it, else ``None`` (nothing is
    imported: a program that has not imported it runs no job)."""
    dist: Any = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    return dist


def job_rank() -> int:
    """This process's rank in the ``torch.distributed`` job (0 without one)."""
    dist = _running_job()
    return 0 if dist is None else int(dist.get_rank())


def job_size() -> int:
    """The number of processes of the ``torch.distributed`` job (1 without one)."""
    dist = _running_job()
    return 1 if dist is None else int(dist.get_world_size())


def _same_batches_of_workers(batch_size: int | None, state: dict[str, Any]) -> None:
    """Over a stream read by several workers, a batch holds the next items of one worker: the
    batches of another size do not cover the same items, so the batch size stays until the
    epoch ends."""
    saved = state.get("batch_size")
    if saved is None or saved == batch_size or state["position"] == 0:
        return
    raise UsageError(
        f"the batch size changed from {saved} to {batch_size} in the middle of epoch "
        f"{state['epoch']} of an IterableDataset read by several workers: each batch comes "
        "from one worker's stream, so batches of the new size would not hold the items that "
        "the rest of the epoch holds",
        fix=f"keep batch_size={saved} until this epoch ends; a new batch size from the start "
        "of an epoch needs nothing",
    )


def _stream_ended_early(epoch: int, batches: int, position: int) -> UsageError:
    return UsageError(
        f"epoch {epoch} of the IterableDataset ended after {batches} batches, but the "
        f"checkpoint was saved after {position} batches of it: its stream is not the same as "
        "in the run that saved it",
        fix="make the stream of an epoch a function of the epoch: shuffle in set_epoch(epoch) "
        "or from the global random generators inside __iter__ (nbresume seeds them for each "
        "epoch and worker), never from a counter or the clock",
    )


class EpochLoop(Protocol):
    """What a :class:`ResumableLoader` tells the loop of :meth:`Checkpointer.epochs` about
    the batches it hands out (see :mod:`nbresume.checkpoint.loop.epochloop`)."""

    def in_epoch_body(self) -> bool:
        """Whether the body of an epoch loop is running."""

    def begin_pass(self, loader: ResumableLoader) -> tuple[int, int] | None:
        """A pass over ``loader`` begins: its key, or ``None`` outside an epoch loop's body."""

    def wants_batch(self, loader: ResumableLoader, key: tuple[int, int], exhausted: bool) -> bool:
        """``loader`` is asked for a batch (``exhausted``: it has none left); True: stop."""

    def batch_given(self, loader: ResumableLoader) -> None:
        """``loader`` handed out a batch: it belongs to the running step."""

    def pass_left(self, loader: ResumableLoader, key: tuple[int, int]) -> None:
        """The consumer left the pass before its end (``break``); may run in any thread."""


class ResumableLoader:
    """A DataLoader wrapper that knows its exact position and resumes there.

    Iterating it yields the rest of the current epoch (all of it, unless a checkpoint was
    restored mid-epoch); when an epoch is exhausted the next iteration starts the next epoch.
    :meth:`batches` yields batches forever, epoch after epoch, for step-based loops.

    Inside the body of :meth:`Checkpointer.epochs`, iterating it is one pass over its data
    for that epoch: every batch belongs to a step, a pass left early (``break``) moves it to
    the start of its next data epoch, and a pass that had ended before the checkpoint the run
    resumed from yields nothing.

    Over an ``IterableDataset`` the position is the same count of batches; a resumed epoch
    is the epoch's stream rebuilt from its start, its consumed batches loaded and dropped.
    """

    def __init__(self, loader: Any, *, seed: int | None = None) -> None:
        from torch.utils.data import IterableDataset

        self.loader = loader
        #: A stream (IterableDataset): no indices to skip by, and maybe no length.
        self.iterable = isinstance(loader.dataset, IterableDataset)
        self.seed = int(users_seed() if seed is None else seed) & (2**63 - 1)
        self.epoch = 0
        self.position = 0  # batches of the current epoch already handed out
        #: The epoch of the Checkpointer's loop in which the last pass over this loader ended
        #: (-1: none); a resumed body does not hand out a pass that had ended.
        self.finished_in = -1
        #: The epoch loop this loader reports to (set by the Checkpointer; None: standalone).
        self.epoch_loop: EpochLoop | None = None
        #: The key of the pass running or last begun inside an epoch loop (runtime only).
        self.pass_key: tuple[int, int] | None = None
        #: Where the Checkpointer created this wrapper: (loop, epoch), or None (runtime only).
        self.created_in: tuple[int, int] | None = None
        #: How long the loop waits for each batch and keeps it (runtime only): the data-wait
        #: share the status line and the panel show.
        self.data_wait = DataWait()
        self.data_wait.num_workers = getattr(loader, "num_workers", None)
        self.data_wait.pin_memory = getattr(loader, "pin_memory", None)
        #: What each batch goes through as it is handed out (moving it to a device, as an
        #: Accelerate loader this one stands for did); ``None``: nothing.
        self.place: Callable[[Any], Any] | None = None

    def __len__(self) -> int:
        return len(self.loader)

    def state_dict(self) -> dict[str, int | None]:
        state = {
            "seed": self.seed,
            "epoch": self.epoch,
            "position": self.position,
            "finished_in": self.finished_in,
            "batch_size": self.loader.batch_size,
        }
        if self.iterable:
            state["world_size"] = job_size()
        else:
            state["replicas"] = self._split()
            state["batches"] = self._batches()
        return state

    def load_state_dict(self, state: dict[str, int]) -> None:
        position, said, level = self._resumed_position(state)
        if said:
            log.log(level, said)
        self.seed, self.epoch, self.position = state["seed"], state["epoch"], position
        self.finished_in = state.get("finished_in", -1)  # absent before loop shapes were tracked

    def check_state(self, state: Any) -> None:
        """Raise the :class:`UsageError` that loading ``state`` would raise (another batch
        size or number of processes that cannot continue its epoch exactly), changing nothing."""
        self._resumed_position(state)

    def _resumed_position(self, state: dict[str, Any]) -> tuple[int, str, int]:
        """The position to continue from, in batches of this loader, and what to log about it
        and at which level (see :func:`_position_for`)."""
        from torch.utils.data import BatchSampler

        loader = self.loader
        batch_size = loader.batch_size
        if not self.iterable:
            plain = loader.batch_sampler is None or type(loader.batch_sampler) is BatchSampler
            return _position_for(
                state,
                batch_size=batch_size,
                split=self._split(),
                batches=self._batches(),
                global_order=plain and _is_torch_sampler(loader.sampler, ("DistributedSampler",)),
            )
        saved, now = state.get("world_size", job_size()), job_size()
        if saved != now and state["position"] > 0:
            raise _stream_split_changed(state["epoch"], saved, now)
        if self.loader.num_workers > 1:
            _same_batches_of_workers(batch_size, state)
        stream = {k: v for k, v in state.items() if k not in ("replicas", "batches")}
        return _position_for(stream, batch_size=batch_size, split=None, batches=None)

    def _batches(self) -> int | None:
        """The batches of an epoch of the map-style loader (``None``: its sampler has no
        length)."""
        try:
            return len(self.loader)
        except TypeError:
            return None

    def _split(self) -> int | None:
        """Across how many processes the sampler splits the data (a DistributedSampler's
        ``num_replicas``); ``None`` where no sampler does."""
        loader = self.loader
        for part in _sampler_parts(loader.batch_sampler) + _sampler_parts(loader.sampler):
            replicas = getattr(part, "num_replicas", None)
            if isinstance(replicas, int) and not isinstance(replicas, bool):
                return replicas
        return None

    def _epoch_indices(self) -> tuple[list[list[int]] | None, list[int] | None]:
        """Batches of indices (custom batch sampler) or sample indices of this epoch, drawn
        from generators of nbresume's own, seeded by ``(seed, epoch)`` alone."""
        from torch.utils.data import BatchSampler

        loader = self.loader
        seed = epoch_seed(self.seed, self.epoch)
        sampler, batch_sampler = loader.sampler, loader.batch_sampler
        # A batch sampler given to the DataLoader (its batch_size is then None) holds the
        # order; loader.sampler is only the SequentialSampler torch fills in.
        custom_batches = batch_sampler is not None and (
            type(batch_sampler) is not BatchSampler or loader.batch_size is None
        )
        source = batch_sampler if custom_batches else sampler
        for part in _sampler_parts(source):
            if hasattr(part, "set_epoch"):
                part.set_epoch(self.epoch)
        with _private_generators(source, seed) as on_global_streams:
            if on_global_streams:
                return _read_under_seed(source, seed, custom_batches)
            return _read(source, custom_batches)

    def _options(self, worker_init_fn: Callable[[int], None] | None) -> dict[str, Any]:
        """The options of the DataLoader of one pass: the user's, with nbresume's generator
        for the epoch and its worker setup."""
        import torch

        loader = self.loader
        options: dict[str, Any] = {
            "num_workers": loader.num_workers,
            "collate_fn": loader.collate_fn,
            "pin_memory": loader.pin_memory,
            "timeout": loader.timeout,
            "worker_init_fn": _WorkerInit(worker_init_fn),
            "multiprocessing_context": loader.multiprocessing_context,
            "generator": torch.Generator().manual_seed(epoch_seed(self.seed, self.epoch) ^ 1),
            "persistent_workers": False,
        }
        if loader.num_workers > 0:
            options["prefetch_factor"] = loader.prefetch_factor
        if getattr(loader, "pin_memory_device", ""):
            options["pin_memory_device"] = loader.pin_memory_device
        return options

    def _make_loader(self, skip: int) -> Any:
        from torch.utils.data import DataLoader

        loader = self.loader
        batches, indices = self._epoch_indices()
        options = self._options(loader.worker_init_fn)
        dataset: Any = _SeededDataset(loader.dataset, self.seed, self.epoch)
        if batches is None:
            assert indices is not None
            if loader.batch_size is None:
                return DataLoader(dataset, batch_size=None, sampler=indices[skip:], **options)
            size = loader.batch_size
            rest = indices[skip * size :]
            batches = [rest[at : at + size] for at in range(0, len(rest), size)]
            if batches and loader.drop_last and len(batches[-1]) < size:
                batches.pop()
        else:
            batches = batches[skip:]
        positioned = _batches_of(batches, self.seed, self.epoch, skip)
        return DataLoader(dataset, batch_sampler=positioned, **options)

    def __iter__(self) -> Iterator[Any]:
        loop = self.epoch_loop
        key = None if loop is None else loop.begin_pass(self)
        if loop is None or key is None:
            yield from self._standalone_pass()
        else:
            yield from self._epoch_pass(loop, key)

    def _open_stream(self, skip: int) -> Iterator[Any]:
        """The batches of the current epoch of a stream after the first ``skip``, which are
        loaded and dropped: the epoch's stream starts over (``set_epoch`` first, where the
        dataset has it) on nbresume's seeds, so it is the same as before if the dataset's
        stream of an epoch is a function of the epoch."""
        from torch.utils.data import DataLoader

        loader = self.loader
        if hasattr(loader.dataset, "set_epoch"):
            loader.dataset.set_epoch(self.epoch)
        seeding = _SeedWorkerStreams(loader.worker_init_fn, self.seed, self.epoch)
        made = DataLoader(
            loader.dataset,
            batch_size=loader.batch_size,
            drop_last=loader.drop_last,
            **self._options(seeding),
        )
        if loader.num_workers > 0:
            batches: Iterator[Any] = iter(made)
        else:  # no worker seeds the stream: it runs here, on host streams of its own
            batches = _OnOwnStreams(made, self.seed, self.epoch)
        if skip:
            started = time.perf_counter()
            for dropped in range(skip):
                if next(batches, _NOTHING) is _NOTHING:
                    raise _stream_ended_early(self.epoch, dropped, skip)
            log.info(
                "nbresume: epoch %d of the IterableDataset resumes at batch %d: the %d batches "
                "before it were loaded and dropped in %.1f s",
                self.epoch, skip, skip, time.perf_counter() - started,
            )  # fmt: skip
        return batches

    def _rest_of_epoch(self) -> tuple[Iterator[Any], Callable[[], bool]]:
        """The batches left in the current data epoch (timed), and a test of whether none is
        left: a map-style loader counts them; a stream takes its next batch one early."""
        if self.iterable:
            ahead = _Lookahead(self.data_wait.timed(self._open_stream(self.position)))
            return ahead, ahead.exhausted
        total = len(self.loader)
        return self._timed_batches(), lambda: self.position >= total

    def _timed_batches(self) -> Iterator[Any]:
        yield from self.data_wait.timed(self._make_loader(self.position))

    def _standalone_pass(self) -> Iterator[Any]:
        """The rest of the current data epoch, outside an epoch loop (``steps()``, by hand)."""
        rest, exhausted = self._rest_of_epoch()
        if exhausted():
            self.epoch, self.position = self.epoch + 1, 0
            rest, _ = self._rest_of_epoch()
        for batch in rest:
            self.position += 1
            yield batch if self.place is None else self.place(batch)
        self.epoch, self.position = self.epoch + 1, 0

    def _epoch_pass(self, loop: EpochLoop, key: tuple[int, int]) -> Iterator[Any]:
        """One pass inside the body of epoch ``key[1]`` of the Checkpointer's loop: the loop
        learns of every batch handed out and of every request for the next one (where steps
        end and saves happen)."""
        epoch = key[1]
        if self.finished_in == epoch:
            return  # resumed after this pass had ended: the rest of the body runs without it
        rest, exhausted = self._rest_of_epoch()
        if loop.wants_batch(self, key, exhausted()):
            return  # the loop is stopping: nothing more is handed out
        if exhausted():
            self.epoch, self.position = self.epoch + 1, 0
            rest, exhausted = self._rest_of_epoch()
        for batch in rest:
            self.position += 1
            loop.batch_given(self)
            try:
                yield batch if self.place is None else self.place(batch)
            except GeneratorExit:
                # Closed at the yield: the consumer left (break, or zip ended on another
                # loader). Only noted here: a generator can be closed late, by the garbage
                # collector, in any thread; the loop acts on it at its next control point.
                loop.pass_left(self, key)
                raise
            if loop.wants_batch(self, key, exhausted()):
                return  # stopping mid-epoch: the position stays where the checkpoint has it
        self.end_pass(epoch)

    def end_pass(self, epoch: int) -> None:
        """The pass of the loop's ``epoch`` is over (exhausted or left): the next pass starts
        the next data epoch."""
        self.epoch, self.position, self.finished_in = self.epoch + 1, 0, epoch

    def batches(self) -> Iterator[Any]:
        """Batches forever, epoch after epoch, from the current position (for ``steps()``
        loops; inside ``epochs()``, iterate the loader itself)."""
        loop = self.epoch_loop
        if loop is not None and loop.in_epoch_body():
            raise UsageError(
                "loader.batches() was called inside the body of ckpt.epochs(): it never ends, "
                "and an epoch loop counts one pass over the data per epoch",
                fix="iterate the loader itself inside epochs() (for batch in loader: ...), or "
                "use ckpt.steps(total) with loader.batches()",
            )
        while True:
            yield from self


#: Where nbresume seeds the host streams itself, each time putting the user's states back
#: exactly before returning (tests/test_rng_guest.py checks both).
SCOPED_SEEDING: tuple[Callable[..., Any], ...] = (
    _SeededDataset.__getitem__,
    _SeededDataset.seeded_samples,
    _read_under_seed,
    _OnOwnStreams.__next__,
)
