"""The panel in a real browser: JupyterLab on loopback, Debian's chromium driven by Playwright.

A notebook loads the extension and trains a small PyTorch model. The test watches the panel as
a user would: the step count advances, a checkpoint shows as saved; it clicks "Save now" while
the training cell runs and sees the new checkpoint on the panel and on disk; then "Stop and
save" ends the loop. Every wait is on a condition, with a generous limit.

Set NBRESUME_PANEL_SCREENSHOT=path to keep the screenshot of the panel (docs/img/panel.png is
made this way).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from nbresume.checkpoint.store import CheckpointStore
from testkit.ports import free_port

from .conftest import KERNEL_NAME

CHROMIUM = Path("/usr/bin/chromium")
#: Chromium's background connections are refused on a closed network; without these flags it
#: keeps retrying them.
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
WAIT_MS = 60_000
#: Read now: the tests' environment is cleared of NBRESUME_ variables before each test.
KEEP_SCREENSHOT = os.environ.get("NBRESUME_PANEL_SCREENSHOT", "")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium (/usr/bin/chromium)"),
]

TRAIN_CELLS = [
    "%load_ext nbresume",
    "import time\n"
    "import torch\n"
    "import nbresume\n"
    "\n"
    "torch.manual_seed(0)\n"
    "run = nbresume.init('browser', dir=RUN_DIR)",
    "model = torch.nn.Sequential(\n"
    "    torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)\n"
    ")\n"
    "opt = torch.optim.Adam(model.parameters(), lr=1e-3)\n"
    "x, y = torch.randn(256, 32), torch.randn(256, 1)\n"
    "ckpt = run.checkpointer(model=model, optimizer=opt, every=300, keep=None, async_save=False)\n"
    "for step in ckpt.steps(1_000_000):\n"
    "    loss = torch.nn.functional.mse_loss(model(x), y)\n"
    "    opt.zero_grad()\n"
    "    loss.backward()\n"
    "    opt.step()\n"
    "    time.sleep(0.003)\n"
    "print('training ended at step', ckpt.step)",
]


def write_notebook(path: Path, run_dir: Path) -> None:
    import nbformat
    from nbformat.v4 import new_code_cell, new_notebook

    cells = [new_code_cell(f"RUN_DIR = {str(run_dir)!r}")]
    cells += [new_code_cell(source) for source in TRAIN_CELLS]
    notebook = new_notebook(
        cells=cells,
        metadata={
            "kernelspec": {
                "name": KERNEL_NAME,
                "display_name": "nbresume tests",
                "language": "python",
            }
        },
    )
    nbformat.write(notebook, path)


@pytest.fixture
def jupyterlab(jupyter_env: dict[str, str], tmp_path: Path) -> Iterator[str]:
    """JupyterLab on a free loopback port, without a token, serving a fresh folder."""
    pytest.importorskip("jupyterlab", reason="needs jupyterlab (the test extra)")
    root = tmp_path / "lab"
    root.mkdir()
    jupyter_env = {**jupyter_env, "NBRESUME_SESSION_CAP": "12h"}  # a session clock to show
    port = free_port()
    log = (tmp_path / "jupyterlab.log").open("wb")
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jupyterlab",
            "--no-browser",
            "--ServerApp.open_browser=False",
            "--ServerApp.ip=127.0.0.1",
            f"--ServerApp.port={port}",
            "--ServerApp.port_retries=0",
            "--IdentityProvider.token=",
            "--ServerApp.password=",
            f"--ServerApp.root_dir={root}",
            "--ServerApp.allow_root=True",
            "--LabApp.expose_app_in_browser=True",
            "--LabApp.extension_manager=readonly",
            "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
            f"--LabApp.workspaces_dir={tmp_path / 'workspaces'}",
            f"--LabApp.user_settings_dir={tmp_path / 'settings'}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=jupyter_env,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while True:
        try:
            with urllib.request.urlopen(f"{url}/api/status", timeout=2) as answer:
                json.load(answer)
            break
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                server.kill()
                log.close()
                pytest.fail(
                    "JupyterLab did not start:\n" + (tmp_path / "jupyterlab.log").read_text()
                )
            time.sleep(0.2)
    try:
        yield url
    finally:
        server.terminate()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()


@pytest.fixture
def browser_page(tmp_path: Path) -> Iterator[Any]:
    """A page of a fresh headless chromium (its own profile folder)."""
    sync_api = pytest.importorskip("playwright.sync_api", reason="needs playwright (test extra)")
    with sync_api.sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            str(tmp_path / "chromium-profile"),
            executable_path=str(CHROMIUM),
            headless=True,
            args=CHROMIUM_ARGS,
            viewport={"width": 1400, "height": 900},
        )
        try:
            page = context.pages[0] if context.pages else context.new_page()
            page.set_default_timeout(WAIT_MS)
            yield page
        finally:
            context.close()


def attribute(page: Any, selector: str, name: str) -> str:
    value = page.locator(selector).first.get_attribute(name)
    return value or ""


def test_panel_live_in_jupyterlab(jupyterlab: str, browser_page: Any, tmp_path: Path) -> None:
    page = browser_page
    run_dir = tmp_path / "run"
    write_notebook(tmp_path / "lab" / "train.ipynb", run_dir)

    page.goto(f"{jupyterlab}/lab/tree/train.ipynb")
    page.wait_for_selector(".jp-NotebookPanel .jp-Cell")
    kernel = page.evaluate(
        """async () => {
            const panel = window.jupyterapp.shell.currentWidget;
            await panel.sessionContext.ready;
            return panel.sessionContext.session.kernel.name;
        }"""
    )
    assert kernel == KERNEL_NAME
    # Started, not awaited: the command's promise settles only when every cell has run.
    page.evaluate("() => { window.jupyterapp.commands.execute('notebook:run-all-cells'); }")

    # The panel appears and the step count advances.
    progress = ".nbresume-panel .nbresume-progress span[data-step]"
    page.wait_for_selector(f"{progress}[data-running='true']")
    first = int(attribute(page, progress, "data-step"))
    page.wait_for_function(
        """first => {
            const el = document.querySelector(".nbresume-panel .nbresume-progress [data-step]");
            return el && Number(el.dataset.step) > first;
        }""",
        arg=first,
    )
    page.wait_for_function(  # the rate and the time left, once measured
        """() => /steps\\/s · ETA/.test(
            document.querySelector(".nbresume-panel .nbresume-progress")?.textContent || "")"""
    )

    session = page.locator(".nbresume-panel .nbresume-session").first.inner_text()
    assert re.search(
        r"left \(NBRESUME_SESSION_CAP \(12 h\)\); nbresume saves and stops at", session
    )

    # A checkpoint saved on cadence shows as saved.
    checkpoint = ".nbresume-panel .nbresume-checkpoint span[data-state]"
    page.wait_for_selector(f"{checkpoint}[data-state='saved']")
    before = {i.step for i in CheckpointStore(run_dir, keep=None).list()}
    assert before
    assert all(step % 300 == 0 for step in before)

    # What a crash would lose: the last verified checkpoint and the steps since, no warning.
    at_risk = ".nbresume-panel .nbresume-at-risk span[data-warning='false']"
    page.wait_for_selector(f"{at_risk}:not([data-step=''])")
    assert int(attribute(page, at_risk, "data-step")) % 300 == 0
    assert re.search(
        r"last verified checkpoint: step [\d,]+, [^;]+; [\d,]+ steps? \(.+\) since",
        page.locator(at_risk).first.inner_text(),
    )

    # "Save now" while the training cell runs: saved at the next step boundary.
    page.locator(".nbresume-panel .nbresume-save").first.click()
    page.wait_for_function(
        """() => /save requested: nbresume saves after step/.test(
            document.querySelector(".nbresume-panel .nbresume-message")?.textContent || "")"""
    )
    message = page.locator(".nbresume-panel .nbresume-message").first.inner_text()
    asked = int(re.search(r"after step ([\d,]+)", message).group(1).replace(",", ""))  # type: ignore[union-attr]
    page.wait_for_function(
        """asked => {
            const el = document.querySelector(
                ".nbresume-panel .nbresume-checkpoint [data-state='saved']");
            return el && Number(el.dataset.step) >= asked;
        }""",
        arg=asked,
    )
    shown = int(attribute(page, checkpoint, "data-step"))
    assert asked <= shown <= asked + 2
    on_disk = {i.step for i in CheckpointStore(run_dir, keep=None).list()}
    assert shown in on_disk - before
    assert (run_dir / f"{shown:012d}" / "manifest.json").is_file()
    assert attribute(page, progress, "data-running") == "true"  # training carries on

    shot = tmp_path / "panel.png"
    page.locator(".nbresume-panel").first.screenshot(path=str(shot))
    if KEEP_SCREENSHOT:
        shutil.copyfile(shot, KEEP_SCREENSHOT)

    # "Stop and save": the loop saves and ends; the cell finishes.
    page.locator(".nbresume-panel .nbresume-stop").first.click()
    page.wait_for_selector(f"{progress}[data-running='false']")
    page.wait_for_function(
        """() => [...document.querySelectorAll(".jp-OutputArea-output")]
            .some(el => /training ended at step \\d+/.test(el.textContent))"""
    )
    ended = page.locator(".jp-OutputArea-output", has_text="training ended at step").first
    stopped = int(re.search(r"step (\d+)", ended.inner_text()).group(1))  # type: ignore[union-attr]
    assert "stopped" in page.locator(progress).first.inner_text()
    steps = [i.step for i in CheckpointStore(run_dir, keep=None).list()]
    assert steps[-1] == stopped
    assert CheckpointStore(run_dir).verify().ok
