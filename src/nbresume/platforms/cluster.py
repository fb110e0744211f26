"""Machines reached over SSH or through a scheduler: a rented box, a Slurm job, a Kubernetes pod.

All three keep durable folders under ``$NBRESUME_HOME`` (default ``~/nbresume``). They differ
in what ends the work: nothing at all on a rented box (it bills until destroyed), the job's
time limit on Slurm, and SIGTERM followed by SIGKILL after a grace period on Kubernetes.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from nbresume import knobs
from nbresume.checkpoint.units import format_duration
from nbresume.platforms.base import (
    HOUR,
    DangerClock,
    Platform,
    is_inside,
)

#: Kubernetes' default terminationGracePeriodSeconds.
K8S_GRACE_S = 30.0
#: Slurm's default KillWait: seconds between SIGTERM and SIGKILL at the time limit.
SLURM_KILL_WAIT_S = 30.0

_OFFLINE_NODES_FIX = (
    "compute nodes are often kept offline: download data and models on a login node first, "
    "or ask the administrators for a proxy (HTTPS_PROXY)"
)


class _HomePlatform(Platform):
    """Durable folders under NBRESUME_HOME, on a machine that runs for half a day between
    interruptions."""

    mtbf_s = 12 * HOUR

    def durable_base(self) -> Path:
        return knobs.home()


class SshPlatform(_HomePlatform):
    """A rented or shared machine used over SSH."""

    name = "ssh"
    title = "SSH box"
    detected_by = ("SSH_CONNECTION", "SSH_CLIENT", "SSH_TTY")

    def why(self) -> str:
        return "SSH_CONNECTION is set"

    def danger_clocks(self, accelerated: bool) -> list[DangerClock]:
        return [
            DangerClock(
                "the rental meter",
                None,
                "money: nothing stops a forgotten box, and destroying it deletes its disk",
                "`nbresume pull` copies verified checkpoints off the box before you tear it down",
            ),
            DangerClock(
                "spot preemption",
                None,
                "the process, and on many providers the local disk (grace from about 2 min "
                "to none)",
                "periodic verified checkpoints; SIGTERM saves at the next step boundary",
            ),
            DangerClock(
                "SSH disconnect",
                None,
                "a process started in the foreground of the SSH session",
                "`nbresume run --detach` keeps the job running without the connection",
            ),
        ]


class SlurmPlatform(_HomePlatform):
    """A Slurm job (``sbatch`` or ``srun``)."""

    name = "slurm"
    title = "Slurm job"
    detected_by = ("SLURM_JOB_ID",)

    @staticmethod
    def end_time() -> float | None:
        """The job's end (SLURM_JOB_END_TIME, a Unix time), when Slurm exported it."""
        text = os.environ.get("SLURM_JOB_END_TIME", "").strip()
        try:
            value = float(text)
        except ValueError:
            return None
        return value if value > 0 else None

    def session_deadline(self, accelerated: bool) -> tuple[float | None, str]:
        if knobs.session_cap() != knobs.UNSET:
            return super().session_deadline(accelerated)
        end = self.end_time()
        if end is None:
            return None, ""
        return end, f"Slurm job time limit (job {os.environ.get('SLURM_JOB_ID', '?')})"

    def durable_warning(self, path: str) -> tuple[str, str] | None:
        return _scratch_warning(path, "deleted when the job ends")

    def danger_clocks(self, accelerated: bool) -> list[DangerClock]:
        end = self.end_time()
        return [
            DangerClock(
                "job time limit",
                None if end is None else max(0.0, end - time.time()),
                "the job: SIGTERM, then SIGKILL after KillWait "
                f"({format_duration(SLURM_KILL_WAIT_S)} by default)",
                "deadline='auto' saves and stops before SLURM_JOB_END_TIME; add "
                "`#SBATCH --signal=B:USR1@360` for an early warning and `--requeue` to continue",
            ),
            DangerClock(
                "preemption",
                None,
                "the job (requeued or cancelled, by partition policy)",
                "SIGTERM or SIGUSR1 saves at the next step boundary; a requeued job resumes "
                "from the newest verified checkpoint",
            ),
        ]

    def gpu_request(self, count: int) -> str:
        return (
            f"request GPUs with `#SBATCH --gres=gpu:{count}` (or `--gpus={count}`) and run "
            "inside the allocation"
        )

    def internet_fix(self) -> str:
        return _OFFLINE_NODES_FIX


class KubernetesPlatform(_HomePlatform):
    """A container in a Kubernetes pod."""

    name = "kubernetes"
    title = "Kubernetes pod"
    detected_by = ("KUBERNETES_SERVICE_HOST",)

    def why(self) -> str:
        return "KUBERNETES_SERVICE_HOST is set"

    def durable_warning(self, path: str) -> tuple[str, str] | None:
        scratch = _scratch_warning(path, "lost with the pod")
        if scratch:
            return scratch
        mount = mount_of(Path(path), knobs.mountinfo())
        if mount is None:
            return None  # no mount table to read: say nothing rather than guess
        point, fstype = mount
        if point == "/" or fstype in ("overlay", "tmpfs", "aufs"):
            return (
                f"on the pod's own file system ({fstype} at {point}), which is lost when the "
                "pod is deleted or rescheduled",
                f"mount a PersistentVolumeClaim and set {knobs.HOME.name} (or dir=) to a "
                "folder on it",
            )
        return None

    def danger_clocks(self, accelerated: bool) -> list[DangerClock]:
        return [
            DangerClock(
                "termination grace period",
                K8S_GRACE_S,
                "the pod: SIGTERM, then SIGKILL after terminationGracePeriodSeconds (30 s by "
                "default)",
                "SIGTERM saves at the next step boundary: keep a step plus a save shorter than "
                "the grace period, or raise it",
            ),
            DangerClock(
                "pod rescheduling",
                None,
                "everything on the pod's own file system",
                "checkpoints belong on a mounted volume; the preflight warns when they are not",
            ),
        ]

    def gpu_request(self, count: int) -> str:
        return (
            f"set `resources.limits: nvidia.com/gpu: {count}` in the pod spec (the NVIDIA "
            "device plugin must run on the node)"
        )

    def internet_fix(self) -> str:
        return (
            "the pod has no route out: check the cluster's NetworkPolicy and egress, or set "
            "HTTPS_PROXY; or bake data and models into the image or a volume"
        )


def _scratch_warning(path: str, fate: str) -> tuple[str, str] | None:
    """A warning when ``path`` is in node-local scratch (``/dev/shm``, the job's TMPDIR)."""
    scratch = ["/dev/shm"]  # noqa: S108 (a place we warn about, not one we write to)
    tmpdir = os.environ.get("TMPDIR", "")
    if tmpdir and os.path.realpath(tmpdir) not in ("/tmp", "/"):  # noqa: S108
        scratch.append(tmpdir)
    for folder in scratch:
        if is_inside(path, folder):
            return (
                f"in node-local scratch ({folder}), {fate}",
                f"set {knobs.HOME.name} (or dir=) to a shared or persistent folder",
            )
    return None


def mount_of(path: Path, mountinfo: Path) -> tuple[str, str] | None:
    """The mount point and file system type holding ``path`` (longest matching mount point),
    from a ``/proc/self/mountinfo`` table; ``None`` when the table cannot be read."""
    try:
        lines = mountinfo.read_text().splitlines()
    except OSError:
        return None
    target = os.path.realpath(path)
    best: tuple[str, str] | None = None
    for line in lines:
        left, _, right = line.partition(" - ")
        fields = left.split()
        if len(fields) < 5 or not right:
            continue
        point = _unescape(fields[4])
        fstype = right.split()[0]
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and (best is None or len(point) >= len(best[0])):
            best = (point, fstype)
    return best


def _unescape(field: str) -> str:
    """mountinfo writes space, tab, newline and backslash as octal escapes."""
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(code, char)
    return field
