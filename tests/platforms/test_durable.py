"""The durable folder check, init's folder choice, and the knobs that steer them."""

from __future__ import annotations

from pathlib import Path

import pytest

import nbresume
from nbresume.errors import PreflightError, UsageError


def test_a_folder_that_does_not_exist_yet_is_checked_where_it_will_be(tmp_path: Path) -> None:
    parent = tmp_path / "disk"
    parent.mkdir()
    check = nbresume.preflight(dir=parent / "a" / "b")["durable folder"]
    assert check.status == "ok"
    assert "(will be created)" in check.seen
    assert list(parent.iterdir()) == []  # the check created nothing and left no test file


def test_a_file_in_the_way_fails(tmp_path: Path) -> None:
    (tmp_path / "blocker").write_text("x")
    check = nbresume.preflight(dir=tmp_path / "blocker" / "ckpt")["durable folder"]
    assert check.status == "fail"
    assert "is a file, not a folder" in check.seen


def test_an_unwritable_folder_fails(tmp_path: Path) -> None:
    # A read-only bind mount is what a user meets; /proc is read-only for root too.
    check = nbresume.preflight(dir="/proc/nbresume-test")["durable folder"]
    assert check.status == "fail"
    assert "cannot write" in check.seen
    assert "NBRESUME_HOME" in check.fix


def test_object_store_urls_are_not_probed_but_memory_is_flagged() -> None:
    assert nbresume.preflight(dir="s3://bucket/runs/x")["durable folder"].status == "ok"
    check = nbresume.preflight(dir="memory://runs/x")["durable folder"]
    assert check.status == "warn"
    assert "memory only" in check.seen


def test_kubernetes_warns_when_checkpoints_are_not_on_a_volume(
    monkeypatch: pytest.MonkeyPatch, clean_platform: Path
) -> None:
    volume = clean_platform / "pvc"
    volume.mkdir()
    mountinfo = clean_platform / "mountinfo"
    mountinfo.write_text(
        "22 1 0:21 / / rw,relatime - overlay overlay rw,lowerdir=/a\n"
        f"40 22 8:17 / {volume} rw,relatime - ext4 /dev/sdb1 rw\n"
        "41 22 0:50 / /dev/shm rw - tmpfs shm rw\n"
    )
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    monkeypatch.setenv("NBRESUME_MOUNTINFO", str(mountinfo))

    monkeypatch.setenv("NBRESUME_HOME", str(clean_platform / "pod-fs"))
    check = nbresume.preflight()["durable folder"]
    assert check.status == "warn"
    assert "overlay at /" in check.seen
    assert "PersistentVolumeClaim" in check.fix

    monkeypatch.setenv("NBRESUME_HOME", str(volume / "nbresume"))
    assert nbresume.preflight()["durable folder"].status == "ok"


def test_slurm_warns_about_node_local_scratch(
    monkeypatch: pytest.MonkeyPatch, clean_platform: Path
) -> None:
    scratch = clean_platform / "job-tmp"
    scratch.mkdir()
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("TMPDIR", str(scratch))
    check = nbresume.preflight(dir=scratch / "ckpt")["durable folder"]
    assert check.status == "warn"
    assert "deleted when the job ends" in check.seen


def test_colab_warns_about_the_vms_own_disk(
    monkeypatch: pytest.MonkeyPatch, clean_platform: Path
) -> None:
    monkeypatch.setenv("COLAB_RELEASE_TAG", "release-colab_20250101-060000")
    check = nbresume.preflight(dir=clean_platform / "content" / "ckpt")["durable folder"]
    assert check.status == "warn"
    assert "wiped" in check.seen
    assert "Drive" in check.fix


def test_colab_is_recognised_by_its_marker_file(
    monkeypatch: pytest.MonkeyPatch, clean_platform: Path
) -> None:
    assert nbresume.preflight().platform == "local"
    (clean_platform / "var-colab-hostname").write_text("colab-vm\n")
    assert nbresume.preflight().platform == "colab"


def test_explicit_dir_wins_over_the_platform_default(
    monkeypatch: pytest.MonkeyPatch, clean_platform: Path, tmp_path: Path
) -> None:
    monkeypatch.setenv("KAGGLE_KERNEL_RUN_TYPE", "Interactive")
    (clean_platform / "kaggle" / "working").mkdir(parents=True)
    run = nbresume.init("x", dir="s3://bucket/runs/x", quiet=True)
    assert run.dir == "s3://bucket/runs/x"
    assert not (clean_platform / "kaggle" / "working" / "nbresume").exists()


def test_the_space_a_run_needs_is_checked_before_it_starts(tmp_path: Path) -> None:
    with pytest.raises(PreflightError, match="lower keep="):
        nbresume.init("x", dir=tmp_path, expected_bytes=10**18, strict=True, quiet=True)


@pytest.mark.parametrize("name", ["", ".", "..", ".hidden", "a/b", "a\\b"])
def test_run_names_that_cannot_name_a_folder_are_refused(name: str) -> None:
    with pytest.raises(UsageError, match="cannot name a run"):
        nbresume.init(name, quiet=True)


# -- knobs -------------------------------------------------------------------------------------


def test_platform_can_be_forced(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NBRESUME_PLATFORM", "kaggle-batch")
    assert nbresume.preflight(strict=False).platform == "kaggle-batch"
    monkeypatch.setenv("NBRESUME_PLATFORM", "paperspace")
    with pytest.raises(UsageError, match="kaggle-batch"):
        nbresume.preflight()


def test_strict_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NBRESUME_STRICT", "1")
    with pytest.raises(PreflightError, match="accelerator"):
        nbresume.preflight(accelerator="gpu")
    # The argument wins over the environment.
    assert not nbresume.preflight(accelerator="gpu", strict=False).ok


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("NBRESUME_PROBE_PORT", "https"),
        ("NBRESUME_PROBE_PORT", "70000"),
        ("NBRESUME_PROBE_TIMEOUT", "soon"),
        ("NBRESUME_STRICT", "maybe"),
        ("NBRESUME_SESSION_CAP", "forever"),
        ("NBRESUME_SESSION_START", "yesterday"),
    ],
)
def test_a_knob_that_cannot_be_used_names_itself(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str
) -> None:
    monkeypatch.setenv(variable, value)
    monkeypatch.setenv("KAGGLE_KERNEL_RUN_TYPE", "Interactive")  # a platform with a cap
    with pytest.raises(UsageError) as caught:
        nbresume.preflight()
    assert variable in str(caught.value)


def test_a_folder_that_cannot_even_be_examined_fails_with_a_fix(tmp_path: Path) -> None:
    # stat() raising something other than "not found" (here: a name too long; on Colab, a
    # Drive mount whose daemon died) must become a failed check, not a crash.
    check = nbresume.preflight(dir=tmp_path / ("x" * 300) / "ckpt")["durable folder"]
    assert check.status == "fail"
    assert "cannot be examined" in check.seen
    assert "remount" in check.fix
