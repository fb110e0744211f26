"""The simulated DriveFS daemon: a local cache at ``<mountpoint>/MyDrive`` and a lazy uploader.

What Colab users meet, reproduced on purpose:

- Writes land in the local cache at once and reach Drive only later: a file is uploaded when it
  has not changed for ``COLAB_STANDIN_UPLOAD_LAG_S`` seconds (default 1.0), by a thread of this
  process. A deletion reaches Drive after the same lag, and there it only moves the file to the
  trash, where it keeps using the quota.
- A new file shows up on Drive right away as an empty placeholder (0 bytes) until its content
  is uploaded, as large files have been seen to do (``COLAB_STANDIN_PLACEHOLDERS=0`` turns that
  off).
- Renames and moves (same inode) are applied to the existing Drive item, which keeps its id.
- An upload that would exceed the quota is refused and retried; it never lands on a full Drive.
- When the process dies (``kill -9``: the VM went away) or :func:`disconnect` is called,
  whatever had not been uploaded is lost. A fresh mount in another process shows only what
  reached the cloud.
- ``flush()`` pushes every pending change now, ignoring the lag (``drive.flush_and_unmount``).
"""

from __future__ import annotations

import os
import stat
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from colab_standin.cloud import Cloud, copy_tree_out

ROOT_ENV = "COLAB_STANDIN_ROOT"
LAG_ENV = "COLAB_STANDIN_UPLOAD_LAG_S"
SCAN_ENV = "COLAB_STANDIN_SCAN_S"
PLACEHOLDERS_ENV = "COLAB_STANDIN_PLACEHOLDERS"


@dataclass
class _File:
    ino: int
    sig: tuple[int, int]  # (size, mtime_ns)
    cloud_id: str | None
    synced: tuple[int, int] | None  # the signature whose content is on Drive
    changed_at: float


@dataclass
class _Dir:
    ino: int
    cloud_id: str | None


def _scan(top: Path) -> tuple[dict[str, int], dict[str, tuple[int, int, int]]]:
    """Folders {rel: inode} and files {rel: (inode, size, mtime_ns)} below ``top``."""
    dirs: dict[str, int] = {}
    files: dict[str, tuple[int, int, int]] = {}
    stack = [""]
    while stack:
        rel = stack.pop()
        try:
            entries = list(os.scandir(top / rel))
        except (FileNotFoundError, NotADirectoryError):
            continue  # removed while we looked
        for entry in entries:
            path = f"{rel}/{entry.name}" if rel else entry.name
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            if stat.S_ISDIR(st.st_mode):
                dirs[path] = st.st_ino
                stack.append(path)
            elif stat.S_ISREG(st.st_mode):
                files[path] = (st.st_ino, st.st_size, st.st_mtime_ns)
    return dirs, files


def _parent(rel: str) -> str:
    return rel.rsplit("/", 1)[0] if "/" in rel else ""


def _name(rel: str) -> str:
    return rel.rsplit("/", 1)[-1]


class Mount:
    """One mounted Drive: its cache folder, what it knows of the cloud, and its uploader."""

    def __init__(self, mountpoint: Path, cloud_root: Path, *, readonly: bool = False) -> None:
        self.mountpoint = mountpoint
        self.cache = mountpoint / "MyDrive"
        self.cloud = Cloud(cloud_root)
        self.readonly = readonly
        self.lag = float(os.environ.get(LAG_ENV, "1.0"))
        self.scan_interval = float(os.environ.get(SCAN_ENV, "0.05"))
        self.placeholders = os.environ.get(PLACEHOLDERS_ENV, "1") != "0"
        self._dirs: dict[str, _Dir] = {}
        self._files: dict[str, _File] = {}
        self._deletions: dict[str, float] = {}  # cloud id -> when the deletion was seen
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.last_error: BaseException | None = None

    # -- lifetime --------------------------------------------------------------------------

    def start(self) -> None:
        """Show what the cloud holds in the cache, then start uploading changes."""
        self.cache.mkdir(parents=True)
        copy_tree_out(self.cloud, self.cache)
        dirs, files = _scan(self.cache)
        ids = {path: item.id for path, item in self.cloud.walk()}
        self._dirs = {"": _Dir(self.cache.stat().st_ino, self.cloud.root_id)}
        self._dirs.update({rel: _Dir(ino, ids.get(rel)) for rel, ino in dirs.items()})
        for rel, (ino, size, mtime) in files.items():
            self._files[rel] = _File(ino, (size, mtime), ids.get(rel), (size, mtime), 0.0)
        if not self.readonly:
            self._thread = threading.Thread(target=self._run, name="drivefs-upload", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.scan_interval):
            try:
                self.sync_once()
            except Exception as exc:  # the daemon keeps going, as DriveFS retries
                self.last_error = exc

    def stop(self) -> None:
        """Stop uploading; pending changes are dropped (a disconnect)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        self.cloud.close()

    def flush(self, timeout_s: float) -> bool:
        """Push every pending change now; True when nothing is left pending."""
        if self.readonly:
            return True
        deadline = time.monotonic() + timeout_s
        while True:
            if self.sync_once(force=True) == 0:
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))

    # -- the uploader ----------------------------------------------------------------------

    def pending(self) -> int:
        """How many uploads and deletions have not reached the cloud yet."""
        with self._lock:
            uploads = sum(f.synced != f.sig for f in self._files.values())
            return uploads + len(self._deletions)

    def sync_once(self, *, force: bool = False) -> int:
        """One pass: notice changes, upload what is due; return how much is still pending."""
        with self._lock:
            now = time.monotonic()
            dirs, files = _scan(self.cache)
            self._reconcile(dirs, files, now)
            due = now if force else now - self.lag
            for rel, state in sorted(self._files.items(), key=lambda kv: kv[1].changed_at):
                if state.synced != state.sig and state.changed_at <= due:
                    self._upload(rel, state)
            for cloud_id, seen in list(self._deletions.items()):
                if seen <= due:
                    self.cloud.trash(cloud_id)  # gone already when deleted through the API
                    del self._deletions[cloud_id]
            return self.pending()

    def _reconcile(
        self, dirs: dict[str, int], files: dict[str, tuple[int, int, int]], now: float
    ) -> None:
        """Bring what we know in line with the cache as it is now: moves (by inode), new and
        changed files, deletions. The cache can change between two passes in any way."""
        # Folders, shallowest first, matched by inode: one that changed its path was moved,
        # and on Drive it keeps its id (with everything in it).
        old_dirs = {state.ino: (rel, state) for rel, state in self._dirs.items() if rel}
        self._dirs = {"": self._dirs[""]}
        for rel in sorted(dirs, key=lambda r: r.count("/")):
            found = old_dirs.pop(dirs[rel], None)
            if found is None:
                self._dirs[rel] = _Dir(dirs[rel], None)
                self._folder_id(rel)  # creating a folder is metadata: it shows up at once
                continue
            old_rel, state = found
            self._dirs[rel] = state
            if old_rel != rel and state.cloud_id is not None and self._cloud_has(state.cloud_id):
                self.cloud.move(state.cloud_id, self._folder_id(_parent(rel)), _name(rel))
        # Files: the same path and inode is the same file (perhaps rewritten); a file that
        # appears elsewhere with the same inode, size and mtime was renamed.
        old_files = self._files
        self._files = {}
        new: dict[str, tuple[int, int, int]] = {}
        for rel, (ino, size, mtime) in files.items():
            state = old_files.get(rel)
            if state is not None and state.ino == ino:
                del old_files[rel]
                if state.sig != (size, mtime):
                    state.sig, state.changed_at = (size, mtime), now
                self._files[rel] = state
            else:
                new[rel] = (ino, size, mtime)
        renamed = {(s.ino, *s.sig): (rel, s) for rel, s in old_files.items()}
        for rel, (ino, size, mtime) in new.items():
            found = renamed.pop((ino, size, mtime), None)
            if found is None:
                self._files[rel] = _File(ino, (size, mtime), None, None, now)
                if self.placeholders:
                    self._file_id(rel)
                continue
            old_rel, state = found
            del old_files[old_rel]
            self._files[rel] = state
            if state.cloud_id is not None and self._cloud_has(state.cloud_id):
                self.cloud.move(state.cloud_id, self._folder_id(_parent(rel)), _name(rel))
        # What is left is gone from the cache: on Drive it goes to the trash, after the lag.
        for state in [*old_files.values(), *(s for _, s in old_dirs.values())]:
            if state.cloud_id is not None:
                self._deletions[state.cloud_id] = now

    def _cloud_has(self, cloud_id: str) -> bool:
        item = self.cloud.get(cloud_id)
        return item is not None and not item.trashed

    def _folder_id(self, rel: str) -> str:
        """The cloud id of the cached folder ``rel``, created on Drive when missing there."""
        if rel == "":
            return self.cloud.root_id
        state = self._dirs.setdefault(rel, _Dir(-1, None))
        if state.cloud_id is None or not self._cloud_has(state.cloud_id):
            parent = self._folder_id(_parent(rel))
            state.cloud_id = self.cloud.create(parent, _name(rel), folder=True)
        return state.cloud_id

    def _file_id(self, rel: str) -> str:
        state = self._files[rel]
        if state.cloud_id is None or not self._cloud_has(state.cloud_id):
            state.cloud_id = self.cloud.create(self._folder_id(_parent(rel)), _name(rel),
                                               folder=False)  # fmt: skip
            state.synced = None
        return state.cloud_id

    def _upload(self, rel: str, state: _File) -> None:
        path = self.cache / rel
        try:
            before = path.stat()
        except FileNotFoundError:
            return  # deleted since the scan: the next pass sees it
        if (before.st_size, before.st_mtime_ns) != state.sig:
            return
        if self.cloud.upload(self._file_id(rel), path):
            try:
                after = path.stat()
            except FileNotFoundError:
                return
            if (after.st_size, after.st_mtime_ns, after.st_ino) == (*state.sig, state.ino):
                state.synced = state.sig  # else it changed while uploading: the next pass
