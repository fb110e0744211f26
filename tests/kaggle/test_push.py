"""``nbresume push DIR --kaggle-dataset owner/slug``: a run's checkpoint moves onto Kaggle
verified, in the layout a Kaggle notebook's ``nbresume.init`` finds; a checkpoint that does not
verify is never uploaded."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from nbresume.checkpoint.store import CheckpointStore
from nbresume.cli import main
from nbresume.platforms.kaggle import seed_from_inputs

from .conftest import nbresume, user_env
from .fake_kaggle import FakeKaggle, _unpack_into


def saved_run(folder: Path, steps: tuple[int, ...] = (4, 8)) -> None:
    store = CheckpointStore(folder, keep=None)
    for step in steps:
        store.save(step, tensors={"model": {"w": np.full(256, step, np.float32)}})


def test_the_newest_checkpoint_lands_where_a_kaggle_notebook_continues_from_it(
    tmp_path: Path, kaggle_server: FakeKaggle
) -> None:
    run = tmp_path / "drive" / "nbresume" / "hop-demo"
    saved_run(run)
    dataset = f"{kaggle_server.username}/hop-demo-ckpt"
    env = user_env(tmp_path, kaggle_server)
    for attempt in (1, 2):  # the first push makes the dataset, the next a new version
        result = nbresume(["push", str(run), "--kaggle-dataset", dataset], cwd=tmp_path, env=env)
        assert result.code == 0, result.text
        assert "  OK    000000000008" in result.out
        assert "verified, staged as nbresume/hop-demo/000000000008" in result.out
        assert 'nbresume.init("hop-demo") there continues from step 8' in result.out
        assert len(kaggle_server.datasets[tuple(dataset.split("/"))].versions) == attempt  # type: ignore[index]

    # The dataset as a notebook sees it under /kaggle/input: nbresume.init's search finds it.
    [files] = kaggle_server.datasets[tuple(dataset.split("/"))].versions[-1:]  # type: ignore[index]
    assert sorted(files) == ["nbresume.tar"]
    inputs = tmp_path / "kaggle" / "input" / "hop-demo-ckpt"
    inputs.mkdir(parents=True)
    for name, data in files.items():
        _unpack_into(inputs, name, data)
    working = tmp_path / "kaggle" / "working" / "nbresume" / "hop-demo"
    working.mkdir(parents=True)
    seeded = seed_from_inputs("hop-demo", working, tmp_path / "kaggle" / "input")
    assert seeded is not None
    assert seeded.step == 8
    assert [i.step for i in CheckpointStore(working, keep=None).list()] == [8]


def test_a_checkpoint_that_does_not_verify_is_not_uploaded(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    run = tmp_path / "hop-demo"
    saved_run(run)
    target = run / "000000000008" / "model.safetensors"
    data = bytearray(target.read_bytes())
    data[-1] ^= 0x01
    target.write_bytes(bytes(data))
    monkeypatch.setenv("KAGGLE_CONFIG_DIR", str(tmp_path / "no-credentials"))
    assert main(["push", str(run), "--kaggle-dataset", "you/hop-demo-ckpt"]) == 1
    err = capsys.readouterr().err
    assert "checkpoint 8 (000000000008) does not verify" in err
    assert "nothing was uploaded" in err
    assert f"run `nbresume verify {run}`" in err
    assert "pass --step 4" in err
    assert "credentials" not in err  # refused before Kaggle was asked anything


def test_a_folder_without_checkpoints_or_a_step_it_lacks_is_refused_with_the_fix(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["push", str(empty), "--kaggle-dataset", "you/some-ckpt"]) == 1
    assert "no committed checkpoint in" in capsys.readouterr().err
    run = tmp_path / "hop-demo"
    saved_run(run)
    assert main(["push", str(run), "--kaggle-dataset", "you/some-ckpt", "--step", "5"]) == 1
    assert "give one of the steps it holds (4, 8)" in capsys.readouterr().err
    with pytest.raises(SystemExit) as usage:
        main(["push", str(run), "--kaggle-dataset", "not-a-dataset"])
    assert usage.value.code == 2
    assert "does not name a Kaggle dataset" in capsys.readouterr().err
