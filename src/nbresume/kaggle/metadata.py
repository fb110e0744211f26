"""``kernel-metadata.json``: what ``kaggle kernels push`` reads, built from the command line.

Accelerators have friendly names (``t4x2``, ``p100``, ``tpu``, ``cpu``; ``gpu`` means the
default GPU, T4 x2) and Kaggle's own machine shapes (``NvidiaTeslaT4``, ``NvidiaTeslaP100``,
``TpuV5E8``, ``Tpu1VmV38``; other ``Nvidia...``/``Tpu...`` shapes are passed on as given, since
Kaggle adds machines over time).

The file is written next to the notebook, so the user sees exactly what was pushed. Data
sources already listed in an existing ``kernel-metadata.json`` of the same notebook are kept.
"""

from __future__ import annotations

import json
import os
import re
import unicodedata
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nbresume.errors import UsageError

METADATA_FILE = "kernel-metadata.json"
#: Source lists of kernel-metadata.json that are carried over from an existing file.
SOURCE_KEYS = ("dataset_sources", "competition_sources", "kernel_sources", "model_sources")
MIN_TITLE = 5
MAX_TITLE = 50

_REF = re.compile(r"([A-Za-z0-9][A-Za-z0-9_-]*)/([A-Za-z0-9][A-Za-z0-9_.-]*)")
_SHAPE = re.compile(r"(Nvidia|Tpu)[A-Za-z0-9]+")


@dataclass(frozen=True)
class Accelerator:
    """What a commit asks Kaggle for.

    Attributes:
        name: as the user wrote it.
        kind: ``"gpu"``, ``"tpu"`` or ``"cpu"``.
        machine_shape: Kaggle's machine shape, ``None`` for CPU.
    """

    name: str
    kind: str
    machine_shape: str | None

    @property
    def note(self) -> str:
        """A caution to print, or ``""``."""
        if self.machine_shape == "NvidiaTeslaP100":
            return (
                "Kaggle has retired the P100 and may give another GPU; current torch builds "
                "do not run on a P100 ('no kernel image is available'): prefer t4x2"
            )
        return ""


FRIENDLY: dict[str, tuple[str, str | None]] = {
    "t4x2": ("gpu", "NvidiaTeslaT4"),
    "t4": ("gpu", "NvidiaTeslaT4"),
    "gpu": ("gpu", "NvidiaTeslaT4"),
    "p100": ("gpu", "NvidiaTeslaP100"),
    "tpu": ("tpu", "TpuV5E8"),
    "cpu": ("cpu", None),
    "none": ("cpu", None),
}
KNOWN_SHAPES = {
    "NvidiaTeslaT4": "gpu",
    "NvidiaTeslaP100": "gpu",
    "TpuV5E8": "tpu",
    "Tpu1VmV38": "tpu",
}


def parse_accelerator(text: str) -> Accelerator:
    """A friendly name or a Kaggle machine shape; :class:`UsageError` with the choices
    otherwise."""
    lowered = text.strip().lower()
    if lowered in FRIENDLY:
        kind, shape = FRIENDLY[lowered]
        return Accelerator(text, kind, shape)
    for shape, kind in KNOWN_SHAPES.items():
        if lowered == shape.lower():
            return Accelerator(text, kind, shape)
    if _SHAPE.fullmatch(text.strip()):
        return Accelerator(text, "tpu" if text.startswith("Tpu") else "gpu", text.strip())
    raise UsageError(
        f"{text!r} is not an accelerator Kaggle offers",
        fix="use t4x2 (the default GPU), p100, tpu or cpu, or a Kaggle machine shape such as "
        + ", ".join(KNOWN_SHAPES),
    )


def parse_ref(ref: str) -> tuple[str, str]:
    """``"owner/slug"`` -> ``("owner", "slug")``; :class:`UsageError` otherwise."""
    match = _REF.fullmatch(ref.strip())
    if not match:
        raise UsageError(
            f"{ref!r} does not name a Kaggle notebook",
            fix="write it as owner/slug, as in kaggle.com/code/owner/slug",
        )
    return match.group(1), match.group(2)


def configured_username() -> str:
    """The Kaggle user name from ``KAGGLE_USERNAME`` or ``kaggle.json`` (in
    ``KAGGLE_CONFIG_DIR``, else ``~/.kaggle``), ``""`` when there is none. Read as the kaggle
    client reads it, without checking any credential."""
    name = os.environ.get("KAGGLE_USERNAME", "").strip()
    if name:
        return name
    folder = Path(os.environ.get("KAGGLE_CONFIG_DIR") or Path.home() / ".kaggle")
    try:
        document = json.loads((folder / "kaggle.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return ""
    value = document.get("username") if isinstance(document, dict) else None
    return value.strip() if isinstance(value, str) else ""


def slugify(title: str) -> str:
    """The slug Kaggle derives from a title (``"MNIST (leg 2)"`` -> ``"mnist-leg-2"``)."""
    ascii_text = unicodedata.normalize("NFKD", title).encode("ascii", "ignore").decode()
    return re.sub(r"[^a-z0-9]+", "-", ascii_text.lower()).strip("-")


def default_title(slug: str) -> str:
    """A title that turns back into ``slug``: ``"resnet-cifar"`` -> ``"Resnet Cifar"``."""
    return " ".join(word.capitalize() for word in slug.split("-") if word) or slug


def check_title(title: str, slug: str) -> str:
    """``""`` when ``title`` suits ``slug``, else a caution. A title Kaggle refuses raises."""
    if not MIN_TITLE <= len(title) <= MAX_TITLE:
        raise UsageError(
            f"the title {title!r} has {len(title)} characters; Kaggle wants "
            f"{MIN_TITLE} to {MAX_TITLE}",
            fix="pass --title with 5 to 50 characters that give the slug (Kaggle makes the "
            "slug from the title), or use a slug of at least 5 characters",
        )
    if slugify(title) != slug.lower():
        return (
            f"the title {title!r} gives the slug {slugify(title)!r}, not {slug!r}: Kaggle may "
            "answer 'Notebook not found' or make a second notebook"
        )
    return ""


def build(
    ref: str,
    code_file: str,
    *,
    title: str,
    accelerator: Accelerator,
    internet: bool,
    private: bool,
    sources: dict[str, list[str]] | None = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The content of ``kernel-metadata.json`` for one push."""
    document: dict[str, Any] = dict(extra or {})
    document.update(
        {
            "id": ref,
            "title": title,
            "code_file": code_file,
            "language": "python",
            "kernel_type": "script" if code_file.endswith(".py") else "notebook",
            "is_private": private,
            "enable_gpu": accelerator.kind == "gpu",
            "enable_tpu": accelerator.kind == "tpu",
            "enable_internet": internet,
        }
    )
    document.pop("id_no", None)  # the slug names the notebook; a stale number would win
    if accelerator.machine_shape:
        document["machine_shape"] = accelerator.machine_shape
    else:
        document.pop("machine_shape", None)
    for key in SOURCE_KEYS:
        document[key] = list((sources or {}).get(key, document.get(key) or []))
    return document


def read_existing(folder: Path, code_file: str) -> dict[str, Any]:
    """The ``kernel-metadata.json`` already in ``folder`` for this notebook (``{}`` when there
    is none). One that belongs to another notebook is an error: Kaggle keeps one per folder."""
    path = folder / METADATA_FILE
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise UsageError(
            f"cannot read the existing {METADATA_FILE}: {exc}",
            where=str(path),
            fix="fix or delete it; nbresume writes a new one",
        ) from None
    if not isinstance(document, dict):
        return {}
    if document.get("code_file") not in (None, code_file):
        raise UsageError(
            f"{METADATA_FILE} here belongs to {document.get('code_file')!r}, not {code_file!r}",
            where=str(path),
            fix="put each notebook in a folder of its own (Kaggle reads one "
            f"{METADATA_FILE} per folder)",
        )
    return document


def write(folder: Path, document: dict[str, Any]) -> Path:
    """Write ``kernel-metadata.json`` into ``folder`` (through a temporary file) and return its
    path."""
    path = folder / METADATA_FILE
    temp = folder / f".{METADATA_FILE}.tmp"
    temp.write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
    os.replace(temp, path)
    return path
