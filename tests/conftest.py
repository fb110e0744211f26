"""Fixtures shared by the checkpoint tests.

The helpers here build checkpoint folders the way a stranger would: from the format's
specification (docs/format.md), with plain ``json`` and ``hashlib``, never through nbresume's
own writer, so that a test of the reader cannot pass merely because reader and writer agree.
"""

from __future__ import annotations

import contextlib
import getpass
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

# The suite's tiers: the ``proc`` mark, given at collection, and the watch that keeps the
# in-process tier in-process (tests/tiers.py); how a run is spread over the workers
# (tests/schedule.py).
pytest_plugins = ["tiers", "schedule"]

if TYPE_CHECKING:
    from colab_standin.cloud import Cloud
    from colab_standin.server import DriveServer

# No test may reach a real service. The first-cell internet check probes a public host by
# default; point it (for this process and every child a test starts) at a closed loopback
# port, so "internet" is deterministically off unless a test brings its own loopback server.
os.environ.setdefault("NBRESUME_PROBE_HOST", "127.0.0.1")
os.environ.setdefault("NBRESUME_PROBE_PORT", "9")

_SANDBOX = pytest.StashKey[tuple[str, str | None]]()


def pytest_configure(config: pytest.Config) -> None:
    """Give this test process (and every process it starts) a temporary folder of its own,
    removed when the process ends.

    Tests SIGKILL training runs on purpose; what such a run had in the temporary folder
    (multiprocessing's ``pymp-*`` folders, a half-written ``torch.save``) is never cleaned up
    by the run itself, and neither is what a library keeps there (IPython's test shell keeps
    its history database). pytest's own ``tmp_path`` folders stay where pytest keeps them."""
    os.environ.setdefault("PYTEST_DEBUG_TEMPROOT", tempfile.gettempdir())
    sandbox = tempfile.mkdtemp(prefix="nbresume-tests-")
    config.stash[_SANDBOX] = (sandbox, os.environ.get("TMPDIR"))
    os.environ["TMPDIR"] = sandbox
    tempfile.tempdir = None  # gettempdir() reads TMPDIR again


def pytest_unconfigure(config: pytest.Config) -> None:
    sandbox, before = config.stash.get(_SANDBOX, (None, None))
    if sandbox is None:
        return
    if before is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = before
    tempfile.tempdir = None
    shutil.rmtree(sandbox, ignore_errors=True)
    if not hasattr(config, "workerinput"):  # the run itself, once its workers have ended
        # pytest removes the folders of tests that passed (tmp_path_retention_policy) but
        # leaves their parent, pytest-of-<user>, behind, empty; one that holds a failed
        # test's folder stays.
        # (getuser() raises where the user has no name: pytest then says "unknown".)
        with contextlib.suppress(OSError, KeyError):
            root = Path(os.environ["PYTEST_DEBUG_TEMPROOT"]) / f"pytest-of-{getpass.getuser()}"
            root.rmdir()


@pytest.fixture(autouse=True)
def _drive_sign_in_stays_in_its_test() -> Iterator[None]:
    """Signing in to Drive in-process (``google.colab.auth.authenticate_user()``) points
    ``GOOGLE_APPLICATION_CREDENTIALS`` at that test's simulated cloud; a later test, or a
    kernel it starts, would present that token to another cloud and be refused."""
    before = os.environ.get("GOOGLE_APPLICATION_CREDENTIALS")
    yield
    if before is None:
        os.environ.pop("GOOGLE_APPLICATION_CREDENTIALS", None)
    else:
        os.environ["GOOGLE_APPLICATION_CREDENTIALS"] = before


def spec_manifest(
    folder: Path,
    *,
    step: int | None = None,
    files: Iterable[str] | None = None,
    entries: dict[str, Any] | None = None,
    **overrides: Any,
) -> Path:
    """Write ``folder/manifest.json`` as the format specification describes it."""
    names = sorted(p.name for p in folder.iterdir() if p.name != "manifest.json" and not p.is_dir())
    if files is not None:
        names = list(files)
    listed: dict[str, Any] = {}
    for name in names:
        data = (folder / name).read_bytes() if (folder / name).exists() else b""
        listed[name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    listed.update(entries or {})
    document: dict[str, Any] = {
        "format": "nbresume-checkpoint",
        "format_version": 1,
        "step": int(folder.name) if step is None else step,
        "created": "2024-01-01T00:00:00+00:00",
        "writer": "by hand",
        "metrics": {},
        "files": listed,
    }
    document.update(overrides)
    path = folder / "manifest.json"
    path.write_text(json.dumps(document, indent=1))
    return path


@pytest.fixture
def forge_manifest() -> Callable[..., Path]:
    """Writes a manifest naming ``files`` (default: every file in the folder) with their true
    sizes and SHA-256; keyword arguments replace top-level fields, ``entries`` file entries."""
    return spec_manifest


@pytest.fixture
def ckpt_dir(tmp_path: Path) -> Path:
    """A checkpoint folder that does not exist yet (the store creates it)."""
    return tmp_path / "runs" / "exp1"


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def sha256() -> Callable[[Path], str]:
    return sha256_of


@pytest.fixture
def cloud(tmp_path: Path) -> Iterator[tuple[Cloud, DriveServer]]:
    """Google's side of a simulated Drive: the cloud (``tmp_path / "cloud"``, read directly) and
    the Drive API server over it, on loopback."""
    pytest.importorskip("googleapiclient", reason="needs google-api-python-client (test extra)")
    pytest.importorskip("colab_standin", reason="needs the google.colab stand-in (scripts/setup)")
    from colab_standin.cloud import Cloud
    from colab_standin.server import DriveServer

    god = Cloud(tmp_path / "cloud")
    server = DriveServer(str(tmp_path / "cloud")).start()
    try:
        yield god, server
    finally:
        server.stop()
        god.close()
