"""What the notebook panel and the terminal status line show, folded from the core's events.

The core (:mod:`nbresume.checkpoint`) knows nothing of displays: it emits events through
callbacks. A :class:`Tracker` watches every new Checkpointer
(:func:`~nbresume.checkpoint.events.watch_checkpointers`), subscribes to its events and folds
them into one picture of the run; views (the panel, the status line) are told about every event
and render a :class:`Snapshot` when they choose to, through a :class:`Throttle`. Nothing here
imports a UI library.

A checkpoint is shown as ``saved`` only once the store confirmed it: verified on an ordinary
store, confirmed by Drive itself on a write-back store (until then it is ``syncing``).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from nbresume.checkpoint import events as ev
from nbresume.checkpoint import forksafe
from nbresume.checkpoint.backends import open_store
from nbresume.checkpoint.format import created_time
from nbresume.checkpoint.store import CheckpointStore
from nbresume.checkpoint.units import format_bytes, format_duration
from nbresume.platforms.gpu import accelerator_attached
from nbresume.preflight_checks import STOP_MARGIN_S

if TYPE_CHECKING:
    from nbresume.checkpoint.loop import RunningLoop
    from nbresume.preflight_checks import Check, Report
    from nbresume.run import Run

log = logging.getLogger("nbresume")

#: The states a checkpoint is shown in. Only SAVED means "it is there and it verified".
SAVING = "saving"
VERIFYING = "verifying"
SAVED = "saved"
SYNCING = "syncing"
FAILED = "failed"
#: Found in the folder when the display started; committed, not re-verified since.
FOUND = "found"
#: The kind of the event views get when the cadence warning appears (data: ``text``).
WARNING = "warning"

#: Seconds of step history that the rate is measured over.
RATE_WINDOW_S = 30.0
#: Seconds a free-space figure is reused before the store is asked again.
FREE_SPACE_TTL_S = 10.0
#: Training this long with nothing verified is worth a warning where no cadence says more:
#: ``every=None``, and ``every="auto"`` until it has measured a save.
UNSAVED_WARN_S = 30 * 60.0


@dataclass(frozen=True)
class CheckpointView:
    """One checkpoint as a display shows it."""

    step: int
    state: str
    size: int | None = None
    #: When it was written or found (a Unix time), if known.
    at: float | None = None
    #: Why it failed or is syncing; where it is.
    detail: str = ""


@dataclass(frozen=True)
class Fact:
    """A line of the run's facts: a label, what was seen, and ok / warn / fail."""

    label: str
    text: str
    status: str = "ok"


@dataclass(frozen=True)
class AtRisk:
    """What a crash now would lose: the training since the last verified checkpoint.

    A warning is due when that is more than twice the cadence: ``2 * every`` steps, twice a
    duration, twice the interval ``every="auto"`` computed; ``30 min`` (:data:`UNSAVED_WARN_S`)
    of training with nothing verified for ``every=None`` and for ``"auto"`` before its first
    measured save.
    """

    #: The step of the last verified checkpoint (``None``: none yet).
    step: int | None = None
    #: When it was written (a Unix time), if known.
    at: float | None = None
    #: Steps trained since it (since the start without one); ``None`` before training.
    steps: int | None = None
    #: Seconds of training since it, counted from the start of the loop at the earliest.
    seconds: float | None = None
    #: Why that is too long, or ``""``.
    warning: str = ""

    def text(self, now: float) -> str:
        """``"last verified checkpoint: step 1,500, 2 min ago; 37 steps (40 s) since"``."""
        if self.step is None:
            head = "no verified checkpoint yet"
        else:
            head = f"last verified checkpoint: step {self.step:,}"
            if self.at is not None:
                head += (
                    ", just now" if now - self.at < 1 else f", {format_duration(now - self.at)} ago"
                )
        if self.steps is None:
            return head
        return f"{head}; {self._amount()} {'since' if self.step is not None else 'trained'}"

    def since_text(self) -> str:
        """``"37 steps (40 s) since the last verified checkpoint"`` (``""`` before training)."""
        if self.steps is None:
            return ""
        if self.step is None:
            return f"{self._amount()} and no verified checkpoint yet"
        return f"{self._amount()} since the last verified checkpoint"

    def _amount(self) -> str:
        text = f"{self.steps:,} step{'' if self.steps == 1 else 's'}"
        if self.seconds is not None:
            text += f" ({format_duration(self.seconds)})"
        return text


@dataclass(frozen=True)
class Snapshot:
    """Everything a view shows, at one moment. Plain data."""

    now: float
    run_name: str
    folder: str
    facts: tuple[Fact, ...]
    verdict: str
    step: int | None
    total: int | None
    epoch: int | None
    running: bool
    rate: float | None
    eta_s: float | None
    last: CheckpointView | None
    saving: CheckpointView | None
    failed: CheckpointView | None
    #: When the session ends (a Unix time), and what ends it.
    deadline: float | None
    deadline_source: str
    #: When the Checkpointer will save and stop before the deadline (``None``: it will not).
    stop_at: float | None
    #: Whether a Checkpointer is shown (then ``stop_at is None`` means it will not stop).
    has_checkpointer: bool
    free_bytes: int | None
    stopped: str
    finished: bool
    message: str
    #: The training a crash now would lose, and a warning when that is too much.
    at_risk: AtRisk = AtRisk()
    #: The number of processes of the job that saved the restored checkpoint and of this
    #: one, where they differ (``None``: the same).
    reshaped: tuple[int, int] | None = None

    def progress_text(self) -> str:
        """``"step 1,234 of 20,000 (6%) · 12.3 steps/s · ETA 25 min"``."""
        if self.step is None:
            return "not training yet"
        text = f"step {self.step:,}"
        if self.total:
            text += f" of {self.total:,} ({100.0 * self.step / self.total:.0f}%)"
        if self.epoch:
            text += f", epoch {self.epoch}"
        if self.rate:
            text += f" · {_rate(self.rate)}"
        if self.eta_s is not None and self.running:
            text += f" · ETA {format_duration(self.eta_s)}"
        if self.finished:
            text += " · done"
        elif self.stopped:
            text += f" · stopped: {self.stopped}"
        return text

    def checkpoint_text(self) -> str:
        """``"step 1,500 saved 2 min ago (12.3 MB)"``, or what is known instead."""
        text = "none yet" if self.last is None else describe(self.last, self.now)
        if self.saving is not None and (self.last is None or self.saving.step > self.last.step):
            verb = "verifying" if self.saving.state == VERIFYING else "saving"
            text += f"; {verb} step {self.saving.step:,}"
        if self.failed is not None and (self.last is None or self.failed.step >= self.last.step):
            text += f"; saving step {self.failed.step:,} FAILED: {self.failed.detail}"
        return text

    def session_text(self) -> str:
        """When the session ends and when nbresume stops before it."""
        if self.deadline is None:
            return next((f.text for f in self.facts if f.label == "session"), "no session cap")
        text = f"{format_duration(self.deadline - self.now)} left ({self.deadline_source})"
        if self.stop_at is not None:
            text += (
                f"; nbresume saves and stops at {_clock(self.stop_at)} "
                f"(in {format_duration(self.stop_at - self.now)})"
            )
        elif self.has_checkpointer:
            text += "; this Checkpointer has deadline=None: it will not stop before"
        return text


def describe(view: CheckpointView, now: float) -> str:
    """``"step 1,500 saved (2 min ago, 12.3 MB)"``."""
    parts = []
    if view.at is not None:
        parts.append(f"{format_duration(now - view.at)} ago" if now - view.at >= 1 else "just now")
    if view.size is not None:
        parts.append(format_bytes(view.size))
    label = "in the folder" if view.state == FOUND else view.state
    text = f"step {view.step:,} {label}"
    if parts:
        text += f" ({', '.join(parts)})"
    if view.detail and view.state in (SYNCING, FAILED):
        text += f": {view.detail}"
    return text


def _rate(rate: float) -> str:
    if rate >= 1:
        return f"{rate:.3g} steps/s"
    return f"{1.0 / rate:.3g} s/step"


def _clock(when: float) -> str:
    return time.strftime("%H:%M", time.localtime(when))


class View(Protocol):
    """Something that shows the run: told about every event, renders when it chooses."""

    def notify(self, event: ev.Event | None) -> None: ...


class Throttle:
    """Calls ``fire`` at most once per ``interval`` seconds, at once when urgent, and once more
    after the interval when calls were held back (so the last state always shows)."""

    def __init__(self, interval: float, fire: Callable[[], None]) -> None:
        self.interval = interval
        self.fire = fire
        self._last = 0.0
        self._timer: threading.Timer | None = None
        self._lock = forksafe.lock()

    def poke(self, *, urgent: bool = False) -> None:
        with self._lock:
            now = time.monotonic()
            wait = self._last + self.interval - now
            if not urgent and wait > 0:
                if self._timer is None:
                    self._timer = threading.Timer(wait, self._trailing)
                    self._timer.daemon = True
                    self._timer.start()
                return
            self._last = now
        self._safe_fire()

    def _trailing(self) -> None:
        with self._lock:
            self._timer = None
            self._last = time.monotonic()
        self._safe_fire()

    def _safe_fire(self) -> None:
        try:
            self.fire()
        except Exception:  # a display must never take training down
            log.exception("nbresume: updating the display failed")

    def cancel(self) -> None:
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None


#: The cadence warning last logged for each checkpointer.
_LOGGED_WARNINGS: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()


class Tracker:
    """Folds the events of the Checkpointers of this process into one picture of the run."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self._lock = forksafe.rlock()
        self._views: list[View] = []
        self._step_hooks: list[Callable[[], None]] = []
        self._unwatch: Callable[[], None] | None = None
        self._ckpt: weakref.ref[RunningLoop] | None = None
        self._subscribed: weakref.WeakSet[RunningLoop] = weakref.WeakSet()
        self.run: Run | None = None
        self.report: Report | None = None
        self._reset_progress()
        self._states: dict[int, CheckpointView] = {}
        self.saving: CheckpointView | None = None
        self.failed: CheckpointView | None = None
        self.message = ""
        #: The change of the number of processes the shown run resumed with (before, after).
        self.reshaped: tuple[int, int] | None = None
        self._free: tuple[float, int | None] | None = None
        self._session: tuple[float | None, str] = (None, "")
        self._verified: tuple[int, float] | None = None  # step and time of the last VERIFIED
        self._warned = ""  # the warning already logged for the present stretch without one

    def _reset_progress(self) -> None:
        self.step: int | None = None
        self.total: int | None = None
        self.epoch: int | None = None
        self.running = False
        self.stopped = ""
        self.finished = False
        self._samples: deque[tuple[float, int]] = deque()
        self._loop_started: float | None = None  # when the running (or last) loop began
        self._last_step_at: float | None = None  # when the last step boundary was seen

    # -- wiring ----------------------------------------------------------------------------

    def start(self) -> None:
        """Watch every Checkpointer created from now on (once, however often called)."""
        with self._lock:
            if self._unwatch is None:
                self._unwatch = ev.watch_checkpointers(self.attach)

    def stop(self) -> None:
        """Stop watching; views stay but hear nothing more."""
        with self._lock:
            if self._unwatch is not None:
                self._unwatch()
                self._unwatch = None

    def add_view(self, view: View) -> None:
        with self._lock:
            if view not in self._views:
                self._views.append(view)

    def remove_view(self, view: View) -> None:
        with self._lock:
            if view in self._views:
                self._views.remove(view)

    @property
    def views(self) -> list[View]:
        with self._lock:
            return list(self._views)

    def on_step(self, hook: Callable[[], None]) -> None:
        """Call ``hook()`` in the training thread at every step boundary (before the checkpointer
        decides whether to save or stop), e.g. to handle button clicks there."""
        with self._lock:
            if hook not in self._step_hooks:
                self._step_hooks.append(hook)

    def set_run(self, run: Run | None) -> None:
        """Show this run (the run of the last ``nbresume.init``): its facts and folder."""
        with self._lock:
            changed = run is not self.run
            self.run = run
            if run is not None:
                self.report = run.report
            if changed and run is not None:
                self._session = _session_deadline(run)
                if self.checkpointer is None:
                    self._states.clear()
                    self._found(run.dir)
        self._notify(None)

    def set_report(self, report: Report) -> None:
        """Show this preflight report (before any run exists)."""
        with self._lock:
            self.report = report
        self._notify(None)

    def attach(self, ckpt: RunningLoop) -> None:
        """Follow ``ckpt``: subscribe to its events and show it from now on."""
        with self._lock:
            if ckpt not in self._subscribed:
                self._subscribed.add(ckpt)
                ref = weakref.ref(ckpt)
                ckpt.events.subscribe(lambda event: self._on_event(ref, event))
            self._make_current(ckpt)
        self._notify(None)

    def _make_current(self, ckpt: RunningLoop) -> None:
        if self.checkpointer is ckpt:
            return
        self._ckpt = weakref.ref(ckpt)
        self._reset_progress()
        self._states.clear()
        self.saving = self.failed = None
        self.reshaped = None
        self._free = None
        self._verified = None
        self._warned = ""
        self._found(ckpt.store)

    def _found(self, location: Any) -> None:
        """The newest committed checkpoint already in the folder, as FOUND."""
        try:
            store = (
                location
                if isinstance(location, CheckpointStore)
                else CheckpointStore(location, keep=None)
            )
            info = store.latest()
        except Exception as exc:  # an unreadable folder is the preflight's to report
            log.debug("nbresume: cannot list %s: %s", location, exc)
            return
        if info is not None:
            self._states[info.step] = CheckpointView(
                info.step, FOUND, info.size, created_time(info.created), info.location
            )

    @property
    def checkpointer(self) -> RunningLoop | None:
        """The Checkpointer shown (the newest one that was created or did something)."""
        return self._ckpt() if self._ckpt is not None else None

    # -- events ----------------------------------------------------------------------------

    def _on_event(self, ref: weakref.ref[RunningLoop], event: ev.Event) -> None:
        ckpt = ref()
        if ckpt is None:
            return
        with self._lock:
            if ckpt is not self.checkpointer:
                if event.kind not in (ev.STEP, ev.SAVE_STARTED):
                    return  # a late event of a checkpointer no longer shown
                self._make_current(ckpt)
            self._fold(ckpt, event)
            warning = self._new_warning(ckpt) if event.kind == ev.STEP else ""
            hooks = list(self._step_hooks) if event.kind == ev.STEP else []
        if warning:
            # Views first (a live terminal line makes room for it), then the log, once per
            # stretch without a verified checkpoint, for a script that nobody watches.
            self._notify(ev.Event(WARNING, event.step, {"text": warning}))
            # Logged once per checkpointer even when several trackers watch it (the one of
            # nbresume.init and a panel of one's own).
            if _LOGGED_WARNINGS.get(ckpt) != warning:
                _LOGGED_WARNINGS[ckpt] = warning
                log.warning("nbresume: %s", warning)
        for hook in hooks:
            try:
                hook()
            except Exception:
                log.exception("nbresume: a step hook failed")
        self._notify(event)

    def _fold(self, ckpt: RunningLoop, event: ev.Event) -> None:
        kind, step, data = event.kind, event.step, event.data
        if kind == ev.STEP:
            if self.step is not None and step < self.step:
                self._samples.clear()
            if not self.running:
                self.stopped, self.finished = "", False
                self._loop_started = event.time
            self.running = True
            self.step = step
            self._last_step_at = event.time
            self.total = data.get("total")
            self.epoch = data.get("epoch")
            self._samples.append((event.time, step))
            while len(self._samples) > 2 and event.time - self._samples[0][0] > RATE_WINDOW_S:
                self._samples.popleft()
        elif kind == ev.SAVE_STARTED:
            self.saving = CheckpointView(step, SAVING, at=event.time)
        elif kind == ev.COMMITTED:
            self.saving = CheckpointView(step, VERIFYING, data.get("size"), event.time)
        elif kind == ev.VERIFIED:
            # On a write-back store (Drive) a checkpoint that reads back is not saved yet.
            state = SYNCING if ckpt.durability is not None else SAVED
            self._set_state(step, state, data.get("size"), event.time, data.get("location", ""))
            if self._verified is None or step >= self._verified[0]:
                self._verified = (step, event.time)
                self._warned = ""
            if self.saving is not None and self.saving.step <= step:
                self.saving = None
            if self.failed is not None and self.failed.step <= step:
                self.failed = None
        elif kind == ev.SYNCING:
            detail = str(data.get("reason") or "")
            if data.get("state") == FAILED:
                self._set_state(step, FAILED, detail=f"the store could not confirm it: {detail}")
            else:
                self._set_state(step, SYNCING, detail=detail or "uploading")
        elif kind == ev.DURABLE:
            self._set_state(step, SAVED, detail=str(data.get("location") or ""))
        elif kind == ev.FAILED:
            self.failed = CheckpointView(step, FAILED, at=event.time, detail=str(data.get("error")))
            if self.saving is not None and self.saving.step == step:
                self.saving = None
        elif kind == ev.STOPPING:
            self.running = False
            self.step = step
            self.stopped = str(data.get("reason") or "stopped")
        elif kind == ev.DONE:
            self.running = False
            self.step = step
            self.finished = True
        elif kind == ev.RESHAPED:
            self.reshaped = (int(data["before"]), int(data["after"]))
            self.message = str(data.get("text") or "")
        # Other kinds (added to the core later) change nothing shown.

    def _set_state(
        self,
        step: int,
        state: str,
        size: int | None = None,
        at: float | None = None,
        detail: str = "",
    ) -> None:
        old = self._states.get(step)
        if old is not None:
            size = size if size is not None else old.size
            at = at if at is not None else old.at
        if old is None and state != SAVED and self._states and step < max(self._states):
            return  # news about a checkpoint that retention already replaced
        self._states[step] = CheckpointView(step, state, size, at, detail)
        for older in sorted(self._states)[:-8]:
            del self._states[older]

    def cell_finished(self) -> None:
        """A notebook cell ended: no loop can be running any more (an exception may have left
        the loop without an event)."""
        with self._lock:
            was = self.running
            self.running = False
        if was:
            self._notify(None)

    def say(self, message: str) -> None:
        """Show ``message`` (the answer to a button or a magic)."""
        with self._lock:
            self.message = message
        self._notify(ev.Event("message", self.step or 0, {"text": message}))

    def _notify(self, event: ev.Event | None) -> None:
        for view in self.views:
            try:
                view.notify(event)
            except Exception:
                log.exception("nbresume: a display failed")

    # -- requests --------------------------------------------------------------------------

    def request_save(self) -> str:
        """Ask the running loop for a save at its next step boundary; say what will happen."""
        ckpt = self.checkpointer
        if ckpt is None:
            return "no Checkpointer in this process yet: nothing to save"
        if not self.running:
            return "no training loop is running: use %nbresume save to save the current state"
        ckpt.request_save()
        return f"save requested: nbresume saves after step {(self.step or 0):,}"

    def request_stop(self, reason: str = "stop requested from the panel") -> str:
        """Ask the running loop to save at its next step boundary and end."""
        ckpt = self.checkpointer
        if ckpt is None or not self.running:
            return "no training loop is running: nothing to stop"
        ckpt.request_stop(reason)
        return "stop requested: nbresume saves at the next step boundary, then the loop ends"

    # -- what is shown ---------------------------------------------------------------------

    def snapshot(self) -> Snapshot:
        """The run as it is now."""
        with self._lock:
            now = self.clock()
            ckpt = self.checkpointer
            rate = self._rate()
            eta = None
            if rate and self.total is not None and self.step is not None:
                eta = max(0.0, (self.total - self.step) / rate)
            last = self._states[max(self._states)] if self._states else None
            deadline, source = self._session
            stop_at = None
            if ckpt is not None and ckpt.deadline is not None:
                deadline, source = ckpt.deadline, ckpt.deadline_source
                with contextlib.suppress(Exception):
                    stop_at = ckpt.stop_at
            elif ckpt is None and deadline is not None:
                stop_at = deadline - STOP_MARGIN_S  # what deadline="auto" does, at the least
            return Snapshot(
                now=now,
                run_name=self.run.name if self.run is not None else "",
                folder=self._folder(),
                facts=self._facts(),
                verdict=self.report.verdict() if self.report is not None else "",
                step=self.step,
                total=self.total,
                epoch=self.epoch,
                running=self.running,
                rate=rate,
                eta_s=eta,
                last=last,
                saving=self.saving,
                failed=self.failed,
                deadline=deadline,
                deadline_source=source,
                stop_at=stop_at,
                has_checkpointer=ckpt is not None,
                free_bytes=self._free_bytes(ckpt),
                stopped=self.stopped,
                finished=self.finished,
                message=self.message,
                at_risk=self._at_risk(ckpt, now),
                reshaped=self.reshaped,
            )

    def _at_risk(self, ckpt: RunningLoop | None, now: float) -> AtRisk:
        """The training since the last verified checkpoint of the Checkpointer shown (or the
        one it restored), and the warning when that is more than twice its cadence."""
        if ckpt is None:
            return AtRisk()
        base: tuple[int, float | None] | None = self._verified
        restored = ckpt.restored_step
        if base is None and restored:
            # Restored from a checkpoint that verified as it was loaded.
            found = self._states.get(restored)
            base = (restored, found.at if found is not None else None)
        if self.step is None:
            return AtRisk(*base) if base is not None else AtRisk()
        steps = max(0, self.step - (base[0] if base is not None else (restored or 0)))
        end = now if self.running else (self._last_step_at or now)
        begin = max(
            (t for t in (self._loop_started, base[1] if base else None) if t is not None),
            default=None,
        )
        seconds = max(0.0, end - begin) if begin is not None else None
        warning = _cadence_warning(ckpt, steps, seconds, base[0] if base is not None else None)
        step, at = base if base is not None else (None, None)
        return AtRisk(step, at, steps, seconds, warning)

    def _new_warning(self, ckpt: RunningLoop) -> str:
        """The cadence warning if it has just appeared (it is logged once, not at every step)."""
        warning = self._at_risk(ckpt, self.clock()).warning
        if not warning or self._warned:
            return ""
        self._warned = warning
        return warning

    def _rate(self) -> float | None:
        if len(self._samples) < 2:
            return None
        (t0, s0), (t1, s1) = self._samples[0], self._samples[-1]
        if t1 - t0 < 0.5 or s1 <= s0:
            return None
        return (s1 - s0) / (t1 - t0)

    def _folder(self) -> str:
        ckpt = self.checkpointer
        if ckpt is not None:
            return str(ckpt.store.location)
        if self.run is not None:
            return self.run.dir
        return ""

    def _facts(self) -> tuple[Fact, ...]:
        report = self.report
        if report is None:
            return ()
        facts = [Fact("platform", report.platform_title)]
        for name, label in (("accelerator", "accelerator"), ("internet", "internet")):
            check = _check(report, name)
            if check is not None:
                facts.append(Fact(label, _seen(check), check.status))
        durable = _check(report, "durable folder")
        if durable is not None and durable.status != "ok":
            facts.append(Fact("durable folder", _seen(durable), durable.status))
        session = _check(report, "session clock")
        if session is not None:
            facts.append(Fact("session", session.seen, session.status))
        for check in report.checks:
            if check.status != "ok" and check.name not in (
                "accelerator",
                "internet",
                "durable folder",
                "session clock",
            ):
                facts.append(Fact(check.name, _seen(check), check.status))
        return tuple(facts)

    def _free_bytes(self, ckpt: RunningLoop | None) -> int | None:
        now = time.monotonic()
        if self._free is not None and now - self._free[0] < FREE_SPACE_TTL_S:
            return self._free[1]
        free: int | None = None
        try:
            if ckpt is not None:
                free = ckpt.store.backend.free_space().bytes
            elif self.run is not None:
                free = open_store(self.run.dir).free_space().bytes
        except Exception as exc:
            log.debug("nbresume: free space unknown: %s", exc)
        self._free = (now, free)
        return free


def _cadence_warning(
    ckpt: RunningLoop, steps: int, seconds: float | None, verified: int | None
) -> str:
    """Why ``steps`` steps (``seconds`` of training) since the checkpoint of step ``verified``
    (``None``: there is none) is too long for ``ckpt``'s cadence, or ``""``."""
    cadence = ckpt.cadence
    lost = "a crash now would lose that training; check why saves fail"
    what = (
        f"since the last verified checkpoint (step {verified:,})"
        if verified is not None
        else "without a verified checkpoint"
    )
    if cadence is None:
        return ""
    if cadence.steps is not None:
        if steps > 2 * cadence.steps:
            return f"{steps:,} steps {what}, more than twice every={cadence.steps:,}: {lost}"
        return ""
    if cadence.seconds is not None:
        if seconds is not None and seconds > 2 * cadence.seconds:
            return (
                f"{format_duration(seconds)} of training {what}, more than twice "
                f"every={format_duration(cadence.seconds)}: {lost}"
            )
        return ""
    interval = cadence.interval_steps() if cadence.auto else None
    if interval is not None:
        if steps > 2 * interval:
            return (
                f"{steps:,} steps {what}, more than twice the {interval:,} steps that "
                f'every="auto" chose: {lost}'
            )
        return ""
    if seconds is not None and seconds > UNSAVED_WARN_S:
        why = (
            "every=None saves only at the end, at a deadline or on a signal"
            if not cadence.auto
            else 'every="auto" has not saved yet'
        )
        return (
            f"{format_duration(seconds)} of training {what} ({why}): a crash now would lose "
            "it; call ckpt.save() or set every="
        )
    return ""


def _check(report: Report, name: str) -> Check | None:
    try:
        return report[name]
    except KeyError:
        return None


def _seen(check: Check) -> str:
    if check.status != "ok" and check.fix:
        return f"{check.seen} (fix: {check.fix})"
    return check.seen


def _session_deadline(run: Run) -> tuple[float | None, str]:
    """When the platform ends this session, and what that limit is called."""
    try:
        return run.platform.session_deadline(accelerator_attached())
    except Exception as exc:  # a bad NBRESUME_SESSION_CAP is the preflight's to report
        log.debug("nbresume: session deadline unknown: %s", exc)
        return None, ""


def _started_tracker() -> Tracker:
    started = Tracker()
    started.start()
    return started


_TRACKER = forksafe.Lazy(_started_tracker)


def tracker() -> Tracker:
    """The tracker of this process (created and started on first use)."""
    return _TRACKER.get()
