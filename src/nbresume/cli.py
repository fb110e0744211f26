"""The ``nbresume`` command. Thin: it parses arguments and calls the modules that do the work.

Exit status: 0 success, 1 failure (for ``verify`` and ``pull``: any checkpoint that does not
verify), 2 usage error. ``nbresume run`` exits with its job's status.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any

from nbresume.errors import NbresumeError, UsageError


def _cmd_ls(args: argparse.Namespace) -> int:
    from nbresume.checkpoint.store import CheckpointStore, format_bytes

    store = CheckpointStore(args.dir, keep=None)
    infos = store.list()
    if not infos:
        print(f"no committed checkpoints in {store.location}")
        return 0
    print(f"{'step':>12}  {'size':>9}  {'created':<25}  metrics")
    for info in infos:
        metrics = " ".join(f"{k}={v:.6g}" for k, v in sorted(info.metrics.items()))
        print(f"{info.step:>12}  {format_bytes(info.size):>9}  {info.created:<25}  {metrics}")
    print(f"{len(infos)} checkpoint(s) in {store.location} (not re-hashed: run `nbresume verify`)")
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    from nbresume.checkpoint.store import CheckpointStore

    report = CheckpointStore(args.dir, keep=None).verify()
    for result in report.results:
        print(result)
    if report.uncommitted:
        names = ", ".join(report.uncommitted)
        print(f"(not checkpoints: {names}: a save that never committed; the next save cleans it)")
    if not report.results:
        print(f"no checkpoints in {report.location}: nothing verified")
        return 1
    print(report.summary)
    return 0 if report.ok else 1


def _cmd_prune(args: argparse.Namespace) -> int:
    from nbresume.checkpoint.store import CheckpointStore

    keep_best = None
    if args.best:
        metric, _, mode = args.best.partition(":")
        keep_best = (metric, mode or "min", args.best_count or args.keep)
    store = CheckpointStore(args.dir, keep=args.keep, keep_best=keep_best)
    deleted = store.prune()
    left = [i.step for i in store.list()]
    print(f"deleted {len(deleted)} checkpoint(s): {deleted or 'none'}; kept steps {left}")
    return 0


def _cmd_doctor(args: argparse.Namespace) -> int:
    import os

    from nbresume.preflight import preflight, terminal_width

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
    from nbresume import runner

    command = list(args.command)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        return _usage(args, "no command to run: nbresume run [OPTIONS] -- CMD ...")
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
    return code


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
    try:
        return pull(args.src, args.dst, identity=args.identity, rate=args.limit_rate)
    except UsageError as exc:
        return _usage(args, str(exc))


def _usage(args: argparse.Namespace, message: str) -> int:
    """A usage error found after parsing: reported as argparse does, exit status 2."""
    print(f"nbresume {args.command}: error: {message}", file=sys.stderr)
    return 2


def _cmd_demo(args: argparse.Namespace) -> int:
    from nbresume.demo import run_demo

    return run_demo(args.dir, seed=args.seed)


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
    )


def _cmd_chain(args: argparse.Namespace) -> int:
    from nbresume.kaggle.commands import chain

    return chain(
        args.kernel, legs=args.legs, poll_s=args.poll, timeout_s=args.timeout, output=args.output
    )


def _kaggle_ref(text: str) -> str:
    from nbresume.kaggle.metadata import parse_ref

    try:
        parse_ref(text)
    except NbresumeError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _kaggle_accelerator(text: str) -> str:
    from nbresume.kaggle.metadata import parse_accelerator

    try:
        parse_accelerator(text)
    except NbresumeError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _poll_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 < value <= 3600:
        raise argparse.ArgumentTypeError(f"must be more than 0 and at most 3600, got {value}")
    return value


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
    p.add_argument("notebook", help="the .ipynb file")
    p.add_argument(
        "--platform",
        choices=("auto", "kaggle", "colab", "local"),
        default="auto",
        help="the sandbox: a Kaggle machine, Colab (google.colab needed) or this machine "
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
    p.add_argument("notebook", help="the .ipynb file")
    p.add_argument(
        "--kernel", required=True, type=_kaggle_ref, metavar="OWNER/SLUG", help="the notebook"
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
    from nbresume import __version__

    parser = argparse.ArgumentParser(
        prog="nbresume",
        description="Verified checkpoints and exact resume for long PyTorch training.",
    )
    parser.add_argument("--version", action="version", version=f"nbresume {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("ls", help="list the committed checkpoints of a folder")
    p.add_argument("dir", help="checkpoint folder: a path or an fsspec URL")
    p.set_defaults(func=_cmd_ls)

    p = sub.add_parser("verify", help="read back every checkpoint and compare it with its manifest")
    p.add_argument("dir", help="checkpoint folder: a path or an fsspec URL")
    p.set_defaults(func=_cmd_verify)

    p = sub.add_parser("prune", help="delete all but the newest (and best) verified checkpoints")
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
        "or its checkpoint folder. Liveness is judged by the processes and the checkpoint "
        "age, not by the log. An argument owner/slug (no scheme, not a local path) names a "
        "Kaggle notebook. Exit status 1 when the run died or failed, or its newest checkpoint "
        "does not verify.",
    )
    p.add_argument("target", metavar="DIR", help="run folder, checkpoint folder, or owner/slug")
    p.set_defaults(func=_cmd_status)

    p = sub.add_parser(
        "pull",
        help="copy a run's checkpoints to a local folder, verified and resumable",
        description="Copy every committed checkpoint of SRC into the local folder DST, each "
        "file checked against its manifest; an interrupted pull resumes where it stopped. "
        "SRC: ssh://[user@]host[:port]/path (ssh://host/~/path is relative to the remote "
        "home), any fsspec URL, or a local path; owner/slug names a Kaggle notebook. Exit "
        "status 1 when any checkpoint does not verify. Nothing remote is ever deleted.",
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

    _add_kaggle_parsers(sub)

    p = sub.add_parser("demo", help="show the promise: save, kill -9, restore, verify")
    p.add_argument(
        "--dir", default="nbresume-demo", help="folder for the demo (default ./nbresume-demo)"
    )
    p.add_argument("--seed", type=int, default=None, help="make the random kill reproducible")
    p.set_defaults(func=_cmd_demo)
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


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 <= value <= 3600:
        raise argparse.ArgumentTypeError(f"must be between 0 and 3600 seconds, got {value}")
    return value


def _rate(text: str) -> float:
    from nbresume.pull import parse_rate

    try:
        return parse_rate(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _accelerator(text: str) -> str:
    from nbresume.preflight import parse_accelerator

    try:
        parse_accelerator(text)
    except NbresumeError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "best", None) and args.best.partition(":")[2] not in ("", "min", "max"):
        parser.error(f"--best {args.best}: the mode after ':' must be min or max")
    try:
        status: int = args.func(args)
    except NbresumeError as exc:
        print(f"nbresume {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"nbresume {args.command}: interrupted", file=sys.stderr)
        return 130
    return status


if __name__ == "__main__":
    sys.exit(main())
