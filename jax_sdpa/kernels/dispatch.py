"""The kernel switch: one forward and one backward per implementation ("cudnn": our FFI targets
by job, dense, packed, paged or FP8; "xla": the reference behind the same calling convention),
chosen by the CallSpec (a mask cut into pieces: kernels/pieces.py over the dense target).

    forward(spec, inputs)  -> (output [B, T, N, Hv], lse float32 [B, N, T])
    backward(spec, inputs, output, lse, d_output) -> (dq, dk, dv, dbias or None)

inputs: the spec's arrays by name (call_spec.INPUTS). This is what the sharding rules run per
device. Sinks are applied here, after whichever kernel ran (sink_softmax.py).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jax_sdpa.cudnn import dense
from jax_sdpa.cudnn import paged as paged_target
from jax_sdpa.kernels import fp8, pieces, sink_softmax
from jax_sdpa.packing import ragged
from jax_sdpa.reference import empty_rows
from jax_sdpa.reference import kernel as reference_kernel
from jax_sdpa.reference.attention import large_negative


def forward(spec, inputs):
    if spec.implementation == "xla":
        return reference_kernel.forward(spec, inputs)
    if spec.paged:
        return _paged_forward(spec, inputs)
    plain = _without_sinks(inputs)
    if spec.fp8:
        return fp8.forward(spec, plain)
    if spec.pieces:
        output, lse = pieces.forward(spec, plain)
    elif spec.segments:
        output, lse = ragged.forward(spec, plain)
    else:
        output, lse = dense.forward(plain, spec)
    if (spec.logits_soft_cap or spec.score_mod) and spec.has_lengths:
        # With a score modifier, cuDNN's padding is a mask inside it, not its own padding
        # mode: rows whose every score is masked come back non-finite.
        output, lse = empty_rows.clear_nonfinite_rows(output, lse)
    if spec.has_sinks:
        output, lse = sink_softmax.apply(output, lse, inputs["sinks"])
    return output, lse


def backward(spec, inputs, output, lse, d_output):
    """With sinks, output and lse are the sink attention's (sink_softmax.py): given those, cuDNN's
    backward is the sink attention's; a reference backward recomputes with the sinks."""
    if spec.implementation == "xla":
        return reference_kernel.backward(spec, inputs, output, lse, d_output)
    if spec.backward_kernel == "xla":  # a cuDNN forward whose backward cuDNN cannot run
        # (planning sends calls with dropout wholly to the reference: a recomputed forward
        # would not drop what cuDNN dropped)
        forward_fn = (reference_kernel.blockwise_forward if spec.segments else
                      reference_kernel.forward)
        return reference_kernel.backward(spec, inputs, output, lse, d_output, forward_fn)
    if spec.half_backward:  # the FP8 forward's output and stats, graded in the inputs' dtype
        half = dataclasses.replace(spec, fp8="", backward_implementation=None)
        return tuple(dense.backward(_without_sinks(inputs), output, lse, d_output, half))
    if spec.fp8:
        return fp8.backward(spec, inputs, output, lse, d_output)
    if spec.backward_pieces:
        return (*pieces.backward(spec, _without_sinks(inputs), output, lse, d_output), None)
    if spec.segments:
        if spec.has_sinks and empty_rows.packed_rows_may_see_nothing(spec):
            # Rows that see no key are the sink's whole (zeros), not the values' mean the
            # packed backward would grade: nothing flows back through them.
            kept = sink_softmax.rows_kept(lse, inputs["sinks"])
            d_output = jnp.where(kept[..., None], d_output, 0)
        return (*ragged.backward(spec, _without_sinks(inputs), output, lse, d_output), None)
    return tuple(dense.backward(_without_sinks(inputs), output, lse, d_output, spec))


def _paged_forward(spec, inputs):
    """cuDNN's paged forward (paged_attention: forward only, one problem per call)."""
    query, key_pages = inputs["query"], inputs["key"]
    # Entries past a sequence's last page may hold anything: cuDNN must not follow them out
    # of the pool (the reference clamps the same way).
    page_table = jnp.clip(inputs["page_table"], 0, key_pages.shape[0] - 1)
    output, lse = paged_target.forward(query, key_pages, inputs["value"], inputs["q_lengths"],
                                       inputs["kv_lengths"], page_table, spec)
    # Rows before a sequence's first key (kv_lengths[b] < T) see nothing: what cuDNN leaves
    # there is not the answer, and their lse must be the empty row's for the sinks.
    seen = empty_rows.paged_rows_seeing_keys(query.shape[1], inputs["kv_lengths"])
    lse = jnp.where(seen[:, None, :], lse, large_negative())
    if spec.has_sinks:
        output, lse = sink_softmax.apply(output, lse, inputs["sinks"])
    return output, lse


def _without_sinks(inputs):
    return {name: x for name, x in inputs.items() if name != "sinks"}
