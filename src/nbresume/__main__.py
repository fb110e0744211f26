"""``python -m nbresume``: the same as the ``nbresume`` command."""

from __future__ import annotations

import sys

from nbresume.cli import main

if __name__ == "__main__":
    sys.exit(main())
