"""Fixtures for the notebook tests: a clean environment, IPython's test shell with a fresh
extension, and a kernelspec that starts kernels with this virtualenv's Python.

Every knob points into ``tmp_path`` and the internet probe at a closed loopback port, so no
test reaches the network; kernels started by a test inherit that environment.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from nbresume.platforms.base import DETECTION_VARIABLES
from testkit.ports import free_port

#: What makes a platform recognise itself (the one list the detectors are checked against).
PLATFORM_VARIABLES = DETECTION_VARIABLES

#: The kernelspec the tests create: this interpreter, whatever `python3` means elsewhere.
KERNEL_NAME = "nbresume-test-venv"


def train_cell(steps: int) -> str:
    """A cell that trains a small model for ``steps`` steps in ``run`` (made by an earlier
    cell's ``nbresume.init``), saving every 10 steps."""
    return f"""
from testkit.stateful import Weights

model = Weights()
ckpt = run.checkpointer(model=model, every=10, async_save=False)
for step in ckpt.steps({steps}):
    model.w += 1
"""


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """No platform variables, nbresume's folders in ``tmp_path``, no internet, a session that
    began a minute ago; Jupyter and IPython configuration kept inside ``tmp_path`` too."""
    for name in [*PLATFORM_VARIABLES, *(v for v in os.environ if v.startswith("NBRESUME_"))]:
        monkeypatch.delenv(name, raising=False)
    world = tmp_path / "world"
    world.mkdir()
    monkeypatch.setenv("NBRESUME_HOME", str(world / "home"))
    monkeypatch.setenv("NBRESUME_COLAB_MARKER", str(world / "no-colab"))
    monkeypatch.setenv("NBRESUME_KAGGLE_ROOT", str(world / "no-kaggle"))
    monkeypatch.setenv("NBRESUME_PROBE_HOST", "127.0.0.1")
    monkeypatch.setenv("NBRESUME_PROBE_PORT", str(free_port()))
    monkeypatch.setenv("NBRESUME_SESSION_START", str(time.time() - 60))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    return world


@pytest.fixture
def jupyter_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict[str, str]:
    """Jupyter's folders in ``tmp_path`` and a kernelspec, :data:`KERNEL_NAME`, that runs
    this virtualenv's Python; returns the environment for servers and kernels."""
    jupyter = tmp_path / "jupyter"
    spec = jupyter / "data" / "kernels" / KERNEL_NAME
    spec.mkdir(parents=True)
    kernel: dict[str, Any] = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "nbresume tests",
        "language": "python",
        "metadata": {"debugger": False},
    }
    (spec / "kernel.json").write_text(json.dumps(kernel))
    for name, sub in (
        ("JUPYTER_DATA_DIR", "data"),
        ("JUPYTER_CONFIG_DIR", "config"),
        ("JUPYTER_RUNTIME_DIR", "runtime"),
        ("IPYTHONDIR", "ipython"),
    ):
        (jupyter / sub).mkdir(exist_ok=True)
        monkeypatch.setenv(name, str(jupyter / sub))
    monkeypatch.setenv("JUPYTER_PATH", str(jupyter / "data"))
    monkeypatch.setenv("JUPYTER_PLATFORM_DIRS", "1")
    monkeypatch.delenv("JUPYTER_ALLOW_INSECURE_WRITES", raising=False)
    return dict(os.environ)


@pytest.fixture
def tracker() -> Any:
    """A tracker that watches the Checkpointers made during the test, and only them."""
    from nbresume.notebook.progress import Tracker

    tracker = Tracker()
    tracker.start()
    yield tracker
    tracker.stop()


@pytest.fixture
def panel(tracker: Any) -> Any:
    """A panel that shows what the test's tracker sees (the test needs ipywidgets)."""
    from nbresume.notebook.panel import Panel

    panel = Panel(tracker)
    tracker.add_view(panel)
    return panel


@pytest.fixture(scope="session")
def _shell_history_closed_at_the_end() -> Iterator[None]:
    """IPython's test shell writes its history at interpreter exit, into a database in the
    test process's temporary folder (tests/conftest.py), which is removed before that: the
    history is closed when the session ends instead."""
    yield
    from IPython.core.interactiveshell import InteractiveShell

    if InteractiveShell.initialized():
        InteractiveShell.instance()._atexit_once()  # what its exit would do, once


@pytest.fixture
def ipshell(
    monkeypatch: pytest.MonkeyPatch, _shell_history_closed_at_the_end: None
) -> Iterator[Any]:
    """IPython's test shell with nbresume not loaded yet and no run: a fresh tracker, a fresh
    extension state, no watchers left from earlier tests."""
    pytest.importorskip("IPython", reason="needs IPython (the notebook extra)")
    from IPython.terminal.interactiveshell import TerminalInteractiveShell
    from IPython.testing.globalipapp import start_ipython

    from nbresume import run as run_module
    from nbresume.checkpoint import events
    from nbresume.notebook import extension_state, progress

    shell = start_ipython() or TerminalInteractiveShell.instance()  # started once per process
    monkeypatch.setattr(progress._TRACKER, "made", None)
    monkeypatch.setattr(extension_state._STATE, "made", None)
    monkeypatch.setattr(events, "_watchers", [])
    monkeypatch.setattr(run_module._Latest, "run", None)
    shell.extension_manager.loaded.discard("nbresume")
    yield shell
    state = extension_state._STATE.made
    if state is not None:
        state.unregister(shell)
        state.tracker.stop()
    shell.extension_manager.loaded.discard("nbresume")
