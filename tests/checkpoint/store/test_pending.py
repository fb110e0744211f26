"""The pending-checkpoint layer: ``store.begin(step)``, files in by every way there is, then a
verified commit, or a discard that leaves nothing a reader would take."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import fsspec
import pytest
import safetensors.torch
import torch

from nbresume import CheckpointError, CheckpointStore, NoCheckpointError
from nbresume.checkpoint.format import step_dirname
from nbresume.checkpoint.store import PendingCheckpoint
from nbresume.cli import main
from nbresume.errors import UsageError
from testkit import warmfork


def weights(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(16, 8, generator=gen), "b": torch.randn(8, generator=gen)}


def visible(folder: Path) -> list[str]:
    """What a reader lists there: entries not hidden by a leading dot."""
    return (
        sorted(p.name for p in folder.iterdir() if not p.name.startswith("."))
        if folder.exists()
        else []
    )


def test_every_way_of_adding_files_commits_a_checkpoint_that_verifies(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "ckpt")
    copied = tmp_path / "elsewhere.json"
    copied.write_text('{"copied": true}')
    with store.begin(7) as pending:
        pending.write_tensors("model", weights(0))
        pending.write_json("meta", {"epoch": 2, "names": ["a", "b"]})
        pending.add_file("copied.json", copied)
        assert pending.path is not None
        (pending.path / "written_in_place.json").write_text('{"in_place": 1}')
        adopted = pending.adopt()
        assert list(adopted) == ["written_in_place.json"]
        info = pending.commit(metrics={"loss": 0.5})

    assert info.step == 7
    assert info.metrics == {"loss": 0.5}
    assert set(info.manifest.files) == {
        "model.safetensors",
        "meta.json",
        "copied.json",
        "written_in_place.json",
    }
    assert [i.step for i in store.list()] == [7]
    report = store.verify()
    assert report.ok, report.results
    loaded = store.load()
    assert torch.equal(loaded.tensors["model"]["w"], weights(0)["w"])
    assert loaded.data == {
        "meta": {"epoch": 2, "names": ["a", "b"]},
        "copied": {"copied": True},
        "written_in_place": {"in_place": 1},
    }
    assert visible(tmp_path / "ckpt") == [step_dirname(7)]
    assert [p.name for p in (tmp_path / "ckpt").iterdir()] == [step_dirname(7)]  # no leftovers


def test_save_is_the_pending_layer_and_both_write_the_same_files(tmp_path: Path) -> None:
    saved = CheckpointStore(tmp_path / "a").save(3, tensors={"m": weights(1)}, data={"d": [1]})
    with CheckpointStore(tmp_path / "b").begin(3) as pending:
        pending.write_tensors("m", weights(1))
        pending.write_json("d", [1])
        committed = pending.commit()
    assert saved.manifest.files == committed.manifest.files


def test_a_discard_leaves_nothing_a_reader_takes(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "ckpt")
    pending = store.begin(4)
    pending.write_tensors("model", weights(2))
    pending.discard()
    assert store.list() == []
    assert list((tmp_path / "ckpt").iterdir()) == []
    with pytest.raises(NoCheckpointError):
        store.load()
    with pytest.raises(UsageError):
        pending.write_json("late", 1)


def fail_inside(pending: PendingCheckpoint) -> None:
    with pending:
        pending.write_json("second", 2)
        raise RuntimeError("boom")


def test_an_exception_in_a_with_block_discards(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "ckpt")
    store.save(1, data={"first": 1})
    with pytest.raises(RuntimeError, match="boom"):
        fail_inside(store.begin(2))
    with store.begin(3) as pending:
        pending.write_json("third", 3)  # a block left without a commit discards too
    assert [i.step for i in store.list()] == [1]
    assert visible(tmp_path / "ckpt") == [step_dirname(1)]
    assert [p.name for p in (tmp_path / "ckpt").iterdir()] == [step_dirname(1)]
    assert store.load().data == {"first": 1}


def test_names_outside_the_format_and_repeats_are_refused(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "ckpt")
    with store.begin(1) as pending:
        with pytest.raises(CheckpointError, match="cannot name"):
            pending.write_json("../escape", 1)
        source = tmp_path / "notes.txt"
        source.write_text("not a checkpoint file")
        with pytest.raises(CheckpointError, match="cannot name"):
            pending.add_file("notes.txt", source)
        pending.write_json("once", 1)
        with pytest.raises(UsageError, match="already"):
            pending.write_json("once", 2)
        with pytest.raises(CheckpointError, match="nothing to save"):
            CheckpointStore(tmp_path / "empty").begin(1).commit()
        pending.commit()
        with pytest.raises(UsageError, match="committed"):
            pending.commit()


def test_adopting_a_folder_a_library_wrote(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A library's own output, written with plain Python, safetensors and json.
    library = tmp_path / "ckpt" / "library-output"
    library.mkdir(parents=True)
    with open(library / "config.json", "w") as handle:
        handle.write('{"hidden_size": 8}')
    safetensors.torch.save_file(weights(3), str(library / "model.safetensors"))
    with open(library / "trainer_state.json", "w") as handle:
        json.dump({"global_step": 10, "log_history": [{"loss": 1.5}]}, handle)
    originals = {p.name: p.read_bytes() for p in library.iterdir()}

    store = CheckpointStore(tmp_path / "ckpt")
    with store.begin(10) as pending:
        adopted = pending.adopt(library)
        info = pending.commit()
    assert set(adopted) == set(originals)
    assert not library.exists()  # its files were taken in place, not copied
    folder = tmp_path / "ckpt" / step_dirname(10)
    assert {name: (folder / name).read_bytes() for name in originals} == originals
    assert set(info.manifest.files) == set(originals)

    assert main(["verify", str(tmp_path / "ckpt")]) == 0
    assert "OK 1/1" in capsys.readouterr().out
    assert torch.equal(
        safetensors.torch.load_file(folder / "model.safetensors")["w"], weights(3)["w"]
    )


def test_adopting_a_folder_with_a_file_outside_the_format_takes_nothing(tmp_path: Path) -> None:
    library = tmp_path / "out"
    library.mkdir()
    (library / "model.json").write_text("{}")
    (library / "optimizer.pt").write_bytes(b"pickle")
    store = CheckpointStore(tmp_path / "ckpt")
    with pytest.raises(CheckpointError, match="cannot name"), store.begin(1) as pending:
        pending.adopt(library)
    assert sorted(p.name for p in library.iterdir()) == ["model.json", "optimizer.pt"]
    assert store.list() == []


def test_a_folder_inside_the_pending_folder_is_refused(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "ckpt")
    pending = store.begin(1)
    assert pending.path is not None
    (pending.path / "nested").mkdir()
    with pytest.raises(UsageError, match="not a regular file"), pending:
        pending.adopt()
    assert list((tmp_path / "ckpt").iterdir()) == []


_CHILD = textwrap.dedent(
    """
    import sys, time
    import torch
    from nbresume import CheckpointStore

    store = CheckpointStore(sys.argv[1])
    pending = store.begin(9)
    pending.write_tensors("model", {"w": torch.zeros(1000, 100)})
    print("pending", flush=True)
    time.sleep(120)
    """
)


def test_a_kill_9_in_the_middle_of_a_pending_checkpoint_leaves_nothing_listed(
    tmp_path: Path,
) -> None:
    root = tmp_path / "ckpt"
    CheckpointStore(root).save(1, data={"before": 1})
    child = warmfork.popen(
        [sys.executable, "-c", _CHILD, str(root)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "pending"
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.wait(timeout=60)
    assert child.returncode == -signal.SIGKILL
    assert any(p.name.startswith(".") for p in root.iterdir())  # the partial folder is there

    store = CheckpointStore(root)
    assert [i.step for i in store.list()] == [1]
    assert store.verify().ok
    assert store.load().data == {"before": 1}
    store.save(2, data={"after": 2})  # the next writer cleans what the killed one left
    assert sorted(p.name for p in root.iterdir()) == [step_dirname(1), step_dirname(2)]


def test_commit_and_discard_on_an_object_store() -> None:
    store = CheckpointStore(f"memory://pending-{uuid.uuid4().hex}")
    with store.begin(5) as pending:
        assert pending.path is None
        pending.write_tensors("model", weights(4))
        pending.write_json("meta", {"ok": True})
        with fsspec.open(f"{pending.location}/extra.json", "wb") as handle:
            handle.write(b'{"by": "another library"}')
        assert list(pending.adopt()) == ["extra.json"]
        info = pending.commit()
    assert [i.step for i in store.list()] == [5]
    assert store.verify().ok
    assert info.location.startswith("memory://")
    assert store.load().data == {"meta": {"ok": True}, "extra": {"by": "another library"}}

    with store.begin(6) as pending:
        pending.write_json("meta", {"never": "committed"})
        pending.discard()
    assert [i.step for i in store.list()] == [5]
    assert store.load().step == 5
