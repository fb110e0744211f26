"""Side-by-side cost of a verified nbresume checkpoint against torch.save and safetensors.

Saves (each made durable with fsync before the clock stops):

  nbresume               CheckpointStore.save: write + fsync + commit + read-back verification
  torch.save             torch.save to one file + fsync, nothing verified
  safetensors            safetensors.torch.save_file, one file per state dict, + fsync
  torch.save + sha256    torch.save + fsync, then a separate read-back SHA-256 pass: the fair
                         "verified" comparison

Loads, from a cold page cache (the files' cached pages dropped with posix_fadvise) and from a
warm one (right after the cold load):

  nbresume               CheckpointStore.load: every file hashed against its manifest, then parsed
  torch.load             torch.load(weights_only=True), nothing verified
  safetensors            safetensors.torch.load_file for each file, nothing verified
  sha256 + torch.load    a SHA-256 pass over the file, then torch.load

Every load ends by touching each memory page of every tensor it returned, so that a loader
that maps the file and reads lazily (safetensors) really reads it, as training would.

Repetitions are interleaved (method A, B, C, D, then again) so that drift in the machine hits
every method alike; the tables report medians. Peak extra memory is measured once per method
in a fresh child process, from the kernel's high-water mark of resident memory (VmHWM in
/proc/self/status, reset through /proc/self/clear_refs just before the method runs).

Run from the repository root:

    .venv/bin/python benchmarks/bench_store.py --mb 100 --reps 3
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

if not __package__:  # run as a script (python benchmarks/NAME.py): the repository's root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks._common import file_system, machine

HERE = Path(__file__).resolve().parent
SAVE_METHODS = ("nbresume", "torch.save", "safetensors", "torch.save + sha256")
LOAD_METHODS = ("nbresume", "torch.load", "safetensors", "sha256 + torch.load")
CHUNK = 8 << 20
MB = 1_000_000

State = tuple[dict[str, Any], dict[str, Any]]


# -- the state being saved ----------------------------------------------------------------


def build_state(mb: float, seed: int = 0) -> State:
    """A model of about ``mb`` MB of float32 weights and its AdamW state after one step."""
    import torch

    torch.manual_seed(seed)
    width = 1024
    layers = max(1, round(mb * MB / (width * width * 4)))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for param in model.parameters():
        param.grad = torch.randn_like(param)
    optimizer.step()  # fills exp_avg and exp_avg_sq: twice the model's size
    optimizer.zero_grad(set_to_none=True)
    return model.state_dict(), optimizer.state_dict()


def flat_optimizer(opt_state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The optimizer's tensors as one flat dict, and what is left of it as JSON."""
    tensors = {
        f"state.{index}.{key}": value
        for index, per_param in opt_state["state"].items()
        for key, value in per_param.items()
    }
    return tensors, {"param_groups": opt_state["param_groups"]}


def state_bytes(state: State) -> int:
    model, opt = state
    return sum(t.nbytes for t in model.values()) + sum(
        t.nbytes for t in flat_optimizer(opt)[0].values()
    )


# -- the methods --------------------------------------------------------------------------


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _torch_save(state: State, folder: Path) -> Path:
    import torch

    path = folder / "checkpoint.pt"
    with open(path, "wb") as handle:
        torch.save({"model": state[0], "optimizer": state[1]}, handle)
        handle.flush()
        os.fsync(handle.fileno())
    return path


def save_nbresume(state: State, folder: Path) -> None:
    import nbresume

    opt_tensors, opt_rest = flat_optimizer(state[1])
    nbresume.CheckpointStore(folder).save(
        1, tensors={"model": state[0], "optimizer": opt_tensors}, data={"optimizer": opt_rest}
    )


def save_torch(state: State, folder: Path) -> None:
    _torch_save(state, folder)


def save_safetensors(state: State, folder: Path) -> None:
    from safetensors.torch import save_file

    opt_tensors, _ = flat_optimizer(state[1])
    for name, tensors in (("model", state[0]), ("optimizer", opt_tensors)):
        path = folder / f"{name}.safetensors"
        save_file(tensors, path)
        _fsync_path(path)


def save_torch_sha256(state: State, folder: Path) -> None:
    path = _torch_save(state, folder)
    # What a verifying writer must do at least: read every byte back and hash it.
    _sha256_file(path)


def touch(value: Any) -> Any:
    """Read one element of every memory page of every tensor in ``value``.

    A loader may map a file and read it lazily (safetensors does): touching every page makes
    each loader really bring every byte into memory, as training would right after.
    """
    import torch

    if isinstance(value, torch.Tensor):
        flat = value.reshape(-1)
        step = max(1, 4096 // max(1, flat.element_size()))
        flat[::step].sum()
    elif isinstance(value, dict):
        for item in value.values():
            touch(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            touch(item)
    return value


def load_nbresume(folder: Path) -> Any:
    import nbresume

    return touch(nbresume.CheckpointStore(folder).load().tensors)


def load_torch(folder: Path) -> Any:
    import torch

    return touch(torch.load(folder / "checkpoint.pt", weights_only=True))


def load_safetensors(folder: Path) -> Any:
    from safetensors.torch import load_file

    return touch(
        {name: load_file(folder / f"{name}.safetensors") for name in ("model", "optimizer")}
    )


def load_sha256_torch(folder: Path) -> Any:
    import torch

    path = folder / "checkpoint.pt"
    _sha256_file(path)
    return touch(torch.load(path, weights_only=True))


SAVES: dict[str, Callable[[State, Path], None]] = {
    "nbresume": save_nbresume,
    "torch.save": save_torch,
    "safetensors": save_safetensors,
    "torch.save + sha256": save_torch_sha256,
}
LOADS: dict[str, Callable[[Path], Any]] = {
    "nbresume": load_nbresume,
    "torch.load": load_torch,
    "safetensors": load_safetensors,
    "sha256 + torch.load": load_sha256_torch,
}
# Which save writes the files each load reads.
LOAD_SOURCE = {
    "nbresume": "nbresume",
    "torch.load": "torch.save",
    "safetensors": "safetensors",
    "sha256 + torch.load": "torch.save",
}


# -- page cache and memory ----------------------------------------------------------------


def evict(folder: Path) -> None:
    """Drop the page-cache pages of every file below ``folder`` (they are clean: fsynced)."""
    for path in folder.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{key} not in /proc/self/status")


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")  # resets VmHWM to the current RSS
    except OSError:
        return False
    return True


def measure_peak(run: Callable[[], Any]) -> dict[str, Any]:
    """Run ``run`` and report how far resident memory rose above where it started."""
    gc.collect()
    reset = _reset_peak()
    baseline = _status_bytes("VmRSS") if reset else _status_bytes("VmHWM")
    result = run()
    peak = _status_bytes("VmHWM")
    del result
    return {"extra": max(0, peak - baseline), "reset": reset}


def child(args: argparse.Namespace) -> None:
    """One measurement in a fresh process; prints a JSON line."""
    import torch  # noqa: F401 - imported before the baseline so that it is not counted

    import nbresume  # noqa: F401

    folder = Path(args.folder)
    if args.child == "save":
        state = build_state(args.mb)
        out = measure_peak(lambda: SAVES[args.method](state, folder))
    else:
        import safetensors.torch  # noqa: F401

        out = measure_peak(lambda: LOADS[args.method](folder))
    print(json.dumps(out))


def peak_in_child(kind: str, method: str, folder: Path, mb: float) -> dict[str, Any]:
    command = [sys.executable, __file__, "--child", kind, "--method", method]
    command += ["--folder", str(folder), "--mb", str(mb)]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


# -- the run ------------------------------------------------------------------------------


def timed(run: Callable[[], Any]) -> float:
    gc.collect()
    start = time.perf_counter()
    result = run()
    elapsed = time.perf_counter() - start
    del result
    return elapsed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--mb", type=float, default=100, help="model size in MB; optimizer state is twice that"
    )
    parser.add_argument("--reps", type=int, default=3, help="repetitions of every method")
    parser.add_argument("--dir", help="scratch folder on the disk to measure (default: a temp)")
    parser.add_argument("--out", default=str(HERE / "results" / "store.md"), help="results file")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory children")
    parser.add_argument("--child", choices=("save", "load"), help=argparse.SUPPRESS)
    parser.add_argument("--method", help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args)
        return 0

    import safetensors
    import torch

    import nbresume

    load_before = os.getloadavg()[0]
    scratch = Path(tempfile.mkdtemp(prefix="nbresume-bench-", dir=args.dir))
    try:
        print(f"building a {args.mb:g} MB model and its AdamW state ...", flush=True)
        state = build_state(args.mb)
        total = state_bytes(state)
        print(f"state: {total / MB:.1f} MB of tensors; scratch folder {scratch}", flush=True)

        save_times: dict[str, list[float]] = {m: [] for m in SAVE_METHODS}
        for rep in range(args.reps):
            for method in SAVE_METHODS:
                folder = scratch / f"save-{rep}-{method.replace(' ', '')}"
                folder.mkdir()
                save_times[method].append(timed(lambda m=method, f=folder: SAVES[m](state, f)))
                print(f"  save {method:<22} {save_times[method][-1]:7.2f} s", flush=True)
                shutil.rmtree(folder)
                os.sync()  # the deletion's write-back must not land in the next method's time

        sources = {}
        for method in SAVE_METHODS[:3]:
            sources[method] = scratch / f"load-{method}"
            sources[method].mkdir()
            SAVES[method](state, sources[method])
        cold: dict[str, list[float]] = {m: [] for m in LOAD_METHODS}
        warm: dict[str, list[float]] = {m: [] for m in LOAD_METHODS}
        for _ in range(args.reps):
            for method in LOAD_METHODS:
                folder = sources[LOAD_SOURCE[method]]
                evict(folder)
                cold[method].append(timed(lambda m=method, f=folder: LOADS[m](f)))
                warm[method].append(timed(lambda m=method, f=folder: LOADS[m](f)))
                print(
                    f"  load {method:<22} cold {cold[method][-1]:6.2f} s, "
                    f"warm {warm[method][-1]:6.2f} s",
                    flush=True,
                )
        sizes = {
            m: sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
            for m, folder in sources.items()
        }

        save_peaks: dict[str, dict[str, Any]] = {}
        load_peaks: dict[str, dict[str, Any]] = {}
        if not args.no_memory and sys.platform.startswith("linux"):
            del state
            gc.collect()
            for method in SAVE_METHODS:
                folder = scratch / "peak"
                folder.mkdir()
                save_peaks[method] = peak_in_child("save", method, folder, args.mb)
                shutil.rmtree(folder)
            for method in LOAD_METHODS:
                folder = sources[LOAD_SOURCE[method]]
                load_peaks[method] = peak_in_child("load", method, folder, args.mb)
            print("  peak memory measured in fresh processes", flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    command = "python benchmarks/bench_store.py " + " ".join(
        a for a in (argv if argv is not None else sys.argv[1:])
    )
    versions = (
        f"Python {platform.python_version()}, torch {torch.__version__}, "
        f"safetensors {safetensors.__version__}, nbresume {nbresume.__version__}"
    )
    report = render(
        command=command.strip(),
        machine=machine(),
        fs=file_system(scratch),
        load=(load_before, os.getloadavg()[0]),
        versions=versions,
        total=total,
        reps=args.reps,
        sizes=sizes,
        save_times=save_times,
        cold=cold,
        warm=warm,
        save_peaks=save_peaks,
        load_peaks=load_peaks,
    )
    print()
    print(report)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(report)
    print(f"written to {out}")
    return 0


def render(
    *,
    command: str,
    machine: str,
    fs: str,
    load: tuple[float, float],
    versions: str,
    total: int,
    reps: int,
    sizes: dict[str, int],
    save_times: dict[str, list[float]],
    cold: dict[str, list[float]],
    warm: dict[str, list[float]],
    save_peaks: dict[str, dict[str, Any]],
    load_peaks: dict[str, dict[str, Any]],
) -> str:
    def med(values: list[float]) -> float:
        return statistics.median(values)

    def rate(seconds: float) -> str:
        return f"{total / MB / seconds:,.0f}"

    def peak(peaks: dict[str, dict[str, Any]], method: str) -> str:
        if method not in peaks:
            return "not measured"
        extra = peaks[method]["extra"]
        return f"{extra / MB:,.0f} MB ({extra / total:.2f}x state)"

    base_save = med(save_times["torch.save"])
    base_cold, base_warm = med(cold["torch.load"]), med(warm["torch.load"])
    date = datetime.now(timezone.utc).strftime("%Y-%m-%d")
    lines = [
        "# Checkpoint store benchmark",
        "",
        f"- Command: `{command}`",
        f"- Machine: {machine}",
        f"- Scratch folder: {fs}",
        f"- Load average (1 min) at the start and the end: {load[0]:.2f}, {load[1]:.2f} "
        "(anything else running shares the cores and the disk)",
        f"- Software: {versions}",
        f"- Date: {date}",
        f"- State: {total / MB:.1f} MB of float32 tensors: a model of {total / 3 / MB:.0f} MB "
        "(1024x1024 linear layers) and its AdamW state after one step (exp_avg, exp_avg_sq).",
        f"- Files on disk: nbresume {sizes['nbresume'] / MB:.1f} MB, torch.save "
        f"{sizes['torch.save'] / MB:.1f} MB, safetensors {sizes['safetensors'] / MB:.1f} MB.",
        f"- Medians of {reps} interleaved repetitions. MB/s is state bytes (10^6) per second.",
        "",
        "## Saves",
        "",
        "Every save is durable (fsync) before the clock stops. nbresume's time includes its "
        "read-back verification; that read comes from the page cache the write just filled.",
        "",
        "| method | verified | median time | MB/s | time vs torch.save | peak extra memory |",
        "|---|---|---:|---:|---:|---:|",
    ]
    verified = {"nbresume": "yes", "torch.save + sha256": "yes (read-back)"}
    for method in SAVE_METHODS:
        seconds = med(save_times[method])
        lines.append(
            f"| {method} | {verified.get(method, 'no')} | {seconds:.2f} s | {rate(seconds)} | "
            f"{seconds / base_save:.2f}x | {peak(save_peaks, method)} |"
        )
    lines += [
        "",
        "## Loads",
        "",
        "Cold: the files' pages were dropped from the page cache first (posix_fadvise "
        "DONTNEED); on a virtual machine the host may still cache the disk, so cold reads can "
        "be faster than the physical disk. Warm: the same load again right after. Every load "
        "ends by touching each memory page of the tensors it returned, so that lazily mapped "
        "files (safetensors) are really read.",
        "",
        "| method | verified | cold time | cold MB/s | cold vs torch.load | warm time | "
        "warm MB/s | warm vs torch.load | peak extra memory |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    verified = {"nbresume": "yes", "sha256 + torch.load": "yes (hash pass)"}
    for method in LOAD_METHODS:
        c, w = med(cold[method]), med(warm[method])
        lines.append(
            f"| {method} | {verified.get(method, 'no')} | {c:.2f} s | {rate(c)} | "
            f"{c / base_cold:.2f}x | {w:.2f} s | {rate(w)} | {w / base_warm:.2f}x | "
            f"{peak(load_peaks, method)} |"
        )
    reset = all(p.get("reset") for p in (*save_peaks.values(), *load_peaks.values()))
    lines += [
        "",
        "Peak extra memory: the rise of the resident-memory high-water mark (VmHWM) while the "
        "method ran, in a fresh process per method"
        + (
            ", reset just before it through /proc/self/clear_refs. "
            if reset
            else " (the high-water mark could not be reset: these are upper bounds). "
        )
        + "A load necessarily holds the loaded state (1.00x); a save needs none of it.",
        "",
        "## Every repetition (seconds)",
        "",
    ]
    for method in SAVE_METHODS:
        lines.append(f"- save {method}: " + ", ".join(f"{t:.2f}" for t in save_times[method]))
    for method in LOAD_METHODS:
        lines.append(
            f"- load {method}: cold "
            + ", ".join(f"{t:.2f}" for t in cold[method])
            + "; warm "
            + ", ".join(f"{t:.2f}" for t in warm[method])
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
