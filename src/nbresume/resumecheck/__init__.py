"""``nbresume check -- python train.py``: does *this* script resume exactly?

nbresume saves what it is given and the global random streams; a script may keep state
elsewhere (a generator of its own, a local counter, gradients accumulated over several
steps). The check runs the user's own command, in folders of its own: twice uninterrupted
(side by side), and once killed with SIGKILL at random moments (one of them inside a save)
and started again each time until it ends. The runs cover the
script's whole run when the uninterrupted runs end within :data:`DEFAULT_COVER_S` seconds;
otherwise (or with ``steps``) every run stops and saves at the same step N, and the verdict
says how many steps of how many it covered. The final checkpoints are then read back,
verified, and compared tensor by tensor and value by value; where they differ, the notes
every save left (:mod:`~nbresume.resumecheck.saves`) say from which step on. What differs
between the two uninterrupted runs too (a random stream the script never seeds nor draws
from) is left out; what differs only after the kills is reported by kind, with the likely
cause and its fix.

Nothing of a check outlives it: however it ends (its result, a failure, Ctrl-C, SIGTERM or
SIGHUP sent to it), the script's process groups are ended, what the script started included
(:func:`~nbresume.resumecheck.runs.end_groups`), and its folders are removed (unless ``keep``).
"""

from __future__ import annotations

import random
import shlex
import shutil
import signal
import tempfile
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

from nbresume.resumecheck import causes, observe, saves
from nbresume.resumecheck.compare import (
    KINDS,
    PROGRESS,
    RNG,
    Comparison,
    Difference,
    compare,
    final_checkpoints,
    reproducible,
)
from nbresume.resumecheck.runs import (
    Kill,
    Leg,
    Run,
    RunFailed,
    look,
    plan_kills,
    run_uninterrupted,
    run_with_kill,
    working_folder,
)

#: The budget of steps when the script's whole run does not end within the cover time.
DEFAULT_STEPS = 20
DEFAULT_KILLS = 2
DEFAULT_TIMEOUT_S = 300.0
#: The whole run is checked when the uninterrupted runs end within this many seconds.
DEFAULT_COVER_S = 120.0

__all__ = ["DEFAULT_COVER_S", "DEFAULT_KILLS", "DEFAULT_STEPS", "DEFAULT_TIMEOUT_S", "check"]


def check(
    command: Sequence[str],
    *,
    steps: int | None = None,
    kills: int = DEFAULT_KILLS,
    seed: int | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    cover_s: float = DEFAULT_COVER_S,
    keep: bool = False,
    say: Callable[[str], None] | None = None,
) -> int:
    """Run the check of ``command``; return the exit status: 0 when the resumed run ended
    bit-identical to the uninterrupted one, 1 when it did not or the check could not run.

    ``steps``: the budget every run stops at; ``None``: the script's whole run when it ends
    within ``cover_s`` seconds, else the first :data:`DEFAULT_STEPS` steps."""
    if seed is None:
        seed = random.SystemRandom().randrange(100_000)
    job = _Check(list(command), steps, kills, seed, timeout_s, cover_s, say or _print)
    extent = (
        f"{steps} steps" if steps is not None else f"the whole run (if it ends in {cover_s:g} s)"
    )
    job.say(f"nbresume check: `{shlex.join(command)}`, {extent}, {kills} kill(s), seed {seed}")
    with _StopSignals() as signals:
        work = Path(tempfile.mkdtemp(prefix="nbresume-check-"))
        try:
            return job.run(work)
        except RunFailed as exc:
            job.say(f"FAILED: {exc.message}")
            job.say(f"fix: {exc.fix}")
            return 1
        except _Stopped as stopped:
            job.say(
                f"STOPPED by {signal.Signals(stopped.signum).name}: the script's processes "
                "were ended"
            )
            return 128 + stopped.signum
        finally:
            signals.disarm()  # a second signal must not cut the removal short
            if keep:
                job.say(f"the runs' folders and logs are kept in {work}")
            else:
                shutil.rmtree(work, ignore_errors=True)


class _Stopped(Exception):
    """SIGTERM or SIGHUP reached the check (see :class:`_StopSignals`)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class _StopSignals:
    """While a check runs in the main thread: SIGTERM and SIGHUP raise :class:`_Stopped`
    there, once, so that the check ends the script's processes and removes its folders as it
    does on Ctrl-C, instead of dying with them left behind. A signal ignored before (under
    ``nohup``) stays ignored; the handlers before are put back at the end."""

    SIGNALS = (signal.SIGTERM, signal.SIGHUP)

    def __init__(self) -> None:
        self.previous: dict[int, Any] = {}
        self.armed = True

    def __enter__(self) -> _StopSignals:
        if threading.current_thread() is threading.main_thread():
            for signum in self.SIGNALS:
                if signal.getsignal(signum) is not signal.SIG_IGN:
                    self.previous[signum] = signal.signal(signum, self._stop)
        return self

    def _stop(self, signum: int, frame: FrameType | None) -> None:
        if self.armed:
            self.armed = False
            raise _Stopped(signum)

    def disarm(self) -> None:
        self.armed = False

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)


def _print(line: str) -> None:
    print(line, flush=True)


@dataclass
class _Check:
    command: list[str]
    #: The budget every run stops at; ``None``: the script's whole run.
    steps: int | None
    kills: int
    seed: int
    timeout_s: float
    cover_s: float
    say: Callable[[str], None]
    rng: random.Random = field(init=False)
    #: The step the uninterrupted run ended at, and the total its loop was given (if known).
    last: int = field(init=False, default=0)
    total: int | None = field(init=False, default=None)
    #: The script's globals that ended differently in the resumed run (name, kind, note).
    globals_differ: list[tuple[str, str, str]] = field(init=False, default_factory=list)
    #: The first save at which the resumed run differs from the uninterrupted one.
    first_difference: saves.FirstDifference | None = field(init=False, default=None)
    #: Every start of the killed run (run 2).
    legs: list[Leg] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)  # noqa: S311 - when to kill, not security

    def run(self, work: Path) -> int:
        first, again, second = (
            Run(name, work / folder, work / f"{folder}.log")
            for name, folder in (("run 1", "run1"), ("run 1b", "run1b"), ("run 2", "run2"))
        )
        for run in (first, again, second):
            run.root.mkdir()
            run.cwd = working_folder(work / f"{run.root.name}.cwd", Path.cwd())

        # Twice, side by side: what differs between two uninterrupted runs is not the
        # resume's doing (an unseeded stream the script never draws from, a time stamp),
        # and weights that differ there mean that the script is not reproducible at all.
        self._uninterrupted(work, first, again)
        finals = final_checkpoints(first.root)
        if not finals:
            self.say(
                "FAILED: run 1 saved no checkpoint. `nbresume check` redirects the folder of "
                "every nbresume.Checkpointer (and of nbresume.init) the script makes; does it "
                "make one and train in ckpt.steps() or ckpt.epochs()?"
            )
            return 1
        last = self.last = max(f.step for f in finals.values())
        totals = [f.state.total for f in finals.values() if f.state.total is not None]
        self.total = max(totals) if totals else None
        if any(f.state.done for f in finals.values()) or (
            self.total is not None and self.total <= last
        ):
            self.steps = None  # the script ended within the budget: its whole run is covered
        seconds = first.legs[0].seconds
        self.say(
            f"run 1 (uninterrupted, twice side by side): done at step {last} ({seconds:.1f} s)"
        )
        baseline = compare(finals, final_checkpoints(again.root))
        if not reproducible(baseline):
            return self._not_reproducible(baseline)
        noise = baseline.differences
        if noise:
            self._left_out(noise)

        killed = self._killed_run(second, plan_kills(self.kills, last, self.rng))
        comparison = compare(finals, final_checkpoints(second.root))
        ignored = {(d.folder, d.kind, d.name) for d in noise}
        comparison.differences = [
            d for d in comparison.differences if (d.folder, d.kind, d.name) not in ignored
        ]
        # The script's globals at its end: what differs between the uninterrupted runs is
        # left out, as above; what differs only after the kills is state no checkpoint holds.
        ended = observe.read(first.root)
        varies = {
            n for n, _, _ in observe.differing(ended, observe.read(again.root), leave_out=set())
        }
        self.globals_differ = observe.differing(ended, observe.read(second.root), leave_out=varies)
        # What each save held, noted in every run: the first save where the resumed run
        # left the uninterrupted one (what also differs between runs 1 and 1b left out).
        self.first_difference = saves.first_difference(
            saves.read(first.root), saves.read(again.root), saves.read(second.root)
        )
        self.legs = second.legs
        return self._report(comparison, noise, killed)

    def _uninterrupted(self, work: Path, first: Run, again: Run) -> None:
        """Run 1 and 1b, side by side: to their end when they end within the cover time (or
        no budget is given), else stopped at the budget."""
        if self.steps is None:
            if run_uninterrupted(
                self.command, [first, again], None, self.timeout_s, cap_s=self.cover_s
            ):
                return
            reached = look(first.root).committed or 0
            self.steps = DEFAULT_STEPS
            self.say(
                f"run 1 did not end within {self.cover_s:g} s (at step {reached:,} then): "
                f"checking the first {self.steps} steps (--steps N sets another budget, "
                "--cover SECONDS a longer wait)"
            )
            for run in (first, again):
                # Links are removed, never followed: the current folder's files stay.
                for folder in (run.root, run.cwd):
                    if folder is not None:
                        shutil.rmtree(folder, ignore_errors=True)
                run.root.mkdir()
                run.cwd = working_folder(work / f"{run.root.name}.cwd", Path.cwd())
                run.legs.clear()
        run_uninterrupted(self.command, [first, again], self.steps, self.timeout_s)

    def _coverage(self) -> str:
        """What the runs covered of the script's run."""
        if self.steps is None:
            return f"covered: the script's whole run, {self.last:,} steps, to its end"
        if self.total is not None:
            of = f"the first {self.last:,} of {self.total:,} steps"
        else:
            of = f"the first {self.last:,} steps (the loop does not say how many it has)"
        return (
            f"covered: {of}; differences that begin later are not seen: --steps N checks "
            "the first N"
        )

    def _left_out(self, noise: list[Difference]) -> None:
        shown = ", ".join(d.label() for d in noise)
        plural = len(noise) > 1
        if all(d.kind == RNG for d in noise):
            why = "the script does not seed " + ("them" if plural else "it")
        else:
            why = "they change from one run to the next" if plural else "it changes every run"
        differ = "they differ" if plural else "it differs"
        self.say(
            f"left out of the comparison: {shown}: {differ} between the two uninterrupted "
            f"runs too ({why})"
        )

    def _killed_run(self, run: Run, plan: list[Kill]) -> list[Leg]:
        """Run 2: started, killed as planned and started again until it ends; its kills."""
        killed: list[Leg] = []
        pending = list(plan)
        while True:
            kill = pending.pop(0) if pending else None
            if kill is not None and killed and killed[-1].step is not None:
                kill.target = max(kill.target, killed[-1].step + 1)  # train between two kills
            if kill is not None and kill.target >= self.last:
                kill, pending = None, []
            leg = run_with_kill(
                self.command,
                run,
                self.last if self.steps is None else self.steps,
                kill,
                rng=self.rng,
                timeout_s=self.timeout_s,
                budget=self.steps is not None,
            )
            run.legs.append(leg)
            began = f"resumed at step {leg.resumed_at}" if leg.resumed_at else "started fresh"
            if leg.ended == "done":
                newest = max((f.step for f in final_checkpoints(run.root).values()), default=0)
                self.say(f"run 2: {began}, done at step {newest}")
                return killed
            killed.append(leg)
            where = (
                f"while saving step {leg.step} (inside a save)"
                if leg.inside_save
                else f"after step {leg.step or 0} was saved (between saves)"
            )
            self.say(f"run 2: {began}, killed {where}")

    def _report(self, comparison: Comparison, noise: list[Difference], killed: list[Leg]) -> int:
        if not killed:
            self.say(
                "NOT CHECKED: no kill found a moment before the final save, so nothing was "
                "resumed: give the script more steps (--steps)"
            )
            self.say(self._coverage())
            return 1
        if not any(leg.inside_save for leg in killed):
            self.say("note: no kill landed inside a save this time (each save ended first)")
        if comparison.exact:
            held = set().union(*comparison.kinds.values())
            streams = sorted(comparison.streams - {d.name for d in noise if d.kind == RNG})
            parts = ", ".join(
                f"RNG ({', '.join(streams)})" if k == RNG else k
                for k in KINDS
                if k in held and k != PROGRESS and (k != RNG or streams)
            )
            ended = ", ".join(str(s) for s in sorted({b for _, b in comparison.compared.values()}))
            self.say(
                f"exact: the final checkpoints (step {ended}) are bit-identical, read back and "
                f"verified: {parts}"
            )
            for name, kind, _ in self.globals_differ:
                if kind != "counter":  # not used yet, or not in what the checkpoint holds
                    self.say(
                        f"note: the script's {name!r} ({kind}) ended in another state in the "
                        "resumed run: no Checkpointer restores it"
                    )
            self.say(self._coverage())
            return 0
        self.say("DIFFERENT: the resumed run did not end as the uninterrupted one")
        for name in comparison.missing:
            self.say(f"  the Checkpointer of folder {name!r} saved in one run only")
        for difference in comparison.differences:
            self.say(f"  {difference.line()}")
        for name, kind, note in self.globals_differ:
            self.say(f"  the script's global {name!r} ({kind}): {note}")
        if self.first_difference is not None:
            resumes = [leg.resumed_at for leg in self.legs if leg.resumed_at is not None]
            self.say(self._where_it_begins(self.first_difference, resumes))
        script = _script(self.command)
        shown = script.name if script is not None else "the script"
        verdicts = causes.likely_causes(comparison, _source(script), shown, self.globals_differ)
        for verdict in verdicts:
            self._cause(verdict.cause, verdict.evidence)
        if not verdicts:
            self.say(
                "cause: not determined: nothing the check observed points at a known cause; "
                "look for state the training step uses that the Checkpointer is not given (a "
                "generator of its own, a counter, gradients accumulated over several steps)"
            )
        self.say(self._coverage())
        budget = f" --steps {self.steps}" if self.steps is not None else ""
        self.say(
            f"repeat this check: nbresume check --seed {self.seed}{budget} "
            f"--kills {self.kills} -- {shlex.join(self.command)}"
        )
        return 1

    def _where_it_begins(self, found: saves.FirstDifference, resumes: list[int]) -> str:
        """The line that says from which save on the runs differ, and what differs there."""
        before = [step for step in resumes if step < found.step]
        since = (
            f"{_steps(found.step - max(before))} after run 2 resumed at step {max(before)}"
            if before
            else "before run 2 first resumed"
        )
        where = f" in {found.folder}/" if found.folder else ""
        same = (
            f", every save up to step {found.same_until} is identical" if found.same_until else ""
        )
        return (
            f"  the runs first differ at step {found.step}{where} ({since}{same}): {found.names()}"
        )

    def _not_reproducible(self, baseline: Comparison) -> int:
        self.say("NOT REPRODUCIBLE: two uninterrupted runs already end differently")
        for difference in baseline.differences:
            self.say(f"  {difference.line()}")
        for name in baseline.missing:
            self.say(f"  the Checkpointer of folder {name!r} saved in one run only")
        self._cause(causes.UNSEEDED, "two uninterrupted runs differ: no resumed run can match")
        return 1

    def _cause(self, cause: causes.Cause, evidence: str) -> None:
        self.say(f"likely cause: {cause.title}")
        self.say(f"  seen: {evidence}")
        self.say(f"  why: {cause.why}")
        self.say(f"  fix: {cause.fix}")


def _steps(count: int) -> str:
    return f"{count} step" if count == 1 else f"{count} steps"


def _script(command: Sequence[str]) -> Path | None:
    """The Python file the command runs, when it names one (its source hints at causes)."""
    for argument in command[1:]:
        if argument.endswith(".py") and Path(argument).is_file():
            return Path(argument)
    return None


def _source(script: Path | None) -> str | None:
    if script is None:
        return None
    try:
        return script.read_text(errors="replace")
    except OSError:
        return None
