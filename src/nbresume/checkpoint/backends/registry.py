"""Which backend holds a location: a lazy registry, in the style of fsspec's ``registry.py``.

Protocol: :data:`known_backends` maps a kind to the dotted name of a
:class:`~nbresume.checkpoint.backends.base.Backend` class and the hint shown when that class
cannot be imported. Nothing is imported until a location of that kind is opened, so
``import nbresume`` pulls in no backend. :func:`backend_kind` names the kind of a location: a
folder inside the mounted Google Drive is ``"drive"``, any other local folder (or a ``file://``
URL) ``"local"``; a URL is the kind registered for its scheme, else ``"fsspec"``.
:func:`register_backend` adds a kind; :func:`open_store` checks a location and opens its
backend through :meth:`Backend.from_location`.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Mapping
from typing import Any

from nbresume import knobs
from nbresume.checkpoint.arguments import kind, refused
from nbresume.checkpoint.backends.base import Backend
from nbresume.errors import UsageError

#: kind -> {"class": dotted name of the backend class, "err": what to install when it is missing}
known_backends: dict[str, dict[str, str]] = {
    "local": {"class": "nbresume.checkpoint.backends.local.LocalStore", "err": ""},
    "fsspec": {
        "class": "nbresume.checkpoint.backends.fsspec_store.FsspecStore",
        "err": "pip install fsspec",
    },
    "drive": {
        "class": "nbresume.checkpoint.backends.drive.DriveStore",
        "err": "pip install google-api-python-client (Colab ships it)",
    },
    "hf_bucket": {
        "class": "nbresume.checkpoint.backends.hf_bucket.HfBucketStore",
        "err": 'pip install "nbresume[buckets]" (huggingface_hub and hf_xet; Colab ships both)',
    },
}

#: The package behind an fsspec URL scheme, and what to install for it.
SCHEME_PACKAGES: dict[str, tuple[str, str]] = {
    "s3": ("s3fs", 'pip install "nbresume[s3]"'),
    "s3a": ("s3fs", 'pip install "nbresume[s3]"'),
    "gs": ("gcsfs", "pip install gcsfs"),
    "gcs": ("gcsfs", "pip install gcsfs"),
    "az": ("adlfs", "pip install adlfs"),
    "abfs": ("adlfs", "pip install adlfs"),
    "abfss": ("adlfs", "pip install adlfs"),
    "sftp": ("paramiko", 'pip install "nbresume[ssh]"'),
    "ssh": ("paramiko", 'pip install "nbresume[ssh]"'),
}

#: Backend classes already imported or registered as classes, by kind.
registry: dict[str, type[Backend]] = {}

#: URL schemes that name a local folder.
LOCAL_SCHEMES = ("file", "local")
#: The kinds :func:`backend_kind` picks by itself; any other registered kind is a URL scheme.
BUILTIN_KINDS = ("local", "fsspec", "drive", "hf_bucket")
#: The URL prefix of a Hugging Face Storage Bucket (other hf:// URLs are fsspec's).
BUCKET_PREFIX = "hf://buckets/"


def register_backend(
    kind: str, cls: str | type[Backend], *, clobber: bool = False, errtxt: str = ""
) -> None:
    """Add a backend for ``kind`` (a URL scheme, or a name :func:`backend_kind` returns):
    a class, or its dotted name to import on first use with ``errtxt`` as the install hint.
    An existing kind is replaced only with ``clobber=True``."""
    if (kind in registry or kind in known_backends) and not clobber:
        raise ValueError(f"a backend for {kind!r} is registered already; pass clobber=True")
    registry.pop(kind, None)
    if isinstance(cls, str):
        known_backends[kind] = {"class": cls, "err": errtxt}
    else:
        registry[kind] = cls


def get_backend_class(kind: str) -> type[Backend]:
    """The backend class of ``kind``, imported now if it was not yet."""
    if kind not in registry:
        entry = known_backends[kind]
        module_name, _, class_name = entry["class"].rpartition(".")
        try:
            cls = getattr(importlib.import_module(module_name), class_name)
        except ImportError as exc:
            hint = entry["err"] or f"install the package that provides {entry['class']}"
            raise UsageError(f"the {kind} backend cannot be loaded: {exc}", fix=hint) from None
        registry[kind] = cls
    return registry[kind]


def backend_kind(text: str) -> str:
    """The kind of backend for a checked location (see :func:`check_location`)."""
    if text.startswith(BUCKET_PREFIX):
        return "hf_bucket"
    scheme = text.split("::", 1)[0].split("://", 1)[0] if "://" in text else ""
    if not scheme or scheme in LOCAL_SCHEMES:
        return "drive" if _on_drive(_local_path(text)) else "local"
    return scheme if scheme in _registered_schemes() else "fsspec"


def _registered_schemes() -> set[str]:
    return (set(known_backends) | set(registry)) - set(BUILTIN_KINDS)


def _local_path(text: str) -> str:
    return text.split("://", 1)[1] if "://" in text else text


def _on_drive(path: str) -> bool:
    """Whether ``path`` is inside the mounted ``MyDrive``: a checkpoint there is saved only once
    Drive confirms it, even when the script never called ``nbresume.init``."""
    my_drive = knobs.drive_mount() / "MyDrive"
    real = os.path.realpath(os.path.expanduser(path))
    base = os.path.realpath(my_drive).rstrip("/") + "/"
    return (real + "/").startswith(base) and my_drive.is_dir()


def open_store(
    location: str | os.PathLike[str], *, storage_options: Mapping[str, Any] | None = None
) -> Backend:
    """The backend for a local path, a ``file://`` URL, or any other fsspec URL.

    ``storage_options`` are passed to the fsspec file system of a URL, for example
    ``{"endpoint_url": ..., "key": ..., "secret": ...}`` for ``s3://``.
    """
    text = check_location(location)
    kind = backend_kind(text)
    if kind in ("local", "drive"):
        if storage_options:
            raise UsageError(
                f"storage_options apply to fsspec URLs such as s3://, but {text} is a local folder",
                where=text,
                fix="drop storage_options, or give a URL of the store they are meant for",
            )
        return get_backend_class(kind).from_location(_local_path(text))
    try:
        return get_backend_class(kind).from_location(text, storage_options)
    except ImportError as exc:
        scheme = text.split("::", 1)[0].split("://", 1)[0]
        package, install = SCHEME_PACKAGES.get(scheme, ("", ""))
        module = exc.name or package or _protocol_module(text)
        if module and module != package:
            install = f"pip install {module}"
        raise UsageError(
            f"the file system of {text} is not installed: {exc}",
            where=text,
            fix=install or "install fsspec's package for it",
        ) from None


def check_location(location: object, call: str = "Checkpointer", argument: str = "dir") -> str:
    """``location`` as a str: a local folder or an fsspec URL of a known scheme; anything
    else (``None``, ``""``, a number, ``"nosuchscheme://x"``) raises ArgumentError."""

    fix = (
        f'{argument}="runs/exp1" (a folder, created when needed), a pathlib.Path, or a URL '
        f'such as {argument}="s3://bucket/exp1"'
    )
    if location is None:
        raise refused(call, argument, location, "a folder is needed for the checkpoints", fix)
    if not isinstance(location, (str, os.PathLike)):
        raise refused(call, argument, location, f"{kind(location)} is not a folder", fix)
    text = os.fspath(location)
    if not isinstance(text, str):
        raise refused(call, argument, location, "a path of bytes is not taken", fix)
    if not text.strip():
        # Path("") is the current folder: retention would then delete checkpoints there.
        raise refused(call, argument, location, "an empty path names no folder", fix)
    if "://" in text:
        import fsspec

        known = set(fsspec.available_protocols()) | _registered_schemes()
        for part in text.split("::"):
            scheme = part.split("://", 1)[0] if "://" in part else ""
            if scheme and scheme not in known:
                raise refused(
                    call,
                    argument,
                    location,
                    f"{scheme}:// is not a URL scheme fsspec knows",
                    f"use a local folder, or one of fsspec's schemes ({_some_schemes(known)})",
                )
    return text


def _some_schemes(known: set[str]) -> str:
    common = ["file", "memory", "s3", "gs", "az", "hf", "sftp", "http"]
    return ", ".join(f"{name}://" for name in common if name in known) + ", ..."


def _protocol_module(url: str) -> str:
    """The module that implements the scheme of ``url`` (``"s3fs"`` for ``s3://``), or ``""``."""
    from fsspec.registry import known_implementations

    scheme = url.split("::", 1)[0].split("://", 1)[0]
    entry = known_implementations.get(scheme, {})
    return str(entry.get("class", "")).split(".", 1)[0]
