"""``nbresume push DIR --kaggle-dataset owner/slug``: a run's checkpoint moves onto Kaggle
verified, in the layout a Kaggle notebook's ``nbresume.init`` finds; a checkpoint that does not
verify is never uploaded."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest

import nbresume as nbresume_api
from nbresume.checkpoint.store import CheckpointStore
from nbresume.cli import main
from nbresume.errors import UsageError
from nbresume.kaggle.push import push
from nbresume.platforms.kaggle import seed_from_inputs
from testkit.fake_kaggle import FakeKaggle, _unpack_into
from testkit.stateful import Weights

from .conftest import nbresume, user_env


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


# -- the newest checkpoint, never an older one in its place ----------------------------------


def uploaded_steps(server: FakeKaggle, dataset: str, tmp_path: Path) -> list[int]:
    """The steps of the run's checkpoints in the newest version of ``dataset``."""
    owner, slug = dataset.split("/")
    files = server.datasets[(owner, slug)].versions[-1]
    unpacked = tmp_path / "unpacked"
    shutil.rmtree(unpacked, ignore_errors=True)
    unpacked.mkdir()
    for name, data in files.items():
        _unpack_into(unpacked, name, data)
    return [i.step for i in CheckpointStore(unpacked / "nbresume" / "run", keep=None).list()]


def test_a_damaged_newest_checkpoint_is_never_replaced_by_an_older_one_silently(
    tmp_path: Path, kaggle_server: FakeKaggle
) -> None:
    run = tmp_path / "run"
    saved_run(run, steps=(10, 20))
    (run / "000000000020" / "manifest.json").write_text('{"format": "nbresume", "files": {')
    dataset = f"{kaggle_server.username}/run-ckpt"
    env = user_env(tmp_path, kaggle_server)

    refused = nbresume(["push", str(run), "--kaggle-dataset", dataset], cwd=tmp_path, env=env)
    assert refused.code == 1, refused.text
    assert "checkpoint 20 (000000000020) does not verify" in refused.err
    assert "nothing was uploaded" in refused.err
    assert "the newest checkpoint that verifies, step 10: pass --step 10" in refused.err
    assert "OK    000000000010" not in refused.out
    assert ("nbresume-tester", "run-ckpt") not in kaggle_server.datasets

    # Asked for explicitly, the older one is pushed, and the newer one passed over is named.
    chosen = ["push", str(run), "--kaggle-dataset", dataset, "--step", "10"]
    pushed = nbresume(chosen, cwd=tmp_path, env=env)
    assert pushed.code == 0, pushed.text
    assert "passed over the newer checkpoint 20 (000000000020)" in pushed.out
    assert "pushing step 10 as --step asks" in pushed.out
    assert uploaded_steps(kaggle_server, dataset, tmp_path) == [10]


def test_a_step_asked_for_that_does_not_verify_names_the_one_that_does(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    run = tmp_path / "run"
    saved_run(run, steps=(10, 20, 30))
    (run / "000000000020" / "manifest.json").write_bytes(b"\xff\xfe not a manifest")
    monkeypatch.setenv("KAGGLE_CONFIG_DIR", str(tmp_path / "no-credentials"))
    assert main(["push", str(run), "--kaggle-dataset", "you/run-ckpt", "--step", "20"]) == 1
    err = capsys.readouterr().err
    assert "checkpoint 20 (000000000020) does not verify" in err
    assert "the newest checkpoint that verifies, step 30: pass --step 30" in err
    assert "credentials" not in err


# -- the run's name stays inside the staging folder ------------------------------------------


def test_a_name_that_leaves_the_staging_folder_is_refused_and_nothing_is_written_or_uploaded(
    tmp_path: Path, kaggle_server: FakeKaggle
) -> None:
    run = tmp_path / "run"
    saved_run(run)
    dataset = f"{kaggle_server.username}/run-ckpt"
    env = user_env(tmp_path, kaggle_server)
    result = nbresume(
        ["push", str(run), "--kaggle-dataset", dataset, "--name", "../.."], cwd=tmp_path, env=env
    )
    assert result.code == 2, result.text
    assert "--name '../..' cannot name the run's folder" in result.err
    assert "one folder name" in result.err
    assert "OK:" not in result.out
    assert ("nbresume-tester", "run-ckpt") not in kaggle_server.datasets
    assert list((tmp_path / "tmp").iterdir()) == []  # nothing staged, nothing left outside


@pytest.mark.parametrize(
    "name", ["", ".", "..", "/", "/etc", "a/b", "a\\b", "../run", ".hidden", "run\nname", "x\0y"]
)
def test_every_name_that_is_not_one_plain_folder_name_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str
) -> None:
    run = tmp_path / "run"
    saved_run(run)
    with pytest.raises(SystemExit) as usage:
        main(["push", str(run), "--kaggle-dataset", "you/run-ckpt", "--name", name])
    assert usage.value.code == 2
    err = capsys.readouterr().err
    assert "cannot name the run's folder" in err
    assert "nbresume.init" in err  # the fix: the name the notebook passes to nbresume.init
    with pytest.raises(UsageError, match="cannot name the run's folder"):
        push(str(run), "you/run-ckpt", name=name, out=lambda line: None)


# -- what is uploaded: no credentials, no file beyond its manifest's size ---------------------


#: A token of the shape of a Hugging Face one (made up, mixed case as real ones are).
FAKE_TOKEN = "hf_" + "AbCdEfGhIjKlMnOpQrStUvWxYz0123456789"


def test_a_credential_saved_in_the_checkpoint_is_found_and_never_uploaded_or_shown(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    run = tmp_path / "run"
    ckpt = nbresume_api.Checkpointer(
        run, every=None, async_save=False, quiet=True, weights=Weights(4, np.float32)
    )
    ckpt["config"] = {"lr": 0.1, "hub_token": FAKE_TOKEN}
    for _ in ckpt.steps(3):
        pass
    ckpt.close()
    monkeypatch.setenv("KAGGLE_CONFIG_DIR", str(tmp_path / "no-credentials"))
    assert main(["push", str(run), "--kaggle-dataset", "you/run-ckpt"]) == 1
    out, err = capsys.readouterr()
    assert "checkpoint 3 holds a credential; nothing was uploaded" in err
    assert "state.json: a Hugging Face token (hf_...)" in err
    assert "revoke" in err
    assert "credentials" not in err  # refused before Kaggle was asked anything
    assert FAKE_TOKEN not in out + err
    assert FAKE_TOKEN[3:20] not in out + err


def test_a_secret_in_a_document_saved_with_the_checkpoint_is_found_too(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    run = tmp_path / "run"
    store = CheckpointStore(run, keep=None)
    key = "0123456789abcdef0123456789abcdef01234567"
    store.save(
        5,
        tensors={"model": {"w": np.zeros(8, np.float32)}},
        data={"notes": {"WANDB_API_KEY": key, "padding": "x" * (3 << 20)}},
    )
    monkeypatch.setenv("KAGGLE_CONFIG_DIR", str(tmp_path / "no-credentials"))
    assert main(["push", str(run), "--kaggle-dataset", "you/run-ckpt"]) == 1
    out, err = capsys.readouterr()
    assert "notes.json: a Weights & Biases API key" in err
    assert key not in out + err


def _bytes_read() -> int:
    """Bytes this process has read through read() and its kind, from /proc/self/io."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar in /proc/self/io")


@pytest.mark.skipif(not Path("/proc/self/io").exists(), reason="needs Linux's /proc/self/io")
def test_a_file_larger_than_its_manifest_entry_is_refused_before_it_is_copied(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    run = tmp_path / "run"
    saved_run(run, steps=(4,))
    grown = run / "000000000004" / "model.safetensors"
    with open(grown, "r+b") as handle:  # 256 MiB more, sparse: costs no disk
        handle.truncate(grown.stat().st_size + (256 << 20))
    monkeypatch.setenv("KAGGLE_CONFIG_DIR", str(tmp_path / "no-credentials"))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where staging would copy it
    before = _bytes_read()
    assert main(["push", str(run), "--kaggle-dataset", "you/run-ckpt"]) == 1
    read = _bytes_read() - before
    err = capsys.readouterr().err
    assert "model.safetensors" in err
    assert "larger than the manifest records" in err
    assert "nothing was uploaded" in err
    assert read < 32 << 20, f"{read} bytes were read to refuse it"
    assert not list(tmp_path.glob("nbresume-push-*"))  # the staging folder is gone
