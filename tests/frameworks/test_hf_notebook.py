"""``notebooks/hf_trainer_quickstart.ipynb`` executed with papermill on a real kernel, twice:
a fresh run, then the same notebook again, which resumes from the newest verified checkpoint."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from papermill_run import environment, execute

from testkit.paths import ROOT

pytest.importorskip("transformers")
pytest.importorskip("papermill")

NOTEBOOK = ROOT / "notebooks" / "hf_trainer_quickstart.ipynb"
pytestmark = pytest.mark.slow


def run(tmp: Path, output: Path, env: dict[str, str]) -> str:
    parameters = {"steps": 24, "save_steps": 8, "folder": str(tmp / "run")}
    return execute(NOTEBOOK, tmp, output, env, parameters)


def test_the_quickstart_trains_and_a_rerun_resumes_from_its_verified_checkpoint(
    tmp_path: Path,
) -> None:
    env = environment(
        tmp_path, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HOME=str(tmp_path / "hf-home")
    )
    first = run(tmp_path, tmp_path / "first.ipynb", env)
    assert "training from the start" in first
    assert "trained to step 24 of 24" in first
    newest = tmp_path / "run" / "checkpoint-24"
    assert f"newest verified checkpoint: {newest}" in first
    assert sorted(p.name for p in (tmp_path / "run").glob("checkpoint-*")) == [
        "checkpoint-16",
        "checkpoint-24",
    ]
    weights = re.search(r"weights sha256: ([0-9a-f]{64})", first)
    assert weights is not None

    again = run(tmp_path, tmp_path / "again.ipynb", env)
    assert f"resuming from {newest}" in again
    assert f"weights sha256: {weights.group(1)}" in again
