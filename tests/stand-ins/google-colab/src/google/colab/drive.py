"""Stand-in for ``google.colab.drive``: same names, signatures and errors as Colab's.

``mount`` shows the simulated Drive (``COLAB_STANDIN_ROOT``) at ``<mountpoint>/MyDrive``, a
local cache whose changes upload lazily; ``flush_and_unmount`` pushes what is pending and
unmounts. See ``colab_standin.drivefs`` for what is simulated.
"""

from __future__ import annotations

import os as _os
from pathlib import Path as _Path

import colab_standin as _standin

__all__ = ["flush_and_unmount", "mount"]


def mount(
    mountpoint: str,
    force_remount: bool = False,
    timeout_ms: int = 120000,
    readonly: bool = False,
) -> None:
    """Mount your Google Drive at the specified mountpoint path."""
    if " " in mountpoint:
        raise ValueError("Mountpoint must not contain a space.")
    mountpoint = _os.path.expanduser(mountpoint)
    root = _os.environ.get(_standin.ROOT_ENV)
    if not root:
        raise NotImplementedError(
            __name__ + " is unsupported in this environment (the test stand-in simulates "
            f"Drive in the folder named by {_standin.ROOT_ENV}, which is not set)."
        )
    key = _os.path.realpath(mountpoint)
    if key in _standin.MOUNTS and not force_remount:
        print(
            f"Drive already mounted at {mountpoint}; to attempt to forcibly remount, "
            f'call drive.mount("{mountpoint}", force_remount=True).'
        )
        return
    if key in _standin.MOUNTS:
        # Colab kills the running DriveFS (`pkill -9 -x drive`): pending uploads are lost.
        _standin.MOUNTS.pop(key).stop()
        _standin.unmount_folder(_Path(mountpoint))
    if _os.path.islink(mountpoint):
        raise ValueError("Mountpoint must not be a symlink")
    if _os.path.isdir(mountpoint) and _os.listdir(mountpoint):
        raise ValueError("Mountpoint must not already contain files")
    if not _os.path.isdir(mountpoint) and _os.path.exists(mountpoint):
        raise ValueError("Mountpoint must either be a directory or not exist")
    normed = _os.path.normpath(mountpoint)
    if "/" in normed and not _os.path.exists(_os.path.dirname(normed)):
        raise ValueError("Mountpoint must be in a directory that exists")
    _os.makedirs(mountpoint, exist_ok=True)
    _standin.start_mount(_Path(mountpoint), _Path(root), readonly=readonly)
    print(f"Mounted at {mountpoint}")


def flush_and_unmount(timeout_ms: int = 24 * 60 * 60 * 1000) -> None:
    """Unmount Google Drive and flush any outstanding writes to it."""
    if not _standin.MOUNTS:
        print("Drive not mounted, so nothing to flush and unmount.")
        return
    if not _standin.flush_all(timeout_ms / 1000):
        raise ValueError("flush_and_unmount failed")
