"""The safety net: the status line and the panel always show the last verified checkpoint and
how much training a crash would lose now, and warn (once in the log, for a script nobody
watches) when that is more than twice the cadence.

Saves fail for real: a disk that fills up after the first checkpoint (an ``ENOSPC`` from the
operating system, through Python's audit hook, in a script of its own), or a file that takes the
place of the checkpoint folder. The training goes on through the failures, as a script that
catches ``CheckpointError`` does.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from nbresume import Checkpointer, CheckpointError
from nbresume.notebook.progress import UNSAVED_WARN_S, Tracker
from testkit.paths import with_testkit
from testkit.stateful import Weights
from testkit.terminal import stderr_on_a_terminal

#: every=2, and the disk is full from step 2 on: saves at 4, 6, ... fail while training goes
#: on; from step 7 on, more than 2 * 2 steps are at risk.
SCRIPT = textwrap.dedent(
    """
    import errno, os, sys, time
    import nbresume
    from testkit.stateful import Weights

    full = []

    def disk_full(event, args):
        if full and event == "os.mkdir" and ".nbresume-tmp-" in os.fsdecode(args[0]):
            raise OSError(errno.ENOSPC, "No space left on device", os.fsdecode(args[0]))

    sys.addaudithook(disk_full)

    run = nbresume.init("script", dir=sys.argv[1])
    model = Weights()
    ckpt = run.checkpointer(model=model, every=2, async_save=False)
    while True:
        try:
            for step in ckpt.steps(12):
                model.w += 1
                if step == 2:
                    full.append(True)  # step 2 is saved; from now on the disk is full
                time.sleep(0.01)
            break
        except nbresume.CheckpointError:
            print("save failed after step", ckpt.step, flush=True)
            if ckpt.step >= 12:
                break
    """
)

WARNING_TEXT = (
    "5 steps since the last verified checkpoint (step 2), more than twice every=2: a crash "
    "now would lose that training; check why saves fail"
)


def script_argv(tmp_path: Path) -> list[str]:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    return [sys.executable, str(script), str(tmp_path / "run")]


def test_log_lines_say_what_is_at_risk_and_warn_once(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        script_argv(tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=with_testkit(os.environ),
    )
    out, err = (b.decode() for b in proc.communicate(timeout=120))
    assert proc.returncode == 0, err
    failures = [line for line in out.splitlines() if line.startswith("save failed")]
    assert failures == [f"save failed after step {s}" for s in (4, 6, 8, 10, 12)]
    lines = err.splitlines()
    # Every failed save says which checkpoint is the last verified one, and what is at risk.
    failed = [re.search(r"saving step (\d+) FAILED: (.*)", line) for line in lines]
    failed_steps = [int(m.group(1)) for m in failed if m]
    assert failed_steps == [4, 6, 8, 10, 12]
    for match in filter(None, failed):
        step, text = int(match.group(1)), match.group(2)
        assert "ran out of space while writing a checkpoint" in text
        tail = re.search(
            r"; last verified checkpoint: step 2, [^;]+; (\d+) steps \(.+\) since$", text
        )
        assert tail is not None, text
        assert int(tail.group(1)) == step - 2
    # The warning, logged once when it first appeared (at step 7), with nothing else on its line.
    warnings = [line for line in lines if "more than twice" in line]
    assert warnings == [f"nbresume: {WARNING_TEXT}"]


def test_the_live_line_shows_the_warning(tmp_path: Path) -> None:
    code, output = stderr_on_a_terminal(
        script_argv(tmp_path), with_testkit({**os.environ, "COLUMNS": "400"})
    )
    assert code == 0
    text = output.decode().replace("\r\n", "\n")
    frames = [f.strip() for line in text.split("\n") for f in line.split("\r") if f.strip()]
    live = [f for f in frames if f.startswith("nbresume script: step ")]
    # Before the warning: the training since the last verified checkpoint, in every frame.
    early = [f for f in live if "WARNING" not in f]
    assert early
    since = re.compile(
        r" · \d+ steps? \(\d+ s\) "
        r"(since the last verified checkpoint|and no verified checkpoint yet) · last checkpoint "
    )
    assert all(since.search(f) for f in early), early
    assert re.search(r" · 0 steps \(\d+ s\) since the last verified checkpoint", " ".join(early))
    # Once it is due, the live line carries the warning...
    assert any(f"WARNING: {WARNING_TEXT}" in f for f in live)
    # ...and the logged warning starts on a line of its own.
    assert f"\nnbresume: {WARNING_TEXT}\n" in text


# -- the panel ----------------------------------------------------------------------------------

widgets = pytest.importorskip("ipywidgets", reason="needs ipywidgets (the notebook extra)")

from nbresume.notebook.panel import Panel  # noqa: E402


def data(html: str, name: str) -> str:
    return html.split(f'data-{name}="', 1)[1].split('"', 1)[0]


def test_the_panel_shows_what_is_at_risk(tracker: Tracker, tmp_path: Path) -> None:
    panel = Panel(tracker)
    tracker.add_view(panel)
    model = Weights(4)
    ckpt = Checkpointer(tmp_path / "run", every=5, async_save=False, deadline=None, model=model)
    seen = []
    for step in ckpt.steps(12):
        model.w += 1
        panel.render()
        seen.append((step, data(panel.at_risk.value, "step"), data(panel.at_risk.value, "steps")))
    # Steps since the last verified checkpoint (none before step 5), in the panel at each step.
    assert seen[:7] == [
        (0, "", ""), (1, "", "1"), (2, "", "2"), (3, "", "3"), (4, "", "4"),
        (5, "5", "0"), (6, "5", "1"),
    ]  # fmt: skip
    assert tracker.snapshot().at_risk.warning == ""
    html = panel.at_risk.value
    assert (data(html, "step"), data(html, "steps"), data(html, "warning")) == ("12", "0", "false")
    assert "last verified checkpoint: step 12" in html
    assert "WARNING" not in html


def test_the_panel_warns_when_saves_keep_failing(
    tracker: Tracker, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    panel = Panel(tracker)
    tracker.add_view(panel)
    folder = tmp_path / "run"
    model = Weights(4)
    # A second tracker watches too (the one nbresume.init starts): the warning is still
    # logged once.
    second = Tracker()
    second.start()
    ckpt = Checkpointer(folder, every=2, async_save=False, deadline=None, model=model)
    second.stop()
    failed_at = []
    with caplog.at_level(logging.WARNING, logger="nbresume"):
        while True:
            try:
                for step in ckpt.steps(10):
                    model.w += 1
                    if step == 2:  # step 2 is saved; then a file takes the folder's place
                        folder.rename(tmp_path / "moved")
                        folder.write_text("in the way")
                break
            except CheckpointError:
                failed_at.append(ckpt.step)
                if ckpt.step >= 10:
                    break
    assert failed_at == [4, 6, 8, 10]
    risk = tracker.snapshot().at_risk
    assert (risk.step, risk.steps) == (2, 8)
    assert risk.warning.startswith(
        "8 steps since the last verified checkpoint (step 2), more than twice every=2"
    )
    html = panel.at_risk.value
    assert (data(html, "step"), data(html, "steps"), data(html, "warning")) == ("2", "8", "true")
    assert "<b>WARNING:</b> 8 steps since the last verified checkpoint (step 2)" in html
    # Logged once, when it first appeared (at step 5), however many steps followed.
    logged = [r.getMessage() for r in caplog.records if "more than twice" in r.getMessage()]
    assert logged == [
        "nbresume: 5 steps since the last verified checkpoint (step 2), more than twice "
        "every=2: a crash now would lose that training; check why saves fail"
    ]


@pytest.mark.parametrize(
    ("every", "expected"),
    [
        ("15min", "1 h of training without a verified checkpoint, more than twice every=15 min"),
        (None, "1 h of training without a verified checkpoint (every=None saves only at the end"),
        ("auto", '1 h of training without a verified checkpoint (every="auto" has not saved yet)'),
    ],
)
def test_time_cadences_warn_after_twice_their_interval(
    every: str | None, expected: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # The tracker's clock is an hour ahead: the loop has then trained for an hour, unsaved.
    tracker = Tracker(clock=lambda: time.time() + 3600)
    tracker.start()
    try:
        model = Weights(4)
        ckpt = Checkpointer(
            tmp_path / "run", every=every, async_save=False, deadline=None, model=model
        )
        with caplog.at_level(logging.WARNING, logger="nbresume"):
            for step in ckpt.steps(3):
                model.w += 1
                if step == 1:
                    risk = tracker.snapshot().at_risk
        assert UNSAVED_WARN_S < 3600
        assert (risk.step, risk.steps) == (None, 1)
        assert risk.warning.startswith(expected), risk.warning
        logged = [r.getMessage() for r in caplog.records if "without a verified" in r.getMessage()]
        assert len(logged) == 1
        assert tracker.snapshot().at_risk.warning == ""  # the final save verified
    finally:
        tracker.stop()
