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
- **The exact batch mid-epoch.** Each plain ``DataLoader`` of the training data is wrapped
  in nbresume's resumable loader once Lightning has prepared it (:mod:`.data`): Lightning then
  saves its position in every checkpoint and continues a resumed epoch at the next batch,
  with the same samples and the same augmentation as an uninterrupted run. Its epoch order
  comes from a seed of its own and the epoch (the seed is ``torch.initial_seed()``, which
  ``seed_everything`` sets), not from the DataLoader's generator.
- **ModelCheckpoint's folders.** A folder copied or moved as a whole (a new session's copy)
  resumes in place: the paths ``ModelCheckpoint`` recorded follow it, where Lightning would
  drop its state and save ``last-v1.ckpt``. When a run resumes, nbresume removes only what
  Lightning's own retention removes (:func:`stale_reason`): never a checkpoint that
  ``save_top_k=-1`` keeps, nor one the resumed state keeps, nor another run's.
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

from nbresume.checkpoint.format import capture_rng, restore_rng
from nbresume.checkpoint.store import CheckpointStore
from nbresume.frameworks.layout import committed
from nbresume.lightning.checkpoint_io import CheckpointIO, read_document
from nbresume.lightning.data import ResumableSource

log = logging.getLogger("nbresume")

#: Seconds the end of ``fit()`` waits for Google Drive to confirm the newer checkpoints
#: before the older ones ``save_top_k`` dropped are removed (else they stay until a resume).
REMOVALS_WAIT_S = 120.0
#: The key of nbresume's own state (the run's identity, the RNG states) in the checkpoint.
STATE_KEY = "nbresume"
#: How the name of a ``ModelCheckpoint``'s last checkpoint begins.
LAST = ModelCheckpoint.CHECKPOINT_NAME_LAST


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

    # -- the training data -----------------------------------------------------------------

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        fit_loop = trainer.fit_loop
        if stage != "fit" or isinstance(_source(trainer), ResumableSource):
            return
        if not hasattr(fit_loop, "_data_source"):
            # A Lightning release whose fit loop keeps its data elsewhere: its own loaders.
            log.warning(
                "nbresume: this Lightning release's fit loop has no _data_source: the training "
                "loaders stay Lightning's own, and a run resumed mid-epoch does not see the same "
                "batches (nbresume is tested with lightning 2.6)"
            )
            return
        if trainer.reload_dataloaders_every_n_epochs:
            # A new DataLoader every few epochs would start its order over from epoch 0.
            log.info(
                "nbresume: reload_dataloaders_every_n_epochs is set: the training loaders "
                "stay Lightning's own, and a run resumed mid-epoch does not see the same batches"
            )
            return
        fit_loop._data_source = ResumableSource(fit_loop._data_source)

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        source = _source(trainer)
        if isinstance(source, ResumableSource):
            for loader in source.loaders:
                loader.taken()

    # -- the checkpoint --------------------------------------------------------------------

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        state: dict[str, Any] = {"run": self.run_id, "rng": capture_rng()}
        source = _source(trainer)
        if isinstance(source, ResumableSource) and source.loaders:
            state["loaders"] = [loader.state_dict() for loader in source.loaders]
        checkpoint[STATE_KEY] = state

    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        if trainer.ckpt_path:
            follow_move(trainer, checkpoint)  # before ModelCheckpoint loads its state
        state = checkpoint.get(STATE_KEY)
        if isinstance(state, dict):
            self.run_id = str(state.get("run", self.run_id))
            self._rng = state.get("rng")
            self._put_back_rng()
            source = _source(trainer)
            loaders = state.get("loaders")
            if isinstance(source, ResumableSource) and isinstance(loaders, list):
                source.resumed = loaders  # put into the loaders once the loop makes them
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
            self._drop_stale(trainer, resumed)
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

    def _drop_stale(self, trainer: pl.Trainer, step: int) -> None:
        """Remove the ``.ckpt`` folders this run wrote that Lightning's own retention removes
        (:func:`stale_reason`); ``step`` is the resumed one."""
        io = trainer.strategy.checkpoint_io
        if not isinstance(io, CheckpointIO) or not trainer.ckpt_path:
            return
        resumed = _resolved(trainer.ckpt_path)
        callbacks = [
            c
            for c in trainer.checkpoint_callbacks
            if isinstance(c, ModelCheckpoint) and c.dirpath and "://" not in os.fspath(c.dirpath)
        ]
        known = {resumed}
        lasts: set[Path] = set()
        for callback in callbacks:
            names = [*callback.best_k_models, callback.best_model_path, callback.last_model_path]
            known.update(_resolved(name) for name in names if name)
            if callback.last_model_path:
                lasts.add(_resolved(callback.last_model_path))
        # Resumed from the run's last checkpoint (a rerun after a kill), rather than from an
        # older one the user chose.
        from_last = resumed in lasts or resumed.name.startswith(LAST)
        for folder in {_resolved(c.dirpath) for c in callbacks}:
            steps: dict[Path, int] = {}
            for (found, _, _), path, _ in committed(folder):
                steps[path] = max(found, steps.get(path, found))
            for path, found in steps.items():
                if _resolved(path) in known:
                    continue
                document = read_document(path)
                state = _get(document, "checkpoint", STATE_KEY)
                if not isinstance(state, dict) or state.get("run") != self.run_id:
                    continue  # not this run's: never touched
                reason = stale_reason(
                    _get(document, "checkpoint", "callbacks"),
                    path,
                    callbacks,
                    found=found,
                    resumed=step,
                    from_last=from_last,
                )
                if reason:
                    log.warning("nbresume: removing %s (step %d): %s", path, found, reason)
                    io.remove_checkpoint(path)


def stale_reason(
    states: Any,
    path: Path,
    callbacks: list[ModelCheckpoint],
    *,
    found: int,
    resumed: int,
    from_last: bool,
) -> str:
    """Why Lightning's own retention removes the ``.ckpt`` folder ``path`` (of step ``found``,
    written by this run, unknown to the state resumed at step ``resumed``), or ``""``: keep it.

    ``states`` are the ``ModelCheckpoint`` states saved in ``path`` itself: the one that
    names ``path`` wrote it. Removed are only the checkpoints of a ``ModelCheckpoint`` (still
    configured alike) that keeps a number of them: its ``save_top_k`` ones when ``save_top_k``
    is 1 or more, its ``last``. Of those, one older than the resumed step was dropped by that
    retention before the state resumed was saved (a kill or Google Drive cut its removal
    short); one newer was written by the run a rerun from its last checkpoint replays, and the
    replay saves that step again (the leftover would stay beside the ``save_top_k`` best, and
    push the replay's name to ``-v1``). Everything else stays: what ``save_top_k=-1`` keeps,
    what a callback no longer configured so wrote, the newer checkpoints of a run resumed from
    an older one on purpose (as Lightning keeps them).
    """
    if not isinstance(states, dict):
        return ""
    for key, state in states.items():
        if not isinstance(state, dict) or "dirpath" not in state:
            continue
        role = _role(state, path.name)
        owner = next((c for c in callbacks if c.state_key == key), None)
        if not role or owner is None or _resolved(owner.dirpath) != _resolved(path.parent):
            continue
        if role == "last" and not owner.save_last:
            continue
        if role == "top_k" and owner.save_top_k < 1:
            continue  # save_top_k=-1 keeps every checkpoint (0: none was to be written)
        kept = "its last checkpoint" if role == "last" else f"save_top_k={owner.save_top_k}"
        if found <= resumed:
            return (
                f"ModelCheckpoint ({kept}) had dropped it before the step resumed ({resumed}); "
                "its removal was cut short"
            )
        if from_last:
            return (
                f"ModelCheckpoint ({kept}) wrote it after the step resumed ({resumed}), in the "
                "run this one replays: the replay saves that step again"
            )
    return ""


def _role(state: dict[str, Any], name: str) -> str:
    """How a ``ModelCheckpoint``'s ``state`` names the checkpoint ``name``: ``"last"``,
    ``"top_k"`` or ``""``."""
    last = state.get("last_model_path")
    if isinstance(last, str) and os.path.basename(last) == name:
        return "last"
    best = state.get("best_k_models")
    paths = [*best] if isinstance(best, dict) else []
    paths.append(state.get("best_model_path"))
    if any(isinstance(p, str) and os.path.basename(p) == name for p in paths):
        return "top_k"
    return ""


def follow_move(trainer: pl.Trainer, checkpoint: dict[str, Any]) -> None:
    """Point the ``ModelCheckpoint`` states of ``checkpoint`` at the folder it is resumed from
    when that folder was copied or moved as a whole.

    Lightning records absolute paths; given a state saved under another ``dirpath``, it keeps
    only ``best_model_path`` (the old path), so that ``last.ckpt`` is saved again as
    ``last-v1.ckpt`` and the old best ones are never managed again. A state is moved when the
    checkpoint resumed lies in its callback's folder now and a state saved in the same old
    folder names it there: the folder moved with the checkpoint.
    """
    where = os.fspath(trainer.ckpt_path or "")
    states = checkpoint.get("callbacks")
    if "://" in where or not isinstance(states, dict):
        return
    resumed = _resolved(where)
    here = [
        c
        for c in trainer.checkpoint_callbacks
        if isinstance(c, ModelCheckpoint)
        and c.dirpath
        and "://" not in os.fspath(c.dirpath)
        and _resolved(c.dirpath) == resumed.parent
    ]
    moves: dict[str, dict[str, Any]] = {}
    old_folders: set[str] = set()
    for callback in here:
        state = states.get(callback.state_key)
        old = state.get("dirpath") if isinstance(state, dict) else None
        if not isinstance(state, dict) or not isinstance(old, str) or old == callback.dirpath:
            continue
        moves[callback.state_key] = state
        if _role(state, resumed.name):
            old_folders.add(old)
    for callback in here:
        state = moves.get(callback.state_key)
        if state is None or state["dirpath"] not in old_folders:
            continue
        old, new = state["dirpath"], os.fspath(callback.dirpath)
        log.info("nbresume: %s moved to %s; ModelCheckpoint's state follows it", old, new)

        def moved(name: Any, old: str = old, new: str = new) -> Any:
            if isinstance(name, str) and name and os.path.dirname(name) == old:
                return os.path.join(new, os.path.basename(name))
            return name

        for key in ("best_model_path", "kth_best_model_path", "last_model_path"):
            if key in state:
                state[key] = moved(state[key])
        if isinstance(state.get("best_k_models"), dict):
            state["best_k_models"] = {moved(k): v for k, v in state["best_k_models"].items()}
        state["dirpath"] = callback.dirpath


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


def _source(trainer: pl.Trainer) -> Any:
    """The fit loop's source of training data (Lightning's own attribute; ``None`` where a
    release has none)."""
    return getattr(trainer.fit_loop, "_data_source", None)
