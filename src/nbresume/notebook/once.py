"""Completion markers for ``%%nbresume once NAME``: which cells already ran in this run.

A marker is a small JSON file, ``<run folder>/once/<NAME>.json``, written only after the cell
ran without an error, and written atomically: on a POSIX folder through a temporary file, fsync
and rename; on an object store as one object (a single PUT is all or nothing). A marker that
does not parse counts as absent, so a torn write can only make a cell run again, never skip it.
The folder's name is not a checkpoint's, so checkpoint listing, retention and ``restore()``
pass it over.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
from pathlib import Path
from typing import Any

from nbresume.errors import UsageError

FOLDER = "once"
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,99}")


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


def read_marker(root: str, name: str) -> dict[str, Any] | None:
    """The record of ``name``'s completion in the run folder ``root``, or ``None``."""
    location = marker_location(root, name)
    try:
        if _is_url(root):
            import fsspec

            fs, path = fsspec.core.url_to_fs(location)
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


def write_marker(root: str, name: str, record: dict[str, Any]) -> str:
    """Record ``name``'s completion (``record`` plus the name) atomically; return where."""
    location = marker_location(root, name)
    data = json.dumps({**record, "name": name}, indent=1, sort_keys=True).encode()
    if _is_url(root):
        import fsspec

        fs, path = fsspec.core.url_to_fs(location)
        fs.pipe_file(path, data)
        return location
    target = Path(location)
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
    return location
