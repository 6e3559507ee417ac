"""The one error type of ``trainguard watch``: bad input, reported as exit code 2."""

from __future__ import annotations


class WatchError(Exception):
    """Bad input to the watch (run dir, notification URL, setting): ``main`` prints it and returns 2."""
