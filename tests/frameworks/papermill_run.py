"""A quickstart notebook run with papermill on a real kernel, on a neutral machine: no platform
markers, Jupyter's folders under a temporary folder, no GPU, no network."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any


def environment(tmp: Path, **extra: str) -> dict[str, str]:
    """The environment of a kernel whose folders are all under ``tmp``; ``extra`` on top."""
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
    # TMPDIR: the kernel's connection file (mkstemp) of a papermill that is killed stays here.
    for name in (
        "JUPYTER_CONFIG_DIR",
        "JUPYTER_RUNTIME_DIR",
        "IPYTHONDIR",
        "MPLCONFIGDIR",
        "TMPDIR",
    ):
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
        **extra,
    )
    return env


def execute(
    notebook: Path, tmp: Path, output: Path, env: dict[str, str], parameters: dict[str, Any]
) -> str:
    """Run ``notebook`` with ``parameters`` in ``tmp``; the text of every output."""
    done = subprocess.run(
        [sys.executable, "-m", "papermill", str(notebook), str(output), "-y",
         json.dumps(parameters), "--cwd", str(tmp), "--no-progress-bar", "--start-timeout",
         "120", "--execution-timeout", "300"],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ran = json.loads(output.read_text())
    return "\n".join(
        "".join(out.get("text", "")) for cell in ran["cells"] for out in cell.get("outputs", [])
    )
