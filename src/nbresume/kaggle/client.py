"""Talking to Kaggle through the official ``kaggle`` package, with every answer checked.

``kaggle kernels push`` prints "Kernel push error: ..." and exits 0 when Kaggle refuses a push
(quota used up, too many sessions, notebook not found). Here the answer's ``error`` field is
read and becomes a :class:`KaggleError` that says what happened and what to do, so that
``nbresume commit`` exits non-zero. HTTP and connection failures are translated the same way.

The package authenticates when it is imported (and prints a help text when it cannot);
:class:`Kaggle` imports it quietly and authenticates again itself, so a missing credential is
an error with the fix rather than a page of text.

Files of a version's output are downloaded by nbresume, streamed to disk (checkpoints can be
larger than memory), under names checked to stay inside the destination folder.
"""

from __future__ import annotations

import contextlib
import io
import os
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from nbresume.errors import KaggleError, UsageError
from nbresume.kaggle.metadata import SOURCE_KEYS, parse_ref

#: Statuses after which a version runs no more.
FINISHED = ("COMPLETE", "ERROR", "CANCEL_ACKNOWLEDGED")
PAGE_SIZE = 100
MAX_PAGES = 1000
DOWNLOAD_CHUNK = 1 << 20
#: (connect, read) seconds for one request to Kaggle or to a file's URL.
TIMEOUT = (30.0, 300.0)
#: How long an uploaded dataset may take to become ready, and the seconds between two looks.
DATASET_READY_S = 600.0
DATASET_POLL_S = 3.0

_CREDENTIALS_FIX = (
    "create an API token at kaggle.com → Settings → API → Create New Token, then save "
    "kaggle.json in ~/.kaggle/ (chmod 600) or set KAGGLE_USERNAME and KAGGLE_KEY"
)


@dataclass(frozen=True)
class PushResult:
    """What Kaggle answered to a push that it accepted."""

    ref: str
    url: str
    version: int | None
    invalid_sources: dict[str, list[str]] = field(default_factory=dict)


@dataclass(frozen=True)
class SessionStatus:
    """The state of a notebook's latest version: QUEUED, RUNNING, COMPLETE, ERROR, ..."""

    ref: str
    status: str
    failure: str = ""

    @property
    def finished(self) -> bool:
        return self.status in FINISHED


@dataclass(frozen=True)
class OutputFile:
    """One file of a version's output: its path in the output, and where to download it."""

    name: str
    url: str


@dataclass(frozen=True)
class KernelInfo:
    """A notebook as Kaggle has it: its source and its settings, as kernel-metadata keys."""

    ref: str
    title: str
    source: str
    settings: dict[str, Any]
    version: int | None
    kernel_type: str = "notebook"


def classify(error: str, ref: str, user: str) -> KaggleError:
    """Kaggle's refusal of a push, as an error that says what to do."""
    lowered = error.lower()
    if "quota" in lowered or ("exceeded" in lowered and "hour" in lowered):
        return KaggleError(
            f"Kaggle refused the push of {ref}: {error}",
            fix="the weekly accelerator quota (about 30 GPU hours) is used up: wait for its "
            "reset (kaggle.com → Settings shows when), or commit with --accelerator cpu",
            reason="quota",
        )
    if "session" in lowered and any(w in lowered for w in ("maximum", "count", "concurrent")):
        return KaggleError(
            f"Kaggle refused the push of {ref}: {error}",
            fix="too many batch sessions run at once (2 with a GPU): wait for one to finish "
            f"(`nbresume status {ref}`) or stop one at kaggle.com → Your Work, then commit "
            "again",
            reason="sessions",
        )
    if "not found" in lowered:
        owner = ref.partition("/")[0]
        whose = f" (the credentials are {user!r}'s)" if user and user != owner else ""
        return KaggleError(
            f"Kaggle refused the push of {ref}: {error}",
            fix=f"check that {owner!r} is the Kaggle user name of these credentials{whose}, "
            "that the slug is right and that the title gives the slug; if the notebook was "
            "made on kaggle.com, open it there and save it once, then commit again",
            reason="not-found",
        )
    return KaggleError(
        f"Kaggle refused the push of {ref}: {error}",
        fix="nothing was started; fix what the message says and commit again",
    )


def _import_api() -> Any:
    try:
        # `import kaggle` authenticates and, without credentials, prints a help page: keep it
        # out of our output and authenticate again below.
        with contextlib.redirect_stdout(io.StringIO()):
            from kaggle.api.kaggle_api_extended import KaggleApi
    except ModuleNotFoundError as exc:
        raise UsageError(
            f"Kaggle support needs the package {exc.name!r}",
            fix="pip install 'nbresume[kaggle]'",
        ) from None
    # Older clients authenticate at import without credentials: 2.0 exits, 1.7 raises.
    except SystemExit:
        raise KaggleError(
            "no Kaggle credentials found", fix=_CREDENTIALS_FIX, reason="auth"
        ) from None
    except OSError as exc:
        raise KaggleError(
            f"no Kaggle credentials found ({exc})", fix=_CREDENTIALS_FIX, reason="auth"
        ) from None
    return KaggleApi


#: What to do when Kaggle refuses the upload of nbresume's wheel as a dataset.
_WHEEL_DATASET_FIX = (
    "commit with --internet (the notebook then installs nbresume with pip), "
    "or with --no-wheel if the notebook installs nbresume itself"
)


class Kaggle:
    """An authenticated connection to Kaggle's API (see the module docstring)."""

    def __init__(self) -> None:
        api_class = _import_api()
        self.api = api_class()
        self.user: str = ""
        captured = io.StringIO()
        try:
            with contextlib.redirect_stdout(captured):
                self.api.authenticate()
        except SystemExit:
            raise KaggleError(
                "no Kaggle credentials found", fix=_CREDENTIALS_FIX, reason="auth"
            ) from None
        except Exception as exc:
            raise self._translate(exc, "authenticating") from None
        self.user = str(self.api.config_values.get("username") or "")

    # -- calls -----------------------------------------------------------------------------

    def push(self, folder: Path, timeout_s: int | None = None) -> PushResult:
        """Push the notebook described by ``folder/kernel-metadata.json``; raise
        :class:`KaggleError` when Kaggle answers with an error."""
        import json

        meta = json.loads((folder / "kernel-metadata.json").read_text(encoding="utf-8"))
        ref = str(meta.get("id", ""))
        try:
            with contextlib.redirect_stdout(io.StringIO()):  # its slug caution: ours is clearer
                response = self.api.kernels_push(str(folder), str(timeout_s) if timeout_s else None)
        except ValueError as exc:
            raise KaggleError(
                f"the kaggle client refused kernel-metadata.json: {exc}",
                where=str(folder),
                fix="correct the command line options (the file is rewritten on each commit)",
            ) from None
        except Exception as exc:
            raise self._translate(exc, f"pushing {ref}") from None
        if response is None:
            raise KaggleError(f"Kaggle gave no answer to the push of {ref}", fix="try again")
        if response.error:
            raise classify(str(response.error), ref, self.user)
        invalid = {
            "dataset_sources": list(response.invalid_dataset_sources or []),
            "competition_sources": list(response.invalid_competition_sources or []),
            "kernel_sources": list(response.invalid_kernel_sources or []),
            "model_sources": list(response.invalid_model_sources or []),
        }
        return PushResult(
            ref=str(response.ref or ref),
            url=str(response.url or ""),
            version=response.version_number,
            invalid_sources={k: v for k, v in invalid.items() if v},
        )

    def dataset_description(self, ref: str) -> str | None:
        """The description of the dataset ``ref`` (Kaggle's dataset metadata); ``None`` when
        the dataset does not exist or the answer has none."""
        import json
        import tempfile

        try:
            with (
                tempfile.TemporaryDirectory(prefix="nbresume-dataset-") as folder,
                contextlib.redirect_stdout(io.StringIO()),
            ):
                written = self.api.dataset_metadata(ref, folder)
                document = json.loads(Path(written).read_text(encoding="utf-8"))
        except Exception as exc:
            if _is_not_found(exc):
                return None
            raise self._translate(exc, f"asking for the dataset {ref}") from None
        # The client writes the whole answer ({"info": {...}}) or the info alone.
        info = document.get("info", document) if isinstance(document, dict) else {}
        description = info.get("description") if isinstance(info, dict) else None
        return str(description) if description else None

    def publish_dataset(
        self,
        folder: Path,
        ref: str,
        title: str,
        description: str = "",
        *,
        dir_mode: str = "skip",
        notes: str = "uploaded by nbresume commit",
        fix: str = _WHEEL_DATASET_FIX,
    ) -> str:
        """Upload the files of ``folder`` as a new version of the private dataset ``ref``
        (made by the first upload), with ``description``; return the dataset's URL.
        ``dataset-metadata.json`` is written into ``folder``. ``dir_mode="tar"`` uploads each
        sub-folder as an archive that Kaggle unpacks into the dataset, keeping its layout;
        ``fix`` is said when Kaggle refuses the upload."""
        import json

        document = {"id": ref, "title": title, "licenses": [{"name": "other"}]}
        if description:
            document["description"] = description
        (folder / "dataset-metadata.json").write_text(json.dumps(document), encoding="utf-8")
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                try:
                    self.api.dataset_status(ref)
                    exists = True
                except Exception as exc:
                    if not _is_not_found(exc):
                        raise
                    exists = False
                if exists:
                    response = self.api.dataset_create_version(
                        str(folder), notes, quiet=True, dir_mode=dir_mode
                    )
                else:
                    response = self.api.dataset_create_new(
                        str(folder), public=False, quiet=True, dir_mode=dir_mode
                    )
        except ValueError as exc:
            raise KaggleError(
                f"the kaggle client refused the dataset {ref}: {exc}", where=str(folder)
            ) from None
        except Exception as exc:
            raise self._translate(exc, f"uploading the dataset {ref}") from None
        if response is None or response.error:
            error = response.error if response is not None else "no answer"
            raise KaggleError(f"Kaggle refused the dataset {ref}: {error}", fix=fix)
        self._wait_dataset_ready(ref)
        return str(response.url or "")

    def _wait_dataset_ready(self, ref: str) -> None:
        """Kaggle processes an upload before a notebook can attach it: wait until the
        dataset's status is ``ready`` (``KaggleError`` after :data:`DATASET_READY_S`)."""
        import time

        deadline = time.monotonic() + DATASET_READY_S
        status = ""
        while True:
            try:
                with contextlib.redirect_stdout(io.StringIO()):
                    status = str(self.api.dataset_status(ref) or "").lower()
            except Exception as exc:
                raise self._translate(exc, f"asking for the dataset {ref}") from None
            if status == "ready":
                return
            if status in ("failed", "deleted") or time.monotonic() >= deadline:
                raise KaggleError(
                    f"the dataset {ref} is {status or 'not ready'} after the upload",
                    fix=f"check it at kaggle.com/datasets/{ref}, then commit again",
                )
            time.sleep(DATASET_POLL_S)

    def status(self, ref: str) -> SessionStatus:
        """The state of the latest version of ``ref``."""
        from kagglesdk.kernels.types.kernels_api_service import (
            ApiGetKernelSessionStatusRequest,
        )

        owner, slug = parse_ref(ref)
        request = ApiGetKernelSessionStatusRequest()
        request.user_name = owner
        request.kernel_slug = slug
        response = self._call("get_kernel_session_status", request, ref)
        status = response.status
        return SessionStatus(
            ref=ref,
            status=str(getattr(status, "name", status)),
            failure=str(response.failure_message or ""),
        )

    def output_files(self, ref: str) -> tuple[list[OutputFile], str]:
        """Every file of the latest version's output, and its log."""
        from kagglesdk.kernels.types.kernels_api_service import (
            ApiListKernelSessionOutputRequest,
        )

        owner, slug = parse_ref(ref)
        files: list[OutputFile] = []
        log = ""
        token: str | None = None
        for _ in range(MAX_PAGES):
            request = ApiListKernelSessionOutputRequest()
            request.user_name = owner
            request.kernel_slug = slug
            request.page_size = PAGE_SIZE
            if token:
                request.page_token = token
            response = self._call("list_kernel_session_output", request, ref)
            files += [
                OutputFile(str(f.file_name or ""), str(f.url or "")) for f in response.files or []
            ]
            log = log or str(response.log or "")
            token = response.next_page_token
            if not token:
                return files, log
        raise KaggleError(
            f"the output of {ref} did not end after {MAX_PAGES} pages", fix="try again later"
        )

    def kernel(self, ref: str) -> KernelInfo:
        """The notebook's source and settings (``GetKernel``, as ``kaggle kernels pull``)."""
        from kagglesdk.kernels.types.kernels_api_service import ApiGetKernelRequest

        owner, slug = parse_ref(ref)
        request = ApiGetKernelRequest()
        request.user_name = owner
        request.kernel_slug = slug
        response = self._call("get_kernel", request, ref)
        meta, blob = response.metadata, response.blob
        if meta is None or blob is None or not blob.source:
            raise KaggleError(f"Kaggle sent no source for {ref}", fix="try again later")
        settings: dict[str, Any] = {
            "is_private": bool(meta.is_private) if meta.is_private is not None else True,
            "enable_gpu": bool(meta.enable_gpu),
            "enable_tpu": bool(meta.enable_tpu),
            "enable_internet": bool(meta.enable_internet),
            "machine_shape": meta.machine_shape,
            "dataset_sources": list(meta.dataset_data_sources or []),
            "competition_sources": list(meta.competition_data_sources or []),
            "kernel_sources": list(meta.kernel_data_sources or []),
            "model_sources": list(meta.model_data_sources or []),
        }
        assert set(SOURCE_KEYS) <= settings.keys()
        return KernelInfo(
            ref=ref,
            title=str(meta.title or ""),
            source=str(blob.source),
            settings=settings,
            version=meta.current_version_number,
            kernel_type=str(blob.kernel_type or meta.kernel_type or "notebook"),
        )

    def download(self, url: str, target: Path) -> int:
        """Stream ``url`` into ``target`` (through a temporary sibling); return the bytes."""
        import requests

        temp = target.with_name(f".{target.name}.nbresume-part")
        size = 0
        try:
            with requests.get(url, stream=True, timeout=TIMEOUT) as response:
                response.raise_for_status()
                with open(temp, "wb") as out:
                    for chunk in response.iter_content(DOWNLOAD_CHUNK):
                        out.write(chunk)
                        size += len(chunk)
                    out.flush()
                    os.fsync(out.fileno())
            os.replace(temp, target)
        except requests.RequestException as exc:
            temp.unlink(missing_ok=True)
            raise KaggleError(
                f"downloading {target.name} failed: {exc}",
                where=str(target),
                fix="run the pull again (files already downloaded are checked, not trusted)",
                reason="network",
            ) from None
        return size

    # -- plumbing --------------------------------------------------------------------------

    def _call(self, method: str, request: Any, ref: str) -> Any:
        try:
            with self.api.build_kaggle_client() as client:
                return getattr(client.kernels.kernels_api_client, method)(request)
        except Exception as exc:
            raise self._translate(exc, ref) from None

    def _translate(self, exc: Exception, what: str) -> KaggleError:
        import requests

        if isinstance(exc, requests.HTTPError) and exc.response is not None:
            code = exc.response.status_code
            if code in (401, 403):
                return KaggleError(
                    f"Kaggle refused access ({code}) while {what}",
                    fix="check the notebook's owner/slug, and that the credentials "
                    f"({self.user or 'none'}) may see it; " + _CREDENTIALS_FIX,
                    reason="auth",
                )
            if code == 404:
                return KaggleError(
                    f"Kaggle has no such notebook ({what})",
                    fix="check owner/slug as in kaggle.com/code/owner/slug",
                    reason="not-found",
                )
            if code == 429:
                return KaggleError(
                    f"Kaggle asks to slow down (429) while {what}",
                    fix="wait a minute and run the command again",
                    reason="network",
                )
            return KaggleError(f"Kaggle answered {code} while {what}: {exc}", fix="try again")
        if isinstance(exc, requests.RequestException):
            return KaggleError(
                f"cannot reach Kaggle while {what}: {exc}",
                fix="check the internet connection (and HTTPS_PROXY), then run the command again",
                reason="network",
            )
        return KaggleError(f"the kaggle client failed while {what}: {exc}", fix="try again")


def _is_not_found(exc: Exception) -> bool:
    response = getattr(exc, "response", None)
    return getattr(response, "status_code", None) == 404


def safe_output_path(root: Path, name: str) -> Path:
    """Where output file ``name`` goes under ``root``; :class:`KaggleError` for a name that
    would land outside it (absolute, ``..``, empty parts)."""
    pure = PurePosixPath(name)
    if (
        not name
        or "\\" in name
        or "\0" in name
        or pure.is_absolute()
        or any(part in ("", ".", "..") for part in name.split("/"))
    ):
        raise KaggleError(
            f"the output lists a file named {name!r}, which would land outside the folder",
            where=str(root),
            fix="nothing was written for it; report this notebook's output as damaged",
        )
    return root.joinpath(*pure.parts)
