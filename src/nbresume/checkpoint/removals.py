"""Removal of checkpoints that retention took out of view, in the background.

On a local disk, deleting a checkpoint is one rename to a hidden ``.nbresume-old-deleting-...``
folder, with the parent folder fsynced (every reader stops seeing the checkpoint, durably,
before :meth:`~nbresume.checkpoint.store.CheckpointStore.save` returns), then the removal of
that folder's files, which costs tens of milliseconds for a checkpoint of 50 MB and hundreds
for 500 MB. That removal runs in a kept thread (:class:`~nbresume.checkpoint.forksafe.Workers`)
so that a save does not wait for it. What needs the disk space back waits for it first:

- the next save of this process, before it cleans up, checks free space and writes
  (:meth:`LocalStore.recover <nbresume.checkpoint.backends.local.LocalStore.recover>`, which
  every ``begin`` follows, calls :func:`wait`), and a framework's save that writes its own
  folder (``Watch.save_started``);
- :meth:`CheckpointStore.wait_removals <nbresume.checkpoint.store.CheckpointStore.wait_removals>`
  and a Checkpointer giving back its writer lease (``close()``, the end of a run);
- a normal interpreter exit (an ``atexit`` hook; removals started after it run in the caller),
  so that a script or a notebook kernel that ends leaves no hidden folder behind.

A kill in the middle of a removal leaves the hidden folder, which the next writer's
``recover()`` removes. A forked child does not wait for its parent's removals.
"""

from __future__ import annotations

import atexit
import logging
import os
from collections.abc import Callable

from nbresume.checkpoint import forksafe
from nbresume.checkpoint.forksafe import Workers

log = logging.getLogger("nbresume")


class Removals:
    """Removals started by this process and not yet finished."""

    def __init__(self) -> None:
        self._changed = forksafe.condition()
        self._pending = 0
        self._exiting = False
        # One thread: removals of one disk go no faster side by side, and each is waited for.
        self._workers = Workers("nbresume-remove", 1)
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=self._forget)

    def _forget(self) -> None:
        """In a forked child: the parent's removals are not this process's to wait for."""
        self._pending = 0

    def start(self, remove: Callable[[], None]) -> None:
        """Run ``remove`` in the background; in the caller once the interpreter is exiting,
        or where no thread can start. ``remove`` must not raise for a folder it could not
        remove (a leftover hidden folder is removed by the next writer's ``recover()``)."""
        with self._changed:
            background = not self._exiting
            if background:
                self._pending += 1
        if background:
            if self._workers.submit(lambda: self._run(remove)):
                return
            self._finished()
        remove()

    def _run(self, remove: Callable[[], None]) -> None:
        try:
            remove()
        except BaseException as exc:  # a job that raises would end the worker thread
            log.debug("nbresume: a background removal failed: %r", exc)
        finally:
            self._finished()

    def _finished(self) -> None:
        with self._changed:
            self._pending -= 1
            self._changed.notify_all()

    def wait(self) -> None:
        """Return once every removal started so far has finished."""
        with self._changed:
            self._changed.wait_for(lambda: self._pending == 0)

    def at_exit(self) -> None:
        """At interpreter exit: finish the removals; any later one runs in its caller."""
        with self._changed:
            self._exiting = True
        self.wait()


REMOVALS = Removals()
# Registered when nbresume's store is imported, before any Checkpointer registers its own
# exit hook: hooks run last-registered first, so a Checkpointer's final background save (and
# its retention) has finished before this one waits.
atexit.register(REMOVALS.at_exit)


def start(remove: Callable[[], None]) -> None:
    """Run ``remove`` (a folder's removal) in the background; see :class:`Removals`."""
    REMOVALS.start(remove)


def wait() -> None:
    """Return once every removal this process started has finished."""
    REMOVALS.wait()
