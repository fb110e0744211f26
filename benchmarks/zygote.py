"""Fresh processes without paying for imports each time.

Every measurement runs in a fresh process (peak memory, a cold restore, a restart after
kill -9), and importing torch, DCP, Lightning and Accelerate takes several seconds on a small
machine. The runner therefore starts one *zygote*: a process that imports those libraries,
runs nothing, and forks a child per measurement. A child shares no object, thread or file
with any other (torch's thread pools start lazily, in the child); it writes its answer to a
JSON file and ends with ``os._exit``. A child killed with SIGKILL is just that: a process
killed by the kernel, whatever it was doing. The zygote's own objects are frozen out of the
garbage collector before the first fork (``gc.freeze()``), so that a collection in a child
does not copy the zygote's whole heap page by page, a cost a fresh process does not have.

Protocol on the zygote's stdin/stdout, one JSON object per line: the parent sends
``{"kind": ..., "args": {...}}``; the zygote answers ``{"pid": ...}`` once the child runs and
``{"exit": status}`` once it ended.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks._common import ROOT, child_env

Work = Callable[[dict[str, Any]], dict[str, Any]]


def serve(work: dict[str, Work], imports: list[str]) -> None:
    """The zygote's loop (``python -m benchmarks --zygote``)."""
    import importlib

    loaded = []
    for module in imports:
        try:
            importlib.import_module(module)
            loaded.append(module)
        except Exception:  # a missing library is reported by the tool, not here
            continue
    # What the imports left is collected once and then frozen out of the collector's reach:
    # otherwise the first full collection in a child walks every object of the zygote's heap
    # (420 000, every library of every tool imported), writing to each one's header, and so
    # copies that heap page by page: 0.35 to 0.46 s measured on 2 busy cores, landing inside
    # whichever timed window first allocated enough objects (a 20 MB restore, or the first
    # step after it). A script started afresh has only its own imports to collect, and no
    # page to copy.
    gc.collect()
    gc.freeze()
    _answer({"ready": loaded})
    for line in sys.stdin:
        command = json.loads(line)
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            _run_child(work[command["kind"]], command["args"])
        _answer({"pid": pid})
        _, status = os.waitpid(pid, 0)
        _answer({"exit": os.waitstatus_to_exitcode(status)})


def _answer(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def _run_child(run: Work, args: dict[str, Any]) -> None:
    code = 0
    try:
        os.setpgid(0, 0)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        devnull = os.open(os.devnull, os.O_RDWR)
        os.dup2(devnull, 0)
        os.dup2(devnull, 1)  # the zygote's stdout is the protocol: children never write to it
        os.dup2(devnull, 2)  # libraries' chatter; a failure comes back in the answer file
        try:
            result = run(args)
        except BaseException as exc:  # DCP's CheckpointException is not an Exception
            result = {"error": f"{type(exc).__name__}: {exc}"[:400],
                      "trace": traceback.format_exc()[-2000:]}  # fmt: skip
            code = 1
        Path(args["result"]).write_text(json.dumps(result))
    except BaseException:
        code = 2
    finally:
        os._exit(code)


class Zygote:
    """The parent's handle on a zygote process."""

    def __init__(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "benchmarks", "--zygote"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            bufsize=0,  # unbuffered: select() must see every line not yet read
            cwd=ROOT,
            env=child_env(),
        )
        self.selector = selectors.DefaultSelector()
        assert self.process.stdout is not None
        self.selector.register(self.process.stdout, selectors.EVENT_READ)
        self.loaded: list[str] = self._read(300)["ready"]
        self.scratch = Path(tempfile.mkdtemp(prefix="nbresume-bench-results-"))
        self.count = 0
        self.active: int | None = None  # the child started and not yet joined

    def _read(self, timeout: float) -> dict[str, Any]:
        assert self.process.stdout is not None
        if not self.selector.select(timeout):
            raise TimeoutError(f"the benchmark zygote did not answer in {timeout:.0f} s")
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError("the benchmark zygote ended")
        message: dict[str, Any] = json.loads(line)
        return message

    def start(self, kind: str, args: dict[str, Any]) -> tuple[int, Path]:
        """Fork a child running ``kind``; its pid and the file its answer will be in."""
        assert self.process.stdin is not None
        self.count += 1
        result = self.scratch / f"{self.count}.json"
        result.unlink(missing_ok=True)
        line = json.dumps({"kind": kind, "args": {**args, "result": str(result)}}) + "\n"
        self.process.stdin.write(line.encode())
        self.process.stdin.flush()
        self.active = int(self._read(60)["pid"])
        return self.active, result

    def child_ended(self) -> bool:
        """Whether the zygote has reported the end of the running child (without reading it)."""
        return bool(self.selector.select(0))

    def join(self, pid: int, timeout: float) -> int:
        """Wait for the child to end (killing it after ``timeout``); its exit status."""
        try:
            code = int(self._read(timeout)["exit"])
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            code = int(self._read(60)["exit"])
        self.active = None
        return code

    def call(self, kind: str, args: dict[str, Any], timeout: float = 900) -> dict[str, Any]:
        """Run ``kind`` in a fresh child and return its answer (``{"error": ...}`` if none)."""
        pid, result = self.start(kind, args)
        code = self.join(pid, timeout)
        if result.exists():
            answer: dict[str, Any] = json.loads(result.read_text())
            return answer
        return {"error": f"the child ended with status {code} and no answer"}

    def close(self) -> None:
        if self.active is not None:  # interrupted in the middle of a measurement
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.active, signal.SIGKILL)
        if self.process.stdin is not None:
            self.process.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(30)
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        for path in self.scratch.glob("*"):
            path.unlink()
        self.scratch.rmdir()
