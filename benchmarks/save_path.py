"""The modules of nbresume that one blocking save enters: ``python -m benchmarks.save_path``.

A Checkpointer on a tiny model saves once into a local folder (its first save chooses the
strategy, once), then the second save, ``ckpt.save(step=1, block=True)``, is traced with
:func:`sys.setprofile`: every file under ``src/nbresume`` whose code is called, from
``Checkpointer.save()`` to the verified commit and its retention, is listed in the order it is
first entered, then counted. Only the calling thread is traced (the fsyncs that worker threads
do are not). The Checkpointer is ``quiet``: with the console status line (the default outside
a notebook), that line's own modules are entered too (``--status-line`` lists them).
docs/architecture.md ("The life of one save") shows this list; tests/test_layers.py checks that
the two agree.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from types import FrameType
from typing import Any


def save_path(*, status_line: bool = False) -> list[str]:
    """The files under ``nbresume/`` one blocking save enters, relative to it, in order."""
    import torch

    import nbresume

    root = str(Path(nbresume.__file__).resolve().parent) + "/"
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    seen: dict[str, None] = {}

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        name = frame.f_code.co_filename
        if event == "call" and name.startswith(root):
            seen.setdefault(name[len(root) :], None)

    with tempfile.TemporaryDirectory() as folder:
        ckpt = nbresume.Checkpointer(
            folder, model=model, optimizer=optimizer, every=None, quiet=not status_line
        )
        ckpt.save(block=True)
        sys.setprofile(profile)
        try:
            ckpt.save(step=1, block=True)
        finally:
            sys.setprofile(None)
        ckpt.close()
    return list(seen)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--status-line", action="store_true", help="show the console status line, as by default"
    )
    args = parser.parse_args(argv)
    modules = save_path(status_line=args.status_line)
    for module in modules:
        print(module)
    print(f"{len(modules)} modules")


if __name__ == "__main__":
    main()
