"""Widget clicks while a cell runs.

A Jupyter kernel reads its shell messages (cells to run, widget events) in its event loop, and
that loop does not turn while a cell runs: a click on "Save now" would wait until training
ended. Where a front-end and kernel deliver a widget's messages to a *subshell* (a kernel
thread of its own, as JupyterLab 4.4+ can with ipykernel 7), they are handled while the main
shell is busy and nothing more is needed: the buttons only set a request, which is safe from
any thread. Everywhere else, and that includes ipykernel 7 routing a widget's messages to the
shell that last sent on it (the training cell's), they wait for the main shell.

:class:`CommPump` handles those. At step boundaries, in the thread that runs the cell, it reads
the main shell's pending messages: widget messages (``comm_msg``, ``comm_open``,
``comm_close``) are handled there and then, by the kernel's own handlers; every other message
(the next cells of "Run all", completions) is held, in order, and given back to the kernel
when the cell ends, which then handles it as if it had just arrived. This is the approach of
jupyter-ui-poll, taking messages from the socket rather than through the kernel's dispatch, so
that it works with ipykernel 6 (Colab, Kaggle, VS Code) and 7 alike.

A kernel this does not recognise gets no pump: the buttons then act when the cell ends.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
import time
from typing import Any

log = logging.getLogger("nbresume")

COMM_MESSAGES = frozenset({"comm_open", "comm_msg", "comm_close"})
#: Seconds between two looks at the socket (a look costs microseconds when nothing is there).
POLL_INTERVAL_S = 0.05
#: At most this many messages are read per look, so a flood cannot stall training.
MAX_PER_POLL = 64


class CommPump:
    """Handles the widget messages waiting for a busy kernel; see the module docstring."""

    def __init__(self, kernel: Any, stream: Any, thread: threading.Thread) -> None:
        self.kernel = kernel
        self.stream = stream
        self.thread = thread
        self.copy = bool(getattr(stream, "_recv_copy", False))
        self.handled = 0
        self._held: list[Any] = []
        self._last = 0.0
        self._broken = False
        self._tasks: set[asyncio.Future[Any]] = set()

    @classmethod
    def for_shell(cls, shell: Any) -> CommPump | None:
        """The pump for this IPython shell's kernel, or ``None`` when it has no kernel we know
        (a terminal, an unknown kernel)."""
        kernel = getattr(shell, "kernel", None)
        if kernel is None or getattr(kernel, "session", None) is None:
            return None
        handlers = getattr(kernel, "shell_handlers", None)
        if not isinstance(handlers, dict) or not handlers.keys() >= COMM_MESSAGES:
            return None
        channel = getattr(kernel, "shell_channel_thread", None)
        try:
            if channel is not None:
                # ipykernel 7: a thread reads the shell socket and forwards the main shell's
                # messages through an inproc pair that the kernel's own thread reads.
                stream = channel.manager.get_shell_channel_to_subshell_pair(None).to_stream
                thread = getattr(channel, "parent_thread", None) or threading.main_thread()
            else:
                # ipykernel 6: the kernel's thread reads the shell socket itself.
                stream = kernel.shell_stream
                thread = threading.main_thread()
        except Exception as exc:
            log.debug("nbresume: no widget pump for this kernel: %s", exc)
            return None
        if stream is None or getattr(stream, "_recv_callback", None) is None:
            return None
        return cls(kernel, stream, thread)

    @property
    def held(self) -> int:
        """Messages waiting to be given back to the kernel."""
        return len(self._held)

    def poll(self, *, force: bool = False) -> int:
        """Handle the widget messages that arrived since the last look; return how many.

        Only in the kernel's own thread (the one running the cell), at most every
        :data:`POLL_INTERVAL_S` seconds unless ``force``.
        """
        if self._broken or threading.current_thread() is not self.thread:
            return 0
        now = time.monotonic()
        if not force and now - self._last < POLL_INTERVAL_S:
            return 0
        self._last = now
        import zmq

        socket = getattr(self.stream, "socket", None)
        if socket is None:
            return 0
        handled = 0
        for _ in range(MAX_PER_POLL):
            try:
                frames = socket.recv_multipart(zmq.NOBLOCK, copy=self.copy)
            except zmq.Again:
                break
            except zmq.ZMQError as exc:
                log.debug("nbresume: widget pump stopped: %s", exc)
                self._broken = True
                break
            if self._msg_type(frames) in COMM_MESSAGES:
                self._dispatch(frames)
                handled += 1
            else:
                self._held.append(frames)
        self.handled += handled
        return handled

    def _msg_type(self, frames: list[Any]) -> str:
        """The message's type, read without consuming its signature (the kernel checks each
        signature once, and a held message must still pass that check when given back)."""
        session = self.kernel.session
        try:
            _, rest = session.feed_identities(frames, copy=self.copy)
            msg = session.deserialize(rest, content=False, copy=self.copy)
            return str(msg["header"]["msg_type"])
        except Exception:
            return ""  # held and given back: the kernel reports it as it always does

    def _dispatch(self, frames: list[Any]) -> None:
        kernel = self.kernel
        try:
            idents, rest = kernel.session.feed_identities(frames, copy=self.copy)
            msg = kernel.session.deserialize(rest, content=True, copy=self.copy)
            handler = kernel.shell_handlers[msg["header"]["msg_type"]]
            result = handler(getattr(kernel, "shell_stream", None), idents, msg)
            if inspect.isawaitable(result):
                self._schedule(result)  # runs when the cell ends
        except Exception:
            log.exception("nbresume: handling a widget message during a cell failed")

    def _schedule(self, awaitable: Any) -> None:
        # The kernel's loop runs it once the cell ends; keep a reference until then.
        task = asyncio.ensure_future(awaitable)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def give_back(self) -> int:
        """Hand the held messages back to the kernel, in the order they came; return how many.

        Called when the cell ends (IPython's ``post_execute``): the kernel then handles them
        after the cell, exactly where it would have.
        """
        if not self._held:
            return 0
        held, self._held = self._held, []
        callback = getattr(self.stream, "_recv_callback", None)
        if callback is None:
            log.error("nbresume: %d message(s) could not be given back to the kernel", len(held))
            return 0
        for frames in held:
            try:
                result = callback(frames)
                if inspect.isawaitable(result):
                    self._schedule(result)
            except Exception:
                log.exception("nbresume: giving a message back to the kernel failed")
        return len(held)
