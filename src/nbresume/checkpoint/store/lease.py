"""The writer lease: at most one live writer per checkpoint folder.

A save cleans up what a killed writer left (temporary folders, uncommitted step folders) and
applies retention to every checkpoint of the folder. Two processes saving into one folder
would therefore delete each other's work. A :class:`~nbresume.Checkpointer` takes the folder's
lease when it is created, and a second live writer is refused at once with
:class:`~nbresume.errors.FolderInUseError`, naming the holder. Readers need no lease.

The lease is a small JSON file, :data:`LEASE_NAME`, directly in the checkpoint folder (a file
whose name begins with a dot: never a step folder, never listed as a checkpoint). It records
who holds it: host, process id and start time, when it was taken and when it was last renewed.

A lease whose holder is gone is taken over, with a warning:

- **on the same machine** (same host name, boot and process namespace) the holder's process is
  looked at: gone, a zombie, or a different process under a reused pid (another start time in
  ``/proc/<pid>/stat``) means stale, at once;
- **from another machine**, or where processes cannot be looked at (an object store, Google
  Drive shared by two VMs), the holder renews the lease every :data:`LEASE_RENEW_S` seconds
  from a daemon thread, and a lease not renewed for :data:`LEASE_EXPIRY_S` seconds (the
  store's ``lease_expiry_s`` where it sets one: Drive's sync is slower) is stale. This
  compares the holder's clock with ours: clocks must agree to well within the expiry.
  A lease renewed more than :data:`~nbresume.checkpoint.store.FUTURE_TOLERANCE_S`
  ahead of our clock (a holder whose clock is wrong) is not judged by its date: the writer
  watches it, and takes it over as stale only if it is not renewed within its expiry by our
  own clock; renewed meanwhile, its holder runs and the writer is refused.

A lease file is data from anywhere, and read as such: one that does not parse, or holds a
value nbresume never writes (a time that is not finite or out of range, a pid no process can
have, a field of another type), is a lease that cannot be read, and is taken over as stale.
Something else in the lease file's place (a folder, a named pipe, a symbolic link; objects
under that name on an object store) is never opened or followed, and never removed: taking
the lease (at the first save, as for a folder that cannot be written, or by ``nbresume
prune``) fails with an error that names it and the fix.

Taking the lease:

- On POSIX the lease file is created with ``O_EXCL``: of two writers starting together, one
  wins, atomically. A stale lease is taken over by writing a new file aside and renaming it
  over the old one; the new holder then waits :data:`LEASE_SETTLE_S` and reads it back, so
  that of two processes taking over the same stale lease at once, the one overwritten backs
  off.
- Object stores have no create-if-absent in general (fsspec offers none): the writer writes
  its lease, waits :data:`LEASE_SETTLE_S`, and reads it back; only if it is still its own does
  it hold the folder. Two writers that start within the same moment are told apart unless one
  of them takes longer than :data:`LEASE_SETTLE_S` between looking at the lease and writing
  its own (a stalled request): then both can believe they hold it until the first renewal or
  save of the overwritten one, which then fails with :class:`~nbresume.errors.LeaseLostError`.
- On Google Drive's mount (a POSIX folder of each VM), ``O_EXCL`` holds between processes of
  one VM; another VM sees the lease only once Drive has synced it, so two VMs starting within
  that delay are not refused at once: the one whose lease is overwritten by the sync finds out
  at its next renewal or save.

A writer checks that it still holds the lease (one small read) before it cleans up, commits
or deletes anything, so a process that was suspended past the expiry and taken over raises
:class:`~nbresume.errors.LeaseLostError` at its next save instead of writing. A Checkpointer
created again in the same process (a notebook cell run again) takes the lease over from the
older one, which then raises if it ever saves again. The lease is given back by ``close()``,
at the end of a ``with`` block and at interpreter exit. A forked child holds none of its
parent's leases: its exit gives none back, and a save there is refused while the parent runs.

The holder: a lease file records who holds it (:class:`Holder`): host, process id and start
time, the machine's boot id and pid namespace, and when the lease was taken and last renewed.
:func:`judge` decides what a writer may do with a lease it found: ``"self"`` (held by this
process), ``"live"`` (another writer that runs: refuse), ``"stale"`` (a holder that is gone on
this machine, or a lease from elsewhere not renewed within its expiry: take it over), or
``"future"`` (a lease from elsewhere renewed later than this machine's clock allows: its date
says nothing, and the writer watches whether it is renewed).

A lease file is read as data from anywhere: :meth:`Holder.parse` takes only the types and
ranges nbresume writes (finite times between 1970 and 9999, a pid a process can have, strings
where strings go) and gives ``None`` for anything else, which a writer treats as a lease it
cannot read: stale.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import secrets
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from typing import Any, TypeGuard

from nbresume.checkpoint import forksafe, procfs
from nbresume.checkpoint.backends import Backend
from nbresume.checkpoint.units import format_duration
from nbresume.errors import FolderInUseError, LeaseLostError, StorageError

log = logging.getLogger("nbresume")

# -- who holds a lease --------------------------------------------------------------------

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
        if procfs.process_runs(holder.pid, holder.started):
            return "live", ""
        return "stale", f"its process (pid {holder.pid} on this machine) is no longer running"
    age = now - holder.renewed
    if -age > FUTURE_TOLERANCE_S:
        return "future", ""
    if age > holder.expiry_s:
        return "stale", f"it expired (not renewed for more than {holder.expiry_s:.0f} s)"
    return "live", ""


# -- the lease -------------------------------------------------------------------------------


# -- taking, renewing and checking the lease ----------------------------------------------

#: The lease file, directly in the checkpoint folder.
LEASE_NAME = ".nbresume-lease.json"
#: Seconds between two renewals by the holder.
LEASE_RENEW_S = 30.0
#: Seconds a writer waits before reading back a lease it wrote without an atomic create.
LEASE_SETTLE_S = 1.0
#: Reads of a lease file that does not parse (a create caught between open and write).
_READ_TRIES = 5
#: Seconds between two looks at a lease dated in the future, while waiting for its renewal.
_WATCH_POLL_S = 1.0

_HELD, _RELEASED, _LOST = "held", "released", "lost"


#: Leases held by this process, by token: a newer lease on the same folder supersedes them.
_REGISTRY: dict[str, WriterLease] = {}
_REGISTRY_LOCK = forksafe.lock()


class WriterLease:
    """The writer lease of one checkpoint folder, held by this process.

    Args:
        store: the folder.
        purpose: what the lease is held for, shown to a writer that is refused.
        drain: called before a newer lease of this process takes this one over (the older
            Checkpointer's save in flight finishes first).
    """

    def __init__(
        self, store: Backend, *, purpose: str = "", drain: Callable[[], None] | None = None
    ) -> None:
        self.store = store
        self.purpose = purpose
        self.drain = drain
        self.token = secrets.token_hex(8)
        self.expiry_s = store.lease_expiry_s or LEASE_EXPIRY_S
        self._since = time.time()
        self._state = _RELEASED
        self._lost = ""
        self._lost_fix = ""
        self._lost_holder: Holder | None = None
        self._lock = forksafe.rlock()
        self._stop = forksafe.event()
        self._thread: threading.Thread | None = None

    @property
    def where(self) -> str:
        return self.store.location

    @property
    def held(self) -> bool:
        """Whether this process holds the lease, as far as it knows without looking."""
        return self._state == _HELD

    def __repr__(self) -> str:
        return f"WriterLease({self.where!r}, {self._state})"

    # -- taking and giving back ----------------------------------------------------------

    def acquire(self, *, replace_own: bool = True) -> None:
        """Take the lease, or raise :class:`FolderInUseError` naming the live holder. With
        ``replace_own``, a lease held by another object of this process (an older Checkpointer
        of a cell run again) is taken over; without, it is refused like another process's."""
        with self._lock:
            if self._state == _LOST:
                self._raise_lost()
            if self._state == _HELD:
                return
            self._take(replace_own=replace_own)
            self._state = _HELD
            self.store.writer_check = self.check
            with _REGISTRY_LOCK:
                _REGISTRY[self.token] = self
            self._stop = forksafe.event()
            self._thread = threading.Thread(
                target=self._beat, args=(self._stop,), name="nbresume-lease", daemon=True
            )
            self._thread.start()

    def release(self) -> None:
        """Give the lease back (removing the lease file if it is still ours). A lease that was
        lost or superseded is left to its new holder."""
        with self._lock:
            self._stop.set()
            with _REGISTRY_LOCK:
                _REGISTRY.pop(self.token, None)
            if self._state != _HELD:
                return
            self._state = _RELEASED
            try:
                holder = self._read()[0]
                if holder is not None and holder.token == self.token:
                    self.store.remove_small(LEASE_NAME)
            except StorageError:
                pass  # a file stands where the folder was: no lease is left there either
            except Exception as exc:  # OSError, or a network store's own client errors
                log.warning(
                    "nbresume: could not remove the writer lease %s (%s); it becomes stale "
                    "when this process ends",
                    self.store.child(LEASE_NAME),
                    exc,
                )

    def check(self) -> None:
        """Raise :class:`LeaseLostError` unless this process still holds the lease (one small
        read). A lease given back by ``close()`` is taken again, as a new writer would."""
        with self._lock:
            if self._state == _RELEASED:
                try:
                    self.acquire(replace_own=False)
                except FolderInUseError as exc:
                    if _held_here(getattr(exc.holder, "token", "")):
                        # Closed, then a newer Checkpointer of this process took the folder.
                        self._lose(None, superseded=True)
                        self._raise_lost()
                    raise
                return
            if self._state == _LOST:
                self._raise_lost()
            self._refresh(renew=False)

    # -- inside ---------------------------------------------------------------------------

    def _read(self) -> tuple[Holder | None, bytes | None]:
        """The holder of the lease file and its bytes; (None, None) when there is none. A file
        that does not parse is read again a few times (a create caught before its write)."""
        raw: bytes | None = None
        for attempt in range(_READ_TRIES):
            raw = self.store.read_small(LEASE_NAME)
            if raw is None:
                return None, None
            holder = Holder.parse(raw)
            if holder is not None:
                return holder, raw
            if attempt + 1 < _READ_TRIES:
                time.sleep(0.05 * (attempt + 1))
        return None, raw

    def _mine(self) -> Holder:
        return this_process(self.token, self._since, self.expiry_s, self.purpose)

    def _confirm(self, pause: float) -> None:
        """After ``pause`` seconds, read the lease file back; raise :class:`_Overwritten` when
        it is not ours any more."""
        if pause:
            time.sleep(pause)
        holder = self._read()[0]
        if holder is None or holder.token != self.token:
            raise _Overwritten(holder)

    def _take(self, *, replace_own: bool = True) -> None:
        """Create the lease file, or take over a stale one or this process's own."""
        for _ in range(4):
            current, raw = self._read()
            if raw is None:
                if self.store.create_small(LEASE_NAME, self._mine().to_bytes()):
                    try:
                        self._confirm(0.0 if self.store.atomic_create else LEASE_SETTLE_S)
                    except _Overwritten:
                        continue  # another writer's lease landed over ours: look at it
                    return
                continue  # created by another writer in between: look at it
            me = self._mine()
            if current is None:
                verdict, why = "stale", "its lease file cannot be read (damaged, or not nbresume's)"
            else:
                verdict, why = judge(current, me, time.time())
            if verdict == "future" and current is not None:
                watched = self._watch(current, raw)
                if watched is None:
                    holder = self._read()[0]
                    if holder is not None and holder.token == current.token:
                        raise self._in_use(holder, me)  # renewed while watched: it runs
                    continue  # another writer's lease now, or none: look at it
                ahead = format_duration(current.renewed - time.time())
                verdict = "stale"
                why = (
                    f"its last renewal is dated {ahead} ahead of this machine's clock, and it "
                    f"was not renewed while this process watched it for {watched:.0f} s"
                )
            if current is not None and (
                verdict == "live"
                or (verdict == "self" and not replace_own and _held_here(current.token))
            ):
                raise self._in_use(current, me)
            if verdict == "self" and current is not None:
                _supersede(current.token)
            if self.store.read_small(LEASE_NAME) != raw:
                continue  # it changed while we looked: look again
            self.store.replace_small(LEASE_NAME, me.to_bytes())
            try:
                # Two processes taking over one stale lease: the one overwritten backs off.
                self._confirm(0.0 if verdict == "self" else LEASE_SETTLE_S)
            except _Overwritten:
                continue
            if verdict == "stale":
                gone = current.describe() if current is not None else "an unknown writer"
                # A log line, not a Python warning: after a crash this is the normal start.
                log.warning("nbresume: took over the writer lease of %s from %s: %s",
                            self.where, gone, why)  # fmt: skip
            else:
                log.info("nbresume: a newer Checkpointer of this process took over %s", self.where)
            return
        current = self._read()[0]
        raise FolderInUseError(
            "the writer lease of this folder kept changing hands while this process tried to "
            "take it: other processes are starting writers on it",
            where=self.where,
            fix="run one writer per folder: stop the others, or give this run its own dir=",
            holder=current,
        )

    def _watch(self, holder: Holder, raw: bytes) -> float | None:
        """Watch a lease dated in the future for its holder's next renewal, for the lease's
        expiry by this machine's clock: ``None`` when it changed (renewed, or taken), else the
        seconds watched."""
        seconds = min(holder.expiry_s, self.expiry_s)
        log.warning(
            "nbresume: the writer lease of %s is dated ahead of this machine's clock (%s); "
            "waiting up to %.0f s for its holder to renew it",
            self.where,
            holder.describe(),
            seconds,
        )
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            time.sleep(min(_WATCH_POLL_S, left))
            if self.store.read_small(LEASE_NAME) != raw:
                return None
        return seconds

    def _in_use(self, holder: Holder, me: Holder) -> FolderInUseError:
        here = holder.host == me.host and holder.machine == me.machine
        fix = (
            "stop that run first (or let it finish), or give this run its own folder with "
            "another dir=. To only read the checkpoints, `nbresume ls`, `nbresume verify` and "
            "CheckpointStore(dir).load() need no lease"
        )
        ahead = holder.renewed - time.time()
        if not here and ahead > FUTURE_TOLERANCE_S:
            # To the minute: the lease was renewed a moment ago, so the seconds are noise.
            skew = format_duration(round(ahead / 60) * 60)
            fix += (
                f". That machine's clock is {skew} ahead of this one's: set "
                "it right. If that machine is gone, a writer started after it stopped renewing "
                f"its lease takes over within {holder.expiry_s:.0f} s"
            )
        elif not here:
            fix += (
                f". If that machine is gone, its lease expires at "
                f"{format_utc(holder.renewed + holder.expiry_s)} ({holder.expiry_s:.0f} s after "
                "its last renewal) and a writer started after that takes over"
            )
        return FolderInUseError(
            f"another process is writing checkpoints to this folder: {holder.describe()}",
            where=self.where,
            fix=fix,
            holder=holder,
        )

    def _refresh(self, *, renew: bool) -> None:
        """Read the lease back; rewrite it with a new renewal time when ``renew``. Marks the
        lease lost and raises when another writer holds it now."""
        holder, raw = self._read()
        if holder is not None and holder.token == self.token:
            if renew:
                self.store.replace_small(LEASE_NAME, self._mine().to_bytes())
            return
        if raw is None and renew:
            # Removed (by hand, or with the whole folder): the heartbeat never writes into a
            # folder by itself, which could bring back a folder the user deleted. This process
            # takes the lease again at its next save, as a new writer would.
            log.warning(
                "nbresume: the writer lease file of %s was removed while this process held it; "
                "it is taken again at the next save",
                self.where,
            )
            self._state = _RELEASED
            self._stop.set()
            with _REGISTRY_LOCK:
                _REGISTRY.pop(self.token, None)
            return
        if raw is None:
            # Removed by someone (by hand), seen right before a write: take it again, unless
            # another writer got it first.
            log.warning(
                "nbresume: the writer lease file of %s was removed while this process held it; "
                "taking it again",
                self.where,
            )
            try:
                self._take()
            except FolderInUseError as exc:
                taker = exc.holder if isinstance(exc.holder, Holder) else None
                self._lose(taker)
                self._raise_lost()
            return
        self._lose(holder)
        self._raise_lost()

    def _lose(self, holder: Holder | None, *, superseded: bool = False) -> None:
        self._state = _LOST
        self._stop.set()
        self._lost_holder = holder
        with _REGISTRY_LOCK:
            _REGISTRY.pop(self.token, None)
        if superseded:
            self._lost = (
                "this Checkpointer no longer writes to this folder: a newer Checkpointer on the "
                "same folder, created in this process, took over its writer lease"
            )
            self._lost_fix = (
                "save with the newest Checkpointer (running the cell that creates it again "
                "replaces the old one)"
            )
            return
        who = holder.describe() if holder is not None else "a writer whose lease cannot be read"
        self._lost = (
            f"this writer lost the folder's writer lease to another writer ({who}), most "
            f"likely because this process could not renew it for more than {self.expiry_s:.0f} "
            "s (suspended, or cut off from the store)"
        )
        self._lost_fix = (
            "stop this run: the other one writes to this folder now, and nothing more is "
            "written here by this one. To keep both, restart this one with its own dir="
        )
        log.warning("nbresume: %s: %s", self.where, self._lost)

    def _raise_lost(self) -> None:
        raise LeaseLostError(
            self._lost, where=self.where, fix=self._lost_fix, holder=self._lost_holder
        )

    def _beat(self, stop: threading.Event) -> None:
        """Renew the lease until it is given back or lost."""
        failing = False
        while not stop.wait(LEASE_RENEW_S):
            with self._lock:
                if self._state != _HELD or stop.is_set():
                    return
                try:
                    self._refresh(renew=True)
                    failing = False
                except LeaseLostError:
                    return
                except Exception as exc:  # a network store hiccup: try again next time
                    if not failing:
                        log.warning(
                            "nbresume: could not renew the writer lease of %s (%s); retrying "
                            "every %.0f s",
                            self.where,
                            exc,
                            LEASE_RENEW_S,
                        )
                    failing = True


class _Overwritten(Exception):
    def __init__(self, holder: Holder | None) -> None:
        super().__init__("lease overwritten")
        self.holder = holder


def _held_here(token: str) -> bool:
    """Whether a lease object of this process holds the lease with ``token``."""
    with _REGISTRY_LOCK:
        return token in _REGISTRY


def _supersede(token: str) -> None:
    """Hand the folder from an older lease of this process to a newer one: the older
    holder's save in flight finishes, then it refuses to write."""
    with _REGISTRY_LOCK:
        older = _REGISTRY.get(token)
    if older is None:
        return
    if older.drain is not None:
        with contextlib.suppress(Exception):  # its own error stays with it
            older.drain()
    with older._lock:
        if older._state == _HELD:
            older._lose(None, superseded=True)


def _rank() -> int:
    """This process's rank under torch.distributed (0 without it); nothing is imported."""
    dist: Any = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return 0
    return int(dist.get_rank())


def acquire_writer_lease(
    store: Backend, *, purpose: str = "", drain: Callable[[], None] | None = None
) -> WriterLease | None:
    """The lease of ``store`` for a writer of this process, taken now; ``None`` on a rank other
    than 0 under torch.distributed (only rank 0 writes and commits). Raises
    :class:`FolderInUseError` when another live writer holds it."""
    if _rank() != 0:
        return None
    lease = WriterLease(store, purpose=purpose, drain=drain)
    try:
        lease.acquire()
    except (OSError, StorageError) as exc:
        # A folder that cannot be written now (read-only, an attached dataset, a file in its
        # place, a store out of reach): restoring from it needs no lease. The first save
        # takes it, and fails there as the save itself would.
        log.debug("nbresume: writer lease of %s deferred to the first save: %s", store, exc)
        store.writer_check = lease.check
    return lease


@contextlib.contextmanager
def holding(store: Backend, *, purpose: str) -> Iterator[WriterLease]:
    """Hold the lease of ``store`` for the duration of a block (a one-off deleting command)."""
    lease = WriterLease(store, purpose=purpose)
    lease.acquire(replace_own=False)
    try:
        yield lease
    finally:
        lease.release()
        store.writer_check = None


def live_holder(store: Backend, now: float | None = None) -> Holder | None:
    """The live writer that holds the lease of ``store``, judged as a writer taking the lease
    would judge it (on this machine: its process still runs; from another: renewed within
    the lease's expiry, or dated ahead of this machine's clock); ``None`` when no lease is
    there or its holder is gone. A reader's question (``nbresume pull``): one small read,
    nothing taken or written."""
    holder: Holder | None = None
    for attempt in range(_READ_TRIES):
        raw = store.read_small(LEASE_NAME)
        if raw is None:
            return None
        holder = Holder.parse(raw)
        if holder is not None:
            break
        time.sleep(0.05 * (attempt + 1))  # a create caught before its write
    if holder is None:
        return None  # a lease file that never parses: a writer would take it over as stale
    now = time.time() if now is None else now
    me = this_process("", now, holder.expiry_s, "")
    verdict, _ = judge(holder, me, now)
    # "self": this very process writes there; "future": a reader does not wait to watch it.
    return None if verdict == "stale" else holder


def _release_all() -> None:
    """At interpreter exit: give back every lease still held (a Checkpointer's own exit hook
    runs first and finishes its save in flight)."""
    with _REGISTRY_LOCK:
        leases = list(_REGISTRY.values())
    for lease in leases:
        with contextlib.suppress(Exception):
            lease.release()


atexit.register(_release_all)


def _forget_in_child() -> None:
    """In a forked child, which holds none of its parent's leases (the lease files name the
    parent). Its exit must not give them back, which would remove the lease file the parent
    still writes under; a save there takes the lease as a new writer would, and is refused
    while the parent runs."""
    for lease in _REGISTRY.values():
        lease._state = _RELEASED
    _REGISTRY.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)
