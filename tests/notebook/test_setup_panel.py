"""The setup panel, in-process: the Kaggle choice between input checkpoints (real folders, real
Checkpointers), the danger clocks, the text for a terminal, and the training panel's metric
plot and clocks.

What a user relies on: choosing an input checkpoint makes the run's next Checkpointer resume
from exactly that one, "Start fresh" starts at step 0, nothing under /kaggle/input is ever
changed, and a checkpoint trained in this session is never removed by a choice.
"""

from __future__ import annotations

import gc
import hashlib
import html
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("ipywidgets", reason="needs ipywidgets (the notebook extra)")

import nbresume
from nbresume import Checkpointer
from nbresume.checkpoint import events
from nbresume.checkpoint.store import CheckpointStore
from nbresume.errors import CorruptCheckpointError, UsageError
from nbresume.notebook import progress
from nbresume.notebook.panel import Panel
from nbresume.notebook.progress import Tracker
from nbresume.notebook.setup_panel import (
    SetupPanel,
    choose_input,
    clock_lines,
    input_checkpoints,
    setup_text,
)
from nbresume.platforms import by_name

NAME = "tiny-run"


@pytest.fixture(autouse=True)
def fresh_tracker(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The process tracker and the checkpointer watchers start empty for each test."""
    monkeypatch.setattr(progress._TRACKER, "made", None)
    monkeypatch.setattr(events, "_watchers", [])
    progress.tracker()  # as in a notebook, where init shows the run before any Checkpointer
    yield
    if progress._TRACKER.made is not None:
        progress._TRACKER.made.stop()


@pytest.fixture
def kaggle(monkeypatch: pytest.MonkeyPatch, clean_env: Path) -> Path:
    """An interactive Kaggle session whose notebook has two earlier versions attached as
    inputs: one with steps 10 and 20, the other (in the newer layout) with step 30."""
    root = clean_env / "kaggle"
    (root / "working").mkdir(parents=True)
    monkeypatch.setenv("NBRESUME_KAGGLE_ROOT", str(root))
    monkeypatch.setenv("KAGGLE_KERNEL_RUN_TYPE", "Interactive")
    first = root / "input" / "tiny-v1" / "nbresume" / NAME
    second = root / "input" / "notebooks" / "someone" / "tiny-v2" / "nbresume" / NAME
    save(first, 10)
    save(first, 20)
    save(second, 30)
    return root


def save(folder: Path, step: int) -> None:
    """A checkpoint as an earlier version wrote it: its step is in its state too."""
    ckpt = Checkpointer(folder, every=None, keep=None, deadline=None, async_save=False)
    ckpt["trained"] = {"up_to": step}
    ckpt.save(step=step)
    ckpt.close()
    del ckpt
    gc.collect()  # a writer long gone, as an earlier version's is


def flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def tree_digest(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def init(accelerator: str | None = None) -> nbresume.Run:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a failed check only warns here
        return nbresume.init(NAME, accelerator=accelerator, quiet=True)


def resumed_state(run: nbresume.Run) -> tuple[int, Any]:
    """What the run's next Checkpointer resumes from: its step and the state saved with it."""
    ckpt = run.checkpointer(every=None, async_save=False)
    ckpt["trained"] = {"up_to": 0}
    step = ckpt.restore()
    state = ckpt["trained"]
    ckpt.close()
    del ckpt
    gc.collect()  # gone, as a notebook's Checkpointer is once its name is reused
    return step, state


def test_inputs_are_listed_newest_verified_first(kaggle: Path) -> None:
    broken = kaggle / "input" / "tiny-v1" / "nbresume" / NAME / f"{20:012d}"
    victim = next(p for p in sorted(broken.iterdir()) if p.name != "manifest.json")
    flip_last_byte(victim)

    found = input_checkpoints(NAME)

    assert [(c.step, c.verified) for c in found] == [(30, True), (10, True), (20, False)]
    assert found[2].problem
    assert found[0].folder.endswith("tiny-v2/nbresume/" + NAME)
    assert "step 30" in found[0].label()
    assert "verified" in found[0].label()
    assert found[0].created[:4].isdigit()  # a date from the manifest


def test_past_the_read_back_budget_a_choice_is_checked_when_made(kaggle: Path) -> None:
    run = init()
    found = input_checkpoints(NAME, verify_bytes=0)  # nothing read back while listing
    assert [(c.step, c.verified) for c in found] == [(30, None), (20, None), (10, None)]
    assert "not read back yet" in found[0].label()
    broken = kaggle / "input" / "tiny-v1" / "nbresume" / NAME / f"{20:012d}"
    victim = next(p for p in sorted(broken.iterdir()) if p.name != "manifest.json")
    flip_last_byte(victim)

    with pytest.raises(CorruptCheckpointError) as caught:
        choose_input(run, found[1])
    assert caught.value.where == found[1].location
    # Refused before anything changed: the copy init made is still what the run resumes from.
    assert [i.step for i in CheckpointStore(run.dir, keep=None).list()] == [30]


def test_choosing_an_older_input_resumes_from_it(kaggle: Path) -> None:
    inputs = tree_digest(kaggle / "input")
    run = init()
    assert run.seeded is not None
    assert run.seeded.step == 30

    chosen = next(c for c in input_checkpoints(NAME) if c.step == 20)
    said = choose_input(run, chosen)

    assert "resumes from step 20" in said
    assert resumed_state(run) == (20, {"up_to": 20})
    assert [i.step for i in CheckpointStore(run.dir, keep=None).list()] == [20]
    assert run.seeded is not None
    assert run.seeded.step == 20
    assert tree_digest(kaggle / "input") == inputs  # read-only on Kaggle: untouched

    # Changing one's mind back to the newest works the same way.
    newest = next(c for c in input_checkpoints(NAME) if c.step == 30)
    choose_input(run, newest)
    assert resumed_state(run) == (30, {"up_to": 30})


def test_start_fresh_removes_only_the_copy_and_starts_at_zero(kaggle: Path) -> None:
    inputs = tree_digest(kaggle / "input")
    run = init()

    said = choose_input(run, None)

    assert "step 0" in said
    assert CheckpointStore(run.dir, keep=None).list() == []
    assert resumed_state(run) == (0, {"up_to": 0})
    assert run.seeded is None
    assert tree_digest(kaggle / "input") == inputs


def test_a_checkpoint_trained_here_is_never_removed_by_a_choice(kaggle: Path) -> None:
    run = init()
    save(Path(run.dir), 45)  # trained in this session, after the copy of step 30

    chosen = next(c for c in input_checkpoints(NAME) if c.step == 10)
    with pytest.raises(UsageError) as caught:
        choose_input(run, chosen)
    assert "step 45" in str(caught.value)
    assert caught.value.where == run.dir
    assert caught.value.fix
    with pytest.raises(UsageError):
        choose_input(run, None)
    assert [i.step for i in CheckpointStore(run.dir, keep=None).list()] == [30, 45]


def test_a_choice_after_the_checkpointer_restored_is_refused(kaggle: Path) -> None:
    run = init()
    ckpt = run.checkpointer(every=None, async_save=False)
    ckpt["trained"] = {"up_to": 0}
    assert ckpt.restore() == 30
    chosen = next(c for c in input_checkpoints(NAME) if c.step == 20)
    with pytest.raises(UsageError, match="already in use, at step 30"):
        choose_input(run, chosen)
    ckpt.close()


def test_the_widget_offers_the_inputs_and_applies_the_choice(kaggle: Path) -> None:
    run = init()
    panel = SetupPanel(run.report, run)

    labels = [label for label, _ in panel.inputs.options]
    assert [label.split(" · ")[0] for label in labels[:-1]] == ["step 30", "step 20", "step 10"]
    assert labels[-1].startswith("Start fresh")
    assert panel.inputs.value == 0  # the checkpoint init copied in
    assert 'data-resume-step="30"' in panel.choice.value
    assert panel.kaggle_box.layout.display is None
    assert panel.drive_box.layout.display == "none"
    assert "Kaggle output folder" in panel.folder.value

    panel.inputs.value = 2  # step 10
    panel.choose_button.click()

    assert 'data-resume-step="10"' in panel.choice.value, panel.message.value
    assert resumed_state(run) == (10, {"up_to": 10})

    panel.inputs.value = -1
    panel.choose_button.click()
    assert 'data-resume-step="0"' in panel.choice.value
    assert resumed_state(run) == (0, {"up_to": 0})


def test_every_preflight_check_is_a_row_with_its_fix(kaggle: Path) -> None:
    run = init(accelerator="gpu")  # no GPU on this machine: that check fails, with its fix
    panel = SetupPanel(run.report, run)
    for check in run.report.checks:
        assert f'data-check="{check.name}" data-status="{check.status}"' in panel.checks.value
    gpu = run.report["accelerator"]
    assert gpu.status == "fail"
    assert html.escape(gpu.fix, quote=True) in panel.checks.value
    assert "Kaggle (interactive)" in panel.title.value


def test_kaggle_clocks_name_the_cap_and_the_weekly_quota(kaggle: Path) -> None:
    lines = {c.name: c for c in clock_lines(by_name("kaggle"))}
    assert lines["session cap"].cap
    assert lines["session cap"].seconds_left is not None
    assert 0 < lines["session cap"].seconds_left <= 12 * 3600
    assert "left" in lines["session cap"].text
    # No GPU in this test machine: the session spends none of the weekly quota.
    assert "no GPU attached" in lines["weekly GPU quota"].text


def test_colab_clocks_include_idle_closed_tab_and_the_vm_lifetime(clean_env: Path) -> None:
    lines = {c.name: c for c in clock_lines(by_name("colab"))}
    assert "1 h 30 min without activity" in lines["idle disconnect"].text
    assert "browser tab open" in lines["closed tab"].text
    assert lines["VM lifetime"].cap
    assert "left" in lines["VM lifetime"].text


def test_colab_panel_shows_drive_not_mounted_with_the_button(
    monkeypatch: pytest.MonkeyPatch, clean_env: Path
) -> None:
    from nbresume.preflight_checks import preflight

    monkeypatch.setenv("NBRESUME_DRIVE_MOUNT", str(clean_env / "drive"))
    colab = by_name("colab")
    report = preflight(platform=colab)
    panel = SetupPanel(report, platform=colab)
    assert 'data-mounted="false"' in panel.drive.value
    assert not panel.mount_button.disabled
    assert panel.kaggle_box.layout.display == "none"
    assert 'data-clock="closed tab"' in panel.clocks.value
    # Clicking it is the browser test's (importing google.colab here would make this whole
    # process look like Colab).


def test_setup_text_for_a_terminal(kaggle: Path) -> None:
    run = init()
    text = setup_text(run.report, run)
    assert text.startswith("nbresume setup · Kaggle (interactive)")
    assert f"run folder: {run.dir}" in text
    assert "input checkpoint: step 30" in text
    assert "resumes from step 30" in text
    assert "clock session cap:" in text


# -- the training panel's additions ----------------------------------------------------------


def test_training_panel_plots_the_metric_given_to_save(panel: Panel, tmp_path: Path) -> None:
    ckpt = Checkpointer(tmp_path / "run", every=None, keep=None, deadline=None)
    losses = []
    for step in ckpt.steps(45):  # the final save at 45 has no metric
        if step % 10 == 9:
            losses.append(1.0 / (step + 1))
            ckpt.save(metric={"loss": losses[-1], "acc": step / 40}, block=True)
    ckpt.close()
    panel.render()
    assert 'data-metric="loss"' in panel.plot.value
    assert f'data-points="{len(losses)}"' in panel.plot.value
    assert f'data-last="{losses[-1]!r}"' in panel.plot.value
    assert "<polyline" in panel.plot.value

    # A new panel on the same folder shows the history at once.
    fresh = Tracker()
    fresh.start()
    try:
        again = Checkpointer(tmp_path / "run", every=None, keep=None, deadline=None)
        fresh.attach(again)
        view = Panel(fresh)
        assert f'data-points="{len(losses)}"' in view.plot.value
        again.close()
    finally:
        fresh.stop()


def test_training_panel_without_metrics_shows_no_plot(panel: Panel, tmp_path: Path) -> None:
    ckpt = Checkpointer(tmp_path / "run", every=5, deadline=None, async_save=False)
    for _ in ckpt.steps(12):
        pass
    ckpt.close()
    panel.render()
    assert panel.plot.value == ""
    assert 'data-age="' in panel.at_risk.value  # the time since the last verified one


def test_training_panel_shows_the_platform_clocks(kaggle: Path) -> None:
    run = init()
    tracker = Tracker()
    tracker.set_run(run)
    panel = Panel(tracker)
    assert "danger clocks:" in panel.clocks.value
    assert "weekly GPU quota" in panel.clocks.value
    assert "session cap" not in panel.clocks.value  # the session row shows that one
    assert "left" in panel.session.value
