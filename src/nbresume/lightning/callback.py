"""``nbresume.lightning.Callback``: what a resumed Lightning run needs beyond its checkpoint.

- **Stops that save.** SIGTERM, SIGUSR1, a notebook interrupt, the panel's "Stop and save"
  and the session's deadline (``deadline="auto"``: the platform's cap, less the measured
  cost of a save) become a verified save of ``last.ckpt`` at the next step boundary, then a
  clean stop. After a signal the process ends as the signal would have (a Slurm job first
  asks to be requeued); after an interrupt ``fit()`` simply returns. Under DDP the ranks
  agree on these requests at every step end: every rank saves the same ``last.ckpt`` (rank 0
  writes it) and stops there.
- **The panel and the status line** show the run: its step, its saves, the deadline.
- **Randomness.** The random number generators (Python, NumPy, torch, CUDA) go into every
  checkpoint and are put back before the training loader makes its first iterator, so dropout
  and the next epoch's shuffle continue as in an uninterrupted run (Lightning saves none of
  them). A resume from a checkpoint saved at an epoch's end is then exact.
- **ModelCheckpoint's folders.** When a run resumes, ``.ckpt`` folders that this same run
  wrote but that the resumed ``ModelCheckpoint`` state does not know are removed: those
  written after the resumed step (the run replays those steps and saves them again), and
  those whose removal a kill interrupted. They would otherwise stay forever beside the
  ``save_top_k`` best, and their names would push the new ones to ``-v1``.
"""

from __future__ import annotations

import logging
import os
import signal
import uuid
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint

from nbresume.checkpoint.state import capture_rng, restore_rng
from nbresume.checkpoint.store import CheckpointStore
from nbresume.frameworks.layout import committed
from nbresume.lightning.checkpoint_io import CheckpointIO, ckpt_folders, read_document

log = logging.getLogger("nbresume")

#: Seconds the end of ``fit()`` waits for Google Drive to confirm the newer checkpoints
#: before the older ones ``save_top_k`` dropped are removed (else they stay until a resume).
REMOVALS_WAIT_S = 120.0
#: The key of nbresume's own state (the run's identity, the RNG states) in the checkpoint.
STATE_KEY = "nbresume"


class Callback(pl.Callback):
    """``Trainer(callbacks=[nbresume.lightning.Callback()])``, with
    ``plugins=[nbresume.lightning.CheckpointIO()]``.

    Args:
        deadline: when the session ends: ``"auto"`` (the platform's cap: Colab, Kaggle, a
            Slurm job's time limit), seconds from now, a duration such as ``"8.5h"``, or
            ``None``. The run saves and stops before it, by the measured cost of a save.
        announce: show the run in the notebook panel and the status line.
    """

    def __init__(
        self, *, deadline: float | int | str | None = "auto", announce: bool = True
    ) -> None:
        self.deadline = deadline
        self.announce = announce
        self.run_id = uuid.uuid4().hex
        self.watch: Any = None  # a nbresume.frameworks.watch.Watch while training runs
        #: The last run's watch, kept so that the panel still shows the run between cells
        #: (the panel holds it weakly) and its "Save now" answers for it.
        self._shown: Any = None
        self._rng: dict[str, Any] | None = None
        self._resumed_step: int | None = None
        self._stopped = ""

    # -- the checkpoint --------------------------------------------------------------------

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        checkpoint[STATE_KEY] = {"run": self.run_id, "rng": capture_rng()}

    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        state = checkpoint.get(STATE_KEY)
        if isinstance(state, dict):
            self.run_id = str(state.get("run", self.run_id))
            self._rng = state.get("rng")
            self._put_back_rng()
        step = checkpoint.get("global_step")
        self._resumed_step = step if isinstance(step, int) else None

    def on_sanity_check_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # The sanity check's loaders drew from the RNG after the restore; the uninterrupted
        # run did not draw there. Put the saved states back again before the training loader
        # makes its first iterator (Lightning makes it before on_train_start).
        self._put_back_rng()

    def _put_back_rng(self) -> None:
        if isinstance(self._rng, dict):
            restore_rng(self._rng)

    # -- the loop --------------------------------------------------------------------------

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        resumed, self._resumed_step = self._resumed_step, None
        if resumed is not None and trainer.ckpt_path and trainer.is_global_zero:
            self._drop_unknown(trainer, resumed)
        self._rng = None
        self._stopped = ""
        # Every rank of a DDP job watches (its signals, its deadline) and saves with the others
        # (Lightning's save holds barriers); rank 0 alone is shown and writes.
        self._start_watch(trainer)

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        watch = self.watch
        if watch is None:
            return
        step = trainer.global_step
        watch.step_done(step, epoch=trainer.current_epoch)
        reason, save = watch.decide()  # the same answer on every rank of a DDP job
        if reason:
            self.save(trainer)
            watch.stopping(step, reason)
            self._stopped = reason
            trainer.should_stop = True
        elif save:
            self.save(trainer)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        watch, self.watch = self.watch, None
        if watch is None:
            return
        self._shown = watch
        self._detach(trainer)
        io = trainer.strategy.checkpoint_io
        if isinstance(io, CheckpointIO):
            # On Drive, save_top_k's removals wait for Drive to confirm the newer checkpoints;
            # a run stopped for a signal or the deadline has no time to wait (the next run
            # that resumes removes what is left).
            io.finish_removals(timeout=0 if self._stopped else REMOVALS_WAIT_S)
        if watch.signum == signal.SIGINT:
            watch.signum = None  # an interrupt in a notebook: the cell ends, saved
        try:
            watch.finish(trainer.global_step, done=not self._stopped)
        finally:
            watch.close()

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        watch, self.watch = self.watch, None
        if watch is not None:
            self._detach(trainer)
            watch.close()

    # -- saves -----------------------------------------------------------------------------

    def save(self, trainer: pl.Trainer) -> str:
        """Save a verified checkpoint now, as ``last.ckpt`` of the first ``ModelCheckpoint``
        (or ``<default_root_dir>/checkpoints/last.ckpt``); return its path."""
        path = last_path(trainer)
        for callback in trainer.checkpoint_callbacks:
            if (
                isinstance(callback, ModelCheckpoint)
                and callback.save_last
                and (os.path.dirname(path) == os.fspath(callback.dirpath or ""))
            ):
                callback.last_model_path = path  # its state, saved in the checkpoint, agrees
        trainer.save_checkpoint(path)
        return path

    def _start_watch(self, trainer: pl.Trainer) -> None:
        from nbresume.frameworks.watch import Watch

        io = trainer.strategy.checkpoint_io
        lead = trainer.is_global_zero
        watch = Watch(
            CheckpointStore(last_path(trainer)),
            deadline=self.deadline,
            announce=self.announce and lead,
        )
        total = trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else None
        if total is None:
            try:
                total = int(trainer.estimated_stepping_batches)
            except (TypeError, ValueError, OverflowError, RuntimeError):
                total = None
        watch.start(step=trainer.global_step, total=total, epoch=trainer.current_epoch)
        if isinstance(io, CheckpointIO) and lead:
            io.watch = watch  # the process that writes reports the saves
        self.watch = watch

    @staticmethod
    def _detach(trainer: pl.Trainer) -> None:
        io = trainer.strategy.checkpoint_io
        if isinstance(io, CheckpointIO):
            io.watch = None

    # -- ModelCheckpoint's folders ---------------------------------------------------------

    def _drop_unknown(self, trainer: pl.Trainer, step: int) -> None:
        """Remove the ``.ckpt`` folders this run wrote that the resumed state does not know."""
        io = trainer.strategy.checkpoint_io
        if not isinstance(io, CheckpointIO):
            return
        resumed = _resolved(trainer.ckpt_path) if trainer.ckpt_path else None
        known: set[Path] = set()
        folders: set[Path] = set()
        for callback in trainer.checkpoint_callbacks:
            if not isinstance(callback, ModelCheckpoint) or not callback.dirpath:
                continue
            if "://" in os.fspath(callback.dirpath):
                continue
            folders.add(Path(os.fspath(callback.dirpath)))
            names = [*callback.best_k_models, callback.best_model_path, callback.last_model_path]
            known.update(_resolved(name) for name in names if name)
        for folder in folders:
            for path in ckpt_folders(folder):
                if _resolved(path) in known or _resolved(path) == resumed:
                    continue
                document = read_document(path)
                state = _get(document, "checkpoint", STATE_KEY)
                if not isinstance(state, dict) or state.get("run") != self.run_id:
                    continue  # not this run's: never touched
                found = max(s for (s, _, _), p, _ in committed(folder) if p == path)
                log.warning(
                    "nbresume: removing %s (step %d): this run wrote it, and the state it "
                    "resumed from (step %d) does not know it",
                    path,
                    found,
                    step,
                )
                io.remove_checkpoint(path)


def last_path(trainer: pl.Trainer) -> str:
    """Where a stop-save goes: ``last.ckpt`` in the first ``ModelCheckpoint``'s folder."""
    for callback in trainer.checkpoint_callbacks:
        if isinstance(callback, ModelCheckpoint) and callback.dirpath:
            name = f"{callback.CHECKPOINT_NAME_LAST}{callback.FILE_EXTENSION}"
            return os.path.join(str(os.fspath(callback.dirpath)), name)
    return os.path.join(os.fspath(trainer.default_root_dir), "checkpoints", "last.ckpt")


def _resolved(name: Any) -> Path:
    return Path(os.fspath(name)).resolve()


def _get(document: Any, *keys: str) -> Any:
    for key in keys:
        if not isinstance(document, dict):
            return None
        document = document.get(key)
    return document
