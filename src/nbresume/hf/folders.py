"""Framework checkpoint folders (``checkpoint-N``) as verified nbresume checkpoints.

The Hugging Face Trainer writes ``<output_dir>/checkpoint-<step>/`` (Accelerate's
``save_state`` with automatic naming ``checkpoints/checkpoint_<n>/``), straight into its final
place. :func:`commit_folder` turns such a folder into an nbresume checkpoint through the core's
pending-checkpoint layer: the files move into the pending folder, each is fsynced and hashed,
``manifest.json`` is written last, and one rename puts the folder back under its own name,
where it is read back and verified. The folder stays what the framework wrote (plus
``manifest.json`` and :data:`FILES_NAME`): ``from_pretrained`` and the Trainer load it unchanged.

nbresume's format names only ``*.safetensors`` and ``*.json`` files, so that nbresume never
has a reason to unpickle anything. A framework's other files (``optimizer.pt``,
``rng_state.pth``, ``training_args.bin``) are listed with their sizes and hashes in
:data:`FILES_NAME`, a JSON file that the manifest itself covers; :func:`verify` checks them
too. nbresume opens them to hash them, with the checkpoint's own hash (XXH3-128 by
default, as ``NBRESUME_HASH`` picks; :mod:`nbresume.checkpoint.store.hashing`), recorded under the
hash's name as the manifest records it (``{"size": ..., "xxh3-128": ...}``); earlier versions
recorded SHA-256 (``"sha256"``), which still verifies. On Google Drive the MD5 is recorded too:
Drive reports it for each uploaded file. Those the Trainer's resume loads
(``optimizer.pt``, ``rng_state.pth``...) are then loaded as it loads them, never executing
a pickle (:mod:`nbresume.hf.trainer_files`): a folder verifies only if the resume can load it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import stat
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from nbresume.checkpoint.backends import READ_CHUNK, Backend, FreeSpace
from nbresume.checkpoint.format import (
    HASH_DIGITS,
    MANIFEST_NAME,
    MAX_JSON_BYTES,
    FileEntry,
    Manifest,
    is_valid_file_name,
    parse_step_dirname,
    step_dirname,
)
from nbresume.checkpoint.store import (
    CheckpointInfo,
    CheckpointStore,
    Digests,
    PendingCheckpoint,
    parse_json,
)
from nbresume.errors import CheckpointError, CorruptCheckpointError, UsageError
from nbresume.hf import trainer_files

if TYPE_CHECKING:
    from nbresume.checkpoint.backends import Durability

#: The file that lists the framework's files the manifest cannot name, with their hashes.
FILES_NAME = "nbresume_framework_files.json"
#: Where the framework's other files wait while the manifest's files are taken in: a folder
#: beside the pending checkpoint's (its name plus this), inside it in earlier versions.
ASIDE_NAME = ".framework"


class FolderNames:
    """How a framework names its checkpoint folders: ``<prefix><step>``."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self._pattern = re.compile(re.escape(prefix) + r"(0|[1-9][0-9]*)")

    def step(self, name: str) -> int | None:
        """The step of a framework folder name (``None`` for any other name)."""
        match = self._pattern.fullmatch(name)
        return int(match.group(1)) if match else None

    def real(self, name: str) -> str:
        """The framework's name of the store's folder ``name`` (other names unchanged)."""
        step = parse_step_dirname(name)
        return name if step is None else f"{self.prefix}{step}"

    def seen(self, name: str) -> str:
        """The store's name of the framework's folder ``name`` (other names unchanged)."""
        step = self.step(name)
        return name if step is None else step_dirname(step)


TRAINER = FolderNames("checkpoint-")
ACCELERATE = FolderNames("checkpoint_")


class _Named(Backend):
    """A local (or Drive) backend whose checkpoint folders carry the framework's names.

    The store above speaks of ``000000000010``; on disk the folder is ``checkpoint-10``. Every
    call goes to the backend of the folder (fsync, atomic rename, Drive's durability and
    deletion through its API) with the names translated; nothing else changes."""

    def __init__(self, inner: Backend, root: Path, names: FolderNames) -> None:
        self.inner = inner
        self.names = names
        self.root = root
        self.atomic_rename = inner.atomic_rename
        self.write_back = inner.write_back
        self.reports_md5 = inner.reports_md5
        self.durability_poll_s = inner.durability_poll_s
        self.atomic_create = inner.atomic_create
        self.lease_expiry_s = inner.lease_expiry_s

    @classmethod
    def from_location(
        cls, location: str, storage_options: Mapping[str, Any] | None = None
    ) -> Backend:
        raise UsageError("a framework's folder is opened with nbresume.hf.folders.open_store")

    @property
    def location(self) -> str:
        return self.inner.location

    @property
    def writer_check(self) -> Callable[[], None] | None:
        return self.inner.writer_check

    @writer_check.setter
    def writer_check(self, check: Callable[[], None] | None) -> None:
        self.inner.writer_check = check

    def child(self, *names: str) -> str:
        return self.inner.child(*[self.names.real(n) for n in names])

    def list_folders(self) -> list[str]:
        return [self.names.seen(n) for n in self.inner.list_folders()]

    def list_files(self, folder: str) -> list[str]:
        return self.inner.list_files(self.names.real(folder))

    def begin(self, final: str) -> str:
        return self.inner.begin(self.names.real(final))

    def open_write(self, folder: str, name: str) -> IO[bytes]:
        return self.inner.open_write(self.names.real(folder), name)

    def close_durably(self, handle: IO[bytes]) -> None:
        self.inner.close_durably(handle)

    def commit(self, folder: str, final: str) -> None:
        self.inner.commit(self.names.real(folder), self.names.real(final))

    def open_read(self, folder: str, name: str) -> IO[bytes]:
        return self.inner.open_read(self.names.real(folder), name)

    def delete(self, folder: str) -> None:
        self.inner.delete(self.names.real(folder))

    def discard(self, folder: str) -> None:
        self.inner.discard(self.names.real(folder))

    def recover(self, current: str) -> list[str]:
        return self.inner.recover(self.names.real(current))

    def free_space(self) -> FreeSpace:
        return self.inner.free_space()

    def durability(self, folder: str, manifest: Manifest) -> Durability:
        real = self.names.real(folder)

        def framework_sums() -> dict[str, tuple[int, str]]:
            # The framework's files, which the manifest cannot name, must be durable too.
            files = framework_files(self.root / real)
            return {name: (entry["size"], entry["md5"]) for name, entry in files.items()}

        return self.inner.durability_with(real, manifest, framework_sums)

    def read_small(self, name: str) -> bytes | None:
        return self.inner.read_small(name)

    def create_small(self, name: str, data: bytes) -> bool:
        return self.inner.create_small(name, data)

    def replace_small(self, name: str, data: bytes) -> None:
        self.inner.replace_small(name, data)

    def remove_small(self, name: str) -> None:
        self.inner.remove_small(name)


def open_store(
    output_dir: str | os.PathLike[str], *, keep: int | None = None, names: FolderNames = TRAINER
) -> CheckpointStore:
    """The checkpoint store of a framework's output folder (a local path or a folder on the
    mounted Google Drive), its checkpoint folders named the framework's way."""
    location = str(local_path(output_dir))
    inner = CheckpointStore(location).backend
    root = inner.local_root
    if root is None:  # pragma: no cover - a path opens a local backend
        raise UsageError(f"{location} is not a local folder", where=location)
    return CheckpointStore(_Named(inner, root, names), keep=keep)


def local_path(output_dir: str | os.PathLike[str]) -> Path:
    """``output_dir`` as a local path (``file://`` URLs too); other URLs are refused: a
    framework writes and resumes from a local folder."""
    location = os.fspath(output_dir)
    if location.startswith("file://"):
        location = location[len("file://") :]
    if "://" in location:
        raise UsageError(
            f"{location} is a URL; the framework writes and resumes from a local folder",
            where=location,
            fix="give the local output folder (on Colab, a folder on the mounted Google Drive); "
            "nbresume pull URL DIR copies verified checkpoints down",
        )
    return Path(location).expanduser()


def commit_folder(store: CheckpointStore, step: int) -> PendingCheckpoint:
    """Move the framework's folder of ``step`` into a pending checkpoint of ``store`` and take
    in its files (fsynced and hashed); the caller commits it (or discards it, which removes the
    files). Raises CheckpointError, leaving the folder as it is, when the folder holds anything
    but plain files."""
    backend = store.backend
    assert isinstance(backend, _Named)
    folder = backend.root / backend.names.real(step_dirname(step))
    for stale in (MANIFEST_NAME, FILES_NAME):
        # The framework wrote into a folder that held an earlier commit of this step: that
        # commit is gone already (its files were overwritten), and this one is recorded anew.
        with contextlib.suppress(FileNotFoundError):
            os.unlink(folder / stale)
    # nbresume's own scratch folder, left by an earlier commit of this step: Google Drive
    # brings it back from a VM killed before its removal synced. It stays in the emptied
    # folder, which the commit replaces (on Drive: deleted through Drive's API).
    # A hidden file is no part of the checkpoint: the temporary file of a write that a kill cut
    # short (safetensors' ``.tmpXXXXXX``) stays in the emptied folder with the scratch folder.
    names = sorted(p.name for p in folder.iterdir() if not p.name.startswith("."))
    for name in names:
        path = folder / name
        if path.is_symlink() or not path.is_file():
            raise CheckpointError(
                f"{path} is not a plain file; nbresume commits folders of plain files only",
                where=str(folder),
                fix="the checkpoint is left as it is, unverified; resume from it explicitly",
            )
    pending = store.begin(step)
    target = backend.root / pending.folder
    # adopt() takes every file of the pending folder, which must be one the manifest can name:
    # the others step aside while it runs, into a temporary folder beside the pending one.
    # Not inside it: Google Drive shows a new folder at once and syncs its removal later, so a
    # VM killed in between would leave it in the checkpoint's folder (a temporary folder left
    # beside is removed by the next save).
    aside = backend.root / f"{pending.folder}{ASIDE_NAME}"
    try:
        plain = [n for n in names if is_valid_file_name(n)]
        others = {}
        for name in names:
            os.rename(folder / name, target / name)
            fsync(target / name)  # another library wrote it: durable before it counts
            if name not in plain:
                others[name] = hash_file(target / name, pending.hash, md5=store.md5).to_json()
        # The emptied folder stays until the commit replaces it: on Google Drive the commit
        # then deletes the copy the mount had uploaded through Drive's API, not into the trash.
        aside.mkdir()
        for name in others:
            os.rename(target / name, aside / name)
        pending.adopt()
        for name in others:
            os.rename(aside / name, target / name)
        aside.rmdir()
        pending.write_json(FILES_NAME.removesuffix(".json"), {"files": others})
    except BaseException:
        pending.discard()
        shutil.rmtree(aside, ignore_errors=True)
        raise
    return pending


def fsync(path: Path) -> None:
    """Make the file (or folder) ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def hash_file(path: Path, algorithm: str, *, md5: bool) -> FileEntry:
    """The size and the ``algorithm`` hash (and with ``md5`` the MD5) of the file ``path`` as
    it is on disk now, through the core's hashing. Only a regular file is read
    (:func:`open_regular`)."""
    digests = Digests(md5=md5, threaded=False, algorithm=algorithm)
    size = 0
    with open_regular(path) as handle:
        while chunk := handle.read(READ_CHUNK):
            digests.update(chunk)
            size += len(chunk)
    digest, md5_hex = digests.result()
    return FileEntry(size, digest, md5_hex, algorithm)


def open_regular(path: Path) -> IO[bytes]:
    """``path`` open for reading, when it is a regular file; OSError (``EINVAL``) for anything
    else, which is never opened: a FIFO would wait forever for a writer, a device such as
    ``/dev/zero`` never ends, a symbolic link may lead anywhere. The open itself follows no
    link and never waits, should another file have taken the name since it was looked at."""
    if not stat.S_ISREG(os.lstat(path).st_mode):
        raise OSError(
            errno.EINVAL, "not a regular file (a link, a FIFO, a device, a folder)", str(path)
        )
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    fd = os.open(path, flags)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(
            errno.EINVAL, "not a regular file (a link, a FIFO, a device, a folder)", str(path)
        )
    return os.fdopen(fd, "rb")


def _algorithm(entry: Mapping[str, Any]) -> str:
    """The hash an entry of :data:`FILES_NAME` is recorded with (``"sha256"`` in earlier
    versions, else the checkpoint's: ``"xxh3-128"``)."""
    named = [name for name in HASH_DIGITS if name in entry]
    if len(named) != 1 or not isinstance(entry[named[0]], str):
        raise ValueError(f"names no single hash of {sorted(HASH_DIGITS)}")
    return named[0]


def framework_files(folder: Path) -> dict[str, dict[str, Any]]:
    """The framework files that :data:`FILES_NAME` in ``folder`` lists, by name (a regular
    file of at most :data:`~nbresume.checkpoint.store.reading.MAX_JSON_BYTES`, its nesting bounded;
    every name a plain file name)."""
    where = str(folder / FILES_NAME)
    try:
        with open_regular(folder / FILES_NAME) as handle:
            raw = handle.read(MAX_JSON_BYTES + 1)
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{FILES_NAME} is missing", where=where) from None
    except OSError as exc:
        raise CorruptCheckpointError(f"cannot read {FILES_NAME}: {exc}", where=where) from None
    if len(raw) > MAX_JSON_BYTES:
        raise CorruptCheckpointError(
            f"{FILES_NAME} is larger than the limit of {MAX_JSON_BYTES} bytes", where=where
        )
    document = parse_json(raw, where=where)
    try:
        files = document["files"]
        for name, entry in files.items():
            if not _is_plain_name(name) or not isinstance(entry["size"], int):
                raise ValueError(f"{name!r} is not a plain file name with a size")
            try:
                _algorithm(entry)
            except ValueError as exc:
                raise ValueError(f"{name!r} {exc}") from None
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CorruptCheckpointError(
            f"{FILES_NAME} does not list files: {exc}", where=str(folder)
        ) from None
    return dict(files)


def _is_plain_name(name: str) -> bool:
    """A file name a folder can hold, as the framework writes them: no path, not hidden, no
    control character (a NUL byte cannot name a file at all)."""
    return (
        isinstance(name, str)
        and 0 < len(name) <= 255
        and "/" not in name
        and not name.startswith(".")
        and name.isprintable()
    )


#: Why a framework folder without a manifest is not a checkpoint to rely on.
NO_MANIFEST = (
    "incomplete: it has no manifest.json (its save was cut short, or it was written "
    "without nbresume.hf.Callback)"
)


def folder_problem(store: CheckpointStore, name: str, info: CheckpointInfo | None) -> str:
    """What keeps the framework folder ``name`` (the store's name; ``info`` when committed)
    from being a verified checkpoint: ``""`` when it verifies."""
    if info is not None:
        return verify(store, info)
    if store.has_manifest(name):
        return "its manifest.json is damaged"
    return NO_MANIFEST


def verify(store: CheckpointStore, info: CheckpointInfo) -> str:
    """Read back every file of the committed framework folder ``info`` and compare it with its
    manifest and :data:`FILES_NAME`; return the problem (``""``: it verified)."""
    report = store.verify(info.step)
    result = next((r for r in report.results if r.name == info.name), None)
    if result is None:
        return "it is not committed"
    if not result.ok:
        return result.problem
    folder = Path(info.location)
    try:
        listed = framework_files(folder)
    except (OSError, CorruptCheckpointError) as exc:
        return str(exc)
    for name, entry in listed.items():
        algorithm = _algorithm(entry)
        try:
            got = hash_file(folder / name, algorithm, md5=False)
        except FileNotFoundError:
            return f"{name}: the file is missing"
        except OSError as exc:
            return f"{name}: cannot read it: {exc.strerror or exc}"
        except CheckpointError as exc:  # an XXH3-128 entry where xxhash is not installed
            return f"{name}: {exc}"
        if got.size != entry["size"]:
            return f"{name}: {got.size} bytes, the checkpoint recorded {entry['size']}"
        if got.digest != entry[algorithm]:
            return f"{name}: its bytes differ from the ones recorded at the save ({algorithm})"
    extra = unlisted(folder, {MANIFEST_NAME, *info.manifest.files, *listed})
    if extra:
        return extra
    # Verified means loadable: what the Trainer's resume loads is loaded as it loads it.
    for name in listed:
        cannot = trainer_files.problem(folder / name)
        if cannot:
            return cannot
    return ""


def unlisted(folder: Path, names: set[str]) -> str:
    """The problem of an entry of ``folder`` that none of ``names`` is (``""``: none): the
    framework loads what its folder holds, so a file added after the save (a ``scaler.pt``
    the resume would load) makes the folder something nbresume never verified. Hidden names
    are no part of a checkpoint (no framework loads them)."""
    try:
        present = sorted(os.listdir(folder))
    except OSError as exc:
        return f"cannot list the folder: {exc.strerror or exc}"
    extra = [n for n in present if n not in names and not n.startswith(".")]
    if extra:
        shown = ", ".join(repr(n) if not n.isprintable() else n for n in extra[:5])
        return (
            f"{shown}: not recorded at the save (added to the folder since), and the framework "
            "would load what its folder holds; remove it, or resume from this folder explicitly"
        )
    return ""
