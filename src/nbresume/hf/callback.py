"""The Trainer callback: every ``checkpoint-N`` verified, nbresume's retention, clean stops."""

from __future__ import annotations

import logging
from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from nbresume.checkpoint import events as ev
from nbresume.checkpoint.arguments import check_keep
from nbresume.checkpoint.loop import check_deadline
from nbresume.checkpoint.store import CheckpointInfo
from nbresume.errors import CheckpointError
from nbresume.frameworks.watch import Watch
from nbresume.hf.folders import commit_folder, open_store

log = logging.getLogger("nbresume")

_UNSET = object()


class Callback(TrainerCallback):
    """Make every checkpoint the Trainer writes a verified nbresume checkpoint.

    ::

        trainer = Trainer(model=model, args=args, train_dataset=ds,
                          callbacks=[nbresume.hf.Callback()])
        trainer.train(resume_from_checkpoint=nbresume.hf.last_checkpoint(args.output_dir))

    After the Trainer wrote ``checkpoint-N`` (and before anything else), its files are fsynced,
    hashed and listed in a manifest written last; the folder is committed by one rename and
    read back; on Google Drive it counts as saved only once Drive reports every file's size
    and MD5. ``save_total_limit`` is applied by nbresume instead of the Trainer: an older
    checkpoint is deleted only after a newer one verified (on Drive: after Drive confirmed it,
    deleted through Drive's API so that the quota comes back).

    Before the session deadline, and on SIGTERM, SIGUSR1, an interrupt or the panel's "Stop
    and save", the Trainer saves at the next step boundary and stops. After a signal the
    process then ends as the signal would have (an interrupt raises ``KeyboardInterrupt``).
    Under DDP the ranks agree on these requests at every step end, so every rank saves the
    same ``checkpoint-N`` and stops there (and ends as the signalled rank does).

    Args:
        deadline: ``"auto"`` (the platform's session cap), seconds from now, a duration
            (``"8.5h"``) or ``None``, as for the Checkpointer.
        keep: how many checkpoints to keep; by default the Trainer's ``save_total_limit``
            (``None`` there keeps all).
        callbacks: callables that receive every :class:`~nbresume.checkpoint.events.Event`.
    """

    def __init__(
        self,
        *,
        deadline: float | int | str | None = "auto",
        keep: Any = _UNSET,
        callbacks: list[ev.Callback] | None = None,
    ) -> None:
        check_deadline(deadline, "nbresume.hf.Callback")
        if keep is not _UNSET:
            check_keep("nbresume.hf.Callback", keep)
        self.deadline = deadline
        self._keep = keep
        self._callbacks = list(callbacks or [])
        self._limit: int | None = None
        self.watch: Watch | None = None
        self._where = ""
        #: Why the running training stops early ("" while it goes on).
        self.stop_reason = ""
        self._save_began: float | None = None
        #: The last checkpoint this callback verified.
        self.last: CheckpointInfo | None = None

    # -- the Trainer's events ----------------------------------------------------------

    def on_init_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **_: Any
    ) -> None:
        # Retention is nbresume's: the Trainer would delete the older checkpoint before the
        # newer one is verified (or, on Drive, uploaded).
        if args.save_total_limit is not None and args.save_total_limit > 0:
            self._limit = args.save_total_limit
        args.save_total_limit = None

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **_: Any
    ) -> None:
        self.on_init_end(args, state, control)  # a callback added after the Trainer was made
        keep = self._limit if self._keep is _UNSET else self._keep
        where = str(args.output_dir)
        if self.watch is None or (self._where, self.watch.store.keep) != (where, keep):
            store = open_store(where, keep=keep)
            # Under torch.distributed every rank watches (signals, its deadline); rank 0 alone
            # is shown in the panel and the status line.
            self.watch = Watch(
                store,
                deadline=self.deadline,
                callbacks=self._callbacks,
                announce=state.is_world_process_zero,
            )
            self._where = where
        self.stop_reason = ""
        self.watch.start(state.global_step, state.max_steps or None, epoch=_epoch(state))

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **_: Any
    ) -> TrainerControl:
        watch = self.watch
        if watch is None:
            return control
        watch.step_done(state.global_step, total=state.max_steps or None, epoch=_epoch(state))
        if not self.stop_reason:
            reason, save = watch.decide()  # the same answer on every rank of a DDP job
            if reason:
                self.stop_reason = reason
                control.should_save = True
                control.should_training_stop = True
            elif save:
                control.should_save = True
        if control.should_save and args.should_save:
            self._save_began = watch.save_started(state.global_step)
        return control

    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **_: Any
    ) -> None:
        watch = self.watch
        if watch is None:
            return
        step = state.global_step
        group = watch.group
        if group is not None:
            # Every rank writes its own rng_state_<rank>.pth into the folder, with no barrier
            # after it: the commit moves the folder's files, so it waits for all of them.
            group.agree([0])
        failed: BaseException | None = None
        if args.should_save:
            started, self._save_began = self._save_began, None
            try:
                pending = commit_folder(watch.store, step)
                self.last = watch.commit_pending(pending, _metrics(state), started=started)
            except Exception as error:
                if group is None:
                    raise
                failed = error
        if group is not None:
            # A failed commit raises on every rank: none goes on alone into the next step.
            group.raise_any(
                failed,
                CheckpointError(
                    f"another process of the job could not commit checkpoint-{step}",
                    where=str(args.output_dir),
                    fix="see that process's error; a rerun resumes from the newest "
                    "checkpoint that verifies",
                ),
            )
        if self.stop_reason:
            watch.stopping(step, self.stop_reason)

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **_: Any
    ) -> None:
        if self.watch is not None:
            done = not self.stop_reason and state.global_step >= state.max_steps
            self.watch.finish(state.global_step, done=done)


def _epoch(state: TrainerState) -> int | None:
    return int(state.epoch) if state.epoch is not None else None


def _metrics(state: TrainerState) -> dict[str, float]:
    """The numbers of the last log entry, recorded in the manifest (``loss``, ``eval_...``)."""
    for entry in reversed(state.log_history or []):
        numbers = {
            k: float(v) for k, v in entry.items() if isinstance(v, (int, float)) and k != "step"
        }
        if numbers:
            return numbers
    return {}


__all__ = ["Callback"]
