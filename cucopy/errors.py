"""Exceptions raised by cucopy."""

from __future__ import annotations

__all__ = ["CopyError"]


class CopyError(RuntimeError):
    """A copy broke the contract of its plan, or the copier cannot take it.

    Raised for run-time contract violations found by check mode (a merged
    destination written before its barrier, a false ``unchanged`` claim), for
    work handed to a closed or foreign-thread copier, and for backend failures
    during a flush.  The message names the site.
    """

    status: int | None = None
    """The CUDA status code behind a backend failure, when there is one."""
