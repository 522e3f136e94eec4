"""Warnings attributed to the caller's line: the first frame outside this package, so that
Python's filters (and its once-per-location default) apply to the user's code, not ours."""

import os
import sys
import warnings

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def warn(message: str) -> None:
    """A RuntimeWarning at the line of the user's code that called into jax_sdpa."""
    frame, level = sys._getframe(1), 2
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, RuntimeWarning, stacklevel=level)
