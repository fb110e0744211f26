"""A fake Kaggle on loopback: the four calls of the kernels API that nbresume makes, and
machines that really run the pushed notebooks.

The real ``kaggle`` client talks to it unchanged. With ``KAGGLE_API_ENVIRONMENT=LOCALHOST``
the client sends every call to ``http://localhost/api/v1/kernels.KernelsApiService/<Method>``
(kagglesdk's ``KaggleEnv.LOCAL``; ``KaggleApi`` reads the variable when the module is imported
and passes ``--local`` to its client builder); with ``HTTP_PROXY`` naming this server the
requests arrive here whatever port localhost would be, in absolute form. ``HTTPS_PROXY``
names it too, so that a call meant for production (``https://api.kaggle.com``) would arrive
as a ``CONNECT`` that is refused and recorded as a violation rather than leave the machine.
(``KAGGLE_API_ENVIRONMENT=TEST`` would not do: ``KaggleApi`` passes an explicit environment
to ``KaggleClient`` and ignores it.)

Calls (POST, camelCase JSON, HTTP Basic auth with the test user's key):

- ``SaveKernel``: a new version; refused with Kaggle's ``error`` field for a notebook of
  another owner ("Notebook not found"), a used-up GPU quota, or too many GPU sessions.
- ``GetKernelSessionStatus``: QUEUED, RUNNING, COMPLETE or ERROR (with ``failureMessage``).
- ``ListKernelSessionOutput``: the files of ``/kaggle/working``, paged, each with a URL that
  a plain GET downloads, and the log.
- ``GetKernel``: the source and settings of the latest version.

A version runs in a folder laid out like a Kaggle machine (``kaggle/working``,
``kaggle/input``, ``kaggle/temp``; ``NBRESUME_KAGGLE_ROOT`` points nbresume at it), as a
batch run (``KAGGLE_KERNEL_RUN_TYPE=Batch``), executed by papermill with the notebook's own
kernelspec. Attached notebooks (``kernelDataSources``) are the latest complete version's
output, copied read-only under ``input/notebooks/<owner>/<slug>/``; attached datasets
(``datasetDataSources``) are their latest version under ``input/<slug>/``, an uploaded archive
unpacked into a folder of its name, as Kaggle's backend does. The session limit
(``sessionTimeoutSeconds``, else :attr:`FakeKaggle.session_limit_s`) is enforced by killing
the run, and told to nbresume as the platform cap (``NBRESUME_SESSION_CAP``), as the real
cap is known on Kaggle, so that ``deadline="auto"`` stops before it. Internet on or off is
what nbresume's internet probe sees (a loopback port that accepts, or one that refuses).
"""

from __future__ import annotations

import base64
import contextlib
import io
import json
import os
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tarfile
import threading
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote, urlsplit

KERNELS_SERVICE = "kernels.KernelsApiService"
DATASETS_SERVICE = "datasets.DatasetApiService"
BLOBS_SERVICE = "blobs.BlobApiService"
SERVICES = (KERNELS_SERVICE, DATASETS_SERVICE, BLOBS_SERVICE)
LOOPBACK_HOSTS = {"localhost", "127.0.0.1", "::1", "[::1]"}


@dataclass
class Recorded:
    """One request as it arrived: method, request target, Host header, path, JSON body."""

    method: str
    target: str
    host: str
    path: str
    body: Any = None

    @property
    def target_host(self) -> str:
        """The host the client meant: from an absolute-form target, else the Host header."""
        parts = urlsplit(self.target)
        if parts.scheme:
            return parts.hostname or ""
        return self.host.rsplit(":", 1)[0].strip("[]") if self.host else ""


@dataclass
class Version:
    """One pushed version of a notebook and its run."""

    number: int
    text: str
    settings: dict[str, Any]
    machine: Path
    limit_s: float
    status: str = "QUEUED"
    failure: str = ""
    log: str = ""
    process: subprocess.Popen[bytes] | None = None
    finished: threading.Event = field(default_factory=threading.Event)

    @property
    def working(self) -> Path:
        return self.machine / "kaggle" / "working"


@dataclass
class Dataset:
    """A dataset: each version is its files, by name."""

    owner: str
    slug: str
    title: str
    private: bool
    versions: list[dict[str, bytes]] = field(default_factory=list)
    description: str = ""


@dataclass
class Kernel:
    owner: str
    slug: str
    title: str
    versions: list[Version] = field(default_factory=list)

    def latest(self, status: str | None = None) -> Version | None:
        for version in reversed(self.versions):
            if status is None or version.status == status:
                return version
        return None


class FakeKaggle:
    """The server and its machines (see the module docstring)."""

    def __init__(self, root: Path, *, username: str = "nbresume-tester") -> None:
        self.root = root
        self.username = username
        self.key = secrets.token_hex(16)  # made at run time: nothing key-shaped in the repo
        self.requests: list[Recorded] = []
        self.violations: list[str] = []
        self.kernels: dict[tuple[str, str], Kernel] = {}
        self.session_limit_s = 600.0
        self.gpu_quota_used_up = False
        self.max_gpu_sessions = 2
        #: GPU sessions already running elsewhere on the account.
        self.busy_gpu_sessions = 0
        #: Environment added to every run (a test's own knobs).
        self.run_env: dict[str, str] = {}
        #: False: versions are accepted and stay QUEUED (tests of the push alone).
        self.execute = True
        #: Entries added to every output listing (a damaged or hostile output).
        self.extra_listing: list[dict[str, str]] = []
        self.sitecustomize_dir: Path | None = None
        #: False: the machines' Python has no nbresume (a notebook must install it).
        self.image_has_nbresume = True
        self.datasets: dict[tuple[str, str], Dataset] = {}
        #: Uploads started (StartBlobUpload): token -> (file name, bytes once PUT).
        self.blobs: dict[str, tuple[str, bytes | None]] = {}
        self._lock = threading.Lock()
        self._refusing = socket.socket()  # a bound port that is not listening: refuses
        self._refusing.bind(("127.0.0.1", 0))
        self.refusing_port = int(self._refusing.getsockname()[1])
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler_for(self))
        self.httpd.daemon_threads = True
        self.port = int(self.httpd.server_address[1])
        # stop() waits for the loop's next poll: the default half second, at every stop.
        self._thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True)

    # -- lifetime --------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> FakeKaggle:
        self._thread.start()
        return self

    def stop(self) -> None:
        for kernel in list(self.kernels.values()):
            for version in kernel.versions:
                _kill(version.process)
        for kernel in list(self.kernels.values()):
            for version in kernel.versions:
                version.finished.wait(30)
        self.httpd.shutdown()
        self.httpd.server_close()
        self._refusing.close()

    def client_env(self, config_dir: Path) -> dict[str, str]:
        """The environment that points the real kaggle client here, with the test user's
        credentials and no other configuration."""
        return {
            "KAGGLE_API_ENVIRONMENT": "LOCALHOST",
            "HTTP_PROXY": self.url,
            "HTTPS_PROXY": self.url,
            "http_proxy": self.url,
            "https_proxy": self.url,
            "KAGGLE_USERNAME": self.username,
            "KAGGLE_KEY": self.key,
            "KAGGLE_CONFIG_DIR": str(config_dir),
        }

    # -- state -----------------------------------------------------------------------------

    def kernel(self, ref: str) -> Kernel:
        owner, slug = ref.split("/")
        return self.kernels[(owner, slug)]

    def wait_idle(self, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        for kernel in list(self.kernels.values()):
            for version in kernel.versions:
                version.finished.wait(max(0.0, deadline - time.monotonic()))

    def api_calls(self, service: str = KERNELS_SERVICE) -> list[str]:
        """The methods of ``service`` (the kernels API by default) called, in order."""
        return [
            r.path.rsplit("/", 1)[-1]
            for r in self.requests
            if r.method == "POST" and service in r.path
        ]

    # -- the calls -------------------------------------------------------------------------

    def call(self, method: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        handler = getattr(self, f"_call_{method}", None)
        if handler is None:
            return 404, {"code": 404, "message": f"no method {method} in this fake"}
        with self._lock:
            result: tuple[int, dict[str, Any]] = handler(body)
        return result

    def _call_SaveKernel(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        owner, _, slug = str(body.get("slug", "")).partition("/")
        if owner != self.username:
            return 200, {"error": "Notebook not found"}
        if body.get("kernelType") not in ("notebook", "script") or body.get("language") != (
            "python"
        ):
            return 200, {"error": "Only python notebooks and scripts are run by this fake"}
        gpu = bool(body.get("enableGpu"))
        if gpu and self.gpu_quota_used_up:
            return 200, {
                "error": "You have exceeded your weekly GPU quota. It resets in 2 days; "
                "you can commit without a GPU."
            }
        running_gpu = self.busy_gpu_sessions + sum(
            1
            for k in self.kernels.values()
            for v in k.versions
            if v.status in ("QUEUED", "RUNNING") and v.settings.get("enableGpu")
        )
        if gpu and running_gpu >= self.max_gpu_sessions:
            return 200, {
                "error": f"Maximum batch GPU session count of {self.max_gpu_sessions} reached."
            }
        sources = list(body.get("kernelDataSources") or [])
        attach: list[tuple[str, Version]] = []
        invalid = []
        for source in sources:
            source_owner, _, source_slug = source.partition("/")
            found = self.kernels.get((source_owner, source_slug))
            done = found.latest("COMPLETE") if found else None
            if done is None:
                invalid.append(source)
            else:
                attach.append((source, done))
        datasets: list[tuple[str, Dataset]] = []
        invalid_datasets = []
        for source in body.get("datasetDataSources") or []:
            found_set = self.datasets.get(tuple(str(source).partition("/")[::2]))  # type: ignore[arg-type]
            if found_set is None or not found_set.versions:
                invalid_datasets.append(source)
            else:
                datasets.append((source, found_set))
        kernel = self.kernels.get((owner, slug))
        if kernel is None:
            kernel = Kernel(owner, slug, str(body.get("newTitle") or slug))
            self.kernels[(owner, slug)] = kernel
        number = len(kernel.versions) + 1
        limit = float(body.get("sessionTimeoutSeconds") or self.session_limit_s)
        machine = self.root / "machines" / f"{owner}-{slug}-v{number}"
        version = Version(number, str(body.get("text", "")), dict(body), machine, limit)
        kernel.versions.append(version)
        self._prepare_machine(version, attach, datasets)
        if self.execute:
            threading.Thread(target=self._run, args=(version,), daemon=True).start()
        else:
            version.finished.set()
        return 200, {
            "ref": f"/code/{owner}/{slug}",
            "url": f"http://localhost/code/{owner}/{slug}?version={number}",
            "versionNumber": number,
            "invalidKernelSources": invalid,
            "invalidDatasetSources": invalid_datasets,
        }

    def _find(self, body: dict[str, Any]) -> Kernel | None:
        return self.kernels.get((str(body.get("userName")), str(body.get("kernelSlug"))))

    def _call_GetKernelSessionStatus(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        kernel = self._find(body)
        version = kernel.latest() if kernel else None
        if version is None:
            return 404, {"code": 404, "message": "Notebook not found"}
        answer: dict[str, Any] = {"status": version.status}
        if version.failure:
            answer["failureMessage"] = version.failure
        return 200, answer

    def _call_ListKernelSessionOutput(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        kernel = self._find(body)
        version = None
        if kernel is not None:
            version = next((v for v in reversed(kernel.versions) if v.finished.is_set()), None)
        if kernel is None or version is None:
            return 404, {"code": 404, "message": "Notebook not found"}
        names = sorted(
            p.relative_to(version.working).as_posix()
            for p in version.working.rglob("*")
            if p.is_file()
        )
        size = int(body.get("pageSize") or 20)
        start = int(body.get("pageToken") or 0)
        page = names[start : start + size]
        files = [
            {
                "fileName": name,
                "url": f"{self.url}/files/{kernel.owner}/{kernel.slug}/{version.number}/"
                + quote(name),
            }
            for name in page
        ]
        if start == 0:
            files += self.extra_listing
        answer: dict[str, Any] = {"files": files, "log": version.log}
        if start + size < len(names):
            answer["nextPageToken"] = str(start + size)
        return 200, answer

    def _call_GetKernel(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        kernel = self._find(body)
        version = kernel.latest() if kernel else None
        if kernel is None or version is None:
            return 404, {"code": 404, "message": "Notebook not found"}
        s = version.settings
        metadata = {
            "id": hash((kernel.owner, kernel.slug)) & 0xFFFFFF,
            "ref": f"{kernel.owner}/{kernel.slug}",
            "title": kernel.title,
            "author": kernel.owner,
            "slug": kernel.slug,
            "language": "python",
            "kernelType": "notebook",
            "isPrivate": s.get("isPrivate", True),
            "enableGpu": s.get("enableGpu", False),
            "enableTpu": s.get("enableTpu", False),
            "enableInternet": s.get("enableInternet", True),
            "machineShape": s.get("machineShape"),
            "datasetDataSources": s.get("datasetDataSources") or [],
            "kernelDataSources": s.get("kernelDataSources") or [],
            "competitionDataSources": s.get("competitionDataSources") or [],
            "modelDataSources": s.get("modelDataSources") or [],
            "currentVersionNumber": version.number,
        }
        metadata["kernelType"] = s.get("kernelType", "notebook")
        blob = {"source": version.text, "language": "python", "kernelType": metadata["kernelType"]}
        return 200, {"metadata": metadata, "blob": blob}

    # -- datasets and uploads (what `kaggle datasets create/version` calls) ------------------

    def _call_GetDatasetStatus(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        key = (str(body.get("ownerSlug")), str(body.get("datasetSlug")))
        if key not in self.datasets:
            return 404, {"code": 404, "message": "Dataset not found"}
        return 200, {"status": "ready"}

    def _call_GetDatasetMetadata(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        dataset = self.datasets.get((str(body.get("ownerSlug")), str(body.get("datasetSlug"))))
        if dataset is None:
            return 404, {"code": 404, "message": "Dataset not found"}
        info = {
            "ownerUser": dataset.owner,
            "datasetSlug": dataset.slug,
            "title": dataset.title,
            "isPrivate": dataset.private,
            "description": dataset.description,
        }
        return 200, {"info": info}

    def _call_StartBlobUpload(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        token = secrets.token_hex(8)
        self.blobs[token] = (str(body.get("name", "")), None)
        return 200, {"token": token, "createUrl": f"{self.url}/upload/{token}"}

    def _files(self, files: list[dict[str, Any]]) -> dict[str, bytes] | None:
        stored = {}
        for item in files:
            name, data = self.blobs.get(str(item.get("token")), ("", None))
            if data is None:
                return None
            stored[name] = data
        return stored

    def _call_CreateDataset(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        owner, slug = str(body.get("ownerSlug")), str(body.get("slug"))
        if owner != self.username:
            return 200, {"status": "error", "error": "You cannot create a dataset for another user"}
        if (owner, slug) in self.datasets:
            return 200, {"status": "error", "error": "The dataset already exists"}
        files = self._files(list(body.get("files") or []))
        if not files:
            return 200, {"status": "error", "error": "No files were uploaded"}
        dataset = Dataset(owner, slug, str(body.get("title")), bool(body.get("isPrivate")))
        dataset.description = str(body.get("description") or "")
        dataset.versions.append(files)
        self.datasets[(owner, slug)] = dataset
        return 200, {"status": "ok", "ref": f"{owner}/{slug}", "url": self._dataset_url(dataset)}

    def _call_CreateDatasetVersion(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        dataset = self.datasets.get((str(body.get("ownerSlug")), str(body.get("datasetSlug"))))
        if dataset is None:
            return 404, {"code": 404, "message": "Dataset not found"}
        files = self._files(list((body.get("body") or {}).get("files") or []))
        if not files:
            return 200, {"status": "error", "error": "No files were uploaded"}
        dataset.versions.append(files)
        description = (body.get("body") or {}).get("description")
        if description is not None:  # a version may change the description, or keep it
            dataset.description = str(description)
        return 200, {
            "status": "ok",
            "ref": f"{dataset.owner}/{dataset.slug}",
            "url": self._dataset_url(dataset),
        }

    def _dataset_url(self, dataset: Dataset) -> str:
        return f"http://localhost/datasets/{dataset.owner}/{dataset.slug}"

    def upload(self, token: str, data: bytes) -> bool:
        if token not in self.blobs:
            return False
        self.blobs[token] = (self.blobs[token][0], data)
        return True

    # -- the machines ----------------------------------------------------------------------

    def _prepare_machine(
        self,
        version: Version,
        attach: list[tuple[str, Version]],
        datasets: list[tuple[str, Dataset]],
    ) -> None:
        kaggle = version.machine / "kaggle"
        for sub in ("working", "input", "temp"):
            (kaggle / sub).mkdir(parents=True, exist_ok=True)
        for source, done in attach:
            owner, _, slug = source.partition("/")
            target = kaggle / "input" / "notebooks" / owner / slug
            shutil.copytree(done.working, target)
            _read_only(target)
        for _, dataset in datasets:
            # A dataset's latest version, at /kaggle/input/<slug>/.
            target = kaggle / "input" / dataset.slug
            target.mkdir(parents=True)
            for name, data in dataset.versions[-1].items():
                _unpack_into(target, name, data)
            _read_only(target)
        (version.machine / "home").mkdir(exist_ok=True)
        source_name = "__script__.py" if self._is_script(version) else "__notebook_source__.ipynb"
        (version.machine / source_name).write_text(version.text)

    @staticmethod
    def _is_script(version: Version) -> bool:
        return version.settings.get("kernelType") == "script"

    def _environment(self, version: Version) -> dict[str, str]:
        internet = bool(version.settings.get("enableInternet", True))
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(version.machine / "home"),
            "LANG": "C.UTF-8",
            "KAGGLE_KERNEL_RUN_TYPE": "Batch",
            "KAGGLE_URL_BASE": "http://localhost",
            "NBRESUME_KAGGLE_ROOT": str(version.machine / "kaggle"),
            "NBRESUME_SESSION_CAP": f"{version.limit_s:g}s",
            "NBRESUME_PROBE_HOST": "127.0.0.1",
            "NBRESUME_PROBE_PORT": str(self.port if internet else self.refusing_port),
            "NBRESUME_PROBE_TIMEOUT": "1.0",
            "NBRESUME_CGROUP_ROOT": str(version.machine / "no-cgroup"),
            "NBRESUME_MOUNTINFO": str(version.machine / "no-mountinfo"),
            "NBRESUME_COLAB_MARKER": str(version.machine / "no-colab-marker"),
            "CUDA_VISIBLE_DEVICES": "",
            "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": "1",
            # The machine's own /tmp: what a run cut by the session cap leaves there (the
            # kernel's connection file papermill made) goes with the test's folder.
            "TMPDIR": str(version.machine / "tmp"),
        }
        (version.machine / "tmp").mkdir(parents=True, exist_ok=True)
        paths = [str(self.sitecustomize_dir)] if self.sitecustomize_dir is not None else []
        if self.sitecustomize_dir is not None:
            for name in ("NBRESUME_TEST_NET_LOG",):
                if name in os.environ:
                    env[name] = os.environ[name]
        if not self.image_has_nbresume:
            # The image has no nbresume (netguard's sitecustomize hides the development copy);
            # pip installs into this machine's own folder, never into the tests' environment.
            site = version.machine / "site-packages"
            site.mkdir(exist_ok=True)
            env["NBRESUME_TEST_HIDE_NBRESUME"] = "1"
            env["PIP_TARGET"] = str(site)
            env["PIP_NO_CACHE_DIR"] = "1"
            env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
            paths.append(str(site))
        if paths:
            env["PYTHONPATH"] = os.pathsep.join(paths)
        env.update(self.run_env)
        return env

    def _run(self, version: Version) -> None:
        """Run the version as Kaggle's batch runner does: papermill, the notebook's kernel."""
        working = version.working
        log_path = version.machine / "run.log"
        # The session clock starts as the notebook's kernel starts (papermill imported).
        script = (
            "import os, sys, time, papermill\n"
            "os.environ['NBRESUME_SESSION_START'] = str(time.time())\n"
            "papermill.execute_notebook(sys.argv[1], sys.argv[2], cwd=sys.argv[3], "
            "progress_bar=False)\n"
        )
        if self._is_script(version):
            # A script kernel: `python script.py` in /kaggle/working.
            script = (
                "import os, runpy, sys, time\n"
                "os.environ['NBRESUME_SESSION_START'] = str(time.time())\n"
                "sys.argv = sys.argv[1:2]\n"
                "runpy.run_path(sys.argv[0], run_name='__main__')\n"
            )
        with open(log_path, "wb") as log:
            version.status = "RUNNING"
            version.process = subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    script,
                    str(
                        version.machine
                        / (
                            "__script__.py"
                            if self._is_script(version)
                            else "__notebook_source__.ipynb"
                        )
                    ),
                    str(version.machine / "__notebook__.ipynb"),
                    str(working),
                ],
                cwd=working,
                env=self._environment(version),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            try:
                code = version.process.wait(timeout=version.limit_s)
                timed_out = False
            except subprocess.TimeoutExpired:
                _kill(version.process)
                code = version.process.wait()
                timed_out = True
        version.log = log_path.read_text(errors="replace")
        if timed_out:
            version.status = "ERROR"
            version.failure = (
                f"The session ran past its limit of {version.limit_s:g} seconds and was stopped."
            )
        elif code != 0:
            version.status = "ERROR"
            lines = [line for line in version.log.splitlines() if line.strip()]
            version.failure = lines[-1] if lines else f"exit status {code}"
        else:
            version.status = "COMPLETE"
        version.finished.set()


def _unpack_into(target: Path, name: str, data: bytes) -> None:
    """A dataset file as a notebook sees it: an archive (the client's upload of a folder,
    ``--dir-mode zip|tar``) unpacked by Kaggle into a folder of its name, any other file as
    it is."""
    stem, dot, kind = name.rpartition(".")
    if dot and kind in ("zip", "tar"):
        folder = target / stem
        folder.mkdir()
        if kind == "zip":
            with zipfile.ZipFile(io.BytesIO(data)) as archive:
                archive.extractall(folder)
        else:
            with tarfile.open(fileobj=io.BytesIO(data)) as archive:
                archive.extractall(folder, filter="data")
        return
    (target / name).write_bytes(data)


def _kill(process: subprocess.Popen[bytes] | None) -> None:
    if process is not None and process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)


def _read_only(folder: Path) -> None:
    for path in sorted(folder.rglob("*"), reverse=True):
        path.chmod(stat.S_IMODE(path.stat().st_mode) & ~0o222)
    folder.chmod(stat.S_IMODE(folder.stat().st_mode) & ~0o222)


@contextlib.contextmanager
def serving(folder: Path, sitecustomize_dir: Path, **options: Any) -> Iterator[FakeKaggle]:
    """A started :class:`FakeKaggle` keeping its files in ``folder``, its machines' Python
    importing ``sitecustomize_dir`` first; afterwards, every request it saw must have been
    meant for localhost."""
    server = FakeKaggle(folder, **options)
    server.sitecustomize_dir = sitecustomize_dir
    server.start()
    try:
        yield server
    finally:
        server.stop()
        if folder.exists():
            make_writable(folder)
    assert server.violations == [], f"requests not meant for loopback: {server.violations}"


def make_writable(folder: Path) -> None:
    """Undo the read-only inputs so a temporary folder can be removed."""
    for path in folder.rglob("*"):
        if not path.is_symlink():
            path.chmod(stat.S_IMODE(path.stat().st_mode) | 0o700)


def _handler_for(server: FakeKaggle) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        # Headers and body leave in two writes: with Nagle's algorithm the body waits for the
        # client's delayed ACK of the headers (some 40 ms a request on Linux).
        disable_nagle_algorithm = True

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def _record(self, body: Any = None) -> Recorded:
            path = urlsplit(self.path).path if "://" in self.path else self.path.split("?")[0]
            record = Recorded(self.command, self.path, self.headers.get("Host", ""), path, body)
            server.requests.append(record)
            if record.target_host not in LOOPBACK_HOSTS:
                server.violations.append(f"{self.command} {self.path} (Host {record.host})")
            return record

        def _send(self, code: int, payload: Any, content_type: str = "application/json") -> None:
            data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_CONNECT(self) -> None:
            # A tunnel request: an https call, which no test may make.
            server.requests.append(Recorded("CONNECT", self.path, self.path, self.path))
            server.violations.append(f"CONNECT {self.path}")
            self._send(403, {"code": 403, "message": "no tunnels: tests stay on loopback"})

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            try:
                body = json.loads(raw or b"{}")
            except ValueError:
                body = None
            record = self._record(body)
            if not self._authorized():
                self._send(401, {"code": 401, "message": "Unauthenticated"})
                return
            prefix, _, method = record.path.rpartition("/")
            known = any(prefix.endswith(f"/v1/{service}") for service in SERVICES)
            if not known or not isinstance(body, dict):
                self._send(404, {"code": 404, "message": f"unknown call {record.path}"})
                return
            code, answer = server.call(method, body)
            self._send(code, answer)

        def do_PUT(self) -> None:
            # An upload to a StartBlobUpload URL: /upload/<token>.
            length = int(self.headers.get("Content-Length") or 0)
            data = self.rfile.read(length) if length else b""
            record = self._record()
            token = record.path.rpartition("/upload/")[2]
            if not record.path.startswith("/upload/") or not server.upload(token, data):
                self._send(404, {"code": 404, "message": "no such upload"})
                return
            self._send(200, {})

        def do_GET(self) -> None:
            record = self._record()
            parts = record.path.split("/", 5)
            # /files/<owner>/<slug>/<version>/<name>
            if len(parts) < 6 or parts[1] != "files":
                self._send(404, {"code": 404, "message": "not found"})
                return
            owner, slug, number, name = parts[2], parts[3], parts[4], unquote(parts[5])
            kernel = server.kernels.get((owner, slug))
            versions = [v for v in kernel.versions if str(v.number) == number] if kernel else []
            if not versions:
                self._send(404, {"code": 404, "message": "no such version"})
                return
            working = versions[0].working.resolve()
            target = (working / name).resolve()
            if not target.is_relative_to(working) or not target.is_file():
                self._send(404, {"code": 404, "message": "no such file"})
                return
            self._send(200, target.read_bytes(), "application/octet-stream")

        def _authorized(self) -> bool:
            header = self.headers.get("Authorization", "")
            if not header.startswith("Basic "):
                return False
            try:
                user, _, key = base64.b64decode(header[6:]).decode().partition(":")
            except ValueError:
                return False
            return user == server.username and key == server.key

    return Handler
