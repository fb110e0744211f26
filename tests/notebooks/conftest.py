"""Running the quickstart notebooks as a user's platform would: papermill, a real kernel.

Each execution is a ``python -m papermill`` process of its own with an explicit environment,
so that a test can kill its kernel and so that nothing of one platform's setup leaks into the
next. The kernel is the notebook's own kernelspec, ``python3``, defined in a Jupyter data
folder of the test's own that starts this virtualenv's Python, whatever ``python3`` means
elsewhere on the machine. No kernel reaches the network: the internet check goes to loopback
(a closed port, or a listening one where a test wants "internet on"), and the notebooks
generate their data.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from nbresume.platforms.base import DETECTION_VARIABLES
from testkit.paths import ROOT

pytest.importorskip("papermill", reason="needs papermill and ipykernel (the test extra)")
pytest.importorskip("ipykernel", reason="needs papermill and ipykernel (the test extra)")

import nbformat

NOTEBOOKS = ROOT / "notebooks"

#: Small settings for every run: a few seconds of training on 2 CPU cores, with a checkpoint
#: early enough that a kill lands mid-training, after one has been saved.
STEPS = 160
EVERY = 20

#: What makes a platform recognise itself (the one list the detectors are checked
#: against), plus the marker of a parent Jupyter and Drive credentials.
PLATFORM_VARIABLES = (
    *DETECTION_VARIABLES,
    "JPY_PARENT_PID",
    # Left by an earlier test's Drive sign-in: it points at another cloud's credentials.
    "GOOGLE_APPLICATION_CREDENTIALS",
)

_SHA = re.compile(r"^weights sha256: ([0-9a-f]{64})$", re.M)
_START = re.compile(r"^training from step (\d+) of (\d+)$", re.M)


@dataclass
class Executed:
    """One finished papermill run: its exit status, its log, and the output notebook."""

    code: int
    log: str
    output: Path

    @property
    def notebook(self) -> Any:
        return nbformat.read(self.output, as_version=4)

    @property
    def text(self) -> str:
        """Everything the notebook's cells printed (streams and plain-text results)."""
        if not self.output.exists():
            return ""
        parts = []
        for cell in self.notebook.cells:
            for out in cell.get("outputs", []):
                if out.get("output_type") == "stream":
                    parts.append(out["text"])
                elif "data" in out and "text/plain" in out["data"]:
                    parts.append(out["data"]["text/plain"] + "\n")
                elif out.get("output_type") == "error":
                    parts.append(f"{out['ename']}: {out['evalue']}\n")
        return "".join(parts)

    @property
    def weights(self) -> str:
        found = _SHA.findall(self.text)
        assert len(found) == 1, f"no single weights line in:\n{self.text}\n{self.log}"
        return found[0]

    @property
    def start(self) -> int:
        found = _START.findall(self.text)
        assert len(found) == 1, f"no single 'training from step' line in:\n{self.text}"
        return int(found[0][0])


def closed_port() -> int:
    """A loopback port nothing listens on: the internet check sees "off" at once."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="session")
def open_port() -> Iterator[int]:
    """A loopback port that accepts connections: the internet check sees "on"."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(64)
        yield int(sock.getsockname()[1])


@pytest.fixture(scope="session")
def jupyter_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Jupyter data folder whose ``python3`` kernelspec starts this interpreter."""
    data = tmp_path_factory.mktemp("jupyter-data")
    spec = data / "kernels" / "python3"
    spec.mkdir(parents=True)
    kernel = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3 (nbresume tests)",
        "language": "python",
        "metadata": {"debugger": False},
    }
    (spec / "kernel.json").write_text(json.dumps(kernel))
    return data


@pytest.fixture(scope="session")
def base_env(jupyter_data: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The environment every kernel starts from: no platform markers, no nbresume settings of
    the caller, Jupyter's folders under the test's temporary folder, no GPU, no network."""
    home = tmp_path_factory.mktemp("jupyter-home")
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in PLATFORM_VARIABLES and not k.startswith(("NBRESUME_", "COLAB_STANDIN_"))
    }
    for name, sub in (
        ("JUPYTER_CONFIG_DIR", "config"),
        ("JUPYTER_RUNTIME_DIR", "runtime"),
        ("IPYTHONDIR", "ipython"),
        ("MPLCONFIGDIR", "matplotlib"),
        # papermill writes the kernel's connection file with mkstemp: a papermill the test
        # kills leaves it, here rather than in /tmp.
        ("TMPDIR", "tmp"),
    ):
        (home / sub).mkdir()
        env[name] = str(home / sub)
    env["JUPYTER_PATH"] = str(jupyter_data)
    env["JUPYTER_DATA_DIR"] = str(jupyter_data)
    env["JUPYTER_PLATFORM_DIRS"] = "1"
    env["CUDA_VISIBLE_DEVICES"] = ""
    env["PYTHONUNBUFFERED"] = "1"
    env["NBRESUME_PROBE_HOST"] = "127.0.0.1"
    env["NBRESUME_PROBE_PORT"] = "9"
    # Colab and Kaggle are recognised by their markers only where a test sets them.
    env["NBRESUME_COLAB_MARKER"] = str(home / "no-colab-marker")
    env["NBRESUME_KAGGLE_ROOT"] = str(home / "no-kaggle")
    return env


def papermill_command(
    notebook: Path, output: Path, parameters: dict[str, Any], cwd: Path
) -> list[str]:
    return [
        sys.executable,
        "-m",
        "papermill",
        str(notebook),
        str(output),
        "-y",
        json.dumps(parameters),  # JSON is YAML: numbers stay numbers, None is null
        "--cwd",
        str(cwd),
        "--no-progress-bar",
        "--start-timeout",
        "120",
        "--execution-timeout",
        "300",
    ]


#: Every papermill process started, so that none (and no kernel) outlives its test.
_running: list[subprocess.Popen[str]] = []


def start(
    notebook: Path,
    output: Path,
    parameters: dict[str, Any],
    *,
    env: dict[str, str],
    cwd: Path,
) -> subprocess.Popen[str]:
    """Start executing ``notebook``; the kernel is a child of the returned process. The
    session clock starts now, as a fresh runtime's does."""
    cwd.mkdir(parents=True, exist_ok=True)
    process = subprocess.Popen(
        papermill_command(notebook, output, parameters, cwd),
        env={**env, "NBRESUME_SESSION_START": env.get("NBRESUME_SESSION_START", str(time.time()))},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    _running.append(process)
    return process


def stop(process: subprocess.Popen[str]) -> None:
    """Kill papermill and its kernel if they still run."""
    if process.poll() is None:
        for child in children(process.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)
        process.kill()
        process.wait()


def finish(process: subprocess.Popen[str], output: Path, timeout: float = 300) -> Executed:
    try:
        log, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop(process)
        log, _ = process.communicate()
    return Executed(process.returncode, log, output)


@pytest.fixture(autouse=True)
def _no_run_outlives_its_test() -> Iterator[None]:
    before = list(_running)
    yield
    for process in [p for p in _running if p not in before]:
        stop(process)
        _running.remove(process)


def execute(
    notebook: Path,
    output: Path,
    parameters: dict[str, Any],
    *,
    env: dict[str, str],
    cwd: Path,
) -> Executed:
    """Execute ``notebook`` to its end (or its first error)."""
    return finish(start(notebook, output, parameters, env=env, cwd=cwd), output)


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            found.append(int(entry.name))
    return found


def kernel_of(process: subprocess.Popen[str]) -> int:
    """The pid of the kernel papermill started."""
    for child in children(process.pid):
        try:
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
        except OSError:
            continue
        if b"ipykernel_launcher" in cmdline:
            return child
    raise AssertionError(f"papermill (pid {process.pid}) has no kernel process")


def wait_for(what: str, predicate: Callable[[], bool], process: subprocess.Popen[str]) -> None:
    """Poll ``predicate`` until it holds; fail when the run ends or two minutes pass first."""
    deadline = time.monotonic() + 120
    while not predicate():
        if process.poll() is not None:
            log = process.stdout.read() if process.stdout else ""
            raise AssertionError(f"the run ended before {what}:\n{log}")
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(0.01)


def kill_kernel(process: subprocess.Popen[str]) -> None:
    """SIGKILL the kernel, as a runtime that goes away would: no handler, no last save."""
    os.kill(kernel_of(process), signal.SIGKILL)
