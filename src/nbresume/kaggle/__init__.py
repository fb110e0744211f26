"""Kaggle "Save & Run All" made safe: lint, secrets scan, smoke run, push, status, pull, chain.

One module per concern: :mod:`~nbresume.kaggle.notebook` reads an ``.ipynb``,
:mod:`~nbresume.kaggle.lint` finds what breaks a batch run, :mod:`~nbresume.kaggle.secrets`
finds credentials in sources and outputs, :mod:`~nbresume.kaggle.smoke` runs the notebook twice
on a clean kernel, :mod:`~nbresume.kaggle.metadata` writes ``kernel-metadata.json``,
:mod:`~nbresume.kaggle.client` talks to Kaggle through the official ``kaggle`` package,
:mod:`~nbresume.kaggle.output` downloads and verifies a version's output, and
:mod:`~nbresume.kaggle.chain` pushes leg after leg until the training is done.
:mod:`~nbresume.kaggle.commands` is what the command line calls.

Nothing here is imported by ``import nbresume``; ``kaggle`` and ``papermill`` are imported
only by the commands that need them (``pip install 'nbresume[kaggle]'``).
"""
