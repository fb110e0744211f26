"""Objects another library wrapped for training, taken as what nbresume saves and restores.

Accelerate's ``accelerator.prepare(model, optimizer, loader, scheduler)`` returns wrappers:
an ``AcceleratedOptimizer`` (an ``Optimizer`` subclass that never ran ``Optimizer.__init__``,
so it has no step hooks of its own), an ``AcceleratedScheduler``, and a ``DataLoaderShard``
or ``DataLoaderDispatcher`` (an adapter around a DataLoader whose sampler Accelerate has
split across the processes). Their state is that of what they wrap: the optimizer, the
scheduler, the DataLoader's data. nbresume takes the wrapped object, so a prepared object
can be given to a Checkpointer (and to ``ck.loader()``) as it is, and a prepared loader's
batches still come on its device; the prepared model is a
module (``DistributedDataParallel`` under several processes) and needs nothing.

Accelerate's objects are known by their type's name and module; Accelerate itself is
imported only to move a prepared loader's batches to its device, as the loader did.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

from nbresume.checkpoint.state.data import ResumableLoader, job_size
from nbresume.errors import UsageError


def _accelerate_type(value: Any) -> str:
    """The name of ``value``'s type when Accelerate defines it, else ``""``."""
    kind = type(value)
    return kind.__name__ if kind.__module__.split(".")[0] == "accelerate" else ""


def unwrap(name: str, value: Any) -> Any:
    """What nbresume saves for ``value``, given as ``name``: the object an Accelerate
    wrapper holds (a prepared loader: nbresume's resumable loader over the DataLoader it
    reads), or ``value`` itself. Raises :class:`UsageError` for what it cannot take."""
    kind = _accelerate_type(value)
    if kind == "AcceleratedOptimizer":
        return value.optimizer
    if kind == "AcceleratedScheduler":
        return value.scheduler
    if kind in ("DataLoaderShard", "DataLoaderDispatcher"):
        base, place = unwrap_loader(name, value)
        resumable = ResumableLoader(base)
        resumable.place = place
        return resumable
    torch = sys.modules.get("torch")
    if (
        torch is not None
        and isinstance(value, torch.optim.Optimizer)
        and not hasattr(value, "_optimizer_step_post_hooks")
    ):
        inner = getattr(value, "optimizer", None)
        fix = (
            f"pass the optimizer it wraps: {name}={name}.optimizer"
            if isinstance(inner, torch.optim.Optimizer)
            else "pass the torch optimizer itself"
        )
        raise UsageError(
            f"{name}= is a {type(value).__name__}, an Optimizer subclass that never ran "
            "Optimizer.__init__: nbresume cannot watch its steps",
            fix=fix,
        )
    return value


def unwrap_loader(name: str, value: Any) -> tuple[Any, Callable[[Any], Any] | None]:
    """The DataLoader an Accelerate ``DataLoaderShard`` reads (its sampler split across the
    processes by Accelerate), for nbresume's resumable loader, and what moves each batch to
    the device as the shard does (``None``: nothing); ``(value, None)`` for any other
    loader."""
    kind = _accelerate_type(value)
    if kind not in ("DataLoaderShard", "DataLoaderDispatcher"):
        return value, None
    base = getattr(value, "base_dataloader", None)
    if kind == "DataLoaderDispatcher" and job_size() > 1:
        raise UsageError(
            f"{name}= is Accelerate's DataLoaderDispatcher: the main process loads every batch "
            "and sends each process its slice, which nbresume's resumable loader cannot take",
            fix="prepare the DataLoader with Accelerator(dataloader_config="
            "DataLoaderConfiguration(dispatch_batches=False)), which shards it in each process",
        )
    if base is None or hasattr(base, "state_dict"):
        raise UsageError(
            f"{name}= is an Accelerate {kind} over a loader that keeps its own state "
            "(use_stateful_dataloader=True)",
            fix=f"pass it as a stateful object ({name}={name}) rather than to ck.loader(), or "
            "prepare the DataLoader without use_stateful_dataloader",
        )
    device = getattr(value, "device", None)
    if device is None:
        return base, None
    from accelerate.utils import send_to_device

    non_blocking = bool(getattr(value, "_non_blocking", False))
    return base, functools.partial(send_to_device, device=device, non_blocking=non_blocking)
