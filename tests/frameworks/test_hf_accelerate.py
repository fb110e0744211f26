"""Accelerate's ``save_state`` folders made verified nbresume checkpoints."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

pytest.importorskip("accelerate")

import torch
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration

import nbresume.hf


def prepared(project: Path) -> tuple[Accelerator, torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    accelerator = Accelerator(
        cpu=True,
        project_config=ProjectConfiguration(
            project_dir=str(project), automatic_checkpoint_naming=True
        ),
    )
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    return accelerator, model, optimizer


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    loss = model(torch.randn(8, 4)).pow(2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def test_save_state_commits_each_folder_and_the_newest_that_verifies_loads(
    tmp_path: Path,
) -> None:
    accelerator, model, optimizer = prepared(tmp_path / "exp")
    saved, weights = [], []
    for _ in range(2):
        train_step(model, optimizer)
        saved.append(nbresume.hf.save_state(accelerator))
        weights.append({k: v.clone() for k, v in model.state_dict().items()})
    checkpoints = tmp_path / "exp" / "checkpoints"
    assert saved == [str(checkpoints / "checkpoint_0"), str(checkpoints / "checkpoint_1")]
    assert (checkpoints / "checkpoint_1" / "manifest.json").exists()
    assert nbresume.hf.last_checkpoint(checkpoints) == saved[1]

    # The newest is damaged: passed over with a warning; the one before loads.
    victim = checkpoints / "checkpoint_1" / "optimizer.bin"
    victim.write_bytes(victim.read_bytes()[:-10])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        found = nbresume.hf.last_checkpoint(checkpoints)
    assert found == saved[0]
    assert any("checkpoint_1" in str(w.message) for w in caught)

    again, model2, _ = prepared(tmp_path / "exp")
    again.load_state(found)
    assert all(torch.equal(weights[0][k], v) for k, v in model2.state_dict().items())


def test_save_state_into_a_folder_without_a_step_number_is_refused(tmp_path: Path) -> None:
    accelerator, _, _ = prepared(tmp_path / "exp")
    accelerator.project_configuration.automatic_checkpoint_naming = False
    with pytest.raises(nbresume.UsageError, match="step number"):
        nbresume.hf.save_state(accelerator, tmp_path / "latest")
