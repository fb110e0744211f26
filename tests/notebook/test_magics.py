"""``%load_ext nbresume`` and the ``%nbresume`` magics in IPython's own test shell.

The user's view: loading runs the preflight and registers the magics (twice is harmless),
``%%nbresume once`` skips a cell that completed in this run and never records a cell that
failed, and ``doctor`` / ``verify`` print what the command line prints.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from nbresume.checkpoint import events
from nbresume.notebook import _extension
from nbresume.notebook.status_line import StatusLine
from testkit import warmfork
from testkit.cli import run_command

from .conftest import train_cell

pytest.importorskip("IPython", reason="needs IPython (the notebook extra)")

TRAIN = train_cell(25)


def run_cell(shell: Any, code: str) -> Any:
    return shell.run_cell(code, store_history=False)


def init(shell: Any, folder: Path) -> None:
    result = run_cell(shell, f"import nbresume\nrun = nbresume.init('nb', dir={str(folder)!r})")
    assert result.success, result.error_in_exec


def test_load_ext_runs_the_preflight_and_registers_the_magics(
    ipshell: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    ipshell.run_line_magic("load_ext", "nbresume")
    out = capsys.readouterr().out
    assert "nbresume preflight on local machine: all" in out
    assert "nbresume" in ipshell.magics_manager.magics["line"]
    assert "nbresume" in ipshell.magics_manager.magics["cell"]
    # In a terminal IPython (no kernel) the run is shown as a status line.
    state = _extension.state()
    assert [type(v) for v in state.tracker.views] == [StatusLine]


def test_loading_twice_is_harmless(ipshell: Any, tmp_path: Path) -> None:
    hooks_before = {n: len(ipshell.events.callbacks[n]) for n in ("post_execute", "post_run_cell")}
    watchers_before = len(events._watchers)
    ipshell.run_line_magic("load_ext", "nbresume")
    ipshell.run_line_magic("reload_ext", "nbresume")
    _extension.load(ipshell)  # as nbresume.init does inside IPython
    _extension.show(ipshell)

    for name, count in hooks_before.items():
        assert len(ipshell.events.callbacks[name]) == count + 1, name
    assert len(events._watchers) == watchers_before + 1
    assert len(_extension.state().tracker.views) == 1
    init(ipshell, tmp_path / "run")
    assert len(_extension.state().tracker.views) == 1
    # A Checkpointer made now is followed once: one subscription, one status line.
    ckpt = ipshell.user_ns["run"].checkpointer(every=None)
    assert len(ckpt.events.callbacks) == 1


def test_once_runs_a_cell_once_per_run(
    ipshell: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ipshell.run_line_magic("load_ext", "nbresume")
    init(ipshell, tmp_path / "run")
    ipshell.user_ns["calls"] = 0
    cell = "%%nbresume once preprocess\ncalls += 1\ncalls * 10"

    first = run_cell(ipshell, cell)
    assert first.success
    assert first.result == 10  # the last expression is the cell's value
    marker = tmp_path / "run" / "once" / "preprocess.json"
    record = json.loads(marker.read_text())
    assert record["name"] == "preprocess"
    capsys.readouterr()

    second = run_cell(ipshell, cell)
    assert second.success
    assert ipshell.user_ns["calls"] == 1
    note = capsys.readouterr().out.strip()
    assert note.startswith("nbresume: skipped 'preprocess': it completed in this run at ")
    assert len(note.splitlines()) == 1
    day, clock = record["completed"][:10], record["completed"][11:19]
    assert f"{day} {clock} UTC" in note

    forced = run_cell(ipshell, "%%nbresume once preprocess --force\ncalls += 1")
    assert forced.success
    assert ipshell.user_ns["calls"] == 2


def test_once_records_nothing_when_the_cell_fails(ipshell: Any, tmp_path: Path) -> None:
    ipshell.run_line_magic("load_ext", "nbresume")
    init(ipshell, tmp_path / "run")
    ipshell.user_ns["calls"] = 0
    failing = "%%nbresume once download\ncalls += 1\nraise ConnectionError('the mirror is down')"

    result = run_cell(ipshell, failing)
    assert not result.success
    assert isinstance(result.error_in_exec, ConnectionError)  # the cell's error, as raised
    assert not (tmp_path / "run" / "once" / "download.json").exists()

    again = run_cell(ipshell, "%%nbresume once download\ncalls += 1")
    assert again.success
    assert ipshell.user_ns["calls"] == 2  # it ran again, and now it is recorded
    assert (tmp_path / "run" / "once" / "download.json").exists()


def test_once_survives_a_new_kernel_on_the_same_run_folder(ipshell: Any, tmp_path: Path) -> None:
    ipshell.run_line_magic("load_ext", "nbresume")
    init(ipshell, tmp_path / "run")
    assert run_cell(ipshell, "%%nbresume once tokenize\nx = 1").success
    # A reconnect: a new process, a new init of the same run; only the folder remembers.
    code = f"""
import nbresume
from nbresume.notebook import once
run = nbresume.init('nb', dir={str(tmp_path / "run")!r}, quiet=True)
print(once.read_marker(run.dir, 'tokenize') is not None, once.read_marker(run.dir, 'other'))
"""
    out = warmfork.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "None"]


def test_once_needs_a_run_and_a_usable_name(
    ipshell: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ipshell.run_line_magic("load_ext", "nbresume")
    ipshell.user_ns["calls"] = 0
    result = run_cell(ipshell, "%%nbresume once prep\ncalls += 1")
    assert not result.success  # "Run all" stops here instead of guessing
    assert "nbresume.init" in str(result.error_in_exec)
    assert ipshell.user_ns["calls"] == 0

    init(ipshell, tmp_path / "run")
    for bad in ("../escape", ".hidden", "two words", ""):
        result = run_cell(ipshell, f"%%nbresume once {bad}\ncalls += 1")
        assert not result.success, bad
    assert ipshell.user_ns["calls"] == 0
    assert not (tmp_path / "run" / "once").exists()


def test_doctor_prints_what_the_command_line_prints(
    ipshell: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    ipshell.run_line_magic("load_ext", "nbresume")
    capsys.readouterr()
    ipshell.run_line_magic("nbresume", "doctor --json")
    magic = json.loads(capsys.readouterr().out)
    cli = run_command("doctor", "--json")
    command = json.loads(cli.stdout)
    assert magic["platform"] == command["platform"]
    assert [(c["name"], c["status"]) for c in magic["checks"]] == [
        (c["name"], c["status"]) for c in command["checks"]
    ]

    ipshell.run_line_magic("nbresume", "doctor")
    table = capsys.readouterr().out
    assert table.startswith("nbresume preflight: local machine\n")
    for check in command["checks"]:
        assert f"  {check['name']}  " in table or f"  {check['name']} " in table


def test_status_verify_and_save(
    ipshell: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ipshell.run_line_magic("load_ext", "nbresume")
    init(ipshell, tmp_path / "run")
    assert run_cell(ipshell, TRAIN).success
    capsys.readouterr()

    ipshell.run_line_magic("nbresume", "status")
    status = capsys.readouterr().out
    assert "run 'nb'" in status
    assert str(tmp_path / "run") in status
    assert "training: step 25 of 25 (100%) · done" in status
    assert "last checkpoint: step 25 saved" in status

    ipshell.run_line_magic("nbresume", "verify")
    verify = capsys.readouterr().out
    assert verify.strip().splitlines()[-1] == "OK 3/3, errors 0"

    ipshell.user_ns["model"].w += 5  # the state after more work, outside the loop
    ipshell.run_line_magic("nbresume", "save")
    saved = capsys.readouterr().out
    assert saved.startswith("nbresume save: saved step 25 ")
    assert saved.rstrip().endswith(": verified")
    from nbresume.checkpoint.store import CheckpointStore

    loaded = CheckpointStore(tmp_path / "run").load(25)
    assert loaded.tensors["model"]["w"].tolist() == [30.0, 30.0, 30.0]


def test_verify_of_the_live_checkpointer_says_whether_each_checkpoint_fits_its_objects(
    ipshell: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ipshell.run_line_magic("load_ext", "nbresume")
    init(ipshell, tmp_path / "run")
    cell = """
import torch
model = torch.nn.Linear(4, 2)
ckpt = run.checkpointer(model=model, every=None, async_save=False)
ckpt.save(5)
"""
    assert run_cell(ipshell, cell).success
    capsys.readouterr()
    ipshell.run_line_magic("nbresume", "verify")
    assert capsys.readouterr().out.strip().splitlines()[-1] == "OK 1/1, errors 0"
    # The model made wider in place: its checkpoint is still whole, and a restore into it
    # would pass the checkpoint over. So does the verify of its Checkpointer.
    assert run_cell(ipshell, "model.weight = torch.nn.Parameter(torch.zeros(3, 4))").success
    ipshell.run_line_magic("nbresume", "verify")
    out = capsys.readouterr().out
    (failed,) = [line for line in out.splitlines() if line.startswith("FAIL")]
    assert failed.startswith("FAIL  000000000005 "), out
    assert "model.weight is [2, 4] float32 in the checkpoint, [3, 4] float32 here" in failed
    assert out.strip().splitlines()[-1] == "OK 0/1, errors 1"


def test_unknown_commands_are_usage_errors(
    ipshell: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    ipshell.run_line_magic("load_ext", "nbresume")
    result = run_cell(ipshell, "%nbresume frobnicate")
    assert not result.success
    result = run_cell(ipshell, "%%nbresume status\nx = 1")
    assert not result.success
    ipshell.run_line_magic("nbresume", "")
    assert "%%nbresume once NAME" in capsys.readouterr().out
