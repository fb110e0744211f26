"""The ``nbresume`` command. Thin: it parses arguments and calls the modules that do the work.

Exit status: 0 success, 1 failure (for ``verify`` and ``pull``: any checkpoint that does not
verify), 2 usage error; for ``pull`` 3 when every checkpoint verified but the job still writes
at the source (not safe to tear down yet). ``nbresume run`` exits with its job's status.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import itertools
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from nbresume import runner
from nbresume.checkpoint.backends import SCHEME_PACKAGES, open_store
from nbresume.checkpoint.format import created_time
from nbresume.checkpoint.store import CheckpointStore, VerifyReport, holding
from nbresume.checkpoint.units import format_bytes, format_duration
from nbresume.checkpoint.version import __version__
from nbresume.errors import NbresumeError, StorageError, UsageError
from nbresume.preflight_checks import preflight, terminal_width


def _cmd_ls(args: argparse.Namespace) -> int:
    from nbresume.frameworks.layout import list_lines, local_kind

    framework = local_kind(args.dir)  # a Trainer's output_dir, a Lightning dirpath
    if framework is not None:
        print("\n".join(list_lines(*framework)))
        return 0
    store = CheckpointStore(args.dir, keep=None)
    infos = store.list()
    # A folder whose manifest cannot be read (not a regular file, or not a manifest) is a
    # broken checkpoint: listed too, so that it is never mistaken for an absent one.
    broken = store.broken(infos)  # only the folders list() left out are read again
    if not infos and not broken:
        print(f"no committed checkpoints in {store.location}")
        return 0
    if infos:
        print(f"{'step':>12}  {'size':>9}  {'created':<25}  metrics")
    for info in infos:
        metrics = " ".join(f"{k}={v:.6g}" for k, v in sorted(info.metrics.items()))
        print(f"{info.step:>12}  {format_bytes(info.size):>9}  {info.created:<25}  {metrics}")
    for result in broken:
        print(f"BROKEN step {result.step}: {result.problem}")
    print(f"{len(infos)} checkpoint(s) in {store.location} (not re-hashed: run `nbresume verify`)")
    if broken:
        print(
            f"{len(broken)} broken checkpoint(s): restore passes over them; `nbresume verify` "
            "reports them"
        )
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    from nbresume.frameworks.layout import local_kind, verify_lines

    framework = local_kind(args.dir)  # a Trainer's output_dir, a Lightning dirpath
    if framework is not None:
        lines, ok = verify_lines(*framework)
        print("\n".join(lines))
        return 0 if ok else 1
    if args.hashes:
        return _verify_hashes(CheckpointStore(args.dir, keep=None))
    return print_verify_report(CheckpointStore(args.dir, keep=None).verify())


def print_verify_report(report: VerifyReport) -> int:
    """Print a verification as ``nbresume verify`` does (also ``%nbresume verify``'s, from
    ``Checkpointer.verify()``); return its exit status."""
    for result in report.results:
        print(result)
    if report.uncommitted:
        names = ", ".join(report.uncommitted)
        print(f"(not checkpoints: {names}: a save that never committed; the next save cleans it)")
    if report.removed:
        names = ", ".join(report.removed)
        print(f"(removed while being read: {names}: the folder's writer keeps only the newest)")
    if not report.results:
        print(f"no checkpoints in {report.location}: nothing verified")
        return 1
    print(report.summary)
    return 0 if report.ok else 1


def _verify_hashes(store: Any) -> int:
    """``verify --hashes``: the store's own hash of each file (a bucket's ``xet_hash``)
    against the local one recorded at save time; nothing but the manifests is downloaded."""
    if not store.backend.write_back:
        print(
            f"{store.location} reports no hashes of its own: run `nbresume verify` without --hashes"
        )
        return 2
    infos = store.list()
    bad = 0
    for info in infos:
        confirmed, how = store.backend.confirm(info.name, info.manifest)
        bad += not confirmed
        print(f"{'OK' if confirmed else 'NOT CONFIRMED'} step {info.step}: {how}")
    if not infos:
        print(f"no checkpoints in {store.location}: nothing verified")
        return 1
    print(
        f"{len(infos) - bad} of {len(infos)} checkpoint(s) confirmed by {store.backend.store_name}"
    )
    return 1 if bad else 0


def _cmd_prune(args: argparse.Namespace) -> int:
    keep_best = None
    if args.best:
        metric, _, mode = args.best.partition(":")
        keep_best = (metric, mode or "min", args.best_count or args.keep)
    store = CheckpointStore(args.dir, keep=args.keep, keep_best=keep_best)
    if keep_best is not None:
        _check_metric(store, keep_best[0], args.dir)
    # Deleting beside a run that saves there would race with its own retention: prune holds
    # the folder's writer lease meanwhile, and a live writer's lease refuses it by name.
    with holding(store.backend, purpose="nbresume prune"):
        deleted = store.prune()
    left = [i.step for i in store.list()]
    print(f"deleted {len(deleted)} checkpoint(s): {deleted or 'none'}; kept steps {left}")
    return 0


def _check_metric(store: Any, metric: str, where: str) -> None:
    """Refuse ``--best METRIC`` when no checkpoint recorded that metric: keeping "the best" by
    it would silently keep nothing more than ``--keep``."""
    infos = store.list()
    if not infos or any(metric in info.metrics for info in infos):
        return
    known = sorted({name for info in infos for name in info.metrics})
    recorded = (
        f"the checkpoints recorded: {', '.join(known)}"
        if known
        else "no checkpoint recorded any metric (save(metric=...) records one)"
    )
    raise UsageError(
        f"--best {metric}: no checkpoint recorded a metric named {metric!r}; {recorded}",
        where=where,
        fix="give a metric the checkpoints have, or leave --best out; nothing was deleted",
    )


def _cmd_doctor(args: argparse.Namespace) -> int:
    import os

    report = preflight(
        args.accelerator,
        args.internet,
        args.dir,
        expected_bytes=args.expected_bytes,
        keep=args.keep,
        strict=False,
    )
    if args.json:
        print(report.to_json())
    else:
        color = sys.stdout.isatty() and not os.environ.get("NO_COLOR")
        print(report.format_table(color=color, width=terminal_width()))
    return 0 if report.ok else 1


def _cmd_run(args: argparse.Namespace) -> int:
    command = _command(args)
    if not command:
        return _no_command(args, "nbresume run --dir runs/exp1 -- python train.py")
    state, path = runner.prepare(
        command, log=args.log, ckpt_dir=args.dir, retries=args.retries, backoff=args.backoff
    )
    if args.detach:
        return runner.run_detached(state, path)
    return runner.run_attached(state, path)


def _cmd_status(args: argparse.Namespace) -> int:
    from nbresume.pull import is_kaggle_ref, kaggle_command
    from nbresume.runner import status

    if is_kaggle_ref(args.target):
        try:
            return kaggle_command("status")(args.target)
        except UsageError as exc:
            return _usage(args, str(exc))
    try:
        lines, code = status(args.target)
    except UsageError as exc:
        return _usage(args, str(exc))
    print("\n".join(lines))
    for line in _last_verified_lines(args.target):
        print(line)
    return code


#: Below this, a pause between checkpoints is never worth a warning in ``nbresume status``.
_STATUS_QUIET_FLOOR_S = 60.0


def _last_verified_lines(target: str, now: float | None = None) -> list[str]:
    """``last verified checkpoint: step N, X ago``, and a warning when that is more than twice
    the usual time between two checkpoints while the run may still be training.

    From outside the training process only the folder is known: the time since the newest
    checkpoint that verifies, not the steps trained since (the panel and the status line of
    the training process show both).
    """
    import time

    from nbresume.frameworks.layout import local_kind
    from nbresume.frameworks.resumable import resumable
    from nbresume.runner import find_state

    now = time.time() if now is None else now
    location = target
    running: bool | None = None  # None: no run record, so nobody knows
    folder = _local_path(target)
    if folder is not None and folder.is_dir():
        recorded = find_state(folder)
        if recorded is not None:
            state, _ = recorded
            running = state.status != "exited"
            location = state.dir or target
    framework = local_kind(location)  # a Trainer's output_dir, a Lightning dirpath
    try:
        if framework is not None:
            # The checkpoint the framework's own resume takes (nbresume.hf.last_checkpoint,
            # nbresume.lightning.last_checkpoint).
            found = resumable(*framework)
            seen = bool(found.created_times or found.passed_over)
            verified = None if found.step is None else (found.step, found.created)
            times = list(found.created_times)
        else:
            store = CheckpointStore(location, keep=None)
            infos = store.list()
            newest = next((i for i in reversed(infos) if store.verify(i.step).ok), None)
            seen = bool(infos)
            verified = None if newest is None else (newest.step, newest.created)
            times = [i.created for i in infos]
    except (NbresumeError, OSError):
        return []  # the checkpoint line above already says what is wrong with the folder
    if verified is None:
        if not seen:
            return []
        return ["last verified checkpoint: none: no checkpoint in the folder verifies"]
    step, when = verified
    created = created_time(when)
    if created is None:
        return [f"last verified checkpoint: step {step:,}"]
    quiet = max(0.0, now - created)
    lines = [f"last verified checkpoint: step {step:,}, {format_duration(quiet)} ago"]
    stamps = sorted(t for t in (created_time(c) for c in times[-6:]) if t is not None)
    gaps = sorted(b - a for a, b in itertools.pairwise(stamps) if b > a)
    if gaps and running is not False:
        usual = gaps[len(gaps) // 2]
        if quiet > max(2 * usual, _STATUS_QUIET_FLOOR_S):
            gap = (
                f"no verified checkpoint for {format_duration(quiet)}, more than twice the "
                f"usual {format_duration(usual)} between two"
            )
            if running:
                lines.append(
                    f"WARNING: {gap}: a crash now loses all that training; look at the "
                    "training's log for failed saves"
                )
            else:  # no run record: the training may have ended long ago
                lines.append(f"note: {gap}: if the training still runs, it is not saving")
    return lines


def _cmd_pull(args: argparse.Namespace) -> int:
    from nbresume.pull import is_kaggle_ref, kaggle_command, pull

    if args.dst and args.output and args.dst != args.output:
        return _usage(args, "give the destination once: DST or -o DIR")
    args.dst = args.dst or args.output
    if is_kaggle_ref(args.src):
        try:
            return kaggle_command("pull")(args.src, args.dst)
        except UsageError as exc:
            return _usage(args, str(exc))
    if args.dst is None:
        return _usage(args, "a destination folder is needed: nbresume pull SRC DST")
    if _local_path(args.src) is None and not args.src.lower().startswith(("ssh://", "sftp://")):
        # Reach the store (credentials, endpoint) before anything is printed or created.
        open_store(args.src).list_folders()
    try:
        return pull(args.src, args.dst, identity=args.identity, rate=args.limit_rate)
    except UsageError as exc:
        return _usage(args, str(exc))


def _cmd_push(args: argparse.Namespace) -> int:
    from nbresume.kaggle.push import push

    return push(args.dir, args.kaggle_dataset, name=args.name, step=args.step)


def _usage(args: argparse.Namespace, message: str) -> int:
    """A usage error found after parsing: reported as argparse does, exit status 2."""
    print(f"nbresume {_name(args)}: error: {message}", file=sys.stderr)
    return 2


def _command(args: argparse.Namespace) -> list[str]:
    """The command that ``run`` and ``check`` are given after ``--`` (argparse keeps it)."""
    command = list(args.command)
    return command[1:] if command[:1] == ["--"] else command


def _no_command(args: argparse.Namespace, example: str) -> int:
    """The usage error of ``run`` or ``check`` given no command; ``example`` shows one."""
    return _usage(
        args, f"the command to {_name(args)} is missing: give it after --, as in `{example}`"
    )


def _cmd_convert_lightning(args: argparse.Namespace) -> int:
    try:
        from nbresume.lightning.convert import convert
    except ImportError as exc:
        return _usage(args, f'{exc}; install Lightning: pip install "nbresume[lightning]"')
    print(
        f"nbresume convert-lightning: reading {args.ckpt} once with "
        "torch.load(weights_only=True): tensors and plain values only, no code runs"
    )
    target = convert(args.ckpt, args.dir)
    print(f"nbresume convert-lightning: wrote {target} (verified)")
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from nbresume.demo import run_demo

    return run_demo(args.dir, seed=args.seed)


def _cmd_check(args: argparse.Namespace) -> int:
    from nbresume.resumecheck import check

    command = _command(args)
    if not command:
        return _no_command(args, "nbresume check -- python train.py")
    return check(
        command,
        steps=args.steps,
        kills=args.kills,
        seed=args.seed,
        timeout_s=args.timeout,
        cover_s=args.cover,
        keep=args.keep,
    )


def _cmd_smoke(args: argparse.Namespace) -> int:
    from nbresume.kaggle.commands import smoke

    return smoke(
        args.notebook,
        target=args.platform,
        steps=args.steps,
        cell_timeout_s=args.cell_timeout,
        keep=args.keep,
    )


def _cmd_commit(args: argparse.Namespace) -> int:
    from nbresume.kaggle.commands import commit

    return commit(
        args.notebook,
        kernel=args.kernel,
        accelerator=args.accelerator,
        internet=args.internet,
        private=args.private,
        title=args.title,
        smoke_first=args.smoke,
        allow=frozenset(args.allow or ()),
        chain=args.chain,
        legs=args.legs,
        poll_s=args.poll,
        timeout_s=args.timeout,
        output=args.output,
        dry_run=args.dry_run,
        wheel=args.wheel,
        datasets=tuple(args.dataset or ()),
    )


def _cmd_chain(args: argparse.Namespace) -> int:
    from nbresume.kaggle.commands import chain

    return chain(
        args.kernel, legs=args.legs, poll_s=args.poll, timeout_s=args.timeout, output=args.output
    )


def _checked_by(
    module: str, function: str, *, errors: type[Exception] = NbresumeError, keep_value: bool = False
) -> Callable[[str], Any]:
    """An argparse type: ``module.function`` checks the text (``module`` imported only then);
    its error becomes argparse's message. The type's value is the text, or the function's
    value where ``keep_value``."""

    def parse(text: str) -> Any:
        check = getattr(importlib.import_module(module), function)
        try:
            value = check(text)
        except errors as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return value if keep_value else text

    return parse


_kaggle_ref = _checked_by("nbresume.kaggle.metadata", "parse_ref")
_kaggle_dataset = _checked_by("nbresume.kaggle.push", "check_dataset_ref")
_push_name = _checked_by("nbresume.kaggle.push", "check_push_name", keep_value=True)
_kaggle_accelerator = _checked_by("nbresume.kaggle.metadata", "parse_accelerator")
_accelerator = _checked_by("nbresume.preflight_checks", "parse_accelerator")
_rate = _checked_by("nbresume.pull", "parse_rate", errors=ValueError, keep_value=True)


def _seconds_to_hour(*, zero: bool) -> Callable[[str], float]:
    """An argparse type: seconds up to an hour, more than 0 (or, where ``zero``, at least 0)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
        above_low = value >= 0 if zero else value > 0
        if not (above_low and value <= 3600):
            low = "at least 0" if zero else "more than 0"
            raise argparse.ArgumentTypeError(f"must be {low} and at most 3600, got {value}")
        return value

    return parse


_poll_seconds = _seconds_to_hour(zero=False)
_seconds = _seconds_to_hour(zero=True)


def _add_chain_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--legs", type=_positive_int, default=3, help="at most this many legs (default 3)"
    )
    p.add_argument(
        "--poll",
        type=_poll_seconds,
        default=60.0,
        metavar="SECONDS",
        help="seconds between two status checks (default 60)",
    )
    p.add_argument(
        "--timeout",
        type=_positive_int,
        metavar="SECONDS",
        help="Kaggle's limit on one leg's run time (kaggle kernels push --timeout)",
    )
    p.add_argument(
        "-o",
        "--output",
        metavar="DIR",
        help="where each leg's output is downloaded (default ./SLUG-chain)",
    )


def _add_kaggle_parsers(sub: Any) -> None:
    from nbresume.kaggle.lint import RULES

    p = sub.add_parser(
        "smoke",
        help="run a notebook twice on clean kernels, a few steps each: save, restart, resume",
        description="Run NOTEBOOK top to bottom with papermill in a temporary sandbox, every "
        "steps()/epochs() loop capped to a few steps (it saves and stops as at a deadline), "
        "then again on a fresh kernel, which must resume from the first run's checkpoint. A "
        "failure names the cell, its first line and the error. Exit status 1 on a failure.",
    )
    p.add_argument("notebook", help="the .ipynb file, or a .py script")
    p.add_argument(
        "--platform",
        choices=("auto", "kaggle", "colab", "local"),
        default="auto",
        help="the sandbox: a Kaggle machine, a Colab runtime (a fresh /content each run, one "
        "Drive folder kept between runs) or this machine "
        "(default: colab when the notebook imports google.colab, kaggle when it mentions "
        "/kaggle/, else local)",
    )
    p.add_argument(
        "--steps", type=_positive_int, default=3, help="steps per training loop (default 3)"
    )
    p.add_argument(
        "--cell-timeout",
        type=_positive_int,
        default=600,
        metavar="SECONDS",
        help="longest a cell may run (default 600)",
    )
    p.add_argument("--keep", action="store_true", help="keep the sandbox and executed notebooks")
    p.set_defaults(func=_cmd_smoke)

    p = sub.add_parser(
        "commit",
        help="check a notebook and push it to Kaggle as a batch run (Save & Run All)",
        description="Refuse a notebook with credentials in its cells or outputs; lint it for "
        "what breaks a batch run; run the smoke test; write kernel-metadata.json next to it; "
        "push it with the kaggle client and check Kaggle's answer. Exit status 1 when "
        "anything refuses (Kaggle's errors included), with what to do.",
    )
    p.add_argument("notebook", help="the .ipynb file, or a .py script kernel")
    p.add_argument(
        "--kernel",
        type=_kaggle_ref,
        metavar="OWNER/SLUG",
        help="the notebook on Kaggle (default: your Kaggle user name, from KAGGLE_USERNAME or "
        "kaggle.json, and a slug made from the file name)",
    )
    p.add_argument(
        "--accelerator",
        type=_kaggle_accelerator,
        metavar="KIND",
        help="t4x2 (the GPU default), p100, tpu, cpu, or a Kaggle machine shape such as "
        "NvidiaTeslaT4 (default: what nbresume.init asks for, else cpu)",
    )
    p.add_argument(
        "--internet",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="internet on or off (default: what nbresume.init asks for, else on)",
    )
    privacy = p.add_mutually_exclusive_group()
    privacy.add_argument(
        "--private", dest="private", action="store_true", default=True, help="(the default)"
    )
    privacy.add_argument("--public", dest="private", action="store_false", help="make it public")
    p.add_argument("--title", help="the notebook's title (default: from the slug)")
    p.add_argument("--no-smoke", dest="smoke", action="store_false", help="skip the smoke run")
    p.add_argument(
        "--allow",
        action="append",
        choices=RULES,
        metavar="RULE",
        help=f"make a lint rule's errors warnings (rules: {', '.join(RULES)})",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="scan, lint and smoke, then print the kernel-metadata.json that would be pushed; "
        "write and push nothing (no Kaggle credentials needed)",
    )
    p.add_argument(
        "--wheel",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="upload the installed nbresume as the private dataset OWNER/nbresume-wheel and "
        "attach it, for an install with internet off (default: with --no-internet)",
    )
    p.add_argument(
        "--dataset",
        action="append",
        type=_kaggle_dataset,
        metavar="OWNER/SLUG",
        help="attach this dataset (repeat for more), such as one made by `nbresume push`",
    )
    p.add_argument(
        "--chain", action="store_true", help="then follow the run leg after leg until done"
    )
    _add_chain_options(p)
    p.set_defaults(func=_cmd_commit)

    p = sub.add_parser(
        "chain",
        help="continue a Kaggle run leg after leg, each leg resuming from the last one's output",
        description="Wait for the notebook's latest version to finish, download its output "
        "and verify every checkpoint; if the training is not done, push the next leg, with "
        "that output attached, to the partner notebook OWNER/SLUG-b (legs alternate between "
        "the two). Stops at a failed leg (exit status 1), when the training is done, or "
        "after --legs legs.",
    )
    p.add_argument("kernel", type=_kaggle_ref, metavar="OWNER/SLUG", help="the notebook")
    _add_chain_options(p)
    p.set_defaults(func=_cmd_chain)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="nbresume",
        description="Verified checkpoints and exact resume for long PyTorch training.",
    )
    parser.add_argument("--version", action="version", version=f"nbresume {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser(
        "ls",
        help="list the committed checkpoints of a folder",
        description="List the committed checkpoints of DIR: step, size, creation time and "
        "metrics, newest last, and any broken checkpoint folder. Reads the manifests only; "
        "`nbresume verify` re-hashes the files.",
    )
    p.add_argument("dir", help="checkpoint folder: a path or an fsspec URL")
    p.set_defaults(func=_cmd_ls)

    p = sub.add_parser(
        "verify",
        help="read back every checkpoint and compare it with its manifest",
        description="Read back every file of every checkpoint in DIR and compare its size and "
        "hash with the manifest, and check that each is complete and consistent. Exit status 1 "
        "when any checkpoint does not verify, or when there is none. Whether a checkpoint fits "
        "a model and optimizer (names, shapes, dtypes) needs those objects: restore() judges "
        "it, and so does Checkpointer.verify() (and %nbresume verify with a live Checkpointer).",
    )
    p.add_argument("dir", help="checkpoint folder: a path or an fsspec URL")
    p.add_argument(
        "--hashes",
        action="store_true",
        help="download nothing but the manifests: compare the store's own hash of each file "
        "(an hf://buckets bucket's xet_hash, Google Drive's MD5) with the one recorded at save",
    )
    p.set_defaults(func=_cmd_verify)

    p = sub.add_parser(
        "prune",
        help="delete all but the newest (and best) verified checkpoints",
        description="Keep the --keep newest checkpoints of DIR (and, with --best, the best "
        "by a metric the checkpoints recorded with save(metric=...)); delete the others. "
        "Holds the folder's writer lease meanwhile: a live training saving there refuses it.",
    )
    p.add_argument("dir", help="checkpoint folder: a path or an fsspec URL")
    p.add_argument("--keep", type=_positive_int, required=True, help="how many newest to keep")
    p.add_argument("--best", metavar="METRIC[:min|max]", help="also keep the best by a metric")
    p.add_argument(
        "--best-count", type=_positive_int, help="how many best to keep (default --keep)"
    )
    p.set_defaults(func=_cmd_prune)

    p = sub.add_parser(
        "doctor",
        help="check this machine: accelerator, internet, durable folder, memory, CPU, clock",
        description="Run the first-cell checks and print them as a table (or JSON). "
        "Exit status 1 when a check fails.",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument(
        "--accelerator",
        metavar="KIND",
        type=_accelerator,
        help="what the training needs: gpu, gpu:N, tpu or cpu",
    )
    p.add_argument(
        "--internet",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the training needs internet on (--internet) or off (--no-internet)",
    )
    p.add_argument("--dir", help="the durable folder to check (default: the platform's)")
    p.add_argument(
        "--expected-bytes", type=_positive_int, metavar="N", help="size of one checkpoint"
    )
    p.add_argument("--keep", type=_positive_int, default=3, help="checkpoints kept (default 3)")
    p.set_defaults(func=_cmd_doctor)

    p = sub.add_parser(
        "run",
        help="run a training command that survives the SSH session and is retried after a "
        "preemption",
        description="Start CMD in a session of its own (an SSH drop does not stop it), with its "
        "output appended to a log file, and start the identical command again when something "
        "outside killed it (a preemption, a kill): it resumes from its newest verified "
        "checkpoint. A Python exception, a full disk or the out-of-memory killer is not "
        "retried. Exit status: the job's.",
    )
    p.add_argument("--detach", action="store_true", help="return as soon as the job is started")
    p.add_argument(
        "--retries", type=_count, default=3, metavar="N", help="retries after a kill (default 3)"
    )
    p.add_argument(
        "--backoff",
        type=_seconds,
        default=5.0,
        metavar="SECONDS",
        help="pause before the first retry, doubled each time (default 5)",
    )
    p.add_argument(
        "--log",
        metavar="FILE",
        help="log file (default: CKPT_DIR/nbresume-run.log, else ./nbresume-run.log)",
    )
    p.add_argument(
        "--dir", metavar="CKPT_DIR", help="the run's checkpoint folder (for the log and status)"
    )
    p.add_argument("command", nargs=argparse.REMAINDER, metavar="-- CMD ...")
    p.set_defaults(func=_cmd_run)

    p = sub.add_parser(
        "status",
        help="is the run alive, and how old is its newest verified checkpoint",
        description="DIR is the folder of a run's log (where `nbresume run` keeps its record) "
        "or its checkpoint folder (a Hugging Face Trainer's output_dir and a Lightning "
        "ModelCheckpoint folder too: the checkpoint their own resume takes). Liveness is "
        "judged by the processes and the checkpoint age, not by the log. An argument "
        "owner/slug (no scheme, not a local path) names a Kaggle notebook. Exit status 1 when "
        "the run died or failed, or its newest checkpoint does not verify.",
    )
    p.add_argument("target", metavar="DIR", help="run folder, checkpoint folder, or owner/slug")
    p.set_defaults(func=_cmd_status)

    p = sub.add_parser(
        "pull",
        help="copy a run's checkpoints to a local folder, verified and resumable",
        description="Copy every committed checkpoint of SRC into the local folder DST, each "
        "file checked against its manifest; an interrupted pull resumes where it stopped. "
        "SRC: ssh://[user@]host[:port]/path (ssh://host/~/path is relative to the remote "
        "home), any fsspec URL, or a local path; owner/slug names a Kaggle notebook. The last "
        "line says the remote copy is safe to tear down only when nothing writes there any "
        "more. Exit status 1 when any checkpoint does not verify; 3 when all verified but a "
        "live training still holds the source (its writer lease): pull again after it "
        "stops. Nothing remote is ever deleted.",
    )
    p.add_argument("src", metavar="SRC", help="where the checkpoints are")
    p.add_argument("dst", metavar="DST", nargs="?", help="local folder to copy them into")
    p.add_argument("-o", "--output", metavar="DIR", help="the same as DST")
    p.add_argument("-i", "--identity", metavar="KEY_FILE", help="SSH private key (as ssh -i)")
    p.add_argument(
        "--limit-rate",
        type=_rate,
        metavar="RATE",
        help="at most RATE bytes per second, such as 500k or 2M",
    )
    p.set_defaults(func=_cmd_pull)

    p = sub.add_parser(
        "push",
        help="upload a run's checkpoint, verified, as a Kaggle dataset",
        description="Upload the newest committed checkpoint of DIR (or --step N) as a new "
        "version of the private Kaggle dataset OWNER/SLUG, in the layout nbresume/NAME/STEP/ "
        "that nbresume.init(NAME) finds in a Kaggle notebook with the dataset attached. The "
        "checkpoint is copied and every file checked against its manifest first; one that "
        "does not verify is not uploaded. Needs Kaggle credentials (KAGGLE_USERNAME and "
        "KAGGLE_KEY, or kaggle.json).",
    )
    p.add_argument("dir", help="the run's checkpoint folder: a path or an fsspec URL")
    p.add_argument(
        "--kaggle-dataset",
        required=True,
        type=_kaggle_dataset,
        metavar="OWNER/SLUG",
        help="the private dataset to upload to (made by the first push)",
    )
    p.add_argument(
        "--name",
        type=_push_name,
        help="the run's name in nbresume.init (default: the folder's last part)",
    )
    p.add_argument("--step", type=int, help="push this step rather than the newest")
    p.set_defaults(func=_cmd_push)

    _add_kaggle_parsers(sub)

    p = sub.add_parser(
        "demo",
        help="show the promise: save, kill -9, restore, verify",
        description="Train a small model twice with the same command: once uninterrupted, "
        "once killed with SIGKILL at two random moments and started again. The killed run "
        "resumes from its newest verified checkpoint and ends with weights bit-identical to "
        "the uninterrupted one; every checkpoint left is then verified. Exit status 1 when "
        "the weights differ.",
    )
    p.add_argument(
        "--dir", default="nbresume-demo", help="folder for the demo (default ./nbresume-demo)"
    )
    p.add_argument("--seed", type=int, default=None, help="make the random kill reproducible")
    p.set_defaults(func=_cmd_demo)

    p = sub.add_parser(
        "check",
        help="test your own script for exact resume: kill it, resume it, compare",
        description="Run CMD (your training script, as you run it) to its end when it ends "
        "within --cover seconds, else on a budget of steps, in temporary folders that every "
        "Checkpointer of the script saves into: once "
        "uninterrupted, and once killed with SIGKILL at random moments (one inside a save) "
        "and started again each time until it ends. Both runs stop and save at the same "
        "step; the two final checkpoints are read back, verified and compared tensor by "
        "tensor. The report says 'exact', or which state differs (model, optimizer, "
        "scheduler, RNG, loader position, a plain value) and the likely cause, with its "
        "fix. Exit status 0 when exact, 1 when it differs or a run failed.",
    )
    p.add_argument(
        "--steps",
        type=_int_at_least(2),
        default=None,
        metavar="N",
        help="every training loop saves and stops at step N (default: the script's whole run "
        "when it ends within --cover seconds, else 20)",
    )
    p.add_argument(
        "--cover",
        type=_positive_int,
        default=120,
        metavar="SECONDS",
        help="check the script's whole run when it ends within SECONDS (default 120)",
    )
    p.add_argument("--kills", type=_positive_int, default=2, metavar="K", help="kills (default 2)")
    p.add_argument("--seed", type=int, default=None, help="repeat the kill moments of a check")
    p.add_argument(
        "--timeout",
        type=_positive_int,
        default=300,
        metavar="SECONDS",
        help="longest one start of the script may run (default 300)",
    )
    p.add_argument("--keep", action="store_true", help="keep the runs' folders and logs")
    p.add_argument("command", nargs=argparse.REMAINDER, metavar="-- CMD ...")
    p.set_defaults(func=_cmd_check)

    p = sub.add_parser(
        "convert-lightning",
        help="move a Lightning run over: a pickled .ckpt written as a verified checkpoint",
        description="Read the Lightning checkpoint file CKPT once with "
        "torch.load(weights_only=True) (tensors and plain values only: no code in it can "
        "run) and write it as DIR/<its name>, a folder holding a verified nbresume "
        "checkpoint that nbresume.lightning.CheckpointIO loads and "
        "nbresume.lightning.last_checkpoint(DIR) finds. Needs Lightning "
        '(pip install "nbresume[lightning]").',
    )
    p.add_argument("ckpt", metavar="CKPT", help="the .ckpt file Lightning wrote")
    p.add_argument("dir", metavar="DIR", help="the folder to write it into (ModelCheckpoint's)")
    p.set_defaults(func=_cmd_convert_lightning)
    return parser


def _int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer of at least ``minimum``, with a message that says so."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    return parse


_positive_int = _int_at_least(1)
_count = _int_at_least(0)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "best", None) and args.best.partition(":")[2] not in ("", "min", "max"):
        parser.error(f"--best {args.best}: the mode after ':' must be min or max")
    location: str | None = None
    try:
        location = _folder_argument(args)
        if location is not None:
            _check_folder(_name(args), location)
        status: int = args.func(args)
    except NbresumeError as exc:
        return _error(args, exc)
    except KeyboardInterrupt:
        print(f"nbresume {_name(args)}: interrupted", file=sys.stderr)
        return 130
    except OSError as exc:
        return _error(args, _os_problem(_name(args), location, exc))
    except Exception as exc:
        problem = _client_problem(location, exc)
        if problem is None:
            raise  # a bug in nbresume: the traceback is what a report needs
        return _error(args, problem)
    return status


# -- problems in the user's world: one line each, with the fix --------------------------------

#: The command's argument that names a checkpoint folder.
_FOLDER_ARGUMENT = {
    "ls": "dir",
    "verify": "dir",
    "prune": "dir",
    "status": "target",
    "pull": "src",
    "push": "dir",
}


def _name(args: argparse.Namespace) -> str:
    """The command's name (``args.command`` is ``run``'s own command line for ``run``)."""
    name: str = args.func.__name__.removeprefix("_cmd_")
    return name


def _error(args: argparse.Namespace, exc: NbresumeError) -> int:
    """The error as one line on stderr; exit status 1."""
    text = " ".join(str(exc).split())
    print(f"nbresume {_name(args)}: error: {text}", file=sys.stderr)
    return 1


def _folder_argument(args: argparse.Namespace) -> str | None:
    """The checkpoint folder the command works on (not a Kaggle notebook, not ssh://, which
    ``pull`` reaches and checks itself)."""
    name = _FOLDER_ARGUMENT.get(_name(args))
    location = getattr(args, name, None) if name else None
    if not isinstance(location, str):
        return None
    if _name(args) in ("status", "pull"):
        from nbresume.pull import is_kaggle_ref

        if is_kaggle_ref(location) or location.lower().startswith(("ssh://", "sftp://")):
            return None
    return location


def _local_path(location: str) -> Path | None:
    """The local folder a location names (``None`` for a URL of another file system)."""
    scheme, sep, rest = location.partition("://")
    if not sep:
        return Path(location).expanduser()
    if scheme.lower() in ("file", "local"):
        return Path(rest).expanduser()
    return None


def _check_folder(command: str, location: str) -> None:
    """Refuse, before any work, a folder that is missing or a file, and a URL whose scheme
    fsspec does not know or whose package is not installed."""
    folder = _local_path(location)
    if folder is None:
        for part in location.split("::"):  # fsspec chains, as in simplecache::s3://...
            if "://" in part:
                _check_scheme(part.split("://", 1)[0].lower(), location)
        return
    if not folder.exists():
        wanted = (
            "the folder of the run (where `nbresume run` keeps its log) or its checkpoints"
            if command == "status"
            else "the folder a training saved its checkpoints into (its dir=)"
        )
        raise UsageError("no such folder", where=location, fix=f"check the path: give {wanted}")
    if not folder.is_dir():
        raise UsageError(
            "this is a file, not a folder",
            where=location,
            fix="give the checkpoint folder itself (the dir= of the training), not a file",
        )


def _check_scheme(scheme: str, location: str) -> None:
    from fsspec.registry import get_filesystem_class

    try:
        get_filesystem_class(scheme)
    except ValueError:  # fsspec: "Protocol not known"
        raise UsageError(
            f"unknown URL scheme {scheme}://",
            where=location,
            fix="give a local folder, or a URL of a file system fsspec knows, such as "
            "s3://bucket/path or gs://bucket/path",
        ) from None
    except ImportError as exc:  # fsspec: the package of that file system is not installed
        package, install = SCHEME_PACKAGES.get(scheme, ("", ""))
        if package:
            raise UsageError(
                f"{scheme}:// URLs need the package {package}, which is not installed",
                where=location,
                fix=install,
            ) from None
        raise UsageError(
            f"{scheme}:// URLs need a package that is not installed: {exc}",
            where=location,
            fix="install the package fsspec names for it",
        ) from None


def _os_problem(command: str, location: str | None, exc: OSError) -> StorageError:
    """What the operating system (or a file system package) refused, in the user's words."""
    where = str(exc.filename) if exc.filename is not None else (location or "")
    code = exc.errno
    if code in (errno.EACCES, errno.EPERM):
        needs = "write" if command in ("prune", "pull") else "read"
        return StorageError(
            "permission denied",
            where=where,
            fix=f"`nbresume {command}` needs {needs} access there: run it as the user that "
            "owns the folder, or change the folder's permissions",
        )
    if code == errno.EROFS:
        return StorageError(
            "the file system is read-only",
            where=where,
            fix=f"run `nbresume {command}` where the folder is writable (on the machine of the "
            "training), or copy it first with `nbresume pull`",
        )
    if code == errno.ENOENT and command == "prune":
        return StorageError(
            "a checkpoint disappeared while it was being pruned: another process deleted it "
            "(a training that still runs prunes with its own keep=)",
            where=where,
            fix="run `nbresume prune` again, or let the training's keep= do the pruning",
        )
    if code == errno.ENOENT:
        return StorageError(
            "it disappeared while nbresume read it: another process deleted it",
            where=where,
            fix=f"run `nbresume {command}` again",
        )
    if code == errno.ENOTDIR:
        return StorageError(
            "a file is where a folder is expected",
            where=where,
            fix="give the checkpoint folder itself (the dir= of the training)",
        )
    if code in (errno.ENOSPC, errno.EDQUOT):
        return StorageError(
            "no space left",
            where=where,
            fix="free some space there, or choose another folder",
        )
    reason = exc.strerror or str(exc) or type(exc).__name__
    return StorageError(
        reason,
        where=where,
        fix="check the folder and the file system or network it is on, then run the command again",
    )


def _client_problem(location: str | None, exc: Exception) -> StorageError | None:
    """An S3 client's own errors (botocore's are not OSErrors), or ``None`` for anything else."""
    boto = sys.modules.get("botocore.exceptions")
    if boto is None or not isinstance(exc, (boto.BotoCoreError, boto.ClientError)):
        return None
    where = location or ""
    if isinstance(exc, (boto.NoCredentialsError, boto.PartialCredentialsError)):
        return StorageError(
            "no S3 credentials found",
            where=where,
            fix="set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE, or write "
            "~/.aws/credentials)",
        )
    if isinstance(exc, boto.EndpointConnectionError):
        return StorageError(
            f"cannot reach the S3 endpoint: {exc}",
            where=where,
            fix="check the network, and AWS_ENDPOINT_URL where the store is not AWS itself",
        )
    return StorageError(
        f"the S3 client failed: {exc}",
        where=where,
        fix="check the credentials, the endpoint and the bucket name",
    )


if __name__ == "__main__":
    sys.exit(main())
