"""Masks as data: descriptions of which keys each query sees, passed as
``dot_product_attention(..., mask=m)`` next to boolean arrays.

A description knows its structure, so it costs what it keeps: those cuDNN's own masks express
(``causal``, ``sliding_window``, ``documents``, and their intersections) run as those masks;
the others whose kept keys are known at trace time (``prefix_lm``, ``global_tokens``, windows
per head, their unions and intersections, ``block_table`` and ``from_boolean`` arrays) are cut
into a few rectangles our dense kernels run at their own cost (jax_sdpa/pieces/), where they cut
into few; past that, those that test positions only run as a score_mod tested inside cuDNN's
kernel (the dense cost, no ``[T, S]`` array) and the rest (``documents`` in a union, say) as
their boolean form (the dense cost and its array). ``explain(mask)`` says which. Every
description also gives its boolean form (``to_boolean``), the oracle the reference path and the
tests read.

Positions are the rows' own: query ``i`` and key ``j`` count from 0 at the top-left of the
``[T, S]`` score matrix.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import operator

import jax.numpy as jnp
import numpy as np

_UNBOUNDED = 1 << 30


class Mask:
    """Which keys each query sees (True = attend). Combine with ``|`` and ``&``."""

    def keep(self, batch: int, q_seq_len: int, kv_seq_len: int):
        """bool array broadcastable to [B, N, T, S] (rank 4). A description that tests
        positions only says it once, in elementwise(); this evaluates that over the positions
        (a batch-independent [1, N|1, T, S])."""
        i, j = _positions(q_seq_len, kv_seq_len)
        head = np.arange(self.heads() or 1).reshape(1, -1, 1, 1)
        return self.elementwise()(0, head, i, j)

    def native(self) -> dict | None:
        """dot_product_attention keywords that express this mask with cuDNN's own masks, or
        None."""
        return None

    def elementwise(self):
        """keep(batch, head, q_index, kv_index) -> bool on scalars (what keep() says, as a
        score_mod can test it inside cuDNN's kernel), or None where the mask reads arrays."""
        return None

    def heads(self) -> int | None:
        """The query heads a per-head description is written for, or None (any)."""
        return None

    def to_boolean(self, q_seq_len: int, kv_seq_len: int, batch: int = 1):
        """The boolean form, [B|1, N|1, T, S]."""
        return jnp.asarray(self.keep(batch, q_seq_len, kv_seq_len), bool)

    def block_table(self, q_seq_len, kv_seq_len, tile_q=128, tile_k=128, batch=1):
        """bool [B|1, N|1, ceil(T / tile_q), ceil(S / tile_k)]: the tiles that keep any
        element (the work a kernel that skips empty tiles does)."""
        keep = np.asarray(self.to_boolean(q_seq_len, kv_seq_len, batch))
        rows, cols = math.ceil(q_seq_len / tile_q), math.ceil(kv_seq_len / tile_k)
        padded = np.zeros((*keep.shape[:2], rows * tile_q, cols * tile_k), bool)
        padded[..., :q_seq_len, :kv_seq_len] = keep
        return padded.reshape(*keep.shape[:2], rows, tile_q, cols, tile_k).any(axis=(3, 5))

    def density(self, q_seq_len, kv_seq_len, batch=1) -> float:
        """The share of the [T, S] scores kept."""
        return float(np.asarray(self.to_boolean(q_seq_len, kv_seq_len, batch)).mean())

    def __or__(self, other):
        return Union(_as_mask(self), _as_mask(other))

    def __and__(self, other):
        return Intersection(_as_mask(self), _as_mask(other))


def _positions(q_seq_len, kv_seq_len):
    return (np.arange(q_seq_len)[None, None, :, None], np.arange(kv_seq_len)[None, None, None, :])


@dataclasses.dataclass(frozen=True)
class Causal(Mask):
    """Query i sees keys 0..i (top-left, as is_causal)."""

    def native(self):
        return dict(is_causal=True)

    def elementwise(self):
        return lambda b, h, i, j: j <= i


@dataclasses.dataclass(frozen=True)
class SlidingWindow(Mask):
    """Query i sees keys i - left .. i + right (inclusive, as local_window_size); left and
    right ints, or tuples of ints with one per query head."""

    left: int | tuple
    right: int | tuple

    def heads(self):
        sizes = {len(bound) for bound in (self.left, self.right) if isinstance(bound, tuple)}
        return sizes.pop() if sizes else None

    def elementwise(self):
        def bound(value, head):  # a per-head bound is a table of the head
            return jnp.asarray(value, jnp.int32)[head] if isinstance(value, tuple) else value
        return lambda b, h, i, j: (j >= i - bound(self.left, h)) & (j <= i + bound(self.right, h))

    def native(self):
        if self.heads() is not None:
            return None  # cuDNN's band is one for every head
        return dict(local_window_size=(self.left, self.right))


@dataclasses.dataclass(frozen=True, eq=False)
class Documents(Mask):
    """A query sees the keys of its own document: int32 ids [B, T] and [B, S] (the keys' the
    queries' when omitted, T = S), as query_segment_ids / kv_segment_ids."""

    query_segment_ids: object
    kv_segment_ids: object = None

    def keep(self, batch, q_seq_len, kv_seq_len):
        q_ids = jnp.asarray(self.query_segment_ids)
        kv_ids = q_ids if self.kv_segment_ids is None else jnp.asarray(self.kv_segment_ids)
        return q_ids[:, None, :, None] == kv_ids[:, None, None, :]

    def native(self):
        return dict(query_segment_ids=self.query_segment_ids, kv_segment_ids=self.kv_segment_ids)


@dataclasses.dataclass(frozen=True)
class PrefixLM(Mask):
    """Every query sees the keys before prefix_length, and is causal after."""

    prefix_length: int

    def elementwise(self):
        return lambda b, h, i, j: (j < self.prefix_length) | (j <= i)


@dataclasses.dataclass(frozen=True)
class GlobalTokens(Mask):
    """The first n queries see every key, and every query sees the first n keys."""

    n: int

    def elementwise(self):
        # one comparison: the same test as (i < n) | (j < n), whose LOGICAL_OR of two
        # comparisons against n killed cuDNN 9.19 while it built the graph (GPU fuzz)
        return lambda b, h, i, j: jnp.minimum(i, j) < self.n


@dataclasses.dataclass(frozen=True, eq=False)
class BlockTable(Mask):
    """bool [ceil(T / tile_q), ceil(S / tile_k)] (or [N, ...], [B, N, ...]): True = the tile
    is computed, whole."""

    table: object
    tile_q: int
    tile_k: int

    def keep(self, batch, q_seq_len, kv_seq_len):
        table = jnp.asarray(self.table, bool)
        rows, cols = math.ceil(q_seq_len / self.tile_q), math.ceil(kv_seq_len / self.tile_k)
        if table.shape[-2:] != (rows, cols):
            raise ValueError(f"block_table's table must end in [ceil(T / tile_q), ceil(S / "
                             f"tile_k)] = [{rows}, {cols}], got {table.shape}")
        table = table.reshape((1,) * (4 - table.ndim) + table.shape)
        return jnp.repeat(jnp.repeat(table, self.tile_q, axis=2)[:, :, :q_seq_len],
                          self.tile_k, axis=3)[..., :kv_seq_len]


@dataclasses.dataclass(frozen=True, eq=False)
class FromBoolean(Mask):
    """A boolean array broadcastable to [B, N, T, S] ([T, S] and [N, T, S] too)."""

    mask: object

    def keep(self, batch, q_seq_len, kv_seq_len):
        mask = jnp.asarray(self.mask, bool)
        return mask.reshape((1,) * (4 - mask.ndim) + mask.shape)


@dataclasses.dataclass(frozen=True, eq=False)
class _Combined(Mask):
    """Two masks joined elementwise by the subclass's `join` (written for the same heads, if
    per head)."""

    a: Mask
    b: Mask

    def __post_init__(self):
        self.heads()

    def keep(self, batch, q_seq_len, kv_seq_len):
        return self.join(self.a.keep(batch, q_seq_len, kv_seq_len),
                         self.b.keep(batch, q_seq_len, kv_seq_len))

    def elementwise(self):
        a, b = self.a.elementwise(), self.b.elementwise()
        if a is None or b is None:
            return None
        return lambda *where: self.join(a(*where), b(*where))

    def heads(self):
        sizes = {n for n in (self.a.heads(), self.b.heads()) if n is not None}
        if len(sizes) > 1:
            raise ValueError(f"masks written for {sorted(sizes)} heads cannot be combined")
        return sizes.pop() if sizes else None


class Union(_Combined):
    """Keys either mask keeps."""

    join = staticmethod(operator.or_)


class Intersection(_Combined):
    """Keys both masks keep: cuDNN's own masks where both parts are (one window at most, one
    set of documents at most)."""

    join = staticmethod(operator.and_)

    def native(self):
        a, b = self.a.native(), self.b.native()
        if a is None or b is None:
            return None
        merged = dict(a)
        for name, value in b.items():
            if name not in merged:
                merged[name] = value
            elif name == "local_window_size":
                (left_a, right_a), (left_b, right_b) = merged[name], value
                merged[name] = (min(left_a, left_b), min(right_a, right_b))
            elif name != "is_causal":
                return None  # two sets of documents: no single pair of id arrays says it
        return merged


def value_key(mask: Mask):
    """A hashable value of everything the description holds (the digest of each array's
    bytes, never the array), or None where an array is not concrete (traced): two descriptions
    of the same values have the same key, and an array changed in place gives another."""
    def key(value):
        if isinstance(value, Mask):
            fields = tuple(key(getattr(value, f.name)) for f in dataclasses.fields(value))
            return None if None in fields else (type(value).__name__, fields)
        if isinstance(value, tuple):
            items = tuple(key(item) for item in value)
            return None if None in items else items
        if isinstance(value, (int, float, str, bool, type(None))):
            return ("scalar", value)
        try:
            array = np.ascontiguousarray(np.asarray(value))
        except Exception:  # noqa: BLE001 - a tracer (values known only when the call runs)
            return None
        digest = hashlib.blake2b(array.tobytes(), digest_size=16).hexdigest()
        return ("array", array.shape, array.dtype.str, digest)
    return key(mask)


def _as_mask(value) -> Mask:
    if isinstance(value, Mask):
        return value
    return from_boolean(value)


def _boolean(array, name):
    """array, refused unless boolean: a float bias or 0/1 ints read as booleans would be
    silently wrong."""
    dtype = getattr(array, "dtype", None)
    if dtype is None:
        dtype = np.asarray(array).dtype
    if np.ndim(array) > 4:
        raise ValueError(f"{name} must have rank <= 4, got shape {np.shape(array)}")
    if dtype != np.bool_:
        raise TypeError(f"{name} must be boolean (True = attend), got {dtype}")
    return array


def _bound(value, name, least=0):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < least:
        raise ValueError(f"{name} must be an int >= {least}, got {value!r}")
    return int(value)


def _bounds(value, name):
    """An int bound, or a tuple of them (one per head)."""
    if isinstance(value, (int, np.integer)):  # bool too: _bound names it
        return _bound(value, name)
    values = tuple(np.asarray(value).reshape(-1).tolist())
    if np.asarray(value).ndim != 1 or not values:
        raise ValueError(f"{name} must be an int >= 0 or a sequence of them (one per query "
                         f"head), got {value!r}")
    return tuple(_bound(v, f"{name}[{i}]") for i, v in enumerate(values))


def causal() -> Mask:
    """Query i sees keys 0..i (top-left, as is_causal=True)."""
    return Causal()


def sliding_window(left, right=0) -> Mask:
    """Query i sees keys i - left .. i + right (as local_window_size=(left, right)). Per head:
    left and/or right a sequence of ints, one per query head (run as a score_mod on cuDNN)."""
    return SlidingWindow(_bounds(left, "left"), _bounds(right, "right"))


def documents(query_segment_ids, kv_segment_ids=None) -> Mask:
    """Queries see the keys of their own document (as query_segment_ids / kv_segment_ids)."""
    return Documents(query_segment_ids, kv_segment_ids)


def prefix_lm(prefix_length: int) -> Mask:
    """Every query sees the keys before prefix_length; after it, causal."""
    return PrefixLM(_bound(prefix_length, "prefix_length"))


def global_tokens(n: int) -> Mask:
    """The first n queries see every key, and every query sees the first n keys."""
    return GlobalTokens(_bound(n, "n"))


def block_table(table, tile_q: int, tile_k: int) -> Mask:
    """Tiles of tile_q queries by tile_k keys, computed where the boolean table is True."""
    return BlockTable(_boolean(table, "block_table's table"), _bound(tile_q, "tile_q", 1),
                      _bound(tile_k, "tile_k", 1))


def from_boolean(mask) -> Mask:
    """A boolean array broadcastable to [B, N, T, S]; True = attend."""
    return FromBoolean(_boolean(mask, "mask"))


_NATIVE_KEYWORDS = ("is_causal", "local_window_size", "query_segment_ids", "kv_segment_ids")


def native_keywords(mask: Mask, keywords: dict, causal_alignment: str) -> dict | None:
    """The call's keywords (is_causal, local_window_size, segment ids) with the description
    merged in as cuDNN's own masks, where they say it exactly (top-left alignment, and no window
    or ids of the call's own to merge with); else None (the boolean form is needed)."""
    native = mask.native()
    if native is None or causal_alignment != "top_left":
        return None
    taken = {name for name in _NATIVE_KEYWORDS if keywords.get(name) not in (None, False)}
    wanted = {name for name, value in native.items() if value is not None}
    if taken & wanted - {"is_causal"}:
        return None
    return {**keywords, **{name: native[name] for name in wanted}}


def as_score_mod(mask: Mask, score_mod=None):
    """The mask as a score_mod (composed after the user's own, if any): a -inf score where it
    hides the key, which cuDNN's kernels test per element with no [T, S] array; None where the
    mask reads arrays (documents, block tables, booleans)."""
    keep = _as_mask(mask).elementwise()
    if keep is None:
        return None

    def masked(score, batch, head, q_index, kv_index):
        if score_mod is not None:
            score = score_mod(score, batch, head, q_index, kv_index)
        return jnp.where(keep(batch, head, q_index, kv_index), score, -jnp.inf)
    return masked


def explain(mask: Mask) -> str:
    """How dot_product_attention runs a mask on cuDNN: as cuDNN's own masks (their keywords);
    cut into pieces at trace time, where its kept keys cut into few rectangles that our dense
    kernels run at their own cost (jax_sdpa.explain of a call says how many, and their share
    of the dense work); else as a score_mod (each element tested inside cuDNN's kernel: dense
    cost, no [T, S] array) or a boolean [B, N, T, S] mask (dense cost)."""
    mask = _as_mask(mask)
    native = mask.native()
    if native is not None and not set(native) - {"is_causal", "local_window_size"}:
        window = native.get("local_window_size")
        if window is not None and window[1] > 0 and not native.get("is_causal"):
            return (f"cuDNN's own masks: local_window_size={window!r} (forward); its backward "
                    f"in pieces (cuDNN's backward skips no tile of a band with a right bound)")
    if native is not None:
        given = {name: value for name, value in native.items() if value is not None}
        return "cuDNN's own masks: " + ", ".join(
            f"{name}={value!r}" if not hasattr(value, "shape") else
            f"{name}=<{value.shape} array>" for name, value in given.items())
    fallback = ("a score_mod testing each element inside cuDNN's kernel (dense cost, no [T, S] "
                "array)" if mask.elementwise() is not None else
                "a boolean mask formed from the description (dense cost)")
    if _structured(mask):
        return (f"pieces: its rows' kept keys cut into rectangles our dense kernels run at their "
                f"own cost, where they are few at the call's sizes; else {fallback}")
    return fallback


def _structured(mask) -> bool:
    """Whether the description's kept keys are known at trace time (no documents)."""
    if isinstance(mask, _Combined):
        return _structured(mask.a) and _structured(mask.b)
    return not isinstance(mask, Documents)
