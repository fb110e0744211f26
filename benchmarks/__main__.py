"""``python -m benchmarks [--quick | --full | --tiny]``: every suite, every tool, one run.

Prints the summary table, writes every page into ``benchmarks/results/`` (``side-by-side.md``
and ``.json``, then one page per suite that has its own: ``io.md``, ``preflight.md``,
``restore.md``, ``trainable.md``, ``lightning.md``, ``hf.md``), the plots into ``docs/img/``
and the generated part of ``docs/benchmarks.md``; every page starts with the same line
(command, date, machine, file system, load average before and after), and a results file this
run did not write is removed. With ``--out DIR`` everything goes into DIR (plots in DIR/img)
and the documentation is left alone; ``--tiny``, ``--suites`` and ``--tools`` need ``--out``
(the published figures come from one whole run).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import shutil
import signal
import sys
import tempfile
import time
import traceback
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

from benchmarks import (
    bench_hf,
    bench_io,
    bench_lightning,
    bench_preflight,
    bench_trainable,
    gpu,
    kill,
    loop,
    report,
    restore_speed,
    resume,
    stall,
)
from benchmarks._common import ROOT, file_system, load_average, machine
from benchmarks.tools import BY_NAME, TOOLS
from benchmarks.zygote import Work, Zygote, serve

REFERENCE_LOOP = {"width": 1024, "depth": 4, "batch": 32, "threads": 1, "warmup": 5}
MODES: dict[str, dict[str, Any]] = {
    # a few MB, one kill per tool: the smoke test's mode (hf: importing the Trainer alone takes
    # longer than the rest of this mode)
    "tiny": {
        "sizes": [3], "reps": 2,
        "loop": {"width": 128, "depth": 2, "batch": 16, "threads": 1, "warmup": 1, "every": 4,
                 "pairs": 3},
        "kills": 1, "kill": {"mb": 1, "every": 3, "window": 0.2},
        "resume": {"mb": 3, "steps": 2, "more": 2, "reps": 1},
        "restore": {"sizes": [3], "reps": 1},
        "io": {"sizes": [3], "reps": 1},
        "preflight": {"reps": 1},
        "trainable": {"layers": 4, "dim": 256, "rank": 4, "reps": 1},
        "lightning": {"mb": 3, "reps": 1},
        "hf": None,
    },
    # the mode whose output the documentation shows: under 10 minutes on 2 cores
    "quick": {
        "sizes": [50, 500], "reps": 3,
        "loop": {**REFERENCE_LOOP, "every": 16, "pairs": 12},
        "kills": 8, "kill": {"mb": 10, "every": 5, "window": 1.0},
        "resume": {"mb": 200, "steps": 2, "more": 2, "reps": 3},
        "restore": {"sizes": [20, 200], "reps": 5},
        "io": {"sizes": [50, 500], "reps": 3},
        "preflight": {"reps": 3},
        "trainable": {"layers": 16, "dim": 2048, "rank": 16, "reps": 3},
        "lightning": {"mb": 50, "reps": 3},
        "hf": {"hidden": 256, "layers": 4, "saves": 8},
    },
    "full": {
        "sizes": [50, 500, 2000], "reps": 5,
        "loop": {**REFERENCE_LOOP, "every": 40, "pairs": 20},
        "kills": 30, "kill": {"mb": 10, "every": 5, "window": 1.5},
        "resume": {"mb": 500, "steps": 2, "more": 2, "reps": 3},
        "restore": {"sizes": [20, 200, 2000], "reps": 3},
        "io": {"sizes": [50, 500, 2000], "reps": 3},
        "preflight": {"reps": 5},
        "trainable": {"layers": 32, "dim": 2048, "rank": 16, "reps": 5},
        "lightning": {"mb": 500, "reps": 3},
        "hf": {"hidden": 512, "layers": 8, "saves": 8},
    },
}  # fmt: skip
SUITES = ("preflight", "stall", "loop", "kill", "resume", "restore", "io", "trainable",
          "lightning", "hf")  # fmt: skip
#: The libraries a suite needs beyond torch; without them it is reported "not installed".
NEEDS = {"lightning": ("lightning",), "hf": ("transformers", "accelerate")}
#: The page each suite writes besides side-by-side.md (whose sections hold the other suites).
PAGES = {"io": "io.md", "preflight": "preflight.md", "trainable": "trainable.md",
         "lightning": "lightning.md", "hf": "hf.md", "restore": "restore.md"}  # fmt: skip


def _lightning_child(args: dict[str, Any]) -> dict[str, Any]:
    page, result = bench_lightning.run(args["mb"], args["reps"], Path(args["folder"]),
                                       args["command"])  # fmt: skip
    return {"page": page, "result": result}


def _hf_child(args: dict[str, Any]) -> dict[str, Any]:
    page, result = bench_hf.run(args["hidden"], args["layers"], args["saves"],
                                Path(args["folder"]), args["command"])  # fmt: skip
    return {"page": page, "result": result}


WORK: dict[str, Work] = {
    "stall": stall.child,
    "loop": loop.child,
    "kill-life": kill.life,
    "resume-save": resume.save_child,
    "resume-load": resume.load_child,
    "restore-save": restore_speed.save_child,
    "restore-load": restore_speed.load_child,
    "trainable": bench_trainable.child,
    "lightning": _lightning_child,
    "hf": _hf_child,
}
ZYGOTE_IMPORTS = [
    "torch",
    "numpy",
    "nbresume",
    "torch.distributed.checkpoint",
    "torch.distributed.checkpoint.state_dict",
    "lightning.fabric.plugins.io.torch_io",
    "lightning.pytorch.plugins.io",
    "accelerate",
    "accelerate.utils",
]


def software() -> str:
    parts = [f"Python {platform.python_version()}"]
    for name in ("torch", "lightning", "accelerate", "nbresume"):
        try:
            parts.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            parts.append(f"{name} not installed")
    return ", ".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks", description=__doc__.split("\n\n")[0]
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument(
        "--quick",
        dest="mode",
        action="store_const",
        const="quick",
        help="two state sizes, 8 kills per tool (default; the documented run)",
    )
    mode.add_argument(
        "--full",
        dest="mode",
        action="store_const",
        const="full",
        help="adds a 2 GB state, more repetitions, 30 kills per tool",
    )
    mode.add_argument(
        "--tiny",
        dest="mode",
        action="store_const",
        const="tiny",
        help="a few MB, one kill per tool: checks that everything runs",
    )
    mode.add_argument(
        "--gpu",
        dest="mode",
        action="store_const",
        const="gpu",
        help="the state on a GPU (about 2 GB): saves, async saves, cold restores into the "
        "model, loop overhead; at most 8 minutes; a dry run without CUDA",
    )
    parser.add_argument("--tools", help="comma-separated subset, e.g. 'nbresume,DCP async'")
    parser.add_argument("--suites", help=f"comma-separated subset of {','.join(SUITES)}")
    parser.add_argument("--restore-sizes", help="the restore suite's state sizes in MB, "
                        "comma-separated (e.g. 2000: the largest alone); needs --out")  # fmt: skip
    parser.add_argument("--dir", type=Path, help="scratch folder on the disk to measure "
                        "(default: the system's temporary folder)")  # fmt: skip
    parser.add_argument("--out", type=Path, help="write results and plots here and leave "
                        "benchmarks/results, docs/img and docs/benchmarks.md alone")  # fmt: skip
    parser.add_argument("--zygote", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.zygote:
        serve(WORK, ZYGOTE_IMPORTS)
        return 0
    name = args.mode or "quick"
    if name == "gpu":
        given = sys.argv[1:] if argv is None else argv
        return gpu.main(args.out, args.dir, " ".join(["python -m benchmarks", *given]))
    config = MODES[name]
    if args.restore_sizes:
        sizes = [int(mb) for mb in args.restore_sizes.split(",")]
        config = {**config, "restore": {**config["restore"], "sizes": sizes}}
    tools = TOOLS
    if args.tools:
        wanted = [t.strip() for t in args.tools.split(",")]
        unknown = [t for t in wanted if t not in BY_NAME]
        if unknown:
            parser.error(f"unknown tools {unknown}; known: {list(BY_NAME)}")
        tools = [BY_NAME[t] for t in wanted]
    suites = SUITES if not args.suites else tuple(s.strip() for s in args.suites.split(","))
    if set(suites) - set(SUITES):
        parser.error(f"unknown suites {sorted(set(suites) - set(SUITES))}; known: {SUITES}")
    if not args.out and (name == "tiny" or args.suites or args.tools or args.restore_sizes):
        parser.error("--tiny, --suites, --tools and --restore-sizes need --out: the published "
                     "results come from one whole run of every suite")  # fmt: skip

    started = time.monotonic()
    scratch = Path(tempfile.mkdtemp(prefix="nbresume-bench-", dir=args.dir))

    def log(message: str) -> None:
        print(f"[{time.monotonic() - started:6.1f} s] {message}", file=sys.stderr, flush=True)

    given = sys.argv[1:] if argv is None else argv
    command = " ".join(["python -m benchmarks", *given])
    results: dict[str, Any] = {
        "meta": {
            "command": command,
            "mode": name,
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": machine(),
            "file_system": file_system(scratch),
            "software": software(),
            "load_before": load_average(),
            "config": config,
            "suite_s": {},
        },
        "tools": {
            t.name: {"is_async": t.is_async, "fsync": t.fsync, "missing": t.missing()}
            for t in tools
        },
        "suites": {},
    }
    pages: dict[str, str] = {}
    log(f"{command}: {len(tools)} tools, suites {', '.join(suites)}, scratch {scratch}")
    zygote = Zygote()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that the zygote is closed
    try:
        for suite in suites:
            why_not = _why_not(suite, config)
            if why_not:
                log(f"{suite}: {why_not}")
                results["suites"][suite] = {"status": why_not}
                continue
            suite_started = time.monotonic()
            try:
                page = _run_suite(suite, config, zygote=zygote, tools=tools, scratch=scratch,
                                  command=command, results=results, log=log)  # fmt: skip
            except Exception as exc:  # one suite's failure must not cost the others' figures
                log(f"{suite} failed:\n{traceback.format_exc()}")
                results["suites"][suite] = {"status": f"failed: {_first_line(exc)}"}
                continue
            finally:
                results["meta"]["suite_s"][suite] = time.monotonic() - suite_started
            if page is not None:
                pages[PAGES[suite]] = page
                results["suites"][suite] = {"page": PAGES[suite]}
            else:
                results["suites"][suite] = {"page": "side-by-side.md"}
    finally:
        zygote.close()
        shutil.rmtree(scratch, ignore_errors=True)
    results["meta"]["duration_s"] = time.monotonic() - started
    results["meta"]["load_after"] = load_average()
    results["summary"] = report.summary_rows(results)

    if args.out:
        out, images, docs = args.out, args.out / "img", None
    else:
        out, images, docs = (
            ROOT / "benchmarks" / "results",
            ROOT / "docs" / "img",
            ROOT / "docs" / "benchmarks.md",
        )
    md, js, plots = report.write(results, out, images)
    for file_name, page in pages.items():
        (out / file_name).write_text(report.stamp(page, results["meta"]))
    written = {md.name, js.name, *pages}
    # a page of an earlier run must not stand beside this one's
    stale = [out / page for page in PAGES.values() if page not in written]
    if docs is not None:
        stale += [
            path
            for path in out.iterdir()
            if path.is_file() and path.name not in written and path.name not in gpu.PAGES
        ]  # the GPU suite's pages come from runs of their own (--gpu)
    for path in sorted(set(stale)):
        if path.exists():
            path.unlink()
            log(f"removed {path}: no longer written by this run")
    if docs is not None:
        report.update_docs(results, docs)
    print("\n".join(report.summary_table(results)))
    files = [md, js, *(out / page for page in pages), *plots, *([docs] if docs else [])]
    print(f"\n{command}: {results['meta']['duration_s']:.0f} s; "
          + ", ".join(str(path) for path in files))  # fmt: skip
    return 0


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]


def _why_not(suite: str, config: dict[str, Any]) -> str | None:
    """Why ``suite`` does not run in this mode or on this machine, or ``None``."""
    if suite in config and config[suite] is None:
        return "not run in this mode"
    missing = [lib for lib in NEEDS.get(suite, ()) if importlib.util.find_spec(lib) is None]
    if missing:
        return f"not installed ({', '.join(missing)})"
    return None


def _run_suite(suite: str, config: dict[str, Any], *, zygote: Zygote, tools: list[Any],
               scratch: Path, command: str, results: dict[str, Any],
               log: Any) -> str | None:  # fmt: skip
    """Run one suite; its results go into ``results``; its own page, if it has one."""
    if suite == "preflight":
        log("preflight: nbresume.preflight() when the network answers, refuses or hangs")
        results["preflight"] = bench_preflight.measure(config["preflight"]["reps"])
        return bench_preflight.render(results["preflight"])
    if suite == "stall":
        results["stall"] = stall.run(
            zygote, tools, sizes=config["sizes"], reps=config["reps"], scratch=scratch, log=log
        )
        if 2000 not in config["sizes"]:
            results["stall_skipped"] = (
                "The 2 GB state is measured by `--full` only: with it this mode would not "
                "finish in 10 minutes on 2 cores."
            )
        return None
    if suite == "loop":
        results["loop"] = loop.run(zygote, tools, config["loop"], scratch, log)
        return None
    if suite == "kill":
        results["kill"] = kill.run(
            zygote, tools, kills=config["kills"], settings=config["kill"], scratch=scratch,
            log=log,
        )  # fmt: skip
        return None
    if suite == "resume":
        results["resume"] = resume.run(zygote, tools, config["resume"], scratch, log)
        return None
    if suite == "restore":
        results["restore"] = restore_speed.run(zygote, config["restore"], scratch, log)
        return restore_speed.render(results["restore"])
    if suite == "io":
        log("io: hashes, save and restore against raw write and read")
        page, results["io"] = bench_io.run(
            [float(mb) for mb in config["io"]["sizes"]],
            config["io"]["reps"],
            scratch / "io",
            command,
        )
        return page
    # the others run in a fresh process, as the side-by-side suites do
    log({"trainable": "trainable: a trainable-only checkpoint of a LoRA-style model",
         "lightning": "lightning: CheckpointIO against TorchCheckpointIO and AsyncCheckpointIO",
         "hf": "hf: the Trainer's save with and without nbresume.hf.Callback"}[suite])  # fmt: skip
    answer = zygote.call(suite, {**config[suite], "folder": str(scratch / suite),
                                 "command": command})  # fmt: skip
    shutil.rmtree(scratch / suite, ignore_errors=True)
    if "error" in answer:
        raise RuntimeError(f"the {suite} suite failed: {answer['error']}\n{answer.get('trace')}")
    if suite == "trainable":
        results["trainable"] = answer
        return bench_trainable.render(answer)
    results[suite] = answer["result"]
    return str(answer["page"])


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    sys.exit(main())
