"""The ragged targets (jax_sdpa_ragged_forward / _backward): packed documents on cuDNN's
ragged layout, each document its own batch entry at its own offsets into the rows
(jax_sdpa/packing/documents.py builds the operands), its stats token-major."""

from __future__ import annotations

import jax

from jax_sdpa.cudnn import call
from jax_sdpa.cudnn.targets import BY_NAME

FORWARD = BY_NAME["jax_sdpa_ragged_forward"]
BACKWARD = BY_NAME["jax_sdpa_ragged_backward"]


def _operands_and_attributes(inputs, spec, ragged_operands, max_document_length, poison_rows,
                             grid, fallback_ids):
    q_lengths, kv_lengths, offsets = ragged_operands
    fallback_ids = fallback_ids and grid is not None
    operands = dict(query=inputs["query"], key=inputs["key"], value=inputs["value"],
                    q_lengths=q_lengths, kv_lengths=kv_lengths, offsets=offsets, grid=grid,
                    dropout_seed=inputs.get("dropout_seed"))
    if fallback_ids:
        operands.update(call.segment_ids(inputs))
    if poison_rows is not None:
        operands["poison_rows"] = poison_rows.astype("int32")
    fill = spec.zero_fill(ragged=True)
    if fill == "tails":
        operands["tails"] = call.tails(inputs)
    attributes = dict(max_document_length_q=max_document_length[0],
                      max_document_length_kv=max_document_length[1],
                      device_grid=grid is not None, fallback_ids=fallback_ids,
                      poison_rows=poison_rows is not None, **call.zero_fill_attributes(fill))
    return operands, attributes


def forward(inputs, spec, ragged_operands, *, max_document_length=(0, 0), poison_rows=None,
            grid=None, fallback_ids=False):
    """(output [batch..., T, N, Hv], lse float32 [batch..., T, N], token-major).

    ragged_operands: (q_lengths, kv_lengths per document, offsets) from
    jax_sdpa.packing.documents.ragged_operands; max_document_length: (queries, keys) no
    document is longer than (0: the rows' lengths); poison_rows: None, or bool [batch...]: rows
    whose first output token comes back NaN. grid: None; or int32 [3], the grid (entries,
    queries, keys) chosen on the device, within ragged_operands and max_document_length: the
    handler reads it (waiting for the GPU) and runs that grid (the workspace is the largest
    grid's: the graph of the operands as given). fallback_ids: with a grid, the call takes the
    segment ids too, and a grid of 0 documents runs the dense call over the rows masking them
    (self-attention without lengths: rows the document table cannot express), the lse
    token-major all the same."""
    operands, attributes = _operands_and_attributes(inputs, spec, ragged_operands,
                                                    max_document_length, poison_rows, grid,
                                                    fallback_ids)
    query = inputs["query"]
    return call.ffi_call(FORWARD, spec, operands, attributes,
                         (call.output_type(query, inputs["value"]),
                          call.stats_type(query, token_major=True)))


def backward(inputs, output, lse, d_output, spec, ragged_operands, *, max_document_length=(0, 0),
             poison_rows=None, grid=None, fallback_ids=False):
    """(dq, dk, dv), given the token-major lse; the rest as forward's."""
    operands, attributes = _operands_and_attributes(inputs, spec, ragged_operands,
                                                    max_document_length, poison_rows, grid,
                                                    fallback_ids)
    operands.update(output=output, stats=lse, d_output=d_output.astype(output.dtype))
    result_types = [jax.ShapeDtypeStruct(inputs[name].shape, inputs[name].dtype)
                    for name in ("query", "key", "value")]
    return tuple(call.ffi_call(BACKWARD, spec, operands, attributes, result_types))
