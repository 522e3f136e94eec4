"""The dense targets (jax_sdpa_dense_forward / _backward): attention over [batch..., T, N, H]
rows on cuDNN, with a bias, sequence lengths, segment ids masked inside cuDNN's kernel,
dropout, soft-capping and a diagonal band, as the CallSpec says."""

from __future__ import annotations

import jax

from jax_sdpa.cudnn import call
from jax_sdpa.cudnn.targets import BY_NAME

FORWARD = BY_NAME["jax_sdpa_dense_forward"]
BACKWARD = BY_NAME["jax_sdpa_dense_backward"]


def _operands(inputs, spec) -> dict:
    operands = dict(inputs)
    if spec.segments:
        operands.update(call.segment_ids(inputs))
    if spec.zero_fill() == "tails":
        operands["tails"] = call.tails(inputs)
    return operands


def _attributes(spec) -> dict:
    return dict(has_bias=spec.has_bias, padding=spec.has_lengths,
                segment_mask=bool(spec.segments), **call.zero_fill_attributes(spec.zero_fill()))


def forward(inputs, spec, *, plan_workspace=True):
    """(output [batch..., T, N, Hv], lse float32 [batch..., N, T]).

    inputs: the spec's inputs by name (call_spec.INPUTS, no sinks): query, key, value in the
    [batch..., seq, heads, head_dim] layout, and the bias, lengths, segment ids and dropout seed
    the spec has. plan_workspace=False: scratch memory, and no graph built while tracing."""
    query, value = inputs["query"], inputs["value"]
    return call.ffi_call(FORWARD, spec, _operands(inputs, spec), _attributes(spec),
                         (call.output_type(query, value), call.stats_type(query)),
                         plan_workspace=plan_workspace)


def backward(inputs, output, lse, d_output, spec, *, plan_workspace=True):
    """(dq, dk, dv, dbias or None): dbias only for a user's bias (the spec's bias_grad)."""
    with_dbias = spec.has_bias and spec.bias_grad
    result_types = [jax.ShapeDtypeStruct(inputs[name].shape, inputs[name].dtype)
                    for name in ("query", "key", "value")]
    if with_dbias:
        result_types.append(jax.ShapeDtypeStruct(inputs["bias"].shape, inputs["bias"].dtype))
    operands = dict(_operands(inputs, spec), output=output, stats=lse,
                    d_output=d_output.astype(output.dtype))
    results = call.ffi_call(BACKWARD, spec, operands,
                            dict(_attributes(spec), bias_grad=with_dbias), result_types,
                            plan_workspace=plan_workspace)
    return (*results[:3], results[3] if with_dbias else None)
