"""What each storage backend brings to the contract: a location, a raw view, a recorder.

Also the edges of the world the contract runs against: a real S3 API server (moto) on
loopback, and a guard that refuses any network connection that is not to loopback, so that
no test can ever reach real AWS whatever the environment holds.

This module is imported by the contract's conftest and by ``other_process.py`` (run as a
script), so it imports nothing from the test package and nothing heavy.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from fsspec.implementations.dirfs import DirFileSystem

from nbresume.checkpoint.backends import FsspecStore
from nbresume.checkpoint.store import CheckpointStore
from testkit.ports import free_port

#: One thing a backend did, in order: ("written", "000000000001/model.safetensors"),
#: ("opened", ...), ("removed", ...), ("renamed", src, dst). Paths are relative to the root.
Event = tuple[str, ...]

FAKE_AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}


# -- audit hooks: the loopback guard and the local write recorder -----------------------------

_listeners: list[Callable[[str, tuple[Any, ...]], None]] = []


def _dispatch(event: str, args: tuple[Any, ...]) -> None:
    if _listeners:
        for listener in list(_listeners):
            listener(event, args)


sys.addaudithook(_dispatch)


def _is_loopback(host: object) -> bool:
    if isinstance(host, bytes):
        host = host.decode(errors="replace")
    if not isinstance(host, str):
        return False
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.split("%", 1)[0]).is_loopback
    except ValueError:
        return False


@contextlib.contextmanager
def loopback_only() -> Iterator[list[str]]:
    """Refuse every connection and name lookup that is not for loopback; yield what was refused.

    A refused connection raises ``PermissionError`` inside whatever tried it (botocore would
    report an endpoint error), and is listed so that the test fails even if it was retried away.
    """
    refused: list[str] = []

    def guard(event: str, args: tuple[Any, ...]) -> None:
        target = None
        if event == "socket.connect" and isinstance(args[1], tuple):
            target = args[1][0]
        elif event == "socket.getaddrinfo" and args[0] is not None:
            target = args[0]
        if target is not None and not _is_loopback(target):
            refused.append(f"{event} {target!r}")
            raise PermissionError(f"the storage contract stays on loopback, refused {target!r}")

    _listeners.append(guard)
    try:
        yield refused
    finally:
        _listeners.remove(guard)


def install_loopback_guard() -> None:
    """The guard for a whole (child) process."""
    loopback_only().__enter__()


@contextlib.contextmanager
def noting_local_writes(root: Path) -> Iterator[list[Event]]:
    """Note the files opened for writing, the renames and the removals below ``root``, in order,
    as the interpreter reports them (audit events): what a local store does, seen from outside."""
    events: list[Event] = []
    base = os.path.realpath(root)

    def rel(path: object) -> str | None:
        if not isinstance(path, (str, os.PathLike)):
            return None
        full = os.path.realpath(os.fspath(path))
        if full != base and not full.startswith(base + os.sep):
            return None
        return os.path.relpath(full, base).replace(os.sep, "/")

    def note(event: str, args: tuple[Any, ...]) -> None:
        if event == "open" and isinstance(args[1], str) and set(args[1]) & set("wxa"):
            if (name := rel(args[0])) is not None:
                events.append(("opened", name))
        elif event == "os.rename":
            src, dst = rel(args[0]), rel(args[1])
            if src is not None and dst is not None:
                events.append(("renamed", src, dst))
        elif event in ("shutil.rmtree", "os.remove", "os.rmdir") and (name := rel(args[0])):
            events.append(("removed", name))

    _listeners.append(note)
    try:
        yield events
    finally:
        _listeners.remove(note)


# -- a file system that notes what happens to it ----------------------------------------------


class _NotingFile:
    """A write handle that notes when its file was closed (on object stores: when it appeared)."""

    def __init__(self, inner: IO[bytes], on_close: Callable[[], None]) -> None:
        self._inner = inner
        self._on_close = on_close
        self._closed = False

    def write(self, data: Any) -> int:
        return self._inner.write(data)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._inner.close()
            self._on_close()

    def __enter__(self) -> _NotingFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class RecordingFileSystem(DirFileSystem):  # type: ignore[misc]
    """The backend's own file system below ``path``, noting completed writes and removals.

    Only the edge is wrapped (the file system nbresume is handed), never nbresume itself.
    """

    events: list[Event]

    def open(self, path: str, mode: str = "rb", *args: Any, **kwargs: Any) -> Any:
        handle = super().open(path, mode, *args, **kwargs)
        if set(mode) & set("wxa"):
            name = path.strip("/")
            return _NotingFile(handle, lambda: self.events.append(("written", name)))
        return handle

    def rm_file(self, path: str, **kwargs: Any) -> None:
        super().rm_file(path, **kwargs)
        self.events.append(("removed", path.strip("/")))

    def rm(self, path: str, *args: Any, **kwargs: Any) -> None:
        super().rm(path, *args, **kwargs)
        self.events.append(("removed", path.strip("/")))


# -- the backend description ------------------------------------------------------------------


@dataclass
class Backend:
    """A place checkpoints can live, as the contract tests see it.

    ``location`` and ``storage_options`` are what a user passes; ``fs`` and ``root`` are a raw
    view of the same place through the backend's own file system (a separate instance, so it
    shares no listing cache with the store under test).
    """

    name: str
    location: str
    fs: Any
    root: str
    #: No atomic rename: the manifest alone commits, and writes happen in place.
    object_store: bool
    storage_options: dict[str, Any] = field(default_factory=dict)
    #: Whether another process sees the same store (not so for ``memory://``).
    shared_across_processes: bool = True
    #: Whether the store itself reports each file's MD5 (S3's ETag of a single-part upload).
    reports_md5: bool = False
    #: Whether the backend has every manifest record MD5s (Google Drive compares them with the
    #: MD5s Drive reports), not only when ``md5=True`` asks for them.
    records_md5: bool = False
    #: The S3 endpoint everything must talk to, where there is one.
    endpoint: str | None = None

    def open(self, **kwargs: Any) -> CheckpointStore:
        """A :class:`CheckpointStore` as a user opens it."""
        return CheckpointStore(
            self.location, storage_options=self.storage_options or None, **kwargs
        )

    def open_elsewhere(self, **kwargs: Any) -> CheckpointStore:
        """A second store on the raw view's file system instance: it shares no listing cache
        with the stores of :meth:`open`, as a store in another process would not."""
        if not self.object_store:
            return self.open(**kwargs)
        return CheckpointStore(FsspecStore(self.location, fs=self.fs, root=self.root), **kwargs)

    @contextlib.contextmanager
    def recorded(self, **kwargs: Any) -> Iterator[tuple[CheckpointStore, list[Event]]]:
        """A store whose writes, renames and removals are noted, in the order they happened."""
        if not self.object_store:
            with noting_local_writes(Path(self.root)) as events:
                yield self.open(**kwargs), events
            return
        recording = RecordingFileSystem(path=self.root, fs=self.fs, skip_instance_cache=True)
        recording.events = []
        store = CheckpointStore(FsspecStore(self.location, fs=recording, root=""), **kwargs)
        yield store, recording.events

    # Raw access, bypassing nbresume.

    def path(self, *names: str) -> str:
        return "/".join([self.root, *names])

    def write(self, data: bytes, *names: str) -> None:
        self.fs.pipe_file(self.path(*names), data)
        self.fs.invalidate_cache()

    def read(self, *names: str) -> bytes:
        self.fs.invalidate_cache()
        data: bytes = self.fs.cat_file(self.path(*names))
        return data

    def _entries(self, *names: str) -> list[dict[str, Any]]:
        self.fs.invalidate_cache()
        try:
            entries: list[dict[str, Any]] = self.fs.ls(self.path(*names), detail=True)
        except FileNotFoundError:
            return []
        return entries

    def folders(self) -> set[str]:
        """Every folder directly below the root, hidden ones included."""
        return {
            e["name"].rstrip("/").rsplit("/", 1)[-1]
            for e in self._entries()
            if e["type"] == "directory"
        }

    def files(self, folder: str) -> set[str]:
        return {e["name"].rsplit("/", 1)[-1] for e in self._entries(folder) if e["type"] == "file"}

    def server_md5(self, *names: str) -> str | None:
        """The MD5 the store itself reports for a file, where it reports one."""
        if not self.reports_md5:
            return None
        self.fs.invalidate_cache()
        etag: str = self.fs.info(self.path(*names))["ETag"]
        return etag.strip('"')

    def endpoint_of(self, fs: Any) -> str | None:
        """The endpoint an S3 file system's client really talks to."""
        fs.connect()
        url: str = fs.s3.meta.endpoint_url
        return url


# -- a real S3 API server on loopback ---------------------------------------------------------


def start_moto_server(log: Path) -> tuple[subprocess.Popen[bytes], str]:
    """moto's S3 server in its own process on a free loopback port; wait until it answers."""
    for _ in range(5):
        port = free_port()
        endpoint = f"http://127.0.0.1:{port}"
        with log.open("ab") as sink:
            server = subprocess.Popen(
                [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                stdout=sink,
                stderr=subprocess.STDOUT,
                env={**os.environ, **FAKE_AWS_ENV},
            )
        deadline = time.monotonic() + 60
        while server.poll() is None and time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=2):
                    return server, endpoint
            except OSError:
                time.sleep(0.05)
        # The port was taken in between, or the server did not come up: try another port.
        server.kill()
        server.wait()
    raise RuntimeError(f"moto's S3 server did not start; its output is in {log}")


# -- behind a write-back cache ----------------------------------------------------------------


def settle(store: CheckpointStore, timeout: float = 60.0) -> None:
    """Behind a write-back cache (Google Drive's mount), retention keeps older checkpoints
    until the durable store confirms the newer ones: wait until it confirms every checkpoint,
    then apply retention again, as the next save would. A local folder: wait until what
    retention took out of view is removed (in the background). Others: nothing to do."""
    backend = store.backend
    store.wait_removals()
    if not backend.write_back:
        return
    deadline = time.monotonic() + timeout
    for info in store.list():
        while not backend.durability(info.name, info.manifest).saved:
            if time.monotonic() > deadline:
                raise AssertionError(f"{info.location} never reached the durable store")
            time.sleep(0.05)
    store.prune()


# -- what another writer saves -----------------------------------------------------------------


def payload(value: int) -> dict[str, Any]:
    """The keyword arguments of ``save`` for a small checkpoint that ``value`` identifies;
    its size depends on ``value`` too, so a rewrite changes both bytes and length."""
    import numpy as np

    return {
        "tensors": {"model": {"w": np.full(8 + value % 7, value, dtype=np.float32)}},
        "data": {"state": {"value": value}},
    }
