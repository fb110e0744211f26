"""``notebooks/lightning_quickstart.ipynb`` executed with papermill on a real kernel, twice: a
fresh run of 2 epochs, then the same notebook asked for 3, which resumes from the newest
verified checkpoint."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lightning")
pytest.importorskip("papermill")

NOTEBOOK = Path(__file__).resolve().parents[2] / "notebooks" / "lightning_quickstart.ipynb"
pytestmark = pytest.mark.slow


def environment(tmp: Path) -> dict[str, str]:
    """No platform markers, Jupyter's folders under ``tmp``, no GPU, no network."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("NBRESUME_", "COLAB", "KAGGLE")) and k != "JPY_PARENT_PID"
    }
    kernel = tmp / "jupyter" / "kernels" / "python3"
    kernel.mkdir(parents=True)
    argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    (kernel / "kernel.json").write_text(
        json.dumps({"argv": argv, "display_name": "Python 3", "language": "python"})
    )
    for name in ("JUPYTER_CONFIG_DIR", "JUPYTER_RUNTIME_DIR", "IPYTHONDIR", "MPLCONFIGDIR"):
        (tmp / name).mkdir()
        env[name] = str(tmp / name)
    env.update(
        JUPYTER_PATH=str(tmp / "jupyter"),
        JUPYTER_DATA_DIR=str(tmp / "jupyter"),
        JUPYTER_PLATFORM_DIRS="1",
        CUDA_VISIBLE_DEVICES="",
        NBRESUME_HOME=str(tmp / "home"),
        NBRESUME_PROBE_HOST="127.0.0.1",
        NBRESUME_PROBE_PORT="9",
        NBRESUME_COLAB_MARKER=str(tmp / "no-colab-marker"),
        NBRESUME_KAGGLE_ROOT=str(tmp / "no-kaggle"),
        OMP_NUM_THREADS="1",
    )
    return env


def execute(tmp: Path, output: Path, env: dict[str, str], epochs: int) -> str:
    """Run the notebook for ``epochs`` epochs; the text of every output."""
    parameters = {"epochs": epochs, "folder": str(tmp / "run")}
    done = subprocess.run(
        [sys.executable, "-m", "papermill", str(NOTEBOOK), str(output), "-y",
         json.dumps(parameters), "--cwd", str(tmp), "--no-progress-bar", "--start-timeout",
         "120", "--execution-timeout", "300"],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    notebook = json.loads(output.read_text())
    return "\n".join(
        "".join(out.get("text", ""))
        for cell in notebook["cells"]
        for out in cell.get("outputs", [])
    )


def test_the_quickstart_trains_and_a_rerun_resumes_from_its_verified_checkpoint(
    tmp_path: Path,
) -> None:
    env = environment(tmp_path)
    last = tmp_path / "run" / "last.ckpt"
    first = execute(tmp_path, tmp_path / "first.ipynb", env, epochs=2)
    assert "training from the start" in first
    assert "trained to epoch 2 of 2, step 32" in first
    assert f"newest verified checkpoint: {last}" in first
    assert last.is_dir()  # a folder holding a verified checkpoint, not a pickle

    again = execute(tmp_path, tmp_path / "again.ipynb", env, epochs=3)
    assert f"resuming from {last}" in again
    assert "trained to epoch 3 of 3, step 48" in again
