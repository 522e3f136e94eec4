"""The cuDNN path: our FFI forward and backward joined by jax.custom_vjp.

The forward's float32 stats (log-sum-exp per query row and head) are the residual the backward
consumes, so the backward never recomputes the softmax normaliser.
"""

from __future__ import annotations

import functools

import jax

from jax_sdpa import _ffi


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def cudnn_attention(query, key, value, scale: float, is_causal: bool):
    """[B..., T, N, H] x [B..., S, K, H] -> (output [B..., T, N, H], lse float32 [B..., N, T])."""
    return _ffi.sdpa_forward(query, key, value, scale=scale, is_causal=is_causal)


def _forward(query, key, value, scale, is_causal):
    output, stats = _ffi.sdpa_forward(query, key, value, scale=scale, is_causal=is_causal)
    return (output, stats), (query, key, value, output, stats)


def _backward(scale, is_causal, residuals, cotangents):
    query, key, value, output, stats = residuals
    # The log-sum-exp is returned under stop_gradient, as jax.nn does: its cotangent is dropped.
    d_output, _ = cotangents
    return _ffi.sdpa_backward(query, key, value, output, stats, d_output,
                              scale=scale, is_causal=is_causal)


cudnn_attention.defvjp(_forward, _backward)
