"""Python children forked from one warm process: ``python script.py`` without paying for
torch's import each time.

A test that runs a training script in a child pays about two seconds of CPU before the script
does anything: ``import torch``, then ``torch._dynamo``, which the first optimizer imports.
:func:`popen` and :func:`run` stand in for ``subprocess.Popen`` and ``subprocess.run`` of
``[sys.executable, script, *args]`` (or ``-c CODE``, ``-m MODULE``): the child is forked from a
server that has imported torch, torch._dynamo, numpy and nbresume once, and is then made what a
fresh interpreter would be:

- its own session and process group (as with ``start_new_session=True``: ``os.killpg(proc.pid,
  ...)`` reaches it and what it starts), the real pid in ``proc.pid``, its exit status as
  ``subprocess`` reports it (``-9`` for a SIGKILL);
- the command's argv, cwd, environment, umask and standard streams (``PIPE``, a file, or the
  test's own), ``sys.path`` as the interpreter would build it from the script's folder and
  ``PYTHONPATH``, a fresh ``__main__`` (pickling by reference and spawned workers find it);
- the signal dispositions a child of the test would get (ignored ones stay ignored, every
  handler back to the default, then Python's own: SIGINT raises KeyboardInterrupt, SIGPIPE and
  SIGXFSZ ignored), no signal blocked, no thread but its main one;
- random streams as at a start: ``random``'s, NumPy's global and torch's default generator
  each seeded anew from the OS.

What is read when an interpreter or a library starts (``PYTHON*`` variables such as the hash
seed, ``OMP_NUM_THREADS`` and the other sizes of math thread pools, ``TORCH*``) cannot be
changed in a fork: children are forked from a server started with the same values, one server
for each set (its children share its hash seed, where fresh processes would each draw one).
What a fork cannot give is refused rather than faked: interpreter options (``-u``,
``-X``...), and a ``PYTHONPATH`` folder that holds a package the server has already imported (a
stand-in would be shadowed). Tests that need those, or ``pass_fds``, ``preexec_fn``, resource
limits, keep ``subprocess``.

A server is started on first use and ends with the test process, taking its running children
with it. Each child is answered on a socket of its own, so a test can run several at once.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import io
import json
import locale
import os
import select
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any, ClassVar

from testkit.paths import TESTS, with_testkit

#: What every server imports before it forks anything.
WARM_MODULES = ("numpy", "torch", "torch._dynamo", "nbresume")

_Stream = int | IO[Any] | None


# -- the server's side ----------------------------------------------------------------------


def serve(channel_fd: int) -> None:
    """The server (``python -c "from testkit.warmfork import serve; serve(FD)"``): import
    :data:`WARM_MODULES`, then fork a child for each request received on ``channel_fd``.

    A request is one byte with four descriptors: the child's control socket (which carries
    the request's JSON line, then the answers ``{"pid": P}`` and ``{"exit": CODE}``), its
    stdin, stdout and stderr. The server ends when the channel closes, killing the process
    groups of children still running."""
    scratch = os.environ["TMPDIR"]  # the server's own (see _Server): removed when it ends
    # torch must not start CUDA's driver here: a child forked after that could not use it.
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
    import numpy  # noqa: F401
    import torch
    import torch._dynamo  # noqa: F401  (what the first optimizer imports)

    import nbresume  # noqa: F401

    # What the imports made is kept out of the collector's sight: without this, a child's
    # first full collection walks (and copies, page by page) the server's whole heap.
    gc.collect()
    gc.freeze()
    own_pythonpath = set(os.environ.get("PYTHONPATH", "").split(os.pathsep))
    site_path = [p for p in sys.path[1:] if p not in own_pythonpath]
    channel = socket.socket(fileno=channel_fd)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    selector = selectors.DefaultSelector()
    selector.register(channel, selectors.EVENT_READ)
    selector.register(wake_r, selectors.EVENT_READ)
    children: dict[int, socket.socket] = {}  # pid -> its control socket
    own_fds = [channel_fd, wake_r, wake_w, selector.fileno()]  # type: ignore[attr-defined]
    while True:
        for key, _ in selector.select():
            if key.fileobj is channel:
                message, fds, _, _ = socket.recv_fds(channel, 1, 4)
                if not message:  # the test process has ended or closed it
                    for pid in children:
                        with contextlib.suppress(ProcessLookupError):
                            os.killpg(pid, signal.SIGKILL)
                    shutil.rmtree(scratch, ignore_errors=True)
                    return
                control = socket.socket(fileno=fds[0])
                request = json.loads(control.makefile("rb").readline())
                pid = os.fork()
                if pid == 0:
                    others = [s.fileno() for s in children.values()]
                    _child(request, fds, [*own_fds, *others], site_path)
                for fd in fds[1:]:
                    os.close(fd)
                control.sendall(json.dumps({"pid": pid}).encode() + b"\n")
                children[pid] = control
                selector.register(control, selectors.EVENT_READ, pid)
            elif key.fileobj == wake_r:
                with contextlib.suppress(BlockingIOError):
                    while os.read(wake_r, 512):
                        pass
                _reap(children, selector)
            else:  # the test closed its end: it has given up on that child
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(key.data, signal.SIGKILL)
                selector.unregister(key.fileobj)


def _reap(children: dict[int, socket.socket], selector: selectors.BaseSelector) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        control = children.pop(pid)
        with contextlib.suppress(KeyError):
            selector.unregister(control)
        with contextlib.suppress(OSError):
            code = os.waitstatus_to_exitcode(status)
            control.sendall(json.dumps({"exit": code}).encode() + b"\n")
        control.close()


def _child(request: dict[str, Any], fds: list[int], close: list[int], site: list[str]) -> None:
    """In the forked child: become what ``python ARGV`` started by the test would be, run it,
    and end as the interpreter would. Never returns."""
    code = 1
    try:
        os.setsid()
        signal.set_wakeup_fd(-1)
        for target, fd in enumerate(fds[1:]):
            os.dup2(fd, target, inheritable=True)
        for fd in {*fds, *close} - {0, 1, 2}:
            with contextlib.suppress(OSError):
                os.close(fd)
        _fresh_signals(set(request["ignored"]))
        os.umask(request["umask"])
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        _fresh_streams()
        _fresh_random()
        _forget_the_suite()
        import importlib
        import tempfile

        tempfile.tempdir = None  # found again from this child's TMPDIR
        importlib.invalidate_caches()  # files written since the server started
        code = _run_main(request["argv"], [*request["pythonpath"], *site])
    except BaseException:  # the child's own setup failed: say so where the test will look
        import traceback

        with contextlib.suppress(BaseException):
            traceback.print_exc()
            sys.stderr.flush()
    finally:
        os._exit(code)


def _fresh_signals(ignored: set[int]) -> None:
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    for signum in signal.valid_signals():
        if signum in (signal.SIGKILL, signal.SIGSTOP):
            continue
        with contextlib.suppress(OSError, ValueError):
            signal.signal(signum, signal.SIG_IGN if signum in ignored else signal.SIG_DFL)
    # What the interpreter sets at its start.
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    if signal.SIGINT not in ignored:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _fresh_streams() -> None:
    """New ``sys.stdin``/``stdout``/``stderr`` on descriptors 0, 1, 2, made as the interpreter
    makes them: buffered (stderr and a terminal by line) or, with ``PYTHONUNBUFFERED``,
    stdout and stderr written straight through."""
    buffered = not os.environ.get("PYTHONUNBUFFERED")
    for fd, name in enumerate(("stdin", "stdout", "stderr")):
        old = getattr(sys, name)
        raw = io.FileIO(fd, "r" if fd == 0 else "w", closefd=False)
        buffer: Any = raw
        if fd == 0:
            buffer = io.BufferedReader(raw)
        elif buffered:
            buffer = io.BufferedWriter(raw)
        stream = io.TextIOWrapper(
            buffer,
            encoding=old.encoding,
            errors=old.errors,
            newline="\n",
            line_buffering=buffered and (fd == 2 or raw.isatty()),
            write_through=not buffered,
        )
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


def _fresh_random() -> None:
    import random

    import numpy as np
    import torch

    # Each from the OS, as at a start: random's and NumPy's global state when imported,
    # torch's default generator when torch is (its initial seed differs from run to run).
    random.seed()
    np.random.seed()
    torch.seed()


def _forget_the_suite() -> None:
    """The suite's own modules (this one among them) are imported afresh by a child that
    imports them, from its own ``sys.path``."""
    suite = (str(TESTS) + os.sep, os.path.realpath(TESTS) + os.sep)
    for name, module in list(sys.modules.items()):
        file = getattr(module, "__file__", None)
        if isinstance(file, str) and file.startswith(suite):  # no resolve(): 2000 modules
            del sys.modules[name]


def _run_main(argv: list[str], path: list[str]) -> int:
    """Run ``argv`` (what follows ``python``) as ``__main__``, with ``path`` after its first
    entry on ``sys.path``; its exit status."""
    import builtins
    import importlib.machinery
    import runpy
    import types

    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = builtins
    sys.modules["__main__"] = main
    sys.orig_argv = [sys.executable, *argv]
    try:
        if argv[0] == "-c":
            sys.argv = ["-c", *argv[2:]]
            sys.path[:] = ["", *path]
            exec(compile(argv[1], "<string>", "exec"), main.__dict__)
        elif argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            sys.path[:] = [os.getcwd(), *path]
            runpy._run_module_as_main(argv[1])  # type: ignore[attr-defined]  # what -m runs
        else:
            script = os.path.abspath(argv[0])
            sys.argv = list(argv)
            sys.path[:] = [os.path.dirname(os.path.realpath(script)), *path]
            main.__file__ = argv[0]
            main.__loader__ = importlib.machinery.SourceFileLoader("__main__", argv[0])
            main.__cached__ = None  # type: ignore[attr-defined]
            source = Path(script).read_bytes()
            exec(compile(source, argv[0], "exec"), main.__dict__)
        code = 0
    except SystemExit as stop:
        code = _exit_code(stop)
    except KeyboardInterrupt as interrupt:
        _print_uncaught(interrupt)
        _finish()
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # ended by SIGINT, as the interpreter is
        os.kill(os.getpid(), signal.SIGINT)
        code = 130
    except BaseException as error:
        _print_uncaught(error)
        code = 1
    return _finish(code)


def _print_uncaught(error: BaseException) -> None:
    """What the interpreter does with an exception that ends the script: note it in
    ``sys.last_*`` (atexit's functions read it there) and hand it to ``sys.excepthook``,
    without this module's frame."""
    tb = error.__traceback__
    tb = tb.tb_next if tb is not None else None
    error.__traceback__ = tb
    sys.last_type, sys.last_value, sys.last_traceback = type(error), error, tb
    if sys.version_info >= (3, 12):
        sys.last_exc = error
    sys.excepthook(type(error), error, tb)


def _exit_code(stop: SystemExit) -> int:
    if stop.code is None:
        return 0
    if isinstance(stop.code, int):
        return stop.code & 0xFF
    with contextlib.suppress(BaseException):
        print(stop.code, file=sys.stderr)
    return 1


def _finish(code: int = 0) -> int:
    """What the interpreter does before it exits: wait for threads, run atexit's functions,
    flush the standard streams."""
    try:
        threading._shutdown()  # type: ignore[attr-defined]
    except SystemExit as stop:
        code = _exit_code(stop)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            code = 120 if code == 0 else code
    return code


# -- the test's side ------------------------------------------------------------------------


class _Server:
    """A server of the test process, started on first use: one for each set of the
    variables read when an interpreter and its libraries start (:func:`_read_at_start`)."""

    lock: ClassVar[threading.Lock] = threading.Lock()
    running: ClassVar[dict[tuple[tuple[str, str], ...], _Server]] = {}

    def __init__(self, at_start: Mapping[str, str]) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.channel = ours
        env = {k: v for k, v in os.environ.items() if not _read_at_start(k)}
        env = with_testkit({**env, **at_start})
        # What the imports leave in the temporary folder (torch._dynamo makes its cache's
        # folder there) goes into a folder of the server's own, removed when it ends.
        self.scratch = tempfile.mkdtemp(prefix="nbresume-warmfork-")
        env["TMPDIR"] = self.scratch
        self.pythonpath = [p for p in env["PYTHONPATH"].split(os.pathsep) if p]
        code = f"from testkit.warmfork import serve; serve({theirs.fileno()})"
        self.process = subprocess.Popen(
            [sys.executable, "-c", code],
            pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL,
            env=env,
            cwd=TESTS,
            start_new_session=True,  # a test's Ctrl-C or killpg never reaches the server
        )
        theirs.close()
        self.preloaded = _top_level(WARM_MODULES)
        atexit.register(self.close)

    @classmethod
    def get(cls, env: Mapping[str, str]) -> _Server:
        """The server whose children get ``env``."""
        at_start = {k: v for k, v in env.items() if _read_at_start(k)}
        key = tuple(sorted(at_start.items()))
        with cls.lock:
            server = cls.running.get(key)
            if server is None or server.process.poll() is not None:
                server = cls.running[key] = cls(at_start)
            return server

    def close(self) -> None:
        self.channel.close()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        shutil.rmtree(self.scratch, ignore_errors=True)


def _read_at_start(name: str) -> bool:
    """Whether the interpreter, torch or the math libraries read ``name`` when they start or
    load (the hash seed, the I/O encoding, the thread pools' sizes), so that a child forked
    from a server started with another value would not be what a fresh process is."""
    if name in ("PYTHONPATH", "PYTHONUNBUFFERED"):  # honoured in the child
        return False
    return name.startswith(("PYTHON", "TORCH", "PYTORCH", "OMP_", "MKL_", "OPENBLAS_", "KMP_"))


def _top_level(names: Sequence[str]) -> set[str]:
    return {name.split(".")[0] for name in names}


class WarmProcess:
    """A forked child, used as a ``subprocess.Popen``: ``pid`` (its own process group),
    ``stdin``/``stdout``/``stderr`` where ``PIPE`` was asked, ``poll``, ``wait``,
    ``send_signal``, ``terminate``, ``kill``, ``returncode``."""

    def __init__(
        self,
        args: Sequence[str | os.PathLike[str]],
        *,
        stdin: _Stream = None,
        stdout: _Stream = None,
        stderr: _Stream = None,
        text: bool = False,
        cwd: str | os.PathLike[str] | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        argv = [os.fspath(a) for a in args]
        self.args = argv
        if not argv or argv[0] != sys.executable:
            raise ValueError(f"warmfork runs Python only: {argv[:1]} is not sys.executable")
        rest = argv[1:]
        if not rest or (rest[0].startswith("-") and rest[0] not in ("-c", "-m")):
            raise ValueError(f"warmfork: interpreter options need a real process: {argv}")
        env = dict(os.environ if env is None else env)
        server = _Server.get(env)
        pythonpath = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        _refuse_shadowed_imports(pythonpath, server)
        self.returncode: int | None = None
        self.stdin: IO[Any] | None = None
        self.stdout: IO[Any] | None = None
        self.stderr: IO[Any] | None = None
        theirs: list[int] = []
        to_close: list[int] = []
        mine: dict[str, int] = {}
        for name, fd_default, spec in (
            ("stdin", 0, stdin),
            ("stdout", 1, stdout),
            ("stderr", 2, stderr),
        ):
            if spec == subprocess.STDOUT:
                theirs.append(theirs[1])
            elif spec == subprocess.PIPE:
                r, w = os.pipe()
                child_end, my_end = (r, w) if name == "stdin" else (w, r)
                theirs.append(child_end)
                to_close.append(child_end)
                mine[name] = my_end
            elif spec == subprocess.DEVNULL:
                fd = os.open(os.devnull, os.O_RDWR)
                theirs.append(fd)
                to_close.append(fd)
            elif spec is None:
                theirs.append(fd_default)
            elif isinstance(spec, int):
                theirs.append(spec)
            else:
                theirs.append(spec.fileno())
        ours, control = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        umask = os.umask(0o022)
        os.umask(umask)
        request = {
            "argv": rest,
            "cwd": os.fspath(cwd) if cwd is not None else os.getcwd(),
            "env": env,
            "pythonpath": pythonpath,
            "umask": umask,
            "ignored": [
                int(s)
                for s in signal.valid_signals()
                if s not in (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGKILL, signal.SIGSTOP)
                and _ignored(s)
            ],
        }
        ours.sendall(json.dumps(request).encode() + b"\n")
        with _Server.lock:
            socket.send_fds(server.channel, [b"x"], [control.fileno(), *theirs])
        control.close()
        for fd in to_close:
            os.close(fd)
        self._control = ours
        self._received = b""
        self._readers: list[threading.Thread] | None = None
        self._read: dict[str, Any] = {}
        self.pid: int = json.loads(self._answer(None) or b"")["pid"]
        for name, fd in mine.items():
            mode = "w" if name == "stdin" else "r"
            # Closed by close(), as Popen's are by its owner.
            if text:
                encoding = locale.getpreferredencoding(False)
                setattr(self, name, open(fd, mode, encoding=encoding))  # noqa: SIM115
            else:
                setattr(self, name, open(fd, mode + "b"))  # noqa: SIM115

    def _answer(self, timeout: float | None) -> bytes | None:
        """The server's next answer line; None if none came in ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._received:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([self._control], [], [], left)[0]:
                return None
            chunk = self._control.recv(4096)
            if not chunk:
                raise RuntimeError(f"the warm-fork server ended before child {self.args}")
            self._received += chunk
        line, self._received = self._received.split(b"\n", 1)
        return line

    def poll(self) -> int | None:
        if self.returncode is None:
            line = self._answer(0)
            if line is not None:
                self.returncode = int(json.loads(line)["exit"])
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            line = self._answer(timeout)
            if line is None:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            self.returncode = int(json.loads(line)["exit"])
        return self.returncode

    def communicate(
        self, input: str | bytes | None = None, timeout: float | None = None
    ) -> tuple[Any, Any]:
        """Feed ``input`` to stdin, read stdout and stderr to their end, wait for the exit:
        (stdout, stderr), each None where it is not a pipe (as ``Popen.communicate``)."""
        if self._readers is None:
            self._readers = [
                threading.Thread(target=self._read_all, args=(name,), daemon=True)
                for name in ("stdout", "stderr")
                if getattr(self, name) is not None
            ]
            for reader in self._readers:
                reader.start()
            if self.stdin is not None:
                with contextlib.suppress(BrokenPipeError):
                    if input:
                        self.stdin.write(input)
                    self.stdin.close()
        self.wait(timeout)
        for reader in self._readers:
            reader.join()
        return self._read.get("stdout"), self._read.get("stderr")

    def _read_all(self, name: str) -> None:
        self._read[name] = getattr(self, name).read()

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def close(self) -> None:
        """Close the streams and the control socket (the server kills a child whose test has
        closed it before it ended)."""
        for stream in (self.stdin, self.stdout, self.stderr):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()
        self._control.close()

    def __enter__(self) -> WarmProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            if self.stdin is not None:
                with contextlib.suppress(OSError):
                    self.stdin.close()
            self.wait()
        finally:
            self.close()


def _ignored(signum: int) -> bool:
    try:
        return signal.getsignal(signum) == signal.SIG_IGN
    except (OSError, ValueError):
        return False


def _refuse_shadowed_imports(pythonpath: list[str], server: _Server) -> None:
    """A folder of the child's ``PYTHONPATH`` that holds another copy of a package the server
    has imported (a stand-in for it) would not be seen: such a child needs a real process."""
    import importlib.util

    for folder in pythonpath:
        if folder in server.pythonpath:
            continue
        for name in server.preloaded:
            for there in (Path(folder) / name, Path(folder) / f"{name}.py"):
                spec = importlib.util.find_spec(name)
                imported = Path(spec.origin) if spec is not None and spec.origin else None
                if imported is not None and imported.name == "__init__.py":
                    imported = imported.parent
                if there.exists() and (imported is None or there.resolve() != imported.resolve()):
                    raise ValueError(
                        f"warmfork: {there} is not the {name} the server has imported: "
                        "run this child with subprocess"
                    )


#: ``subprocess.Popen(args, start_new_session=True, ...)`` for ``args`` =
#: ``[sys.executable, script | -c CODE | -m MODULE, ...]``, forked from the warm server.
popen = WarmProcess


def run(
    args: Sequence[str | os.PathLike[str]],
    *,
    input: str | bytes | None = None,
    capture_output: bool = False,
    timeout: float | None = None,
    check: bool = False,
    **options: Any,
) -> subprocess.CompletedProcess[Any]:
    """``subprocess.run`` of a Python child forked from the warm server; ``options``: those of
    :func:`popen` but ``stdin``. On a timeout the child's process group is killed and
    ``TimeoutExpired`` raised."""
    if capture_output:
        options["stdout"] = options["stderr"] = subprocess.PIPE
    proc = popen(args, stdin=subprocess.PIPE if input is not None else None, **options)
    try:
        try:
            out, err = proc.communicate(input, timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
        code = proc.wait()
    finally:
        proc.close()
    done = subprocess.CompletedProcess(proc.args, code, out, err)
    if check:
        done.check_returncode()
    return done
