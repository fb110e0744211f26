"""Where the project's files are, and how a child Python process finds this package."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

#: The ``tests`` folder: the folder on ``sys.path`` that holds this package.
TESTS = Path(__file__).resolve().parent.parent
#: The project's checkout.
ROOT = TESTS.parent


def with_testkit(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` with ``tests`` first on ``PYTHONPATH``: a child Python process started with it
    imports ``testkit`` (and the suite's other helpers) as the tests do."""
    rest = env.get("PYTHONPATH", "")
    return {**env, "PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS), rest]))}
