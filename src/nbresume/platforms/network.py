"""Whether this machine reaches the internet: a name lookup and a TCP connection, on a timer.

The probe runs in a daemon thread, started early and read late. ``getaddrinfo`` has no
timeout of its own and can hang for many seconds where DNS is blackholed; the caller waits
only as long as its budget allows and then reports "no answer", leaving the thread to finish
on its own.
"""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class ProbeResult:
    """``online``: True (connected), False (refused or unresolvable), None (no answer in time)."""

    online: bool | None
    seen: str


class InternetProbe:
    """Resolve ``host`` and connect to ``port``, in the background, within ``timeout`` seconds."""

    def __init__(self, host: str, port: int, timeout: float) -> None:
        self.host = host
        self.port = port
        self.timeout = timeout
        self.started = time.monotonic()
        self._result: ProbeResult | None = None
        self._done = threading.Event()
        thread = threading.Thread(target=self._run, name="nbresume-internet-probe", daemon=True)
        thread.start()

    def _run(self) -> None:
        try:
            self._result = self._probe()
        except Exception as exc:  # whatever happens, the report gets an answer
            self._result = ProbeResult(False, f"probe failed: {exc}")
        finally:
            self._done.set()

    def _probe(self) -> ProbeResult:
        target = f"{self.host}:{self.port}"
        try:
            addresses = socket.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)
        except (OSError, UnicodeError) as exc:  # UnicodeError: a name IDNA cannot encode
            return ProbeResult(False, f"cannot resolve {self.host}: {exc}")
        problem = "no address"
        for family, kind, proto, _, address in addresses:
            left = self.timeout - (time.monotonic() - self.started)
            if left <= 0:
                break
            with socket.socket(family, kind, proto) as sock:
                sock.settimeout(left)
                try:
                    sock.connect(address)
                except OSError as exc:
                    problem = str(exc) or type(exc).__name__
                    continue
            elapsed_ms = (time.monotonic() - self.started) * 1000
            return ProbeResult(True, f"reached {target} in {elapsed_ms:.0f} ms")
        return ProbeResult(False, f"cannot connect to {target}: {problem}")

    def result(self, wait: float | None = None) -> ProbeResult:
        """The answer, waiting at most ``wait`` seconds (default: what is left of the timeout)."""
        if wait is None:
            wait = self.timeout - (time.monotonic() - self.started)
        if self._done.wait(max(0.0, wait)) and self._result is not None:
            return self._result
        return ProbeResult(
            None,
            f"no answer from {self.host}:{self.port} within {self.timeout:g} s "
            "(name lookup or connection hangs)",
        )
