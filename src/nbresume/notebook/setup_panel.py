"""The setup panel: where the run is and what to do before training, in the first cell.

Shown by ``nbresume.init`` and ``%load_ext nbresume`` in a notebook, built from core ipywidgets
controls (HTML, Button, RadioButtons, boxes), with the same information as text for a terminal
(:func:`setup_text`):

- the platform found, and each preflight check with its state and its fix;
- on Colab: whether Drive is mounted, a "Mount Drive" button (``google.colab.drive``), the run
  folder on Drive and the Drive quota left;
- on Kaggle: ``/kaggle/working`` and the checkpoints of the run found under ``/kaggle/input``
  (newest verified first), with a choice between resuming from one and starting fresh;
- the platform's danger clocks (:func:`clock_lines`, also shown by the training panel).

The data behind it are plain functions (:func:`input_checkpoints`, :func:`choose_input`,
:func:`drive_facts`), so the choice made with a click is the same one a test or a script makes.
"""

from __future__ import annotations

import contextlib
import html
import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nbresume import knobs
from nbresume.checkpoint import forksafe
from nbresume.checkpoint.backends import DriveApi
from nbresume.checkpoint.format import MANIFEST_NAME
from nbresume.checkpoint.loop import session_started_at
from nbresume.checkpoint.store import CheckpointStore
from nbresume.checkpoint.units import format_bytes, format_duration
from nbresume.errors import CorruptCheckpointError, UsageError
from nbresume.platforms import by_name
from nbresume.platforms.gpu import accelerator_attached
from nbresume.platforms.kaggle import _copy_checkpoint, find_seed_folders

if TYPE_CHECKING:
    from nbresume.checkpoint.store import CheckpointInfo, CheckpointStore
    from nbresume.platforms.base import Platform
    from nbresume.preflight_checks import Report
    from nbresume.run import Run

log = logging.getLogger("nbresume")

#: At most this many checkpoints found under /kaggle/input are offered (the newest).
MAX_INPUTS = 10
#: How many bytes of input checkpoints are read back to list them; the rest are read back
#: when chosen (inputs can hold many large checkpoints).
VERIFY_BUDGET_BYTES = 4_000_000_000
#: What the free tier of Colab asks of the browser; Colab publishes no figure for it.
CLOSED_TAB_TEXT = (
    "the free tier needs the browser tab open (Colab publishes no figure for how long a "
    "closed tab lasts)"
)
#: What a clock that runs on no known timer shows (the training panel leaves those out).
NO_TIMER = "no fixed timer"
#: Community figure; Kaggle shows the real one on its settings page and `kaggle quota`.
KAGGLE_WEEKLY_GPU_S = 30 * 3600.0

_STATUS_COLOR = {"ok": "#15803d", "warn": "#b45309", "fail": "#b91c1c"}
_STATUS_LABEL = {"ok": "ok", "warn": "warn", "fail": "FAIL"}


def _esc(text: object) -> str:
    return html.escape(str(text), quote=True)


# -- danger clocks -----------------------------------------------------------------------------


@dataclass(frozen=True)
class ClockLine:
    """One danger clock as shown: its name, what is known of it now, and what it costs."""

    name: str
    text: str
    #: Seconds until it strikes, when it runs on a known timer.
    seconds_left: float | None = None
    loses: str = ""
    protection: str = ""
    #: Whether it is the session cap (the training panel's session row shows that one).
    cap: bool = False


def clock_lines(platform: Platform, now: float | None = None) -> list[ClockLine]:
    """The danger clocks of ``platform`` with what is left of each, as far as it is known."""
    now = time.time() if now is None else now
    accelerated = accelerator_attached()
    try:
        deadline, _ = platform.session_deadline(accelerated)
        started = session_started_at()
    except Exception as exc:  # a bad NBRESUME_SESSION_CAP is the preflight's to report
        log.debug("nbresume: session clock unknown: %s", exc)
        deadline, started = None, None
    cap_s = platform.session_cap_s(accelerated)
    lines = []
    for clock in platform.danger_clocks(accelerated):
        is_cap = clock.seconds is not None and clock.seconds == cap_s
        left = None
        if is_cap and deadline is not None:
            left = deadline - now
            text = f"{format_duration(max(0.0, left))} left (ends {_clock(deadline)})"
        elif clock.name == "weekly GPU quota":
            text = _weekly_quota_text(accelerated, started, now)
        elif clock.name == "idle disconnect" and clock.seconds is not None:
            text = f"after about {format_duration(clock.seconds)} without activity"
        elif clock.name == "job time limit" and clock.seconds is not None:
            left = clock.seconds  # the platform counts it down itself
            text = f"{format_duration(left)} left"
        elif clock.seconds is not None:
            text = f"a {format_duration(clock.seconds)} timer"
        else:
            text = NO_TIMER
        lines.append(ClockLine(clock.name, text, left, clock.loses, clock.protection, is_cap))
        if platform.name == "colab" and clock.name == "idle disconnect":
            lines.append(ClockLine("closed tab", CLOSED_TAB_TEXT))
    return lines


def _weekly_quota_text(accelerated: bool, started: float | None, now: float) -> str:
    """What is known of the weekly GPU quota: the community figure and this session's use."""
    if not accelerated:
        return "no GPU attached: this session spends none of it"
    text = f"about {format_duration(KAGGLE_WEEKLY_GPU_S)} a week (community figure"
    text += "; `kaggle quota` or the settings page has yours)"
    if started is not None:
        text += f"; this session has used {format_duration(max(0.0, now - started))}"
    return text


def _clock(when: float) -> str:
    return time.strftime("%H:%M", time.localtime(when))


def clocks_text(lines: list[ClockLine], *, brief: bool = False) -> str:
    """``"idle disconnect: after about 1 h 30 min without activity · ..."`` on one line;
    ``brief`` leaves out the session cap (the training panel's session row shows it) and the
    clocks on no known timer."""
    return " · ".join(
        f"{c.name}: {c.text}" for c in lines if not (brief and (c.cap or c.text == NO_TIMER))
    )


# -- Colab: Google Drive -----------------------------------------------------------------------


@dataclass(frozen=True)
class DriveFacts:
    """Google Drive as the setup panel shows it."""

    mount: str
    mounted: bool
    #: Bytes left in the Drive quota (``None``: unknown or unlimited; see ``quota_text``).
    free: int | None = None
    quota_text: str = ""


def drive_facts(*, ask_quota: bool = True) -> DriveFacts:
    """Whether Drive is mounted and, once it is (and ``ask_quota``), how much quota is left,
    as Drive's API reports it (trashed files count against it)."""
    mount = knobs.drive_mount()
    mounted = (mount / "MyDrive").is_dir()
    if not mounted or not ask_quota:
        return DriveFacts(str(mount), mounted, None, "" if mounted else "known once mounted")
    try:
        quota = DriveApi.shared().quota()
    except Exception as exc:
        return DriveFacts(str(mount), True, None, f"unknown ({exc})")
    limit, usage = quota.get("limit"), quota.get("usage")
    if limit is None:
        return DriveFacts(str(mount), True, None, "no limit reported")
    if usage is None:
        return DriveFacts(str(mount), True, None, f"unknown usage of {format_bytes(limit)}")
    free = max(0, limit - usage)
    return DriveFacts(str(mount), True, free, f"{format_bytes(free)} free of {format_bytes(limit)}")


def mount_drive() -> str:
    """Mount Google Drive (``google.colab.drive.mount``) where nbresume expects it; what
    happened, in a sentence. Raises :class:`~nbresume.errors.StorageError` with the fix."""
    from nbresume.platforms.drive import mount_drive as mount

    my_drive = mount(str(knobs.drive_mount()))
    return f"Drive is mounted: {my_drive}"


# -- Kaggle: checkpoints of earlier versions -----------------------------------------------------


@dataclass(frozen=True)
class InputCheckpoint:
    """A checkpoint of the run found under ``/kaggle/input``."""

    step: int
    #: When it was written (ISO 8601, from its manifest).
    created: str
    #: The checkpoint's folder, and the ``nbresume/<name>`` folder it is in.
    location: str
    folder: str
    #: Whether it reads back whole (``None``: not read back yet; it is when chosen).
    verified: bool | None
    problem: str = ""

    @property
    def source(self) -> str:
        """The input it is in, as Kaggle names it under /kaggle/input (``"resnet-v2"``)."""
        parts = Path(self.folder).parts
        input_root = (knobs.kaggle_root() / "input").parts
        inside = parts[len(input_root) : -2] if parts[: len(input_root)] == input_root else ()
        return "/".join(inside) or self.folder

    def label(self) -> str:
        """``"step 1,500 · 2026-11-23 21:04 · verified · input resnet-v2"``."""
        date = self.created[:16].replace("T", " ")
        state = {True: "verified", None: "not read back yet"}.get(
            self.verified, f"does NOT verify ({self.problem})"
        )
        return f"step {self.step:,} · {date} · {state} · input {self.source}"


def input_checkpoints(
    name: str, input_root: Path | None = None, *, verify_bytes: int = VERIFY_BUDGET_BYTES
) -> list[InputCheckpoint]:
    """The checkpoints of run ``name`` under ``/kaggle/input`` (every ``nbresume/<name>``
    folder the inputs hold), at most :data:`MAX_INPUTS`, the newest: verified ones first, newest
    first, then those not read back yet, then those that do not verify. The newest are read
    back whole while their sizes add up to ``verify_bytes`` at most."""
    root = input_root if input_root is not None else knobs.kaggle_root() / "input"
    found: list[tuple[int, int, CheckpointStore, CheckpointInfo, Path]] = []
    for order, folder in enumerate(find_seed_folders(root, name)):
        store = CheckpointStore(folder, keep=None)
        with contextlib.suppress(Exception):  # an unreadable input is passed over
            found += [(info.step, -order, store, info, folder) for info in store.list()]
    found.sort(key=lambda f: (f[0], f[1]), reverse=True)
    result = []
    budget = verify_bytes
    for _step, _order, store, info, folder in found[:MAX_INPUTS]:
        verified: bool | None = None
        problem = ""
        if info.size <= budget:
            budget -= info.size
            verified, problem = _verify(store, info.step)
        result.append(
            InputCheckpoint(info.step, info.created, info.location, str(folder), verified,
                            problem)
        )  # fmt: skip
    rank = {True: 2, None: 1, False: 0}
    result.sort(key=lambda c: (rank[c.verified], c.step), reverse=True)
    return result


def _verify(store: CheckpointStore, step: int) -> tuple[bool, str]:
    """Whether the checkpoint of ``step`` reads back whole, and the problem if not."""
    try:
        checked = store.verify(step)
    except Exception as exc:
        return False, str(exc)
    return (True, "") if checked.ok else (False, _problem(checked))


def _problem(report: Any) -> str:
    results = getattr(report, "results", ())
    return results[0].problem if results else "missing"


def choose_input(run: Run, choice: InputCheckpoint | None) -> str:
    """Make ``run``'s Checkpointer resume from ``choice`` (``None``: start fresh).

    The run's folder must then hold nothing newer than the choice: checkpoints there that are
    copies of input checkpoints (what ``nbresume.init`` seeded) are removed, the chosen one is
    copied in and verified. Nothing under ``/kaggle/input`` is touched, and a checkpoint that
    was trained here (no copy of an input) is never removed: the choice is refused instead.
    Returns what was done, in a sentence.
    """
    _refuse_after_restore(run)
    target = CheckpointStore(run.dir, keep=None)
    here = target.list()

    def kept(info: CheckpointInfo) -> bool:
        return choice is not None and info.step == choice.step and _same_as(target, info, choice)

    newer = [i for i in here if i.step >= (choice.step if choice else 0) and not kept(i)]
    originals = [i for i in newer if not _is_input_copy(target, i, run)]
    if originals:
        steps = ", ".join(f"{i.step:,}" for i in originals)
        raise UsageError(
            f"the run folder holds checkpoints trained here (step {steps}), which the "
            "Checkpointer would resume from instead",
            where=run.dir,
            fix="choose before training, or pass another dir= to nbresume.init to start "
            "from an input checkpoint",
        )
    copied = next((i for i in here if kept(i)), None)
    source = CheckpointStore(choice.folder, keep=None) if choice is not None else None
    if choice is not None and source is not None and copied is None:
        ok, problem = _verify(source, choice.step)
        if not ok:  # refused before anything in the run folder changes
            raise CorruptCheckpointError(
                f"checkpoint {choice.step:,} does not verify: {problem}",
                where=choice.location,
                fix="choose another checkpoint, or start fresh",
            )
    for info in newer:
        target.backend.delete(info.name)  # a copy: the original stays on the input
    if choice is not None and source is not None and copied is None:
        info = next(i for i in source.list() if i.step == choice.step)
        copied = _copy_checkpoint(source, info, target)
    run.seeded = copied
    run.platform.seeded = run.seeded
    _show_folder_again(run)
    if choice is None:
        return "starting fresh: the next Checkpointer of this run starts at step 0"
    return (
        f"the next Checkpointer of this run resumes from step {choice.step:,} "
        f"(copied from input {choice.source})"
    )


def _refuse_after_restore(run: Run) -> None:
    """A Checkpointer that already restored (or saved) would not see the choice; one that was
    only created restores at its first loop, and sees it."""
    from nbresume.notebook.progress import tracker

    ckpt = tracker().checkpointer
    if ckpt is None or not ckpt.started:
        return
    if str(ckpt.store.location).rstrip("/") != run.dir.rstrip("/"):
        return
    raise UsageError(
        f"a Checkpointer of this run is already in use, at step {ckpt.step:,}: it would not "
        "see the choice",
        where=run.dir,
        fix="choose in the setup panel before the training cell, or restart the kernel",
    )


def _manifest_bytes(store: CheckpointStore, name: str) -> bytes:
    with store.backend.open_read(name, MANIFEST_NAME) as reader:
        return reader.read()


def _is_input_copy(target: CheckpointStore, info: CheckpointInfo, run: Run) -> bool:
    """Whether ``info`` in the run folder is a copy of a checkpoint under /kaggle/input."""
    mine = _manifest_bytes(target, info.name)
    for folder in find_seed_folders(knobs.kaggle_root() / "input", run.name):
        source = CheckpointStore(folder, keep=None)
        for other in source.list():
            if other.step == info.step and _manifest_bytes(source, other.name) == mine:
                return True
    return False


def _same_as(target: CheckpointStore, info: CheckpointInfo, choice: InputCheckpoint) -> bool:
    source = CheckpointStore(choice.folder, keep=None)
    other = next((i for i in source.list() if i.step == choice.step), None)
    return other is not None and _manifest_bytes(source, other.name) == _manifest_bytes(
        target, info.name
    )


def _show_folder_again(run: Run) -> None:
    """The training panel shows the run folder's newest checkpoint: read it again."""
    from nbresume.notebook.progress import tracker

    shown = tracker()
    if shown.run is run and shown.checkpointer is None:
        shown.set_run(None)
        shown.set_run(run)


# -- text --------------------------------------------------------------------------------------


def setup_text(report: Report, run: Run | None = None, platform: Platform | None = None) -> str:
    """The setup panel as text (for a terminal)."""
    here = run.platform if run is not None else platform or by_name(report.platform)
    lines = [f"nbresume setup · {report.platform_title}: {report.verdict()}"]
    for check in report.checks:
        line = f"  {_STATUS_LABEL[check.status]:4} {check.name}: {check.seen}"
        lines.append(line + (f" (fix: {check.fix})" if check.status != "ok" and check.fix else ""))
    if run is not None:
        lines.append(f"  run folder: {run.dir}")
    if here.name == "colab":
        drive = drive_facts()
        state = f"mounted at {drive.mount}" if drive.mounted else "not mounted"
        lines.append(f"  Google Drive: {state}; quota: {drive.quota_text}")
    if here.name.startswith("kaggle") and run is not None:
        for found in input_checkpoints(run.name):
            lines.append(f"  input checkpoint: {found.label()}")
        if run.seeded is not None:
            lines.append(f"  resumes from step {run.seeded.step:,} (copied from an input)")
    for clock in clock_lines(here):
        lines.append(f"  clock {clock.name}: {clock.text}")
    return "\n".join(lines)


_PRINTED = threading.Event()


def print_text(run: Run) -> bool:
    """In a terminal: print the run's summary followed by the rest of :func:`setup_text`
    (every check with its fix, the inputs, the clocks), once per process as the panel is
    shown once in a notebook. Return whether it printed; the caller prints the summary alone
    otherwise."""
    if _PRINTED.is_set():
        return False
    _PRINTED.set()
    try:
        details = setup_text(run.report, run).splitlines()[1:]  # the summary says the verdict
    except Exception:  # the first lines of a script must not fail for a display
        log.exception("nbresume: the setup text failed")
        return False
    head = run.summary().splitlines()[: 3 if run.seeded is not None else 2]
    said = ("  run folder:", "  resumes from step")  # the summary's head says these
    print("\n".join(head + [line for line in details if not line.startswith(said)]))
    return True


# -- the widget --------------------------------------------------------------------------------


class SetupPanel:
    """The widget tree; ``panel.widget`` is what gets displayed."""

    def __init__(
        self, report: Report, run: Run | None = None, platform: Platform | None = None
    ) -> None:
        import ipywidgets as widgets

        self.report = report
        self.run = run
        self.platform = run.platform if run is not None else platform or by_name(report.platform)
        self._lock = forksafe.lock()
        self._inputs: list[InputCheckpoint] = []
        self.title = widgets.HTML()
        self.checks = widgets.HTML()
        self.folder = widgets.HTML()
        self.drive = widgets.HTML()
        self.mount_button = widgets.Button(
            description="Mount Drive", icon="hdd-o", tooltip="google.colab.drive.mount"
        )
        self.inputs = widgets.RadioButtons(options=[], layout=widgets.Layout(width="auto"))
        self.choose_button = widgets.Button(
            description="Use this choice",
            icon="check",
            tooltip="Resume from the checkpoint chosen above, or start fresh",
        )
        self.choice = widgets.HTML()
        self.clocks = widgets.HTML()
        self.message = widgets.HTML()
        self.drive_box = widgets.VBox([self.drive, self.mount_button])
        self.kaggle_box = widgets.VBox([self.inputs, self.choose_button, self.choice])
        self.widget = widgets.VBox(
            [self.title, self.checks, self.folder, self.drive_box, self.kaggle_box, self.clocks,
             self.message],
            layout=widgets.Layout(
                border="1px solid #d4d4d8", padding="4px 10px", margin="4px 0", width="auto"
            ),
        )  # fmt: skip
        self.widget.add_class("nbresume-setup")
        for name in ("title", "checks", "folder", "drive", "inputs", "choice", "clocks", "message"):
            getattr(self, name).add_class(f"nbresume-setup-{name}")
        self.mount_button.add_class("nbresume-mount")
        self.choose_button.add_class("nbresume-choose")
        self.mount_button.on_click(self._on_mount)
        self.choose_button.on_click(self._on_choose)
        self.set_run(run)

    def set_run(self, run: Run | None) -> None:
        """Show ``run`` (after ``nbresume.init``): its folder and, on Kaggle, its inputs."""
        with self._lock:
            self.run = run
            if run is not None:
                self.report = run.report
                self.platform = run.platform
            kaggle = self.platform.name.startswith("kaggle") and run is not None
            self._inputs = input_checkpoints(run.name) if kaggle and run is not None else []
            options: list[tuple[str, int]] = [(c.label(), i) for i, c in enumerate(self._inputs)]
            options.append(("Start fresh (nothing under /kaggle/input is deleted)", -1))
            self.inputs.options = options
            self.inputs.value = self._default_choice()
            self.choice.value = self.message.value = ""  # what the run resumes from: anew
        self.render()

    def _default_choice(self) -> int:
        """The checkpoint the run resumes from now (the one init seeded), else the newest."""
        seeded = self.run.seeded if self.run is not None else None
        for index, found in enumerate(self._inputs):
            if seeded is not None and found.step == seeded.step:
                return index
        return 0 if self._inputs and seeded is not None else -1

    def render(self) -> None:
        """Redraw every part (the Drive quota is asked again)."""
        report, run, here = self.report, self.run, self.platform
        why = here.why()
        self.title.value = (
            f"<b>nbresume setup</b> · {_esc(report.platform_title)}"
            + (f' <span style="color:#71717a">({_esc(why)})</span>' if why else "")
            + f" · preflight: {_esc(report.verdict())}"
        )
        self.checks.value = _checks_html(report)
        self.folder.value = (
            f'<span data-dir="{_esc(run.dir)}">run folder: <code>{_esc(run.dir)}</code></span>'
            if run is not None
            else "run folder: chosen by <code>nbresume.init(name)</code>"
        )
        colab = here.name == "colab"
        self.drive_box.layout.display = None if colab else "none"
        if colab:
            self._render_drive()
        kaggle = here.name.startswith("kaggle")
        self.kaggle_box.layout.display = None if kaggle and run is not None else "none"
        if kaggle:
            self.folder.value += _kaggle_working_html()
            if run is not None and not self.choice.value:
                step = run.seeded.step if run.seeded is not None else None
                self.choice.value = _choice_html(
                    step,
                    f"resumes from step {step:,} (copied from an input by nbresume.init)"
                    if step is not None
                    else "no input checkpoint copied: the run starts from its folder",
                )
        lines = clock_lines(here)
        rows = "".join(
            f'<tr data-clock="{_esc(c.name)}"><td style="padding:0 12px 0 0;color:#71717a">'
            f'{_esc(c.name)}</td><td style="padding:0">{_esc(c.text)}</td></tr>'
            for c in lines
        )
        self.clocks.value = (
            f'<b>danger clocks</b><table style="border-collapse:collapse;line-height:1.4">'
            f"{rows}</table>"
            if rows
            else ""
        )

    def _render_drive(self) -> None:
        facts = drive_facts()
        state = f"mounted at <code>{_esc(facts.mount)}</code>" if facts.mounted else "not mounted"
        folder = ""
        if self.run is None:
            folder = f"; runs go to <code>{_esc(self.platform.durable_base())}/NAME</code>"
        self.drive.value = (
            f'<span data-mounted="{"true" if facts.mounted else "false"}">Google Drive: {state}'
            f"</span>{folder}<br>"
            f'<span class="nbresume-quota">Drive quota: {_esc(facts.quota_text)}</span>'
        )
        self.mount_button.disabled = facts.mounted
        self.mount_button.description = "Drive mounted" if facts.mounted else "Mount Drive"

    # -- buttons ---------------------------------------------------------------------------

    def _say(self, text: str, status: str = "ok") -> None:
        color = _STATUS_COLOR["fail"] if status == "fail" else "#52525b"
        self.message.value = f'<span style="color:{color}">{_esc(text)}</span>'

    def _on_mount(self, _button: Any) -> None:
        self._say("mounting Google Drive (allow access when the browser asks)…")
        try:
            text = mount_drive()
        except Exception as exc:
            fix = getattr(exc, "fix", "")
            self._say(f"mounting failed: {exc}" + (f" Fix: {fix}" if fix else ""), "fail")
            return
        self.render()
        self._say(text)

    def _on_choose(self, _button: Any) -> None:
        run = self.run
        if run is None:
            self._say("run nbresume.init(name) first", "fail")
            return
        index = self.inputs.value
        chosen = self._inputs[index] if isinstance(index, int) and index >= 0 else None
        if chosen is not None and chosen.verified is False:
            self._say(f"step {chosen.step:,} does not verify: {chosen.problem}", "fail")
            return
        self._say("copying the chosen checkpoint…" if chosen else "starting fresh…")
        try:
            text = choose_input(run, chosen)
        except Exception as exc:
            fix = getattr(exc, "fix", "")
            self._say(f"{exc}" + (f" Fix: {fix}" if fix else ""), "fail")
            return
        self.choice.value = _choice_html(chosen.step if chosen else 0, text)
        self.message.value = ""


def _checks_html(report: Report) -> str:
    rows = []
    for check in report.checks:
        color = _STATUS_COLOR[check.status]
        fix = f"<br><i>fix:</i> {_esc(check.fix)}" if check.fix and check.status != "ok" else ""
        rows.append(
            f'<tr data-check="{_esc(check.name)}" data-status="{check.status}">'
            f'<td style="padding:0 8px 0 0;color:{color}">{_STATUS_LABEL[check.status]}</td>'
            f'<td style="padding:0 12px 0 0;color:#71717a">{_esc(check.name)}</td>'
            f"<td>{_esc(check.seen)}{fix}</td></tr>"
        )
    return f'<table style="border-collapse:collapse;line-height:1.4">{"".join(rows)}</table>'


def _kaggle_working_html() -> str:
    working = knobs.kaggle_root() / "working"
    free = ""
    with contextlib.suppress(OSError):
        import shutil

        free = f" · {format_bytes(shutil.disk_usage(working).free)} free"
    return f"<br>Kaggle output folder: <code>{_esc(working)}</code>{_esc(free)}"


def _choice_html(step: int | None, text: str) -> str:
    value = "" if step is None else str(step)
    return f'<span data-resume-step="{value}">{_esc(text)}</span>'


# -- one panel per process ---------------------------------------------------------------------

_PANEL: SetupPanel | None = None
_PANEL_LOCK = forksafe.lock()


def show(report: Report | None = None, run: Run | None = None) -> SetupPanel | None:
    """Display the setup panel in this notebook cell, once per process like the training
    panel: a later ``nbresume.init`` updates it in place with the run (its folder, the Kaggle
    inputs). Returns it; ``None`` outside a notebook or without ipywidgets."""
    global _PANEL  # noqa: PLW0603
    from nbresume.notebook.shell import in_notebook

    if not in_notebook():
        return None
    report = run.report if run is not None else report
    if report is None:
        return None
    try:
        from IPython.display import display

        with _PANEL_LOCK:
            shown = _PANEL
            if shown is None:
                panel = _PANEL = SetupPanel(report, run)
            else:
                panel = shown
                if run is not None:
                    panel.set_run(run)
    except ImportError:
        return None  # no ipywidgets: the training panel says so
    except Exception:  # the first cell must not fail for a display
        log.exception("nbresume: the setup panel failed")
        return None
    if shown is None:
        display(_output(panel), raw=True)  # type: ignore[no-untyped-call]
    return panel


def _output(panel: SetupPanel) -> dict[str, Any]:
    """The setup panel's output: the widget, and the setup as text instead of the widget's
    repr (truncated HTML) for papermill's and nbconvert's output and other text views."""
    view = {"version_major": 2, "version_minor": 0, "model_id": panel.widget.model_id}
    try:
        text = setup_text(panel.report, panel.run, panel.platform)
    except Exception:  # the first cell must not fail for a display
        log.exception("nbresume: the setup text failed")
        text = "nbresume setup"
    return {"text/plain": text, "application/vnd.jupyter.widget-view+json": view}


__all__ = [
    "ClockLine",
    "DriveFacts",
    "InputCheckpoint",
    "SetupPanel",
    "choose_input",
    "clock_lines",
    "clocks_text",
    "drive_facts",
    "input_checkpoints",
    "mount_drive",
    "print_text",
    "setup_text",
    "show",
]
