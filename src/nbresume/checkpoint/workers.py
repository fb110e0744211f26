"""Threads kept from one save to the next, running jobs from one queue.

Starting a thread costs milliseconds on a busy machine, at every save: the files' fsyncs
(:class:`~nbresume.checkpoint.hashing.DurableCloser`) and the second half of an asynchronous
snapshot's copy (:class:`~nbresume.checkpoint.snapshot.PieceCopy`) go to threads that wait for
the next job instead. A forked child inherits none of its parent's threads: it starts its own.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable

from nbresume.checkpoint import forksafe


class Workers:
    """``count`` daemon threads named ``name``, started at the first job of a process."""

    def __init__(self, name: str, count: int) -> None:
        self.name = name
        self.count = count
        self._lock = forksafe.lock()
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
