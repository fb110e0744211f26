"""Whether this process runs inside IPython, and in a notebook kernel: asked without importing
IPython (a kernel has imported it already), so that a script pays nothing for the question."""

from __future__ import annotations

import sys
from typing import Any


def ipython_shell() -> Any:
    """The running IPython shell, or ``None``."""
    module = sys.modules.get("IPython")
    get = getattr(module, "get_ipython", None)
    return get() if get is not None else None


def in_notebook() -> bool:
    """Whether this process is a notebook kernel (Jupyter, Colab, Kaggle, VS Code)."""
    return getattr(ipython_shell(), "kernel", None) is not None
