"""Google Colab: a VM that lives at most 12 hours, is recycled when idle, and keeps nothing
outside Google Drive.

Durable folders live in Drive, at ``<mount>/MyDrive/nbresume/<name>``. Mounting Drive and
confirming that a file really reached it are the job of :mod:`nbresume.platforms.drive`,
imported only when a durable folder is prepared.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from nbresume import knobs
from nbresume.errors import StorageError
from nbresume.platforms.base import (
    HOUR,
    DangerClock,
    Platform,
    check_run_name,
    is_inside,
    make_folder,
)

VM_LIFETIME_S = 12 * HOUR
#: Community-measured; Colab publishes no figure.
IDLE_DISCONNECT_S = 90 * 60.0


class ColabPlatform(Platform):
    """A Colab runtime."""

    name = "colab"
    title = "Google Colab"
    mtbf_s = 3 * HOUR

    @classmethod
    def detect(cls) -> bool:
        return (
            bool(os.environ.get("COLAB_RELEASE_TAG"))
            or "google.colab" in sys.modules
            or knobs.colab_marker().exists()
        )

    def why(self) -> str:
        if os.environ.get("COLAB_RELEASE_TAG"):
            return f"COLAB_RELEASE_TAG={os.environ['COLAB_RELEASE_TAG']}"
        return "google.colab is loaded" if "google.colab" in sys.modules else "Colab VM marker"

    def durable_base(self) -> Path:
        return knobs.drive_mount() / "MyDrive" / "nbresume"

    def prepare_root(self, name: str) -> str:
        """Mount Drive (asking the browser for permission the first time) and create the run's
        folder in it."""
        check_run_name(name)
        try:
            from nbresume.platforms.drive import mount_drive
        except ImportError as exc:
            raise StorageError(
                f"Google Drive support is not available: {exc}",
                where=str(knobs.drive_mount()),
                fix="pass dir= (a Drive folder you mounted yourself, or an fsspec URL) to "
                "nbresume.init",
            ) from None
        my_drive = mount_drive(str(knobs.drive_mount()))
        root = Path(my_drive) / "nbresume" / name
        make_folder(root)
        return str(root)

    def durable_warning(self, path: str) -> tuple[str, str] | None:
        if is_inside(path, knobs.drive_mount()):
            return None
        return (
            "on the VM's own disk, which is wiped when the runtime disconnects or is recycled",
            "keep checkpoints in Drive (the default without dir=) or at an object store URL",
        )

    def session_cap_s(self, accelerated: bool) -> float | None:
        return VM_LIFETIME_S

    def cap_name(self, accelerated: bool) -> str:
        return "Colab VM lifetime (12 h)"

    def danger_clocks(self, accelerated: bool) -> list[DangerClock]:
        return [
            DangerClock(
                "idle disconnect",
                IDLE_DISCONNECT_S,
                "the VM: memory, variables and /content (about 90 min without activity; the "
                "free tier also needs the browser tab open)",
                "checkpoints go to Drive on a clock; rerunning the notebook resumes from the "
                "newest verified one",
            ),
            DangerClock(
                "VM lifetime",
                VM_LIFETIME_S,
                "the VM and everything outside Drive, without a warning signal",
                "deadline='auto' saves and stops before 12 h from the VM's start",
            ),
            DangerClock(
                "Drive upload lag",
                None,
                "a checkpoint written to the Drive folder but not yet uploaded (large files "
                "can take many minutes)",
                "a checkpoint counts as saved only once Drive reports the same size and MD5; "
                "until then it shows as syncing",
            ),
        ]

    def accelerator_fix(self, kind: str, count: int = 1) -> str:
        if kind == "tpu":
            return "Runtime → Change runtime type → TPU, then run the notebook from the top"
        return (
            "Runtime → Change runtime type → a GPU (T4 on the free tier), then run the "
            "notebook from the top; when no GPU is available, try again later"
        )

    def internet_fix(self) -> str:
        return (
            "Colab runtimes normally reach the internet: Runtime → Disconnect and delete "
            "runtime, then connect again"
        )
