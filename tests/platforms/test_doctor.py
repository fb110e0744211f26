"""``nbresume doctor``: a table for people, JSON for programs, and an exit status for scripts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tests.platforms.conftest import CHECK_NAMES, LoopbackServer

from nbresume.cli import main
from testkit.cli import run_command


def test_table_names_every_check_and_exits_0(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert main(["doctor", "--dir", str(tmp_path / "ckpt")]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0] == "nbresume preflight: local machine"
    for name in CHECK_NAMES:
        assert any(line.split()[1:2] == name.split()[:1] for line in lines), name
    assert "\033[" not in out  # not a terminal: no colour codes
    assert "danger clocks:" in out


def test_json_is_valid_and_complete(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["doctor", "--json", "--dir", str(tmp_path)]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["ok"] is True
    assert document["platform"]["name"] == "local"
    assert [c["name"] for c in document["checks"]] == CHECK_NAMES
    for check in document["checks"]:
        assert set(check) == {"name", "status", "seen", "fix"}
        assert check["status"] in ("ok", "warn", "fail")
    for clock in document["danger_clocks"]:
        assert set(clock) == {"name", "seconds", "loses", "protection"}


def test_an_unmet_expectation_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", "--json", "--accelerator", "gpu", "--internet"]) == 1
    document = json.loads(capsys.readouterr().out)
    assert document["ok"] is False
    failed = {c["name"]: c for c in document["checks"] if c["status"] == "fail"}
    assert set(failed) == {"accelerator", "internet"}
    assert all(c["fix"] for c in failed.values())


def test_no_internet_flag(capsys: pytest.CaptureFixture[str], internet_on: LoopbackServer) -> None:
    assert main(["doctor", "--json", "--no-internet"]) == 0  # a warning is not a failure
    (check,) = [c for c in json.loads(capsys.readouterr().out)["checks"] if c["name"] == "internet"]
    assert check["status"] == "warn"


def test_not_enough_space_for_the_expected_checkpoints_fails(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    huge = str(10**18)  # an exabyte per checkpoint
    assert main(["doctor", "--dir", str(tmp_path), "--expected-bytes", huge, "--keep", "2"]) == 1
    out = capsys.readouterr().out
    assert "FAIL    durable folder" in out
    assert "3 checkpoints of" in out
    assert "lower keep=" in out


def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        main(["doctor", "--accelerator", "npu"])
    assert caught.value.code == 2
    assert "accelerator" in capsys.readouterr().err


def test_a_doctor_run_as_a_command(tmp_path: Path) -> None:
    result = run_command("doctor", "--json", "--dir", str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["ok"] is True

    table = run_command("doctor", "--accelerator", "gpu")
    assert table.returncode == 1
    assert "FAIL    accelerator" in table.stdout
    assert "fix: run on a machine with a GPU" in table.stdout
