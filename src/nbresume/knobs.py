"""Every environment variable nbresume reads, in one place.

Precedence, everywhere: an explicit argument (``nbresume.init(dir=...)``,
``preflight(internet=...)``) wins over the environment variable, which wins over the
platform's default. Variables are read when they are needed, never cached at import, so a
notebook cell or a test can set one and the next call sees it.

Each variable is listed in :data:`KNOBS` with its default and what it is for; the accessor
functions below parse them and raise :class:`~nbresume.errors.UsageError` naming the
variable when a value cannot be used.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from nbresume.checkpoint.units import parse_duration
from nbresume.errors import UsageError


@dataclass(frozen=True)
class Knob:
    """One environment variable: its name, its default (as text) and its purpose."""

    name: str
    default: str
    help: str

    def raw(self) -> str:
        """The variable's value, or the default when it is unset or empty."""
        return os.environ.get(self.name) or self.default


HOME = Knob(
    "NBRESUME_HOME",
    "~/nbresume",
    "parent folder of the durable folders on SSH boxes, Slurm, Kubernetes and local machines",
)
PLATFORM = Knob(
    "NBRESUME_PLATFORM",
    "",
    "force a platform (colab, kaggle, kaggle-batch, slurm, kubernetes, ssh, local) "
    "instead of detecting it",
)
STRICT = Knob(
    "NBRESUME_STRICT",
    "",
    "1: a failed preflight check raises; 0: it warns. Unset: raise only in a Kaggle batch run",
)
KAGGLE_ROOT = Knob("NBRESUME_KAGGLE_ROOT", "/kaggle", "Kaggle's root (working/, input/, temp/)")
DRIVE_MOUNT = Knob("NBRESUME_DRIVE_MOUNT", "/content/drive", "where Google Drive is mounted")
DRIVE_API_URL = Knob(
    "NBRESUME_DRIVE_API_URL",
    "",
    "root URL of the Google Drive API (default: Google's); for a test server on loopback",
)
DRIVE_POLL_S = Knob(
    "NBRESUME_DRIVE_POLL_S", "5", "seconds between two checks of whether Drive has a checkpoint"
)
COLAB_MARKER = Knob(
    "NBRESUME_COLAB_MARKER", "/var/colab/hostname", "a file that exists only on a Colab VM"
)
CGROUP_ROOT = Knob(
    "NBRESUME_CGROUP_ROOT", "/sys/fs/cgroup", "the cgroup file system (memory and CPU limits)"
)
MOUNTINFO = Knob(
    "NBRESUME_MOUNTINFO",
    "/proc/self/mountinfo",
    "the mount table, used to tell a mounted volume from a pod's own file system",
)
PROBE_HOST = Knob("NBRESUME_PROBE_HOST", "pypi.org", "host the internet check resolves")
PROBE_PORT = Knob("NBRESUME_PROBE_PORT", "443", "TCP port the internet check connects to")
PROBE_TIMEOUT = Knob(
    "NBRESUME_PROBE_TIMEOUT", "1.0", "seconds the internet check may take before it says 'off'"
)
SESSION_START = Knob(
    "NBRESUME_SESSION_START",
    "",
    "Unix time the session began (default: the start of the container's first process)",
)
SESSION_CAP = Knob(
    "NBRESUME_SESSION_CAP",
    "",
    "the platform's session cap as a duration ('9h', '12h') or 'none', instead of the "
    "platform's figure",
)
SLURM_REQUEUE = Knob(
    "NBRESUME_SLURM_REQUEUE",
    "auto",
    "after a stop signal in a Slurm job, ask Slurm to requeue it: auto (after SIGUSR1), "
    "always (SIGUSR1 and SIGTERM) or never",
)
SMOKE_STEPS = Knob(
    "NBRESUME_SMOKE_STEPS",
    "",
    "N: a smoke run; every steps()/epochs() loop saves and stops after N steps, as at a "
    "deadline (set by `nbresume smoke`)",
)
CHECK_DIR = Knob(
    "NBRESUME_CHECK_DIR",
    "",
    "a folder: every Checkpointer's folder, and nbresume.init's run folder, becomes a "
    "sub-folder of it named after the original's last part (set by `nbresume check`)",
)
STOP_AT_STEP = Knob(
    "NBRESUME_STOP_AT_STEP",
    "",
    "N: every steps()/epochs() loop saves at step N and stops, as at a deadline; unlike "
    "NBRESUME_SMOKE_STEPS a resumed run stops at the same step (set by `nbresume check`)",
)
SAVE_EVERY = Knob(
    "NBRESUME_SAVE_EVERY",
    "",
    "N: every Checkpointer saves every N steps, whatever its every= says (set by "
    "`nbresume check`, so that its kills land between saves and inside them)",
)

HASH = Knob(
    "NBRESUME_HASH",
    "",
    "the hash of new checkpoints: xxh3-128 (format v1.1) or sha256 (format v1); default: "
    "xxh3-128 where the xxhash package is installed",
)
GPU_DIRECT_READ = Knob(
    "NBRESUME_GPU_DIRECT_READ",
    "1",
    "1 (default): a restore into a model or optimizer on one GPU reads its tensor file onto "
    "the GPU through a few pinned buffers (faster, less host memory); 0: through host memory "
    "as large as the file, then copied",
)
GPU_SNAPSHOT = Knob(
    "NBRESUME_GPU_SNAPSHOT",
    "1",
    "1 (default): an asynchronous save first copies GPU tensors into GPU memory (a fraction "
    "of a millisecond per GB), then to the host while training goes on, where the training's "
    "peak memory leaves room for that copy; 0: straight to the host, training waiting for it",
)

#: Every knob, by variable name.
KNOBS: dict[str, Knob] = {
    k.name: k
    for k in (
        HOME,
        PLATFORM,
        STRICT,
        KAGGLE_ROOT,
        DRIVE_MOUNT,
        DRIVE_API_URL,
        DRIVE_POLL_S,
        COLAB_MARKER,
        CGROUP_ROOT,
        MOUNTINFO,
        PROBE_HOST,
        PROBE_PORT,
        PROBE_TIMEOUT,
        SESSION_START,
        SESSION_CAP,
        SLURM_REQUEUE,
        SMOKE_STEPS,
        CHECK_DIR,
        STOP_AT_STEP,
        SAVE_EVERY,
        GPU_DIRECT_READ,
        GPU_SNAPSHOT,
        HASH,
    )
}


def home() -> Path:
    """The parent of durable folders outside Colab and Kaggle."""
    return Path(HOME.raw()).expanduser()


def platform() -> str | None:
    """The forced platform name, or ``None`` to detect."""
    return PLATFORM.raw().strip().lower() or None


def strict() -> bool | None:
    """``True``/``False`` when NBRESUME_STRICT is set, else ``None`` (the platform decides)."""
    return _switch(STRICT)


def gpu_direct_read() -> bool:
    """Whether NBRESUME_GPU_DIRECT_READ turns on reading tensor files straight onto a GPU."""
    return _on(GPU_DIRECT_READ)


def gpu_snapshot() -> bool:
    """Whether NBRESUME_GPU_SNAPSHOT lets an asynchronous save copy GPU tensors on the GPU
    first."""
    return _on(GPU_SNAPSHOT)


def _switch(knob: Knob) -> bool | None:
    """A 1-or-0 knob (yes/no, true/false and on/off alike), ``None`` when it is empty."""
    value = knob.raw().strip().lower()
    if not value:
        return None
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise _bad(knob, value, "1 or 0")


def _on(knob: Knob) -> bool:
    """A 1-or-0 knob that must be set (it has a default)."""
    value = _switch(knob)
    if value is None:
        raise _bad(knob, "", "1 or 0")
    return value


def kaggle_root() -> Path:
    return Path(KAGGLE_ROOT.raw())


def drive_mount() -> Path:
    return Path(DRIVE_MOUNT.raw())


def colab_marker() -> Path:
    return Path(COLAB_MARKER.raw())


def cgroup_root() -> Path:
    return Path(CGROUP_ROOT.raw())


def mountinfo() -> Path:
    return Path(MOUNTINFO.raw())


def probe_target() -> tuple[str, int]:
    """The (host, port) the internet check connects to."""
    text = PROBE_PORT.raw()
    try:
        port = int(text)
    except ValueError:
        raise _bad(PROBE_PORT, text, "a TCP port number such as 443") from None
    if not 0 < port < 65536:
        raise _bad(PROBE_PORT, text, "a TCP port number such as 443")
    return PROBE_HOST.raw(), port


def probe_timeout() -> float:
    text = PROBE_TIMEOUT.raw()
    try:
        value = float(text)
    except ValueError:
        raise _bad(PROBE_TIMEOUT, text, "seconds, such as 1.0") from None
    if not 0 < value <= 60:
        raise _bad(PROBE_TIMEOUT, text, "seconds between 0 and 60")
    return value


def session_start() -> float | None:
    """The session's start as a Unix time when NBRESUME_SESSION_START is set."""
    text = SESSION_START.raw().strip()
    if not text:
        return None
    try:
        return float(text)
    except ValueError:
        raise _bad(SESSION_START, text, "a Unix time in seconds") from None


#: Returned by :func:`session_cap` when the variable is unset (the platform decides).
UNSET = -1.0


def session_cap() -> float | None:
    """The session cap in seconds from NBRESUME_SESSION_CAP, ``None`` for 'none', or
    :data:`UNSET` when the variable is not set."""
    text = SESSION_CAP.raw().strip().lower()
    if not text:
        return UNSET
    if text in ("none", "0", "off"):
        return None
    try:
        return parse_duration(text)
    except ValueError:
        raise _bad(SESSION_CAP, text, "a duration such as '9h' or 'none'") from None


def slurm_requeue() -> str:
    """``"auto"``, ``"always"`` or ``"never"``: when a stopped Slurm job asks to be requeued."""
    value = SLURM_REQUEUE.raw().strip().lower()
    value = {"1": "always", "true": "always", "yes": "always", "on": "always"}.get(value, value)
    value = {"0": "never", "false": "never", "no": "never", "off": "never"}.get(value, value)
    if value not in ("auto", "always", "never"):
        raise _bad(SLURM_REQUEUE, value, "auto, always or never")
    return value


def smoke_steps() -> int | None:
    """The steps each training loop may run in a smoke run, or ``None`` outside one."""
    return _steps(SMOKE_STEPS, example=3)


def stop_at_step() -> int | None:
    """The step every training loop saves at and stops (``nbresume check``), or ``None``."""
    return _steps(STOP_AT_STEP)


def save_every() -> int | None:
    """The cadence in steps every Checkpointer saves at (``nbresume check``), or ``None``."""
    return _steps(SAVE_EVERY)


def _steps(knob: Knob, example: int = 20) -> int | None:
    text = knob.raw().strip()
    if not text:
        return None
    try:
        value = int(text)
    except ValueError:
        raise _bad(knob, text, f"a number of steps such as {example}") from None
    if value < 1:
        raise _bad(knob, text, f"a number of steps such as {example}")
    return value


#: The sub-folder of NBRESUME_CHECK_DIR each original folder was given, in this process.
_CHECK_FOLDERS: dict[str, str] = {}


def check_dir(original: object) -> str | None:
    """Where a checkpoint folder goes under NBRESUME_CHECK_DIR (``nbresume check``), or
    ``None`` when the variable is unset.

    The sub-folder is named after the original's last part (``runs/exp1`` and
    ``s3://bucket/exp1`` -> ``exp1``), so that each of a script's Checkpointers keeps a
    folder of its own, the same one in every run; two originals of the same last part get
    ``exp1`` and ``exp1-2`` in the order they are made. A folder already inside it stays.
    """
    text = CHECK_DIR.raw().strip()
    if not text:
        return None
    root = Path(text).expanduser().absolute()
    location = str(getattr(original, "location", original)).rstrip("/\\")  # a store's too
    if "://" not in location:
        path = Path(location).expanduser().absolute()
        if path == root or root in path.parents:
            return str(path)
        location = str(path)  # the same folder, however it is written
    if location in _CHECK_FOLDERS:
        return _CHECK_FOLDERS[location]
    name = location.replace("\\", "/").rsplit("/", 1)[-1]
    if name in ("", ".", "..") or name.endswith(":"):
        name = "checkpoints"
    taken = set(_CHECK_FOLDERS.values())
    folder, count = str(root / name), 1
    while folder in taken:
        count += 1
        folder = str(root / f"{name}-{count}")
    _CHECK_FOLDERS[location] = folder
    return folder


def _bad(knob: Knob, value: str, wanted: str) -> UsageError:
    return UsageError(
        f"{knob.name}={value!r} cannot be used",
        where=f"environment variable {knob.name}",
        fix=f"set it to {wanted}, or unset it for the default ({knob.default or 'none'})",
    )
