"""Fixtures of the storage contract: every backend, and the S3 server they run against.

Each test of ``test_store_contract.py`` runs once per backend: a local path, a ``file://``
URL, ``memory://``, ``s3://`` through s3fs against moto's real S3 API server on loopback, and
a folder on Google Drive's mount, through the Colab stand-in (its DriveFS uploading to a
simulated Drive, asked through the real Drive API client against its server on loopback).
A backend is nothing more than a :class:`~.backends.Backend` built here.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec
import pytest

from testkit.backends import FAKE_AWS_ENV, Backend, loopback_only, start_moto_server

BACKENDS = ["local", "file", "memory", "s3", "drive"]


@pytest.fixture(autouse=True)
def network_refusals() -> Iterator[list[str]]:
    """No contract test may open a connection that leaves this machine."""
    with loopback_only() as refused:
        yield refused
    assert not refused, f"a test tried to leave loopback: {refused}"


@dataclass(frozen=True)
class S3Server:
    endpoint: str
    #: The environment of every S3 client here (None: unset).
    env: dict[str, str | None]
    #: What a user passes as ``storage_options`` to reach it.
    options: dict[str, Any]
    #: A client of its own, for raw access (shares no cache with the stores under test).
    raw: Any


def _set_env(monkeypatch: pytest.MonkeyPatch, env: dict[str, str | None]) -> None:
    for name, value in env.items():
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """moto's S3 server, started once for the whole test run."""
    import s3fs

    home = tmp_path_factory.mktemp("moto")
    server, endpoint = start_moto_server(home / "server.log")
    # Every S3 client (those of the command line too, which takes no storage options) is
    # pointed at the loopback server, with fake credentials and no profile files: nothing a
    # developer has configured can send a request to real AWS.
    env: dict[str, str | None] = {
        **FAKE_AWS_ENV,
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_CONFIG_FILE": str(home / "no-aws-config"),
        "AWS_SHARED_CREDENTIALS_FILE": str(home / "no-aws-credentials"),
        "AWS_ENDPOINT_URL_S3": None,
        "AWS_PROFILE": None,
        "AWS_SESSION_TOKEN": None,
        "AWS_SECURITY_TOKEN": None,
    }
    options = {
        "endpoint_url": endpoint,
        "key": FAKE_AWS_ENV["AWS_ACCESS_KEY_ID"],
        "secret": FAKE_AWS_ENV["AWS_SECRET_ACCESS_KEY"],
    }
    # Cached S3 file systems may have been made under another environment.
    s3fs.S3FileSystem.clear_instance_cache()
    with pytest.MonkeyPatch.context() as monkeypatch:
        _set_env(monkeypatch, env)
        raw = s3fs.S3FileSystem(skip_instance_cache=True, **options)
        raw.connect()  # the client is made now, under this environment
    try:
        yield S3Server(endpoint, env, options, raw)
    finally:
        s3fs.S3FileSystem.clear_instance_cache()
        server.terminate()
        server.wait(timeout=30)


@pytest.fixture(params=BACKENDS)
def backend(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Backend]:
    """One place for checkpoints, fresh for each test."""
    kind: str = request.param
    if kind == "local":
        root = tmp_path / "checkpoints"
        yield Backend(
            "local",
            str(root),
            fsspec.filesystem("file", auto_mkdir=True),
            str(root),
            object_store=False,
        )
    elif kind == "file":
        root = tmp_path / "checkpoints"
        yield Backend(
            "file",
            root.as_uri(),
            fsspec.filesystem("file", auto_mkdir=True),
            str(root),
            object_store=False,
        )
    elif kind == "memory":
        name = f"nbresume-contract/{uuid.uuid4().hex}"
        fs = fsspec.filesystem("memory")
        yield Backend(
            "memory",
            f"memory://{name}",
            fs,
            f"/{name}",
            object_store=True,
            shared_across_processes=False,
        )
        # memory:// is one store for the whole process: leave nothing behind.
        if fs.exists(f"/{name}"):
            fs.rm(f"/{name}", recursive=True)
        assert not fs.exists(f"/{name}")
    elif kind == "drive":
        yield from drive_backend(tmp_path, monkeypatch)
    else:
        server: S3Server = request.getfixturevalue("s3_server")
        _set_env(monkeypatch, server.env)
        bucket = f"nbresume-{uuid.uuid4().hex[:20]}"
        server.raw.mkdir(bucket)
        backend = Backend(
            "s3",
            f"s3://{bucket}/run",
            server.raw,
            f"{bucket}/run",
            object_store=True,
            storage_options=server.options,
            reports_md5=True,
            endpoint=server.endpoint,
        )
        assert backend.endpoint_of(server.raw) == server.endpoint
        store_fs = backend.open().backend.fs  # type: ignore[attr-defined]
        assert backend.endpoint_of(store_fs) == server.endpoint
        yield backend
        server.raw.rm(bucket, recursive=True)


def drive_backend(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Backend]:
    """A folder on a mounted Google Drive: the stand-in's DriveFS (in this process) uploads to
    a simulated Drive, which the real Drive API client asks through the stand-in's server.

    This process never imports ``google.colab`` (that would make every later test here look
    like Colab): the Drive API client is built here, with the stand-in's access token. Another
    process (``other_process.py``) authorises the way Colab does, through the stand-in's
    ``google.colab.auth``, which finds the credentials written here.
    """
    pytest.importorskip("googleapiclient", reason="needs google-api-python-client (test extra)")
    standin = pytest.importorskip("colab_standin", reason="needs the google.colab stand-in")
    from google.oauth2.credentials import Credentials
    from googleapiclient.discovery import build

    from nbresume.checkpoint.backends.drive import DriveApi

    cloud_root = tmp_path / "cloud"
    cloud = standin.Cloud(cloud_root)
    server = standin.DriveServer(str(cloud_root)).start()
    adc = tmp_path / "adc.json"
    adc.write_text(json.dumps({
        "type": "authorized_user", "client_id": "standin.apps.googleusercontent.com",
        "client_secret": "standin-secret", "refresh_token": "standin-refresh-token",
        "token": cloud.access_token, "expiry": "2099-01-01T00:00:00Z",
    }))  # fmt: skip
    for name, value in {
        "COLAB_STANDIN_ROOT": str(cloud_root),
        "COLAB_STANDIN_API_URL": server.url,
        "COLAB_STANDIN_UPLOAD_LAG_S": "0.05",
        "GOOGLE_APPLICATION_CREDENTIALS": str(adc),
        "NBRESUME_DRIVE_API_URL": server.url,
        "NBRESUME_DRIVE_MOUNT": str(tmp_path / "drive"),
        "NBRESUME_DRIVE_POLL_S": "0.1",
    }.items():
        monkeypatch.setenv(name, value)
    service = build(
        "drive",
        "v3",
        credentials=Credentials(cloud.access_token),
        static_discovery=True,
        cache_discovery=False,
        client_options={"api_endpoint": server.url.rstrip("/") + "/drive/v3/"},
    )
    monkeypatch.setattr(DriveApi, "_shared", DriveApi(service))
    mount = standin.drivefs.Mount(tmp_path / "drive", cloud_root)
    mount.start()
    root = mount.cache / "run"
    try:
        yield Backend(
            "drive",
            str(root),
            fsspec.filesystem("file", auto_mkdir=True),
            str(root),
            object_store=False,
            records_md5=True,
        )
    finally:
        mount.stop()
        server.stop()
        cloud.close()
