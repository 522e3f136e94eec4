"""The exact fallback of packed segment ids on cuDNN, for rows the document table cannot
express (a document split into runs, more documents than slots): one dense cuDNN call over
every key whose score modifier masks the keys of other ids (the segment_mask attribute:
the ids go in as int32 [B, T] and [B, S], compared inside cuDNN's kernel), with the band and
the lengths in the same modifier. Memory O(T), no matmul or mask of ours in the program (a
checked packed call compiles this branch beside its ragged ones), and its graphs are built
when it first runs, not while tracing: most checked calls never run it (their workspace is
scratch memory).

The rows come out as the reference gives them (jax_sdpa/reference/empty_rows.py): a row that
sees no key is the mean of all values, rows past the query lengths and rows of an entry without
keys are zeros, their lse the empty row's. cuDNN leaves such a row non-finite (every score -inf).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jax_sdpa.cudnn import dense
from jax_sdpa.reference import empty_rows
from jax_sdpa.reference.attention import large_negative


def masked_spec(spec):
    """The dense call: the packed call's masks and dropout, with its ids as a segment mask."""
    return dataclasses.replace(spec, segments="cross", max_segments=0,
                               max_document_length=(), has_sinks=False)


def masked_inputs(inputs):
    """The dense call's operands: keys carry their own ids ("cross") or the queries'."""
    return dict(inputs, kv_segment_ids=inputs.get("kv_segment_ids", inputs["q_segment_ids"]))


def _averaged_rows(inputs):
    batch, q_seq_len = inputs["query"].shape[:2]
    return empty_rows.averaged_rows(batch, q_seq_len, inputs.get("q_lengths"),
                                    inputs.get("kv_lengths"))


def forward(spec, inputs):
    """(output [B, T, N, Hv], lse float32 [B, N, T]) of a packed call's inputs (no sinks)."""
    output, lse = dense.forward(masked_inputs(inputs), masked_spec(spec), plan_workspace=False)
    averaged = _averaged_rows(inputs)
    # Rows that see no key: cuDNN leaves those within the lengths non-finite (every score
    # -inf; the mask is the same for every head); rows outside them it may not write at all.
    empty = ~jnp.isfinite(lse[:, :1]) | ~averaged
    average = empty_rows.mean_value(inputs["query"].shape[2], inputs["value"])[:, None]
    output, lse = empty_rows.fill(output, lse, empty, average)
    zeros = jnp.swapaxes(~averaged, 1, 2)[..., None]  # [B, T, 1, 1]
    return jnp.where(zeros, jnp.zeros((), output.dtype), output), lse


def backward(spec, inputs, output, lse, d_output):
    """(dq, dk, dv): forward's gradients, given its output and lse (a sink attention's, as
    every cuDNN backward takes them: jax_sdpa/kernels/sink_softmax.py)."""
    value = inputs["value"]
    # Rows that see no key hold the empty row's lse (forward's fill): they are not cuDNN's to
    # grade, and that huge negative must not reach its exp(scores - lse): 0 there, with no
    # cotangent. Those holding the mean of all values send their cotangent to V alike. (With
    # sinks the lse is the sink attention's and the caller has cleared those rows' cotangent.)
    averaged = _averaged_rows(inputs)
    empty = (lse[:, :1] <= 0.5 * large_negative()) | ~averaged
    empty_rows_btn = jnp.swapaxes(empty, 1, 2)[..., None]  # [B, T, 1, 1]
    d_output = d_output.astype(output.dtype)
    dq, dk, dv, _ = dense.backward(
        masked_inputs(inputs), output, jnp.where(empty, 0.0, lse),
        jnp.where(empty_rows_btn, jnp.zeros((), d_output.dtype), d_output), masked_spec(spec),
        plan_workspace=False)
    mean_rows = jnp.swapaxes(empty & averaged, 1, 2)[..., None]
    dv_mean = empty_rows.mean_value_gradient(inputs["query"].shape[2], value,
                                             jnp.where(mean_rows, d_output, 0))
    return dq, dk, (dv.astype(jnp.float32) + dv_mean).astype(value.dtype)
