"""``python -m benchmarks [--quick | --full | --tiny]``: every suite, every tool, one run.

Prints the summary table, writes ``side-by-side.md`` and ``side-by-side.json`` into
``benchmarks/results/``, the plots into ``docs/img/`` and the generated part of
``docs/benchmarks.md``. With ``--out DIR`` everything goes into DIR (plots in DIR/img) and
the documentation is left alone.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import signal
import sys
import tempfile
import time
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

from benchmarks import bench_hf, bench_io, bench_lightning, kill, loop, report, resume, stall
from benchmarks._common import ROOT, file_system, load_average, machine
from benchmarks.tools import BY_NAME, TOOLS
from benchmarks.zygote import Zygote, serve

REFERENCE_LOOP = {"width": 1024, "depth": 4, "batch": 32, "threads": 1, "warmup": 5}
MODES: dict[str, dict[str, Any]] = {
    # a few MB, one kill per tool: the smoke test's mode
    "tiny": {
        "sizes": [3], "reps": 2,
        "loop": {"width": 128, "depth": 2, "batch": 16, "threads": 1, "warmup": 1, "every": 4,
                 "segments": 2, "reps": 1},
        "kills": 1, "kill": {"mb": 1, "every": 3, "window": 0.2},
        "resume": {"mb": 3, "steps": 2, "more": 2},
        "io": {"sizes": [3], "reps": 1},
    },
    # the mode whose output the documentation shows: under 10 minutes on 2 cores
    "quick": {
        "sizes": [50, 500], "reps": 3,
        "loop": {**REFERENCE_LOOP, "every": 20, "segments": 3, "reps": 4},
        "kills": 8, "kill": {"mb": 10, "every": 5, "window": 1.0},
        "resume": {"mb": 200, "steps": 2, "more": 2},
        "io": {"sizes": [50, 500], "reps": 3},
    },
    "full": {
        "sizes": [50, 500, 2000], "reps": 5,
        "loop": {**REFERENCE_LOOP, "every": 40, "segments": 4, "reps": 3},
        "kills": 30, "kill": {"mb": 10, "every": 5, "window": 1.5},
        "resume": {"mb": 500, "steps": 2, "more": 2},
        "io": {"sizes": [50, 500, 2000], "reps": 3},
    },
}  # fmt: skip
SUITES = ("stall", "loop", "kill", "resume", "io")
#: Run only when named in --suites (they need an extra installed).
OPTIONAL_SUITES = ("hf", "lightning")
WORK = {
    "stall": stall.child,
    "loop": loop.child,
    "kill-life": kill.life,
    "resume-save": resume.save_child,
    "resume-load": resume.load_child,
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
    parser.add_argument("--tools", help="comma-separated subset, e.g. 'nbresume,DCP async'")
    parser.add_argument("--suites", help=f"comma-separated subset of {','.join(SUITES)}")
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
    config = MODES[name]
    tools = TOOLS
    if args.tools:
        wanted = [t.strip() for t in args.tools.split(",")]
        unknown = [t for t in wanted if t not in BY_NAME]
        if unknown:
            parser.error(f"unknown tools {unknown}; known: {list(BY_NAME)}")
        tools = [BY_NAME[t] for t in wanted]
    suites = SUITES if not args.suites else tuple(s.strip() for s in args.suites.split(","))
    if set(suites) - set(SUITES + OPTIONAL_SUITES):
        known = SUITES + OPTIONAL_SUITES
        parser.error(f"unknown suites {sorted(set(suites) - set(known))}; known: {known}")

    started = time.monotonic()
    scratch = Path(tempfile.mkdtemp(prefix="nbresume-bench-", dir=args.dir))

    def log(message: str) -> None:
        print(f"[{time.monotonic() - started:6.1f} s] {message}", file=sys.stderr, flush=True)

    command = "python -m benchmarks" + ("" if name == "quick" else f" --{name}")
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
        },
        "tools": {
            t.name: {"is_async": t.is_async, "fsync": t.fsync, "missing": t.missing()}
            for t in tools
        },
    }
    log(f"{command}: {len(tools)} tools, suites {', '.join(suites)}, scratch {scratch}")
    zygote = Zygote()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that the zygote is closed
    try:
        if "stall" in suites:
            results["stall"] = stall.run(
                zygote, tools, sizes=config["sizes"], reps=config["reps"], scratch=scratch, log=log
            )
            if 2000 not in config["sizes"]:
                results["stall_skipped"] = (
                    "The 2 GB state is measured by `--full` only: with it this mode would not "
                    "finish in 10 minutes on 2 cores."
                )
        if "loop" in suites:
            results["loop"] = loop.run(zygote, tools, config["loop"], scratch, log)
        if "kill" in suites:
            results["kill"] = kill.run(
                zygote,
                tools,
                kills=config["kills"],
                settings=config["kill"],
                scratch=scratch,
                log=log,
            )
        if "resume" in suites:
            results["resume"] = resume.run(zygote, tools, config["resume"], scratch, log)
        if "hf" in suites:
            log("hf: the Trainer's save with and without nbresume.hf.Callback")
            hf_page, results["hf"] = bench_hf.run(256, 4, 8, scratch / "hf", command)
        if "lightning" in suites:
            log("lightning: CheckpointIO against TorchCheckpointIO and AsyncCheckpointIO")
            mb = float(config["io"]["sizes"][0])
            lightning_page, results["lightning"] = bench_lightning.run(
                mb, config["io"]["reps"], scratch / "lightning", command
            )
        if "io" in suites:
            log("io: hashes, save and restore against raw write and read")
            io_page, results["io"] = bench_io.run(
                [float(mb) for mb in config["io"]["sizes"]],
                config["io"]["reps"],
                scratch / "io",
                command,
            )
    finally:
        zygote.close()
        shutil.rmtree(scratch, ignore_errors=True)
    results["meta"]["duration_s"] = time.monotonic() - started
    results["meta"]["load_after"] = load_average()
    results["summary"] = report.summary_rows(results)

    if args.out:
        out, images, page = args.out, args.out / "img", None
    else:
        out, images, page = (
            ROOT / "benchmarks" / "results",
            ROOT / "docs" / "img",
            ROOT / "docs" / "benchmarks.md",
        )
    md, js, plots = report.write(results, out, images)
    if "hf" in results:
        out.mkdir(parents=True, exist_ok=True)
        (out / "hf.md").write_text(hf_page)
    if "lightning" in results:
        out.mkdir(parents=True, exist_ok=True)
        (out / "lightning.md").write_text(lightning_page)
    if "io" in results:
        out.mkdir(parents=True, exist_ok=True)
        (out / "io.md").write_text(io_page)
    if page is not None:
        report.update_docs(results, page)
    print("\n".join(report.summary_table(results)))
    print(f"\n{command}: {results['meta']['duration_s']:.0f} s; {md}, {js}, "
          f"{', '.join(str(p) for p in plots)}" + (f", {page}" if page else ""))  # fmt: skip
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    sys.exit(main())
