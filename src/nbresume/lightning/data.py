"""The training DataLoaders of a Lightning run, made resumable mid-epoch.

Lightning saves the state of a training loader and puts it back before its first iterator
only when the loader is stateful (``state_dict()`` / ``load_state_dict()``); a plain
DataLoader starts its epoch again from a new shuffle, so a run resumed mid-epoch sees other
batches than the uninterrupted one. The callback (:class:`nbresume.lightning.Callback`) has
the trainer ask for its train loaders through :class:`ResumableSource`: each torch
``DataLoader``, once Lightning has prepared it (a ``DistributedSampler`` added under DDP,
its ``worker_init_fn``), is wrapped in a :class:`LightningLoader`, nbresume's resumable
loader. Its epoch order is a function of a seed and the epoch, each sample's (and each
batch's, in a worker) randomness a function of its position, and its state is the exact
batch to continue from.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Any

from lightning.pytorch.trainer.connectors.data_connector import _DataLoaderSource
from lightning.pytorch.utilities import CombinedLoader
from torch.utils.data import DataLoader

from nbresume.checkpoint.state import ResumableLoader
from nbresume.errors import UsageError


class LightningLoader:
    """A training DataLoader of a Lightning run that resumes at the exact batch.

    Lightning's data fetcher takes one batch ahead of the step it runs, so the position saved
    is that of the batches the loop has taken (:meth:`taken`, called by the callback at each
    batch's start), not of those handed out. Each iterator is one Lightning epoch: an
    iterator left before its end (``limit_train_batches``) moves to the next data epoch, as
    Lightning's own loader would start a new one.
    """

    def __init__(self, loader: DataLoader[Any]) -> None:
        self.loader = loader
        self.resumable = ResumableLoader(loader)
        #: (epoch, position) after each batch handed out that the loop has not taken yet.
        self._ahead: deque[tuple[int, int]] = deque()
        #: (epoch, position) after the last batch the loop took.
        self._taken = (self.resumable.epoch, self.resumable.position)
        self._in_pass = False

    def __len__(self) -> int:
        return len(self.resumable)

    def __getattr__(self, name: str) -> Any:
        # What Lightning and user code read from a train loader (dataset, batch_size,
        # sampler, num_workers) is the DataLoader's.
        if name.startswith("_") or name == "loader":
            raise AttributeError(name)
        return getattr(self.loader, name)

    def __iter__(self) -> Iterator[Any]:
        inner = self.resumable
        if self._in_pass:  # the last iterator was left before the end of its data epoch
            inner.epoch, inner.position = inner.epoch + 1, 0
        self._ahead.clear()
        self._in_pass = True
        for batch in inner:
            self._ahead.append((inner.epoch, inner.position))
            yield batch
        self._in_pass = False

    def taken(self) -> None:
        """The loop took the oldest batch handed out (its step begins)."""
        if self._ahead:
            self._taken = self._ahead.popleft()

    def state_dict(self) -> dict[str, Any]:
        state = self.resumable.state_dict()
        state["epoch"], state["position"] = self._taken
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.resumable.load_state_dict(state)
        self._taken = (self.resumable.epoch, self.resumable.position)
        self._ahead.clear()
        self._in_pass = False


class _Resumable(CombinedLoader):
    """Lightning's CombinedLoader of the train loaders: the torch DataLoaders Lightning has
    prepared (set through ``flattened``) are wrapped in :class:`LightningLoader`."""

    def __init__(self, iterables: Any, source: ResumableSource) -> None:
        super().__init__(iterables, "max_size_cycle")
        self.source = source

    @property
    def flattened(self) -> list[Any]:
        loaders: list[Any] = self._flattened
        return loaders

    @flattened.setter
    def flattened(self, flattened: list[Any]) -> None:
        wrapped = [_wrap(loader) for loader in flattened]
        CombinedLoader.flattened.fset(self, wrapped)
        self.source.wrapped([w for w in wrapped if isinstance(w, LightningLoader)])


def _wrap(loader: Any) -> Any:
    """``loader`` as a :class:`LightningLoader` where it is a plain torch DataLoader; a
    loader that keeps its own state (torchdata's StatefulDataLoader) stays as it is."""
    if isinstance(loader, DataLoader) and not hasattr(loader, "state_dict"):
        return LightningLoader(loader)
    return loader


class ResumableSource(_DataLoaderSource):
    """Where the fit loop asks for its train loaders: the module's or datamodule's
    ``train_dataloader()``, or the loaders given to ``fit()``, as Lightning's own source; the
    answer goes to the loop as a CombinedLoader that wraps each DataLoader once Lightning has
    prepared it. A CombinedLoader of the user's own is passed on as it is."""

    def __init__(self, source: _DataLoaderSource) -> None:
        super().__init__(source.instance, source.name)
        #: The wrapped loaders of the current fit (set when the loop prepares them).
        self.loaders: list[LightningLoader] = []
        #: The loaders' states of the checkpoint resumed, put into them once they are made.
        self.resumed: list[dict[str, Any]] | None = None

    def wrapped(self, loaders: list[LightningLoader]) -> None:
        """The loop prepared ``loaders``. Lightning puts their saved states back only when
        it resumes inside an epoch; from a checkpoint of an epoch's end it starts the next
        epoch with new loaders, so the states the checkpoint holds are put back here."""
        self.loaders = loaders
        states, self.resumed = self.resumed, None
        if states is None:
            return
        if len(states) != len(loaders):
            raise UsageError(
                f"the checkpoint resumed holds the positions of {len(states)} training "
                f"loader(s), and this run trains on {len(loaders)}",
                fix="train on the same DataLoaders as the run that saved the checkpoint",
            )
        for loader, state in zip(loaders, states, strict=True):
            loader.load_state_dict(state)

    def dataloader(self) -> Any:
        loaders = super().dataloader()
        self.loaders = []
        if isinstance(loaders, CombinedLoader):
            return loaders
        return _Resumable(loaders, self)
