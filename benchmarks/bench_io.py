"""The core's hot path against the disk's own speed: hashes, durable save, restore.

Four measurements, each side by side in one process, repetitions interleaved (A, B, C, then
again), medians reported with the load average at the start and the end:

- **hashes**: throughput of the integrity hashes a checkpoint could use (SHA-256, XXH3-128,
  BLAKE3, CRC32C, MD5) over 256 MiB in memory, on one core and on two threads;
- **save**: ``CheckpointStore.save`` until it returns (written, fsynced, committed, checked)
  against a raw write of the same tensor bytes into one file per group plus fsync, with
  XXH3-128 (format v1.1) and with SHA-256 (format v1);
- **restore**: ``CheckpointStore.load`` (every byte hashed and checked, tensors built) and
  ``torch.load`` of the same state against a raw read of the same files into one reused 8 MiB
  buffer, cold (the files' pages dropped with posix_fadvise first) and warm, with the CPU time
  each cold restore spends in the kernel and what a first write to fresh memory costs;
- **where a warm restore's time goes**: the same files read from the page cache into memory
  already touched, with and without XXH3-128, into fresh memory faulted page by page and
  populated at once, and the unmapping of that memory.

Run from the repository root (``python -m benchmarks`` runs it with the other suites)::

    .venv/bin/python benchmarks/bench_io.py --sizes 50,500 --reps 3
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

if not __package__:  # run as a script (python benchmarks/NAME.py): the repository's root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks._common import evict, file_system, fsync_path, load_average, machine

HERE = Path(__file__).resolve().parent
MB = 1_000_000
CHUNK = 8 << 20


# -- hashes -------------------------------------------------------------------------------


def hash_functions() -> dict[str, Callable[[bytes], object]]:
    """The candidate hashes that are installed, each over one buffer."""
    found: dict[str, Callable[[bytes], object]] = {
        "SHA-256": lambda b: hashlib.sha256(b).digest(),
        "MD5": lambda b: hashlib.md5(b, usedforsecurity=False).digest(),
    }
    try:
        import xxhash

        found["XXH3-128"] = lambda b: xxhash.xxh3_128(b).digest()
    except ImportError:
        pass
    try:
        import blake3

        found["BLAKE3"] = lambda b: blake3.blake3(b).digest()
        found["BLAKE3 (its own threads)"] = lambda b: blake3.blake3(
            b, max_threads=blake3.blake3.AUTO
        ).digest()
    except ImportError:
        pass
    try:
        import google_crc32c

        found["CRC32C"] = google_crc32c.value
    except ImportError:
        pass
    return found


def measure_hashes(mib: int, reps: int) -> dict[str, dict[str, float]]:
    """GB/s of each hash over ``mib`` MiB: one thread, and two threads on two halves."""
    data = os.urandom(mib << 20)  # bytes: google_crc32c takes nothing else
    halves = [data[: len(data) // 2], data[len(data) // 2 :]]  # copied before any clock
    functions = hash_functions()
    times: dict[str, dict[str, list[float]]] = {n: {"one": [], "two": []} for n in functions}
    for _ in range(reps):
        for name, function in functions.items():
            started = time.perf_counter()
            function(data)
            times[name]["one"].append(time.perf_counter() - started)
            threads = [threading.Thread(target=function, args=(h,)) for h in halves]
            started = time.perf_counter()
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            times[name]["two"].append(time.perf_counter() - started)
    return {
        name: {kind: len(data) / statistics.median(values) / 1e9 for kind, values in t.items()}
        for name, t in times.items()
    }


# -- save and restore ---------------------------------------------------------------------


def build(mb: float) -> dict[str, dict[str, Any]]:
    """A model of about ``mb`` / 3 MB of float32 weights and an AdamW-shaped state twice its
    size (exp_avg, exp_avg_sq): ``mb`` MB of tensors in two groups."""
    import torch

    width = 1024
    layers = max(1, round(mb * MB / 3 / (width * width * 4)))
    generator = torch.Generator().manual_seed(0)
    model = {f"{i}.weight": torch.randn(width, width, generator=generator) for i in range(layers)}
    optimizer = {}
    for i in range(layers):
        optimizer[f"state.{i}.exp_avg"] = torch.randn(width, width, generator=generator)
        optimizer[f"state.{i}.exp_avg_sq"] = torch.rand(width, width, generator=generator)
    return {"model": model, "optimizer": optimizer}


def raw_write(state: dict[str, dict[str, Any]], folder: Path) -> None:
    """The floor: each group's tensor bytes into one file, fsynced, and the folder fsynced."""
    folder.mkdir()
    for group, tensors in state.items():
        with open(folder / f"{group}.bin", "wb") as handle:
            for tensor in tensors.values():
                handle.write(memoryview(tensor.numpy()).cast("B"))
            handle.flush()
            os.fsync(handle.fileno())
    fsync_path(folder)


def write_safetensors(state: dict[str, dict[str, Any]], folder: Path) -> None:
    """Each group saved by safetensors' own ``save_file`` (one file each), fsynced."""
    import safetensors.torch

    folder.mkdir()
    for group, tensors in state.items():
        safetensors.torch.save_file(tensors, folder / f"{group}.safetensors")
        fsync_path(folder / f"{group}.safetensors")


def raw_read(folder: Path) -> int:
    """The floor: every file read once into one reused 8 MiB buffer."""
    buffer = bytearray(CHUNK)
    view = memoryview(buffer)
    total = 0
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            with open(path, "rb", buffering=0) as handle:
                while count := handle.readinto(view):
                    total += count
    return total


#: The parts of a warm restore, each a read of the checkpoint's files from the page cache.
PARTS = (
    "read, 8 MiB reused buffer",
    "read into memory already touched",
    "read into memory already touched + XXH3-128",
    "read into fresh memory, a fault per page + XXH3-128",
    "read into fresh memory populated at once + XXH3-128",
    "unmap that fresh memory",
)


def read_parts(folder: Path, part: str) -> tuple[float, float]:
    """(seconds to read, seconds to unmap) every file below ``folder`` the way ``part`` says."""
    import mmap

    import xxhash

    if part == PARTS[0]:
        started = time.perf_counter()
        raw_read(folder)
        return time.perf_counter() - started, 0.0
    sizes = {p: p.stat().st_size for p in sorted(folder.rglob("*")) if p.is_file()}
    touched = {p: bytearray(b"\1" * n) for p, n in sizes.items()} if "touched" in part else {}
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    if "populated" in part:
        flags |= getattr(mmap, "MAP_POPULATE", 0)
    filled: list[Any] = []
    started = time.perf_counter()
    for path, size in sizes.items():
        filled.append(touched[path] if touched else mmap.mmap(-1, size, flags=flags))
        view = memoryview(filled[-1])
        digest = xxhash.xxh3_128() if "XXH3" in part else None
        with open(path, "rb", buffering=0) as handle:
            done = 0
            while count := handle.readinto(view[done : done + CHUNK]):
                if digest is not None:
                    digest.update(view[done : done + count])
                done += count
        view.release()
    elapsed = time.perf_counter() - started
    started = time.perf_counter()
    filled.clear()  # the fresh mappings are unmapped here
    return elapsed, time.perf_counter() - started


def measure_parts(folder: Path, reps: int) -> dict[str, float]:
    """Medians of the parts of a warm restore of ``folder`` (repetitions interleaved)."""
    times: dict[str, list[float]] = {part: [] for part in PARTS}
    for _ in range(reps):
        for part in PARTS[:-1]:
            raw_read(folder)  # the page cache holds the files
            elapsed, unmapped = read_parts(folder, part)
            times[part].append(elapsed)
            if "populated" in part:
                times[PARTS[-1]].append(unmapped)
    return {part: statistics.median(values) for part, values in times.items()}


def kernel_seconds() -> float:
    """CPU seconds this process has spent in the kernel so far (every thread)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_stime


def first_touch(nbytes: int) -> tuple[float, float]:
    """(seconds to write every byte of ``nbytes`` of fresh memory once, seconds to write it
    again): what a restore pays for memory of its own, whichever library reads the file."""
    import ctypes
    import mmap

    memory = mmap.mmap(-1, nbytes)
    buffer = (ctypes.c_char * nbytes).from_buffer(memory)
    try:
        started = time.perf_counter()
        ctypes.memset(buffer, 1, nbytes)
        fresh = time.perf_counter() - started
        started = time.perf_counter()
        ctypes.memset(buffer, 2, nbytes)
        return fresh, time.perf_counter() - started
    finally:
        del buffer
        memory.close()


#: The parts of an asynchronous save's blocked time, each timed alone on the io suite's state.
SNAPSHOT_PARTS = (
    "copy_ of one tensor as large as the state (the stall suite's memory copy)",
    "copy_ of each tensor into kept buffers (torch's threads)",
    "nbresume's snapshot copy into kept buffers (8 MiB pieces, two threads)",
    "nbresume's flattening of the state (names and layout)",
)


def measure_snapshot(state: dict[str, dict[str, Any]], reps: int) -> dict[str, float]:
    """Medians of the parts of an asynchronous save's blocked time (repetitions interleaved);
    every destination is written once before it is timed, as kept buffers are."""
    import torch

    from nbresume.checkpoint.format import flatten
    from nbresume.checkpoint.state import HostBuffers

    tensors = [t for group in state.values() for t in group.values()]
    source = torch.cat([t.reshape(-1) for t in tensors])
    target = torch.empty_like(source)
    kept = [torch.empty_like(t) for t in tensors]
    buffers = HostBuffers()
    jobs: dict[str, Callable[[], object]] = {
        SNAPSHOT_PARTS[0]: lambda: target.copy_(source),
        SNAPSHOT_PARTS[1]: lambda: [k.copy_(t) for k, t in zip(kept, tensors, strict=True)],
        SNAPSHOT_PARTS[2]: lambda: buffers.copy(state),
        SNAPSHOT_PARTS[3]: lambda: [flatten(group, name=name) for name, group in state.items()],
    }
    times: dict[str, list[float]] = {part: [] for part in SNAPSHOT_PARTS}
    for job in jobs.values():
        job()  # the destinations' pages are faulted in once
    for _ in range(max(3, reps)):
        for part, job in jobs.items():
            started = time.perf_counter()
            job()
            times[part].append(time.perf_counter() - started)
    return {part: statistics.median(values) for part, values in times.items()}


#: The restores timed side by side: the floor, nbresume, torch.load of a torch.save file, and
#: safetensors' load_file of the same groups saved by its save_file.
RESTORES = ("raw read", "nbresume", "torch.load", "safetensors")
PAGE = 4096
#: Longest a restore in its own process may take before it is stopped (and reported as such).
RESTORE_TIMEOUT_S = 300.0


def touch_pages(tree: Any) -> int:
    """Read one byte of every memory page of every tensor in ``tree``: a tensor mapped from
    its file and not yet read (safetensors) is not restored until its pages are in memory.
    NumPy reads them (no torch thread pool in a forked process)."""
    total = 0
    if isinstance(tree, dict):
        return sum(touch_pages(value) for value in tree.values())
    if hasattr(tree, "numpy") and tree.numel():
        flat = tree.detach().reshape(-1).view(__import__("torch").uint8).numpy()
        total += int(flat[::PAGE].sum())
    return total


def restore_once(method: str, folder: Path) -> None:
    """One restore of ``folder`` by ``method``, every page of what it returns read once."""
    import torch

    from nbresume import CheckpointStore

    if method == "raw read":
        raw_read(folder)
    elif method == "nbresume":
        touch_pages(CheckpointStore(folder, keep=None).load().tensors)
    elif method == "torch.load":
        touch_pages(torch.load(folder / "state.pt", weights_only=True))
    else:
        import safetensors.torch

        touch_pages({p.name: safetensors.torch.load_file(p) for p in sorted(folder.iterdir())})


def restore_fresh(method: str, folder: Path) -> tuple[float, float]:
    """(seconds, kernel CPU seconds) of :func:`restore_once` in a forked process of its own,
    as a resumed run restores: no memory an earlier restore freed is there to reuse. A
    process that does not answer in :data:`RESTORE_TIMEOUT_S` is killed (NaN)."""
    import select
    import signal

    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: time the restore, send the figures, leave without cleanup
        code = 1
        try:
            os.close(read_end)
            in_kernel = kernel_seconds()
            started = time.perf_counter()
            restore_once(method, folder)
            elapsed = time.perf_counter() - started
            os.write(write_end, f"{elapsed} {kernel_seconds() - in_kernel}".encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write_end)
    try:
        ready, _, _ = select.select([read_end], [], [], RESTORE_TIMEOUT_S)
        answer = os.read(read_end, 200).decode() if ready else ""
    finally:
        os.close(read_end)
        if not answer:
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    if not answer:
        return float("nan"), float("nan")
    seconds, kernel = (float(x) for x in answer.split())
    return seconds, kernel


def measure_io(sizes: list[float], reps: int, scratch: Path) -> list[dict[str, Any]]:
    """Per size: medians of save (XXH3-128, SHA-256, raw) and restore (cold, warm; raw,
    nbresume, torch.load), the kernel's CPU time of each cold restore, and fresh memory's
    first-touch cost."""
    import torch

    from nbresume import CheckpointStore

    rows = []
    for mb in sizes:
        state = build(mb)
        nbytes = sum(t.nbytes for g in state.values() for t in g.values())
        saves: dict[str, list[float]] = {"raw write + fsync": [], "xxh3-128": [], "sha256": []}
        loads: dict[str, list[float]] = {
            f"{method} {temperature}": [] for temperature in ("cold", "warm") for method in RESTORES
        }
        kernel: dict[str, list[float]] = {method: [] for method in RESTORES}
        touch: dict[str, list[float]] = {"fresh": [], "touched": []}
        for rep in range(reps):
            shutil.rmtree(scratch, ignore_errors=True)
            scratch.mkdir(parents=True)
            for method, times in saves.items():
                target = scratch / f"{method}-{rep}"
                started = time.perf_counter()
                if method.startswith("raw"):
                    raw_write(state, target)
                else:
                    CheckpointStore(target, keep=1, hash=method).save(1, tensors=state)
                times.append(time.perf_counter() - started)
            (scratch / f"torch-{rep}").mkdir()
            torch.save(state, scratch / f"torch-{rep}" / "state.pt")
            folders = {
                "raw read": scratch / f"raw write + fsync-{rep}",
                "nbresume": scratch / f"xxh3-128-{rep}",
                "torch.load": scratch / f"torch-{rep}",
                "safetensors": scratch / f"safetensors-{rep}",
            }
            write_safetensors(state, folders["safetensors"])
            for temperature in ("cold", "warm"):
                for method, folder in folders.items():
                    if temperature == "cold":
                        evict(folder)
                    else:
                        raw_read(folder)  # the page cache holds the files
                    seconds, in_kernel = restore_fresh(method, folder)
                    loads[f"{method} {temperature}"].append(seconds)
                    if temperature == "cold":
                        kernel[method].append(in_kernel)
            fresh, touched = first_touch(nbytes)
            touch["fresh"].append(fresh)
            touch["touched"].append(touched)
        parts = measure_parts(folders["nbresume"], reps)
        shutil.rmtree(scratch, ignore_errors=True)
        snapshot = measure_snapshot(state, reps)
        rows.append(
            {
                "mb": nbytes / MB,
                "parts": parts,
                "snapshot": snapshot,
                "save": {k: statistics.median(v) for k, v in saves.items()},
                "load": {k: statistics.median(v) for k, v in loads.items()},
                "kernel": {k: statistics.median(v) for k, v in kernel.items()},
                "touch": {k: statistics.median(v) for k, v in touch.items()},
                "save_all": saves,
                "load_all": loads,
            }
        )
    return rows


# -- the report ---------------------------------------------------------------------------


def by_size(rows: list[dict[str, Any]], first: str, cells: dict[str, Callable[[Any], float]]
            ) -> list[str]:  # fmt: skip
    """A table with a column per state size: one row per label of ``cells``, its seconds taken
    from each size's row."""
    lines = [
        f"| {first} | " + " | ".join(f"{row['mb']:.0f} MB" for row in rows) + " |",
        "|---|" + "---:|" * len(rows),
    ]
    for label, seconds in cells.items():
        lines.append(f"| {label} | " + " | ".join(f"{seconds(r):.3f} s" for r in rows) + " |")
    return lines


def render(hashes: dict[str, dict[str, float]], rows: list[dict[str, Any]], meta: dict[str, str],
           reps: int) -> str:  # fmt: skip
    lines = [
        "# The core's hot path: hashes, durable save, restore",
        "",
        f"- Command: `{meta['command']}`",
        f"- Machine: {meta['machine']}",
        f"- Scratch folder: {meta['file_system']}",
        f"- Load average (1 min) at the start and the end: {meta['load_before']}, "
        f"{meta['load_after']} (other work on the machine shares the cores and the disk)",
        f"- Date: {meta['date']}",
        f"- Medians of {reps} interleaved repetitions.",
        "",
        "## Integrity hashes",
        "",
        "GB/s over 256 MiB in memory (10^9 bytes per second). Two threads: the buffer's two "
        "halves hashed at once (what a hash that releases the GIL gains on 2 cores).",
        "",
        "| hash | one thread | two threads |",
        "|---|---:|---:|",
    ]
    for name, speed in sorted(hashes.items(), key=lambda item: -item[1]["one"]):
        lines.append(f"| {name} | {speed['one']:.2f} | {speed['two']:.2f} |")
    lines += [
        "",
        "## Save until durable, against a raw write + fsync of the same bytes",
        "",
        "nbresume: `CheckpointStore.save` until it returns: files written and hashed in one "
        "pass, each fsynced (overlapped with the next file's write), manifest written and "
        "fsynced, folder fsynced, renamed, parent fsynced, then the manifest and each file's "
        "size checked (no read-back on a local disk: see docs/storage.md).",
        "",
        "| state | raw write + fsync | nbresume (XXH3-128) | ratio | nbresume (SHA-256) | ratio |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        s = row["save"]
        raw = s["raw write + fsync"]
        lines.append(
            f"| {row['mb']:.0f} MB | {raw:.3f} s | {s['xxh3-128']:.3f} s | "
            f"{s['xxh3-128'] / raw:.2f}x | {s['sha256']:.3f} s | {s['sha256'] / raw:.2f}x |"
        )
    lines += [
        "",
        "## Restore, against the fastest loader of the same bytes",
        "",
        "Every restore runs in a process of its own (forked), as a resumed run restores, and "
        "ends by reading one byte of every memory page of every tensor it returns: a tensor "
        "mapped from its file and not read yet is not restored. nbresume: "
        "`CheckpointStore.load`: every file read once into its own buffer, hashed (XXH3-128) "
        "as it is read, checked, tensors built on that memory. torch.load: "
        "`torch.load(weights_only=True)` of the same state saved by `torch.save`; safetensors: "
        "`safetensors.torch.load_file` of each group saved by its `save_file` (a copy-on-write "
        "mapping of the file: its pages are the page cache's until a tensor is written). "
        "Neither checks anything. Raw: the files read into one reused 8 MiB buffer. Cold: the "
        "files' pages dropped with posix_fadvise first (a virtual machine's host may still "
        "cache the disk). The last column is nbresume over the faster of torch.load and "
        "safetensors.",
        "",
        "| state | cache | raw read | nbresume | torch.load | safetensors "
        "| nbresume / fastest loader |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        load = row["load"]
        for temperature in ("cold", "warm"):
            fastest = min(load[f"{m} {temperature}"] for m in ("torch.load", "safetensors"))
            cells = [f"{row['mb']:.0f} MB", temperature]
            cells += [f"{load[f'{m} {temperature}']:.3f} s" for m in RESTORES]
            cells.append(f"{load[f'nbresume {temperature}'] / fastest:.2f}x")
            lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "### Where a cold restore's time goes: memory of its own",
        "",
        "A restore returns tensors, so it needs memory of its own; a raw read into one reused "
        "buffer does not. The first write to each page of fresh memory costs the kernel a "
        "page fault and a zeroed page (and, in a virtual machine, often the host's own fault): "
        "the rows below time that alone (writing every byte of fresh anonymous memory as large "
        "as the state, then writing it again), and the CPU time each cold restore above spent "
        "in the kernel (medians).",
        "",
    ]
    memory: dict[str, Callable[[Any], float]] = {
        "write fresh memory once": lambda r: r["touch"]["fresh"],
        "write it again": lambda r: r["touch"]["touched"],
    }
    for method in RESTORES:
        memory[f"{method} cold: in the kernel"] = lambda r, m=method: r["kernel"][m]
    lines += by_size(rows, "what", memory)
    lines += [
        "",
        "### Where a warm restore's time goes",
        "",
        "Each part is a read of the same checkpoint's files from the page cache, in 8 MiB "
        "pieces, timed alone (medians, repetitions interleaved). A restore must return memory "
        "of its own (the tensors), so it reads into fresh memory: every page is faulted in "
        "(zeroed by the kernel) before the copy, and the nbresume figures above include "
        "unmapping it (`del` of what `load` returned). nbresume populates a tensor file's "
        "memory in one go when its header is checked (`MAP_POPULATE`), which costs less than "
        "a fault per page.",
        "",
    ]
    warm: dict[str, Callable[[Any], float]] = {
        part: lambda r, p=part: r["parts"][p] for part in PARTS
    }
    warm["nbresume warm (the table above)"] = lambda r: r["load"]["nbresume warm"]
    lines += by_size(rows, "part", warm)
    lines += [
        "",
        "### What an asynchronous save's copy costs",
        "",
        "An asynchronous save blocks training while it copies the state into buffers it keeps "
        "from one save to the next; the stall suite divides that time by one `copy_` of a "
        "single tensor as large as the state. Each part below is timed alone on this suite's "
        "state (tensors of 4 MiB; medians, repetitions interleaved, destinations written once "
        "before).",
        "",
    ]
    lines += by_size(rows, "part", {p: lambda r, p=p: r["snapshot"][p] for p in SNAPSHOT_PARTS})
    return "\n".join(lines) + "\n"


def run(sizes: list[float], reps: int, scratch: Path, command: str) -> tuple[str, dict[str, Any]]:
    """Every measurement; the page and the raw numbers."""
    meta = {
        "command": command,
        "machine": machine(),
        "file_system": file_system(scratch.parent),
        "load_before": load_average(),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }
    hashes = measure_hashes(256, max(3, reps))
    rows = measure_io(sizes, reps, scratch)
    meta["load_after"] = load_average()
    return render(hashes, rows, meta, reps), {"meta": meta, "hashes": hashes, "io": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="50,500", help="state sizes in MB, comma-separated")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--dir", type=Path, help="scratch folder on the disk to measure")
    parser.add_argument("--out", default=str(HERE / "results" / "io.md"), help="results file")
    args = parser.parse_args(argv)
    sizes = [float(s) for s in args.sizes.split(",")]
    scratch = Path(tempfile.mkdtemp(prefix="nbresume-io-", dir=args.dir)) / "work"
    command = f"python benchmarks/bench_io.py --sizes {args.sizes} --reps {args.reps}"
    try:
        page, _ = run(sizes, args.reps, scratch, command)
    finally:
        shutil.rmtree(scratch.parent, ignore_errors=True)
    Path(args.out).write_text(page)
    print(page)
    return 0


if __name__ == "__main__":
    sys.exit(main())
