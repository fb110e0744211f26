"""The machinery behind the ``google.colab`` stand-in: simulated cloud, DriveFS, API server.

Tests use these names directly: :func:`disconnect` (the VM goes away: pending uploads are
lost), :func:`api_url` (the Drive API server of this process, started on first use unless
``COLAB_STANDIN_API_URL`` names one), :class:`Cloud` (what Google's servers hold).
"""

from __future__ import annotations

from colab_standin.guard import refuse_on_colab

refuse_on_colab()

# ruff: noqa: E402  (the guard runs before anything else is imported)

import os
import shutil
import time
from pathlib import Path

from colab_standin.cloud import Cloud
from colab_standin.drivefs import LAG_ENV, ROOT_ENV, Mount
from colab_standin.server import DriveServer

API_URL_ENV = "COLAB_STANDIN_API_URL"

MOUNTS: dict[str, Mount] = {}
_SERVER: list[DriveServer] = []

__all__ = [
    "API_URL_ENV",
    "LAG_ENV",
    "MOUNTS",
    "ROOT_ENV",
    "Cloud",
    "DriveServer",
    "access_token",
    "api_url",
    "disconnect",
    "flush_all",
    "start_mount",
    "unmount_folder",
]


def start_mount(mountpoint: Path, cloud_root: Path, *, readonly: bool = False) -> Mount:
    mount = Mount(mountpoint, cloud_root, readonly=readonly)
    mount.start()
    MOUNTS[os.path.realpath(mountpoint)] = mount
    return mount


def unmount_folder(mountpoint: Path) -> None:
    for entry in list(mountpoint.iterdir()):
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)


def flush_all(timeout_s: float) -> bool:
    """Push every mount's pending changes, then unmount them all; False on a timeout."""
    deadline = time.monotonic() + timeout_s
    ok = all([m.flush(max(0.0, deadline - time.monotonic())) for m in MOUNTS.values()])
    if ok:
        for key, mount in list(MOUNTS.items()):
            mount.stop()
            unmount_folder(mount.mountpoint)
            del MOUNTS[key]
    return ok


def disconnect() -> None:
    """The VM went away: every mount stops at once and what had not uploaded is lost."""
    for key, mount in list(MOUNTS.items()):
        mount.stop()
        del MOUNTS[key]


def access_token() -> str:
    """The access token the simulated Google accepts (stored with the cloud)."""
    root = os.environ.get(ROOT_ENV)
    if not root:
        raise RuntimeError(f"set {ROOT_ENV} (the simulated Drive's folder)")
    cloud = Cloud(root)
    try:
        return cloud.access_token
    finally:
        cloud.close()


def api_url() -> str:
    """The Drive API server's root URL (``http://127.0.0.1:PORT/``)."""
    url = os.environ.get(API_URL_ENV)
    if url:
        return url
    if not _SERVER:
        root = os.environ.get(ROOT_ENV)
        if not root:
            raise RuntimeError(f"set {ROOT_ENV} (the simulated Drive's folder) or {API_URL_ENV}")
        _SERVER.append(DriveServer(root).start())
    os.environ[API_URL_ENV] = _SERVER[0].url
    return _SERVER[0].url
