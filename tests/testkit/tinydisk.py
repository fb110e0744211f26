"""A real, small file system for a child process: a tmpfs in a private mount namespace."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

import pytest


def on_a_tiny_disk(mount: Path, argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` with the folder ``mount`` as its last argument, a 4 MiB tmpfs mounted
    there that only it sees (``unshare``, no privileges needed); its output captured. The test
    skips where such a file system cannot be mounted."""
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("needs util-linux `unshare` to mount a small tmpfs without privileges")
    mount.mkdir()
    shell = 'mount -t tmpfs -o size=4m nbresume-test "$1" || exit 77; m=$1; shift; exec "$@" "$m"'
    namespace = [unshare, "--user", "--map-root-user", "--mount"]
    proc = subprocess.run(
        [*namespace, "sh", "-c", shell, "sh", str(mount), *argv],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if proc.returncode == 77 or proc.stderr.startswith("unshare:"):
        pytest.skip(f"cannot mount a tmpfs in a user namespace here: {proc.stderr.strip()}")
    return proc
