"""Training text that every machine has: the Python standard library's own source files, read
at run time as bytes (a byte-level vocabulary of 256), split into train and validation."""

import pathlib
import sysconfig

import numpy as np


def load_stdlib_bytes(max_bytes: int) -> np.ndarray:
    """Up to max_bytes of the standard library's .py files, in a fixed (sorted) order."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts:
            continue
        try:
            data = path.read_bytes()
        except OSError:
            continue
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    text = b"\n".join(chunks)[:max_bytes]
    if len(text) < 100_000:
        raise RuntimeError(f"found only {len(text)} bytes of Python source under {root}")
    return np.frombuffer(text, dtype=np.uint8)


def train_validation_split(data: np.ndarray, validation_fraction: float = 0.1):
    cut = int(len(data) * (1 - validation_fraction))
    return data[:cut], data[cut:]


def random_batch(data: np.ndarray, batch: int, seq_len: int, rng: np.random.Generator):
    """Inputs and next-byte targets, int32 [batch, seq_len] each, from random offsets."""
    starts = rng.integers(0, len(data) - seq_len - 1, size=batch)
    windows = np.stack([data[s:s + seq_len + 1] for s in starts]).astype(np.int32)
    return windows[:, :-1], windows[:, 1:]
