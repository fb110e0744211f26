"""What a resumed Lightning run keeps: every checkpoint Lightning itself would keep.

Each case fits the same small LightningModule twice with the same ``ModelCheckpoint``
settings, once with Lightning's own checkpoints and once with nbresume's plugin and callback,
crashes both at the same step (an exception at a step's end: the files on disk are those a
kill there leaves), resumes both from their last checkpoint and compares the ``.ckpt`` names
left. A ``ModelCheckpoint`` folder copied or moved elsewhere resumes there in place.

The score ``save_top_k`` ranks by depends on the step alone, and the model has no randomness,
so that both runs make the same choices whatever their random streams.
"""

from __future__ import annotations

import shutil
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lightning")

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import nbresume.lightning
from nbresume.checkpoint.backends import wait_for_removals
from testkit.lightning import quiet_trainer

STEPS_PER_EPOCH = 8
EPOCHS = 3


class Net(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 2)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        # Goes up and down with the step, so that save_top_k keeps and drops in turn.
        self.log("score", float(((self.global_step + 1) * 37) % 11))
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def loader() -> DataLoader[Any]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(8 * STEPS_PER_EPOCH, 4, generator=generator)
    return DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=8)


class Crashed(Exception):
    pass


class CrashAt(L.Callback):
    """Raises at the end of step ``step``, before ModelCheckpoint's callbacks (which Lightning
    runs last) could save it."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            raise Crashed(f"step {self.step}")


class FirstStep(L.Callback):
    """Records the step training starts from."""

    started: int | None = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.started = trainer.global_step


class CrashesAt:
    """Put before a checkpoint plugin's class: the plugin's save of ``name`` at ``step`` fails
    (the plugin's own save runs for every other)."""

    def __init__(self, name: str, step: int) -> None:
        super().__init__()
        self.name, self.step = name, step

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None
    ) -> None:
        if Path(path).name == self.name and checkpoint["global_step"] == self.step:
            raise Crashed(f"saving {path}")
        super().save_checkpoint(checkpoint, path, storage_options)  # type: ignore[misc]


class CrashingIO(CrashesAt, TorchCheckpointIO):
    """Lightning's own plugin, failing the save of ``name`` at ``step``."""


class CrashingNbresumeIO(CrashesAt, nbresume.lightning.CheckpointIO):
    """nbresume's plugin, failing the save of ``name`` at ``step``."""


class KeepingNbresumeIO(nbresume.lightning.CheckpointIO):
    """nbresume's plugin, whose removal of ``name`` is cut short (as by a kill, or by Google
    Drive not confirming the newer checkpoint before the VM goes): the folder stays."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def remove_checkpoint(self, path: Any) -> None:
        if Path(path).name != self.name:
            super().remove_checkpoint(path)


#: The ModelCheckpoint settings compared, each a list of ModelCheckpoint keyword arguments.
SETTINGS: dict[str, list[dict[str, Any]]] = {
    "every 4 steps, keep all": [
        {"save_last": True, "every_n_train_steps": 4, "save_top_k": -1},
    ],
    "every epoch, keep all": [
        {"save_last": True, "save_top_k": -1, "save_on_train_epoch_end": True},
    ],
    "the best 2 by score, and every 4 steps kept": [
        {"monitor": "score", "save_top_k": 2, "every_n_train_steps": 4, "filename": "best-{step}"},
        {"save_last": True, "every_n_train_steps": 4, "save_top_k": -1},
    ],
}


def fit(
    folder: Path,
    settings: list[dict[str, Any]],
    *,
    ours: bool,
    ckpt_path: str | None = None,
    extra: Sequence[Any] = (),
    plugin: Any = None,
) -> L.Trainer:
    """Fit with ModelCheckpoint(dirpath=folder, **each of settings): Lightning's own
    checkpoints, or with nbresume's plugin and callback (``ours``)."""
    callbacks: list[Any] = [ModelCheckpoint(dirpath=folder, **s) for s in settings]
    callbacks += list(extra)
    plugins: list[Any] = []
    if ours:
        callbacks.append(nbresume.lightning.Callback(deadline=None, announce=False))
        plugins.append(plugin or nbresume.lightning.CheckpointIO())
    elif plugin is not None:
        plugins.append(plugin)
    trainer = quiet_trainer(
        max_epochs=EPOCHS,
        num_sanity_val_steps=0,
        callbacks=callbacks,
        plugins=plugins,
        default_root_dir=folder.parent,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "the checkpoint folder is not empty", and such
        trainer.fit(Net(), loader(), ckpt_path=ckpt_path)
    return trainer


def crash(folder: Path, settings: list[dict[str, Any]], *, ours: bool, **options: Any) -> None:
    with pytest.raises(Crashed):
        fit(folder, settings, ours=ours, **options)
    # The process goes on after the crash, and with it a removal retention started in the
    # background: it ends before the folder is looked at or copied, as at a process's exit.
    wait_for_removals()


def resume_path(folder: Path, *, ours: bool) -> str | None:
    if ours:
        return nbresume.lightning.last_checkpoint(folder)
    return str(folder / "last.ckpt")


def names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def kept_for_good(folder: Path) -> set[str]:
    """The .ckpt that nothing removes, as the settings ask: all but the best-2 ones (which
    Lightning itself drops as better ones come)."""
    return {name for name in names(folder) if not name.startswith("best-")}


def both(root: Path) -> dict[bool, Path]:
    return {False: root / "lightning" / "ckpts", True: root / "nbresume" / "ckpts"}


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_a_resumed_run_keeps_what_lightning_keeps(tmp_path: Path, setting: str) -> None:
    """Crashed at step 18 (saved at 16) and resumed: the same .ckpt as Lightning's own run,
    every one that save_top_k=-1 keeps among them."""
    settings = SETTINGS[setting]
    kept = {}
    for ours, folder in both(tmp_path).items():
        crash(folder, settings, ours=ours, extra=[CrashAt(18)])
        before = kept_for_good(folder)
        started = FirstStep()
        fit(folder, settings, ours=ours, ckpt_path=resume_path(folder, ours=ours), extra=[started])
        assert started.started == 16
        assert before <= set(names(folder)), "a checkpoint of the crashed run was removed"
        kept[ours] = names(folder)
    assert kept[True] == kept[False]
    assert not any("-v" in name for name in kept[True])


def test_a_deliberate_resume_from_an_older_checkpoint_keeps_the_newer_ones(
    tmp_path: Path,
) -> None:
    """Fitted to the end, then fitted again from the checkpoint of step 8: every checkpoint
    of the first fit stays, as with Lightning, the best ones included."""
    settings = SETTINGS["the best 2 by score, and every 4 steps kept"]
    kept = {}
    for ours, folder in both(tmp_path).items():
        fit(folder, settings, ours=ours)
        before = kept_for_good(folder)
        fit(folder, settings, ours=ours, ckpt_path=str(folder / "epoch=0-step=8.ckpt"))
        assert before <= set(names(folder))
        kept[ours] = names(folder)
    assert kept[True] == kept[False]


def test_a_crash_between_a_best_checkpoint_and_last_leaves_no_duplicate(tmp_path: Path) -> None:
    """Crashed while last.ckpt of step 12 was being saved, after the best-2 checkpoint of step
    12 was saved (and the one it displaced removed): the resumed run replays step 12, and the
    crashed run's best-2 checkpoint of that step, which the resumed state does not know, gives
    way to the replay's instead of staying beside it as Lightning's does (its replay is named
    -v1). The keep-all checkpoint of step 12 stays, as Lightning's does."""
    settings = SETTINGS["the best 2 by score, and every 4 steps kept"]
    kept = {}
    for ours, folder in both(tmp_path).items():
        plugin = CrashingNbresumeIO("last.ckpt", 12) if ours else CrashingIO("last.ckpt", 12)
        crash(folder, settings, ours=ours, plugin=plugin)
        assert "best-step=12.ckpt" in names(folder)
        fit(folder, settings, ours=ours, ckpt_path=resume_path(folder, ours=ours))
        kept[ours] = names(folder)
    assert "best-step=12-v1.ckpt" in kept[False]  # Lightning's own: the leftover stays beside
    assert kept[True] == sorted(set(kept[False]) - {"best-step=12-v1.ckpt"})
    assert "epoch=1-step=12.ckpt" in kept[True]


def test_a_best_checkpoint_whose_removal_was_cut_short_goes_when_the_run_resumes(
    tmp_path: Path,
) -> None:
    """save_top_k=2 dropped best-step=8 at step 12, and its removal did not happen; the run
    crashed at step 18 and resumed from step 16: the resumed run removes it, as Lightning
    would have, and keeps what Lightning's own run keeps."""
    settings = SETTINGS["the best 2 by score, and every 4 steps kept"]
    kept = {}
    for ours, folder in both(tmp_path).items():
        plugin = KeepingNbresumeIO("best-step=8.ckpt") if ours else None
        crash(folder, settings, ours=ours, extra=[CrashAt(18)], plugin=plugin)
        assert ("best-step=8.ckpt" in names(folder)) == ours
        fit(folder, settings, ours=ours, ckpt_path=resume_path(folder, ours=ours))
        kept[ours] = names(folder)
    assert kept[True] == kept[False]


@pytest.mark.parametrize("how", ["copied", "moved"])
def test_a_copied_or_moved_folder_resumes_in_place(tmp_path: Path, how: str) -> None:
    """The checkpoint folder copied (a new Kaggle session's input) or moved elsewhere, then
    resumed there: from the right step, nothing removed, last.ckpt saved again in place (not
    as last-v1.ckpt), and the same checkpoints in the end as a run resumed where it was."""
    settings = SETTINGS["the best 2 by score, and every 4 steps kept"]
    first = tmp_path / "session-1" / "ckpts"
    crash(first, settings, ours=True, extra=[CrashAt(18)])
    before = kept_for_good(first)
    second = tmp_path / "session-2" / "ckpts"
    second.parent.mkdir()
    if how == "copied":
        shutil.copytree(first, second)
    else:
        first.rename(second)
    resume = nbresume.lightning.last_checkpoint(second)
    assert resume == str(second / "last.ckpt")
    started = FirstStep()
    run = fit(second, settings, ours=True, ckpt_path=resume, extra=[started])
    assert started.started == 16
    after = names(second)
    assert before <= set(after)
    assert "last-v1.ckpt" not in after
    assert not any("-v" in name for name in after)
    assert nbresume.CheckpointStore(second / "last.ckpt").latest().step == EPOCHS * STEPS_PER_EPOCH  # type: ignore[union-attr]
    # ModelCheckpoint's state followed the folder: its paths are the new ones.
    for callback in run.checkpoint_callbacks:
        assert isinstance(callback, ModelCheckpoint)
        for path in [*callback.best_k_models, callback.best_model_path, callback.last_model_path]:
            assert not path or Path(path).parent == second.resolve()
    if how == "copied":
        assert kept_for_good(first) == before  # the original is left as it was

    in_place = tmp_path / "in-place" / "ckpts"
    crash(in_place, settings, ours=True, extra=[CrashAt(18)])
    fit(in_place, settings, ours=True, ckpt_path=resume_path(in_place, ours=True))
    assert after == names(in_place)
