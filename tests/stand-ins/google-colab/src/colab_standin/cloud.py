"""The simulated Google Drive "cloud": what Google's servers hold, in a folder on disk.

Several processes share it (each simulated VM uploads into it; the Drive API server reads and
deletes), so the metadata lives in SQLite (WAL, one transaction per change) and the contents in
``blobs/``. Like Drive: every item has an id, a name and one parent; names need not be unique;
trashed items keep counting against the quota until they are deleted permanently; trashing or
deleting a folder does the same to everything below it.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import sqlite3
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

FOLDER_MIME = "application/vnd.google-apps.folder"
FILE_MIME = "application/octet-stream"
DEFAULT_QUOTA = 15 * 10**9  # the free tier
EMPTY_MD5 = hashlib.md5(b"").hexdigest()

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS items (
    id TEXT PRIMARY KEY,
    name TEXT NOT NULL,
    parent TEXT,
    mime TEXT NOT NULL,
    size INTEGER NOT NULL DEFAULT 0,
    md5 TEXT,
    blob TEXT,
    trashed INTEGER NOT NULL DEFAULT 0,
    explicitly_trashed INTEGER NOT NULL DEFAULT 0,
    modified TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS items_parent ON items(parent);
"""


@dataclass(frozen=True)
class Item:
    """One file or folder as Drive's servers know it."""

    id: str
    name: str
    parent: str | None
    mime: str
    size: int
    md5: str | None
    blob: str | None
    trashed: bool
    explicitly_trashed: bool
    modified: str

    @property
    def is_folder(self) -> bool:
        return self.mime == FOLDER_MIME


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def new_id() -> str:
    """An id shaped like Drive's (33 URL-safe characters)."""
    return "1" + secrets.token_urlsafe(24)[:32]


class Cloud:
    """A handle on the cloud folder ``root`` (created on first use). Thread-safe."""

    def __init__(self, root: str | os.PathLike[str], *, quota_bytes: int | None = None) -> None:
        self.root = Path(root)
        (self.root / "blobs").mkdir(parents=True, exist_ok=True)
        self._lock = threading.RLock()
        self._db = sqlite3.connect(
            self.root / "drive.sqlite", timeout=60, isolation_level=None, check_same_thread=False
        )
        self._db.row_factory = sqlite3.Row
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.executescript(_SCHEMA)
            with self._write():
                if self._meta("root_id") is None:
                    root_id = "0A" + secrets.token_urlsafe(16)[:17] + "Uk9PVA"
                    self._db.execute("INSERT INTO meta VALUES ('root_id', ?)", (root_id,))
                    self._db.execute(
                        "INSERT INTO items (id, name, parent, mime, modified) VALUES (?,?,?,?,?)",
                        (root_id, "My Drive", None, FOLDER_MIME, _now()),
                    )
                if self._meta("access_token") is None:
                    token = "ya29.standin-" + secrets.token_urlsafe(24)
                    self._db.execute("INSERT INTO meta VALUES ('access_token', ?)", (token,))
                if quota_bytes is not None:
                    self._db.execute(
                        "INSERT OR REPLACE INTO meta VALUES ('quota', ?)", (str(quota_bytes),)
                    )
        self.root_id: str = self._meta("root_id") or ""
        #: The one OAuth access token Google's side of this cloud accepts.
        self.access_token: str = self._meta("access_token") or ""

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # -- plumbing --------------------------------------------------------------------------

    def _meta(self, key: str) -> str | None:
        row = self._db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return None if row is None else str(row[0])

    class _Tx:
        def __init__(self, db: sqlite3.Connection) -> None:
            self.db = db

        def __enter__(self) -> sqlite3.Connection:
            self.db.execute("BEGIN IMMEDIATE")
            return self.db

        def __exit__(self, exc_type: object, *rest: object) -> None:
            self.db.execute("COMMIT" if exc_type is None else "ROLLBACK")

    def _write(self) -> Cloud._Tx:
        return Cloud._Tx(self._db)

    @staticmethod
    def _item(row: sqlite3.Row | None) -> Item | None:
        if row is None:
            return None
        return Item(
            id=row["id"],
            name=row["name"],
            parent=row["parent"],
            mime=row["mime"],
            size=int(row["size"]),
            md5=row["md5"],
            blob=row["blob"],
            trashed=bool(row["trashed"]),
            explicitly_trashed=bool(row["explicitly_trashed"]),
            modified=row["modified"],
        )

    # -- reading ---------------------------------------------------------------------------

    @property
    def quota_bytes(self) -> int:
        with self._lock:
            value = self._meta("quota")
        return DEFAULT_QUOTA if value is None else int(value)

    def resolve(self, file_id: str) -> str:
        """``'root'`` is an alias of the root folder's id, as in the Drive API."""
        return self.root_id if file_id == "root" else file_id

    def get(self, file_id: str) -> Item | None:
        with self._lock:
            row = self._db.execute(
                "SELECT * FROM items WHERE id = ?", (self.resolve(file_id),)
            ).fetchone()
        return self._item(row)

    def items(self) -> list[Item]:
        """Every item but the root folder, in a stable order."""
        with self._lock:
            rows = self._db.execute(
                "SELECT * FROM items WHERE parent IS NOT NULL ORDER BY name, id"
            ).fetchall()
        return [i for r in rows if (i := self._item(r)) is not None]

    def children(self, parent: str, *, trashed: bool | None = None) -> list[Item]:
        query = "SELECT * FROM items WHERE parent = ?"
        args: list[Any] = [self.resolve(parent)]
        if trashed is not None:
            query += " AND trashed = ?"
            args.append(int(trashed))
        with self._lock:
            rows = self._db.execute(query + " ORDER BY name, id", args).fetchall()
        return [i for r in rows if (i := self._item(r)) is not None]

    def usage(self) -> tuple[int, int]:
        """(bytes used in total, of which in the trash): trashed files still count."""
        with self._lock:
            total, trash = self._db.execute(
                "SELECT COALESCE(SUM(size), 0), COALESCE(SUM(size * trashed), 0) FROM items"
            ).fetchone()
        return int(total), int(trash)

    def walk(self, parent: str | None = None, prefix: str = "") -> Iterator[tuple[str, Item]]:
        """(relative path, item) of everything not trashed below ``parent``, parents first."""
        for item in self.children(parent or self.root_id, trashed=False):
            path = f"{prefix}{item.name}"
            yield path, item
            if item.is_folder:
                yield from self.walk(item.id, path + "/")

    def read(self, item: Item) -> bytes:
        if item.blob is None:
            return b""
        return (self.root / "blobs" / item.blob).read_bytes()

    def find(self, path: str) -> list[Item]:
        """Every item not trashed at ``path`` (``a/b/c``, names may repeat on Drive)."""
        found = [self.get(self.root_id)]
        for name in [p for p in path.split("/") if p]:
            found = [
                child
                for parent in found
                if parent is not None
                for child in self.children(parent.id, trashed=False)
                if child.name == name
            ]
        return [i for i in found if i is not None]

    # -- writing (what an uploader or the API does) ----------------------------------------

    def create(self, parent: str, name: str, *, folder: bool) -> str:
        """A new folder, or a new empty file (what a client creates before the content)."""
        file_id = new_id()
        with self._lock, self._write() as db:
            db.execute(
                "INSERT INTO items (id, name, parent, mime, size, md5, modified)"
                " VALUES (?,?,?,?,?,?,?)",
                (
                    file_id,
                    name,
                    self.resolve(parent),
                    FOLDER_MIME if folder else FILE_MIME,
                    0,
                    None if folder else EMPTY_MD5,
                    _now(),
                ),
            )
        return file_id

    def upload(self, file_id: str, source: Path) -> bool:
        """Replace the content of ``file_id`` with the bytes of ``source``.

        Returns False, changing nothing, when the new content would not fit in the quota
        (Drive refuses the upload) or the item no longer exists.
        """
        blob = f"{file_id}-{secrets.token_hex(4)}"
        tmp = self.root / "blobs" / f".tmp-{blob}"
        md5 = hashlib.md5()
        size = 0
        with open(source, "rb") as src, open(tmp, "wb") as dst:
            while chunk := src.read(1 << 20):
                md5.update(chunk)
                dst.write(chunk)
                size += len(chunk)
            dst.flush()
            os.fsync(dst.fileno())
        os.rename(tmp, self.root / "blobs" / blob)
        old_blob = None
        stored = False
        with self._lock, self._write() as db:
            row = db.execute("SELECT size, blob FROM items WHERE id = ?", (file_id,)).fetchone()
            if row is not None:
                used = int(db.execute("SELECT COALESCE(SUM(size), 0) FROM items").fetchone()[0])
                limit = int(self._meta("quota") or DEFAULT_QUOTA)
                if used - int(row["size"]) + size <= limit:
                    db.execute(
                        "UPDATE items SET size = ?, md5 = ?, blob = ?, modified = ? WHERE id = ?",
                        (size, md5.hexdigest(), blob, _now(), file_id),
                    )
                    old_blob, stored = row["blob"], True
        for name in (old_blob,) if stored else (blob,):
            if name:
                (self.root / "blobs" / name).unlink(missing_ok=True)
        return stored

    def move(self, file_id: str, parent: str, name: str) -> None:
        with self._lock, self._write() as db:
            db.execute(
                "UPDATE items SET parent = ?, name = ?, modified = ? WHERE id = ?",
                (self.resolve(parent), name, _now(), file_id),
            )

    def _subtree(self, db: sqlite3.Connection, file_id: str) -> list[str]:
        ids, frontier = [file_id], [file_id]
        while frontier:
            marks = ",".join("?" * len(frontier))
            frontier = [
                str(r[0])
                for r in db.execute(f"SELECT id FROM items WHERE parent IN ({marks})", frontier)
            ]
            ids += frontier
        return ids

    def trash(self, file_id: str) -> bool:
        """Move to the trash (with everything below it); False when there is no such item."""
        with self._lock, self._write() as db:
            if db.execute("SELECT 1 FROM items WHERE id = ?", (file_id,)).fetchone() is None:
                return False
            ids = self._subtree(db, file_id)
            marks = ",".join("?" * len(ids))
            db.execute(f"UPDATE items SET trashed = 1 WHERE id IN ({marks})", ids)
            db.execute("UPDATE items SET explicitly_trashed = 1 WHERE id = ?", (file_id,))
        return True

    def delete(self, file_id: str) -> bool:
        """Delete permanently (with everything below it), freeing the quota it used."""
        file_id = self.resolve(file_id)
        if file_id == self.root_id:
            raise ValueError("the root folder cannot be deleted")
        with self._lock, self._write() as db:
            ids = self._subtree(db, file_id)
            marks = ",".join("?" * len(ids))
            blobs = [
                r[0]
                for r in db.execute(f"SELECT blob FROM items WHERE id IN ({marks})", ids)
                if r[0]
            ]
            gone = db.execute(f"DELETE FROM items WHERE id IN ({marks})", ids).rowcount
        for blob in blobs:
            (self.root / "blobs" / blob).unlink(missing_ok=True)
        return gone > 0

    def empty_trash(self) -> None:
        with self._lock:
            rows = self._db.execute("SELECT id FROM items WHERE explicitly_trashed = 1").fetchall()
        for row in rows:
            self.delete(str(row[0]))


def copy_tree_out(cloud: Cloud, target: Path) -> list[tuple[str, Item]]:
    """Write every non-trashed item into ``target`` (what a fresh mount shows); return them."""
    found = list(cloud.walk())
    for path, item in found:
        local = target / path
        if item.is_folder:
            local.mkdir(parents=True, exist_ok=True)
        else:
            local.parent.mkdir(parents=True, exist_ok=True)
            local.write_bytes(cloud.read(item))
    return found


__all__ = ["EMPTY_MD5", "FILE_MIME", "FOLDER_MIME", "Cloud", "Item", "copy_tree_out"]
