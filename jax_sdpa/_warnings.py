"""One warning per distinct message per process: fallbacks are announced once, not per trace."""

import warnings

_seen: set[str] = set()


def warn_once(message: str, stacklevel: int = 2) -> None:
    """stacklevel counts from the caller of warn_once, as warnings.warn counts from its own."""
    if message not in _seen:
        _seen.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=stacklevel + 1)


def reset() -> None:
    """Forget what was announced (for tests)."""
    _seen.clear()
