"""``nbresume check`` says from which save on a resumed run differs, and what differs there.

Inside a run of the check (``NBRESUME_CHECK_DIR`` set), every save is noted as a fingerprint
of what it held; the check then finds the first step whose notes differ between the
uninterrupted run and the resumed one, leaving out what differs between two uninterrupted
runs too. Here the runs are Checkpointer loops in this process, under the check's knobs.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from torch import nn

import nbresume
from nbresume import knobs
from nbresume.checkpoint import hooks
from nbresume.resumecheck import saves

_stamps = itertools.count()


def train(
    root: Path,
    monkeypatch: pytest.MonkeyPatch,
    *,
    lower_lr_at: int | None = None,
    nudge_at: int | None = None,
) -> dict[str, dict[int, saves.Fingerprint]]:
    """Six steps of a tiny model under the check's knobs, saving after every step; with
    ``lower_lr_at`` the learning rate is lowered after that step, with ``nudge_at`` the
    weights are changed after that step. Returns the notes of the run."""
    monkeypatch.setattr(knobs, "_CHECK_FOLDERS", {})
    monkeypatch.setenv(knobs.CHECK_DIR.name, str(root))
    monkeypatch.setenv(knobs.SAVE_EVERY.name, "1")
    # What `import nbresume` registers in a run of the check (NBRESUME_CHECK_DIR set).
    monkeypatch.setattr(hooks, "after_save", saves.note_saves(str(root)))
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt = nbresume.Checkpointer(
        "runs/tiny", every=None, async_save=False, quiet=True, model=model, optimizer=optimizer
    )
    ckpt["stamp"] = next(_stamps)  # differs in every run: what the check leaves out
    for step in ckpt.steps(6):
        loss = model(torch.ones(2, 3)).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step + 1 == lower_lr_at:
            optimizer.param_groups[0]["lr"] = 0.01
        if step + 1 == nudge_at:
            with torch.no_grad():
                model.bias += 1.0
    ckpt.close()
    return saves.read(root)


def test_the_first_save_that_differs_is_found_with_what_differs_there(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = train(tmp_path / "run1", monkeypatch, lower_lr_at=3)
    again = train(tmp_path / "run1b", monkeypatch, lower_lr_at=3)
    assert sorted(first["tiny"]) == [1, 2, 3, 4, 5, 6]  # every save noted

    # The resumed run lowers it later: at step 3 only the learning rate differs.
    later = train(tmp_path / "run2", monkeypatch, lower_lr_at=5)
    found = saves.first_difference(first, again, later)
    assert found is not None
    assert (found.step, found.same_until) == (3, 2)
    assert found.parts == [("optimizer 'optimizer'", ["param_groups/0/lr"])]
    assert found.names() == "optimizer 'optimizer': param_groups/0/lr"

    # Weights changed after step 4: the tensors are named.
    nudged = train(tmp_path / "run3", monkeypatch, lower_lr_at=3, nudge_at=4)
    found = saves.first_difference(first, again, nudged)
    assert found is not None
    assert (found.step, found.same_until) == (4, 3)
    assert found.names() == "model 'model': bias"


def test_runs_that_differ_only_where_uninterrupted_runs_differ_too_have_no_first_difference(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = train(tmp_path / "run1", monkeypatch)
    again = train(tmp_path / "run1b", monkeypatch)
    second = train(tmp_path / "run2", monkeypatch)
    assert first["tiny"][6] != second["tiny"][6]  # the stamp differs in every run
    assert saves.first_difference(first, again, second) is None


def test_a_step_noted_twice_keeps_its_last_note_and_a_cut_line_is_passed_over(
    tmp_path: Path,
) -> None:
    (tmp_path / saves.NOTES).write_text(
        '{"folder": "a", "step": 1, "held": {"model \'m\'": {"w": "1"}}}\n'
        '{"folder": "a", "step": 1, "held": {"model \'m\'": {"w": "2"}}}\n'
        '{"folder": "a", "step": 2, "held": {"mod'
    )
    assert saves.read(tmp_path) == {"a": {1: {"model 'm'": {"w": "2"}}}}
