"""The exact fallback of packed segment ids on cuDNN, for rows the document table cannot
express (a document split into runs, more documents than slots): blocks of query rows against
every key, each block one dense cuDNN call whose segment ids, band and lengths arrive as a
[B, 1, block, S] bias. Memory O(block x S), the block sized by _BIAS_ELEMENTS (a whole
[T, S] only where that is small); two cuDNN graphs whatever the ids, built when the fallback
first runs (not while tracing: most checked calls never run it; their workspace is scratch
memory), and no reference in the compiled program (its matmuls cost seconds of XLA autotuning
in every checked packed call, which compiles this branch beside its ragged ones).

The rows come out as the reference gives them (jax_sdpa/reference.py): a row that sees no key
is the mean of all values, rows past the query lengths and rows of an entry without keys are
zeros, their lse the empty row's.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jax_sdpa import _ffi
from jax_sdpa.reference_kernel import QueryBlocks
from jax_sdpa.reference import (combined_mask, fill_empty_rows, mask_to_bias, mean_value,
                                mean_value_gradient)

# Query rows per block: the block's bias and mask hold batch x block x S elements; about this
# many at most (a bfloat16 bias of 64 MiB), but never fewer rows than _MIN_BLOCK (or T): a
# call per handful of rows would spend its time launching.
_BIAS_ELEMENTS = 1 << 25
_MIN_BLOCK = 64


def _dense_spec(config):
    """The blocks' calls: the packed call's scale, determinism and dropout, every mask in the
    bias."""
    return dataclasses.replace(
        config, window_left=-1, window_right=-1, bottom_right=False, has_bias=True,
        bias_batch_full=True, bias_heads_full=False, bias_grad=False, has_lengths=False,
        same_lengths=False, segments="", max_segments=0, max_document_length=(),
        has_sinks=False)


def _blocks(inputs):
    batch, q_seq_len = inputs["query"].shape[:2]
    kv_seq_len = inputs["key"].shape[1]
    return QueryBlocks(q_seq_len, min(q_seq_len, max(_MIN_BLOCK,
                                                     _BIAS_ELEMENTS // (batch * kv_seq_len))))


def _block_inputs(inputs, q_block, seen, index):
    """A block's dense call: its queries, every key and value, the keys it sees as a bias, and
    with dropout a seed of its own (drawn from the call's and the block's index, so that blocks
    drop independently, and the backward's block drops what the forward's dropped)."""
    block = dict(query=q_block, key=inputs["key"], value=inputs["value"],
                 bias=mask_to_bias(seen, q_block.dtype))
    seed = inputs.get("dropout_seed")
    if seed is not None:
        key = jax.random.fold_in(jax.random.wrap_key_data(seed[:2]), index)
        block["dropout_seed"] = jnp.concatenate([jax.random.bits(key, (2,), jnp.uint32),
                                                 seed[2:]])
    return block


def _seen(config, inputs, blocks, ids_block, index):
    """bool [B, 1, block, S]: the keys each row of block `index` sees, and bool [B, 1, block]:
    whether the row holds the mean of all values if it sees none (within the query lengths,
    in an entry with keys), else zeros."""
    batch, q_seq_len = inputs["query"].shape[:2]
    kv_seq_len = inputs["key"].shape[1]
    block, first = blocks.size, index * blocks.size
    q_lengths, kv_lengths = inputs.get("q_lengths"), inputs.get("kv_lengths")
    if q_lengths is None:
        q_lengths = jnp.full((batch,), q_seq_len, jnp.int32)
    q_lengths = blocks.lengths(q_lengths, first)
    seen = combined_mask(
        block, kv_seq_len, query_seq_lengths=q_lengths, key_value_seq_lengths=kv_lengths,
        local_window_size=config.window(),
        diagonal_offset=config.diagonal_offset(q_seq_len, kv_seq_len) + first,
        query_segment_ids=ids_block,
        kv_segment_ids=inputs.get("kv_segment_ids", inputs["q_segment_ids"]))
    averaged = jnp.arange(block)[None, :] < q_lengths[:, None]
    if kv_lengths is not None:
        averaged &= (kv_lengths > 0)[:, None]
    return jnp.broadcast_to(seen, (batch, 1, block, kv_seq_len)), averaged[:, None, :]


def forward(config, inputs):
    """(output [B, T, N, Hv], lse float32 [B, N, T]) of a packed call's inputs (no sinks)."""
    query, value = inputs["query"], inputs["value"]
    q_heads = query.shape[2]
    blocks, dense = _blocks(inputs), _dense_spec(config)
    average = mean_value(q_heads, value)[:, None]  # [B, 1, N, Hv]

    def one_block(args):
        q_block, ids_block, index = args
        seen, averaged = _seen(config, inputs, blocks, ids_block, index)
        output, lse = _ffi.sdpa_forward(_block_inputs(inputs, q_block, seen, index), dense,
                                        workspace_for=False)
        empty = ~jnp.any(seen, axis=-1)  # [B, 1, block]
        output, lse = fill_empty_rows(output, lse, empty, average)
        zeros = jnp.swapaxes(empty & ~averaged, 1, 2)[..., None]  # [B, block, 1, 1]
        return jnp.where(zeros, jnp.zeros((), output.dtype), output), lse
    output, lse = jax.lax.map(one_block, (blocks.split(query), blocks.split(
        inputs["q_segment_ids"]), jnp.arange(blocks.count)))
    return blocks.join(output), blocks.join(lse, axis=2)


def backward(config, inputs, output, lse, d_output):
    """(dq, dk, dv, None): forward's gradients, given its output and lse (a sink attention's,
    as every cuDNN backward takes them: jax_sdpa/sink_softmax.py)."""
    query, key, value = inputs["query"], inputs["key"], inputs["value"]
    q_heads = query.shape[2]
    blocks, dense = _blocks(inputs), _dense_spec(config)

    def one_block(carry, args):
        dk_sum, dv_sum = carry
        q_block, ids_block, out_block, lse_block, d_out_block, index = args
        seen, averaged = _seen(config, inputs, blocks, ids_block, index)
        empty = ~jnp.any(seen, axis=-1)  # [B, 1, block]
        empty_rows = jnp.swapaxes(empty, 1, 2)[..., None]  # [B, block, 1, 1]
        # Rows that see no key are not cuDNN's to grade, and their lse (the empty row's, a
        # huge negative) must not reach its exp(scores - lse): 0 there, with no cotangent.
        dq, dk, dv, _ = _ffi.sdpa_backward(
            _block_inputs(inputs, q_block, seen, index), out_block,
            jnp.where(empty, 0.0, lse_block),
            jnp.where(empty_rows, jnp.zeros((), d_out_block.dtype), d_out_block), dense,
            workspace_for=False)
        mean_rows = jnp.swapaxes(empty & averaged, 1, 2)[..., None]
        dv_mean = mean_value_gradient(q_heads, value, jnp.where(mean_rows, d_out_block, 0))
        return (dk_sum + dk.astype(jnp.float32),
                dv_sum + dv.astype(jnp.float32) + dv_mean), dq
    zeros = lambda x: jnp.zeros(x.shape, jnp.float32)  # noqa: E731
    (dk, dv), dq = jax.lax.scan(one_block, (zeros(key), zeros(value)), (
        blocks.split(query), blocks.split(inputs["q_segment_ids"]), blocks.split(output),
        blocks.split(lse, axis=2), blocks.split(d_output.astype(output.dtype)),
        jnp.arange(blocks.count)))
    return blocks.join(dq), dk.astype(key.dtype), dv.astype(value.dtype), None
