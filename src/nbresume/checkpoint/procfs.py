"""What Linux's ``/proc`` says about processes and this boot: the one reader of it.

Every function answers ``None`` or ``""`` where ``/proc`` is missing (macOS) or the entry
cannot be read (the process is gone); the callers decide what that means for them.
"""

from __future__ import annotations

import os


def read_text(path: str) -> str:
    """A small ``/proc`` file's text, stripped; ``""`` where it cannot be read."""
    try:
        with open(path, encoding="ascii", errors="replace") as handle:
            return handle.read().strip()
    except OSError:
        return ""


def has_proc() -> bool:
    """Whether this system has a ``/proc`` that describes processes (Linux)."""
    return os.path.exists("/proc/self/stat")


def stat_fields(pid: int | str) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name: ``[state, ppid, ...]``,
    the start time (clock ticks since boot) at index 19; ``None`` where unreadable. The
    command name, in parentheses, may hold spaces and parentheses itself."""
    fields = read_text(f"/proc/{pid}/stat").rpartition(")")[2].split()
    return fields if len(fields) > 19 else None


def state(pid: int | str) -> str | None:
    """The process's state letter (``R``, ``S``, ``T``, ``Z``, ...), or ``None``."""
    fields = stat_fields(pid)
    return fields[0] if fields else None


def start_ticks(pid: int | str) -> int | None:
    """When the process started, in clock ticks since boot, or ``None``."""
    fields = stat_fields(pid)
    return int(fields[19]) if fields else None


def process_runs(pid: int | None, started: int | str | None = None) -> bool:
    """Whether the process ``pid`` runs: it exists and is no zombie (ended, waiting for its
    parent to reap it), and where ``started`` is given (its start time, in clock ticks since
    boot, as :func:`start_ticks` reads it) it is that process, not a later one under a
    reused pid. Without ``/proc`` (macOS) the kernel only says whether the pid exists. Where
    the kernel cannot tell, the answer is yes: a caller never takes a live process for gone."""
    if pid is None or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):
        return False  # gone, or a pid no process can have
    except PermissionError:
        pass  # it exists, under another user
    except OSError:
        return True  # cannot tell
    if not has_proc():
        return True
    fields = stat_fields(pid)
    if fields is None or fields[0] in ("Z", "X"):
        return False  # ended between the two looks, or killed and not yet reaped
    return started is None or started == "" or fields[19] == str(started)


def group_members(pgid: int) -> list[int] | None:
    """The processes of the process group ``pgid`` that still run (zombies, which have ended
    and wait to be reaped, left out); ``None`` where ``/proc`` is missing."""
    if not has_proc():
        return None
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        fields = stat_fields(entry)  # [state, ppid, pgrp, ...]
        if fields is not None and fields[2] == str(pgid) and fields[0] not in ("Z", "X"):
            members.append(int(entry))
    return members


def boot_id() -> str:
    """An id of this boot of the machine (``""`` where unknown): a reboot ends every process."""
    return read_text("/proc/sys/kernel/random/boot_id")


def uptime() -> float | None:
    """Seconds since this machine booted, or ``None``."""
    text = read_text("/proc/uptime")
    try:
        return float(text.split()[0])
    except (IndexError, ValueError):
        return None


def status_bytes(field: str, pid: int | str = "self") -> int | None:
    """A size field of ``/proc/<pid>/status`` (``VmSize``: address space mapped; ``VmRSS``:
    resident; ``VmHWM``: the peak of it) in bytes, or ``None``."""
    for line in read_text(f"/proc/{pid}/status").splitlines():
        name, _, value = line.partition(":")
        if name == field:
            try:
                return int(value.split()[0]) * 1024
            except (IndexError, ValueError):
                return None
    return None


def address_space_room() -> tuple[int | None, int | None]:
    """The address space this process may still map under its ``RLIMIT_AS`` (``ulimit -v``,
    common on Slurm and SGE sites), and that limit; ``(None, None)`` without a limit. Fresh
    memory takes address space as soon as it is asked for, touched or not, so where such a
    limit is set, it bounds what may be allocated before any page is used."""
    try:
        import resource
    except ImportError:  # not a Unix
        return None, None
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY or soft < 0:
        return None, None
    mapped = status_bytes("VmSize")
    return (None if mapped is None else max(0, soft - mapped)), soft
