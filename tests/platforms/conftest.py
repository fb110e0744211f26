"""Fixtures for the platform tests: a clean environment, fake platform trees, and loopback
servers standing in for "the internet".

Every test here starts from an environment with no platform variables and with every
nbresume knob pointing into ``tmp_path`` (no real /kaggle, /sys/fs/cgroup, Drive or network):
the internet probe targets a closed port on 127.0.0.1 unless a test points it elsewhere.
"""

from __future__ import annotations

import os
import socket
import stat
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from nbresume.platforms.base import DETECTION_VARIABLES
from testkit.ports import free_port
from tiers import starts_processes

#: The preflight's checks, in the order it reports them.
CHECK_NAMES = [
    "platform",
    "accelerator",
    "cuda build",
    "internet",
    "durable folder",
    "memory",
    "cpu",
    "session clock",
]

#: What makes a platform recognise itself (the one list the detectors are checked
#: against), plus the terminal's colour switch.
PLATFORM_VARIABLES = (*DETECTION_VARIABLES, *("NO_COLOR",))


@pytest.fixture(autouse=True)
def clean_platform(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """No platform variables, every knob inside ``tmp_path``, internet probe at a closed
    loopback port, a session that began a minute ago, GPUs hidden from CUDA. Returns the
    folder holding the fake trees."""
    for name in [*PLATFORM_VARIABLES, *(v for v in os.environ if v.startswith("NBRESUME_"))]:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delitem(sys.modules, "google.colab", raising=False)
    world = tmp_path / "world"
    (world / "cgroup").mkdir(parents=True)
    monkeypatch.setenv("NBRESUME_COLAB_MARKER", str(world / "var-colab-hostname"))
    monkeypatch.setenv("NBRESUME_CGROUP_ROOT", str(world / "cgroup"))
    monkeypatch.setenv("NBRESUME_MOUNTINFO", str(world / "no-mountinfo"))
    monkeypatch.setenv("NBRESUME_KAGGLE_ROOT", str(world / "kaggle"))
    monkeypatch.setenv("NBRESUME_DRIVE_MOUNT", str(world / "content" / "drive"))
    monkeypatch.setenv("NBRESUME_HOME", str(world / "home" / "nbresume"))
    monkeypatch.setenv("NBRESUME_PROBE_HOST", "127.0.0.1")
    monkeypatch.setenv("NBRESUME_PROBE_PORT", str(free_port()))
    monkeypatch.setenv("NBRESUME_SESSION_START", str(time.time() - 60))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    return world


class LoopbackServer:
    """A TCP server on 127.0.0.1 that accepts and closes every connection."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = int(self.sock.getsockname()[1])
        self.accepted = 0
        self._connected = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            self._connected.set()
            conn.close()

    def was_reached(self, timeout_s: float = 10.0) -> bool:
        """Whether a client connected. The kernel completes a connection before this
        server's thread accepts it: a client can be done before the count moves."""
        return self._connected.wait(timeout_s)

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def internet_on(monkeypatch: pytest.MonkeyPatch) -> Iterator[LoopbackServer]:
    """The internet, played by a server on loopback that accepts connections."""
    server = LoopbackServer()
    monkeypatch.setenv("NBRESUME_PROBE_HOST", "127.0.0.1")
    monkeypatch.setenv("NBRESUME_PROBE_PORT", str(server.port))
    yield server
    server.close()


@pytest.fixture
def internet_hangs(monkeypatch: pytest.MonkeyPatch) -> Iterator[int]:
    """The internet, played by a port whose connections hang: a listening socket whose
    accept queue is full, so the kernel drops further attempts and the client waits."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(0)
    port = int(server.getsockname()[1])
    held = []
    for _ in range(64):
        client = socket.socket()
        client.settimeout(0.2)
        try:
            client.connect(("127.0.0.1", port))
        except OSError:
            client.close()
            break
        held.append(client)
    else:
        pytest.fail("could not fill the accept queue of a loopback socket")
    monkeypatch.setenv("NBRESUME_PROBE_HOST", "127.0.0.1")
    monkeypatch.setenv("NBRESUME_PROBE_PORT", str(port))
    yield port
    for client in held:
        client.close()
    server.close()


def write_executable(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


@pytest.fixture
@starts_processes  # nbresume runs the nvidia-smi it installs
def fake_nvidia_smi(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Callable[..., Path]:
    """Install an ``nvidia-smi`` first on PATH that prints the given CSV lines (or sleeps),
    as the real one answers ``--query-gpu=name,driver_version,compute_cap``."""

    def install(lines: list[str], *, sleep: float = 0.0, exit_status: int = 0) -> Path:
        body = "".join(f"echo '{line}'\n" for line in lines)
        script = "#!/bin/sh\n" + (f"sleep {sleep}\n" if sleep else "") + body
        script += f"exit {exit_status}\n"
        path = write_executable(tmp_path / "fakebin" / "nvidia-smi", script)
        monkeypatch.setenv("PATH", f"{path.parent}{os.pathsep}{os.environ.get('PATH', '')}")
        return path

    return install
