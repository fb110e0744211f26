"""Pieces shared by the integrations with training frameworks (:mod:`nbresume.hf`, ...).

:class:`~nbresume.frameworks.watch.Watch` makes a loop that a framework runs look like a
:class:`~nbresume.Checkpointer` to the panel, the status line and the stop machinery. Nothing
here imports a framework.
"""
