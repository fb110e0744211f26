"""How long a save blocks the training loop: async_save=True against async_save=False.

For a model of a given size and its AdamW state, each mode saves several times through
``nbresume.Checkpointer`` and measures:

  blocked      the time ``ckpt.save()`` takes to return, i.e. the time the training loop
               stands still. async_save=True: a copy of the state into reused host buffers;
               async_save=False: write + fsync + commit + read-back verification.
  end to end   from the call of ``save()`` until the checkpoint is verified (the
               ``verified`` event); for async_save=False the same as blocked.
  step slowdown  async_save=True only, in two more saves: a fixed compute step (a matrix
               product) run in a loop while the background writer works, against the same step
               with no save in flight, and the end-to-end time of those saves. The writer
               shares the machine's cores and memory bandwidth with training.
  peak memory  the rise of the process's peak resident memory (ru_maxrss) over all of the
               mode's saves, in a fresh child process per mode.

Between two timed saves the loop idles until the previous one is verified, so each blocked time
is that of a save starting with nothing in flight (as when saves are further apart than a write
takes). The first async save also allocates its host buffers; it is reported on its own.

Run from the repository root:

    .venv/bin/python benchmarks/bench_async.py --mb 200 --saves 5
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

if not __package__:  # run as a script (python benchmarks/NAME.py): the repository's root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks._common import file_system, machine

HERE = Path(__file__).resolve().parent
MB = 1_000_000
MODES = ("async", "sync")


# -- one mode, in its own process ----------------------------------------------------------------


def build(mb: float) -> tuple[Any, Any, int]:
    """A model of about ``mb`` MB of float32 weights and its AdamW state; returns the bytes."""
    import torch

    torch.manual_seed(0)
    width = 1024
    layers = max(1, round(mb * MB / (width * width * 4)))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # One parameter at a time: the peak memory before the saves is then the state itself, not
    # the state plus a full set of gradients (which would hide the saves' own memory).
    for param in model.parameters():
        param.grad = torch.randn_like(param)
        optimizer.step()
        param.grad = None
    size = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    for state in optimizer.state.values():
        size += sum(t.numel() * t.element_size() for t in state.values())
    return model, optimizer, size


def max_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def compute_step(a: Any, b: Any) -> float:
    started = time.perf_counter()
    a.mm(b)
    return time.perf_counter() - started


def run_child(mode: str, mb: float, saves: int, folder: Path) -> dict[str, Any]:
    import torch

    import nbresume

    model, optimizer, size = build(mb)
    a, b = torch.randn(768, 768), torch.randn(768, 768)
    baseline_steps = [compute_step(a, b) for _ in range(30)]

    verified_at: dict[int, float] = {}
    done = threading.Event()

    def on_event(event: nbresume.Event) -> None:
        if event.kind == "verified":
            verified_at[event.step] = time.perf_counter()
            done.set()

    ckpt = nbresume.Checkpointer(
        folder,
        every=None,
        deadline=None,
        keep=1,
        async_save=(mode == "async"),
        callbacks=[on_event],
        model=model,
        optimizer=optimizer,
    )
    rss_before = max_rss_bytes()

    def save(step: int) -> float:
        with torch.no_grad():
            for param in model.parameters():
                param.add_(1e-3)  # the state changes between saves, as in training
        done.clear()
        started = time.perf_counter()
        ckpt.save(step=step)
        blocked.append(time.perf_counter() - started)
        return started

    blocked: list[float] = []
    end_to_end: list[float] = []
    for step in range(1, saves + 1):
        started = save(step)
        ckpt.wait()  # the loop idles: nothing competes with the writer
        end_to_end.append(verified_at[step] - started)
    timed_blocked = list(blocked)

    during: list[float] = []
    while_training: list[float] = []
    if mode == "async":
        for step in range(saves + 1, saves + 3):
            started = save(step)
            while not done.is_set():  # the loop computes while the writer runs
                during.append(compute_step(a, b))
            ckpt.wait()
            while_training.append(verified_at[step] - started)
    ckpt.close()
    assert ckpt.verify().ok
    return {
        "mode": mode,
        "state_bytes": size,
        "blocked": timed_blocked,
        "end_to_end": end_to_end,
        "end_to_end_while_training": while_training,
        "baseline_step": statistics.median(baseline_steps),
        "step_during_save": statistics.median(during) if during else None,
        "steps_during_save": len(during),
        "rss_before": rss_before,
        "rss_peak_delta": max_rss_bytes() - rss_before,
    }


# -- the parent: children, tables, results file ---------------------------------------------------


def software() -> str:
    import torch

    import nbresume

    return (
        f"Python {platform.python_version()}, torch {torch.__version__}, "
        f"nbresume {nbresume.__version__}"
    )


def spawn(mode: str, args: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    folder = scratch / f"{mode}-{time.monotonic_ns()}"
    command = [sys.executable, __file__, "--child", mode, "--mb", str(args.mb)]
    command += ["--saves", str(args.saves), "--folder", str(folder)]
    try:
        out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return result


def seconds(value: float) -> str:
    return f"{value * 1000:.1f} ms" if value < 1 else f"{value:.2f} s"


def spread(values: list[float]) -> str:
    return f"{seconds(min(values))} - {seconds(max(values))}"


def mbytes(value: float) -> str:
    return f"{value / MB:,.0f} MB"


def report(
    results: dict[str, list[dict[str, Any]]], args: argparse.Namespace, scratch: Path
) -> str:
    def pooled(mode: str, key: str) -> list[float]:
        return [v for r in results[mode] for v in r[key]]

    size = results["sync"][0]["state_bytes"]
    blocked = {m: statistics.median(pooled(m, "blocked")) for m in MODES}
    later_async = [v for r in results["async"] for v in r["blocked"][1:]] or pooled(
        "async", "blocked"
    )
    first_async = statistics.median(r["blocked"][0] for r in results["async"])
    e2e = {m: statistics.median(pooled(m, "end_to_end")) for m in MODES}
    rss = {m: max(r["rss_peak_delta"] for r in results[m]) for m in MODES}
    base = statistics.median(r["baseline_step"] for r in results["async"])
    during_values = [r["step_during_save"] for r in results["async"] if r["step_during_save"]]
    during = statistics.median(during_values) if during_values else None
    count = sum(len(r["blocked"]) for r in results["sync"])

    command = f"python benchmarks/bench_async.py --mb {args.mb:g} --saves {args.saves}"
    if args.rounds != 1:
        command += f" --rounds {args.rounds}"
    lines = [
        "# Async save benchmark",
        "",
        f"- Command: `{command}`",
        f"- Machine: {machine()}, CPU only",
        f"- Scratch folder: {file_system(scratch)}",
        f"- Software: {software()}",
        f"- Date: {datetime.now(timezone.utc).date().isoformat()}",
        f"- Load average (1 min) at start and end: {args.load_start:.1f}, {os.getloadavg()[0]:.1f}"
        " (other work on the machine shares its cores)",
        f"- State: {mbytes(size)} of float32 tensors: a model of {args.mb:g} MB (1024x1024 "
        "linear layers) and its AdamW state (exp_avg, exp_avg_sq).",
        f"- {count} saves per mode ({args.rounds} fresh child process(es) of {args.saves}), each "
        "starting with no save in flight; medians. Checkpoints are written, fsynced, committed "
        "and read back for verification; keep=1.",
        "",
        "## Time the training loop is blocked per save",
        "",
        "| mode | blocked (median) | blocked (min-max) | end to end (median) "
        "| peak extra memory (ru_maxrss) |",
        "|---|---:|---:|---:|---:|",
        *(
            f"| async_save={mode == 'async'} | {seconds(blocked[mode])} | "
            f"{spread(pooled(mode, 'blocked'))} | {seconds(e2e[mode])} | "
            f"{mbytes(rss[mode])} ({rss[mode] / size:.2f}x state) |"
            for mode in MODES
        ),
        "",
        f"- Ratio blocked async / blocked sync: **{blocked['async'] / blocked['sync']:.3f}**.",
        f"- First async save (allocates the host buffers): {seconds(first_async)} blocked; "
        f"later ones reuse them: {seconds(statistics.median(later_async))} (median).",
    ]
    if during is not None:
        training = statistics.median(pooled("async", "end_to_end_while_training"))
        lines.append(
            f"- Training during a background save: a {seconds(base)} compute step (768x768 "
            f"matrix product) took {seconds(during)} (median) while the writer ran "
            f"({during / base:.2f}x), and the save took {seconds(training)} end to end "
            f"(median of {len(pooled('async', 'end_to_end_while_training'))}). On this "
            f"{os.cpu_count()}-core machine training and writer share the cores."
        )
    lines += [
        "",
        "Blocked time with async_save=True is the copy of every tensor into host buffers that "
        "are reused from one save to the next; the write, commit and verification then run in "
        "a thread. The price is memory: one extra copy of the state, held for the life of the "
        "Checkpointer. async_save=False streams the live tensors to the file and reads the "
        "file back in chunks, so it needs almost no extra memory but blocks for the whole save.",
        "",
        "On a machine shared with other work the spread is wide (see the load average); the "
        "minimum is the closest to the cost on a quiet machine. Compare modes by the ratio of "
        "medians, taken from children interleaved in time.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=float, default=200, help="model size in MB (AdamW adds 2x)")
    parser.add_argument("--saves", type=int, default=5, help="saves per mode and child process")
    parser.add_argument("--rounds", type=int, default=1, help="child processes per mode")
    parser.add_argument("--dir", help="scratch folder on the disk to measure (default: a temp)")
    parser.add_argument("--out", default=str(HERE / "results" / "async.md"), help="results file")
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.child:
        print(json.dumps(run_child(args.child, args.mb, args.saves, Path(args.folder))))
        return 0

    args.load_start = os.getloadavg()[0]
    scratch = Path(tempfile.mkdtemp(prefix="nbresume-bench-async-", dir=args.dir))
    try:
        results: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
        for round_number in range(args.rounds):
            for mode in MODES if round_number % 2 == 0 else MODES[::-1]:
                print(f"round {round_number + 1}: {mode} ...", file=sys.stderr)
                results[mode].append(spawn(mode, args, scratch))
        text = report(results, args, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(text)
    Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
