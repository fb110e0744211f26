"""Completion markers for ``%%nbresume once NAME``: which cells already ran in this run.

A marker is a small JSON file, ``<run folder>/once/<NAME>.json``, written only after the cell
ran without an error, and written atomically: on a POSIX folder through a temporary file, fsync
and rename; on an object store as one object (a single PUT is all or nothing). A marker that
does not parse counts as absent, so a torn write can only make a cell run again, never skip it.
The folder's name is not a checkpoint's, so checkpoint listing, retention and ``restore()``
pass it over.

On Google Drive's mount a file written lands in a local cache and uploads later: a marker is
kept only once Drive itself reports it with its size and MD5, so that after a lost VM a cell is
never skipped whose completion never reached Drive. On an fsspec URL the marker goes through
the file system given (the one of the run's Checkpointer, with its ``storage_options``);
``nbresume.init`` takes no ``storage_options``, so before that Checkpointer exists fsspec's own
configuration (environment variables, config files) applies.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import secrets
import time
from pathlib import Path
from typing import Any

from nbresume.checkpoint.backends import DriveStore, backend_kind
from nbresume.errors import NbresumeError, StorageError, UsageError

FOLDER = "once"
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,99}")
#: Seconds a marker on Google Drive may take to be confirmed by Drive before it is given up.
DRIVE_CONFIRM_S = 300.0


def check_name(name: str) -> str:
    """``name`` when it can name a marker file, else a UsageError with the fix."""
    if not _NAME.fullmatch(name):
        raise UsageError(
            f"{name!r} cannot name a cell for %%nbresume once",
            fix="use letters, digits, '_', '-' and '.', e.g. %%nbresume once preprocess",
        )
    return name


def _is_url(root: str) -> bool:
    return "://" in root and not root.startswith("file://")


def _local(root: str) -> Path:
    return Path(root.removeprefix("file://")).expanduser()


def marker_location(root: str, name: str) -> str:
    """Where the marker of ``name`` lives under the run folder ``root``."""
    check_name(name)
    if _is_url(root):
        return f"{root.rstrip('/')}/{FOLDER}/{name}.json"
    return str(_local(root) / FOLDER / f"{name}.json")


def _url_fs(location: str, fs: Any) -> tuple[Any, str]:
    """The fsspec file system and the path of ``location`` (``fs`` when one is given)."""
    if fs is not None:
        return fs, fs._strip_protocol(location)
    import fsspec

    made, path = fsspec.core.url_to_fs(location)
    return made, str(path)


def read_marker(root: str, name: str, *, fs: Any = None) -> dict[str, Any] | None:
    """The record of ``name``'s completion in the run folder ``root``, or ``None``.

    ``fs``: the fsspec file system of a URL ``root`` (with its credentials and options)."""
    location = marker_location(root, name)
    try:
        if _is_url(root):
            fs, path = _url_fs(location, fs)
            data = fs.cat_file(path)
        else:
            data = Path(location).read_bytes()
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return None
    try:
        record = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(record, dict) or record.get("name") != name:
        return None
    return record


def write_marker(
    root: str,
    name: str,
    record: dict[str, Any],
    *,
    fs: Any = None,
    confirm_s: float = DRIVE_CONFIRM_S,
) -> str:
    """Record ``name``'s completion (``record`` plus the name) atomically; return where.

    On Google Drive's mount, wait (at most ``confirm_s`` seconds) until Drive reports the
    marker; when it does not, the marker is removed again and a StorageError says so: the cell
    will run again rather than be skipped on a VM that never saw it uploaded."""
    location = marker_location(root, name)
    data = json.dumps({**record, "name": name}, indent=1, sort_keys=True).encode()
    if _is_url(root):
        fs, path = _url_fs(location, fs)
        fs.pipe_file(path, data)
        return location
    _write_local(Path(location), data)
    if _on_drive(root):
        _confirm_on_drive(root, name, data, confirm_s)
    return location


def _on_drive(root: str) -> bool:
    return backend_kind(root) == "drive"


def _confirm_on_drive(root: str, name: str, data: bytes, timeout: float) -> None:
    """Wait until Drive reports the marker with its size and MD5; else remove it and raise."""
    expected = {f"{name}.json": (len(data), hashlib.md5(data, usedforsecurity=False).hexdigest())}
    started = time.monotonic()
    try:
        store = DriveStore.from_location(str(_local(root)))
        while True:
            state = store.drive_state(FOLDER, expected)
            if state.saved:
                return
            reported = str(state)
            if time.monotonic() - started + store.durability_poll_s > timeout:
                break
            time.sleep(store.durability_poll_s)
    except NbresumeError as exc:  # Drive cannot be asked at all: not confirmed either
        reported = str(exc)
    with contextlib.suppress(FileNotFoundError):
        Path(marker_location(root, name)).unlink()
    raise StorageError(
        f"Google Drive did not confirm that the cell completed within {timeout:.0f} s "
        f"({reported}): it is not recorded, and will run again",
        where=marker_location(root, name),
        fix="keep the runtime connected while Drive uploads; the cell's results may not have "
        "reached Drive either",
    )


def _write_local(target: Path, data: bytes) -> None:
    """``data`` into ``target`` atomically: a temporary file, fsync, rename, fsync the folder."""
    target.parent.mkdir(parents=True, exist_ok=True)
    temp = target.with_name(f".{target.name}.{secrets.token_hex(4)}.tmp")
    try:
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temp, target)
    finally:
        with contextlib.suppress(FileNotFoundError):
            temp.unlink()
    with contextlib.suppress(OSError):
        dir_fd = os.open(target.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
