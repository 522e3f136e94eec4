"""Decode steps (one new token per sequence) split along the keys for cuDNN's paged forward.

cuDNN's SDPA forward gives each (sequence, query head) its own tiles of query rows and walks that
sequence's keys in one tile. A decode step has one query row per head, so a small batch runs
B x N tiles, fewer than the GPU's SMs can overlap, each reading a long run of pages. Split: each
sequence's pages are cut into S chunks that run as separate batch entries (their own slices of
the page table, their own lengths), and the partial outputs are merged with their log-sum-exps
(flash-decoding). Exact for one query per sequence without a window (every chunk's keys are
then wholly seen or wholly past the sequence's length).

Folding the g query heads of a K/V head into g query rows of that head (GQA packing, as
flash-attn's decode kernels do) was measured and is slower on cuDNN 9.19 at every decode
configuration of benchmarks/paged.py (1.02x-1.8x: fewer tiles in flight), so it is not done.

The split count comes from static shapes and the GPU's SM count.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

# Enough tiles for two waves over the SMs before splitting stops paying; chunks shorter than
# this many keys cost more in merging than they win in parallelism.
WAVES = 2
MIN_CHUNK_KEYS = 512
FALLBACK_SM_COUNT = 132  # an H100 / H200, where the device does not say


@dataclasses.dataclass(frozen=True)
class DecodeLayout:
    splits: int = 1  # chunks of pages per sequence, merged by log-sum-exp


PLAIN = DecodeLayout()


def sm_count():
    device = jax.devices()[0]
    return int(getattr(device, "core_count", 0) or FALLBACK_SM_COUNT)


def choose(batch, q_seq_len, q_heads, max_pages, page_size, windowed, sms=None):
    """The layout for one call: PLAIN unless it is a decode step (T = 1) without a window
    whose B x N tiles would leave the GPU under WAVES waves."""
    if q_seq_len != 1 or windowed:
        return PLAIN
    wanted = -(-WAVES * (sms or sm_count()) // (batch * q_heads))
    longest = max_pages // max(1, -(-MIN_CHUNK_KEYS // page_size))
    splits = max(1, min(wanted, longest))
    # Whole pages per chunk; no chunk made only of padding.
    chunk_pages = -(-max_pages // splits)
    return DecodeLayout(splits=-(-max_pages // chunk_pages))


def split_pages(query, page_table, kv_lengths, splits, page_size):
    """Chunk s of sequence b becomes batch entry b * splits + s: its slice of the page table
    (padded with page 0, which its length masks) and its keys' count. Returns (query,
    page_table, kv_lengths) for that batch."""
    batch, max_pages = page_table.shape
    chunk_pages = -(-max_pages // splits)
    table = jnp.pad(page_table, ((0, 0), (0, splits * chunk_pages - max_pages)))
    chunk_keys = chunk_pages * page_size
    starts = jnp.arange(splits, dtype=jnp.int32) * chunk_keys
    lengths = jnp.clip(kv_lengths[:, None] - starts[None, :], 0, chunk_keys)
    return (jnp.repeat(query, splits, axis=0), table.reshape(batch * splits, chunk_pages),
            lengths.reshape(batch * splits))


def merge_chunks(output, stats, chunk_lengths, splits):
    """The chunks' partial results combined: output [B * S, T, N, Hv] and stats [B * S, N, T]
    (each chunk's log-sum-exp) -> [B, T, N, Hv] and [B, N, T]. A chunk with no keys counts for
    nothing, whatever cuDNN left in it; a row with no key at all gets zeros and -inf."""
    chunks, q_seq_len, heads, value_dim = output.shape
    batch = chunks // splits
    seen = (chunk_lengths > 0).reshape(batch, splits, 1, 1)
    stats = jnp.where(seen, stats.reshape(batch, splits, heads, q_seq_len), -jnp.inf)
    total = jax.nn.logsumexp(stats, axis=1)  # [B, N, T]
    finite_total = jnp.where(jnp.isfinite(total), total, 0.0)
    weights = jnp.where(seen, jnp.exp(stats - finite_total[:, None]), 0.0)
    partial = output.reshape(batch, splits, q_seq_len, heads, value_dim).astype(jnp.float32)
    partial = jnp.where(seen[..., None], partial, 0.0)
    # Elementwise, in float32 (a dot here could run in TF32).
    merged = jnp.sum(weights.transpose(0, 1, 3, 2)[..., None] * partial, axis=1)
    return merged.astype(output.dtype), total
