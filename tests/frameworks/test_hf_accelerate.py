"""Accelerate's ``save_state`` folders made verified nbresume checkpoints."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

pytest.importorskip("accelerate")

import torch
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration
from safetensors.torch import load_file

import nbresume.hf
from testkit import warmfork
from testkit.paths import ROOT


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


SAVE_STATE_SCRIPT = ROOT / "docs" / "frameworks" / "accelerate_save_state.py"


def run_script(cwd: Path) -> warmfork.WarmProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    return warmfork.popen(
        [sys.executable, str(SAVE_STATE_SCRIPT)],
        cwd=cwd,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.slow
def test_the_docs_save_state_script_continues_after_a_kill_bit_identically(
    tmp_path: Path,
) -> None:
    """docs/frameworks/accelerate_save_state.py, as the docs show it: killed with SIGKILL once
    its second checkpoint is committed, then run again: its saves continue after the newest
    (Accelerate's own count starts at 0 in every process) and its last checkpoint's weights
    are bit-identical to an uninterrupted run's."""
    reference = tmp_path / "reference"
    reference.mkdir()
    whole = run_script(reference)
    _, err = whole.communicate(timeout=300)
    assert whole.returncode == 0, err[-3000:]

    run = tmp_path / "run"
    run.mkdir()
    checkpoints = run / "runs" / "exp" / "checkpoints"
    killed = run_script(run)
    while not (checkpoints / "checkpoint_1" / "manifest.json").exists():
        assert killed.poll() is None, killed.stderr.read() if killed.stderr else ""
        time.sleep(0.01)
    killed.send_signal(signal.SIGKILL)
    killed.communicate(timeout=60)
    assert killed.returncode == -signal.SIGKILL
    assert not (checkpoints / "checkpoint_5").exists(), "the run ended before the kill"

    again = run_script(run)
    _, err = again.communicate(timeout=300)
    assert again.returncode == 0, err[-3000:]
    names = sorted(p.name for p in checkpoints.iterdir())
    assert names == [f"checkpoint_{i}" for i in range(6)]
    assert nbresume.hf.last_checkpoint(checkpoints) == str(checkpoints / "checkpoint_5")
    expected = load_file(reference / "runs/exp/checkpoints/checkpoint_5/model.safetensors")
    final = load_file(checkpoints / "checkpoint_5" / "model.safetensors")
    assert final.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(final[key], value), f"{key} differs after the kill"
