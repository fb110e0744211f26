"""``nbresume pull SRC DST``: copy a run's checkpoints to a local folder, verified, resumable.

SRC is ``ssh://[user@]host[:port]/path`` (SFTP through paramiko; ``~/.ssh/config`` aliases,
users, ports and identity files apply, and ``/~/path`` is relative to the remote home), any
fsspec URL, or a local path. Only committed checkpoints are copied: folders that hold a
manifest. For each one:

1. Read the remote manifest and check it (a hostile or damaged one names no file outside the
   folder and parses strictly).
2. Copy every file into the hidden folder ``DST/.nbresume-pull-<step>/``, under a hidden
   temporary name, hashing on the way. A temporary file left by an interrupted pull is hashed
   and continued where it stopped; a file already complete with the right size and SHA-256 is
   not copied again.
3. Compare size and SHA-256 (and MD5 where recorded) with the manifest, then fsync and rename
   the file to its name. A file that does not match is reported by name and not kept.
4. Write the manifest last (through a temporary name, fsync, rename), then rename the folder
   to ``DST/<step>``: at every moment DST holds whole checkpoints only, and is itself a valid
   nbresume folder.
5. Read the local checkpoint back (``verify``).

The remote copy is declared safe to tear down only when every checkpoint verified locally, the
remote list did not change during the pull, and no live writer holds the source: a training
that still runs there holds the folder's writer lease (:mod:`nbresume.checkpoint.store.lease`), read
before each listing. While it does, the pull says so, names the holder, and exits with
:data:`STILL_WRITING`: pull again after it stops. Nothing remote is ever deleted or written.

A SRC of the form ``owner/slug`` (no scheme, not an existing local path) names a Kaggle
notebook: :func:`is_kaggle_ref` tells, and the command line hands it to Kaggle support.
"""

from __future__ import annotations

import contextlib
import errno
import importlib
import os
import re
import shutil
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any
from urllib.parse import unquote, urlsplit

from nbresume.checkpoint.backends import Backend, FsspecStore, LocalStore, fsync_folder, open_store
from nbresume.checkpoint.format import (
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    FileEntry,
    parse_manifest,
    step_dirname,
)
from nbresume.checkpoint.store import (
    FUTURE_TOLERANCE_S,
    LEASE_NAME,
    CheckpointStore,
    Digests,
    Holder,
    VerifyResult,
    check_hashes,
    format_utc,
    has_manifest,
    live_holder,
    read_header,
    this_process,
)
from nbresume.checkpoint.units import format_bytes
from nbresume.errors import CorruptCheckpointError, NbresumeError, StorageError, UsageError
from nbresume.frameworks.layout import kind_of, travel_refusal

#: Suffix of a file being copied (hidden: it starts with a dot).
PART_SUFFIX = ".nbresume-part"
#: Hidden folder a checkpoint is copied into before it is renamed into place. Neither a
#: checkpoint nor a writer's temporary folder: a save into the same folder leaves it alone.
STAGING_PREFIX = ".nbresume-pull-"
CHUNK = 1 << 20
#: Bytes requested ahead from an SFTP server: enough to fill the link, bounded in memory.
PREFETCH_WINDOW = 32 << 20
#: Rounds of listing the source again when new checkpoints appeared during a pull.
MAX_ROUNDS = 3

SAFE_LINE = "the remote copy is safe to tear down"
#: Exit status of a pull whose checkpoints all verified while the job still writes at the
#: source (a live writer holds its lease, or checkpoints kept appearing): not a failure, and
#: not safe to tear down yet; a script pulls again after the job stopped.
STILL_WRITING = 3

_KAGGLE_REF = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*/[A-Za-z0-9][A-Za-z0-9_.-]*")
#: The module that Kaggle support installs: ``status(ref) -> int`` and
#: ``pull(ref, dst: str | None) -> int``.
KAGGLE_COMMANDS = "nbresume.kaggle.commands"


def is_kaggle_ref(text: str) -> bool:
    """Whether ``text`` names a Kaggle notebook (``owner/slug``): exactly one slash, no scheme,
    and not an existing local path (write ``./owner/slug`` for a local folder)."""
    return bool(_KAGGLE_REF.fullmatch(text)) and not os.path.exists(text)


def kaggle_command(verb: str) -> Callable[..., int]:
    """The Kaggle implementation of ``nbresume status|pull owner/slug``."""
    try:
        module = importlib.import_module(KAGGLE_COMMANDS)
    except ModuleNotFoundError as exc:
        if exc.name and KAGGLE_COMMANDS.startswith(exc.name):
            raise UsageError(
                "an argument of the form owner/slug names a Kaggle notebook, and Kaggle support "
                "is not installed yet in this version of nbresume",
                fix="for a local folder of that name, write ./owner/slug",
            ) from None
        raise UsageError(
            f"Kaggle support needs the package {exc.name!r}",
            fix="pip install 'nbresume[kaggle]'",
        ) from None
    command: Callable[..., int] = getattr(module, verb)
    return command


# -- the source ------------------------------------------------------------------------------


def open_source(src: str, *, identity: str | None = None) -> Backend:
    """The store to pull from: SSH/SFTP, any fsspec URL, or a local folder."""
    scheme = src.split("://", 1)[0].lower() if "://" in src else ""
    if scheme in ("ssh", "sftp"):
        return _ssh_store(src, identity)
    if identity:
        raise UsageError("--identity applies to ssh:// sources only", where=src)
    return open_store(src)


def _ssh_store(url: str, identity: str | None) -> Backend:
    try:
        import paramiko
        from fsspec.implementations.sftp import SFTPFileSystem
    except ModuleNotFoundError:
        raise UsageError(
            "pulling over SSH needs paramiko", fix="pip install 'nbresume[ssh]'"
        ) from None
    parts = urlsplit(url)
    if not parts.hostname:
        raise UsageError("no host in the URL", where=url, fix="write ssh://[user@]host[:port]/path")
    config: dict[str, Any] = {}
    config_path = Path("~/.ssh/config").expanduser()
    if config_path.is_file():
        config = dict(paramiko.SSHConfig.from_path(str(config_path)).lookup(parts.hostname))
    for option in ("proxyjump", "proxycommand"):
        if option in config:
            raise UsageError(
                f"~/.ssh/config sets {option} for {parts.hostname}, which nbresume pull does "
                "not follow",
                where=url,
                fix="open a tunnel first (ssh -N -L 2222:TARGET:22 JUMPHOST) and pull from "
                "ssh://USER@localhost:2222/PATH",
            )
    host = str(config.get("hostname", parts.hostname))
    port = parts.port or int(config.get("port", 22))
    user = unquote(parts.username) if parts.username else config.get("user")
    keys = [identity] if identity else list(config.get("identityfile", []))
    keys = [str(Path(k).expanduser()) for k in keys]
    if identity and not Path(keys[0]).is_file():
        raise UsageError(f"no key file {identity}", where=url)
    path = unquote(parts.path) or "/"
    # ssh://host/~/runs/x is relative to the remote home, where SFTP starts.
    root = path[2:].lstrip("/") if path.startswith("/~") else path
    kwargs: dict[str, Any] = {
        "port": port,
        "timeout": 20,
        "banner_timeout": 20,
        "auth_timeout": 20,
        "host_key_policy": _known_hosts_policy(paramiko),
        "skip_instance_cache": True,  # a cached client may hold a dropped connection
    }
    if user:
        kwargs["username"] = user
    existing = [k for k in keys if Path(k).is_file()]
    if existing:
        kwargs["key_filename"] = existing
    where = f"{user + '@' if user else ''}{host}:{port}"
    try:
        fs = SFTPFileSystem(host, **kwargs)
    except paramiko.BadHostKeyException as exc:
        raise StorageError(
            f"the host key of {host} changed: {exc}",
            where=where,
            fix="if the machine was recreated, remove the old key with "
            f"`ssh-keygen -R '[{host}]:{port}'` (or `ssh-keygen -R {host}`) and pull again",
        ) from None
    except paramiko.AuthenticationException as exc:
        raise StorageError(
            f"authentication failed: {exc}",
            where=where,
            fix="give the key with --identity FILE, or set User and IdentityFile for this host "
            "in ~/.ssh/config",
        ) from None
    except (OSError, EOFError, paramiko.SSHException) as exc:
        raise StorageError(
            f"cannot connect: {exc}",
            where=where,
            fix="check that `ssh` reaches the machine with the same host, port and user",
        ) from None
    # A connection that goes silent must end the pull (to be resumed), not hang it.
    fs.ftp.get_channel().settimeout(60)
    transport = fs.client.get_transport()
    if transport is not None:
        transport.set_keepalive(15)
    return FsspecStore(url, fs=fs, root=root or ".")


def _known_hosts_policy(paramiko: Any) -> Any:
    """A host key policy that checks ``~/.ssh/known_hosts`` as ssh does: a key that differs
    from the recorded one is refused; a host seen for the first time is accepted."""

    class KnownHosts(paramiko.MissingHostKeyPolicy):  # type: ignore[misc]
        def missing_host_key(self, client: Any, hostname: str, key: Any) -> None:
            known = paramiko.HostKeys()
            path = Path("~/.ssh/known_hosts").expanduser()
            if path.is_file():
                with contextlib.suppress(OSError, paramiko.SSHException):
                    known.load(str(path))
            recorded = known.lookup(hostname)
            if recorded is None or key.get_name() not in recorded:
                return  # first contact (or a key type not recorded): accepted, as accept-new
            if recorded[key.get_name()] != key:
                raise paramiko.BadHostKeyException(hostname, key, recorded[key.get_name()])

    return KnownHosts()


# -- copying ---------------------------------------------------------------------------------


class _TransferError(Exception):
    """Reading the source failed mid-pull (a dropped connection): resume by pulling again."""


class _Mismatch(Exception):
    """A copied file does not match its manifest."""


@dataclass
class _Result:
    name: str
    ok: bool
    how: str = ""  # pulled | resumed | here | gone
    size: int = 0
    problem: str = ""
    note: str = ""


class _RateLimit:
    """Sleeps so that no more than ``rate`` bytes per second are read."""

    def __init__(self, rate: float | None) -> None:
        self.rate = rate
        self.start = time.monotonic()
        self.count = 0

    def __call__(self, nbytes: int) -> None:
        if not self.rate:
            return
        self.count += nbytes
        ahead = self.count / self.rate - (time.monotonic() - self.start)
        if ahead > 0:
            time.sleep(ahead)


def parse_rate(text: str) -> float:
    """``"500k"`` -> 512000.0 bytes per second (suffixes k, M, G: powers of 1024)."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([kKmMgG]?)[bB]?\s*", text)
    if not match or float(match.group(1)) <= 0:
        raise ValueError(f"{text!r} is not a rate such as 500k, 2M or 1G (bytes per second)")
    power = {"": 0, "k": 1, "m": 2, "g": 3}[match.group(2).lower()]
    return float(match.group(1)) * float(1 << (10 * power))


def _hash_local(path: Path, digests: Digests) -> int:
    """Hash a local file into ``digests``; return its size."""
    size = 0
    with open(path, "rb") as handle:
        while chunk := handle.read(CHUNK):
            digests.update(chunk)
            size += len(chunk)
    return size


def _matches(entry: FileEntry, size: int, digests: Digests) -> str:
    """The mismatch between a file and its manifest entry, or ``""``."""
    try:
        check_hashes("", entry, size, *digests.result())
    except CorruptCheckpointError as exc:
        return exc.message
    return ""


def _read_source(handle: IO[bytes], offset: int, size: int, window: int) -> Iterator[bytes]:
    """Bytes of a source file from ``offset`` up to one byte past ``size`` (to see a file that
    is larger than its manifest says)."""
    if offset:
        handle.seek(offset)
    end = size + 1
    prefetch = getattr(handle, "prefetch", None)  # SFTP: pipelined reads, ten times faster
    position = offset
    while position < end:
        window_end = min(end, position + window)
        if prefetch is not None:
            prefetch(min(window_end, size), 64)
        while position < window_end:
            chunk = handle.read(min(CHUNK, window_end - position))
            if not chunk:
                return
            position += len(chunk)
            yield chunk


class Puller:
    """Copies the committed checkpoints of ``source`` into the local folder ``dst``."""

    def __init__(
        self,
        source: Backend,
        dst: Path,
        *,
        rate: float | None = None,
        out: Callable[[str], None] = print,
    ) -> None:
        self.source = source
        self.dst = dst
        self.limit = _RateLimit(rate)
        # Under a rate limit, request little ahead: the limit is on the link, not the disk.
        self.window = PREFETCH_WINDOW if not rate else max(CHUNK, min(PREFETCH_WINDOW, int(rate)))
        self.out = out
        self.local = CheckpointStore(LocalStore(dst), keep=None)

    def listing(self) -> dict[int, str]:
        """Committed-looking checkpoint folders of the source: step -> folder name."""
        remote = CheckpointStore(self.source, keep=None)
        # Folder names include an older copy standing in for a step whose replacement a
        # killed writer left unfinished: it is that step's only copy.
        return {step: name for step, name in reversed(remote.checkpoint_folders())}

    def pull_one(self, step: int, folder: str) -> _Result | None:
        """Copy one checkpoint; ``None`` when the folder holds no manifest (never committed)."""
        name = step_dirname(step)
        manifest_where = self.source.child(folder, MANIFEST_NAME)
        try:
            raw = bytes(self.source.read_bytes(folder, MANIFEST_NAME, limit=MAX_MANIFEST_BYTES))
        except FileNotFoundError:
            return None
        except StorageError:
            raise  # the source's own error already says where and what to do
        except OSError as exc:
            if exc.errno == errno.EINVAL:  # a FIFO, a link or a folder: a broken checkpoint
                return _Result(name, False, problem=f"{manifest_where}: not a regular file")
            raise _TransferError(f"reading {manifest_where} failed: {exc}") from exc
        try:
            manifest = parse_manifest(raw, where=manifest_where, expected_step=step)
        except CorruptCheckpointError as exc:
            return _Result(name, False, problem=str(exc))
        final = self.dst / name
        staging = self.dst / f"{STAGING_PREFIX}{name}"
        if final.exists():
            try:
                here = (final / MANIFEST_NAME).read_bytes()
            except FileNotFoundError:
                return _Result(name, False, problem=f"{final} exists but is not a checkpoint "
                               "(it has no manifest); move it away and pull again")  # fmt: skip
            if here != raw:
                return _Result(name, False, problem=f"{final} holds a different checkpoint of "
                               f"step {step} (its manifest differs); pull into an empty folder, "
                               "or move that one away")  # fmt: skip
            if self._verify_local(step).ok:
                return _Result(name, True, "here", manifest.payload_bytes)
            # Our earlier copy went bad: take it out of view (one rename), then copy again
            # what does not match.
            shutil.rmtree(staging, ignore_errors=True)
            os.rename(final, staging)
            (staging / MANIFEST_NAME).unlink()
            fsync_folder(self.dst)
        staging.mkdir(parents=True, exist_ok=True)
        notes = []
        resumed = False
        for file_name, entry in manifest.files.items():
            try:
                how, note = self._pull_file(folder, file_name, entry, staging)
            except FileNotFoundError:
                shutil.rmtree(staging, ignore_errors=True)
                if not has_manifest(self.source, folder):
                    return _Result(name, True, "gone")  # deleted by the writer's retention
                # Still committed there: the checkpoint lacks a file (it does not load).
                where = self.source.child(folder, file_name)
                return _Result(name, False, problem=f"{where}: the file is missing")
            except _Mismatch as exc:
                return _Result(
                    name, False, problem=f"{self.source.child(folder, file_name)}: {exc}"
                )
            resumed = resumed or how == "resumed"
            if note:
                notes.append(note)
        self._commit(staging, final, raw)
        verdict = self._verify_local(step)
        if not verdict.ok:
            return _Result(name, False, problem=f"read back from {final}: {verdict.problem}")
        return _Result(
            name, True, "resumed" if resumed else "pulled", manifest.payload_bytes,
            note="; ".join(notes),
        )  # fmt: skip

    def _verify_local(self, step: int) -> VerifyResult:
        results = self.local.verify(step).results
        if results:
            return results[0]
        name = step_dirname(step)
        return VerifyResult(name, step, str(self.dst / name), ok=False, problem="not found")

    def _pull_file(self, folder: str, name: str, entry: FileEntry, local: Path) -> tuple[str, str]:
        final = local / name
        if final.is_file():
            digests = Digests(md5=entry.md5 is not None, threaded=False, algorithm=entry.algorithm)
            if not _matches(entry, _hash_local(final, digests), digests):
                return "here", ""
        part = local / f".{name}{PART_SUFFIX}"
        offset = part.stat().st_size if part.is_file() else 0
        if offset > entry.size:
            part.unlink()
            offset = 0
        if not offset and name.endswith(".safetensors"):
            self._check_header(folder, name, entry)
        problem = self._copy(folder, name, entry, part, offset)
        how, note = ("resumed", f"{name} continued at {format_bytes(offset)}") if offset else (
            "pulled", "")  # fmt: skip
        if problem and offset:
            # The partial copy may be of an older version of the file: start over once.
            part.unlink()
            problem = self._copy(folder, name, entry, part, 0)
            how, note = "pulled", ""
        if problem:
            with contextlib.suppress(FileNotFoundError):
                part.unlink()
            raise _Mismatch(problem)
        os.replace(part, final)
        return how, note

    def _check_header(self, folder: str, name: str, entry: FileEntry) -> None:
        """Refuse a safetensors file whose header does not account for the size the manifest
        gives (a sparse file of gigabytes) before a byte of it is copied."""
        try:
            with self.source.open_read(folder, name) as handle:
                read_header(handle, entry.size, where=self.source.child(folder, name))
        except CorruptCheckpointError as exc:
            raise _Mismatch(exc.message) from None
        except StorageError:
            raise  # the source's own error already says where and what to do
        except OSError:
            pass  # the copy meets the same problem and reports it as usual

    def _copy(self, folder: str, name: str, entry: FileEntry, part: Path, offset: int) -> str:
        """Append the source file to ``part`` from ``offset``; return the mismatch, if any."""
        digests = Digests(md5=entry.md5 is not None, threaded=False, algorithm=entry.algorithm)
        size = _hash_local(part, digests) if offset else 0
        where = self.source.child(folder, name)
        with open(part, "ab") as out:
            try:
                with self.source.open_read(folder, name) as handle:
                    for chunk in _read_source(handle, offset, entry.size, self.window):
                        out.write(chunk)
                        digests.update(chunk)
                        size += len(chunk)
                        self.limit(len(chunk))
            except FileNotFoundError:
                raise
            except Exception as exc:  # paramiko raises its own kinds besides OSError
                out.flush()
                said = str(exc).strip().rstrip(":") or type(exc).__name__
                raise _TransferError(
                    f"reading {where} failed after {format_bytes(size)} of "
                    f"{format_bytes(entry.size)}: {said}"
                ) from exc
            out.flush()
            os.fsync(out.fileno())
        return _matches(entry, size, digests)

    def _commit(self, staging: Path, final: Path, raw: bytes) -> None:
        """Manifest last, then one rename: the checkpoint appears whole or not at all."""
        part = staging / f".{MANIFEST_NAME}{PART_SUFFIX}"
        with open(part, "wb") as out:
            out.write(raw)
            out.flush()
            os.fsync(out.fileno())
        os.replace(part, staging / MANIFEST_NAME)
        fsync_folder(staging)
        os.rename(staging, final)
        fsync_folder(self.dst)


def pull(
    src: str,
    dst: str,
    *,
    identity: str | None = None,
    rate: float | None = None,
    out: Callable[[str], None] = print,
) -> int:
    """Copy every committed checkpoint of ``src`` into the local folder ``dst`` and verify it.

    Returns the exit status: 0 when every checkpoint verified and nothing writes at the source
    any more (the remote copy may be torn down); :data:`STILL_WRITING` when every checkpoint
    verified but a live writer holds the source's lease or checkpoints kept appearing (pull
    again after the job stopped); 1 otherwise. Raises
    :class:`~nbresume.errors.NbresumeError` when the source cannot be reached or the
    arguments cannot be used.
    """
    if "://" in dst and not dst.startswith("file://"):
        raise UsageError("the destination must be a local folder", where=dst)
    target = Path(dst.removeprefix("file://")).expanduser().absolute()
    if "://" not in src and Path(src).expanduser().absolute() == target:
        raise UsageError("the source and the destination are the same folder", where=dst)
    if target.exists() and not target.is_dir():
        raise UsageError("the destination is a file, not a folder", where=dst)
    source = open_source(src, identity=identity)
    try:
        framework = kind_of(source.list_folders())  # a Trainer's output_dir, a Lightning dirpath
    except (OSError, NbresumeError):
        framework = None  # the pull itself reports a source it cannot list
    if framework is not None:
        raise UsageError(travel_refusal(framework, "pull"), where=src)
    target.mkdir(parents=True, exist_ok=True)
    with _quiet_prefetch_threads():
        return _pull_all(source, target, rate, out)


@contextlib.contextmanager
def _quiet_prefetch_threads() -> Iterator[None]:
    """paramiko's read-ahead threads print a traceback when the connection drops; the pull
    reports the drop itself, once, with what to do."""
    previous = threading.excepthook

    def hook(args: threading.ExceptHookArgs) -> None:
        frames = traceback.extract_tb(args.exc_traceback) if args.exc_traceback else []
        if issubclass(args.exc_type, (OSError, EOFError)) and any(
            "paramiko" in frame.filename for frame in frames
        ):
            return
        previous(args)

    threading.excepthook = hook
    try:
        yield
    finally:
        threading.excepthook = previous


def _pull_all(source: Backend, target: Path, rate: float | None, out: Callable[[str], None]) -> int:
    puller = Puller(source, target, rate=rate, out=out)
    out(f"nbresume pull: {source.location} -> {target}")
    results: dict[str, _Result] = {}
    stable = False
    writer: Holder | None = None
    try:
        for _ in range(MAX_ROUNDS):
            # The lease before the listing: a writer seen gone here has committed its last
            # checkpoint already, so the listing that follows holds it.
            writer = _live_writer(source)
            listing = puller.listing()
            todo = {s: f for s, f in listing.items() if step_dirname(s) not in results}
            new = 0
            for step, folder in sorted(todo.items()):
                result = puller.pull_one(step, folder)
                if result is None:
                    continue  # never committed (or not yet): not a checkpoint
                new += 1
                results[result.name] = result
                out(_describe(result))
            if not new:
                stable = True  # a listing that brought nothing new: the source is still
                break
    except _TransferError as exc:
        out(
            f"INTERRUPTED: {exc}. The pull stopped; what arrived is kept. Run the same command "
            "again: it resumes where it stopped. The remote copy is NOT safe to tear down yet."
        )
        return 1
    except KeyboardInterrupt:
        out(
            "INTERRUPTED: what arrived is kept. Run the same command again: it resumes where it "
            "stopped. The remote copy is NOT safe to tear down yet."
        )
        return 130
    _pull_log(source, target, out)
    checked = [r for r in results.values() if r.how != "gone"]
    good = [r for r in checked if r.ok]
    gone = len(results) - len(checked)
    extra = f" ({gone} deleted on the remote while pulling)" if gone else ""
    if not checked:
        out(f"no committed checkpoints in {source.location}: nothing pulled")
        return 1
    if len(good) < len(checked):
        out(
            f"FAILED: {len(checked) - len(good)} of {len(checked)} checkpoint(s) did not "
            f"verify{extra}; the remote copy is NOT safe to tear down"
        )
        return 1
    if not stable:
        out(
            f"INCOMPLETE: {len(good)}/{len(checked)} verified, but new checkpoints kept "
            "appearing at the source (a job is still writing there); pull again once it has "
            "stopped. The remote copy is NOT safe to tear down yet."
        )
        return STILL_WRITING
    size = format_bytes(sum(r.size for r in good))
    if writer is not None:
        newest = max(int(r.name) for r in good)
        out(
            f"STILL TRAINING: {len(good)}/{len(checked)} verified in {target} ({size}), "
            f"newest step {newest}{extra}; a live writer holds the source's writer lease: "
            f"{_describe_writer(writer)}. Pull again after it stops: the remote copy is NOT "
            "safe to tear down yet."
        )
        return STILL_WRITING
    out(f"OK {len(good)}/{len(checked)} verified in {target} ({size}){extra}: {SAFE_LINE}")
    return 0


def _live_writer(source: Backend) -> Holder | None:
    """The live writer holding the source's lease (``None`` when there is none)."""
    where = source.child(LEASE_NAME)
    try:
        return live_holder(source)
    except NbresumeError as exc:
        # Not a file (a FIFO, a folder, a link): a pull run again would find it the same.
        fix = f"{exc.fix}; then pull again" if exc.fix else "remove it, then pull again"
        raise StorageError(
            f"cannot tell whether a training still writes in {source.location}: {exc.message}",
            where=where,
            fix=fix,
        ) from None
    except PermissionError:
        raise StorageError(
            f"cannot read the writer lease {where} (permission denied), which tells whether a "
            f"training still writes in {source.location}",
            where=where,
            fix="pull as the user the training runs as, or make the file readable to you "
            "(chmod a+r), then pull again",
        ) from None
    except OSError as exc:
        raise _TransferError(f"reading the writer lease {where} failed: {exc}") from exc


def _describe_writer(holder: Holder) -> str:
    """Who holds the lease; for a holder on another machine, when its lease lapses if that
    process is gone without giving it back (a kill, a preemption)."""
    me = this_process("", time.time(), holder.expiry_s, "")
    said = holder.describe()
    if (holder.host, holder.machine) == (me.host, me.machine):
        return said  # its process was looked at: it runs
    if holder.renewed - time.time() > FUTURE_TOLERANCE_S:
        return (
            f"{said} (its lease is dated ahead of this machine's clock, so its date says "
            "nothing: it counts as live until a writer started on the folder sees it go "
            f"{holder.expiry_s:.0f} s without a renewal)"
        )
    lapses = format_utc(holder.renewed + holder.expiry_s)
    return (
        f"{said} (its process cannot be looked at from here: if it was killed, its lease "
        f"lapses at {lapses}, {holder.expiry_s:.0f} s after its last renewal)"
    )


def _pull_log(source: Backend, target: Path, out: Callable[[str], None]) -> None:
    """The training log ``nbresume run`` keeps next to the checkpoints, when there is one."""
    from nbresume.runner import DEFAULT_LOG_NAME

    aside = target / f".{DEFAULT_LOG_NAME}.part"
    size = 0
    try:
        with source.open_read("", DEFAULT_LOG_NAME) as handle, open(aside, "wb") as copy:
            # In pieces: a log grows for as long as the job runs (gigabytes, in memory never).
            while chunk := handle.read(CHUNK):
                copy.write(chunk)
                size += len(chunk)
    except (NbresumeError, OSError, ValueError):
        with contextlib.suppress(OSError):
            aside.unlink()
        return  # no log there (or none readable): the checkpoints are what counts
    os.replace(aside, target / DEFAULT_LOG_NAME)
    out(f"  log   {DEFAULT_LOG_NAME}  {format_bytes(size):>9}  copied (not verified)")


def _describe(result: _Result) -> str:
    if not result.ok:
        return f"  FAIL  {result.name}  {result.problem}"
    if result.how == "gone":
        return f"  gone  {result.name}  deleted on the remote while pulling (not counted)"
    words = {"here": "already here", "pulled": "pulled", "resumed": "resumed"}[result.how]
    note = f" ({result.note})" if result.note else ""
    return f"  OK    {result.name}  {format_bytes(result.size):>9}  {words}, verified{note}"
