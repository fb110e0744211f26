"""``%nbresume doctor|status|verify|save`` and ``%%nbresume once NAME``.

One magic name with subcommands, like a command line. ``doctor`` and ``verify`` run the very
code of ``nbresume doctor`` and ``nbresume verify``, so they print the same report (``verify``
of the live Checkpointer's folder is its ``verify()``: whether each checkpoint fits its objects
too, as a restore would judge it). ``once
skips a cell that already completed in the run of the last ``nbresume.init`` (its marker is in
the run's durable folder; see :mod:`nbresume.notebook.once`), so "Run all" after a reconnect
does not redo an hour of preprocessing.
"""

from __future__ import annotations

import ast
import shlex
import sys
import time
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from IPython.core.error import UsageError

from nbresume.checkpoint.loop import Checkpointer, confirm
from nbresume.checkpoint.units import format_bytes, format_duration
from nbresume.errors import NbresumeError
from nbresume.notebook import once as markers
from nbresume.notebook.extension_state import ExtensionState, state
from nbresume.run import current_run

if TYPE_CHECKING:
    from nbresume.checkpoint.loop import RunningLoop

USAGE = """\
%nbresume doctor [--json] [--accelerator KIND] [--internet|--no-internet] [--dir DIR]
                       check this machine (the same report as `nbresume doctor`)
%nbresume status       the run, its progress and its last checkpoint (and the panel)
%nbresume verify [DIR] read back every checkpoint of the run (or of DIR)
%nbresume save         save the current training state now, verified
%%nbresume once NAME [--force]
                       run this cell once per run: skip it when it already completed"""


def nbresume_magic(line: str, cell: str | None = None) -> Any:
    """The ``%nbresume`` line magic and ``%%nbresume`` cell magic."""
    __tracebackhide__ = True  # an error in the user's cell shows the cell, not this magic
    try:
        words = shlex.split(line)
    except ValueError as exc:
        raise UsageError(f"%nbresume {line}: {exc}") from None
    command, args = (words[0], words[1:]) if words else ("help", [])
    if cell is not None:
        if command != "once":
            raise UsageError(f"%%nbresume {command}: only `%%nbresume once NAME` takes a cell")
        return run_once(args, cell)
    commands = {
        "doctor": doctor,
        "status": status,
        "verify": verify,
        "save": save,
        "help": _help,
    }
    if command == "once":
        raise UsageError("once applies to a whole cell: start the cell with %%nbresume once NAME")
    if command not in commands:
        raise UsageError(f"%nbresume {command}: unknown command\n{USAGE}")
    try:
        commands[command](args)
    except NbresumeError as exc:
        print(f"nbresume {command}: error: {exc}", file=sys.stderr)
    return None


def _help(args: list[str]) -> None:
    print(USAGE)


def _cli(argv: list[str]) -> int:
    from nbresume.cli import main

    try:
        return main(argv)
    except SystemExit as exc:  # --help, or a usage error that argparse already printed
        return int(exc.code) if isinstance(exc.code, int) else 2


def doctor(args: list[str]) -> None:
    """The report of ``nbresume doctor``, from the same code; a wrong option fails the cell."""
    _cli_or_fail(["doctor", *args])


def _cli_or_fail(argv: list[str]) -> int:
    """Run the command line; a usage error (exit status 2, already printed) fails the cell,
    so that "Run all" stops there instead of going on with a check that never ran."""
    code = _cli(argv)
    if code == 2:
        raise UsageError(f"%nbresume {' '.join(argv)}: see the error above; %nbresume help")
    return code


def _state() -> ExtensionState:
    return state()


def status(args: list[str]) -> None:
    """Print where the run stands; in a notebook, show the panel too."""
    if args:
        raise UsageError("%nbresume status takes no arguments")
    state = _state()
    print(state.tracker_status_text())
    ckpt = state.tracker.checkpointer
    if ckpt is not None and not state.tracker.running:
        print(_safe_to_close(ckpt))
    state.display_panel()


def _safe_to_close(ckpt: RunningLoop) -> str:
    """Whether the storage itself holds the newest checkpoint now (asked once, no waiting)."""
    try:
        return f"safe to close: {confirm(ckpt.store, timeout=0)}"
    except NbresumeError as exc:
        return (
            f"not yet safe to close: {exc.message}; ckpt.wait(durable=True) waits until the "
            "storage confirms it"
        )


def verify(args: list[str]) -> None:
    """``nbresume verify`` on the run's folder (after the save in flight, if any); on the
    live Checkpointer's own folder, its :meth:`~nbresume.Checkpointer.verify`, which also
    says whether each checkpoint fits its objects, as a restore would."""
    if len(args) > 1:
        raise UsageError("%nbresume verify [DIR]")
    state = _state()
    ckpt = state.tracker.checkpointer
    if args:
        folder = args[0]
    elif ckpt is not None:
        folder = str(ckpt.store.location)
    else:
        folder = _run_folder("%nbresume verify")
    if ckpt is not None and str(ckpt.store.location) == folder:
        if isinstance(ckpt, Checkpointer):  # it has the objects: restore's verdict too
            from nbresume.cli import print_verify_report

            print_verify_report(ckpt.verify())  # after the save in flight
            return
        ckpt.wait()  # a save in flight is part of what the user asks about
    _cli_or_fail(["verify", folder])


def save(args: list[str]) -> None:
    """Save the shown Checkpointer's state now and wait until it verified."""
    if args:
        raise UsageError("%nbresume save takes no arguments")
    tracker = _state().tracker
    ckpt = tracker.checkpointer
    if ckpt is None:
        print("nbresume save: no Checkpointer in this kernel yet: nothing to save")
        return
    if tracker.running:
        print(f"nbresume save: {tracker.request_save()}")
        return
    info = ckpt.save(block=True)
    if info is None:  # pragma: no cover - a blocking save returns its checkpoint
        return
    where = f"step {info.step:,} ({format_bytes(info.size)}) at {info.location}"
    if ckpt.durability is not None:
        print(f"nbresume save: {where}: verified; syncing until the durable store confirms it")
    else:
        print(f"nbresume save: saved {where}: verified")


def _run_folder(what: str) -> str:
    run = current_run()
    if run is None:
        raise UsageError(
            f"{what} needs a run: call nbresume.init('name') first "
            "(it chooses the run's durable folder)"
        )
    return run.dir


def run_once(args: list[str], cell: str) -> Any:
    """Run ``cell`` unless it already completed in this run; record it when it completes."""
    __tracebackhide__ = True
    force = "--force" in args
    names = [a for a in args if a != "--force"]
    if len(names) != 1 or any(n.startswith("-") for n in names):
        raise UsageError("usage: %%nbresume once NAME [--force]")
    name = names[0]
    try:
        markers.check_name(name)
    except NbresumeError as exc:
        raise UsageError(str(exc)) from None
    root = _run_folder("%%nbresume once")
    fs = _marker_fs(root)
    record = None if force else markers.read_marker(root, name, fs=fs)
    if record is not None:
        print(f"nbresume: skipped {name!r}: {_completed(record)} (--force runs it again)")
        return None
    started = time.time()
    result = _run_cell(cell, name)  # an error propagates: nothing is recorded
    seconds = time.time() - started
    record = {
        "completed": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "seconds": round(seconds, 3),
    }
    try:
        markers.write_marker(root, name, record, fs=fs)
    except NbresumeError as exc:  # the cell ran; only its record is missing
        print(f"nbresume: {exc}", file=sys.stderr)
    return result


def _marker_fs(root: str) -> Any:
    """The fsspec file system for the markers of a URL run folder: the shown Checkpointer's,
    with its ``storage_options`` (credentials, ``endpoint_url``), when it saves in the same
    bucket (the run folder itself, a folder inside it, or beside it); else ``None``, and
    fsspec's own configuration applies: ``nbresume.init`` takes no ``storage_options``, they
    live on the Checkpointer's store."""
    if "://" not in root or root.startswith("file://"):
        return None
    ckpt = _state().tracker.checkpointer
    if ckpt is None:
        return None
    backend = ckpt.store.backend
    fs = getattr(backend, "fs", None)  # an fsspec store's file system
    if fs is None:
        return None
    return fs if _bucket(str(backend.location)) == _bucket(root) else None


def _bucket(url: str) -> tuple[str, str]:
    """The protocol and the bucket (or host) of ``url``: where one set of options reaches."""
    parts = urlsplit(url)
    return parts.scheme, parts.netloc


def _completed(record: dict[str, Any]) -> str:
    when = str(record.get("completed", "?"))
    text = f"it completed in this run at {when}"
    try:
        moment = datetime.fromisoformat(when).astimezone(timezone.utc)
        age = format_duration(time.time() - moment.timestamp())
        text = f"it completed in this run at {moment:%Y-%m-%d %H:%M:%S} UTC ({age} ago)"
    except (ValueError, TypeError):
        pass
    seconds = record.get("seconds")
    if isinstance(seconds, (int, float)):
        text += f" and took {format_duration(seconds)}"
    return text


def _run_cell(cell: str, name: str) -> Any:
    """Run the cell's code in the user's namespace as a cell would: IPython syntax allowed, the
    value of a last expression returned (and so displayed). Exceptions propagate."""
    __tracebackhide__ = True
    from IPython import get_ipython

    shell = get_ipython()
    if shell is None:  # pragma: no cover - magics only run inside IPython
        raise UsageError("%%nbresume once runs inside IPython only")
    code = shell.transform_cell(cell)
    try:
        filename = shell.compile.cache(code, raw_code=cell)  # tracebacks show the cell's lines
    except Exception:
        filename = f"<nbresume once {name}>"
    tree = ast.parse(code, filename=filename)
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = ast.Expression(tree.body.pop().value)
    namespace = shell.user_ns
    exec(compile(tree, filename, "exec"), namespace)  # noqa: S102 - the user's own cell
    if last is not None:
        return eval(compile(last, filename, "eval"), namespace)  # noqa: S307 - likewise
    return None


def register(shell: Any) -> None:
    """Register ``%nbresume`` / ``%%nbresume`` (again is harmless: it replaces itself)."""
    shell.register_magic_function(nbresume_magic, magic_kind="line_cell", magic_name="nbresume")
