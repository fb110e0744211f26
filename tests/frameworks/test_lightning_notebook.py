"""``notebooks/lightning_quickstart.ipynb`` executed with papermill on a real kernel, twice: a
fresh run of 2 epochs, then the same notebook asked for 3, which resumes from the newest
verified checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
from papermill_run import environment, execute

from testkit.paths import ROOT

pytest.importorskip("lightning")
pytest.importorskip("papermill")

NOTEBOOK = ROOT / "notebooks" / "lightning_quickstart.ipynb"
pytestmark = pytest.mark.slow


def run(tmp: Path, output: Path, env: dict[str, str], epochs: int) -> str:
    """Run the notebook for ``epochs`` epochs; the text of every output."""
    return execute(NOTEBOOK, tmp, output, env, {"epochs": epochs, "folder": str(tmp / "run")})


def test_the_quickstart_trains_and_a_rerun_resumes_from_its_verified_checkpoint(
    tmp_path: Path,
) -> None:
    env = environment(tmp_path)
    last = tmp_path / "run" / "last.ckpt"
    first = run(tmp_path, tmp_path / "first.ipynb", env, epochs=2)
    assert "training from the start" in first
    assert "trained to epoch 2 of 2, step 32" in first
    assert f"newest verified checkpoint: {last}" in first
    assert last.is_dir()  # a folder holding a verified checkpoint, not a pickle

    again = run(tmp_path, tmp_path / "again.ipynb", env, epochs=3)
    assert f"resuming from {last}" in again
    assert "trained to epoch 3 of 3, step 48" in again
