"""The package's version, where the checkpoint core can read it without importing ``nbresume``.

Protocol: one constant. Manifests record it as their writer (``"nbresume 0.1.0.dev0"``);
``nbresume.__version__`` re-exports it.
"""

from __future__ import annotations

__version__ = "0.1.0.dev0"
