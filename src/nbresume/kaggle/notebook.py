"""Reading a notebook file: its cells, numbered as Jupyter shows them, and their Python.

Plain JSON, no ``nbformat``: the checks before a commit must work where only nbresume is
installed. Cells are numbered from 1 by their position in the notebook (markdown cells
included), which is what a user counts in the editor.
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nbresume.errors import UsageError

#: A line that IPython turns into something other than Python: a shell escape or a magic.
_IPYTHON_LINE = re.compile(r"^(\s*)(!|%|\?)")


@dataclass(frozen=True)
class Cell:
    """One cell of a notebook.

    Attributes:
        number: its position in the notebook, from 1.
        kind: ``"code"``, ``"markdown"`` or ``"raw"``.
        source: its text.
        outputs: its saved outputs (code cells), as in the file.
        tags: its ``metadata.tags`` (papermill's ``parameters`` among them).
    """

    number: int
    kind: str
    source: str
    outputs: tuple[Any, ...] = ()
    tags: tuple[str, ...] = ()

    @property
    def first_line(self) -> str:
        """The first line that is not blank, for messages."""
        for line in self.source.splitlines():
            if line.strip():
                return line.strip()
        return ""

    def python(self) -> ast.Module | None:
        """The cell parsed as Python, IPython lines blanked out; ``None`` when it is a cell magic
        (``%%bash``) or does not parse."""
        if self.kind != "code" or self.source.lstrip().startswith("%%"):
            return None
        try:
            return ast.parse(python_text(self.source))
        except (SyntaxError, ValueError):
            return None

    def ipython_lines(self) -> list[str]:
        """The shell escapes and magics of the cell (``!pip install x``, ``%pip ...``)."""
        if self.source.lstrip().startswith("%%"):
            return self.source.splitlines()
        return [line.strip() for line in self.source.splitlines() if _IPYTHON_LINE.match(line)]


@dataclass(frozen=True)
class Notebook:
    """A notebook file: its metadata and cells."""

    path: Path
    metadata: dict[str, Any]
    cells: tuple[Cell, ...]
    document: dict[str, Any] = field(repr=False, default_factory=dict)
    #: A Python script kernel (``.py``): one code cell, run with ``python``.
    script: bool = False

    @property
    def code_cells(self) -> list[Cell]:
        return [c for c in self.cells if c.kind == "code"]

    @property
    def kernel_name(self) -> str:
        """``metadata.kernelspec.name``, or ``""`` when it is missing."""
        spec = self.metadata.get("kernelspec")
        name = spec.get("name") if isinstance(spec, dict) else None
        return name if isinstance(name, str) else ""

    def all_source(self) -> str:
        return "\n".join(c.source for c in self.code_cells)


def python_text(source: str) -> str:
    """``source`` with every IPython line replaced by ``pass`` at the same indentation, so that
    line numbers and blocks stay as they were."""
    lines = []
    for line in source.splitlines():
        match = _IPYTHON_LINE.match(line)
        lines.append(f"{match.group(1)}pass" if match else line)
    return "\n".join(lines)


def _text(value: Any) -> str:
    if isinstance(value, list):
        return "".join(str(v) for v in value)
    return value if isinstance(value, str) else ""


def load(path: str | Path) -> Notebook:
    """Read a notebook file (format 4), or a Python script (``.py``) as a notebook of one code
    cell. Raises :class:`~nbresume.errors.UsageError` naming the file when it cannot be read or
    is not a notebook."""
    where = str(path)
    if Path(path).suffix == ".py":
        return _load_script(Path(path))
    try:
        document = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise UsageError(f"cannot read the notebook: {exc.strerror or exc}", where=where) from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UsageError(
            f"not a notebook file (not JSON: {exc})",
            where=where,
            fix="pass the .ipynb file saved by Jupyter, Colab or Kaggle",
        ) from None
    if not isinstance(document, dict) or not isinstance(document.get("cells"), list):
        raise UsageError(
            "not a notebook file (no list of cells)",
            where=where,
            fix="pass the .ipynb file saved by Jupyter, Colab or Kaggle",
        )
    if document.get("nbformat", 4) != 4:
        raise UsageError(
            f"notebook format {document.get('nbformat')} is not supported",
            where=where,
            fix="open and save it in a current Jupyter (format 4)",
        )
    cells = []
    for number, raw in enumerate(document["cells"], start=1):
        if not isinstance(raw, dict):
            continue
        outputs = raw.get("outputs") if raw.get("cell_type") == "code" else None
        cells.append(
            Cell(
                number=number,
                kind=str(raw.get("cell_type", "")),
                source=_text(raw.get("source", "")),
                outputs=tuple(outputs) if isinstance(outputs, list) else (),
                tags=_tags(raw.get("metadata")),
            )
        )
    metadata = document.get("metadata")
    return Notebook(
        path=Path(path),
        metadata=metadata if isinstance(metadata, dict) else {},
        cells=tuple(cells),
        document=document,
    )


def _tags(metadata: object) -> tuple[str, ...]:
    tags = metadata.get("tags") if isinstance(metadata, dict) else None
    return tuple(t for t in tags if isinstance(t, str)) if isinstance(tags, list) else ()


def _load_script(path: Path) -> Notebook:
    try:
        source = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"cannot read the script: {exc}", where=str(path)) from None
    return Notebook(path=path, metadata={}, cells=(Cell(1, "code", source),), script=True)
