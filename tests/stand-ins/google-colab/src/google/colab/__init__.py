"""A TEST STAND-IN for Colab's ``google.colab`` (``drive``, ``auth``), not the real package.

It exists so that nbresume's tests can run what a Colab user runs, on any machine, against a
simulated Google Drive (package ``colab_standin``). It must never shadow the real package: on
a Colab runtime (``/var/colab/hostname`` exists) importing it fails.
"""

from __future__ import annotations

from colab_standin.guard import refuse_on_colab

refuse_on_colab()

STANDIN = True  # the real package has no such name: a test can tell which one it runs on
