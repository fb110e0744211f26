"""``nbresume status``: alive or not is judged by the processes and the checkpoint age, and
the newest checkpoint is verified."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from nbresume.checkpoint.format import step_dirname
from nbresume.checkpoint.procfs import process_runs
from nbresume.pull import is_kaggle_ref
from testkit import warmfork
from testkit.cli import nbresume_argv, run_cli
from testkit.supervisor import RecordedJob

from .conftest import (
    HANG_S,
    read_state,
    train_argv,
    verified_steps,
    wait_until,
)


def status(target: Path | str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    return run_cli(["status", str(target)], capsys)


def test_a_running_job_then_one_that_died_without_a_word(
    tmp_path: Path, child_env: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = tmp_path / "ckpt"
    started = warmfork.run(
        nbresume_argv(
            "run", "--detach", "--dir", str(ckpt), "--",
            *train_argv(ckpt, 100_000, "--every", "3"),
        ),
        env=child_env,
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )  # fmt: skip
    assert started.returncode == 0, started.stdout + started.stderr
    wait_until(lambda: len(verified_steps(ckpt)) >= 2, "two checkpoints")
    state = read_state(ckpt / "nbresume-run.log")
    assert state is not None

    code, out, _ = status(ckpt, capsys)

    assert code == 0, out
    assert f"process:    running: pid {state.pid} " in out
    assert f"(supervisor pid {state.supervisor_pid})" in out
    assert "verified" in out.split("checkpoint: ")[1]

    # The machine's OOM killer or a `kill -9` takes both: no final status is ever written.
    os.kill(state.supervisor_pid or 0, signal.SIGKILL)
    os.killpg(state.pgid or 0, signal.SIGKILL)
    wait_until(
        lambda: not process_runs(state.pid) and not process_runs(state.supervisor_pid),
        "the killed processes to be gone",
    )
    code, out, _ = status(ckpt, capsys)

    assert code == 1, out
    assert "not running: the job and its supervisor are gone without a final status" in out
    assert read_state(ckpt / "nbresume-run.log").status == "running"  # type: ignore[union-attr]


def test_a_finished_run_and_a_failed_one(
    tmp_path: Path, child_env: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    good, bad = tmp_path / "good", tmp_path / "bad"
    warmfork.run(
        nbresume_argv("run", "--dir", str(good), "--", *train_argv(good, 4, "--every", "2")),
        env=child_env,
        capture_output=True,
        timeout=HANG_S,
        check=True,
    )
    bad.mkdir()
    warmfork.run(
        nbresume_argv(
            "run", "--log", str(bad / "train.log"), "--",
            sys.executable, "-c", "raise RuntimeError('no GPU')",
        ),
        env=child_env,
        capture_output=True,
        timeout=HANG_S,
    )  # fmt: skip

    code, out, _ = status(good, capsys)
    assert code == 0, out
    assert "process:    finished: exit 0" in out
    assert "checkpoint: step 4 verified" in out

    code, out, _ = status(bad, capsys)
    assert code == 1, out
    assert "process:    ended: exit 1" in out
    assert "RuntimeError: no GPU" in out
    assert "checkpoint: unknown" in out


def test_the_newest_checkpoint_is_verified(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import numpy as np

    from nbresume.checkpoint.store import CheckpointStore

    store = CheckpointStore(tmp_path / "ckpt", keep=None)
    for step in (10, 20):
        store.save(step, tensors={"model": {"w": np.full(64, step, dtype=np.float32)}})
    code, out, _ = status(tmp_path / "ckpt", capsys)
    assert code == 0, out
    assert "process:    unknown: no run record here" in out
    assert "checkpoint: step 20 verified" in out

    model = tmp_path / "ckpt" / step_dirname(20) / "model.safetensors"
    data = bytearray(model.read_bytes())
    data[-1] ^= 0xFF
    model.write_bytes(bytes(data))

    code, out, _ = status(tmp_path / "ckpt", capsys)
    assert code == 1, out
    assert "checkpoint: step 20 does NOT verify" in out
    assert "xxh3-128 mismatch" in out


@pytest.fixture
def no_kaggle_credentials(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever Kaggle support does with a reference, it finds no credentials and so never
    reaches Kaggle's servers."""
    for name in ("KAGGLE_USERNAME", "KAGGLE_KEY", "KAGGLE_API_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("KAGGLE_CONFIG_DIR", str(tmp_path / "home" / ".kaggle"))


def test_owner_slug_means_kaggle_unless_it_is_a_local_folder(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    no_kaggle_credentials: None,
) -> None:
    monkeypatch.chdir(tmp_path)
    assert is_kaggle_ref("someone/some-notebook")
    for local_or_url in ("./someone/some-notebook", "/abs/path", "a/b/c", "s3://b/x", "x"):
        assert not is_kaggle_ref(local_or_url), local_or_url

    code, _, err = status("someone/some-notebook", capsys)
    assert code != 0
    assert "Kaggle" in err  # handed to Kaggle support, not looked up as a folder
    assert "no such folder" not in err

    (tmp_path / "someone" / "some-notebook").mkdir(parents=True)
    assert not is_kaggle_ref("someone/some-notebook")
    code, out, _ = status("someone/some-notebook", capsys)
    assert code == 0, out
    assert "checkpoint: none yet" in out


def test_a_missing_folder_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = status(tmp_path / "nowhere" / "x", capsys)
    assert code == 1
    assert "no such folder" in err


def test_a_live_job_that_stopped_saving_is_flagged(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], forge_manifest: Callable[..., Path]
) -> None:
    # Checkpoints came every 10 minutes until 2 h 40 min ago; the job's process still runs
    # (here a `sleep`, recorded as the job as `nbresume run` records it).
    now = datetime.now(timezone.utc)
    ckpt = tmp_path / "ckpt"
    for minutes_ago, step in ((180, 100), (170, 200), (160, 300)):
        folder = ckpt / step_dirname(step)
        folder.mkdir(parents=True)
        (folder / "state.json").write_text(f'{{"step": {step}}}')
        created = (now - timedelta(minutes=minutes_ago)).isoformat(timespec="seconds")
        forge_manifest(folder, created=created)
    with RecordedJob(ckpt, tmp_path, started=(now - timedelta(hours=4)).timestamp()) as job:
        code, out, _ = status(ckpt, capsys)

    assert code == 0, out
    assert f"process:    running: pid {job.pid}" in out
    assert "checkpoint: step 300 verified, 2 h 40 min old" in out
    assert "no new checkpoint for 2 h 40 min, while they came every 10 min before" in out
