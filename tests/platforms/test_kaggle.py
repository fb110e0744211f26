"""Kaggle: a batch run stops in its first cell when the machine is not what it needs; an
interactive session warns and carries on; a new version continues from the previous
version's output attached as an input."""

from __future__ import annotations

import hashlib
import warnings
from pathlib import Path

import pytest

import nbresume
from nbresume.checkpoint.store import CheckpointStore
from nbresume.errors import PreflightError

NAME = "resnet-cifar"


@pytest.fixture
def kaggle(monkeypatch: pytest.MonkeyPatch, clean_platform: Path) -> Path:
    """A Kaggle machine: /kaggle/working and /kaggle/input, no GPU usable, session just begun."""
    root = clean_platform / "kaggle"
    (root / "working").mkdir(parents=True)
    (root / "input").mkdir()
    return root


@pytest.fixture
def batch(monkeypatch: pytest.MonkeyPatch, kaggle: Path) -> Path:
    monkeypatch.setenv("KAGGLE_KERNEL_RUN_TYPE", "Batch")
    return kaggle


@pytest.fixture
def interactive(monkeypatch: pytest.MonkeyPatch, kaggle: Path) -> Path:
    monkeypatch.setenv("KAGGLE_KERNEL_RUN_TYPE", "Interactive")
    return kaggle


# -- the first cell ------------------------------------------------------------------------


def test_batch_run_without_a_gpu_stops_in_the_first_cell_with_the_fix(batch: Path) -> None:
    with pytest.raises(PreflightError) as caught:
        nbresume.init(NAME, accelerator="gpu", quiet=True)
    message = str(caught.value)
    assert "accelerator" in message
    assert "Settings → Accelerator → GPU T4 x2" in message
    assert "nbresume commit --accelerator t4x2" in message
    # It stopped before preparing anything.
    assert not (batch / "working" / "nbresume" / NAME).exists()


def test_batch_run_without_internet_stops_with_the_phone_verification_fix(batch: Path) -> None:
    # The probe points at a closed loopback port: internet is off.
    with pytest.raises(PreflightError) as caught:
        nbresume.init(NAME, internet=True, quiet=True)
    message = str(caught.value)
    assert "internet" in message
    assert "Settings → Internet" in message
    assert "phone" in message.lower()


def test_batch_run_names_every_failed_check(batch: Path) -> None:
    with pytest.raises(PreflightError) as caught:
        nbresume.init(NAME, accelerator="gpu", internet=True, quiet=True)
    report = caught.value.report
    assert isinstance(report, nbresume.Report)
    assert {c.name for c in report.failures} == {"accelerator", "internet"}
    assert "Settings → Accelerator" in str(caught.value)
    assert "Settings → Internet" in str(caught.value)


def test_batch_run_that_meets_its_expectations_goes_on(batch: Path, internet_on: object) -> None:
    run = nbresume.init(NAME, accelerator="cpu", internet=True, quiet=True)
    assert run.report.ok
    assert run.report["internet"].status == "ok"
    assert Path(run.dir) == batch / "working" / "nbresume" / NAME
    assert Path(run.dir).is_dir()


def test_interactive_session_warns_and_carries_on(
    interactive: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.warns(RuntimeWarning, match="accelerator") as caught:
        run = nbresume.init(NAME, accelerator="gpu")
    assert any("Settings → Accelerator" in str(w.message) for w in caught)
    assert run.platform.name == "kaggle"
    assert run.report["accelerator"].status == "fail"
    assert Path(run.dir).is_dir()
    printed = capsys.readouterr().out
    assert "FAIL accelerator" in printed
    assert "Settings → Accelerator" in printed


def test_strict_can_be_switched_off_for_a_batch_run(
    batch: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NBRESUME_STRICT", "0")
    with pytest.warns(RuntimeWarning, match="accelerator"):
        run = nbresume.init(NAME, accelerator="gpu", quiet=True)
    assert not run.report.ok


def test_quiet_prints_nothing(interactive: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing fails: no warning either
        nbresume.init(NAME, quiet=True)
    assert capsys.readouterr().out == ""


# -- continuing from the previous version's output -----------------------------------------


def _save(folder: Path, step: int) -> None:
    """Save a checkpoint as an earlier version of the notebook did."""
    ckpt = nbresume.Checkpointer(folder, every=None, keep=None, deadline=None, async_save=False)
    ckpt["progress"] = {"step": step}
    ckpt.save(step=step)
    ckpt.close()


def _corrupt(folder: Path, step: int) -> None:
    """Flip the last byte of one of the checkpoint's files (not its manifest)."""
    victim = next(
        p for p in sorted((folder / f"{step:012d}").iterdir()) if p.name != "manifest.json"
    )
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))


def _tree_digest(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@pytest.fixture
def previous_outputs(kaggle: Path) -> Path:
    """Two earlier versions' outputs attached as inputs, in the old and the new layout: steps
    100 and 300 (300 corrupt) in one, step 200 in the other."""
    old_layout = kaggle / "input" / "resnet-prev" / "nbresume" / NAME
    new_layout = kaggle / "input" / "notebooks" / "someone" / "resnet-v2" / "nbresume" / NAME
    _save(old_layout, 100)
    _save(old_layout, 300)
    _corrupt(old_layout, 300)
    _save(new_layout, 200)
    # An unrelated run's checkpoints and a dataset are attached too.
    _save(kaggle / "input" / "resnet-prev" / "nbresume" / "other-run", 900)
    (kaggle / "input" / "cifar10" / "train").mkdir(parents=True)
    (kaggle / "input" / "cifar10" / "train" / "0001.png").write_bytes(b"\x89PNG")
    return kaggle / "input"


def test_newest_verified_checkpoint_of_the_inputs_is_copied_in(
    interactive: Path, previous_outputs: Path
) -> None:
    before = _tree_digest(previous_outputs)
    run = nbresume.init(NAME, quiet=True)

    assert run.seeded is not None
    assert run.seeded.step == 200
    working = CheckpointStore(run.dir, keep=None)
    assert [i.step for i in working.list()] == [200]
    assert working.verify().ok
    assert "step 200" in run.summary()
    # The inputs are read-only on Kaggle: nothing there was touched.
    assert _tree_digest(previous_outputs) == before

    ckpt = run.checkpointer(every=None, async_save=False)
    ckpt["progress"] = {"step": 0}
    assert ckpt.restore() == 200
    assert ckpt["progress"] == {"step": 200}
    ckpt.close()


def test_a_newer_checkpoint_already_in_working_is_kept(
    interactive: Path, previous_outputs: Path
) -> None:
    _save(interactive / "working" / "nbresume" / NAME, 400)
    run = nbresume.init(NAME, quiet=True)
    assert run.seeded is None
    assert [i.step for i in CheckpointStore(run.dir, keep=None).list()] == [400]


def test_inputs_with_no_verified_checkpoint_seed_nothing(interactive: Path) -> None:
    folder = interactive / "input" / "resnet-prev" / "nbresume" / NAME
    _save(folder, 100)
    _corrupt(folder, 100)
    run = nbresume.init(NAME, quiet=True)
    assert run.seeded is None
    assert CheckpointStore(run.dir, keep=None).list() == []


def test_batch_run_continues_from_its_inputs_too(batch: Path, previous_outputs: Path) -> None:
    run = nbresume.init(NAME, quiet=True)
    assert run.seeded is not None
    assert run.seeded.step == 200


def test_a_folder_outside_working_is_flagged(interactive: Path) -> None:
    scratch = interactive / "temp" / "ckpt"
    run = nbresume.init(NAME, dir=scratch, quiet=True)
    check = run.report["durable folder"]
    assert check.status == "warn"
    assert "/kaggle/working" in check.seen or str(interactive / "working") in check.seen
    assert Path(run.dir) == scratch
