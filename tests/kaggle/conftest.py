"""Fixtures for the Kaggle tests: a fake Kaggle on loopback, and the ``nbresume`` command run
as a user runs it (a process of its own, the real kaggle client inside) pointed at it.

Nothing here may reach the real Kaggle. Three guards, each checked after every test:
every process the tests start loads ``netguard/sitecustomize.py``, which refuses and logs
any connection or name lookup that is not loopback; the client's proxies point at the fake
server, which records every request and refuses tunnels (``CONNECT``, an https call); and the
fake server checks that every request was meant for localhost.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from testkit.fake_kaggle import FakeKaggle, serving

HERE = Path(__file__).parent
NOTEBOOKS = HERE / "notebooks"
NETGUARD = HERE / "netguard"

# Looked up, not imported: `import kaggle` authenticates (and prints help) at import time.
for _package in ("kaggle", "papermill"):
    if importlib.util.find_spec(_package) is None:
        pytest.skip(
            f"the Kaggle tests need {_package}: pip install 'nbresume[kaggle]'",
            allow_module_level=True,
        )


@dataclass
class Result:
    code: int
    out: str
    err: str

    @property
    def text(self) -> str:
        return self.out + self.err


@pytest.fixture
def net_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The file where the network guard logs what it refused; empty at the end of a test."""
    log = tmp_path / "refused-connections.log"
    log.touch()
    monkeypatch.setenv("NBRESUME_TEST_NET_LOG", str(log))
    yield log
    refused = log.read_text()
    assert refused == "", f"a process tried to leave loopback:\n{refused}"


@pytest.fixture
def kaggle_server(tmp_path: Path, net_log: Path) -> Iterator[FakeKaggle]:
    """A fake Kaggle whose machines run notebooks for real; afterwards, every request it saw
    must have been meant for localhost."""
    with serving(tmp_path / "fake-kaggle", NETGUARD) as server:
        yield server


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    """A folder for the user's files (the notebook, kernel-metadata.json, downloads)."""
    folder = tmp_path / "user"
    folder.mkdir()
    return folder


def copy_notebook(name: str, folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / name
    shutil.copy(NOTEBOOKS / name, target)
    return target


def user_env(tmp_path: Path, server: FakeKaggle | None) -> dict[str, str]:
    """The environment of the user's shell: no stray Kaggle or nbresume settings, a home of
    its own (no real ~/.kaggle), the network guard, and the fake Kaggle's address."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("KAGGLE_", "NBRESUME_"))
        and k.lower() not in ("http_proxy", "https_proxy", "no_proxy", "all_proxy")
    }
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    env["HOME"] = str(home)
    # Temporary folders (a failed smoke run keeps its sandbox) stay inside the test's folder.
    temp = tmp_path / "tmp"
    temp.mkdir(exist_ok=True)
    env["TMPDIR"] = str(temp)
    env["PYTHONPATH"] = os.pathsep.join([str(NETGUARD), str(HERE.parent.parent / "src")])
    env["NBRESUME_TEST_NET_LOG"] = os.environ["NBRESUME_TEST_NET_LOG"]
    env["PYTHONUNBUFFERED"] = "1"
    # nbresume's own probes stay on loopback too (a closed port: "internet off").
    env["NBRESUME_PROBE_HOST"] = "127.0.0.1"
    env["NBRESUME_PROBE_PORT"] = str(server.refusing_port if server else 9)
    env["CUDA_VISIBLE_DEVICES"] = ""
    if server is not None:
        config = tmp_path / "kaggle-config"
        config.mkdir(exist_ok=True)
        env.update(server.client_env(config))
    return env


def nbresume(
    args: list[str],
    *,
    cwd: Path,
    env: dict[str, str],
    timeout: float = 300,
) -> Result:
    """Run the ``nbresume`` command in a process of its own: a new interpreter, since the
    network guard is a ``sitecustomize`` on ``PYTHONPATH``, which only a starting interpreter
    runs (a fork of the warm server would run without it)."""
    done = subprocess.run(
        [sys.executable, "-m", "nbresume.cli", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return Result(done.returncode, done.stdout, done.stderr)


def commit(
    tmp_path: Path,
    server: FakeKaggle,
    notebook: Path,
    slug: str,
    *args: str,
    owner: str | None = None,
    timeout: float = 300,
) -> Result:
    """Run ``nbresume commit`` of ``notebook`` as the kernel ``<owner>/<slug>`` (the fake
    Kaggle's user unless told), from the notebook's folder, in the user's environment."""
    kernel = f"{owner or server.username}/{slug}"
    return nbresume(
        ["commit", str(notebook), "--kernel", kernel, *args],
        cwd=notebook.parent,
        env=user_env(tmp_path, server),
        timeout=timeout,
    )
