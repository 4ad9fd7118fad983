"""Bounded host waits: every wait cucopy makes for the device has a deadline.

A wait that never returns (a GPU that never answers: a hung kernel, a peer that
never arrives) leaves an engine hung with no word of why. cucopy's waits (a ring
slot still in flight, :meth:`~cucopy.DeviceCopier.close`, a slot replaced to grow
the staging capacity, the slot an eager copy needs) poll the event instead, and
raise :class:`~cucopy.CopyError` saying what they waited for once the deadline has
passed.

The deadline is the copier's ``wait_timeout`` argument, else ``CUCOPY_WAIT_TIMEOUT``
(seconds) in the environment when the copier is made, else
:data:`DEFAULT_WAIT_TIMEOUT`: five minutes, which no healthy engine's step reaches.

No wait spins: between two queries of the event the host sleeps, starting at
:data:`FIRST_SLEEP` and doubling up to :data:`LONGEST_SLEEP`, so a wait that
ends at once costs one query and a long one costs a query a millisecond.
"""

from __future__ import annotations

import math
import os
import time

__all__ = ["DEFAULT_WAIT_TIMEOUT", "FIRST_SLEEP", "LONGEST_SLEEP", "resolve_timeout", "poll"]

#: seconds a host wait may last before it raises (no healthy step comes near)
DEFAULT_WAIT_TIMEOUT = 300.0
#: the first sleep between two queries of a pending event, in seconds
FIRST_SLEEP = 20e-6
#: the longest sleep between two queries, in seconds
LONGEST_SLEEP = 1e-3

ENV = "CUCOPY_WAIT_TIMEOUT"


def resolve_timeout(value=None) -> float:
    """The wait deadline in seconds: ``value``, else ``CUCOPY_WAIT_TIMEOUT``, else the default.

    Parameters
    ----------
    value : float or int, optional
        Seconds, > 0 (``math.inf``: no bound).

    Returns
    -------
    float

    Raises
    ------
    TypeError
        ``value`` is not a real number (a bool is refused too).
    ValueError
        ``value``, or the environment variable, is zero, negative or NaN (or the
        variable is not a number).
    """
    if value is None:
        raw = os.environ.get(ENV, "").strip()
        if not raw:
            return DEFAULT_WAIT_TIMEOUT
        try:
            value = float(raw)
        except ValueError:
            raise ValueError(f"{ENV}: expected seconds > 0, got {raw!r}") from None
        if not value > 0:
            raise ValueError(f"{ENV}: expected seconds > 0, got {raw!r}")
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(
            f"wait_timeout: expected seconds as an int or float, got {type(value).__qualname__} "
            f"{value!r}"
        )
    value = float(value)
    if not value > 0:  # NaN too
        raise ValueError(f"wait_timeout: expected seconds > 0, got {value!r}")
    return value


def poll(query, arg, timeout: float) -> bool:
    """Wait until ``query(arg)`` is true or ``timeout`` seconds have passed.

    Sleeps between queries (:data:`FIRST_SLEEP` doubling to :data:`LONGEST_SLEEP`),
    never spins.

    Parameters
    ----------
    query : callable
        Returns true once the awaited work has completed; never blocks.
    arg : object
        Passed to ``query``.
    timeout : float
        Seconds (``math.inf``: no bound).

    Returns
    -------
    bool
        True when it completed, False when the deadline passed first.
    """
    if query(arg):
        return True
    deadline = time.monotonic() + timeout if math.isfinite(timeout) else math.inf
    delay = FIRST_SLEEP
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return bool(query(arg))
        time.sleep(min(delay, left))
        if query(arg):
            return True
        delay = min(delay * 2, LONGEST_SLEEP)
