"""The cuDNN path: our FFI forward and backward joined by jax.custom_vjp.

The forward's float32 stats (log-sum-exp per query row and head) are the residual the backward
consumes, so the backward never recomputes the softmax normaliser.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_sdpa import _ffi


@dataclasses.dataclass(frozen=True)
class CudnnOptions:
    """The static part of a cuDNN call (hashable: it keys traces and graphs)."""

    scale: float
    window_left: int = -1  # cuDNN's exclusive left bound: keys j > i - window_left; -1: none
    window_right: int = -1  # keys j <= i + window_right; 0 is causal; -1: none
    bias_grad: bool = False  # the bias is the user's (it has a gradient), not a mask's
    deterministic: bool = False


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def cudnn_attention(query, key, value, bias, q_lengths, kv_lengths, options: CudnnOptions):
    """[B..., T, N, H] x [B..., S, K, H] -> (output [B..., T, N, H], lse float32 [B..., N, T]).

    bias: None or [1|B, 1|N, T, S] in the query's dtype; q_lengths, kv_lengths: None or int32 [B].
    """
    return _ffi.sdpa_forward(query, key, value, bias, q_lengths, kv_lengths, options)


def _forward(query, key, value, bias, q_lengths, kv_lengths, options):
    output, stats = _ffi.sdpa_forward(query, key, value, bias, q_lengths, kv_lengths, options)
    return (output, stats), (query, key, value, bias, q_lengths, kv_lengths, output, stats)


def _integer_zero(x):
    return None if x is None else np.zeros(x.shape, jax.dtypes.float0)


def _backward(options, residuals, cotangents):
    query, key, value, bias, q_lengths, kv_lengths, output, stats = residuals
    # The log-sum-exp is returned under stop_gradient, as jax.nn does: its cotangent is dropped.
    d_output, _ = cotangents
    dq, dk, dv, dbias = _ffi.sdpa_backward(query, key, value, bias, q_lengths, kv_lengths,
                                           output, stats, d_output, options)
    if bias is not None and dbias is None:
        dbias = jnp.zeros_like(bias)  # a mask's bias: nothing upstream needs its gradient
    return dq, dk, dv, dbias, _integer_zero(q_lengths), _integer_zero(kv_lengths)


cudnn_attention.defvjp(_forward, _backward)


def mask_to_bias(mask, dtype):
    """Boolean mask (True = attend) -> additive bias: 0 where attended, a large negative number
    elsewhere, with room left to add a user's bias without overflowing the dtype."""
    return jnp.where(mask, 0.0, -0.5 * float(jnp.finfo(dtype).max)).astype(dtype)


def run(call, deterministic: bool):
    """Runs a validated AttentionCall on cuDNN: (output [B, T, N, H], lse [B, N, T])."""
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
    left, right = -1, -1
    if call.local_window_size is not None:
        left, right = call.local_window_size[0] + 1, call.local_window_size[1]
    if call.is_causal:
        right = 0
    options = CudnnOptions(scale=call.scale, window_left=left, window_right=right,
                           bias_grad=call.bias is not None, deterministic=deterministic)
    return cudnn_attention(call.query, call.key, call.value, bias, q_lengths, kv_lengths, options)
