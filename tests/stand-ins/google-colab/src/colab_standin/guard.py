"""The stand-in must never shadow the real ``google.colab`` on a Colab runtime."""

from __future__ import annotations

import os

COLAB_MARKER = "/var/colab/hostname"  # colabtools' own marker of a Colab VM
#: Names one more marker file to check (to test this guard); it cannot disable the real one.
EXTRA_MARKER_ENV = "COLAB_STANDIN_MARKER"


def refuse_on_colab() -> None:
    """Raise ImportError on a Colab runtime."""
    markers = [COLAB_MARKER]
    if os.environ.get(EXTRA_MARKER_ENV):
        markers.append(os.environ[EXTRA_MARKER_ENV])
    for marker in markers:
        if os.path.exists(marker):
            raise ImportError(
                f"this google.colab is nbresume's test stand-in and refuses to load on a Colab "
                f"runtime ({marker} exists): run `pip uninstall nbresume-test-google-colab` "
                "to use the real google.colab"
            )
