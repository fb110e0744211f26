"""A real notebook, executed with papermill on a real kernel, twice on the same run folder.

The second execution is what a reconnect looks like: a new kernel, "Run all" again. The
``once`` cell is skipped with a note, training has nothing left to do, and the panel starts
from the checkpoint in the folder. The panel's state is read from the output notebook's widget
state, as a front-end opening the notebook would show it.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("papermill", reason="needs papermill (the test extra)")
pytest.importorskip("ipywidgets", reason="needs ipywidgets (the notebook extra)")

import nbformat
import papermill

from nbresume.checkpoint.store import CheckpointStore

from .conftest import KERNEL_NAME

NOTEBOOK = Path(__file__).with_name("notebooks") / "panel_and_once.ipynb"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


def execute(tmp_path: Path, name: str, run_dir: Path, total: int) -> Any:
    output = tmp_path / f"{name}.ipynb"
    papermill.execute_notebook(
        str(NOTEBOOK),
        str(output),
        parameters={"run_dir": str(run_dir), "total": total},
        kernel_name=KERNEL_NAME,
        cwd=str(tmp_path),
        progress_bar=False,
        start_timeout=120,
        execution_timeout=120,
    )
    return nbformat.read(output, as_version=4)


def cell_text(cell: Any) -> str:
    parts = []
    for out in cell.get("outputs", []):
        if out.get("output_type") == "stream":
            parts.append(out["text"])
        elif "data" in out and "text/plain" in out["data"]:
            parts.append(out["data"]["text/plain"])
    return "".join(parts)


def find_cell(notebook: Any, start: str) -> Any:
    return next(c for c in notebook.cells if c.source.startswith(start))


def widget_states(notebook: Any) -> dict[str, dict[str, Any]]:
    saved = notebook.metadata.get("widgets", {}).get(WIDGET_STATE, {}).get("state", {})
    return {model_id: model["state"] for model_id, model in saved.items()}


def panel_part(states: dict[str, dict[str, Any]], css_class: str) -> dict[str, Any]:
    found = [s for s in states.values() if css_class in s.get("_dom_classes", [])]
    assert len(found) == 1, f"{len(found)} widgets with class {css_class}"
    return found[0]


def attr(html: str, name: str) -> str:
    match = re.search(rf'data-{name}="([^"]*)"', html)
    assert match, html
    return match.group(1)


def test_panel_and_once_across_a_reconnect(jupyter_env: dict[str, str], tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    total = 40

    first = execute(tmp_path, "first", run_dir, total)
    assert cell_text(find_cell(first, "%%nbresume once prepare")) == "prepared 499500\n"
    assert cell_text(find_cell(first, "class Model")).endswith(f"trained to step {total} done\n")
    assert [i.step for i in CheckpointStore(run_dir, keep=None).list()] == [20, 30, 40]

    # %load_ext displayed the setup panel and the panel once; their state is stored with the
    # notebook.
    load = find_cell(first, "%load_ext nbresume")
    views = [o for o in load.outputs if WIDGET_VIEW in o.get("data", {})]
    assert len(views) == 2
    init = find_cell(first, "import numpy as np")  # nbresume.init shows no second panel
    assert not [o for o in init.outputs if WIDGET_VIEW in o.get("data", {})]
    states = widget_states(first)
    assert "nbresume-setup" in states[views[0]["data"][WIDGET_VIEW]["model_id"]]["_dom_classes"]
    panel = states[views[1]["data"][WIDGET_VIEW]["model_id"]]
    assert "nbresume-panel" in panel["_dom_classes"]
    # Where widgets do not render (the output read as text: nbconvert, a diff, GitHub), the
    # panel's output states the run instead of the widget's repr, brought up to date at the
    # end of each cell: the training cell ran after the panel was shown.
    text = views[1]["data"]["text/plain"].splitlines()
    assert text[:3] == [
        "nbresume · run 'notebook' · local machine",
        f"  checkpoints: {run_dir}",
        f"  training: step {total} of {total} (100%) · done",
    ]
    assert len(text) == 4
    assert text[3].startswith(f"  last checkpoint: step {total} saved (")
    setup = views[0]["data"]["text/plain"]
    assert setup.startswith("nbresume setup · local machine: ")
    assert "<" not in setup
    bar = panel_part(states, "nbresume-bar")
    assert (bar["value"], bar["max"]) == (total, total)
    progress = panel_part(states, "nbresume-progress")["value"]
    assert attr(progress, "step") == str(total)
    assert attr(progress, "running") == "false"
    assert f"step {total} of {total}" in progress
    checkpoint = panel_part(states, "nbresume-checkpoint")["value"]
    assert (attr(checkpoint, "step"), attr(checkpoint, "state")) == (str(total), "saved")
    assert str(run_dir) in panel_part(states, "nbresume-facts")["value"]
    assert "run <code>notebook</code>" in panel_part(states, "nbresume-title")["value"]

    status = cell_text(find_cell(first, "%nbresume status"))
    assert f"last checkpoint: step {total} saved" in status
    assert cell_text(find_cell(first, "%nbresume verify")).strip().endswith("OK 3/3, errors 0")

    # A reconnect: a new kernel, "Run all" again on the same run folder.
    second = execute(tmp_path, "second", run_dir, total)
    note = cell_text(find_cell(second, "%%nbresume once prepare"))
    assert note.startswith("nbresume: skipped 'prepare': it completed in this run at ")
    assert "prepared" not in note.replace("'prepare'", "")
    assert cell_text(find_cell(second, "class Model")).endswith(f"trained to step {total} done\n")
    assert [i.step for i in CheckpointStore(run_dir, keep=None).list()] == [20, 30, 40]
    checkpoint = panel_part(widget_states(second), "nbresume-checkpoint")["value"]
    assert attr(checkpoint, "step") == str(total)
    # Found in the folder and not re-verified in this kernel: not claimed as saved.
    assert attr(checkpoint, "state") == "found"
