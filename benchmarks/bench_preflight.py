"""How long the first-cell preflight takes, when the network answers and when it hangs.

The product target: ``nbresume.preflight()`` returns in under 2 seconds however the network
behaves. Scenarios, each run in a fresh child process (a cold start, as in a notebook's first
cell) and repeated:

  internet on        the probe reaches a TCP server on loopback
  internet off       the probe's port is closed: refused at once
  connection hangs   the probe's port accepts nothing (a full accept queue): the connection
                     would hang for minutes
  nvidia-smi hangs   an nvidia-smi on PATH that never answers, and the connection hangs too

Nothing here touches the real network: every probe targets 127.0.0.1. torch is not imported
(a machine without a GPU), so the times are nbresume's own.

Run from the repository root:

    .venv/bin/python benchmarks/bench_preflight.py --reps 5
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent
TARGET_S = 2.0

CHILD = """
import json, sys, time
started = time.monotonic()
import nbresume
imported = time.monotonic()
report = nbresume.preflight(internet=True)
done = time.monotonic()
print(json.dumps({"import_s": imported - started, "preflight_s": done - imported,
                  "internet": report["internet"].seen, "accelerator": report["accelerator"].seen}))
"""


@contextmanager
def accepting_server() -> Iterator[int]:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            conn.close()

    threading.Thread(target=serve, daemon=True).start()
    try:
        yield int(server.getsockname()[1])
    finally:
        server.close()


@contextmanager
def closed_port() -> Iterator[int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    yield port


@contextmanager
def hanging_port() -> Iterator[int]:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(0)
    port = int(server.getsockname()[1])
    held = []
    while True:
        client = socket.socket()
        client.settimeout(0.2)
        try:
            client.connect(("127.0.0.1", port))
        except OSError:
            client.close()
            break
        held.append(client)
    try:
        yield port
    finally:
        for client in held:
            client.close()
        server.close()


def run_child(port: int, extra_path: str | None) -> dict[str, object]:
    env = dict(os.environ)
    env.update(NBRESUME_PROBE_HOST="127.0.0.1", NBRESUME_PROBE_PORT=str(port))
    if extra_path:
        env["PATH"] = f"{extra_path}{os.pathsep}{env.get('PATH', '')}"
    result = subprocess.run(
        [sys.executable, "-c", CHILD], capture_output=True, text=True, env=env, check=True
    )
    return dict(json.loads(result.stdout))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", type=Path, default=HERE / "results" / "preflight.md")
    args = parser.parse_args()

    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        fake = Path(tmp) / "nvidia-smi"
        fake.write_text("#!/bin/sh\nexec sleep 60\n")
        fake.chmod(0o755)
        scenarios = [
            ("internet on", accepting_server, None),
            ("internet off", closed_port, None),
            ("connection hangs", hanging_port, None),
            ("nvidia-smi hangs", hanging_port, tmp),
        ]
        rows = []
        for label, make_port, path in scenarios:
            times: list[float] = []
            imports: list[float] = []
            seen: dict[str, object] = {}
            with make_port() as port:
                for _ in range(args.reps):
                    seen = run_child(port, path)
                    times.append(float(seen["preflight_s"]))  # type: ignore[arg-type]
                    imports.append(float(seen["import_s"]))  # type: ignore[arg-type]
            rows.append(
                (label, statistics.median(times), max(times), statistics.median(imports), seen)
            )
            print(f"{label:18} median {statistics.median(times):.3f} s  max {max(times):.3f} s")

    lines = [
        "# Preflight benchmark",
        "",
        f"- Command: `python benchmarks/bench_preflight.py --reps {args.reps}`",
        f"- Machine: {platform.machine()}, {os.cpu_count()} cores, {platform.system()} "
        f"{platform.release()}",
        f"- Python {platform.python_version()}; each repetition is a fresh process",
        f"- Load average (1 min) at the start and the end: {load_before:.2f}, "
        f"{os.getloadavg()[0]:.2f} (anything else running shares the cores)",
        f"- Date: {datetime.now(timezone.utc).date().isoformat()}",
        f"- Target: under {TARGET_S:g} s however the network behaves (probe timeout 1 s)",
        "",
        "| scenario | median preflight | max preflight | median `import nbresume` | "
        "internet check saw |",
        "|---|---:|---:|---:|---|",
    ]
    for label, median, worst, imported, seen in rows:
        lines.append(
            f"| {label} | {median:.3f} s | {worst:.3f} s | {imported:.3f} s | {seen['internet']} |"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")
    if any(worst >= TARGET_S for _, _, worst, _, _ in rows):
        sys.exit(f"a preflight took {TARGET_S:g} s or more")


if __name__ == "__main__":
    main()
