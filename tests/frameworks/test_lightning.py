"""nbresume.lightning in one process: Lightning's checkpoints as verified safetensors + JSON.

A small LightningModule is fitted the way users write it, with the plugin and the callback,
and the checkpoints it leaves are damaged, replaced by pickles and removed as a disk, an
attacker or ModelCheckpoint would.
"""

from __future__ import annotations

import pickle
import subprocess
import sys
import warnings
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lightning")

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import nbresume.lightning
from nbresume.errors import CheckpointError, UsageError
from testkit.lightning import quiet_trainer


class Net(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.1), nn.Linear(8, 2))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self.net(x), y))

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=0.01)


def loaders() -> tuple[DataLoader[Any], DataLoader[Any]]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(96, 4, generator=generator)
    y = (x[:, 0] > 0).long()
    train = DataLoader(TensorDataset(x[:64], y[:64]), batch_size=8, shuffle=True)
    return train, DataLoader(TensorDataset(x[64:], y[64:]), batch_size=16)


def trainer(root: Path, epochs: int = 2, **options: Any) -> L.Trainer:
    checkpoint = ModelCheckpoint(
        dirpath=root / "ckpts",
        monitor="val_loss",
        save_top_k=2,
        save_last=True,
        every_n_train_steps=options.pop("every", None),
    )
    return quiet_trainer(
        max_epochs=epochs,
        plugins=[nbresume.lightning.CheckpointIO()],
        callbacks=[checkpoint, nbresume.lightning.Callback(deadline=None, announce=False)],
        default_root_dir=root,
        **options,
    )


def fit(root: Path, epochs: int = 2, ckpt_path: str | None = None) -> L.Trainer:
    L.seed_everything(0, verbose=False)
    run = trainer(root, epochs)
    train, val = loaders()
    run.fit(Net(), train, val, ckpt_path=ckpt_path)
    return run


def newest_step_folder(ckpt: Path) -> Path:
    return max(p for p in ckpt.iterdir() if p.name.isdigit())


class Planted:
    """A pickle that leaves a file behind if anything ever unpickles it."""

    def __init__(self, sentinel: Path) -> None:
        self.sentinel = sentinel

    def __reduce__(self) -> Any:
        return (Path.touch, (self.sentinel,))


# -- the checkpoints ---------------------------------------------------------------------------


def test_fit_saves_verified_folders_without_pickle_and_resumes(tmp_path: Path) -> None:
    run = fit(tmp_path, epochs=2)
    ckpts = tmp_path / "ckpts"
    names = sorted(p.name for p in ckpts.iterdir())
    assert "last.ckpt" in names
    assert len(names) == 3  # last + the 2 best
    for ckpt in ckpts.iterdir():
        assert ckpt.is_dir()
        files = {p.suffix for p in ckpt.rglob("*") if p.is_file()}
        assert files <= {".safetensors", ".json"}, ckpt
        assert nbresume.verify(ckpt).ok
    best = run.checkpoint_callback.best_k_models  # type: ignore[union-attr]
    assert {Path(p).name for p in best} == set(names) - {"last.ckpt"}

    resume = nbresume.lightning.last_checkpoint(run)
    assert resume == str(ckpts / "last.ckpt")
    assert nbresume.lightning.last_checkpoint(ckpts) == resume
    again = fit(tmp_path, epochs=3, ckpt_path=resume)
    assert again.global_step == 3 * run.global_step // 2
    # trainer.test / validate load a checkpoint through the same plugin.
    validated = again.validate(Net(), loaders()[1], ckpt_path="best", verbose=False)
    assert validated[0]["val_loss"] >= 0


def test_round_trip_keeps_every_value(tmp_path: Path) -> None:
    io = nbresume.lightning.CheckpointIO()
    checkpoint = {
        "epoch": 3,
        "global_step": 12,
        "state_dict": OrderedDict(w=torch.arange(6.0).reshape(2, 3), b=torch.zeros(2)),
        "optimizer_states": [{"state": {0: {"step": torch.tensor(4.0)}}, "param_groups": []}],
        "hyper_parameters": {"lr": 0.1, "betas": (0.9, 0.99), "name": "run", "none": None},
        "loops": {"nan": float("nan"), "inf": float("inf"), "raw": b"\x00\x01"},
    }
    io.save_checkpoint(checkpoint, tmp_path / "x.ckpt")
    loaded = io.load_checkpoint(tmp_path / "x.ckpt")
    assert torch.equal(loaded["state_dict"]["w"], checkpoint["state_dict"]["w"])
    assert loaded["optimizer_states"][0]["state"][0]["step"].item() == 4.0
    assert loaded["hyper_parameters"] == checkpoint["hyper_parameters"]
    assert loaded["loops"]["raw"] == b"\x00\x01"
    assert loaded["loops"]["inf"] == float("inf")
    assert loaded["loops"]["nan"] != loaded["loops"]["nan"]
    assert loaded["global_step"] == 12


def test_a_value_json_cannot_hold_is_refused_with_its_key(tmp_path: Path) -> None:
    io = nbresume.lightning.CheckpointIO()
    checkpoint = {"global_step": 1, "hyper_parameters": {"loss": nn.MSELoss()}}
    with pytest.raises(CheckpointError) as caught:
        io.save_checkpoint(checkpoint, tmp_path / "x.ckpt")
    message = str(caught.value)
    assert "checkpoint/hyper_parameters/loss" in message
    assert "never pickles" in message
    assert "str()" in message
    assert not any(tmp_path.iterdir())  # nothing written, nothing half-written


def test_a_pickled_ckpt_is_refused_never_loaded(tmp_path: Path) -> None:
    sentinel = tmp_path / "unpickled"
    path = tmp_path / "old.ckpt"
    path.write_bytes(pickle.dumps({"state_dict": Planted(sentinel)}))
    io = nbresume.lightning.CheckpointIO()
    with pytest.raises(CheckpointError, match="convert-lightning"):
        io.load_checkpoint(path)
    with pytest.raises(UsageError, match="convert-lightning"):
        io.save_checkpoint({"global_step": 1}, path)
    assert nbresume.lightning.last_checkpoint(tmp_path) is None
    assert not sentinel.exists()


# -- damage -----------------------------------------------------------------------------------


@pytest.mark.parametrize("damage", ["bit flip", "truncation", "planted pickle"])
def test_a_damaged_checkpoint_is_passed_over_with_a_warning(tmp_path: Path, damage: str) -> None:
    run = fit(tmp_path, epochs=2)
    ckpts = tmp_path / "ckpts"
    last = ckpts / "last.ckpt"
    tensors = newest_step_folder(last) / "tensors.safetensors"
    sentinel = tmp_path / "unpickled"
    data = bytearray(tensors.read_bytes())
    if damage == "bit flip":
        data[len(data) // 2] ^= 0x10
        tensors.write_bytes(bytes(data))
    elif damage == "truncation":
        tensors.write_bytes(bytes(data[: len(data) // 2]))
    else:
        tensors.write_bytes(pickle.dumps(Planted(sentinel)))
        (newest_step_folder(last) / "extra.pkl").write_bytes(pickle.dumps(Planted(sentinel)))

    others = [p for p in ckpts.iterdir() if p != last]
    chosen = nbresume.lightning.last_checkpoint(run)
    assert chosen is not None
    assert Path(chosen) in others

    io = nbresume.lightning.CheckpointIO()
    with pytest.warns(RuntimeWarning, match="last.ckpt") as caught:
        loaded = io.load_checkpoint(last)
    assert any("instead" in str(w.message) for w in caught)
    assert loaded["global_step"] <= run.global_step
    assert not sentinel.exists()


def test_remove_withdraws_the_whole_ckpt(tmp_path: Path) -> None:
    io = nbresume.lightning.CheckpointIO()
    io.save_checkpoint({"global_step": 1, "w": torch.ones(2)}, tmp_path / "a.ckpt")
    io.save_checkpoint({"global_step": 2, "w": torch.ones(2)}, tmp_path / "a.ckpt")
    # keep=1 (the older checkpoint's hidden folder may still be being removed in the background)
    kept = [p.name for p in (tmp_path / "a.ckpt").iterdir() if not p.name.startswith(".")]
    assert kept == ["000000000002"]
    io.remove_checkpoint(tmp_path / "a.ckpt")
    io.remove_checkpoint(tmp_path / "a.ckpt")  # ModelCheckpoint may ask twice after a resume
    assert list(tmp_path.iterdir()) == []


def test_import_nbresume_never_imports_lightning() -> None:
    code = "import sys, nbresume; assert 'lightning' not in sys.modules, 'imported'"
    # A new interpreter: what it imports is the question.
    subprocess.run([sys.executable, "-c", code], check=True)


def test_stop_request_saves_last_and_stops(tmp_path: Path) -> None:
    """The panel's "Stop and save" (any stop request): a verified last.ckpt at the next step
    boundary, then fit() returns."""

    class StopAt(L.Callback):
        def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
            if trainer.global_step == 3:
                watch.watch.request_stop("Stop and save")

    L.seed_everything(0, verbose=False)
    run = trainer(tmp_path, epochs=5)
    watch = next(c for c in run.callbacks if isinstance(c, nbresume.lightning.Callback))  # type: ignore[attr-defined]
    run.callbacks.insert(0, StopAt())  # type: ignore[attr-defined]
    train, val = loaders()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run.fit(Net(), train, val)
    assert run.global_step == 3  # saved and stopped at the boundary where it was asked
    last = tmp_path / "ckpts" / "last.ckpt"
    assert nbresume.verify(last).ok
    assert nbresume.CheckpointStore(last).latest().step == 3  # type: ignore[union-attr]


# -- moving a run over -------------------------------------------------------------------------


def test_convert_lightning_moves_a_pickled_run_over(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from nbresume.cli import main

    L.seed_everything(0, verbose=False)
    plain = quiet_trainer(
        max_epochs=1,
        callbacks=[ModelCheckpoint(dirpath=tmp_path / "old", save_last=True)],
    )
    train, val = loaders()
    plain.fit(Net(), train, val)
    assert (tmp_path / "old" / "last.ckpt").is_file()  # Lightning's own: one pickle

    assert (
        main(["convert-lightning", str(tmp_path / "old" / "last.ckpt"), str(tmp_path / "new")]) == 0
    )
    assert "weights_only=True" in capsys.readouterr().out
    resume = nbresume.lightning.last_checkpoint(tmp_path / "new")
    assert resume == str(tmp_path / "new" / "last.ckpt")
    again = fit(tmp_path / "new-run", epochs=2, ckpt_path=resume)
    assert again.global_step == 2 * plain.global_step


def test_convert_lightning_never_runs_a_planted_pickle(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from nbresume.cli import main

    sentinel = tmp_path / "unpickled"
    evil = tmp_path / "evil.ckpt"
    torch.save({"state_dict": Planted(sentinel)}, evil)
    assert main(["convert-lightning", str(evil), str(tmp_path / "new")]) == 1
    assert "weights_only=True" in capsys.readouterr().err
    assert not sentinel.exists()
    assert not (tmp_path / "new").exists()


def test_a_deadline_already_reached_saves_at_the_first_step_and_stops(tmp_path: Path) -> None:
    L.seed_everything(0, verbose=False)
    run = trainer(tmp_path, epochs=5)
    ours = next(c for c in run.callbacks if isinstance(c, nbresume.lightning.Callback))  # type: ignore[attr-defined]
    ours.deadline = 0.001  # the session ends a millisecond from now
    train, val = loaders()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run.fit(Net(), train, val)
    assert run.global_step == 1
    last = tmp_path / "ckpts" / "last.ckpt"
    assert nbresume.CheckpointStore(last).latest().step == 1  # type: ignore[union-attr]
    assert nbresume.lightning.last_checkpoint(run) == str(last)
