"""The writer lease: one live writer per checkpoint folder, with real processes.

A second training run started on a folder that a live run writes to is refused when its
Checkpointer is created, naming the holder; the first run loses nothing. A lease left by a
killed process, or by another machine that stopped renewing it, is taken over. Readers need no
lease. The same holds on an object store: moto's S3 server on loopback, with processes of
their own, and ``memory://`` in one process.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import re
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from nbresume import Checkpointer, CheckpointStore
from nbresume.checkpoint.store import LEASE_NAME, this_process
from nbresume.checkpoint.store import lease as lease_module
from nbresume.cli import main as cli_main
from nbresume.errors import CheckpointError, FolderInUseError, LeaseLostError, StorageError
from testkit import warmfork
from testkit.cli import run_command
from testkit.paths import with_testkit
from testkit.stateful import Counter

# A training run as a user writes it: a Checkpointer that saves every step and keeps three.
# It prints each checkpoint it reports saved, trains until `total` or until the stop file
# appears (then it saves and stops cleanly), and prints its counter at the end.
WRITER = r"""
import json, os, sys, time
location, total, pause, stop_file, options = sys.argv[1:6]
options = json.loads(options)
if options:
    from testkit.backends import install_loopback_guard
    install_loopback_guard()
from nbresume import Checkpointer
from testkit.stateful import Counter

def say(line):
    sys.stdout.write(line + "\n")  # one write: lines from two threads never mix
    sys.stdout.flush()

def record(event):
    if event.kind == "verified":
        say(f"saved {event.step}")

counter = Counter()
ckpt = Checkpointer(location, every=1, keep=3, deadline=None, callbacks=[record],
                    storage_options=options or None, counter=counter)
say(f"holding from {ckpt.restore()}")
for step in ckpt.steps(int(total)):
    counter.count += 1
    time.sleep(float(pause))
    if stop_file and os.path.exists(stop_file):
        ckpt.request_stop("asked to stop")
ckpt.close()
say(f"done {counter.count}")
"""


class Writer:
    """A writer process, its output read line by line as it comes: forked from the warm
    server, or with ``fresh`` a new interpreter, a child of the test's own (whose pid stays
    taken, by a zombie, until the test reaps it)."""

    def __init__(
        self,
        location: str,
        *,
        total: int = 100_000,
        pause: float = 0.0,
        stop_file: Path | None = None,
        options: dict[str, Any] | None = None,
        env: dict[str, str] | None = None,
        fresh: bool = False,
    ) -> None:
        start: Any = subprocess.Popen if fresh else warmfork.popen
        self.proc = start(
            [sys.executable, "-c", WRITER, location, str(total), str(pause),
             str(stop_file or ""), json.dumps(options or {})],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=with_testkit({**os.environ, **(env or {})}),
        )  # fmt: skip
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        self.stderr = ""
        self._errors: list[str] = []
        self._pumps = [
            threading.Thread(target=self._pump, daemon=True),
            threading.Thread(target=self._pump_errors, daemon=True),
        ]
        for pump in self._pumps:
            pump.start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.strip())
        self.lines.put("")  # end of output

    def _pump_errors(self) -> None:
        assert self.proc.stderr is not None
        self._errors.append(self.proc.stderr.read())

    def wait_for(self, prefix: str, timeout: float = 120) -> str:
        """The first line from now on that starts with ``prefix``; fails if the process ends
        first."""
        deadline = time.monotonic() + timeout
        while True:
            line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            if line == "":  # its output ended: so did the process
                self.finish()
                raise AssertionError(f"writer ended before {prefix!r}: {self.stderr}")
            self.seen.append(line)
            if line.startswith(prefix):
                return line

    def finish(self, timeout: float = 120) -> int:
        """Wait for the end; keep the rest of the output. Returns the exit status."""
        self.proc.wait(timeout=timeout)
        for pump in self._pumps:
            pump.join(timeout=timeout)
        self.stderr = "".join(self._errors)
        while not self.lines.empty():
            line = self.lines.get()
            if line:
                self.seen.append(line)
        return self.proc.returncode

    def saved(self) -> list[int]:
        return [int(line.split()[1]) for line in self.seen if line.startswith("saved ")]


def lease_file(folder: Path) -> dict[str, Any]:
    document: dict[str, Any] = json.loads((folder / LEASE_NAME).read_text())
    return document


def lease_of_another_host(*, renewed_ago: float) -> bytes:
    """A lease as another machine's writer would have left it (its documented fields)."""
    now = time.time()
    return json.dumps(
        {
            "format": "nbresume-lease",
            "version": 1,
            "token": uuid.uuid4().hex,
            "host": "gpu-box-7.example",
            "pid": 4242,
            "since": now - renewed_ago - 600,
            "renewed": now - renewed_ago,
            "expiry_s": 180,
            "program": "train.py",
        }
    ).encode()


QUIET: dict[str, Any] = {"every": None, "deadline": None}


# -- two processes, one folder --------------------------------------------------------------


@pytest.mark.slow
def test_a_second_writer_is_refused_and_the_first_loses_nothing(tmp_path: Path) -> None:
    folder, stop = tmp_path / "run", tmp_path / "stop"
    first = Writer(str(folder), pause=0.05, stop_file=stop)
    first.wait_for("saved 2")

    second = Writer(str(folder), pause=0.05, stop_file=stop)
    assert second.finish() != 0, "the second writer was not refused"
    assert "FolderInUseError" in second.stderr
    assert f"pid {first.pid} on host {socket.gethostname()!r}" in second.stderr
    assert "another dir=" in second.stderr
    assert not second.saved()

    first.wait_for("saved 6")  # it went on saving, undisturbed
    stop.touch()
    assert first.finish() == 0, first.stderr
    reported = sorted(set(first.saved()))
    store = CheckpointStore(folder, keep=None)
    # keep=3: the three newest checkpoints the run reported saved are there and verify; no
    # other writer's step and no leftover folder is.
    assert [i.step for i in store.list()] == reported[-3:]
    report = store.verify()
    assert report.ok
    assert not report.uncommitted
    assert sorted(os.listdir(folder)) == [f"{s:012d}" for s in reported[-3:]]  # lease returned


@pytest.mark.slow
def test_a_killed_writers_lease_is_taken_over_and_the_run_resumes(tmp_path: Path) -> None:
    folder = tmp_path / "run"
    # A child of this process, not of the warm server: the server would reap it at once.
    first = Writer(str(folder), pause=0.05, fresh=True)
    first.wait_for("saved 3")
    first.proc.kill()  # kill -9; not reaped yet: a zombie holds the pid meanwhile
    try:
        second = Writer(str(folder), total=40)
        resumed_from = int(second.wait_for("holding from").split()[-1])
        assert second.finish() == 0, second.stderr
    finally:
        first.proc.wait()
    assert "took over the writer lease" in second.stderr
    assert f"pid {first.pid} on this machine) is no longer running" in second.stderr
    assert resumed_from >= 3
    assert "done 40" in second.seen  # the counter continued exactly from the checkpoint
    assert [i.step for i in CheckpointStore(folder).list()] == [38, 39, 40]
    assert CheckpointStore(folder).verify().ok


@pytest.mark.slow
def test_a_live_writer_on_this_machine_is_never_taken_over(tmp_path: Path) -> None:
    folder, stop = tmp_path / "run", tmp_path / "stop"
    first = Writer(str(folder), pause=0.05, stop_file=stop)
    try:
        first.wait_for("saved 1")
        # As if its renewals had stopped for an hour (a stuck thread): its process still runs,
        # and on the same machine that is what counts.
        document = lease_file(folder)
        document["renewed"] -= 3600
        (folder / LEASE_NAME).write_text(json.dumps(document))
        with pytest.raises(FolderInUseError, match=f"pid {first.pid} on host") as refused:
            Checkpointer(folder, **QUIET)
        assert refused.value.where == str(folder)
        assert "nbresume ls" in refused.value.fix
    finally:
        stop.touch()
        assert first.finish() == 0, first.stderr


@pytest.fixture
def no_settle(monkeypatch: pytest.MonkeyPatch) -> None:
    """A takeover in this process reads its lease back at once rather than after
    ``LEASE_SETTLE_S``: the pause tells apart two writers taking over one stale lease at the
    same moment, which a test using this never starts."""
    monkeypatch.setattr(lease_module, "LEASE_SETTLE_S", 0.0)


@pytest.mark.usefixtures("no_settle")
def test_a_stale_lease_from_another_host_is_taken_over(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / LEASE_NAME).write_bytes(lease_of_another_host(renewed_ago=600))
    counter = Counter()
    with caplog.at_level(logging.WARNING, logger="nbresume"):
        ckpt = Checkpointer(folder, counter=counter, **QUIET)
    assert re.search(r"took over the writer lease .*gpu-box-7\.example.*: it expired", caplog.text)
    counter.count = 5
    assert ckpt.save(step=5, block=True) is not None
    assert lease_file(folder)["pid"] == os.getpid()
    ckpt.close()
    assert not (folder / LEASE_NAME).exists()


def test_a_fresh_lease_from_another_host_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "run"
    folder.mkdir()
    written = lease_of_another_host(renewed_ago=20)
    (folder / LEASE_NAME).write_bytes(written)
    with pytest.raises(FolderInUseError) as refused:
        Checkpointer(folder, **QUIET)
    message = str(refused.value)
    assert "pid 4242 on host 'gpu-box-7.example' (train.py)" in message
    assert "renewed 20 s ago" in message
    assert "its lease expires at" in message  # when that machine is gone
    assert (folder / LEASE_NAME).read_bytes() == written
    assert os.listdir(folder) == [LEASE_NAME]


# -- one process -------------------------------------------------------------------------------


def test_a_checkpointer_made_again_in_the_same_process_takes_over(tmp_path: Path) -> None:
    folder = tmp_path / "run"
    old = Checkpointer(folder, counter=Counter(), **QUIET)
    old.save(step=1)  # in flight while the cell is run again: it finishes first
    counter = Counter()
    new = Checkpointer(folder, counter=counter, **QUIET)
    assert new.restore() == 1
    counter.count = 2
    assert new.save(step=2, block=True) is not None

    with pytest.raises(LeaseLostError, match="newer Checkpointer"):
        old.save(step=3, block=True)
    old.save(step=3)  # in the background: it fails there, and says so
    with pytest.raises(CheckpointError, match="newer Checkpointer"):
        old.wait()
    old.close()  # leaves the newer one's lease alone
    assert [i.step for i in CheckpointStore(folder).list()] == [1, 2]
    assert lease_file(folder)["pid"] == os.getpid()
    new.close()
    assert not (folder / LEASE_NAME).exists()


def test_a_writer_that_lost_its_lease_writes_nothing(tmp_path: Path) -> None:
    folder = tmp_path / "run"
    ckpt = Checkpointer(folder, counter=Counter(), **QUIET)
    assert ckpt.save(step=1, block=True) is not None
    # Another machine took the folder over while this process was suspended past the expiry.
    taken = lease_of_another_host(renewed_ago=0)
    (folder / LEASE_NAME).write_bytes(taken)
    with pytest.raises(LeaseLostError, match=r"gpu-box-7\.example") as lost:
        ckpt.save(step=2, block=True)
    assert "stop this run" in lost.value.fix
    assert sorted(os.listdir(folder)) == [LEASE_NAME, "000000000001"]
    ckpt.close()
    assert (folder / LEASE_NAME).read_bytes() == taken  # the new holder's lease stays


def test_close_and_a_with_block_give_the_lease_back(tmp_path: Path) -> None:
    folder = tmp_path / "run"
    with Checkpointer(folder, counter=Counter(), **QUIET) as ckpt:
        ckpt.save(step=1)
        assert (folder / LEASE_NAME).exists()
    assert not (folder / LEASE_NAME).exists()
    assert [i.step for i in CheckpointStore(folder).list()] == [1]
    # A closed Checkpointer that saves again takes the lease again, as a new writer would.
    assert ckpt.save(step=2, block=True) is not None
    assert lease_file(folder)["pid"] == os.getpid()
    ckpt.close()
    assert not (folder / LEASE_NAME).exists()


def test_a_closed_checkpointer_does_not_take_the_folder_from_a_newer_one(tmp_path: Path) -> None:
    folder = tmp_path / "run"
    old = Checkpointer(folder, counter=Counter(), **QUIET)
    old.close()
    new = Checkpointer(folder, counter=Counter(), **QUIET)
    with pytest.raises(LeaseLostError, match="newer Checkpointer"):
        old.save(step=1, block=True)
    assert new.save(step=2, block=True) is not None
    assert [i.step for i in CheckpointStore(folder).list()] == [2]
    new.close()


# -- lease files nbresume did not write ----------------------------------------------------------


def this_machine() -> dict[str, str]:
    """The host and machine fields a lease written on this machine carries."""
    me = this_process("", 0.0, 180.0, "")
    return {"host": me.host, "machine": me.machine}


# Each is a lease file as a hostile or broken writer could leave it: a value nbresume never
# writes. Each is a lease that cannot be read, and is taken over like a stale one.
ODD_LEASES = {
    "renewed NaN": '{"token": "t", "host": "gpu-box-7.example", "pid": 4242, "renewed": NaN}',
    "since Infinity": (
        '{"token": "t", "host": "gpu-box-7.example", "pid": 4242, "since": Infinity, '
        f'"renewed": {time.time()}}}'
    ),
    "renewed 1e300": '{"token": "t", "host": "gpu-box-7.example", "pid": 4242, "renewed": 1e300}',
    "pid 2**62 on this machine": json.dumps(
        {"token": "t", **this_machine(), "pid": 2**62, "renewed": time.time()}
    ),
    "pid as text": json.dumps(
        {"token": "t", "host": "gpu-box-7.example", "pid": "4242", "renewed": time.time()}
    ),
    "host as a list": json.dumps(
        {"token": "t", "host": ["gpu-box-7"], "pid": 4242, "renewed": time.time()}
    ),
}


@pytest.mark.parametrize("lease", ODD_LEASES.values(), ids=ODD_LEASES.keys())
@pytest.mark.usefixtures("no_settle")
def test_a_lease_file_holding_values_nbresume_never_writes_is_taken_over(
    tmp_path: Path,
    lease: str,
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
) -> None:
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / LEASE_NAME).write_text(lease)
    assert cli_main(["prune", str(folder), "--keep", "1"]) == 0
    assert "Traceback" not in capsys.readouterr().err
    assert not (folder / LEASE_NAME).exists()

    (folder / LEASE_NAME).write_text(lease)
    counter = Counter()
    with caplog.at_level(logging.WARNING, logger="nbresume"):
        ckpt = Checkpointer(folder, counter=counter, **QUIET)
    assert "took over the writer lease" in caplog.text
    assert "its lease file cannot be read" in caplog.text
    counter.count = 1
    assert ckpt.save(step=1, block=True) is not None
    assert lease_file(folder)["pid"] == os.getpid()
    ckpt.close()
    assert [i.step for i in CheckpointStore(folder).list()] == [1]


def plant(path: Path, kind: str, elsewhere: Path) -> None:
    if kind == "a named pipe (FIFO)":
        os.mkfifo(path)
    elif kind == "a folder":
        path.mkdir()
        (path / "notes.txt").write_text("a user's file")
    else:  # a link to a lease that looks fresh: never followed
        elsewhere.write_bytes(lease_of_another_host(renewed_ago=0))
        path.symlink_to(elsewhere)


@pytest.mark.timeout(60)  # a FIFO opened for reading would wait here forever
@pytest.mark.parametrize("kind", ["a named pipe (FIFO)", "a folder", "a symbolic link"])
def test_something_else_in_the_lease_files_place_is_named_with_the_fix(
    tmp_path: Path, kind: str, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "run"
    folder.mkdir()
    path = folder / LEASE_NAME
    plant(path, kind, tmp_path / "elsewhere.json")
    fix = "mv " if kind == "a folder" else "rm "

    ckpt = Checkpointer(folder, counter=Counter(), **QUIET)
    assert ckpt.restore() == 0  # reading needs no lease
    with pytest.raises(StorageError) as refused:
        ckpt.save(step=1, block=True)
    assert refused.value.where == str(path)
    assert f"is {kind}, not a file" in str(refused.value)
    assert fix + str(path) in refused.value.fix
    ckpt.close()

    assert cli_main(["prune", str(folder), "--keep", "1"]) == 1
    err = capsys.readouterr().err
    assert f"{path} is {kind}" in err
    assert fix + str(path) in err
    assert "Traceback" not in err
    # Left as it was: nbresume removes nothing it did not make.
    assert path.is_symlink() if kind == "a symbolic link" else path.exists()
    assert sorted(os.listdir(folder)) == [LEASE_NAME]


def lease_from_a_clock_ahead(*, renewed: float, expiry_s: float) -> bytes:
    document = json.loads(lease_of_another_host(renewed_ago=0))
    document.update(renewed=renewed, expiry_s=expiry_s)
    return json.dumps(document).encode()


def test_a_lease_dated_in_the_future_is_judged_by_its_renewals_not_its_date(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = tmp_path / "run"
    folder.mkdir()
    in_2096 = time.time() + 70 * 365.25 * 86400
    # Its holder's clock said 2096 and the holder is gone: no renewal comes within the
    # lease's expiry (2 s here), by this machine's clock.
    (folder / LEASE_NAME).write_bytes(lease_from_a_clock_ahead(renewed=in_2096, expiry_s=2))
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="nbresume"):
        ckpt = Checkpointer(folder, counter=Counter(), **QUIET)
    assert 2 <= time.monotonic() - started < 30
    assert "dated ahead of this machine's clock" in caplog.text
    assert "not renewed while this process watched it for 2 s" in caplog.text
    assert ckpt.save(step=1, block=True) is not None
    assert lease_file(folder)["pid"] == os.getpid()
    ckpt.close()


def test_a_lease_dated_in_the_future_and_still_renewed_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "run"
    folder.mkdir()
    path = folder / LEASE_NAME
    ahead = 3 * 3600.0
    path.write_bytes(lease_from_a_clock_ahead(renewed=time.time() + ahead, expiry_s=5))
    document = json.loads(path.read_bytes())
    stop = threading.Event()

    def holder_renews() -> None:  # the live holder on the machine whose clock is ahead
        while not stop.wait(0.5):
            document["renewed"] = time.time() + ahead
            aside = folder / "renewal.tmp"
            aside.write_text(json.dumps(document))
            os.replace(aside, path)

    renewing = threading.Thread(target=holder_renews, daemon=True)
    renewing.start()
    try:
        with pytest.raises(FolderInUseError) as refused:
            Checkpointer(folder, **QUIET)
    finally:
        stop.set()
        renewing.join()
    assert "pid 4242 on host 'gpu-box-7.example'" in str(refused.value)
    assert "clock is 3 h" in refused.value.fix
    assert "ahead of this one's" in refused.value.fix
    assert "expires at" not in refused.value.fix  # no date decades away
    assert json.loads(path.read_bytes())["token"] == document["token"]  # the holder keeps it
    assert os.listdir(folder) == [LEASE_NAME]


# -- readers -----------------------------------------------------------------------------------


@pytest.mark.slow
def test_readers_need_no_lease_and_prune_waits_for_the_writer(tmp_path: Path) -> None:
    folder, stop = tmp_path / "run", tmp_path / "stop"
    writer = Writer(str(folder), pause=0.05, stop_file=stop)
    try:
        writer.wait_for("saved 5")
        listed = run_command("ls", str(folder))
        assert listed.returncode == 0, listed.stderr
        assert "checkpoint(s)" in listed.stdout
        assert LEASE_NAME not in listed.stdout
        verified = run_command("verify", str(folder))
        assert verified.returncode == 0, verified.stdout + verified.stderr
        assert LEASE_NAME not in verified.stdout

        store = CheckpointStore(folder)
        assert store.load().step >= 5
        assert LEASE_NAME not in [i.name for i in store.list()]

        before = (folder / LEASE_NAME).read_bytes()
        pruned = run_command("prune", str(folder), "--keep", "1")
        assert pruned.returncode == 1
        assert f"pid {writer.pid} on host" in pruned.stderr
        assert (folder / LEASE_NAME).read_bytes() == before  # the writer's lease is untouched
    finally:
        stop.touch()
        assert writer.finish() == 0, writer.stderr
    last = writer.saved()[-1]
    pruned = run_command("prune", str(folder), "--keep", "1")
    assert pruned.returncode == 0, pruned.stderr
    assert [i.step for i in CheckpointStore(folder).list()] == [last]
    assert not (folder / LEASE_NAME).exists()


# -- object stores -----------------------------------------------------------------------------


@pytest.fixture
def memory_url() -> Iterator[str]:
    import fsspec

    name = f"nbresume-lease-{uuid.uuid4().hex}"
    yield f"memory://{name}/run"
    fs = fsspec.filesystem("memory")
    if fs.exists(f"/{name}"):
        fs.rm(f"/{name}", recursive=True)


def test_on_an_object_store_a_fresh_lease_is_refused_and_an_expired_one_taken(
    memory_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    import fsspec

    fs = fsspec.filesystem("memory")
    path = memory_url.removeprefix("memory://") + "/" + LEASE_NAME
    fs.pipe_file(path, lease_of_another_host(renewed_ago=5))
    with pytest.raises(FolderInUseError, match=r"gpu-box-7\.example"):
        Checkpointer(memory_url, **QUIET)

    fs.pipe_file(path, lease_of_another_host(renewed_ago=3600))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="nbresume"):
        ckpt = Checkpointer(memory_url, counter=Counter(), **QUIET)
    assert "took over the writer lease" in caplog.text
    assert ckpt.save(step=1, block=True) is not None
    again = Checkpointer(memory_url, counter=Counter(), **QUIET)  # same process: takes over
    assert again.restore() == 1
    with pytest.raises(LeaseLostError):
        ckpt.save(step=2, block=True)
    assert [i.step for i in CheckpointStore(memory_url).list()] == [1]
    again.close()
    ckpt.close()
    assert not fs.exists(path)


def test_on_an_object_store_a_folder_in_the_lease_files_place_is_named_with_the_fix(
    memory_url: str,
) -> None:
    import fsspec

    fs = fsspec.filesystem("memory")
    inside = memory_url.removeprefix("memory://") + f"/{LEASE_NAME}/notes.txt"
    fs.pipe_file(inside, b"a user's file")
    ckpt = Checkpointer(memory_url, counter=Counter(), **QUIET)
    with pytest.raises(StorageError) as refused:
        ckpt.save(step=1, block=True)
    assert refused.value.where == f"{memory_url}/{LEASE_NAME}"
    assert "is a folder, not a file" in str(refused.value)
    assert "move the objects under that name elsewhere" in refused.value.fix
    ckpt.close()
    assert fs.cat_file(inside) == b"a user's file"


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """moto's S3 server on loopback, a fresh bucket, and what a client needs to reach it."""
    pytest.importorskip("moto")
    import s3fs

    from testkit.backends import FAKE_AWS_ENV, loopback_only, start_moto_server

    home = tmp_path_factory.mktemp("moto")
    server, endpoint = start_moto_server(home / "server.log")
    env = {
        **FAKE_AWS_ENV,
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_CONFIG_FILE": str(home / "none"),
        "AWS_SHARED_CREDENTIALS_FILE": str(home / "none"),
    }
    options = {
        "endpoint_url": endpoint,
        "key": FAKE_AWS_ENV["AWS_ACCESS_KEY_ID"],
        "secret": FAKE_AWS_ENV["AWS_SECRET_ACCESS_KEY"],
    }
    try:
        # Nothing here may reach a real service, whatever the environment holds.
        with loopback_only() as refused:
            raw = s3fs.S3FileSystem(skip_instance_cache=True, **options)
            bucket = f"nbresume-{uuid.uuid4().hex[:20]}"
            raw.mkdir(bucket)
            yield {"url": f"s3://{bucket}/run", "options": options, "env": env, "raw": raw}
        assert not refused, f"a test tried to leave loopback: {refused}"
    finally:
        server.terminate()
        server.wait(timeout=30)


@pytest.mark.slow
def test_on_s3_a_second_process_is_refused_and_a_killed_ones_lease_taken_over(
    s3: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    url, options, env = s3["url"], s3["options"], s3["env"]
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    first = Writer(url, pause=0.05, options=options, env=env)
    first.wait_for("saved 2")
    second = Writer(url, options=options, env=env)
    assert second.finish() != 0, "the second writer was not refused"
    assert f"pid {first.pid} on host {socket.gethostname()!r}" in second.stderr
    first.wait_for("saved 4")
    first.proc.kill()
    first.proc.wait()
    third = Writer(url, total=12, options=options, env=env)
    assert third.finish() == 0, third.stderr
    assert "took over the writer lease" in third.stderr
    assert "done 12" in third.seen
    store = CheckpointStore(url, storage_options=options)
    assert [i.step for i in store.list()] == [10, 11, 12]
    assert store.verify().ok
    raw = s3["raw"]
    assert not raw.exists(f"{url.removeprefix('s3://')}/{LEASE_NAME}")


@pytest.mark.slow
def test_on_s3_a_lease_of_another_host_is_honoured_until_it_expires(
    s3: dict[str, Any], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    for name, value in s3["env"].items():
        monkeypatch.setenv(name, value)
    url = s3["url"].replace("/run", "/other")
    path = f"{url.removeprefix('s3://')}/{LEASE_NAME}"
    raw = s3["raw"]
    raw.pipe_file(path, lease_of_another_host(renewed_ago=5))
    with pytest.raises(FolderInUseError, match=r"gpu-box-7\.example"):
        Checkpointer(url, storage_options=s3["options"], **QUIET)
    raw.pipe_file(path, lease_of_another_host(renewed_ago=3600))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="nbresume"):
        ckpt = Checkpointer(url, storage_options=s3["options"], counter=Counter(), **QUIET)
    assert "took over the writer lease" in caplog.text
    assert ckpt.save(step=1, block=True) is not None
    raw.invalidate_cache()
    assert json.loads(raw.cat_file(path))["pid"] == os.getpid()
    ckpt.close()
    raw.invalidate_cache()
    assert not raw.exists(path)
