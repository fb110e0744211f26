"""Colab's error types (the ones the stand-in raises)."""

from __future__ import annotations


class Error(Exception):
    """Base class for Colab errors."""


class AuthorizationError(Error):
    """Authorization failed."""
