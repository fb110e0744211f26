"""The memory and CPU this container really has, from its cgroup, not from the host.

On a rented slice of a big machine, ``free`` and ``os.cpu_count()`` describe the host. The
cgroup says what this container may use (``memory.max``, ``cpu.max``) and whether the kernel
already killed something for memory (``memory.events``: ``oom_kill``). torch sizes its thread
pool by the cores it sees, not by the CPU quota; :func:`cap_threads` fixes that.

cgroup v2 (one unified tree) is read first, then v1 (one tree per controller).
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from nbresume import knobs
from nbresume.checkpoint.units import format_bytes

#: v1 reports "no limit" as a huge number near 2**63.
_V1_UNLIMITED = 1 << 60


@dataclass(frozen=True)
class MemoryFacts:
    """Memory limit and use of this container (``None``: unknown or unlimited).

    ``reclaimable``: the container's file pages not used lately (``inactive_file``), which
    ``current`` counts but the kernel drops before it kills anything; ``host_available``: the
    host's MemAvailable."""

    limit: int | None
    current: int | None
    oom_kills: int | None
    host_total: int | None
    source: str
    reclaimable: int | None = None
    host_available: int | None = None

    @property
    def available(self) -> int | None:
        """Bytes this process can still allocate before the kernel kills something: the room
        under the container's limit, and no more than the host has available (``None`` when
        neither is known)."""
        room = [r for r in (self._room_under_limit(), self.host_available) if r is not None]
        return min(room) if room else None

    @property
    def bound(self) -> str:
        """What bounds :attr:`available`, in words."""
        room = self._room_under_limit()
        if room is not None and (self.host_available is None or room <= self.host_available):
            return f"under the container's limit of {format_bytes(self.limit)}, {self.source}"
        if self.host_available is not None:
            return "the host's MemAvailable"
        return "nothing known"

    def _room_under_limit(self) -> int | None:
        if self.limit is None or self.current is None:
            return None
        return max(0, self.limit - max(0, self.current - (self.reclaimable or 0)))


@dataclass(frozen=True)
class CpuFacts:
    """CPU quota of this container, in CPUs (``None``: no quota), and the cores it may run on."""

    quota: float | None
    affinity: int
    host: int
    source: str

    @property
    def usable(self) -> int:
        """Whole CPUs the container can keep busy: the quota rounded down, at least 1."""
        if self.quota is None:
            return self.affinity
        return max(1, min(self.affinity, math.floor(self.quota + 1e-9)))


def _own_paths(controller: str) -> list[str]:
    """This process's cgroup paths for ``controller`` ("" means v2), from /proc/self/cgroup,
    most specific first, ending with the root."""
    paths: list[str] = []
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        _, controllers, path = [*line.split(":", 2), "", ""][:3]
        if controllers.split(",") == [controller] or (controller == "" and controllers == ""):
            path = path.strip("/")
            if path:
                paths.append(path)
    return [*paths, ""]


def _first_existing(base: Path, controller: str, name: str) -> Path | None:
    for sub in _own_paths(controller):
        candidate = base / sub / name if sub else base / name
        if candidate.is_file():
            return candidate
    return None


def _read(path: Path | None) -> str | None:
    if path is None:
        return None
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _int(text: str | None) -> int | None:
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


def _keyed(text: str | None, key: str) -> int | None:
    """The number on the ``key <number>`` line of a cgroup file (memory.events, memory.stat)."""
    for line in (text or "").splitlines():
        name, _, value = line.partition(" ")
        if name == key:
            return _int(value.strip())
    return None


def host_memory(field: str = "MemTotal") -> int | None:
    """A field of /proc/meminfo (``MemTotal``, ``MemAvailable``) in bytes."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


#: The memory files of cgroup v2 and v1: use, OOM events, and the reclaimable field of
#: memory.stat (v1's usage_in_bytes counts the groups below: so does total_inactive_file).
_V2_FILES = ("memory.current", "memory.events", "inactive_file")
_V1_FILES = ("memory.usage_in_bytes", "memory.oom_control", "total_inactive_file")


def read_memory(root: Path | None = None) -> MemoryFacts:
    """The memory limit, use (and how much of it the kernel may reclaim) and OOM kill count of
    this container, and the host's total and available memory."""
    root = knobs.cgroup_root() if root is None else root
    host = host_memory()
    host_available = host_memory("MemAvailable")
    limit_file = _first_existing(root, "", "memory.max")
    v2 = limit_file is not None
    if not v2:
        limit_file = _first_existing(root / "memory", "memory", "memory.limit_in_bytes")
    if limit_file is not None:
        folder = limit_file.parent
        raw = _read(limit_file)
        limit = _int(raw)
        if raw == "max" or (not v2 and limit is not None and limit >= _V1_UNLIMITED):
            limit = None
        usage, events, inactive = _V2_FILES if v2 else _V1_FILES
        return MemoryFacts(
            limit=limit,
            current=_int(_read(folder / usage)),
            oom_kills=_keyed(_read(folder / events), "oom_kill"),
            host_total=host,
            source=str(limit_file),
            reclaimable=_keyed(_read(folder / "memory.stat"), inactive),
            host_available=host_available,
        )
    return MemoryFacts(
        None, None, None, host, "no cgroup memory files", host_available=host_available
    )


def available_memory(root: Path | None = None) -> tuple[int | None, str]:
    """The bytes this process can still allocate (``None``: unknown) and what bounds them, in
    words (:attr:`MemoryFacts.available`, :attr:`MemoryFacts.bound`)."""
    facts = read_memory(root)
    return facts.available, facts.bound


def read_cpu(root: Path | None = None) -> CpuFacts:
    """The CPU quota of this container and the cores it may run on."""
    root = knobs.cgroup_root() if root is None else root
    try:
        affinity = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        affinity = os.cpu_count() or 1
    host = os.cpu_count() or affinity
    quota: float | None = None
    source = "no cgroup CPU quota files"
    cpu_max = _first_existing(root, "", "cpu.max")
    if cpu_max is not None:  # cgroup v2: "<quota|max> <period>"
        source = str(cpu_max)
        fields = (_read(cpu_max) or "").split()
        if len(fields) == 2 and fields[0] != "max":
            quota = _ratio(_int(fields[0]), _int(fields[1]))
    else:
        v1 = root / "cpu"
        quota_file = _first_existing(v1, "cpu,cpuacct", "cpu.cfs_quota_us") or _first_existing(
            v1, "cpu", "cpu.cfs_quota_us"
        )
        if quota_file is not None:
            source = str(quota_file)
            quota = _ratio(
                _int(_read(quota_file)), _int(_read(quota_file.parent / "cpu.cfs_period_us"))
            )
    return CpuFacts(quota=quota, affinity=affinity, host=host, source=source)


def _ratio(quota: int | None, period: int | None) -> float | None:
    if quota is None or period is None or quota <= 0 or period <= 0:
        return None  # v1 writes -1 for "no quota"
    return quota / period


_THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


def cap_threads(threads: int | None = None) -> int:
    """Size torch's and OpenMP/MKL's thread pools to this container's CPU quota.

    torch starts one thread per core it sees, which on a slice of a large host is many more
    than the quota allows; the threads then fight over the slice and starve the GPU. Sets
    ``OMP_NUM_THREADS``, ``MKL_NUM_THREADS`` and ``OPENBLAS_NUM_THREADS`` (for libraries loaded
    later) and, when torch is already imported, ``torch.set_num_threads``. torch is not
    imported here. Returns the number of threads chosen.
    """
    if threads is None:
        threads = read_cpu().usable
    if threads < 1:
        raise ValueError(f"threads must be at least 1, got {threads}")
    for variable in _THREAD_VARIABLES:
        os.environ[variable] = str(threads)
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(threads)
    return threads
