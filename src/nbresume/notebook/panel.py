"""The notebook panel: the run at a glance, live, with "Save now" and "Stop and save".

Built from core ipywidgets controls only (HTML, IntProgress, Button, boxes), so it renders
wherever ipywidgets do: Colab, Kaggle, JupyterLab, Notebook 7, VS Code. It is a view of a
:class:`~nbresume.notebook.progress.Tracker`: it renders at most a few times a second while
training steps, and at once when a checkpoint changes state.

The buttons only ask (``request_save`` / ``request_stop``); the training loop saves or stops at
its next step boundary. For the click to reach the kernel while the training cell runs, the
panel pumps widget messages at step boundaries (see :mod:`nbresume.notebook._pump`).
"""

from __future__ import annotations

import contextlib
import html
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import ipywidgets as widgets

from nbresume.checkpoint import events as ev
from nbresume.checkpoint import forksafe
from nbresume.checkpoint.loop import confirm
from nbresume.checkpoint.state import MIN_BATCHES, data_wait_of
from nbresume.checkpoint.units import format_bytes
from nbresume.errors import CheckpointError
from nbresume.notebook.progress import (
    FAILED,
    FOUND,
    SAVED,
    SYNCING,
    WARNING,
    Snapshot,
    Throttle,
    Tracker,
    describe,
)
from nbresume.platforms import by_name

if TYPE_CHECKING:
    from nbresume.notebook._pump import CommPump
    from nbresume.notebook.setup_panel import ClockLine

#: Seconds between two redraws while steps go by.
PANEL_INTERVAL_S = 0.25
#: Seconds the danger clocks are reused before they are worked out again.
CLOCKS_TTL_S = 5.0
#: The metric plotted when ``save(metric=...)`` gives several: the first of these found.
PREFERRED_METRICS = ("loss", "train_loss", "val_loss", "eval_loss")
#: How many points the metric plot keeps (the newest).
PLOT_POINTS = 200

_STATUS_COLOR = {"ok": "inherit", "warn": "#b45309", "fail": "#b91c1c"}
_STATE_COLOR = {SAVED: "#15803d", SYNCING: "#b45309", FAILED: "#b91c1c", FOUND: "inherit"}
_URGENT = (
    ev.SAVE_STARTED,
    ev.COMMITTED,
    ev.VERIFIED,
    ev.SYNCING,
    ev.DURABLE,
    ev.FAILED,
    ev.STOPPING,
    ev.DONE,
    "message",
    WARNING,
)


#: The events after which the panel asks the storage whether the newest checkpoint is there.
_ASK_STORAGE = (ev.VERIFIED, ev.DURABLE)


def _esc(text: object) -> str:
    return html.escape(str(text), quote=True)


@dataclass(frozen=True)
class Safety:
    """What the storage said, last time the panel asked, about the newest checkpoint of
    ``folder``: ``confirmed`` or not, with the storage's words."""

    folder: str
    step: int
    confirmed: bool
    text: str


class Panel:
    """The widget tree and its updates. ``panel.widget`` is what gets displayed."""

    def __init__(
        self, tracker: Tracker, *, pump: CommPump | None = None, interval: float = PANEL_INTERVAL_S
    ) -> None:
        self.tracker = tracker
        self.pump = pump
        self.title = widgets.HTML()
        self.facts = widgets.HTML()
        self.bar = widgets.IntProgress(
            value=0, min=0, max=1, bar_style="info", layout=widgets.Layout(width="240px")
        )
        self.progress = widgets.HTML(layout=widgets.Layout(flex="1 1 auto", width="auto"))
        self.checkpoint = widgets.HTML()
        self.at_risk = widgets.HTML()
        self.safe = widgets.HTML()
        self.session = widgets.HTML()
        self.clocks = widgets.HTML()
        self.plot = widgets.HTML()
        self.save_button = widgets.Button(
            description="Save now",
            icon="save",
            tooltip="Save a checkpoint at the next step boundary",
        )
        self.stop_button = widgets.Button(
            description="Stop and save",
            icon="stop",
            button_style="warning",
            tooltip="Save at the next step boundary and end the training loop",
        )
        self.message = widgets.HTML()
        self.widget = widgets.VBox(
            [
                self.title,
                self.facts,
                widgets.HBox([self.bar, self.progress]),
                self.checkpoint,
                self.at_risk,
                self.safe,
                self.session,
                self.clocks,
                self.plot,
                widgets.HBox([self.save_button, self.stop_button]),
                self.message,
            ],
            layout=widgets.Layout(
                border="1px solid #d4d4d8", padding="4px 10px", margin="4px 0", width="auto"
            ),
        )
        names = ("title", "facts", "bar", "progress", "checkpoint", "session", "clocks", "plot")
        for name in (*names, "message"):
            getattr(self, name).add_class(f"nbresume-{name}")
        self.at_risk.add_class("nbresume-at-risk")
        self.safe.add_class("nbresume-safe")
        self.widget.add_class("nbresume-panel")
        self.save_button.add_class("nbresume-save")
        self.stop_button.add_class("nbresume-stop")
        self.save_button.on_click(self._on_save)
        self.stop_button.on_click(self._on_stop)
        self._lock = forksafe.lock()
        #: {step: metrics} of the checkpoints of the folder shown, for the plot.
        self._metrics: dict[int, dict[str, float]] = {}
        self._metrics_folder = ""
        self._metrics_lock = forksafe.lock()  # the writer thread adds, render reads
        self._clocks: tuple[float, list[ClockLine]] | None = None
        #: The storage's last answer, and the background question's bookkeeping.
        self.safety: Safety | None = None
        self._asking = False
        self._ask_again = False
        self._ask_lock = forksafe.lock()
        self._throttle = Throttle(interval, self.render)
        self.renders = 0
        self.render()

    # -- tracker view ----------------------------------------------------------------------

    def notify(self, event: ev.Event | None) -> None:
        if event is not None and event.kind == ev.VERIFIED:
            self._read_metrics(event.step, str(event.data.get("location") or ""))
        if event is not None and event.kind in _ASK_STORAGE:
            self._ask_storage()
        if event is not None and event.kind == ev.STEP:
            # The first step of a loop enables "Stop and save" at once; later ones can wait.
            self._throttle.poke(urgent=self.stop_button.disabled)
        else:
            self._throttle.poke(urgent=event is None or event.kind in _URGENT)

    def pump_messages(self) -> None:
        """At a step boundary: handle the clicks that arrived while the cell runs."""
        if self.pump is not None:
            self.pump.poll()

    def render(self) -> None:
        """Redraw every part from the tracker's snapshot (only parts that changed are sent)."""
        snap = self.tracker.snapshot()
        with self._lock:
            self.renders += 1
            _set(self.title, self._title_html(snap))
            _set(self.facts, self._facts_html(snap))
            total = snap.total or 0
            step = snap.step or 0
            if total:
                _set(self.bar, max(1, total), "max")
                _set(self.bar, min(step, total))
            else:
                _set(self.bar, 1, "max")
                _set(self.bar, 1 if snap.finished else 0)
            _set(self.bar, _bar_style(snap), "bar_style")
            _set(self.progress, self._progress_html(snap) + self._data_wait_html())
            _set(self.checkpoint, self._checkpoint_html(snap))
            _set(self.at_risk, self._at_risk_html(snap))
            _set(self.safe, self._safe_html())
            _set(self.session, self._session_html(snap))
            _set(self.clocks, self._clocks_html())
            _set(self.plot, self._plot_html())
            message = f'<span style="color:#52525b">{_esc(snap.message)}</span>'
            _set(self.message, message if snap.message else "")
            _set(self.stop_button, not snap.running, "disabled")

    def plain_text(self) -> str:
        """The run in a few lines of text: what the panel's output says where widgets do not
        render (a notebook executed by papermill or nbconvert, read as text or on GitHub)."""
        snap = self.tracker.snapshot()
        head = "nbresume"
        if snap.run_name:
            head += f" · run {snap.run_name!r}"
        platform = next((f.text for f in snap.facts if f.label == "platform"), "")
        if platform:
            head += f" · {platform}"
        lines = [head]
        if snap.folder:
            lines.append(f"  checkpoints: {snap.folder}")
        lines.append(f"  training: {snap.progress_text()}")
        lines.append(f"  last checkpoint: {snap.checkpoint_text()}")
        return "\n".join(lines)

    # -- the parts -------------------------------------------------------------------------

    @staticmethod
    def _title_html(snap: Snapshot) -> str:
        run = f" · run <code>{_esc(snap.run_name)}</code>" if snap.run_name else ""
        verdict = f" · preflight: {_esc(snap.verdict)}" if snap.verdict else ""
        return f"<b>nbresume</b>{run}{verdict}"

    @staticmethod
    def _facts_html(snap: Snapshot) -> str:
        rows = []
        for fact in snap.facts:
            if fact.label == "session":
                continue  # the session row below is live
            color = _STATUS_COLOR.get(fact.status, "inherit")
            rows.append((fact.label, f'<span style="color:{color}">{_esc(fact.text)}</span>'))
        if snap.folder:
            free = f" · {_esc(format_bytes(snap.free_bytes))} free" if snap.free_bytes else ""
            rows.append(("checkpoints", f"<code>{_esc(snap.folder)}</code>{free}"))
        cells = "".join(
            f'<tr><td style="padding:0 12px 0 0;color:#71717a">{_esc(label)}</td>'
            f'<td style="padding:0">{value}</td></tr>'
            for label, value in rows
        )
        return f'<table style="border-collapse:collapse;line-height:1.4">{cells}</table>'

    @staticmethod
    def _progress_html(snap: Snapshot) -> str:
        step = "" if snap.step is None else str(snap.step)
        running = "true" if snap.running else "false"
        return (
            f'<span data-step="{step}" data-running="{running}">{_esc(snap.progress_text())}</span>'
        )

    def _data_wait_html(self) -> str:
        """The share of step time spent waiting for batches; the advice when input-bound."""
        ckpt = self.tracker.checkpointer
        wait = None if ckpt is None else data_wait_of(ckpt)
        if wait is None or wait.batches < MIN_BATCHES:
            return ""
        attrs = f'data-share="{wait.share:.3f}" data-input-bound="{str(wait.input_bound).lower()}"'
        if not wait.input_bound:
            return f" · <span {attrs}>{_esc(wait.short())}</span>"
        return (
            f'<br><span {attrs} style="color:{_STATE_COLOR[FAILED]}"><b>{_esc(wait.short())}'
            f"</b>: {_esc(wait.advice())}</span>"
        )

    @staticmethod
    def _checkpoint_html(snap: Snapshot) -> str:
        last = snap.last
        if last is None:
            main = "none yet"
            attrs = 'data-step="" data-state=""'
        else:
            color = _STATE_COLOR.get(last.state, "inherit")
            main = f'<span style="color:{color}">{_esc(describe(last, snap.now))}</span>'
            attrs = f'data-step="{last.step}" data-state="{_esc(last.state)}"'
        extra = ""
        if snap.saving is not None and (last is None or snap.saving.step > last.step):
            extra += f" · {_esc(snap.saving.state)} step {snap.saving.step:,}…"
        if snap.failed is not None and (last is None or snap.failed.step >= last.step):
            extra += (
                f' · <span style="color:{_STATE_COLOR[FAILED]}">saving step '
                f"{snap.failed.step:,} FAILED: {_esc(snap.failed.detail)}</span>"
            )
        return f"<span {attrs}>last checkpoint: {main}{extra}</span>"

    @staticmethod
    def _at_risk_html(snap: Snapshot) -> str:
        """The last verified checkpoint and the training since; the warning in red when that
        is more than twice the cadence. Data attributes carry the numbers."""
        if not snap.has_checkpointer:
            return ""
        risk = snap.at_risk
        attrs = " ".join(
            f'data-{name}="{"" if value is None else value}"'
            for name, value in (
                ("step", risk.step),
                ("steps", risk.steps),
                ("seconds", None if risk.seconds is None else int(risk.seconds)),
                ("age", None if risk.at is None else int(max(0.0, snap.now - risk.at))),
                ("warning", "true" if risk.warning else "false"),
            )
        )
        html_text = f"<span {attrs}>{_esc(risk.text(snap.now))}</span>"
        if risk.warning:
            html_text += (
                f'<br><span style="color:{_STATE_COLOR[FAILED]}"><b>WARNING:</b> '
                f"{_esc(risk.warning)}</span>"
            )
        return html_text

    def _safe_html(self) -> str:
        """Whether the storage itself has confirmed the newest checkpoint: the moment it is
        safe to close the tab. Empty until the panel has asked."""
        ckpt = self.tracker.checkpointer
        safety = self.safety
        if ckpt is None or safety is None or safety.folder != str(ckpt.store.location):
            return ""
        attrs = f'data-step="{safety.step}" data-confirmed="{str(safety.confirmed).lower()}"'
        if safety.confirmed:
            color = _STATE_COLOR[SAVED]
            text = f"safe to close the tab: {safety.text}"
        else:
            color = _STATE_COLOR[SYNCING]
            text = f"not yet safe to close the tab: {safety.text}"
        return f'<span {attrs} style="color:{color}">{_esc(text)}</span>'

    # -- asking the storage ----------------------------------------------------------------

    def _ask_storage(self) -> None:
        """Ask the storage about the newest checkpoint in a thread of its own: the question
        may be an API call or an fsync, and the writer or the training loop must not wait
        for it. One question at a time; events meanwhile ask once more after it."""
        with self._ask_lock:
            if self._asking:
                self._ask_again = True
                return
            self._asking = True
        threading.Thread(target=self._ask_loop, name="nbresume-panel-confirm", daemon=True).start()

    def _ask_loop(self) -> None:
        while True:
            with contextlib.suppress(Exception):  # a display must never take training down
                self._ask_once()
            with self._ask_lock:
                if not self._ask_again:
                    self._asking = False
                    return
                self._ask_again = False

    def _ask_once(self) -> None:
        ckpt = self.tracker.checkpointer
        if ckpt is None:
            return
        store = ckpt.store
        folder = str(store.location)
        try:
            found = confirm(store, timeout=0)  # one question, no waiting
        except CheckpointError as exc:
            latest = store.latest()
            step = latest.step if latest is not None else 0
            # The error reads "step N not confirmed ... after 0 s: <what the storage said>".
            said = exc.message.partition(" s: ")[2] or exc.message
            self.safety = Safety(folder, step, False, f"step {step:,}: {said}")
        else:
            self.safety = Safety(folder, found.step, True, found.how)
        self._throttle.poke(urgent=True)

    @staticmethod
    def _session_html(snap: Snapshot) -> str:
        return f"<span>session: {_esc(snap.session_text())}</span>"

    def _clocks_html(self) -> str:
        """The platform's danger clocks on one line: those on a known timer, but the session cap
        (the row above shows it)."""
        from nbresume.notebook.setup_panel import NO_TIMER, clocks_text

        lines = self._clock_lines()
        text = clocks_text(lines, brief=True)
        if not text:
            return ""
        names = ",".join(c.name for c in lines if not c.cap and c.text != NO_TIMER)
        return (
            f'<span data-clocks="{_esc(names)}" style="color:#52525b">danger clocks: '
            f"{_esc(text)}</span>"
        )

    def _clock_lines(self) -> list[ClockLine]:
        from nbresume.notebook.setup_panel import clock_lines

        now = time.monotonic()
        if self._clocks is not None and now - self._clocks[0] < CLOCKS_TTL_S:
            return self._clocks[1]
        tracker = self.tracker
        lines: list[ClockLine] = []
        with contextlib.suppress(Exception):  # a display must never take training down
            if tracker.run is not None:
                lines = clock_lines(tracker.run.platform)
            elif tracker.report is not None:
                lines = clock_lines(by_name(tracker.report.platform))
        self._clocks = (now, lines)
        return lines

    # -- the metric plot -------------------------------------------------------------------

    def _read_metrics(self, step: int, location: str) -> None:
        """The metrics ``save(metric=...)`` wrote into the manifest of a verified checkpoint."""
        import posixpath

        ckpt = self.tracker.checkpointer
        if ckpt is None:
            return
        self._load_history(ckpt.store)
        try:
            name = posixpath.basename(location.rstrip("/")) or f"{step:012d}"
            metrics = dict(ckpt.store.read_manifest(name, step).metrics)
        except Exception:  # the plot is a nicety: a checkpoint retention removed, say
            return
        with self._metrics_lock:
            if metrics:
                self._metrics[step] = metrics
            else:  # saved again without one (the final save of a loop at the same step)
                self._metrics.pop(step, None)

    def _load_history(self, store: Any) -> None:
        """The metrics of the checkpoints already in the folder, once per folder."""
        folder = str(store.location)
        if folder == self._metrics_folder:
            return
        history: dict[int, dict[str, float]] = {}
        with contextlib.suppress(Exception):
            history = {i.step: dict(i.metrics) for i in store.list() if i.metrics}
        with self._metrics_lock:
            self._metrics_folder = folder
            self._metrics = history

    def _plot_html(self) -> str:
        """A small line plot of the loss (or the metric given to ``save``) over the steps of
        the verified checkpoints."""
        ckpt = self.tracker.checkpointer
        if ckpt is not None:
            self._load_history(ckpt.store)
        with self._metrics_lock:
            points = dict(sorted(self._metrics.items())[-PLOT_POINTS:])
        if not points:
            return ""
        name = _plot_metric(points)
        series = [(step, m[name]) for step, m in points.items() if name in m]
        return _svg_plot(name, series)

    # -- buttons ---------------------------------------------------------------------------

    def _on_save(self, _button: Any) -> None:
        tracker = self.tracker
        ckpt = tracker.checkpointer
        if ckpt is not None and not tracker.running and _in_kernel_thread(self.pump):
            # Between cells, in the kernel's own thread, nothing else touches the state.
            tracker.say("saving the current state…")
            try:
                info = ckpt.save(block=True)
            except Exception as exc:
                tracker.say(f"saving FAILED: {exc}")
                return
            step = info.step if info is not None else ckpt.step
            tracker.say(f"saved step {step:,}")
            return
        tracker.say(tracker.request_save())

    def _on_stop(self, _button: Any) -> None:
        self.tracker.say(self.tracker.request_stop())


def _in_kernel_thread(pump: CommPump | None) -> bool:
    thread = pump.thread if pump is not None else threading.main_thread()
    return threading.current_thread() is thread


def _set(widget: widgets.Widget, value: Any, name: str = "value") -> None:
    """Set a trait only when it changes: every change is a message to the front-end."""
    if getattr(widget, name) != value:
        setattr(widget, name, value)


def _bar_style(snap: Snapshot) -> str:
    if snap.failed is not None:
        return "danger"
    if snap.finished:
        return "success"
    if snap.stopped:
        return "warning"
    return "info"


def _plot_metric(points: dict[int, dict[str, float]]) -> str:
    """The metric to plot: ``loss`` (or a close name) when given, else the first name."""
    names = {name for metrics in points.values() for name in metrics}
    return next((n for n in PREFERRED_METRICS if n in names), min(names))


def _svg_plot(name: str, series: list[tuple[int, float]]) -> str:
    """An inline SVG polyline of ``series`` with the last value, the minimum and the count."""
    width, height, pad = 240, 48, 3
    steps = [step for step, _ in series]
    values = [value for _, value in series]
    low, high = min(values), max(values)
    first, last_step = steps[0], steps[-1]

    def x(step: int) -> float:
        return pad + (width - 2 * pad) * (
            (step - first) / (last_step - first) if last_step > first else 0.5
        )

    def y(value: float) -> float:
        return pad + (height - 2 * pad) * ((high - value) / (high - low) if high > low else 0.5)

    coords = " ".join(f"{x(s):.1f},{y(v):.1f}" for s, v in series)
    shape = (
        f'<polyline points="{coords}" fill="none" stroke="#2563eb" stroke-width="1.5"/>'
        if len(series) > 1
        else f'<circle cx="{x(first):.1f}" cy="{y(values[0]):.1f}" r="2.5" fill="#2563eb"/>'
    )
    last = values[-1]
    caption = (
        f"{_esc(name)} {last:.4g} at step {last_step:,} · min {low:.4g} · "
        f"{len(series)} checkpoint{'' if len(series) == 1 else 's'}"
    )
    return (
        f'<div data-metric="{_esc(name)}" data-points="{len(series)}" data-last="{last!r}" '
        'style="display:flex;align-items:center;gap:10px">'
        f'<svg width="{width}" height="{height}" style="background:#fafafa;'
        f'border:1px solid #e4e4e7">{shape}</svg>'
        f'<span style="color:#52525b">{caption}</span></div>'
    )
