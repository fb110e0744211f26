"""The checkpoint core: on-disk format, atomic commit, verification, retention and storage.

Imports no notebook or UI library; progress reaches those through callbacks.
"""
