"""``nbresume smoke NOTEBOOK``: run the notebook top to bottom, twice, on clean kernels.

A smoke run is what a batch run does, in minutes: papermill executes every cell on a fresh
kernel, with ``NBRESUME_SMOKE_STEPS`` set so that every ``steps()`` / ``epochs()`` loop saves
and stops after a few steps, as it would at the session deadline. Then a second fresh kernel
runs the notebook again, laid out as the next version would be, and must resume from the
first run's checkpoint: a save, a restart and a resume are exercised before hours are spent.

Where the notebook runs is a temporary sandbox:

- ``kaggle``: a folder laid out like a Kaggle machine (``working/``, ``input/``, ``temp/``,
  ``NBRESUME_KAGGLE_ROOT``), a batch run (``KAGGLE_KERNEL_RUN_TYPE=Batch``). The second run
  gets a fresh ``working/`` and the first run's output attached under ``input/``, read-only,
  as a chained version would: checkpoints kept elsewhere than nbresume's folder are lost
  there, and the smoke run says so.
- ``colab``: laid out like a Colab VM: a fresh working folder (``/content``) for each run,
  and one Google Drive folder (``MyDrive``) kept from the first run to the second, as Drive is
  kept when a runtime is replaced. ``nbresume.init`` finds Drive already mounted there
  (``NBRESUME_DRIVE_MOUNT``), so no ``google.colab`` is needed; checkpoints written anywhere
  else are gone in the second run, as on a new runtime. A notebook that imports
  ``google.colab`` itself (``drive.mount(...)``) runs only where that module exists.
- ``local``: a temporary ``NBRESUME_HOME`` shared by both runs.

The preflight only warns (``NBRESUME_STRICT=0``): the smoke run checks the notebook, not this
machine.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from nbresume import knobs
from nbresume.errors import UsageError
from nbresume.kaggle import notebook as nbfile
from nbresume.kaggle.lint import imports_colab
from nbresume.kaggle.output import check_runs

DEFAULT_STEPS = 3
DEFAULT_CELL_TIMEOUT_S = 600
TARGETS = ("auto", "kaggle", "colab", "local")
#: Knobs that say where the notebook runs: the sandbox sets them, whatever the caller had.
_SANDBOX_KNOBS = (
    knobs.PLATFORM.name,
    knobs.KAGGLE_ROOT.name,
    knobs.HOME.name,
    knobs.DRIVE_MOUNT.name,
    knobs.SESSION_START.name,
    knobs.SESSION_CAP.name,
    knobs.STRICT.name,
    knobs.SMOKE_STEPS.name,
    "KAGGLE_KERNEL_RUN_TYPE",
    "COLAB_RELEASE_TAG",
    "NO_GCE_CHECK",
)
_PAPERMILL_TAG = "papermill-error-cell-tag"
_GPU_WORDS = ("cuda", "nvidia driver", "no kernel image", "xla", "tpu")


@dataclass(frozen=True)
class CellFailure:
    """The cell a run stopped at: its number, its first line and the error."""

    #: The cell's place in the notebook, counting every cell from 1 (0: before any cell).
    cell: int
    first_line: str
    #: The exception's name and message as the kernel reported them, or why the run failed
    #: before any cell.
    error: str
    #: A likely cause and what to do, for errors a smoke run here is known to meet (no GPU,
    #: Kaggle's paths, ``input()``, the network); ``""`` otherwise.
    hint: str = ""

    def __str__(self) -> str:
        # Cell 0: the run failed before any cell (the kernel did not start, ...).
        text = f"cell {self.cell} (`{self.first_line}`): {self.error}" if self.cell else self.error
        return f"{text}\n    hint: {self.hint}" if self.hint else text


@dataclass
class RunResult:
    """One smoke run: how it ended, and the newest checkpoint of every run folder after it."""

    number: int
    failure: CellFailure | None
    checkpoints: dict[str, tuple[int | None, bool]]
    output: Path
    seconds: float

    @property
    def ok(self) -> bool:
        return self.failure is None


@dataclass
class SmokeReport:
    """Both runs, what was wrong, and notes."""

    notebook: Path
    target: str
    runs: list[RunResult] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    workdir: Path | None = None

    @property
    def ok(self) -> bool:
        return not self.problems and all(r.ok for r in self.runs) and len(self.runs) == 2

    def lines(self) -> list[str]:
        out = [f"smoke run of {self.notebook} ({self.target} sandbox):"]
        for run in self.runs:
            label = "first run" if run.number == 1 else "second run (fresh kernel, resumed)"
            if run.failure is not None:
                out.append(f"  {label}: FAILED at {run.failure}")
                continue
            saved = ", ".join(
                f"{name} at step {step}{' (done)' if done else ''}"
                for name, (step, done) in sorted(run.checkpoints.items())
            )
            line = f"  {label}: ok in {run.seconds:.0f} s"
            out.append(f"{line}; checkpoints: {saved}" if saved else line)
        out += [f"  problem: {p}" for p in self.problems]
        out += [f"  note: {n}" for n in self.notes]
        if self.workdir is not None:
            out.append(f"  the executed notebooks and the sandbox are in {self.workdir}")
        out.append("smoke: OK" if self.ok else "smoke: FAILED")
        return out


class _Sandbox:
    """Where a target's runs happen; see the module docstring."""

    def __init__(self, target: str, root: Path, slug: str) -> None:
        self.target = target
        self.root = root
        self.slug = slug

    def prepare(self, number: int) -> tuple[Path, dict[str, str]]:
        """The working folder and the environment of run ``number``."""
        env = {knobs.STRICT.name: "0"}
        if self.target == "kaggle":
            kaggle = self.root / "kaggle"
            if number == 2:
                # The first run's output becomes the next version's read-only input.
                attached = kaggle / "input" / self.slug
                attached.parent.mkdir(parents=True, exist_ok=True)
                (kaggle / "working").rename(attached)
                _make_read_only(attached)
            for sub in ("working", "input", "temp"):
                (kaggle / sub).mkdir(parents=True, exist_ok=True)
            env.update(
                {
                    knobs.PLATFORM.name: "kaggle-batch",
                    knobs.KAGGLE_ROOT.name: str(kaggle),
                    "KAGGLE_KERNEL_RUN_TYPE": "Batch",
                }
            )
            return kaggle / "working", env
        if self.target == "colab":
            # A new runtime each run: a fresh /content, the same Drive.
            content = self.root / f"content-{number}"
            content.mkdir(parents=True, exist_ok=True)
            (self.root / "drive" / "MyDrive").mkdir(parents=True, exist_ok=True)
            env.update(
                {
                    knobs.PLATFORM.name: "colab",
                    knobs.DRIVE_MOUNT.name: str(self.root / "drive"),
                    # This Drive is a local folder: there is no Drive API to ask, and no
                    # Google metadata server for google-auth to look for.
                    "NO_GCE_CHECK": "true",
                }
            )
            return content, env
        cwd = self.root / "cwd"
        cwd.mkdir(parents=True, exist_ok=True)
        env.update({knobs.PLATFORM.name: "local", knobs.HOME.name: str(self.root / "home")})
        return cwd, env

    def durable_roots(self) -> list[Path]:
        if self.target == "kaggle":
            return [self.root / "kaggle" / "working"]
        if self.target == "colab":
            return [self.root / "drive"]
        return [self.root / "home", self.root / "cwd"]

    def cleanup(self) -> None:
        for folder, subfolders, files in os.walk(self.root):
            for name in subfolders + files:
                with contextlib.suppress(OSError):
                    os.chmod(os.path.join(folder, name), 0o700, follow_symlinks=False)
        shutil.rmtree(self.root, ignore_errors=True)


def _make_read_only(folder: Path) -> None:
    for path in sorted(folder.rglob("*"), reverse=True):
        mode = stat.S_IMODE(path.lstat().st_mode)
        if not path.is_symlink():
            path.chmod(mode & ~0o222)
    folder.chmod(stat.S_IMODE(folder.stat().st_mode) & ~0o222)


@contextlib.contextmanager
def _environment(changes: dict[str, str]) -> Iterator[None]:
    """``os.environ`` for a kernel: the sandbox knobs replaced, restored afterwards (the kernel
    inherits this process's environment)."""
    saved = dict(os.environ)
    try:
        for name in _SANDBOX_KNOBS:
            os.environ.pop(name, None)
        os.environ.update(changes)
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _colab_importable() -> tuple[bool, str]:
    """Whether the kernel's Python can import google.colab, and the import error otherwise.
    Tried in a process of its own, as the kernel will (importing it here could mount or start
    things in this process)."""
    probe = "import google.colab"
    try:
        done = subprocess.run(
            [sys.executable, "-c", probe],
            check=False,
            capture_output=True,
            text=True,
            timeout=60,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, str(exc)
    if done.returncode != 0:
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        return False, lines[-1] if lines else f"exit status {done.returncode}"
    return True, ""


def choose_target(notebook: nbfile.Notebook, target: str) -> str:
    if target != "auto":
        return target
    if imports_colab(notebook):
        return "colab"
    return "kaggle" if "/kaggle/" in notebook.all_source() else "local"


def _kernel_name(notebook: nbfile.Notebook, notes: list[str]) -> str:
    from jupyter_client.kernelspec import KernelSpecManager

    installed = KernelSpecManager().find_kernel_specs()
    wanted = notebook.kernel_name
    if wanted and wanted in installed:
        return wanted
    if wanted:
        notes.append(f"the notebook's kernel {wanted!r} is not installed here; ran with python3")
    return "python3"


def smoke(
    path: str | Path,
    *,
    target: str = "auto",
    steps: int = DEFAULT_STEPS,
    cell_timeout_s: int = DEFAULT_CELL_TIMEOUT_S,
    keep: bool = False,
    slug: str = "previous-version",
) -> SmokeReport:
    """Run the notebook twice in a sandbox (see the module docstring) and report."""
    if target not in TARGETS:
        raise UsageError(f"there is no smoke target {target!r}", fix=f"use one of {TARGETS}")
    notebook = nbfile.load(path)
    try:
        import papermill  # noqa: F401  (fail early with the install hint)
    except ModuleNotFoundError as exc:
        raise UsageError(
            f"the smoke run needs the package {exc.name!r}", fix="pip install 'nbresume[kaggle]'"
        ) from None
    chosen = choose_target(notebook, target)
    report = SmokeReport(notebook=Path(path), target=chosen)
    if imports_colab(notebook):
        if chosen != "colab":
            report.problems.append(
                "the notebook imports google.colab, which does not exist on Kaggle; it "
                "stops at that cell there (remove the Drive mount, nbresume.init keeps "
                "checkpoints in /kaggle/working)"
            )
            return report
        importable, why = _colab_importable()
        if not importable:
            report.problems.append(
                f"the notebook imports google.colab, and google.colab cannot be imported here "
                f"({why}): it exists only on Colab. Let nbresume.init mount Drive instead of "
                "calling drive.mount yourself (the smoke run then maps Drive to a temporary "
                "folder), or run the smoke test on Colab"
            )
            return report
    kernel = "" if notebook.script else _kernel_name(notebook, report.notes)
    root = Path(tempfile.mkdtemp(prefix="nbresume-smoke-"))
    sandbox = _Sandbox(chosen, root, slug)
    try:
        for number in (1, 2):
            result = _run_once(
                notebook, sandbox, number, kernel=kernel, steps=steps, cell_timeout_s=cell_timeout_s
            )
            report.runs.append(result)
            if not result.ok:
                break
        if len(report.runs) == 2 and all(r.ok for r in report.runs):
            _compare(report, chosen)
    finally:
        if keep or not report.ok:
            report.workdir = root
        else:
            sandbox.cleanup()
    return report


def _run_once(
    notebook: nbfile.Notebook,
    sandbox: _Sandbox,
    number: int,
    *,
    kernel: str,
    steps: int,
    cell_timeout_s: int,
) -> RunResult:
    import papermill

    cwd, env = sandbox.prepare(number)
    env[knobs.SMOKE_STEPS.name] = str(steps)
    env[knobs.SESSION_START.name] = str(time.time())
    output = sandbox.root / f"run{number}-{notebook.path.name}"
    started = time.monotonic()
    failure = None
    if notebook.script:
        failure = _run_script(notebook, cwd, env, cell_timeout_s, output)
        return _result(sandbox, number, failure, output, started)
    with _environment(env):
        try:
            papermill.execute_notebook(
                str(notebook.path),
                str(output),
                kernel_name=kernel,
                cwd=str(cwd),
                progress_bar=False,
                execution_timeout=cell_timeout_s,
                kernel_manager_class=_kernel_manager_class(),
            )
        except Exception as exc:  # PapermillExecutionError, a dead kernel, a timeout, ...
            failure = _failure(output, exc)
    return _result(sandbox, number, failure, output, started)


def _kernel_manager_class() -> type:
    """jupyter_client's kernel manager, without the interrupt it sends before a shutdown.

    papermill shuts the kernel down right after the reply to its last request, and
    jupyter_client interrupts a kernel (SIGINT) before asking it to shut down. That signal can
    reach the kernel while it is still finishing that reply, with Python's SIGINT handler in
    place: the kernel then logs ``ERROR | KeyboardInterrupt caught in kernel`` in a run that
    went well. The kernel is idle there, so there is nothing to interrupt; one that is not
    (a smoke run stopped by Ctrl-C or a timeout) still gets SIGTERM and then SIGKILL from the
    shutdown, and nbresume's loops save and stop on SIGTERM.
    """
    from jupyter_client.manager import AsyncKernelManager

    class _QuietShutdownKernelManager(AsyncKernelManager):
        async def _async_interrupt_kernel(self) -> None:
            if self.shutting_down:
                return
            await super()._async_interrupt_kernel()

        interrupt_kernel = _async_interrupt_kernel

    return _QuietShutdownKernelManager


def _result(
    sandbox: _Sandbox, number: int, failure: CellFailure | None, output: Path, started: float
) -> RunResult:
    seconds = time.monotonic() - started
    checkpoints: dict[str, tuple[int | None, bool]] = {}
    for base in sandbox.durable_roots():
        if base.exists():
            for run in check_runs(base):
                checkpoints[str(run.folder.relative_to(base))] = (run.step, run.done)
    return RunResult(number, failure, checkpoints, output, seconds)


def _run_script(
    notebook: nbfile.Notebook, cwd: Path, env: dict[str, str], timeout_s: int, log: Path
) -> CellFailure | None:
    """Run a script kernel as Kaggle does (``python script.py`` in the working folder); its
    output goes to ``log``. The whole script counts as one cell."""
    script = notebook.path.resolve()
    with _environment(env), open(log, "wb") as out:
        try:
            done = subprocess.run(
                [sys.executable, str(script)],
                cwd=cwd,
                stdout=out,
                stderr=subprocess.STDOUT,
                timeout=timeout_s,
                check=False,
            )
        except subprocess.TimeoutExpired:
            return CellFailure(0, "", f"the script ran longer than {timeout_s} s")
    if done.returncode == 0:
        return None
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    error = lines[-1] if lines else f"exit status {done.returncode}"
    return CellFailure(0, "", f"{script.name} failed: {error}", _hint(error))


def _failure(output: Path, exc: Exception) -> CellFailure:
    """The failing cell, numbered as in the original notebook (papermill adds marker cells)."""
    error = f"{type(exc).__name__}: {exc}".strip().splitlines()
    fallback = CellFailure(0, "", error[-1] if error else type(exc).__name__)
    try:
        document = json.loads(output.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return fallback
    number = 0
    for cell in document.get("cells", []):
        tags = (cell.get("metadata") or {}).get("tags") or []
        if _PAPERMILL_TAG in tags:
            continue
        number += 1
        if cell.get("cell_type") != "code":
            continue
        errors = [o for o in cell.get("outputs", []) if o.get("output_type") == "error"]
        failed = ((cell.get("metadata") or {}).get("papermill") or {}).get("status") == "failed"
        if errors or failed:
            source = "".join(cell.get("source", []))
            first = next((line.strip() for line in source.splitlines() if line.strip()), "")
            if errors:
                text = f"{errors[0].get('ename', '')}: {errors[0].get('evalue', '')}"
            else:
                text = fallback.error
            return CellFailure(number, first[:80], text, _hint(text))
    return fallback


def _hint(error: str) -> str:
    lowered = error.lower()
    if any(word in lowered for word in _GPU_WORDS):
        return (
            "this machine has no such accelerator; the smoke run uses this machine. Pick the "
            "device at run time (`'cuda' if torch.cuda.is_available() else 'cpu'`), or commit "
            "with --no-smoke"
        )
    if "/kaggle/" in error and "no such file" in lowered:
        return (
            "paths under /kaggle exist only on Kaggle, and the sandbox cannot create them here: "
            "write relative paths (a batch run's working folder is /kaggle/working) or use "
            "run.dir, or run the smoke test in a Kaggle session"
        )
    if "stdinnotimplemented" in lowered or "raw_input" in lowered:
        return "input() cannot be answered in a batch run; set the value in the code"
    if "name resolution" in lowered or "connection" in lowered:
        return "the notebook needs the network; on Kaggle commit with --internet"
    return ""


def _compare(report: SmokeReport, target: str) -> None:
    """The second run must continue where the first one saved."""
    first, second = report.runs[0].checkpoints, report.runs[1].checkpoints
    if not first:
        report.notes.append(
            "no nbresume checkpoint was saved, so save, restart and resume were not exercised"
        )
        return
    for name, (step1, done1) in sorted(first.items()):
        step2, done2 = second.get(name, (None, False))
        if step2 is None:
            where = (
                "on Kaggle the next version starts with an empty /kaggle/working: only "
                "nbresume.init's folder (run.dir, run.checkpointer()) is carried over from the "
                "previous version's output"
                if target == "kaggle"
                else "the second run did not find it"
            )
            report.problems.append(f"{name}: the second run saved no checkpoint there ({where})")
        elif done1:
            if step2 != step1 or not done2:
                report.problems.append(
                    f"{name}: the first run finished at step {step1}, yet the second run "
                    f"saved step {step2}: a finished run must train no further step"
                )
            else:
                report.notes.append(
                    f"{name}: the training ended within the smoke run's steps; the second run "
                    "restored it and trained no further step"
                )
        elif step1 is not None and step2 <= step1:
            hint = (
                " On Kaggle only nbresume.init's folder is carried over between versions: "
                "use run.checkpointer(...) rather than a folder of your own."
                if target == "kaggle"
                else ""
            )
            report.problems.append(
                f"{name}: the second run did not resume from step {step1}: it saved step "
                f"{step2}, so it started over.{hint}"
            )
