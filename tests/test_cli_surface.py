"""The surface a new user meets first: ``python -m nbresume``, every command's ``--help``, the
usage errors that say what is missing, a plain script's progress, ``wait(durable=True)`` and
the place every error names."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import nbresume
from nbresume.cli import build_parser
from testkit import warmfork
from testkit.paths import with_testkit
from testkit.stateful import Counter
from testkit.terminal import stderr_on_a_terminal

ENV = {
    **{k: v for k, v in os.environ.items() if not k.startswith("NBRESUME_")},
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
}


def nbresume_cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m nbresume ARGS`` in a process forked from the warm server."""
    return warmfork.run(
        [sys.executable, "-m", "nbresume", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=ENV,
        timeout=120,
    )


def subcommands() -> list[str]:
    parser = build_parser()
    action = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    return sorted(action.choices)  # type: ignore[arg-type]


def test_python_dash_m_nbresume_is_the_nbresume_command() -> None:
    done = nbresume_cli("--help")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: nbresume")
    for name in subcommands():
        assert f"    {name}" in done.stdout
    version = nbresume_cli("--version")
    assert version.stdout.strip() == f"nbresume {nbresume.__version__}"


@pytest.mark.parametrize("command", subcommands())
def test_every_command_help_says_what_the_command_does(command: str) -> None:
    parser = build_parser()
    action = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    sub = action.choices[command]  # type: ignore[index]
    assert sub.description, f"`nbresume {command} --help` has no description"
    assert len(sub.description) > 40, sub.description
    assert sub.description.split()[0] in sub.format_help()


def test_run_without_a_command_says_what_is_missing() -> None:
    for args in (["run"], ["run", "--"], ["run", "--detach", "--"]):
        done = nbresume_cli(*args)
        assert done.returncode == 2
        assert "the command to run is missing" in done.stderr
        assert "-- python train.py" in done.stderr


def _folder_with_metrics(tmp_path: Path) -> Path:
    store = nbresume.CheckpointStore(tmp_path / "run", keep=None)
    for step in (1, 2, 3):
        store.save(step, data={"state": {"step": step}}, metrics={"val_loss": 1.0 / step})
    return tmp_path / "run"


def test_prune_by_a_metric_no_checkpoint_recorded_is_an_error_and_deletes_nothing(
    tmp_path: Path,
) -> None:
    folder = _folder_with_metrics(tmp_path)
    done = nbresume_cli("prune", str(folder), "--keep", "1", "--best", "accuracy:max")
    assert done.returncode == 1
    assert "no checkpoint recorded a metric named 'accuracy'" in done.stderr
    assert "val_loss" in done.stderr  # the metrics they did record
    assert [i.step for i in nbresume.CheckpointStore(folder, keep=None).list()] == [1, 2, 3]
    kept = nbresume_cli("prune", str(folder), "--keep", "1", "--best", "val_loss:min")
    assert kept.returncode == 0, kept.stderr
    assert "kept steps [3]" in kept.stdout


def test_prune_on_a_folder_that_does_not_exist_is_an_error(tmp_path: Path) -> None:
    done = nbresume_cli("prune", str(tmp_path / "nope"), "--keep", "2")
    assert done.returncode == 1
    assert "no such folder" in done.stderr
    assert not (tmp_path / "nope").exists()


# -- a plain script: progress without nbresume.init --------------------------------------------

SCRIPT = """
import sys
import nbresume
from testkit.stateful import Weights

model = Weights(4)
quiet = sys.argv[2] == "quiet"
ckpt = nbresume.Checkpointer(sys.argv[1], every=5, async_save=False, quiet=quiet, model=model)
for step in ckpt.steps(12):
    model.w += 1
print("trained", ckpt.step)
print(ckpt.wait(durable=True, timeout=60))
"""


def _argv(tmp_path: Path, mode: str) -> list[str]:
    """The plain script, run with its progress "loud" or "quiet"."""
    path = tmp_path / "train.py"
    path.write_text(textwrap.dedent(SCRIPT))
    return [sys.executable, str(path), str(tmp_path / "run"), mode]


def _run_script(tmp_path: Path, mode: str) -> subprocess.CompletedProcess[str]:
    return warmfork.run(
        _argv(tmp_path, mode), capture_output=True, text=True, env=with_testkit(ENV), timeout=120
    )


def test_a_bare_checkpointer_logs_its_checkpoints_to_stderr(tmp_path: Path) -> None:
    done = _run_script(tmp_path, "loud")
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    for step in (5, 10, 12):
        assert any(f"nbresume: step {step} saved" in line for line in lines), done.stderr
    assert lines[-1].endswith("done"), done.stderr  # "done: step 12 of 12 (100%) ... done"
    assert done.stdout.startswith("trained 12\n")


def test_quiet_turns_the_progress_off(tmp_path: Path) -> None:
    done = _run_script(tmp_path, "quiet")
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""


def test_a_bare_checkpointer_on_a_terminal_draws_one_live_line(tmp_path: Path) -> None:
    code, output = stderr_on_a_terminal(
        _argv(tmp_path, "loud"), with_testkit({**ENV, "COLUMNS": "200"})
    )
    assert code == 0
    text = output.decode(errors="replace")
    assert "\r" in text  # redrawn in place
    assert "nbresume: done: step 12 of 12" in text or "step 12 of 12 (100%)" in text
    assert "[" not in text.split("\r")[-1][:1]  # no timestamped log lines on a terminal


# -- wait(durable=True) --------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["local", "memory"])
def test_wait_durable_says_what_the_storage_confirmed(tmp_path: Path, where: str) -> None:
    folder = str(tmp_path / "run") if where == "local" else f"memory://{tmp_path.name}/run"
    counter = Counter()
    ckpt = nbresume.Checkpointer(folder, every=None, deadline=None, quiet=True, counter=counter)
    try:
        counter.count = 7
        ckpt.save(3)  # in the background: wait() finishes it first
        confirmed = ckpt.wait(durable=True, timeout=30)
        assert confirmed is not None
        assert confirmed.step == 3
        assert confirmed.location.endswith("000000000003")
        if where == "local":
            assert "fsynced to the local disk" in str(confirmed)
        else:
            assert "the store lists all" in str(confirmed)
        assert ckpt.wait() is None  # without durable=: as before
    finally:
        ckpt.close()


def test_wait_durable_before_any_checkpoint_says_there_is_none(tmp_path: Path) -> None:
    ckpt = nbresume.Checkpointer(tmp_path / "run", every=None, quiet=True, counter=Counter())
    try:
        with pytest.raises(nbresume.NoCheckpointError) as caught:
            ckpt.wait(durable=True, timeout=1)
        assert caught.value.where == str(tmp_path / "run")
    finally:
        ckpt.close()


# -- errors name their place -----------------------------------------------------------------


def test_errors_name_the_place_they_are_about(tmp_path: Path) -> None:
    with pytest.raises(nbresume.ArgumentError) as argument:
        nbresume.Checkpointer(tmp_path / "a", every="sometimes", quiet=True)
    assert argument.value.where.startswith("Checkpointer(every=")

    store = nbresume.CheckpointStore(tmp_path / "b", keep=None)
    with pytest.raises(nbresume.CheckpointError) as nothing:
        store.save(1)
    assert nothing.value.where == store.location

    with pytest.raises(nbresume.CheckpointError) as unstorable:
        store.save(1, data={"state": {"when": object()}})
    assert unstorable.value.where

    class Picky(Counter):
        def load_state_dict(self, state: dict[str, int]) -> None:
            raise ValueError("shapes differ")

    first = nbresume.Checkpointer(tmp_path / "c", every=None, quiet=True, model=Counter())
    first.save(1, block=True)
    first.close()
    second = nbresume.Checkpointer(tmp_path / "c", every=None, quiet=True, model=Picky())
    try:
        with pytest.raises(nbresume.CheckpointError) as restoring:
            second.restore()
        assert restoring.value.where == "model"
    finally:
        second.close()

    done = nbresume_cli("ls", str(tmp_path / "missing"))
    assert f"{tmp_path / 'missing'}: no such folder" in done.stderr
