"""Which checkpoints a store keeps: the newest ``keep``, and the best by a metric.

A :class:`KeepPolicy` is made once from the short forms ``keep=`` and ``keep_best=`` (checked
there, so a wrong one is refused before anything is opened) and answers one question after
each commit, and for ``nbresume prune``: which checkpoints to delete (:meth:`KeepPolicy.doomed`).
Whether a checkpoint counts as kept (it verifies; behind Drive's write-back cache, the durable
store confirmed it) is the store's to say.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from nbresume.checkpoint.arguments import check_keep, check_keep_best
from nbresume.checkpoint.store.info import CheckpointInfo

#: ``keep_best=``: ``(metric, "min" | "max")`` or ``(metric, "min" | "max", count)``.
KeepBest = tuple[str, str] | tuple[str, str, int]


@dataclass(frozen=True)
class KeepPolicy:
    """Which checkpoints to keep (see the module's docstring)."""

    #: How many of the newest checkpoints that count as kept to keep (``None``: keep all).
    newest: int | None = 3
    #: Also keep the best checkpoints by this metric (``""``: by none).
    metric: str = ""
    #: ``"min"`` keeps the lowest values of :attr:`metric`, ``"max"`` the highest.
    mode: str = "min"
    #: How many best to keep (0: as many as :attr:`newest`).
    best: int = 0

    @classmethod
    def of(cls, call: str, keep: object, keep_best: object = None) -> KeepPolicy:
        """The policy of ``keep=`` and ``keep_best=``; raises ArgumentError naming ``call``
        and the wrong value."""
        newest = check_keep(call, keep)
        best = check_keep_best(call, keep_best)
        return cls(newest) if best is None else cls(newest, *best)

    def but(self, call: str, keep: object = None, keep_best: object = None) -> KeepPolicy:
        """This policy with ``keep=`` and ``keep_best=`` where given (``None``: as it is)."""
        newest = self.newest if keep is None else check_keep(call, keep)
        best = self.keep_best if keep_best is None else check_keep_best(call, keep_best)
        return KeepPolicy(newest) if best is None else KeepPolicy(newest, *best)

    @property
    def keep_best(self) -> tuple[str, str, int] | None:
        """``keep_best=`` as ``(metric, mode, count)`` (count 0: as many as ``keep``)."""
        return (self.metric, self.mode, self.best) if self.metric else None

    @property
    def metric_name(self) -> str:
        """The name of the one number given to ``save(metric=0.25)``."""
        return self.metric or "metric"

    def doomed(
        self, infos: Sequence[CheckpointInfo], counts: Callable[[CheckpointInfo], bool]
    ) -> list[CheckpointInfo]:
        """The checkpoints of ``infos`` (oldest first) to delete, oldest first.

        ``counts(info)`` says whether a checkpoint may count as kept; it is asked only of the
        checkpoints that would be kept, newest first (it may read every byte back), and at
        most once each. Never deleted: a checkpoint newer than every kept one (so the newest
        that counts is never lost to a corrupt or unconfirmed newer copy), and one that was
        asked and does not count (it is left for the user to inspect). Among checkpoints of
        equal metric the older ranks first; one saved without the metric is kept only as one
        of the newest.
        """
        if self.newest is None:
            return []
        verdicts: dict[str, bool] = {}

        def kept(info: CheckpointInfo) -> bool:
            if info.name not in verdicts:
                verdicts[info.name] = counts(info)
            return verdicts[info.name]

        newest: list[CheckpointInfo] = []
        for info in reversed(infos):
            if len(newest) == self.newest:
                break
            if kept(info):
                newest.append(info)
        best: list[CheckpointInfo] = []
        if self.metric:
            ranked = sorted(
                (i for i in infos if self.metric in i.metrics),
                key=lambda i: i.metrics[self.metric],
                reverse=self.mode == "max",
            )
            wanted = self.best or self.newest
            for info in ranked:  # asked in rank order, only until enough count
                if len(best) == wanted:
                    break
                if kept(info):
                    best.append(info)
        names = {i.name for i in newest + best}
        newest_kept = max((i.step for i in newest + best), default=-1)
        return [
            info
            for info in infos
            if info.name not in names and info.step < newest_kept and verdicts.get(info.name, True)
        ]


__all__ = ["KeepBest", "KeepPolicy"]
