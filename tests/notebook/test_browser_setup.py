"""The setup panel in a real browser: JupyterLab on loopback, Debian's chromium driven by
Playwright, as in ``test_browser.py`` (whose fixtures these tests use).

- On the Colab stand-in: ``%load_ext nbresume`` shows Drive as not mounted; a click on "Mount
  Drive" mounts it (through ``google.colab.drive``), the quota left appears (read from the
  simulated Drive API); ``nbresume.init`` then puts the run folder on Drive, and the training
  panel plots the loss given to ``save(metric=...)`` and shows Colab's danger clocks.
- On a simulated Kaggle with two earlier versions attached as inputs: the panel lists their
  checkpoints newest first; choosing the older one and clicking "Use this choice" makes the
  next cell's Checkpointer resume from exactly that checkpoint, and the inputs are untouched.

Each kernel gets its platform from its kernelspec's environment. Every wait is on a condition.
Set NBRESUME_SETUP_SCREENSHOT=path to keep the screenshot of the Kaggle setup panel
(docs/img/setup-panel.png is made this way), NBRESUME_PLOT_SCREENSHOT=path for the Colab
training panel with its loss plot (docs/img/panel-plot.png).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from nbresume.checkpoint.store import CheckpointStore

from .test_browser import CHROMIUM, browser_page, jupyterlab  # noqa: F401 (fixtures)

#: Read now: the tests' environment is cleared of NBRESUME_ variables before each test.
KEEP_SCREENSHOT = os.environ.get("NBRESUME_SETUP_SCREENSHOT", "")
KEEP_PLOT_SCREENSHOT = os.environ.get("NBRESUME_PLOT_SCREENSHOT", "")
NAME = "tiny"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium (/usr/bin/chromium)"),
]


def add_kernel(jupyter_env: dict[str, str], name: str, env: dict[str, str]) -> None:
    """A kernelspec running this virtualenv's Python with ``env`` added: the platform."""
    spec = Path(jupyter_env["JUPYTER_DATA_DIR"]) / "kernels" / name
    spec.mkdir(parents=True)
    kernel = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": name,
        "language": "python",
        "metadata": {"debugger": False},
        "env": env,
    }
    (spec / "kernel.json").write_text(json.dumps(kernel))


def write_notebook(path: Path, kernel: str, cells: list[str]) -> None:
    import nbformat
    from nbformat.v4 import new_code_cell, new_notebook

    notebook = new_notebook(
        cells=[new_code_cell(source) for source in cells],
        metadata={"kernelspec": {"name": kernel, "display_name": kernel, "language": "python"}},
    )
    nbformat.write(notebook, path)


def quiet_lab(tmp_path: Path) -> None:
    """No "get notified about Jupyter news?" toast over the panel (JupyterLab's settings
    folder is ``tmp_path / "settings"``, as the ``jupyterlab`` fixture sets it)."""
    folder = tmp_path / "settings" / "@jupyterlab" / "apputils-extension"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "notification.jupyterlab-settings").write_text('{"fetchNews": "false"}')


def open_notebook(page: Any, url: str, name: str, kernel: str) -> None:
    page.goto(f"{url}/lab/tree/{name}")
    page.wait_for_selector(".jp-NotebookPanel .jp-Cell")
    started = page.evaluate(
        """async () => {
            const panel = window.jupyterapp.shell.currentWidget;
            await panel.sessionContext.ready;
            return panel.sessionContext.session.kernel.name;
        }"""
    )
    assert started == kernel


def run_cell(page: Any, index: int) -> None:
    """Run one cell (queued in the kernel after the ones before it); not awaited."""
    page.evaluate(
        """index => {
            const notebook = window.jupyterapp.shell.currentWidget.content;
            notebook.deselectAll();
            notebook.activeCellIndex = index;
            window.jupyterapp.commands.execute('notebook:run-cell');
        }""",
        index,
    )


def wait_output(page: Any, pattern: str) -> str:
    """The text of the first cell output matching the regular expression ``pattern``."""
    page.wait_for_function(
        """pattern => [...document.querySelectorAll(".jp-OutputArea-output")]
            .some(el => new RegExp(pattern).test(el.textContent))""",
        arg=pattern,
    )
    outputs = page.locator(".jp-OutputArea-output").all_inner_texts()
    import re

    return next(text for text in outputs if re.search(pattern, text))


# -- Colab -------------------------------------------------------------------------------------


@pytest.fixture
def drive_api(tmp_path: Path) -> Iterator[Any]:
    """Google's side of the Colab stand-in: the simulated Drive API over a 2 GB cloud."""
    pytest.importorskip("googleapiclient", reason="needs google-api-python-client (test extra)")
    pytest.importorskip("colab_standin", reason="needs the google.colab stand-in (scripts/setup)")
    from colab_standin.cloud import Cloud
    from colab_standin.server import DriveServer

    cloud = Cloud(tmp_path / "cloud", quota_bytes=2_000_000_000)
    server = DriveServer(str(tmp_path / "cloud")).start()
    try:
        yield server
    finally:
        server.stop()
        cloud.close()


COLAB_CELLS = [
    "%load_ext nbresume",
    "import torch\n"
    "import nbresume\n"
    "\n"
    "torch.manual_seed(0)\n"
    f"run = nbresume.init({NAME!r})\n"
    "model = torch.nn.Linear(8, 1)\n"
    "opt = torch.optim.SGD(model.parameters(), lr=0.05)\n"
    "x, y = torch.randn(64, 8), torch.randn(64, 1)\n"
    "ckpt = run.checkpointer(model=model, optimizer=opt, every=None, async_save=False)\n"
    "for step in ckpt.steps(40):\n"
    "    loss = torch.nn.functional.mse_loss(model(x), y)\n"
    "    opt.zero_grad()\n"
    "    loss.backward()\n"
    "    opt.step()\n"
    "    if step % 10 == 4:\n"
    "        ckpt.save(metric={'loss': loss.item()})\n"
    "print('trained to step', ckpt.step, 'in', run.dir)",
]


def test_setup_panel_mounts_drive_on_colab(
    jupyter_env: dict[str, str],
    drive_api: Any,
    jupyterlab: str,  # noqa: F811 (a fixture)
    browser_page: Any,  # noqa: F811
    tmp_path: Path,
) -> None:
    page = browser_page
    mount = tmp_path / "vm" / "drive"
    mount.parent.mkdir()
    add_kernel(
        jupyter_env,
        "colab-standin",
        {
            "COLAB_RELEASE_TAG": "standin",
            "COLAB_STANDIN_ROOT": str(tmp_path / "cloud"),
            "COLAB_STANDIN_API_URL": drive_api.url,
            "COLAB_STANDIN_UPLOAD_LAG_S": "0.2",
            "NBRESUME_DRIVE_API_URL": drive_api.url,
            "NBRESUME_DRIVE_MOUNT": str(mount),
            "NBRESUME_DRIVE_POLL_S": "0.1",
        },
    )
    write_notebook(tmp_path / "lab" / "colab.ipynb", "colab-standin", COLAB_CELLS)
    quiet_lab(tmp_path)
    open_notebook(page, jupyterlab, "colab.ipynb", "colab-standin")
    run_cell(page, 0)

    # The platform, the preflight rows, Drive not mounted, Colab's clocks.
    setup = ".nbresume-setup"
    page.wait_for_selector(f"{setup} .nbresume-setup-drive [data-mounted='false']")
    title = page.locator(f"{setup} .nbresume-setup-title").first.inner_text()
    assert "Google Colab" in title
    assert page.locator(f"{setup} .nbresume-setup-checks tr[data-check]").count() >= 3
    for clock in ("idle disconnect", "closed tab", "VM lifetime"):
        assert page.locator(f"{setup} tr[data-clock='{clock}']").count() == 1
    assert not (mount / "MyDrive").exists()

    # "Mount Drive": mounted through google.colab.drive, with the quota Drive reports.
    page.locator(f"{setup} .nbresume-mount").first.click()
    page.wait_for_selector(f"{setup} .nbresume-setup-drive [data-mounted='true']")
    assert (mount / "MyDrive").is_dir()
    quota = page.locator(f"{setup} .nbresume-quota").first.inner_text()
    assert "free of 2.0 GB" in quota, quota
    assert page.locator(f"{setup} .nbresume-mount").first.is_disabled()

    # init uses the mount: the run folder is on Drive; the training panel plots the loss.
    run_cell(page, 1)
    ended = wait_output(page, r"trained to step 40 in ")
    run_dir = mount / "MyDrive" / "nbresume" / NAME
    assert str(run_dir) in ended
    page.wait_for_selector(f"{setup} .nbresume-setup-folder [data-dir='{run_dir}']")
    plot = ".nbresume-panel .nbresume-plot [data-metric='loss']"
    page.wait_for_selector(f"{plot}[data-points='4']")
    assert page.locator(f"{plot} polyline").count() == 1
    clocks = page.locator(".nbresume-panel .nbresume-clocks").first.inner_text()
    assert "idle disconnect" in clocks
    assert "closed tab" in clocks
    steps = [i.step for i in CheckpointStore(run_dir, keep=None).list()]
    assert steps[-1] == 40
    shot = tmp_path / "panel-plot.png"
    page.locator(".nbresume-panel").first.screenshot(path=str(shot))
    if KEEP_PLOT_SCREENSHOT:
        shutil.copyfile(shot, KEEP_PLOT_SCREENSHOT)


# -- Kaggle ------------------------------------------------------------------------------------


def save(folder: Path, step: int) -> None:
    """A checkpoint as an earlier version of the notebook wrote it."""
    from nbresume import Checkpointer

    ckpt = Checkpointer(folder, every=None, keep=None, deadline=None, async_save=False)
    ckpt["trained"] = {"up_to": step}
    ckpt.save(step=step)
    ckpt.close()


def tree_digest(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


KAGGLE_CELLS = [
    f"import nbresume\nrun = nbresume.init({NAME!r})",
    "ckpt = run.checkpointer(every=None, async_save=False)\n"
    "ckpt['trained'] = {'up_to': 0}\n"
    "print('resumed from step', ckpt.restore(), 'state', ckpt['trained'])",
]


def test_setup_panel_chooses_the_kaggle_input_to_resume_from(
    jupyter_env: dict[str, str],
    jupyterlab: str,  # noqa: F811 (a fixture)
    browser_page: Any,  # noqa: F811
    tmp_path: Path,
) -> None:
    page = browser_page
    kaggle = tmp_path / "kaggle"
    (kaggle / "working").mkdir(parents=True)
    save(kaggle / "input" / "tiny-v1" / "nbresume" / NAME, 20)
    save(kaggle / "input" / "notebooks" / "someone" / "tiny-v2" / "nbresume" / NAME, 40)
    inputs = tree_digest(kaggle / "input")
    add_kernel(
        jupyter_env,
        "kaggle-sim",
        {"KAGGLE_KERNEL_RUN_TYPE": "Interactive", "NBRESUME_KAGGLE_ROOT": str(kaggle)},
    )
    write_notebook(tmp_path / "lab" / "kaggle.ipynb", "kaggle-sim", KAGGLE_CELLS)
    quiet_lab(tmp_path)
    open_notebook(page, jupyterlab, "kaggle.ipynb", "kaggle-sim")
    run_cell(page, 0)

    # Both inputs, newest first; init copied the newest in.
    setup = ".nbresume-setup"
    choices = f"{setup} .nbresume-setup-inputs .widget-radio-box label"
    page.wait_for_selector(f"{setup} .nbresume-setup-choice [data-resume-step='40']")
    labels = page.locator(choices).all_inner_texts()
    assert [label.split(" · ")[0].strip() for label in labels] == [
        "step 40",
        "step 20",
        "Start fresh (nothing under /kaggle/input is deleted)",
    ]
    assert "verified" in labels[1]
    title = page.locator(f"{setup} .nbresume-setup-title").first.inner_text()
    assert "Kaggle (interactive)" in title
    for clock in ("session cap", "weekly GPU quota"):
        assert page.locator(f"{setup} tr[data-clock='{clock}']").count() == 1

    # Choose the older one; the panel says so, and the next cell resumes from it.
    page.locator(choices, has_text="step 20").first.click()
    page.locator(f"{setup} .nbresume-choose").first.click()
    page.wait_for_selector(f"{setup} .nbresume-setup-choice [data-resume-step='20']")
    working = kaggle / "working" / "nbresume" / NAME
    assert [i.step for i in CheckpointStore(working, keep=None).list()] == [20]
    shot = tmp_path / "setup-panel.png"
    page.locator(setup).first.screenshot(path=str(shot))
    if KEEP_SCREENSHOT:
        shutil.copyfile(shot, KEEP_SCREENSHOT)

    run_cell(page, 1)
    resumed = wait_output(page, r"resumed from step \d+")
    assert "resumed from step 20 state {'up_to': 20}" in resumed
    assert tree_digest(kaggle / "input") == inputs  # read-only on Kaggle: untouched
