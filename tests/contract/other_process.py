"""Another process using the same store: ``python other_process.py LOCATION [OPTIONS_JSON]``.

Reads one JSON command per line from stdin, ``{"saves": [[step, value], ...], "prune_keep":
int | null}``: saves each step with :func:`testkit.backends.payload`, then prunes; answers ``done``
on stdout once the command is complete, so the test can look at the store in between.
"""

from __future__ import annotations

import json
import sys

from nbresume.checkpoint.store import CheckpointStore
from testkit.backends import install_loopback_guard, payload, settle


def main(location: str, options: dict[str, object] | None) -> None:
    install_loopback_guard()
    store = CheckpointStore(location, keep=None, storage_options=options)
    for line in sys.stdin:
        command = json.loads(line)
        for step, value in command.get("saves") or []:
            store.save(step, **payload(value))
        if command.get("prune_keep"):
            settle(store)
            store.prune(keep=command["prune_keep"])
        print("done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], json.loads(sys.argv[2]) if len(sys.argv) > 2 else None)
