"""The installed nbresume as a wheel, for Kaggle runs with internet off.

Most competitions require internet off, where ``pip install nbresume`` fails. ``nbresume
commit`` then uploads this wheel as a private dataset of the user's (``OWNER/nbresume-wheel``),
attaches it to the notebook, and the notebook's install cell installs it from
``/kaggle/input``::

    wheels = glob.glob("../input/**/nbresume-*.whl", recursive=True)  # cwd: /kaggle/working
    %pip install -q --no-index --no-deps {wheels[-1]}

The wheel is built from the nbresume that runs the command (an editable install included),
with the same bytes for the same files. Its SHA-256 goes into the dataset's description, and a
commit with internet off uploads a new version of the dataset only when that hash differs:
committing again with the same nbresume attaches the version already there. nbresume is pure
Python and needs only ``numpy`` and ``fsspec``, which Kaggle's image has: ``--no-deps``
installs it offline.
"""

from __future__ import annotations

import base64
import hashlib
import zipfile
from pathlib import Path

from nbresume.errors import UsageError

#: The dataset's slug under the user's name.
DATASET_SLUG = "nbresume-wheel"
DATASET_TITLE = "nbresume wheel"
#: Zip entries get this date, so that the same files give the same bytes.
_EPOCH = (1980, 1, 1, 0, 0, 0)


_DIGEST_WORD = "sha256:"


def wheel_digest(path: Path) -> str:
    """The SHA-256 of the wheel file, in hex."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


def describe(name: str, digest: str) -> str:
    """The dataset's description: what it is for, and the wheel's hash that the next commit
    compares (see :func:`described_digest`)."""
    return (
        f"{name}, uploaded by `nbresume commit` for notebooks that run with internet off.\n\n"
        f"{_DIGEST_WORD} {digest}"
    )


def described_digest(description: str | None) -> str | None:
    """The wheel hash a description written by :func:`describe` holds, else ``None``."""
    for line in (description or "").splitlines():
        word, _, value = line.strip().partition(" ")
        if word == _DIGEST_WORD and len(value.strip()) == 64:
            return value.strip().lower()
    return None


def _record_hash(data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"sha256={digest}"


def build_wheel(dest: Path) -> Path:
    """Write ``nbresume-<version>-py3-none-any.whl`` into ``dest`` and return its path."""
    from importlib import metadata

    try:
        dist = metadata.distribution("nbresume")
        meta_text = dist.read_text("METADATA")
    except metadata.PackageNotFoundError:
        meta_text = None
    if not meta_text:
        raise UsageError(
            "nbresume is not installed as a package here, so there is no wheel to upload",
            fix="pip install nbresume (or `pip install -e .` in its source), or commit with "
            "--internet",
        )
    version = dist.version
    package = Path(__file__).parent.parent  # the nbresume package
    entries: list[tuple[str, bytes]] = []
    for path in sorted(package.rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
            entries.append((f"nbresume/{path.relative_to(package).as_posix()}", path.read_bytes()))
    info = f"nbresume-{version}.dist-info"
    wheel_text = (
        "Wheel-Version: 1.0\nGenerator: nbresume\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    )
    entries.append((f"{info}/METADATA", meta_text.encode()))
    entries.append((f"{info}/WHEEL", wheel_text.encode()))
    record = "".join(f"{name},{_record_hash(data)},{len(data)}\n" for name, data in entries)
    entries.append((f"{info}/RECORD", (record + f"{info}/RECORD,,\n").encode()))
    dest.mkdir(parents=True, exist_ok=True)
    target = dest / f"nbresume-{version}-py3-none-any.whl"
    with zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, data in entries:
            item = zipfile.ZipInfo(name, date_time=_EPOCH)
            item.external_attr = 0o644 << 16
            item.compress_type = zipfile.ZIP_DEFLATED
            archive.writestr(item, data)
    return target
