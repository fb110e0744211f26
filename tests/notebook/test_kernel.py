"""Clicks on the panel while the training cell runs, on a real kernel.

The test speaks the Jupyter protocol as a front-end does: it runs cells, learns the panel's
widgets from their ``comm_open`` messages, follows their updates, and clicks a button by sending
the ``comm_msg`` a browser sends. A kernel handles such messages only between cells unless
nbresume handles them at step boundaries; the next cell, queued meanwhile ("Run all"), must
still run after the training cell, once, with its output.
"""

from __future__ import annotations

import queue
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("ipykernel", reason="needs ipykernel (the test extra)")
pytest.importorskip("ipywidgets", reason="needs ipywidgets (the notebook extra)")

from jupyter_client.manager import KernelManager, start_new_kernel

from nbresume.checkpoint.store import CheckpointStore

from .conftest import KERNEL_NAME

SETUP = """
%load_ext nbresume
import time
import numpy as np
import nbresume

class Model:
    def __init__(self):
        self.w = np.zeros(8)
    def state_dict(self):
        return {"w": self.w.copy()}
    def load_state_dict(self, state):
        self.w = np.asarray(state["w"]).copy()

run = nbresume.init("kernel-test", dir=RUN_DIR, quiet=True)
model = Model()
"""

TRAIN = """
ckpt = run.checkpointer(model=model, every=None, async_save=False)
for step in ckpt.steps(TOTAL):
    model.w += 1
    time.sleep(0.002)
print("training ended at", ckpt.step, "done" if ckpt.done else "stopped")
"""

#: Far more steps than the test lets run: the loop ends only if "Stop and save" works.
TOTAL = 200_000


class Frontend:
    """A minimal front-end: runs cells, tracks widget models, clicks buttons."""

    def __init__(self, manager: KernelManager, client: Any) -> None:
        self.manager = manager
        self.client = client
        self.models: dict[str, dict[str, Any]] = {}  # comm id -> the widget's state
        self.outputs: dict[str, list[str]] = {}  # execute request id -> stdout text
        self.received: dict[str, dict[str, Any]] = {}  # request id -> its shell reply
        self.order: list[str] = []  # request ids, in the order their replies came

    def pump_iopub(self, timeout: float = 0.2) -> None:
        """Read every pending IOPub message into the widget models and the outputs."""
        while True:
            try:
                msg = self.client.get_iopub_msg(timeout=timeout)
            except queue.Empty:
                return
            timeout = 0.0
            kind, content = msg["msg_type"], msg["content"]
            parent = msg["parent_header"].get("msg_id", "")
            if kind == "comm_open":
                self.models[content["comm_id"]] = dict(content["data"].get("state", {}))
            elif kind == "comm_msg" and content["data"].get("method") == "update":
                self.models.setdefault(content["comm_id"], {}).update(content["data"]["state"])
            elif kind == "stream":
                self.outputs.setdefault(parent, []).append(content["text"])
            elif kind == "error":
                self.outputs.setdefault(parent, []).append("\n".join(content["traceback"]))

    def widget(self, css_class: str) -> tuple[str, dict[str, Any]]:
        """The (comm id, state) of the newest widget with ``css_class``."""
        found = [
            (comm, state)
            for comm, state in self.models.items()
            if css_class in state.get("_dom_classes", ())
        ]
        assert found, f"no widget with class {css_class}; models: {len(self.models)}"
        return found[-1]

    def wait_for(self, what: str, condition: Any, timeout: float = 60.0) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            self.pump_iopub()
            value = condition()
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}")

    def click(self, css_class: str) -> None:
        comm_id, _ = self.widget(css_class)
        content = {"comm_id": comm_id, "data": {"method": "custom", "content": {"event": "click"}}}
        self.client.shell_channel.send(self.client.session.msg("comm_msg", content))

    def reply(self, msg_id: str, timeout: float = 120.0) -> dict[str, Any]:
        """The shell reply to ``msg_id``; replies are recorded in the order they came."""
        deadline = time.monotonic() + timeout
        while msg_id not in self.received:
            assert time.monotonic() < deadline, f"no reply to {msg_id}"
            try:
                msg = self.client.get_shell_msg(timeout=1.0)
            except queue.Empty:
                continue
            parent = msg["parent_header"].get("msg_id", "")
            self.received[parent] = msg
            self.order.append(parent)
        return self.received[msg_id]

    def run(self, code: str) -> str:
        msg_id = self.client.execute(code)
        reply = self.reply(msg_id)
        self.pump_iopub()
        text = "".join(self.outputs.get(msg_id, []))
        assert reply["content"]["status"] == "ok", text
        return text


@pytest.fixture
def frontend(jupyter_env: dict[str, str]) -> Iterator[Frontend]:
    manager, client = start_new_kernel(kernel_name=KERNEL_NAME, startup_timeout=120)
    try:
        yield Frontend(manager, client)
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)


def data(html: str, name: str) -> str:
    match = re.search(rf'data-{name}="([^"]*)"', html)
    return match.group(1) if match else ""


def test_buttons_act_while_the_training_cell_runs(frontend: Frontend, tmp_path: Path) -> None:
    folder = tmp_path / "run"
    frontend.run(f"RUN_DIR = {str(folder)!r}\nTOTAL = {TOTAL}\n" + SETUP)
    frontend.pump_iopub()
    frontend.widget("nbresume-save")  # the panel was displayed by %load_ext

    training = frontend.client.execute(TRAIN)
    # The panel follows the steps live.
    first = int(
        frontend.wait_for(
            "the panel to show steps",
            lambda: data(frontend.widget("nbresume-progress")[1].get("value", ""), "step"),
        )
    )
    later = frontend.wait_for(
        "the step count to advance",
        lambda: int(data(frontend.widget("nbresume-progress")[1]["value"], "step") or 0) > first,
    )
    assert later

    # "Run all": the next cell is already queued while training runs.
    next_cell = frontend.client.execute("print('next cell saw step', ckpt.step)")

    frontend.click("nbresume-save")

    def saved_step() -> int:
        html = frontend.widget("nbresume-checkpoint")[1].get("value", "")
        return int(data(html, "step") or 0) if data(html, "state") == "saved" else 0

    saved = frontend.wait_for("the requested checkpoint to be saved", saved_step)
    assert 0 < saved < TOTAL
    assert [i.step for i in CheckpointStore(folder, keep=None).list()] == [saved]

    frontend.click("nbresume-stop")
    reply = frontend.reply(training)
    assert reply["content"]["status"] == "ok"
    frontend.pump_iopub()
    out = "".join(frontend.outputs.get(training, []))
    match = re.search(r"training ended at (\d+) stopped", out)
    assert match, out
    stopped = int(match.group(1))
    assert saved < stopped < TOTAL

    # The checkpoints on disk: the one asked for, and the one made when stopping.
    steps = [i.step for i in CheckpointStore(folder, keep=None).list()]
    assert steps == [saved, stopped]
    assert CheckpointStore(folder).verify().ok

    # The queued cell ran after the training cell, once, and saw where it stopped.
    assert frontend.reply(next_cell)["content"]["status"] == "ok"
    frontend.pump_iopub()
    assert "".join(frontend.outputs.get(next_cell, [])) == f"next cell saw step {stopped}\n"
    assert frontend.order.index(training) < frontend.order.index(next_cell)

    # The kernel is healthy afterwards: an ordinary cell, and a second training run resumes.
    assert frontend.run("print(1 + 1)") == "2\n"
    assert "stopped" in frontend.run(
        "ckpt = run.checkpointer(model=model, every=None, async_save=False)\n"
        "print(ckpt.restore(), 'stopped' if not ckpt.done else 'done')"
    )


def test_without_ipywidgets_the_kernel_gets_log_lines(frontend: Frontend, tmp_path: Path) -> None:
    folder = tmp_path / "run"
    setup = SETUP.replace("%load_ext nbresume", "import sys\nsys.modules['ipywidgets'] = None")
    frontend.run(f"RUN_DIR = {str(folder)!r}\nTOTAL = 30\n" + setup)
    loaded = frontend.run("%load_ext nbresume")
    assert "pip install ipywidgets" in loaded
    out = frontend.run(TRAIN.replace("every=None", "every=10"))
    assert "training ended at 30 done" in out
    assert re.search(r"\] nbresume: step 30 saved", out), out
    assert not frontend.models  # no widget was created
