"""The ``nbresume`` command: ls, verify, prune, and the usual conventions (``--help`` on every
command, exit 2 for a usage error, 1 for a failure, errors on stderr without a traceback)."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
import torch

from nbresume import CheckpointStore
from nbresume.checkpoint.format import step_dirname
from nbresume.cli import build_parser
from testkit.cli import run_cli as run
from testkit.supervisor import RecordedJob


def commands() -> list[str]:
    parser = build_parser()
    [sub] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return sorted(sub.choices)


@pytest.fixture
def three(ckpt_dir: Path) -> Path:
    """A folder with the checkpoints of steps 100, 200, 300."""
    store = CheckpointStore(ckpt_dir, keep=None)
    for step, loss in ((100, 0.5), (200, 0.25), (300, 0.75)):
        store.save(
            step,
            tensors={"model": {"w": torch.full((16,), float(step))}},
            data={"state": {"step": step}},
            metrics={"val_loss": loss},
        )
    return ckpt_dir


def corrupt(folder: Path, step: int) -> None:
    path = folder / step_dirname(step) / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


# -- conventions -------------------------------------------------------------------------------


def test_the_expected_commands_exist() -> None:
    assert {"ls", "verify", "prune", "demo"} <= set(commands())


@pytest.mark.parametrize("command", [[], *([c] for c in commands())], ids=" ".join)
def test_help_on_every_command_exits_zero(
    command: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = run([*command, "--help"], capsys)
    assert code == 0
    assert out.startswith(f"usage: nbresume {' '.join(command)}".rstrip())


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    from nbresume import __version__

    code, out, _ = run(["--version"], capsys)
    assert (code, out.strip()) == (0, f"nbresume {__version__}")


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["no-such-command"],
        ["ls"],
        ["verify"],
        ["prune", "DIR"],
        ["prune", "DIR", "--keep", "0"],
        ["prune", "DIR", "--keep", "two"],
        ["prune", "DIR", "--keep", "1", "--best", "val_loss:median"],
        ["ls", "DIR", "--no-such-option"],
    ],
    ids=lambda argv: " ".join(argv) or "(nothing)",
)
def test_a_usage_error_exits_two(
    argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [str(tmp_path) if a == "DIR" else a for a in argv]
    code, out, err = run(argv, capsys)
    assert code == 2
    assert "usage: nbresume" in err
    assert out == ""


# -- ls ----------------------------------------------------------------------------------------


def test_ls_lists_committed_checkpoints(three: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (three / ".nbresume-tmp-000000000400-1-ab").mkdir()  # an interrupted write: not listed
    code, out, _ = run(["ls", str(three)], capsys)
    assert code == 0
    header, *rows, footer = out.splitlines()
    assert header.split()[:2] == ["step", "size"]
    assert [int(row.split()[0]) for row in rows] == [100, 200, 300]
    assert "val_loss=0.25" in rows[1]
    assert footer.startswith("3 checkpoint(s)")


def test_ls_of_an_empty_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(["ls", str(tmp_path)], capsys)
    assert code == 0
    assert "no committed checkpoints" in out


# -- verify ------------------------------------------------------------------------------------


def test_verify_prints_one_line_per_checkpoint_and_a_summary(
    three: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run(["verify", str(three)], capsys)
    assert code == 0
    lines = out.splitlines()
    assert len(lines) == 4
    for line, step in zip(lines, (100, 200, 300), strict=False):
        assert line.startswith("OK")
        assert step_dirname(step) in line
    assert lines[-1] == "OK 3/3, errors 0"
    assert err == ""


def test_verify_fails_on_any_bad_checkpoint_naming_the_file(
    three: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    corrupt(three, 200)
    code, out, _ = run(["verify", str(three)], capsys)
    assert code == 1
    lines = out.splitlines()
    assert len(lines) == 4
    [failed] = [line for line in lines if line.startswith("FAIL")]
    assert step_dirname(200) in failed
    assert "model.safetensors" in failed
    assert lines[-1] == "OK 2/3, errors 1"


def test_verify_with_nothing_to_verify_fails(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = run(["verify", str(tmp_path)], capsys)
    assert code == 1
    assert "nothing verified" in out


def test_verify_of_a_missing_folder_is_an_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run(["verify", str(tmp_path / "missing")], capsys)
    assert (code, out) == (1, "")
    assert err.startswith(f"nbresume verify: error: {tmp_path / 'missing'}: no such folder.")


# -- prune -------------------------------------------------------------------------------------


def test_prune_keeps_the_newest(three: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(["prune", str(three), "--keep", "1"], capsys)
    assert code == 0
    assert sorted(os.listdir(three)) == [step_dirname(300)]
    assert "deleted 2" in out


def test_prune_keeps_the_best_too(three: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, _ = run(["prune", str(three), "--keep", "1", "--best", "val_loss:min"], capsys)
    assert code == 0
    assert sorted(os.listdir(three)) == [step_dirname(200), step_dirname(300)]


def test_prune_does_not_count_a_corrupt_newest_as_kept(
    three: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    corrupt(three, 300)
    code, _, _ = run(["prune", str(three), "--keep", "1"], capsys)
    assert code == 0
    # 200 is the newest good one; 300 is left for inspection; only 100 goes.
    assert sorted(os.listdir(three)) == [step_dirname(200), step_dirname(300)]


# -- status: the last verified checkpoint -------------------------------------------------------


def forge_history(folder: Path, forge: Callable[..., Path], minutes_ago: list[int]) -> None:
    """Checkpoints of steps 100, 200, ... written that many minutes ago (oldest first)."""
    now = datetime.now(timezone.utc)
    for index, minutes in enumerate(minutes_ago):
        step = 100 * (index + 1)
        step_folder = folder / step_dirname(step)
        step_folder.mkdir(parents=True)
        (step_folder / "state.json").write_text(f'{{"step": {step}}}')
        created = (now - timedelta(minutes=minutes)).isoformat(timespec="seconds")
        forge(step_folder, created=created)


def test_status_shows_the_last_verified_checkpoint(
    three: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = run(["status", str(three)], capsys)
    assert code == 0, out
    [line] = [line for line in out.splitlines() if line.startswith("last verified checkpoint")]
    assert re.fullmatch(r"last verified checkpoint: step 300, (just now|\d+ s ago)", line), line
    assert "WARNING" not in out
    assert "note:" not in out


def test_status_names_the_newest_checkpoint_that_verifies(
    three: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    corrupt(three, 300)
    code, out, _ = run(["status", str(three)], capsys)
    assert code == 1  # the newest does not verify
    assert "last verified checkpoint: step 200, " in out


def test_status_notes_a_folder_that_stopped_getting_checkpoints(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], forge_manifest: Callable[..., Path]
) -> None:
    # Every 10 minutes until 2 h 40 min ago, and no run record: the training may have ended.
    forge_history(tmp_path / "ckpt", forge_manifest, [180, 170, 160])
    code, out, _ = run(["status", str(tmp_path / "ckpt")], capsys)
    assert code == 0, out
    assert "last verified checkpoint: step 300, 2 h 40 min ago" in out
    assert (
        "note: no verified checkpoint for 2 h 40 min, more than twice the usual 10 min between "
        "two: if the training still runs, it is not saving"
    ) in out


def test_status_warns_when_a_running_job_has_not_saved_for_twice_the_usual_time(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], forge_manifest: Callable[..., Path]
) -> None:
    # Every 10 minutes until 25 minutes ago, while the job (a `sleep` here, recorded as
    # `nbresume run` records a job) still runs: more than twice 10 minutes.
    ckpt = tmp_path / "ckpt"
    forge_history(ckpt, forge_manifest, [55, 45, 35, 25])
    with RecordedJob(ckpt, tmp_path, started=time.time() - 3600):
        code, out, _ = run(["status", str(ckpt)], capsys)
    assert code == 0, out
    assert "last verified checkpoint: step 400, 25 min ago" in out
    assert (
        "WARNING: no verified checkpoint for 25 min, more than twice the usual 10 min between "
        "two: a crash now loses all that training"
    ) in out


# -- errors ------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["ls", "verify", "prune"])
def test_an_error_is_one_message_on_stderr(
    tmp_path: Path, command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    not_a_folder = tmp_path / "weights.pt"
    not_a_folder.write_bytes(b"not a folder")
    extra = ["--keep", "1"] if command == "prune" else []
    code, out, err = run([command, str(not_a_folder), *extra], capsys)
    assert code == 1
    assert out == ""
    assert err.startswith(f"nbresume {command}: error: ")
    assert str(not_a_folder) in err
    assert "Fix:" in err
    assert "Traceback" not in err


# -- the installed command, in a real process --------------------------------------------------
# The suite's one test of the console script that pip installs (its entry point, its exit
# statuses): a new process from the script itself, never a fork of the warm server.


def console_script() -> list[str]:
    script = Path(sys.executable).parent / "nbresume"
    return [str(script)] if script.exists() else [sys.executable, "-m", "nbresume.cli"]


def test_the_installed_command(three: Path, tmp_path: Path) -> None:
    ok = subprocess.run(
        [*console_script(), "verify", str(three)], capture_output=True, text=True, timeout=120
    )
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.splitlines()[-1] == "OK 3/3, errors 0"

    corrupt(three, 100)
    bad = subprocess.run(
        [*console_script(), "verify", str(three)], capture_output=True, text=True, timeout=120
    )
    assert bad.returncode == 1
    assert bad.stdout.splitlines()[-1] == "OK 2/3, errors 1"

    a_file = tmp_path / "file"
    a_file.write_text("x")
    error = subprocess.run(
        [*console_script(), "ls", str(a_file)], capture_output=True, text=True, timeout=120
    )
    assert error.returncode == 1
    assert "Traceback" not in error.stderr
    assert error.stderr.startswith("nbresume ls: error:")

    usage = subprocess.run([*console_script()], capture_output=True, text=True, timeout=120)
    assert usage.returncode == 2
    assert "usage: nbresume" in usage.stderr
