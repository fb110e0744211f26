"""A wrong option of a ``%nbresume`` command fails the cell, so that "Run all" stops there;
``%nbresume status`` says whether it is safe to close the tab."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from .conftest import train_cell

pytest.importorskip("IPython", reason="needs IPython (the notebook extra)")

TRAIN = train_cell(12)


def test_a_wrong_option_of_doctor_or_verify_fails_the_cell(
    ipshell: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    ipshell.run_line_magic("load_ext", "nbresume")
    capsys.readouterr()
    for line, error in (
        ("%nbresume doctor --bad", "unrecognized arguments: --bad"),
        ("%nbresume verify --bad", "the following arguments are required"),
    ):
        result = ipshell.run_cell(line, store_history=False)
        assert not result.success, line
        assert f"error: {error}" in capsys.readouterr().err
    good = ipshell.run_cell("%nbresume doctor --json", store_history=False)
    assert good.success


def test_status_says_whether_it_is_safe_to_close(
    ipshell: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ipshell.run_line_magic("load_ext", "nbresume")
    done = ipshell.run_cell(
        f"import nbresume\nrun = nbresume.init('nb', dir={str(tmp_path / 'run')!r})",
        store_history=False,
    )
    assert done.success
    assert ipshell.run_cell(TRAIN, store_history=False).success
    capsys.readouterr()
    ipshell.run_line_magic("nbresume", "status")
    out = capsys.readouterr().out
    assert "safe to close: step 12 at " in out
    assert "fsynced to the local disk" in out
