"""One file system operation of a save fails (a full disk, a failing mount), in a real
LocalStore in a child process: the failure is reported in nbresume's words, nothing
half-written stays behind, and what was saved before is intact.

The faults are injected at the edge of the world only: Python's audit hooks make one
operation (mkdir, open, rename) raise ENOSPC, and ``os.fsync`` fails on folders.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from .killing import check_folder, hidden_leftovers, run_to_end, step_folders

KEEP = 2

FAILS_THE_SAVE = {
    "creating the temporary folder": "os.mkdir:.nbresume-tmp-",
    "creating a payload file": "open:optimizer.safetensors",
    "creating the manifest": "open:manifest.json",
    "renaming the folder into place": "os.rename:0",
    "moving the replaced copy aside": "os.rename:.nbresume-old-replaced-",
}


@pytest.mark.parametrize("where", list(FAILS_THE_SAVE))
def test_a_full_disk_at_any_operation_fails_the_save_cleanly(tmp_path: Path, where: str) -> None:
    root = tmp_path / "run"
    primed = run_to_end(root, KEEP, "--saves", "3", workdir=tmp_path)
    reported = set(primed.saved)
    resave = where == "moving the replaced copy aside"
    options = ["--saves", "1", "--fail", FAILS_THE_SAVE[where]] + (["--resave"] if resave else [])
    failed = run_to_end(root, KEEP, *options, workdir=tmp_path)
    assert failed.error.startswith("StorageFullError"), failed.error or failed.saved
    assert "needs" in failed.error
    assert failed.saved == []
    assert hidden_leftovers(root) == set()
    assert step_folders(root) == [2, 3]
    # The reader sees the last two saves, whole; the next writer carries on from them.
    assert check_folder(root, KEEP, reported, 4, where) == 3
    after = run_to_end(root, KEEP, "--saves", "1", workdir=tmp_path)
    assert after.resumed == 3
    assert after.saved == [4]
    assert step_folders(root) == [3, 4]


def test_retention_that_cannot_delete_does_not_fail_a_verified_save(tmp_path: Path) -> None:
    """The new checkpoint is saved and verified; the old one that could not be removed stays,
    with a warning, and the next save's retention removes it."""
    root = tmp_path / "run"
    run_to_end(root, KEEP, "--saves", "2", workdir=tmp_path)
    stuck = run_to_end(
        root, KEEP, "--saves", "2", "--fail", "os.rename:.nbresume-old-deleting-", workdir=tmp_path
    )
    assert stuck.error == ""
    assert stuck.saved == [3, 4]
    assert stuck.warnings
    assert "retention" in stuck.warnings[0]
    assert step_folders(root) == [1, 2, 3, 4]
    check_folder(root, KEEP, {1, 2, 3, 4}, 4, "retention failing")
    after = run_to_end(root, KEEP, "--saves", "1", workdir=tmp_path)
    assert after.saved == [5]
    assert step_folders(root) == [4, 5]
    assert hidden_leftovers(root) == set()


def test_folder_fsync_refused_by_the_file_system_is_not_an_error(tmp_path: Path) -> None:
    """Some FUSE mounts refuse fsync on a folder (EINVAL): the files themselves were synced
    and read back, so the save stands."""
    root = tmp_path / "run"
    run = run_to_end(root, KEEP, "--saves", "3", "--fail-dir-fsync", "EINVAL", workdir=tmp_path)
    assert run.error == ""
    assert run.saved == [1, 2, 3]
    check_folder(root, KEEP, {1, 2, 3}, 3, "EINVAL on folder fsync")


@pytest.mark.parametrize("which", ["temporary", "parent"])
def test_folder_fsync_io_error_is_never_reported_as_saved(tmp_path: Path, which: str) -> None:
    """EIO from fsync means the rename may not survive a crash: the save must not claim
    success. Whatever it leaves is whole (after the rename into place, the new checkpoint is
    there but unconfirmed, as after a kill), and the next save works."""
    root = tmp_path / "run"
    run_to_end(root, KEEP, "--saves", "2", workdir=tmp_path)
    options = ["--saves", "1", "--fail-dir-fsync", "EIO"]
    options += ["--only-root"] if which == "parent" else []
    failed = run_to_end(root, KEEP, *options, workdir=tmp_path)
    assert failed.saved == []
    assert failed.error.startswith("StorageError"), failed.error
    assert "Input/output error" in failed.error
    assert hidden_leftovers(root) == set()
    resume = check_folder(root, KEEP, {1, 2}, 3, f"EIO on fsync of the {which} folder")
    assert resume == (3 if which == "parent" else 2)
    after = run_to_end(root, KEEP, "--saves", "1", workdir=tmp_path)
    assert after.resumed == resume
    assert after.saved == [resume + 1]
    assert step_folders(root)[-1] == resume + 1
