"""The Google Drive backend: a folder on Colab's Drive mount, confirmed on Drive itself.

Protocol (:class:`~nbresume.checkpoint.backends.base.Backend`, by way of the local backend):
a file written under the mount lands in DriveFS's local cache and is uploaded later, and
``os.fsync`` does not force an upload, so a checkpoint that reads back from the mount is only
*syncing* (:attr:`DriveStore.write_back`). It is *saved* once Drive itself, asked through the
Drive API v3 (:class:`DriveApi`, the ``google-api-python-client`` that Colab ships, with the
credentials of ``google.colab.auth.authenticate_user()``), reports every file of its manifest
with the same size and MD5 (:meth:`DriveStore.durability`). Checkpoints are deleted permanently
through the API: a deletion through the mount only moves files to Drive's trash, where they keep
using the quota.

The registry (:mod:`nbresume.checkpoint.backends.registry`) picks this backend for every folder
inside the mounted ``MyDrive``. Mounting Drive and flushing it are the Colab platform's part
(:mod:`nbresume.platforms.drive`).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import random
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from nbresume import knobs
from nbresume.checkpoint import forksafe
from nbresume.checkpoint.backends.base import (
    FAILED,
    MISSING,
    REPLACED_PREFIX,
    Durability,
    FileSums,
    syncing,
)
from nbresume.checkpoint.backends.local import LocalStore, remove_in_background
from nbresume.checkpoint.format import MANIFEST_NAME, RETIRED_PREFIX, TEMP_PREFIX, Manifest
from nbresume.errors import CorruptCheckpointError, StorageError, UsageError

#: The Drive client's retry jitter (see DriveApi._execute), never the user's `random`.
_RETRY_JITTER = random.Random()  # noqa: S311

log = logging.getLogger("nbresume")

FOLDER_MIME = "application/vnd.google-apps.folder"
_FILE_FIELDS = "nextPageToken, files(id, name, mimeType, size, md5Checksum)"


# -- the Drive API ----------------------------------------------------------------------------


class DriveApi:
    """The few Drive API v3 calls nbresume makes: find by path, list a folder, delete
    permanently, read the quota. Thread-safe (the client itself is not)."""

    _shared: DriveApi | None = None
    _shared_lock = forksafe.lock()

    def __init__(self, service: Any) -> None:
        self.service = service
        self._lock = forksafe.lock()

    @classmethod
    def connect(cls) -> DriveApi:
        """Authorise (``google.colab.auth.authenticate_user()`` on Colab) and build a client."""
        with contextlib.suppress(ImportError):
            from google.colab import auth

            try:
                auth.authenticate_user()
            except Exception as exc:
                raise StorageError(
                    f"the Drive API was not authorised: {exc}",
                    where="the Google Drive API",
                    fix="run `from google.colab import auth; auth.authenticate_user()` and "
                    "allow access",
                ) from None
        try:
            from googleapiclient.discovery import build
        except ImportError:
            raise StorageError(
                "google-api-python-client is missing, so Drive cannot be asked what it holds",
                where="the Google Drive API",
                fix="pip install google-api-python-client (Colab ships it)",
            ) from None
        root = knobs.DRIVE_API_URL.raw()
        options = {"api_endpoint": root.rstrip("/") + "/drive/v3/"} if root else None
        try:
            # The discovery document bundled with the library: no network round trip.
            service = build(
                "drive", "v3", static_discovery=True, cache_discovery=False, client_options=options
            )
        except Exception as exc:
            raise StorageError(
                f"cannot start a Drive API client: {exc}",
                where="the Google Drive API",
                fix="run `from google.colab import auth; auth.authenticate_user()` and allow "
                "access",
            ) from None
        return cls(service)

    @classmethod
    def shared(cls) -> DriveApi:
        """One client for the process, connected on first use."""
        with cls._shared_lock:
            if cls._shared is None:
                cls._shared = cls.connect()
            return cls._shared

    def _execute(self, request: Any) -> Any:
        # The client jitters its retries with random.random(): the user's own stream, which a
        # guest never draws from. A generator of nbresume's own jitters them instead.
        request._rand = _RETRY_JITTER.random
        with self._lock:
            return request.execute(num_retries=2)

    def _list(self, q: str) -> list[dict[str, Any]]:
        files: list[dict[str, Any]] = []
        token = None
        while True:
            page = self._execute(
                self.service.files().list(
                    q=q, fields=_FILE_FIELDS, pageSize=1000, spaces="drive", pageToken=token
                )
            )
            files += page.get("files", [])
            token = page.get("nextPageToken")
            if not token:
                return files

    def find(self, parts: Sequence[str]) -> list[dict[str, Any]]:
        """Every item (not trashed) at the path ``parts`` below My Drive. Drive allows several
        items of one name in a folder, so there may be more than one."""
        found: list[dict[str, Any]] = [{"id": "root", "mimeType": FOLDER_MIME}]
        for name in parts:
            found = [
                item
                for parent in found
                if parent.get("mimeType") == FOLDER_MIME
                for item in self.named(name, parent["id"])
            ]
            if not found:
                break
        return found

    def named(self, name: str, parent_id: str) -> list[dict[str, Any]]:
        """The items (not trashed) called ``name`` in the folder ``parent_id``."""
        return self._list(
            f"name = '{_quote(name)}' and '{parent_id}' in parents and trashed = false"
        )

    def children(self, folder_id: str) -> list[dict[str, Any]]:
        """The items (not trashed) directly in a folder, with size and MD5."""
        return self._list(f"'{folder_id}' in parents and trashed = false")

    def delete(self, file_id: str) -> bool:
        """Delete permanently (a folder with everything in it), freeing the quota; False when
        there was no such item."""
        from googleapiclient.errors import HttpError

        try:
            self._execute(self.service.files().delete(fileId=file_id))
        except HttpError as exc:
            if getattr(exc, "status_code", None) == 404 or exc.resp.status == 404:
                return False
            raise
        return True

    def quota(self) -> dict[str, int]:
        """``limit``, ``usage``, ``usageInDrive``, ``usageInDriveTrash`` in bytes."""
        about = self._execute(self.service.about().get(fields="storageQuota"))
        return {k: int(v) for k, v in about.get("storageQuota", {}).items()}


def _quote(name: str) -> str:
    """A name as a string literal of Drive's query language."""
    return name.replace("\\", "\\\\").replace("'", "\\'")


def _api_problem(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0][:300]


# -- the store --------------------------------------------------------------------------------


class DriveStore(LocalStore):
    """Checkpoints in a folder of the mounted Drive, confirmed on Drive itself.

    Args:
        root: a folder inside the mount's ``MyDrive``.
        my_drive: the ``MyDrive`` folder (default: the nearest ancestor of that name).
        api: the Drive API client (default: :meth:`DriveApi.shared`, connected now, so that
            Colab's permission prompt shows in the cell that made the store).
        poll_s: seconds between two checks of a checkpoint still uploading.
    """

    write_back = True
    reports_md5 = True
    store_name = "Google Drive"
    #: Another VM sees the writer lease only through Drive's sync, which can lag a renewal by
    #: minutes: a lease is stale later than on other stores.
    lease_expiry_s = 300.0
    #: delete() takes the checkpoint out of view before it returns; then, in the background,
    #: it removes the local copy and deletes its files through the Drive API, so that the
    #: quota comes back (the next save waits for that before it checks free space).
    remove_in_background = True

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        my_drive: str | os.PathLike[str] | None = None,
        api: DriveApi | None = None,
        poll_s: float | None = None,
    ) -> None:
        super().__init__(root)
        base = Path(my_drive) if my_drive is not None else _my_drive_of(self.root)
        real_root, real_base = os.path.realpath(self.root), os.path.realpath(base)
        if not (real_root + "/").startswith(real_base.rstrip("/") + "/"):
            raise StorageError(
                "this folder is not inside Google Drive's MyDrive",
                where=str(self.root),
                fix="choose a folder under /content/drive/MyDrive",
            )
        self.my_drive = base
        #: The path of the store's root below My Drive, as Drive's names.
        self.parts = [p for p in os.path.relpath(real_root, real_base).split(os.sep) if p != "."]
        self.durability_poll_s = poll_s if poll_s is not None else _poll_s()
        self._api = api
        self._api_error = ""
        self._md5s: dict[tuple[str, str, int], str] = {}
        self._root_ids: list[str] | None = None
        if api is None:
            self._connect()

    @classmethod
    def from_location(
        cls, location: str, storage_options: Mapping[str, Any] | None = None
    ) -> DriveStore:
        return cls(location, my_drive=knobs.drive_mount() / "MyDrive")

    def _connect(self) -> DriveApi | None:
        if self._api is None:
            try:
                self._api = DriveApi.shared()
            except StorageError as exc:
                self._api_error = str(exc)
        return self._api

    @property
    def api(self) -> DriveApi:
        api = self._connect()
        if api is None:
            raise StorageError(self._api_error, where=str(self.root))
        return api

    # -- what Drive holds ----------------------------------------------------------------

    def expected(self, folder: str, manifest: Manifest) -> dict[str, tuple[int, str]]:
        """{file name: (size, MD5)} that Drive must report for the checkpoint ``folder``,
        its manifest included (read from the local copy, which verification has checked)."""
        out: dict[str, tuple[int, str]] = {}
        for name, entry in manifest.files.items():
            out[name] = (entry.size, entry.md5 or self._local_md5(folder, name, entry.size))
        raw = bytes(self.read_bytes(folder, MANIFEST_NAME))
        out[MANIFEST_NAME] = (len(raw), hashlib.md5(raw, usedforsecurity=False).hexdigest())
        return out

    def _local_md5(self, folder: str, name: str, size: int) -> str:
        # A manifest written without MD5s (older versions): hash the verified local copy once.
        key = (folder, name, size)
        if key not in self._md5s:
            md5 = hashlib.md5(usedforsecurity=False)
            for chunk in self.iter_chunks(folder, name):
                md5.update(chunk)
            self._md5s[key] = md5.hexdigest()
        return self._md5s[key]

    def _find(self, name: str) -> list[dict[str, Any]]:
        """The items called ``name`` in the store's folder on Drive.

        The ids of the store's own folder are remembered (a walk from the root costs one call
        per path component); when they find nothing, they are looked up again, in case the
        folder was replaced on Drive since.
        """
        for cached in (True, False):
            if not cached or self._root_ids is None:
                self._root_ids = [i["id"] for i in self.api.find(self.parts)
                                  if i.get("mimeType") == FOLDER_MIME]  # fmt: skip
            found = [item for root_id in self._root_ids
                     for item in self.api.named(name, root_id)]  # fmt: skip
            if found or not cached:
                return found
        return []

    def drive_state(self, folder: str, expected: dict[str, tuple[int, str]]) -> Durability:
        """Compare what Drive reports for ``folder`` with ``expected`` (see :meth:`expected`)."""
        where = "/".join(["My Drive", *self.parts, folder])
        try:
            folders = [f for f in self._find(folder) if f.get("mimeType") == FOLDER_MIME]
            remote: dict[str, list[dict[str, Any]]] = {}
            for item in folders:
                for child in self.api.children(item["id"]):
                    remote.setdefault(child["name"], []).append(child)
        except Exception as exc:
            return Durability(FAILED, f"cannot ask Google Drive about {where}: {_api_problem(exc)}")
        if not folders:
            return Durability(MISSING, f"{where} is not on Google Drive yet")
        waiting = []
        for name, (size, md5) in sorted(expected.items()):
            copies = remote.get(name, [])
            if not copies:
                waiting.append(f"{name} (not there yet)")
            elif len(copies) > 1 and any(_matches(c, size, md5) for c in copies):
                waiting.append(f"{name} ({len(copies)} copies of that name)")
            elif not _matches(copies[0], size, md5):
                got = int(copies[0].get("size") or 0)
                detail = f"{got} of {size} bytes" if got != size else "other bytes (MD5 differs)"
                waiting.append(f"{name} ({detail})")
        return syncing(len(expected), waiting, f"of {where} on Google Drive; waiting for ")

    def durability(self, folder: str, manifest: Manifest) -> Durability:
        """``saved`` only when Drive reports every file with the manifest's size and MD5."""
        return self.durability_with(folder, manifest, dict)

    def durability_with(self, folder: str, manifest: Manifest, more: FileSums) -> Durability:
        try:
            expected = self.expected(folder, manifest)
            expected.update(more())
        except (OSError, KeyError, CorruptCheckpointError) as exc:
            return Durability(FAILED, f"cannot read the local copy of {folder}: {exc}")
        return self.drive_state(folder, expected)

    # -- deleting past the trash -----------------------------------------------------------

    def _drive_ids(self, name: str) -> list[str]:
        try:
            return [item["id"] for item in self._find(name)]
        except Exception as exc:
            self._warn_trash(name, exc)
            return []

    def _delete_on_drive(self, name: str, ids: Iterable[str]) -> None:
        for file_id in ids:
            try:
                self.api.delete(file_id)
            except Exception as exc:
                self._warn_trash(name, exc)

    def _warn_trash(self, name: str, exc: BaseException) -> None:
        log.warning(
            "nbresume: %s could not be deleted permanently from Google Drive (%s); it stays in "
            "Drive's trash, using quota, until the trash is emptied",
            self.child(name),
            _api_problem(exc),
        )

    def begin(self, final: str) -> str:
        if not self.my_drive.is_dir():
            # Unmounted (flush_and_unmount, a crash of DriveFS): writing on would fill the VM's
            # own disk, which is lost with the VM.
            raise StorageError(
                "Google Drive is not mounted",
                where=str(self.my_drive),
                fix="mount it again (run nbresume.init again, or drive.mount) and save again",
            )
        return super().begin(final)

    def commit(self, folder: str, final: str) -> None:
        # Replacing a step: the old copy is removed from Drive for good, not trashed.
        replaced = self._drive_ids(final) if (self.root / final).exists() else []
        super().commit(folder, final)
        self._delete_on_drive(final, replaced)

    def delete(self, folder: str) -> None:
        # Drive knows the files by the name they had: looked up before the rename.
        ids = self._drive_ids(folder)
        self._check_writer()
        doomed = self._out_of_view(folder)

        def remove() -> None:
            try:
                self.files.remove_tree(doomed)
            finally:
                self._delete_on_drive(folder, ids)

        remove_in_background(remove)

    def discard(self, folder: str) -> None:
        ids = self._drive_ids(folder) if (self.root / folder).exists() else []
        super().discard(folder)
        self._delete_on_drive(folder, ids)

    def replace_small(self, name: str, data: bytes) -> None:
        # Rewritten in place, not renamed over: every renewal of the writer lease is then a new
        # revision of one Drive file, where a rename would send the old file to Drive's trash.
        # A reader on this VM may catch it half-written and reads again (see the lease).
        self._make_root()
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0)
        with os.fdopen(os.open(self.root / name, flags, 0o644), "wb") as handle:
            handle.write(data)

    def recover(self, current: str) -> list[str]:
        leftovers = [
            name
            for name in self.list_folders()
            if name != current
            and name.startswith((TEMP_PREFIX, RETIRED_PREFIX))
            and not name.startswith(REPLACED_PREFIX)  # may be put back as the step itself
        ]
        ids = {name: self._drive_ids(name) for name in leftovers}
        cleaned = super().recover(current)
        for name in cleaned:
            if name in ids and not (self.root / name).exists():
                self._delete_on_drive(name, ids[name])
        return cleaned


def _poll_s() -> float:
    text = knobs.DRIVE_POLL_S.raw()
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value <= 3600:
        raise UsageError(
            f"{knobs.DRIVE_POLL_S.name}={text!r} cannot be used",
            where=f"environment variable {knobs.DRIVE_POLL_S.name}",
            fix="set it to seconds between 0 and 3600, or unset it for the default (5)",
        )
    return value


def _matches(item: dict[str, Any], size: int, md5: str) -> bool:
    return int(item.get("size") or -1) == size and item.get("md5Checksum") == md5


def _my_drive_of(path: Path) -> Path:
    for candidate in (path, *path.parents):
        if candidate.name == "MyDrive":
            return candidate
    raise StorageError(
        "this folder is not inside Google Drive's MyDrive",
        where=str(path),
        fix="choose a folder under /content/drive/MyDrive",
    )
