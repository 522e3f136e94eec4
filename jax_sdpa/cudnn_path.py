"""The cuDNN path: our FFI forward and backward joined by jax.custom_vjp.

The forward's float32 stats (log-sum-exp per query row and head) are the residual the backward
consumes, so the backward never recomputes the softmax normaliser. With dropout, the forward and
backward get the same Philox seed, so the backward drops exactly what the forward dropped.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_sdpa import partitioning
from jax_sdpa.reference import combined_mask, large_negative


@dataclasses.dataclass(frozen=True)
class CudnnOptions:
    """The static part of a cuDNN call (hashable: it keys traces and graphs)."""

    scale: float
    window_left: int = -1  # cuDNN's exclusive left bound: keys j > i - window_left; -1: none
    window_right: int = -1  # keys j <= i + window_right; 0 is causal; -1: none
    bottom_right: bool = False  # the band is measured from the bottom-right corner (cuDNN's)
    bias_grad: bool = False  # the bias is the user's (it has a gradient), not a mask's
    deterministic: bool = False
    dropout: float = 0.0  # probability of dropping a weight; > 0 needs a dropout seed
    kernel: str = "cudnn"  # or "reference": the reference path, to test sharding on any backend


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def cudnn_attention(query, key, value, bias, q_lengths, kv_lengths, dropout_seed,
                    options: CudnnOptions):
    """[B..., T, N, H] x [B..., S, K, H] x [B..., S, K, Hv]
    -> (output [B..., T, N, Hv], lse float32 [B..., N, T]).

    bias: None or [1|B, 1|N, T, S] in the query's dtype; q_lengths, kv_lengths: None or int32 [B];
    dropout_seed: None or uint32 [4] (Philox seed, then offset, as two int64) when dropout > 0.
    """
    return partitioning.sdpa_forward(query, key, value, bias, q_lengths, kv_lengths, dropout_seed,
                             options)


def _forward(query, key, value, bias, q_lengths, kv_lengths, dropout_seed, options):
    output, stats = partitioning.sdpa_forward(query, key, value, bias, q_lengths, kv_lengths,
                                      dropout_seed, options)
    residuals = (query, key, value, bias, q_lengths, kv_lengths, dropout_seed, output, stats)
    return (output, stats), residuals


def _integer_zero(x):
    return None if x is None else np.zeros(x.shape, jax.dtypes.float0)


def _backward(options, residuals, cotangents):
    query, key, value, bias, q_lengths, kv_lengths, dropout_seed, output, stats = residuals
    # The log-sum-exp is returned under stop_gradient, as jax.nn does: its cotangent is dropped.
    d_output, _ = cotangents
    dq, dk, dv, dbias = partitioning.sdpa_backward(query, key, value, bias, q_lengths, kv_lengths,
                                           dropout_seed, output, stats, d_output, options)
    if bias is not None and dbias is None:
        dbias = jnp.zeros_like(bias)  # a mask's bias: nothing upstream needs its gradient
    return (dq, dk, dv, dbias, _integer_zero(q_lengths), _integer_zero(kv_lengths),
            _integer_zero(dropout_seed))


cudnn_attention.defvjp(_forward, _backward)


def mask_to_bias(mask, dtype):
    """Boolean mask (True = attend) -> additive bias: 0 where attended, a large negative number
    elsewhere, with room left to add a user's bias without overflowing the dtype."""
    return jnp.where(mask, 0.0, -0.5 * float(jnp.finfo(dtype).max)).astype(dtype)


def dropout_seed(rng):
    """uint32 [4] holding cuDNN's Philox seed (64 random bits from the key) and offset (0)."""
    return jnp.concatenate([jax.random.bits(rng, (2,), jnp.uint32), jnp.zeros((2,), jnp.uint32)])


@dataclasses.dataclass(frozen=True)
class Band:
    """The causal/window band in cuDNN's terms (see CudnnOptions)."""

    left: int = -1
    right: int = -1
    bottom_right: bool = False


def diagonal_band(call) -> tuple[Band | None, str | None]:
    """(the band cuDNN runs for this call, None) or (None, why cuDNN cannot run it).

    A bottom-right band is shifted onto the top-left diagonal where the shifted bounds stay
    valid (this also works with a bias and dropout, which cuDNN's own bottom-right alignment
    refuses); otherwise cuDNN's bottom-right alignment is used where it applies."""
    left, right = call.local_window_size or (None, None)
    if call.is_causal:
        right = 0 if right is None else min(right, 0)
    if left is None and right is None:
        return Band(), None
    batch, q_seq_len = call.query.shape[:2]
    kv_seq_len = call.key.shape[1]
    has_lengths = call.query_seq_lengths is not None or call.key_value_seq_lengths is not None
    offset = call.diagonal_offset
    shifted_left = None if left is None else left - offset
    shifted_right = None if right is None else right + offset
    if (shifted_left is None or shifted_left >= 0) and (shifted_right is None or
                                                          shifted_right >= 0):
        band = Band(-1 if left is None else shifted_left + 1,
                    -1 if right is None else shifted_right)
    elif (call.bias is None and call.mask is None and call.dropout_rate == 0.0 and
          not has_lengths and q_seq_len <= kv_seq_len):
        band = Band(-1 if left is None else left + 1, -1 if right is None else right, True)
    else:
        return None, ("causal_alignment='bottom_right' with these sequence lengths "
                      f"(T={q_seq_len}, S={kv_seq_len}) and window needs a band cuDNN does not "
                      "offer together with a bias, mask, dropout or sequence lengths")
    if band.left >= 0 and q_seq_len > kv_seq_len and not has_lengths:
        return None, (f"cuDNN's sliding window needs T <= S without sequence lengths (T="
                      f"{q_seq_len}, S={kv_seq_len})")
    return band, None


def _may_hide_whole_rows(call) -> bool:
    """Whether some query row may see no key at all. A causal or windowed row always sees its
    diagonal key when cuDNN runs it (T <= S for windows, or padding mode), unless key lengths
    cut that key off; masks (and segment ids) can hide anything."""
    has_lengths = call.query_seq_lengths is not None or call.key_value_seq_lengths is not None
    return call.mask is not None or (call.local_window_size is not None and has_lengths)


def _rows_seeing_nothing(call):
    """[B|1, N|1, T] bool: rows whose every key is hidden by the mask, causal, window or the
    key/value lengths."""
    q_seq_len, kv_seq_len = call.query.shape[1], call.key.shape[1]
    keep = combined_mask(q_seq_len, kv_seq_len, mask=call.mask, is_causal=call.is_causal,
                         local_window_size=call.local_window_size,
                         key_value_seq_lengths=call.key_value_seq_lengths,
                         diagonal_offset=call.diagonal_offset)
    return ~jnp.any(keep, axis=-1)


def _uniform_rows(call, output, lse):
    """Rows that see no key get the plain average of all values, as the reference path (and
    jax.nn) give. cuDNN disagrees there: a mask reaches it as a finite bias that in float16
    does not swamp the scores, and rows emptied by padding are left to the kernel. The where
    also sends those rows a zero cotangent, so the backward matches the reference's
    gradient."""
    batch, q_seq_len, q_heads, _ = call.query.shape
    kv_heads = call.key.shape[2]
    empty = _rows_seeing_nothing(call)  # [B|1, N|1, T]
    mean_value = jnp.mean(call.value.astype(jnp.float32), axis=1)  # [B, K, Hv]
    mean_value = jnp.repeat(mean_value, q_heads // kv_heads, axis=1)  # [B, N, Hv]
    empty_btn = jnp.swapaxes(empty, 1, 2)[..., None]  # [B|1, T, N|1, 1]
    output = jnp.where(empty_btn, mean_value[:, None].astype(output.dtype), output)
    if call.query_seq_lengths is not None:
        valid = jnp.arange(q_seq_len)[None, :] < call.query_seq_lengths[:, None]
        output = output * valid[:, :, None, None].astype(output.dtype)
    if call.key_value_seq_lengths is not None:
        output = output * (call.key_value_seq_lengths > 0)[:, None, None, None].astype(
            output.dtype)
    lse = jnp.where(empty, large_negative(), lse)
    return output, lse


def run(call, deterministic: bool, band: Band):
    """Runs a validated AttentionCall on cuDNN: (output [B, T, N, Hv], lse [B, N, T])."""
    dtype = call.query.dtype
    batch, q_seq_len, _, _ = call.query.shape
    kv_seq_len = call.key.shape[1]
    bias = None if call.bias is None else call.bias.astype(dtype)
    if call.mask is not None:
        mask_bias = mask_to_bias(call.mask, dtype)
        bias = mask_bias if bias is None else bias + mask_bias
    if bias is not None:  # cuDNN broadcasts batch and heads, not the score axes
        bias = jnp.broadcast_to(bias, (*bias.shape[:2], q_seq_len, kv_seq_len))
    q_lengths, kv_lengths = call.query_seq_lengths, call.key_value_seq_lengths
    if q_lengths is not None or kv_lengths is not None:
        full = lambda n: jnp.full((batch,), n, jnp.int32)  # noqa: E731
        q_lengths = full(q_seq_len) if q_lengths is None else q_lengths
        kv_lengths = full(kv_seq_len) if kv_lengths is None else kv_lengths
    seed = dropout_seed(call.dropout_rng) if call.dropout_rate > 0.0 else None
    options = CudnnOptions(scale=call.scale, window_left=band.left, window_right=band.right,
                           bottom_right=band.bottom_right, bias_grad=call.bias is not None,
                           deterministic=deterministic, dropout=call.dropout_rate)
    output, lse = cudnn_attention(call.query, call.key, call.value, bias, q_lengths, kv_lengths,
                                  seed, options)
    if _may_hide_whole_rows(call):
        output, lse = _uniform_rows(call, output, lse)
    return output, lse
