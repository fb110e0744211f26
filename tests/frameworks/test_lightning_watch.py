"""What the panel and the status line see of a Lightning run: every verified save, under the
name it has once in place, and a clear answer to "Save now" between cells."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lightning")

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import nbresume
import nbresume.lightning
from nbresume.checkpoint import events as ev
from nbresume.errors import UsageError
from nbresume.notebook.progress import SAVED, Tracker
from testkit.lightning import quiet_trainer


class Net(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 2)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        # A score that goes up and down, so that save_top_k keeps and removes in turn.
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("score", loss + 0.05 * ((self.global_step * 37) % 7))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Record(L.Callback):
    """Every event of the run's watch, as the panel receives them."""

    def __init__(self, nb: nbresume.lightning.Callback) -> None:
        self.nb = nb
        self.events: list[ev.Event] = []
        self.watch: Any = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.watch = self.nb.watch
        self.watch.events.subscribe(self.events.append)


class SavesIO(nbresume.lightning.CheckpointIO):
    """The plugin, unchanged, noting each path Lightning saves to."""

    def __init__(self) -> None:
        super().__init__()
        self.saved: list[Path] = []

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None
    ) -> None:
        super().save_checkpoint(checkpoint, path, storage_options)
        self.saved.append(Path(path))


def test_every_ckpt_save_reaches_the_panel_under_its_final_name(tmp_path: Path) -> None:
    tracker = Tracker()
    tracker.start()
    try:
        nb = nbresume.lightning.Callback(deadline=None)
        record = Record(nb)
        ckpts = tmp_path / "ckpts"
        x = torch.randn(48, 4, generator=torch.Generator().manual_seed(0))
        y = (x[:, 0] > 0).long()
        train = DataLoader(TensorDataset(x[:32], y[:32]), batch_size=8)
        val = DataLoader(TensorDataset(x[32:], y[32:]), batch_size=16)
        io = SavesIO()
        L.seed_everything(0, verbose=False)
        run = quiet_trainer(
            max_epochs=3,
            plugins=[io],
            callbacks=[
                ModelCheckpoint(
                    dirpath=ckpts, monitor="score", save_top_k=1, save_last=True, mode="min"
                ),
                nb,
                record,
            ],
            default_root_dir=tmp_path,
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            run.fit(Net(), train, val)
        assert run.global_step == 12

        verified = [e for e in record.events if e.kind == ev.VERIFIED]
        places = [Path(str(e.data["location"])).parent for e in verified]
        # The first save of each .ckpt (built under a hidden name) and every later one: one
        # verified event per save, in order, naming the folder as it is once in place.
        assert places == io.saved
        assert {ckpts / "last.ckpt", ckpts / "epoch=0-step=4.ckpt"} <= set(places)
        assert all(p.parent == ckpts and not p.name.startswith(".") for p in places)
        assert len(verified) == len([e for e in record.events if e.kind == ev.SAVE_STARTED])
        assert len(verified) == len([e for e in record.events if e.kind == ev.COMMITTED])

        newest = nbresume.CheckpointStore(ckpts / "last.ckpt").latest()
        assert newest is not None
        shown = tracker.snapshot()
        assert shown.last is not None
        assert (shown.last.step, shown.last.state) == (newest.step, SAVED)
        assert shown.finished

        # Between cells nothing is training: "Save now" says so, and which checkpoint is newest.
        # The panel still shows the run after fit() and answers its "Save now" for it.
        assert tracker.checkpointer is record.watch
        del record.watch  # only the panel's view of the run is left
        assert "no training loop is running" in tracker.request_save()
        watch = tracker.checkpointer
        assert watch is not None
        with pytest.raises(UsageError) as refused:
            watch.save(block=True)
        assert "no training is running" in str(refused.value)
        assert f"step {newest.step}" in str(refused.value)
    finally:
        tracker.stop()
