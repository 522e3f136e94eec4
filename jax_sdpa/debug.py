"""Debug switches for tests, read when a call is traced (never on the hot path)."""

from __future__ import annotations

import contextlib

from jax_sdpa.kernel_config import DEBUG_POISON_OUTPUTS

_flags = 0


def flags() -> int:
    """The DEBUG_* bits (jax_sdpa/kernel_config.py) for calls traced now."""
    return _flags


@contextlib.contextmanager
def poison_outputs():
    """Calls traced inside this block NaN-fill their outputs before cuDNN writes them, so a
    test can prove every element is written, and fill their cuDNN workspace with the same
    bytes, so it can prove nothing read there is left from before."""
    global _flags
    previous = _flags
    _flags |= DEBUG_POISON_OUTPUTS
    try:
        yield
    finally:
        _flags = previous
