"""Google's side of a simulated Colab for the framework tests on Google Drive.

:func:`vm_env` is the environment of a fresh VM over the ``cloud`` fixture (tests/conftest.py):
the stand-in ``google.colab``, whose mount uploads with a lag and loses what it has not uploaded
when the VM is killed.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from colab_standin.server import DriveServer


@pytest.fixture
def vm_env(tmp_path: Path, cloud: tuple[Any, DriveServer]) -> Callable[..., dict[str, str]]:
    """``vm_env(lag, mount, **extra)``: the environment of a fresh VM over :func:`cloud`,
    its Drive mounted at ``mount`` and uploading ``lag`` seconds late; none of this process's
    nbresume or Colab settings, one thread, ``extra`` on top."""
    server = cloud[1]

    def make(lag: float, mount: Path, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("NBRESUME_", "COLAB"))}
        env.pop("GOOGLE_APPLICATION_CREDENTIALS", None)
        env.update(
            COLAB_STANDIN_ROOT=str(tmp_path / "cloud"),
            COLAB_STANDIN_API_URL=server.url,
            COLAB_STANDIN_UPLOAD_LAG_S=str(lag),
            NBRESUME_DRIVE_API_URL=server.url,
            NBRESUME_DRIVE_MOUNT=str(mount),
            NBRESUME_DRIVE_POLL_S="0.1",
            # A fresh VM's session begins now; this machine's own (the age of its process 1)
            # may be past Colab's 12 h, and the run would stop before training.
            NBRESUME_SESSION_START=str(time.time()),
            OMP_NUM_THREADS="1",
        )
        env.update(extra)
        return env

    return make
