"""Locks that a forked child finds free, and threads kept from one save to the next.

``fork()`` copies the whole memory of a process but only the thread that called it. A lock
that another thread held at that moment (a background save reporting an event, the lease
heartbeat renewing the lease, a worker pool taking a job) stays held in the child for good,
and the first call there that takes it never returns. nbresume's threads do run while a
process forks: the lease heartbeat lives as long as the Checkpointer, and DataLoader workers
(fork is the default start method on Linux before Python 3.14) start at every epoch, while a
save of the previous one may still be in flight. The child may then call nbresume: the
user's dataset, the user's own multiprocessing, the exit hooks of a child that ends normally.

Every lock, condition and event of nbresume's threads is made here and is made new, free, in
a forked child, as CPython does for its own (``_at_fork_reinit``). What a lock guarded stays
as the fork found it; the objects that track work of the parent's threads (a worker pool,
the removals in flight, the leases held) also forget that work in the child. An object made
once per process at its first use (:class:`Lazy`) is guarded by such a lock too.

A forked child inherits none of its parent's threads either. Starting a thread costs
milliseconds on a busy machine, at every save: the files' fsyncs
(:class:`~nbresume.checkpoint.store.hashing.DurableCloser`) and the second half of an asynchronous
snapshot's copy (:class:`~nbresume.checkpoint.state.snapshot.PieceCopy`) go to :class:`Workers`,
threads that wait for the next job instead; a forked child starts its own.
"""

from __future__ import annotations

import os
import queue
import threading
import weakref
from collections.abc import Callable
from typing import Any, Generic, TypeVar

_T = TypeVar("_T")

#: Every lock, condition and event made here that is still alive.
_MADE: weakref.WeakSet[Any] = weakref.WeakSet()


def lock() -> threading.Lock:
    """A ``threading.Lock`` that is free again in a forked child."""
    return _kept(threading.Lock())


def rlock() -> threading.RLock:
    """A ``threading.RLock`` that is free again in a forked child."""
    return _kept(threading.RLock())


def condition(lock: Any = None) -> threading.Condition:
    """A ``threading.Condition`` (on ``lock``, a new ``RLock`` by default) that is free
    again, without waiters, in a forked child."""
    return _kept(threading.Condition(lock))


def event() -> threading.Event:
    """A ``threading.Event`` whose lock is free again in a forked child (set or not, as at
    the fork)."""
    return _kept(threading.Event())


def _kept(primitive: _T) -> _T:
    _MADE.add(primitive)
    return primitive


def _after_fork_in_child() -> None:
    # Only the forking thread runs here: nothing else can take these locks meanwhile.
    for primitive in list(_MADE):
        primitive._at_fork_reinit()


if hasattr(os, "register_at_fork"):  # not on Windows, which cannot fork
    os.register_at_fork(after_in_child=_after_fork_in_child)


class Lazy(Generic[_T]):
    """One object for the whole process (the notebook's tracker, the extension's state), made
    by ``make`` at the first :meth:`get`, under a lock that a forked child finds free."""

    def __init__(self, make: Callable[[], _T]) -> None:
        self._make = make
        self.lock = lock()
        #: The object :meth:`get` made (``None``: not made yet).
        self.made: _T | None = None

    def get(self) -> _T:
        """The object, made now when it was not yet."""
        with self.lock:
            if self.made is None:
                self.made = self._make()
            return self.made


# -- kept threads ------------------------------------------------------------------------------


class Workers:
    """``count`` daemon threads named ``name``, started at the first job of a process."""

    def __init__(self, name: str, count: int) -> None:
        self.name = name
        self.count = count
        self._lock = lock()
        self._pid = 0  # the process whose threads these are: a forked child starts its own
        self._queue: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()

    def submit(self, job: Callable[[], None]) -> bool:
        """Run ``job`` in a worker (it must catch its own errors); ``False`` where no worker
        can start (an interpreter far in its shutdown): the caller then runs it itself."""
        with self._lock:
            if self._pid != os.getpid():
                jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
                if not all(_start(jobs, self.name) for _ in range(self.count)):
                    return False
                self._queue, self._pid = jobs, os.getpid()
            self._queue.put(job)
        return True


def _start(jobs: queue.SimpleQueue[Callable[[], None]], name: str) -> bool:
    def run() -> None:
        while True:
            jobs.get()()

    thread = threading.Thread(target=run, name=name, daemon=True)
    try:
        thread.start()
    except RuntimeError:  # can't start new thread: the interpreter is shutting down
        return False
    return True
