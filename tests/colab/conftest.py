"""A simulated Colab: Google's side in this process, each VM a process of its own.

Google's side (the Drive API server on loopback, over a cloud folder) lives in the test
process, so it outlives every VM, as the real one does. Each VM is a ``child.py`` process with
a mount point of its own and the stand-in ``google.colab``; a fresh VM is a new process with a
new, empty mount point over the same cloud. The test process itself never imports
``google.colab``: that would make every later test in this process look like Colab.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("googleapiclient", reason="needs google-api-python-client (test extra)")
pytest.importorskip("colab_standin", reason="needs the google.colab stand-in (scripts/setup)")

from colab_standin.cloud import Cloud
from colab_standin.server import DriveServer

from testkit.paths import with_testkit

from .godview import landed

CHILD = Path(__file__).with_name("child.py")


@dataclass
class Colab:
    """Google's side, and a way to start VMs against it."""

    tmp: Path
    server: DriveServer
    cloud: Cloud
    vms: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def cloud_dir(self) -> Path:
        return self.tmp / "cloud"

    def env(self, vm: str, lag: float, extra: dict[str, str] | None = None) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("NBRESUME_", "COLAB"))}
        env.pop("GOOGLE_APPLICATION_CREDENTIALS", None)
        env.update(
            COLAB_STANDIN_ROOT=str(self.cloud_dir),
            COLAB_STANDIN_API_URL=self.server.url,
            COLAB_STANDIN_UPLOAD_LAG_S=str(lag),
            NBRESUME_DRIVE_API_URL=self.server.url,
            NBRESUME_DRIVE_MOUNT=str(self.tmp / vm / "drive"),
            NBRESUME_DRIVE_POLL_S="0.1",
            # A fresh VM's session begins now; this machine's own (the age of its process 1)
            # may be past Colab's 12 h, and the run would stop before training.
            NBRESUME_SESSION_START=str(time.time()),
            OMP_NUM_THREADS="1",
            OPENBLAS_NUM_THREADS="1",
            PYTHONUNBUFFERED="1",
        )
        env.update(extra or {})
        (self.tmp / vm).mkdir(exist_ok=True)
        return with_testkit(env)

    def start(
        self, command: str, *args: str, vm: str, lag: float, env: dict[str, str] | None = None
    ) -> tuple[subprocess.Popen[bytes], Path]:
        """Start a VM running ``child.py command``; return it and its records file."""
        out = self.tmp / f"{vm}-{command}.jsonl"
        proc = subprocess.Popen(
            [sys.executable, str(CHILD), command, "--out", str(out), *args],
            env=self.env(vm, lag, env),
            cwd=self.tmp,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        self.vms.append(proc)
        return proc, out

    def start_script(self, code: str, *, vm: str, lag: float) -> subprocess.Popen[bytes]:
        """Start a VM running ``code`` (stdin and stdout are pipes)."""
        proc = subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(code)],
            env=self.env(vm, lag),
            cwd=self.tmp,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        self.vms.append(proc)
        return proc

    def run(
        self,
        command: str,
        *args: str,
        vm: str = "vm1",
        lag: float = 1.0,
        env: dict[str, str] | None = None,
        timeout: float = 120,
    ) -> list[dict[str, Any]]:
        """Run a VM to its end; its records. Fails the test when the VM fails."""
        proc, out = self.start(command, *args, vm=vm, lag=lag, env=env)
        stdout, stderr = proc.communicate(timeout=timeout)
        assert proc.returncode == 0, f"{command} failed:\n{stdout.decode()}\n{stderr.decode()}"
        return records(out)

    def cloud_landed(self, parts: list[str]) -> dict[int, bool]:
        """{step: whether it landed whole} on the cloud, seen directly."""
        return landed(self.cloud, parts)

    def kill(self, proc: subprocess.Popen[bytes]) -> None:
        """The VM goes away at once: no handler runs, nothing more is uploaded."""
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()


def records(path: Path) -> list[dict[str, Any]]:
    """The JSON lines a VM wrote (a line cut short by a kill is left out)."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def wait_until(predicate: Any, timeout: float = 60.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(0.02)


@pytest.fixture
def colab(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Colab]:
    """Google's side over an empty cloud (``@pytest.mark.parametrize`` ``quota`` to shrink it)."""
    quota = getattr(request, "param", None)
    cloud = Cloud(tmp_path / "cloud", quota_bytes=quota)
    server = DriveServer(str(tmp_path / "cloud")).start()
    colab = Colab(tmp_path, server, cloud)
    try:
        yield colab
    finally:
        for proc in colab.vms:
            if proc.poll() is None:
                colab.kill(proc)
            for stream in (proc.stdin, proc.stdout, proc.stderr):
                if stream is not None:
                    stream.close()
        server.stop()
        cloud.close()
