"""Another process using the same store: ``python other_process.py SPEC``.

SPEC is JSON: ``{"location": ..., "storage_options": {...} | null, "saves": [[step, value],
...], "prune_keep": int | null}``. Saves each step with :func:`backends.payload`, then prunes.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from backends import install_loopback_guard, payload

from nbresume.checkpoint.store import CheckpointStore


def main(spec: dict[str, object]) -> None:
    install_loopback_guard()
    store = CheckpointStore(
        str(spec["location"]),
        keep=None,
        storage_options=spec.get("storage_options") or None,  # type: ignore[arg-type]
    )
    for step, value in spec.get("saves") or []:  # type: ignore[attr-defined]
        store.save(step, **payload(value))
    if spec.get("prune_keep"):
        store.prune(keep=spec["prune_keep"])  # type: ignore[arg-type]


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
