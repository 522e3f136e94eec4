"""The reference path behind the cuDNN kernels' calling convention (CudnnOptions' band, a bias
that already holds the mask, stats as the forward's residual).

It lets the sharding rules (jax_sdpa.partitioning) run, and be tested, on any backend: CI checks
on 8 CPU devices that a sharded call compiles to per-device kernels with no collectives, with
exactly the code path the GPU runs, only the kernel swapped."""

from __future__ import annotations

import jax

from jax_sdpa.reference import attention_reference

_UNBOUNDED = 1 << 30  # a window bound no sequence reaches


def _window(options):
    if options.window_left < 0 and options.window_right < 0:
        return None
    # cuDNN's left bound is exclusive (keys j > i - left); the reference's is inclusive.
    left = options.window_left - 1 if options.window_left >= 0 else _UNBOUNDED
    right = options.window_right if options.window_right >= 0 else _UNBOUNDED
    return left, right


def forward(query, key, value, bias, q_lengths, kv_lengths, dropout_seed, options):
    """(output [B, T, N, Hv], stats float32 [B, N, T]), as _ffi.sdpa_forward."""
    offset = key.shape[1] - query.shape[1] if options.bottom_right else 0
    rng = None
    if dropout_seed is not None:  # seed words, then the offset's low word (a shard's index)
        rng = jax.random.fold_in(jax.random.wrap_key_data(dropout_seed[:2]), dropout_seed[2])
    return attention_reference(query, key, value, bias, None, scale=options.scale,
                               query_seq_lengths=q_lengths, key_value_seq_lengths=kv_lengths,
                               local_window_size=_window(options), diagonal_offset=offset,
                               dropout_rate=options.dropout, dropout_rng=rng)


def backward(query, key, value, bias, q_lengths, kv_lengths, dropout_seed, output, stats,
             d_output, options):
    """(dq, dk, dv, dbias or None), as _ffi.sdpa_backward; recomputes the forward."""
    del output, stats

    def primal(query, key, value, bias):
        return forward(query, key, value, bias, q_lengths, kv_lengths, dropout_seed,
                       options)[0]
    _, vjp = jax.vjp(primal, query, key, value, bias)
    dq, dk, dv, dbias = vjp(d_output.astype(query.dtype))
    return dq, dk, dv, dbias if (bias is not None and options.bias_grad) else None
