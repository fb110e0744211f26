"""Who holds a writer lease, and whether that holder is still alive.

A lease file records its holder (:class:`Holder`): host, process id and start time, the
machine's boot id and pid namespace, and when the lease was taken and last renewed.
:func:`judge` decides what a writer may do with a lease it found: ``"self"`` (held by this
process), ``"live"`` (another writer that runs: refuse), ``"stale"`` (a holder that is gone
on this machine, or a lease from elsewhere not renewed within its expiry: take it over), or
``"future"`` (a lease from elsewhere renewed later than this machine's clock allows: its date
says nothing, and the writer watches whether it is renewed).

A lease file is read as data from anywhere: :meth:`Holder.parse` takes only the types and
ranges nbresume writes (finite times between 1970 and 9999, a pid a process can have, strings
where strings go) and gives ``None`` for anything else, which a writer treats as a lease it
cannot read: stale.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from typing import Any, TypeGuard

from nbresume.checkpoint import procfs
from nbresume.checkpoint.units import format_duration

LEASE_FORMAT = "nbresume-lease"
LEASE_VERSION = 1
#: Seconds without renewal after which a lease from another machine is stale.
LEASE_EXPIRY_S = 180.0


@dataclass(frozen=True)
class Holder:
    """What a lease file says of the writer that holds the folder."""

    token: str
    host: str
    pid: int
    #: The machine beyond its host name: boot id and pid namespace ("" where unknown).
    machine: str = ""
    #: The process's start time as ``/proc/<pid>/stat`` gives it ("" where unknown).
    started: str = ""
    #: When the lease was taken and last renewed (Unix times, the holder's clock).
    since: float = 0.0
    renewed: float = 0.0
    #: Seconds after ``renewed`` at which the lease is stale, seen from another machine.
    expiry_s: float = LEASE_EXPIRY_S
    #: The holder's program (``train.py``, ``ipykernel_launcher.py``) and what it holds it for.
    program: str = ""
    purpose: str = ""

    def to_bytes(self) -> bytes:
        document = {"format": LEASE_FORMAT, "version": LEASE_VERSION, **asdict(self)}
        return json.dumps(document, indent=1).encode()

    @classmethod
    def parse(cls, data: bytes) -> Holder | None:
        """The holder a lease file names, or ``None`` when it is not a lease that can be read
        (not JSON, a field missing, of another type, or out of range)."""
        try:
            document = json.loads(data)
        except (ValueError, RecursionError):
            return None
        if not isinstance(document, dict):
            return None
        renewed = _time(document.get("renewed"))
        since = _time(document.get("since", renewed))
        pid = document.get("pid")
        if renewed is None or since is None or not _is_pid(pid):
            return None
        text = {key: document.get(key, "") for key in ("token", "host", "machine", "started")}
        if not all(isinstance(value, str) and len(value) <= 300 for value in text.values()):
            return None
        if not text["token"] or not text["host"]:
            return None
        return cls(
            token=text["token"],
            host=text["host"],
            pid=pid,
            machine=text["machine"],
            started=text["started"],
            since=since,
            renewed=renewed,
            expiry_s=_sane_expiry(document.get("expiry_s")),
            program=_label(document.get("program")),
            purpose=_label(document.get("purpose")),
        )

    def describe(self, now: float | None = None) -> str:
        """``pid 1234 on host 'gpu-1' (train.py), holding it since ... UTC, renewed 12 s ago``."""
        now = time.time() if now is None else now
        what = f" ({self.program})" if self.program else ""
        purpose = f" for {self.purpose}" if self.purpose else ""
        return (
            f"pid {self.pid} on host {self.host!r}{what}{purpose}, holding it since "
            f"{format_utc(self.since)}, renewed {_ago(now - self.renewed)}"
        )


def _sane_expiry(value: Any) -> float:
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        return LEASE_EXPIRY_S
    return seconds if 1.0 <= seconds <= 7 * 24 * 3600 else LEASE_EXPIRY_S


#: The latest Unix time a lease may carry (the end of the year 9999).
_LATEST = 253402300799.0
#: The largest process id there can be (``pid_t`` is a signed 32-bit integer).
_PID_MAX = 2**31 - 1


def _time(value: Any) -> float | None:
    """A Unix time as a lease writes it, or ``None`` (another type, not finite, out of range)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if not 0 <= value <= _LATEST:  # NaN fails this too; an int too large for a float as well
        return None
    return float(value)


def _is_pid(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and 0 < value <= _PID_MAX


def _label(value: Any) -> str:
    return value[:200] if isinstance(value, str) else ""


def format_utc(when: float) -> str:
    try:
        moment = datetime.fromtimestamp(when, timezone.utc)
    except (ValueError, OverflowError, OSError):
        return f"an unreadable time ({when!r})"
    return moment.strftime("%Y-%m-%d %H:%M:%S UTC")


def _ago(seconds: float) -> str:
    if seconds < 0:
        return f"{format_duration(-seconds)} in the future by this machine's clock"
    return f"{format_duration(seconds)} ago"


# -- this process, and looking at another one ----------------------------------------------


def _machine() -> str:
    """This machine beyond its host name: containers and VMs can share a host name, and two
    of them must not judge each other's processes by pid."""
    boot = procfs.boot_id()
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        namespace = ""
    return f"{boot}/{namespace}" if boot or namespace else ""


def _process_runs(pid: int, started: str) -> bool:
    """Whether the process ``pid`` that started at ``started`` still runs on this machine."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):
        return False  # gone, or a pid no process can have
    except PermissionError:
        pass  # it exists, under another user
    except OSError:
        return True  # cannot tell: never take over a lease that may be live
    stat = procfs.stat_fields(pid)
    if stat is None:
        # Without /proc (macOS) a reused pid cannot be told apart; with it, the process
        # ended between the two looks.
        return not procfs.has_proc()
    if stat[0] in ("Z", "X"):
        return False  # killed, not yet reaped by its parent
    return not started or stat[19] == started


def _program() -> str:
    name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return (name or "python")[:100]


def this_process(token: str, since: float, expiry_s: float, purpose: str) -> Holder:
    stat = procfs.stat_fields(os.getpid())
    return Holder(
        token=token,
        host=socket.gethostname(),
        pid=os.getpid(),
        machine=_machine(),
        started=stat[19] if stat else "",
        since=since,
        renewed=time.time(),
        expiry_s=expiry_s,
        program=_program(),
        purpose=purpose,
    )


#: Seconds a lease from another machine may be dated ahead of this machine's clock before its
#: date is not believed: clocks that agree to within a renewal are taken at their word.
FUTURE_TOLERANCE_S = 30.0


def judge(holder: Holder, me: Holder, now: float) -> tuple[str, str]:
    """("self" | "live" | "stale" | "future", why it is stale) for the lease ``holder`` holds.

    On this machine the holder's process decides, whatever the lease's dates. From another
    machine the last renewal does; a renewal dated more than :data:`FUTURE_TOLERANCE_S` ahead
    of ``now`` is ``"future"``: a clock that is wrong (or a lease that was not written by a
    holder), to be judged by watching for the next renewal, never by waiting for that date."""
    if holder.host == me.host and holder.machine == me.machine:
        if holder.pid == me.pid and holder.started == me.started:
            return "self", ""
        if _process_runs(holder.pid, holder.started):
            return "live", ""
        return "stale", f"its process (pid {holder.pid} on this machine) is no longer running"
    age = now - holder.renewed
    if -age > FUTURE_TOLERANCE_S:
        return "future", ""
    if age > holder.expiry_s:
        return "stale", f"it expired (not renewed for more than {holder.expiry_s:.0f} s)"
    return "live", ""


# -- the lease -------------------------------------------------------------------------------
