"""Training text that every machine has: the Python standard library's own source files, read
at run time as bytes (a byte-level vocabulary of 256), split into train and validation."""

import os
import pathlib
import sysconfig

import numpy as np


def _stdlib_sources(max_bytes: int):
    """The standard library's .py files as bytes, in a fixed (sorted) order, until max_bytes
    have been read."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    paths = []
    for directory, subdirectories, files in os.walk(root):
        # Installed packages are not the standard library (and walking them is slow).
        subdirectories[:] = [d for d in subdirectories if d != "site-packages"]
        paths += [pathlib.Path(directory, name) for name in files if name.endswith(".py")]
    total = 0
    for path in sorted(paths):
        try:
            data = path.read_bytes()
        except OSError:
            continue
        yield data
        total += len(data)
        if total >= max_bytes:
            return


def _check_enough(total: int) -> None:
    if total < 100_000:
        root = sysconfig.get_paths()["stdlib"]
        raise RuntimeError(f"found only {total} bytes of Python source under {root}")


def load_stdlib_bytes(max_bytes: int) -> np.ndarray:
    """Up to max_bytes of the standard library's .py files, in a fixed (sorted) order."""
    text = b"\n".join(_stdlib_sources(max_bytes))[:max_bytes]
    _check_enough(len(text))
    return np.frombuffer(text, dtype=np.uint8)


def train_validation_split(data: np.ndarray, validation_fraction: float = 0.1):
    cut = int(len(data) * (1 - validation_fraction))
    return data[:cut], data[cut:]


def random_batch(data: np.ndarray, batch: int, seq_len: int, rng: np.random.Generator):
    """Inputs and next-byte targets, int32 [batch, seq_len] each, from random offsets."""
    starts = rng.integers(0, len(data) - seq_len - 1, size=batch)
    windows = np.stack([data[s:s + seq_len + 1] for s in starts]).astype(np.int32)
    return windows[:, :-1], windows[:, 1:]


def load_stdlib_documents(max_bytes: int) -> list:
    """The same source, one document (uint8 array) per file, for packed training."""
    documents = [np.frombuffer(data, dtype=np.uint8) for data in _stdlib_sources(max_bytes)
                 if len(data) > 1]
    _check_enough(sum(len(d) for d in documents))
    return documents


# How many times packed_batch draws the offsets of rows that hold too many documents.
_DRAWS = 1000


class DocumentStream:
    """Documents back to back, with each token's document index and its document's start, so
    that any window of the stream is a packed row: documents cut at the row's edges carry over
    into the next window, each one's positions restart at its first token in the row."""

    def __init__(self, documents):
        self.documents = documents
        self.tokens = np.concatenate(documents)
        lengths = np.array([len(d) for d in documents])
        self.document = np.repeat(np.arange(len(documents), dtype=np.int32), lengths)
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        self.start = np.repeat(starts, lengths)

    def packed_batch(self, batch: int, seq_len: int, rng: np.random.Generator,
                     max_documents: int | None = None):
        """Rows of seq_len tokens from random offsets: dict of int32 [batch, seq_len] arrays
        tokens, targets (next byte), weights (1 where the target is in the token's document),
        segment_ids (the document; the row's tokens attend within it) and positions (within
        the document's run in the row). max_documents: a row holding more documents is drawn
        again from another offset, so that the attention can be told the bound."""
        offsets = rng.integers(0, len(self.tokens) - seq_len - 1, size=batch)
        if max_documents is not None:
            self._redraw_crowded(offsets, seq_len, rng, max_documents)
        index = offsets[:, None] + np.arange(seq_len + 1)[None, :]
        document = self.document[index]
        positions = index[:, :-1] - np.maximum(self.start[index[:, :-1]], offsets[:, None])
        return dict(tokens=self.tokens[index[:, :-1]].astype(np.int32),
                    targets=self.tokens[index[:, 1:]].astype(np.int32),
                    weights=(document[:, 1:] == document[:, :-1]).astype(np.float32),
                    segment_ids=document[:, :-1], positions=positions.astype(np.int32))

    def _redraw_crowded(self, offsets, seq_len, rng, max_documents):
        """Draws again, in place, the offsets whose rows hold more than max_documents."""
        for _ in range(_DRAWS):
            crowded = self._documents_in(offsets, seq_len) > max_documents
            if not crowded.any():
                return
            offsets[crowded] = rng.integers(0, len(self.tokens) - seq_len - 1,
                                            size=int(crowded.sum()))
        raise ValueError(f"rows of {seq_len} tokens holding at most {max_documents} documents "
                         f"are too rare here ({_DRAWS} draws): raise max_documents")

    def _documents_in(self, offsets, seq_len):
        """int [rows]: how many documents the rows of seq_len tokens at these offsets hold
        (document indices rise by one from each document to the next along the stream)."""
        return self.document[offsets + seq_len - 1] - self.document[offsets] + 1

    def padded_batch(self, batch: int, seq_len: int, rng: np.random.Generator):
        """One document per row from its first token, cut at seq_len + 1 tokens and padded:
        the same dict, padding as segment id -1 with weight 0."""
        rows = {name: np.zeros((batch, seq_len), np.int32)
                for name in ("tokens", "targets", "positions")}
        rows["segment_ids"] = np.full((batch, seq_len), -1, np.int32)
        rows["weights"] = np.zeros((batch, seq_len), np.float32)
        for row, choice in enumerate(rng.integers(0, len(self.documents), size=batch)):
            document = self.documents[choice][:seq_len + 1]
            n = len(document) - 1
            rows["tokens"][row, :n] = document[:-1]
            rows["targets"][row, :n] = document[1:]
            rows["positions"][row, :n] = np.arange(n)
            rows["segment_ids"][row, :n] = 0
            rows["weights"][row, :n] = 1.0
        return rows
