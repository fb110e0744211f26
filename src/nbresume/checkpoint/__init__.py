"""The checkpoint core: on-disk format, atomic commit, verification, retention and storage.

Imports no notebook or UI library; progress reaches those through callbacks. What each layer's
package exports (its ``__all__``) is for the rest of nbresume only: users import from
``nbresume`` itself (docs/api.md), and :class:`~nbresume.checkpoint.store.PendingCheckpoint`.
"""
