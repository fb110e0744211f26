"""The Hugging Face Storage Buckets backend: ``hf://buckets/OWNER/NAME[/PREFIX]``.

Protocol (:class:`~nbresume.checkpoint.backends.base.Backend`): a bucket is an object store
reached through the official client (``huggingface_hub`` 2.x, whose uploads go through
``hf_xet``). Each file of a checkpoint is written to a local staging file, hashed with
``hf_xet.hash_files`` (the bucket's own content hash, ``xet_hash``) and uploaded when it is
closed, together with a small record of its size and ``xet_hash`` as computed here (in the
checkpoint's hidden subfolder :data:`XET_RECORDS`), so that any process on any machine (another
rank of a sharded save, a later session) can ask the bucket whether it holds exactly those bytes
without downloading them. The manifest goes last and is the commit, as on other object stores.

A checkpoint is *saved* (:meth:`HfBucketStore.durability`) only when the bucket's listing
reports every file, the manifest included, with the local size and ``xet_hash``: the twin of
Google Drive's MD5 check. Deletion goes through the API and frees the bucket's space.

Tokens come from where users keep them: ``storage_options={"token": ...}``, ``HF_TOKEN``, the
``hf auth login`` file and Colab's secrets (all three through ``huggingface_hub.get_token``),
then Kaggle's secrets (``HF_TOKEN``). A token is never printed nor written anywhere. The first
write checks once that the token may write to the bucket (the Hub hands out a xet write token
only then), so a missing, expired or read-only token is one clear error before training.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import IO, Any, TypeVar

from nbresume.checkpoint import forksafe
from nbresume.checkpoint.backends.base import (
    FAILED,
    MISSING,
    SMALL_FILE_LIMIT,
    Backend,
    Durability,
    syncing,
)
from nbresume.checkpoint.format import (
    MANIFEST_NAME,
    Manifest,
)
from nbresume.errors import StorageError, UsageError

log = logging.getLogger("nbresume")

#: The URL prefix of a bucket.
SCHEME = "hf://buckets/"
#: The subfolder of each checkpoint folder that holds, per file, ``NAME.json``:
#: ``{"size": ..., "xet_hash": ...}`` as computed where the file was written, uploaded with the
#: file. Not a file of the folder (:meth:`HfBucketStore.list_files`); removed with the folder.
XET_RECORDS = ".nbresume-xet"
#: Attempts at a call the Hub answers with 429 (beyond the client's own retries), and the most
#: seconds of one wait that ``Retry-After`` may ask for.
RATE_LIMIT_ATTEMPTS = 5
RATE_LIMIT_MAX_WAIT_S = 60.0

AUTH_FIX = (
    "create a token with write access at https://huggingface.co/settings/tokens, then run "
    "`hf auth login` or set HF_TOKEN (on Colab or Kaggle: a secret named HF_TOKEN)"
)
KAGGLE_OFFLINE_FIX = (
    "turn Internet on in the notebook's settings (or `kaggle kernels push` with internet "
    "enabled), or keep checkpoints in /kaggle/working and carry them with "
    "`nbresume push --kaggle-dataset`"
)

T = TypeVar("T")


def parse_url(url: str) -> tuple[str, str]:
    """``(bucket_id, prefix)`` of ``hf://buckets/OWNER/NAME[/PREFIX]``."""
    if not url.startswith(SCHEME):
        raise UsageError(
            f"{url} is not a bucket URL", where=url, fix="write it as hf://buckets/OWNER/NAME"
        )
    parts = [p for p in url[len(SCHEME) :].split("/") if p]
    if len(parts) < 2 or any(p in (".", "..") for p in parts):
        raise UsageError(
            f"{url} does not name a bucket",
            where=url,
            fix="write it as hf://buckets/OWNER/NAME, optionally followed by a folder",
        )
    return f"{parts[0]}/{parts[1]}", "/".join(parts[2:])


def find_token(explicit: str | None = None) -> str | None:
    """The token to use, from the places users keep it (never logged)."""
    if explicit:
        return explicit
    from huggingface_hub import get_token

    token = get_token()  # HF_TOKEN, the `hf auth login` file, Colab's secrets
    if token:
        return token
    if os.environ.get("KAGGLE_KERNEL_RUN_TYPE"):
        with contextlib.suppress(Exception):  # no secret of that name, or secrets not attached
            from kaggle_secrets import UserSecretsClient

            secret = UserSecretsClient().get_secret("HF_TOKEN")
            if isinstance(secret, str) and secret:
                return secret
    return None


def xet_hash(path: str | os.PathLike[str]) -> str:
    """The ``xet_hash`` of a local file, as a bucket reports it."""
    from hf_xet import hash_files

    (info,) = hash_files([os.fspath(path)])
    return str(info.hash)


class BucketReadError(OSError):
    """A file of the bucket could not be read back (a reader skips that checkpoint)."""


class _Upload:
    """A staging file being written; uploaded by :meth:`HfBucketStore.close_durably`."""

    def __init__(self, folder: str, name: str, path: Path) -> None:
        self.folder, self.name, self.path = folder, name, path


class HfBucketStore(Backend):
    """Checkpoints in a Hugging Face Storage Bucket, confirmed by the bucket's ``xet_hash``.

    Args:
        url: ``hf://buckets/OWNER/NAME`` with an optional folder after it.
        token: a Hugging Face token (default: :func:`find_token`).
        endpoint: the Hub's URL (default: ``HF_ENDPOINT``, else https://huggingface.co).
    """

    atomic_rename = False
    #: Not a cache that uploads later, but a store whose own report decides: a checkpoint
    #: counts as saved (for retention and the durability events) only once the bucket reports
    #: the local ``xet_hash`` and size of each of its files.
    write_back = True
    store_name = "the Hugging Face bucket"
    durability_poll_s = 5.0
    #: Another machine renews its writer lease through the Hub: allow for slow round trips.
    lease_expiry_s = 180.0

    def __init__(self, url: str, *, token: str | None = None, endpoint: str | None = None) -> None:
        self.url = url.rstrip("/")
        self.bucket_id, self.prefix = parse_url(self.url)
        try:
            from huggingface_hub import HfApi
        except ImportError:
            raise UsageError(
                "huggingface_hub is not installed, so the bucket cannot be reached",
                where=self.url,
                fix='pip install "nbresume[buckets]" (huggingface_hub and hf_xet)',
            ) from None
        self._token = find_token(token)
        # huggingface_hub reads HF_ENDPOINT once, when it is imported: read it again here.
        self.api = HfApi(endpoint=endpoint or os.environ.get("HF_ENDPOINT") or None)
        self._staging = tempfile.TemporaryDirectory(prefix="nbresume-bucket-")
        self._hashes: dict[str, dict[str, tuple[int, str]]] = {}
        self._lock = forksafe.lock()
        self._writable = False

    @classmethod
    def from_location(
        cls, location: str, storage_options: Mapping[str, Any] | None = None
    ) -> HfBucketStore:
        options = dict(storage_options or {})
        token, endpoint = options.pop("token", None), options.pop("endpoint", None)
        if options:
            raise UsageError(
                f"storage_options {sorted(options)} do not apply to a bucket",
                where=location,
                fix='pass only {"token": ..., "endpoint": ...}, or none',
            )
        return cls(location, token=token, endpoint=endpoint)

    @property
    def location(self) -> str:
        return self.url

    def __repr__(self) -> str:  # never the token
        return f"HfBucketStore({self.url!r})"

    # -- calls to the Hub ------------------------------------------------------------------

    def _remote(self, *names: str) -> str:
        return "/".join(part for part in (self.prefix, *names) if part)

    def _call(self, what: str, fn: Callable[[], T]) -> T:
        """``fn()``, waiting out 429s as ``Retry-After`` asks; errors in nbresume's words."""
        from huggingface_hub.errors import HfHubHTTPError

        for attempt in range(RATE_LIMIT_ATTEMPTS):
            try:
                return fn()
            except HfHubHTTPError as exc:
                status = exc.response.status_code if exc.response is not None else None
                if status == 429 and attempt + 1 < RATE_LIMIT_ATTEMPTS:
                    time.sleep(_retry_after(exc.response.headers, attempt))
                    continue
                raise self._error(what, exc, status) from None
            except (FileNotFoundError, BucketReadError, StorageError):
                raise  # StorageError: already in nbresume's words
            except OSError as exc:
                raise self._error(what, exc, None) from None
            except Exception as exc:
                if type(exc).__module__.startswith(("httpx", "httpcore")):  # no connection
                    raise self._error(what, exc, None) from None
                raise
        raise AssertionError("unreachable")

    def _error(self, what: str, exc: BaseException, status: int | None) -> StorageError:
        where = self.url
        text = _first_line(exc)
        if status == 401:
            return StorageError(
                f"the Hub refused the token while it tried to {what} (401: expired, revoked or "
                "not a token)"
                if self._token
                else f"no Hugging Face token was found to {what}",
                where=where,
                fix=AUTH_FIX,
            )
        if status == 403:
            return StorageError(
                f"the token may not {what} (403: a read-only token, or no access to the bucket)",
                where=where,
                fix=AUTH_FIX,
            )
        if status == 404:
            return StorageError(
                f"the bucket {self.bucket_id} was not found while it tried to {what}",
                where=where,
                fix=f"create it (`hf buckets create {self.bucket_id}`), or check the URL and "
                "that the token may see it",
            )
        if status is None and os.environ.get("KAGGLE_KERNEL_RUN_TYPE"):
            return StorageError(
                f"the Hub cannot be reached from this Kaggle session to {what}: {text}",
                where=where,
                fix=KAGGLE_OFFLINE_FIX,
            )
        return StorageError(
            f"cannot {what}: {text}",
            where=where,
            fix="check the network and https://status.huggingface.co, then run again",
        )

    def check_writable(self) -> None:
        """Raise a clear error unless the token may write to the bucket (asked once)."""
        if self._writable:
            return
        if not self._token:
            raise StorageError(
                "no Hugging Face token was found, and writing to a bucket needs one",
                where=self.url,
                fix=AUTH_FIX,
            )
        from huggingface_hub import get_session, hf_raise_for_status

        url = f"{self.api.endpoint}/api/buckets/{self.bucket_id}/xet-write-token"
        headers = self.api._build_hf_headers(token=self._token)

        def ask() -> None:
            hf_raise_for_status(get_session().get(url, headers=headers))

        self._call("write to the bucket", ask)
        self._writable = True

    def _listing(self, path: str, recursive: bool) -> list[Any]:
        """The entries below the folder ``path`` (the root when empty): directly below it, or
        all files at any depth. The Hub matches a listing's prefix as a string ("run1" also
        finds "run10/..."): the folder is asked for with its slash, and what is not below it
        is dropped. A folder that is not there lists as empty."""
        from huggingface_hub.errors import HfHubHTTPError

        below = path + "/" if path else ""

        def ask() -> list[Any]:
            try:
                items = self.api.list_bucket_tree(
                    self.bucket_id, below or None, recursive=recursive, token=self._token
                )
                return [item for item in items if item.path.startswith(below)]
            except HfHubHTTPError as exc:
                if exc.response is not None and exc.response.status_code == 404 and path:
                    return []
                raise

        found = self._call("list the bucket", ask)
        if recursive:
            return [item for item in found if item.type == "file"]
        return [item for item in found if "/" not in item.path[len(below) :].strip("/")]

    def _tree(self, path: str) -> list[Any]:
        return self._listing(path, recursive=False)

    def _tree_all(self, path: str) -> list[str]:
        """Every file below the folder ``path``, at any depth."""
        return [item.path for item in self._listing(path, recursive=True)]

    def _paths_info(self, paths: list[str]) -> dict[str, tuple[int, str]]:
        def ask() -> dict[str, tuple[int, str]]:
            found = self.api.get_bucket_paths_info(self.bucket_id, paths, token=self._token)
            return {item.path: (int(item.size), str(item.xet_hash)) for item in found}

        return self._call("ask the bucket about its files", ask)

    def _upload(self, items: list[tuple[str | Path | bytes, str]]) -> None:
        self.check_writable()

        def send() -> None:
            self.api.batch_bucket_files(self.bucket_id, add=items, token=self._token)

        self._call("upload to the bucket", send)

    def _remove(self, paths: Iterable[str]) -> None:
        doomed = list(paths)
        if not doomed:
            return
        self.check_writable()

        def send() -> None:
            self.api.batch_bucket_files(self.bucket_id, delete=doomed, token=self._token)

        self._call("delete from the bucket", send)

    def _download(self, remote: str) -> IO[bytes]:
        """A read-only handle of a local copy of ``remote``, gone once closed."""
        from huggingface_hub.errors import EntryNotFoundError

        fd, name = tempfile.mkstemp(dir=self._staging.name)
        os.close(fd)

        def fetch() -> None:
            try:
                self.api.download_bucket_files(
                    self.bucket_id, [(remote, name)], raise_on_missing_files=True, token=self._token
                )
            except EntryNotFoundError:
                raise FileNotFoundError(f"{self.url}: no {remote}") from None
            except RuntimeError as exc:  # hf_xet: the bytes could not be reconstructed
                raise BucketReadError(
                    f"{self.url}: {remote} could not be downloaded: {_first_line(exc)}"
                ) from None

        try:
            self._call("download from the bucket", fetch)
            handle = open(name, "rb")  # noqa: SIM115 (returned to the caller)
        finally:
            with contextlib.suppress(OSError):
                os.unlink(name)  # the open handle keeps the bytes until it is closed
        return handle

    # -- folders and files -----------------------------------------------------------------

    def list_folders(self) -> list[str]:
        return [
            item.path.rsplit("/", 1)[-1]
            for item in self._tree(self.prefix)
            if item.type == "directory"
        ]

    def list_files(self, folder: str) -> list[str]:
        return [
            item.path.rsplit("/", 1)[-1]
            for item in self._tree(self._remote(folder))
            if item.type == "file"
        ]

    def begin(self, final: str) -> str:
        # Written in place: an earlier copy of this step is withdrawn (its manifest first).
        self.check_writable()
        self.delete(final)
        with self._lock:
            self._hashes[final] = {}
        return final

    def open_write(self, folder: str, name: str) -> IO[bytes]:
        fd, path = tempfile.mkstemp(dir=self._staging.name)
        handle = os.fdopen(fd, "wb")
        handle._nbresume_upload = _Upload(folder, name, Path(path))  # type: ignore[attr-defined]
        return handle

    def close_durably(self, handle: IO[bytes]) -> None:
        """Upload the staged file, with the record of its size and ``xet_hash``."""
        handle.close()
        upload: _Upload = handle._nbresume_upload  # type: ignore[attr-defined]
        try:
            size, digest = upload.path.stat().st_size, xet_hash(upload.path)
            items: list[tuple[str | Path | bytes, str]] = [
                (str(upload.path), self._remote(upload.folder, upload.name))
            ]
            if upload.name != MANIFEST_NAME:  # the manifest's own is taken from a download
                record = json.dumps({"size": size, "xet_hash": digest}).encode()
                items.append(
                    (record, self._remote(upload.folder, XET_RECORDS, upload.name + ".json"))
                )
            with self._lock:
                self._hashes.setdefault(upload.folder, {})[upload.name] = (size, digest)
            self._upload(items)
        finally:
            upload.path.unlink(missing_ok=True)

    def commit(self, folder: str, final: str) -> None:
        self._check_writer()
        if folder != final:
            raise AssertionError(f"a bucket is written in place, got {folder!r} for {final!r}")

    def open_read(self, folder: str, name: str) -> IO[bytes]:
        return self._download(self._remote(folder, name))

    def delete(self, folder: str) -> None:
        # The manifest goes first: from then on the folder is not a checkpoint.
        self._check_writer()
        files = self._tree_all(self._remote(folder))
        manifest = self._remote(folder, MANIFEST_NAME)
        if manifest in files:
            self._remove([manifest])
        self._remove(p for p in files if p != manifest)
        with self._lock:
            self._hashes.pop(folder, None)

    def discard(self, folder: str) -> None:
        self._remove(self._tree_all(self._remote(folder)))
        with self._lock:
            self._hashes.pop(folder, None)

    def recover(self, current: str) -> list[str]:
        return self._discard_uncommitted(current)

    # -- what the bucket holds ---------------------------------------------------------------

    def expected(self, folder: str, manifest: Manifest) -> dict[str, tuple[int, str]]:
        """{file name: (size, xet_hash)} the bucket must report for the files of ``manifest``
        and the manifest itself: as hashed here where this process wrote the file; else from
        the file's record (:data:`XET_RECORDS`), and for the manifest from a downloaded copy.
        Raises FileNotFoundError when a record is not in the bucket."""
        with self._lock:
            out = dict(self._hashes.get(folder, {}))
        for name in sorted(set(manifest.files) - set(out)):
            with self.open_read(folder, f"{XET_RECORDS}/{name}.json") as handle:
                record = json.loads(handle.read(SMALL_FILE_LIMIT))
            out[name] = (int(record["size"]), str(record["xet_hash"]))
        if MANIFEST_NAME not in out:
            with self.open_read(folder, MANIFEST_NAME) as handle:
                out[MANIFEST_NAME] = (os.fstat(handle.fileno()).st_size, _hash_handle(handle))
        return {n: v for n, v in out.items() if n in manifest.files or n == MANIFEST_NAME}

    def durability(self, folder: str, manifest: Manifest) -> Durability:
        """``saved`` only when the bucket reports every file of the manifest, and the manifest
        itself, with the size and ``xet_hash`` computed where each was written (no file is
        downloaded but the manifest and the records, for files another process wrote)."""
        where = self.child(folder)
        try:
            expected = self.expected(folder, manifest)
        except FileNotFoundError as exc:
            return Durability(MISSING, f"{where}: not in the bucket yet ({_first_line(exc)})")
        except (StorageError, OSError, ValueError) as exc:
            return Durability(FAILED, f"cannot read what {where} should hold: {_first_line(exc)}")
        try:
            remote = self._paths_info([self._remote(folder, n) for n in sorted(expected)])
        except StorageError as exc:
            return Durability(FAILED, f"cannot ask the bucket about {where}: {exc}")
        waiting = []
        for name, (size, digest) in sorted(expected.items()):
            entry = manifest.files.get(name)
            got = remote.get(self._remote(folder, name))
            if got is None:
                waiting.append((name, size, "not in the bucket"))
            elif got[0] != size or (entry is not None and entry.size != size):
                waiting.append((name, size, f"{got[0]} of {size} bytes"))
            elif got[1] != digest:
                waiting.append((name, size, "other bytes: the bucket's xet_hash differs"))
        total = sum(size for size, _ in expected.values())
        return syncing(
            len(expected),
            [f"{name} ({why})" for name, _, why in waiting],
            f"of {where} confirmed by the bucket; not yet: ",
            size=(total - sum(size for _, size, _ in waiting), total),
        )

    def confirm(self, folder: str, manifest: Manifest) -> tuple[bool, str]:
        state = self.durability(folder, manifest)
        if state.saved:
            count = len(manifest.files)
            return True, (
                f"the bucket reports all {count} files and the manifest with the local size "
                "and xet_hash"
            )
        return False, f"{self.store_name}: {state}"

    # -- small files directly below the root (the writer lease) ------------------------------

    def read_small(self, name: str) -> bytes | None:
        try:
            with self._download(self._remote(name)) as handle:
                return handle.read(SMALL_FILE_LIMIT)
        except FileNotFoundError:
            return None

    def replace_small(self, name: str, data: bytes) -> None:
        self._upload([(bytes(data), self._remote(name))])

    def remove_small(self, name: str) -> None:
        self._remove([self._remote(name)])


def _hash_handle(handle: IO[bytes]) -> str:
    fd, path = tempfile.mkstemp(prefix="nbresume-manifest-", dir=os.path.dirname(handle.name))
    try:
        with os.fdopen(fd, "wb") as out:
            handle.seek(0)
            out.write(handle.read())
        return xet_hash(path)
    finally:
        os.unlink(path)


def _retry_after(headers: Mapping[str, str], attempt: int) -> float:
    text = headers.get("Retry-After", "")
    try:
        wait = float(text)
    except ValueError:
        wait = float(2**attempt)
    return min(max(wait, 0.0), RATE_LIMIT_MAX_WAIT_S)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0][:300]
