"""What every platform tells nbresume: how to recognise it, where durable files go, and which
clocks can end the work.

A platform is recognised by looking only (environment variables, marker files, paths,
``sys.modules``); nothing heavy is imported to find out where we are. Each platform module
(``colab``, ``kaggle``, ``cluster``, ``local``) subclasses :class:`Platform`; the registry is in
:mod:`nbresume.platforms`.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from nbresume import knobs
from nbresume.checkpoint.loop import session_started_at
from nbresume.checkpoint.units import format_duration
from nbresume.errors import StorageError, UsageError

if TYPE_CHECKING:
    from nbresume.checkpoint.store import CheckpointInfo

HOUR = 3600.0

#: Every environment variable that changes what nbresume detects about the machine: which
#: platform it is on (Colab, Kaggle, Slurm, Kubernetes, SSH), which accelerator it has, and how
#: many threads it may use. A harness that wants a neutral machine (a test, a smoke run) clears
#: exactly these; a new detection variable belongs here.
DETECTION_VARIABLES: tuple[str, ...] = (
    "COLAB_RELEASE_TAG",
    "COLAB_TPU_ADDR",
    "KAGGLE_KERNEL_RUN_TYPE",
    "KAGGLE_URL_BASE",
    "ISTPUVM",
    "TPU_ACCELERATOR_TYPE",
    "TPU_NAME",
    "XRT_TPU_CONFIG",
    "SLURM_JOB_ID",
    "SLURM_JOB_END_TIME",
    "SLURM_ARRAY_JOB_ID",
    "SLURM_ARRAY_TASK_ID",
    "SLURM_PROCID",
    "KUBERNETES_SERVICE_HOST",
    "SSH_CONNECTION",
    "SSH_CLIENT",
    "SSH_TTY",
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
)

#: Text shared by every platform's "no GPU" fix.
GPU_VISIBLE_FIX = (
    "check that `nvidia-smi` lists the GPU and that CUDA_VISIBLE_DEVICES does not hide it"
)


@dataclass(frozen=True)
class DangerClock:
    """Something on a timer that can end the work.

    Attributes:
        name: what it is ("idle disconnect", "session cap").
        seconds: how long until it strikes (``None``: unknown, or not on a fixed timer).
        loses: what is lost when it strikes.
        protection: what nbresume does about it.
    """

    name: str
    seconds: float | None
    loses: str
    protection: str

    def to_dict(self) -> dict[str, object]:
        return {
            "name": self.name,
            "seconds": self.seconds,
            "loses": self.loses,
            "protection": self.protection,
        }


class Platform(ABC):
    """A place where training runs. Instances are cheap; every knob is read when needed."""

    #: Short identifier (``"kaggle-batch"``), also accepted by NBRESUME_PLATFORM.
    name: ClassVar[str]
    #: Human name for reports (``"Kaggle (Save & Run All)"``).
    title: ClassVar[str]
    #: Whether a failed preflight check raises by default (no one is watching the run).
    strict_default: ClassVar[bool] = False
    #: Expected time between interruptions, in seconds; the Young/Daly cadence uses it.
    mtbf_s: ClassVar[float] = 24 * HOUR
    #: The checkpoint :meth:`prepare_root` copied in from an earlier run's output, if any.
    seeded: CheckpointInfo | None = None

    #: The environment variables that tell this platform: by default :meth:`detect` sees it
    #: when any of them is set, and :meth:`why` shows the first with its value.
    detected_by: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def detect(cls) -> bool:
        """Whether this process runs on this platform. Looks; imports nothing heavy."""
        return any(os.environ.get(variable) for variable in cls.detected_by)

    def why(self) -> str:
        """What detection saw, for the report (``"KAGGLE_KERNEL_RUN_TYPE=Batch"``)."""
        if not self.detected_by:
            return ""
        variable = self.detected_by[0]
        return f"{variable}={os.environ.get(variable, '')}"

    # -- the durable folder ----------------------------------------------------------------

    @abstractmethod
    def durable_base(self) -> Path:
        """The folder under which each run gets its own durable folder."""

    def default_root(self, name: str) -> str:
        """The durable folder of run ``name``, without creating, mounting or seeding it."""
        return str(self.durable_base() / check_run_name(name))

    def prepare_root(self, name: str) -> str:
        """Make the durable folder of run ``name`` ready (mount, create, seed) and return it."""
        root = Path(self.default_root(name))
        make_folder(root)
        return str(root)

    def durable_warning(self, path: str) -> tuple[str, str] | None:
        """Why ``path`` may not survive the end of the session, and the fix; ``None`` when it
        should survive."""
        return None

    # -- clocks ----------------------------------------------------------------------------

    def session_cap_s(self, accelerated: bool) -> float | None:
        """The platform's limit on a session's length in seconds (``None``: none)."""
        return None

    def cap_name(self, accelerated: bool) -> str:
        """How reports name the cap (``"Kaggle GPU session (9 h)"``)."""
        return ""

    def session_deadline(self, accelerated: bool) -> tuple[float | None, str]:
        """When the platform will end this session (a Unix time) and what that is called.

        NBRESUME_SESSION_CAP replaces the platform's figure; the cap is counted from the
        session's real start (see :func:`nbresume.checkpoint.loop.session_started_at`).
        """
        cap = knobs.session_cap()
        label = self.cap_name(accelerated)
        if cap == knobs.UNSET:
            cap = self.session_cap_s(accelerated)
        else:
            label = f"{knobs.SESSION_CAP.name} ({format_duration(cap) if cap else 'none'})"
        if cap is None:
            return None, ""
        return session_started_at() + cap, label

    @abstractmethod
    def danger_clocks(self, accelerated: bool) -> list[DangerClock]:
        """The timers that can end the work here, with what they cost and how nbresume helps."""

    # -- fixes in the platform's own words -------------------------------------------------

    def accelerator_fix(self, kind: str, count: int = 1) -> str:
        """How to get an accelerator of ``kind`` (``"gpu"`` or ``"tpu"``) here."""
        if kind == "tpu":
            return "run on a machine with a TPU (a TPU VM); this one has none"
        return f"{self.gpu_request(count)}; {GPU_VISIBLE_FIX}"

    def gpu_request(self, count: int) -> str:
        """How to be given ``count`` GPUs here (:meth:`accelerator_fix` adds how to check
        that they are visible)."""
        return f"run on a machine with {'a GPU' if count == 1 else f'{count} GPUs'}"

    def internet_fix(self) -> str:
        """How to get internet access here."""
        return (
            "this machine cannot reach the internet: check its firewall or set HTTPS_PROXY; "
            "or download data and models beforehand"
        )

    def __repr__(self) -> str:
        return f"<platform {self.name}>"


def check_run_name(name: str) -> str:
    """``name`` when it can name a folder of its own, else a UsageError with the fix."""
    if (
        not isinstance(name, str)
        or not name
        or name in (".", "..")
        or name.startswith(".")
        or "/" in name
        or "\\" in name
        or "\0" in name
        or len(name) > 200
    ):
        raise UsageError(
            f"{name!r} cannot name a run",
            fix="use a short name such as 'resnet-cifar': no slashes, not starting with a dot",
        )
    return name


def make_folder(path: Path) -> None:
    """Create ``path`` (and its parents), as a StorageError naming the place on failure."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise StorageError(
            f"cannot create the durable folder: {exc.strerror or exc}",
            where=str(path),
            fix=f"pass dir= to nbresume.init, or set {knobs.HOME.name} to a writable folder",
        ) from None


def is_inside(path: str | os.PathLike[str], folder: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is ``folder`` or inside it, after resolving symbolic links."""
    target = os.path.realpath(path)
    parent = os.path.realpath(folder)
    return target == parent or target.startswith(parent.rstrip("/") + "/")
