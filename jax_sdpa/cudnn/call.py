"""The ffi_call wrappers of our cuDNN forward and backward (and the paged forward): operands in
the handlers' order, attributes from the CallSpec, the cuDNN workspace as one more result
that XLA allocates."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax_sdpa.cudnn import extension as _extension
from jax_sdpa.common.varying import varying_like


def _tails(inputs):
    """int32 [B, 2]: each row's query and key tokens cuDNN writes, the handler zero-filling
    past them: the lengths, or 0 where the other side has none."""
    q_lengths, kv_lengths = inputs["q_lengths"], inputs["kv_lengths"]
    return jnp.stack([jnp.where(kv_lengths > 0, q_lengths, 0),
                      jnp.where(q_lengths > 0, kv_lengths, 0)], axis=-1).astype(jnp.int32)


def _segment_ids(inputs):
    return [inputs["q_segment_ids"].astype(jnp.int32),
            inputs.get("kv_segment_ids", inputs["q_segment_ids"]).astype(jnp.int32)]


def _optional_operands(inputs, ragged_operands, config, poison_rows, fp8_scales=None,
                       grid=None, fallback_ids=False):
    """The FFI's optional operands, in its order: [bias], [q_lengths, kv_lengths] (per document
    when ragged), [q_segment_ids, kv_segment_ids] (a dense call's segment mask, or a ragged
    call's fallback), [offsets], [grid], [dropout_seed], [poison_rows], [tails],
    [fp8_scales]."""
    operands = [inputs["bias"]] if config.has_bias else []
    if ragged_operands is not None:
        *lengths, offsets = ragged_operands
        operands += [*lengths, *(_segment_ids(inputs) if fallback_ids else ()), offsets]
        if grid is not None:
            operands.append(grid)
    else:
        if config.has_lengths:
            operands += [inputs["q_lengths"], inputs["kv_lengths"]]
        if config.segments:
            operands += _segment_ids(inputs)
    if config.has_seed:
        operands.append(inputs["dropout_seed"])
    if poison_rows is not None:
        operands.append(poison_rows.astype(jnp.int32))
    if config.zero_fill(ragged=ragged_operands is not None) == "tails":
        operands.append(_tails(inputs))
    if fp8_scales is not None:
        operands.append(fp8_scales)
    return operands


def _described(inputs, config, leading, ragged_operands, max_document_length, *, poison_rows,
               fp8_scales, grid=None, fallback_ids=False):
    """(operands, attributes) of a call: the leading operands, then the optional ones."""
    fallback_ids = fallback_ids and grid is not None
    operands = (*leading, *_optional_operands(inputs, ragged_operands, config, poison_rows,
                                              fp8_scales, grid, fallback_ids))
    return operands, config.ffi_attributes(ragged=ragged_operands is not None,
                                           max_document_length=max_document_length,
                                           poison_rows=poison_rows is not None,
                                           device_grid=grid is not None,
                                           fallback_ids=fallback_ids)


# An FP8 call's amaxes (ffi/call_plan.h): rows of 4 floats, 2 forward, 4 backward.
_FP8_AMAXES = {"forward": 2, "backward": 4}


def _fp8_amaxes(role, fp8_scales):
    """The amax result of an FP8 call (per vmapped slice, as its scales), or nothing."""
    if fp8_scales is None:
        return ()
    shape = (*fp8_scales.shape[:-2], _FP8_AMAXES[role], fp8_scales.shape[-1])
    return (jax.ShapeDtypeStruct(shape, jnp.float32),)


def _gpu_ordinal() -> int | None:
    """CUDA ordinal of this process's first GPU; None without one (lowering for CUDA on a
    CPU-only host, jax.export)."""
    try:
        devices = jax.local_devices(backend="gpu")
    except RuntimeError:
        return None
    return devices[0].local_hardware_id if devices else None


@functools.lru_cache(maxsize=4096)
def _planned_workspace_bytes(backward, device, operands, attributes) -> int:
    try:
        planner = _extension.extension().workspace_bytes
        return int(planner(backward, device, list(operands), dict(attributes)))
    except RuntimeError:
        # The graph does not build (cuDNN refuses the config): the call itself reports that,
        # with cuDNN's message, when it runs, as it does for a call planned without a GPU.
        return 0


def _call_with_workspace(role, config, result_types, operands, attributes, vmap_method,
                         plan_workspace=True):
    """ffi_call of our target with the call's cuDNN workspace as one more result, a uint8 buffer
    XLA allocates: XLA reuses that memory like any temporary, and orders it like any buffer
    inside a command buffer (CUDA graph), so no call holds memory of its own. Its size comes
    from the call's graph, built here (on this process's first GPU) and cached for the call;
    without a GPU, or a graph that needs none, the handler takes scratch memory per call
    instead. plan_workspace=False: no graph built while tracing, scratch memory (for calls that
    seldom run). Returns the call's other results."""
    buffered = config.command_buffer
    attributes = dict(attributes, command_buffer=buffered, workspace_result=False)
    device = _gpu_ordinal()
    workspace = 0
    if device is not None and plan_workspace:
        described = tuple((jnp.dtype(x.dtype).name, tuple(int(d) for d in x.shape))
                          for x in operands)
        values = tuple(sorted((name, float(value)) for name, value in attributes.items()))
        workspace = _planned_workspace_bytes(role == "backward", device, described, values)
    if workspace > 0:
        attributes["workspace_result"] = True
        result_types = (*result_types, jax.ShapeDtypeStruct((workspace,), jnp.uint8))
    target = _extension.target_names()[role + ("_command_buffer" if buffered else "")]
    call = jax.ffi.ffi_call(target, tuple(result_types), vmap_method=vmap_method)
    results = call(*operands, **attributes)
    return varying_like(results[:len(results) - (workspace > 0)], operands)


def sdpa_forward(inputs, config, ragged_operands=None, max_document_length=(0, 0),
                 poison_rows=None, fp8_scales=None, plan_workspace=True, grid=None,
                 fallback_ids=False):
    """cuDNN forward: (output [batch..., T, N, Hv], lse float32 [batch..., N, T], or
    [batch..., T, N] token-major when ragged).

    inputs: the config's inputs by name (call_spec.INPUTS); query, key, value in the
    [batch..., seq, heads, head_dim] layout. ragged_operands: None, or (q_lengths, kv_lengths
    per document, offsets) from jax_sdpa.packing.documents.ragged_operands; max_document_length:
    (queries, keys) no document is longer than (0: the rows' lengths); poison_rows: None, or
    bool [batch...]: rows whose first output token comes back NaN; fp8_scales: None, or an
    FP8 call's float32 scale rows (e4m3 query, key and value; the output comes back e4m3 too,
    and the amaxes as a third result); plan_workspace=False: scratch memory, and no graph
    built while tracing. grid: None; or int32 [3], the ragged grid (entries, queries, keys)
    chosen on the device, within ragged_operands and max_document_length: the handler reads it
    (waiting for the GPU) and runs that grid (the workspace is the largest grid's: the graph
    of the operands as given).
    fallback_ids: with a grid, the call takes the segment ids too, and a grid of 0 documents
    runs the dense call over the rows masking them (self-attention without lengths: rows the
    document table cannot express), the lse token-major all the same.
    """
    _extension.register_ffi_targets()
    query, key, value = inputs["query"], inputs["key"], inputs["value"]
    *batch, q_seq_len, q_heads, _ = query.shape
    stats_shape = ((*batch, q_seq_len, q_heads) if ragged_operands is not None
                   else (*batch, q_heads, q_seq_len))
    result_types = (
        jax.ShapeDtypeStruct((*batch, q_seq_len, q_heads, value.shape[-1]), query.dtype),
        jax.ShapeDtypeStruct(stats_shape, jnp.float32),
        *_fp8_amaxes("forward", fp8_scales),
    )
    operands, attributes = _described(inputs, config, (query, key, value), ragged_operands,
                                      max_document_length, poison_rows=poison_rows,
                                      fp8_scales=fp8_scales, grid=grid,
                                      fallback_ids=fallback_ids)
    # broadcast_all: under vmap every operand gains the same leading axes, which the handler
    # folds into the batch.
    return _call_with_workspace("forward", config, result_types, operands, attributes,
                                "broadcast_all", plan_workspace)


def sdpa_backward(inputs, output, lse, d_output, config, ragged_operands=None,
                  max_document_length=(0, 0), poison_rows=None, fp8_scales=None,
                  plan_workspace=True, grid=None, fallback_ids=False):
    """cuDNN backward: (dq, dk, dv, dbias or None); dbias only for a user's bias. poison_rows:
    as sdpa_forward's, for dq, dk and dv. fp8_scales: an FP8 call's scale rows; d_output is then
    in the gradients' FP8 format, which dq, dk and dv come back in, and the amaxes follow.
    plan_workspace, grid, fallback_ids: as sdpa_forward's."""
    _extension.register_ffi_targets()
    query, key, value = inputs["query"], inputs["key"], inputs["value"]
    gradient_dtype = lambda x: d_output.dtype if fp8_scales is not None else x.dtype  # noqa
    result_types = [jax.ShapeDtypeStruct(x.shape, gradient_dtype(x)) for x in (query, key, value)]
    with_dbias = config.has_bias and config.bias_grad
    if with_dbias:
        result_types.append(jax.ShapeDtypeStruct(inputs["bias"].shape, inputs["bias"].dtype))
    result_types += _fp8_amaxes("backward", fp8_scales)
    if fp8_scales is None:
        d_output = d_output.astype(output.dtype)
    operands, attributes = _described(inputs, config, (query, key, value, output, lse, d_output),
                                      ragged_operands, max_document_length,
                                      poison_rows=poison_rows, fp8_scales=fp8_scales, grid=grid,
                                      fallback_ids=fallback_ids)
    results = _call_with_workspace("backward", config, result_types, operands, attributes,
                                   "broadcast_all", plan_workspace)
    amaxes = (results[-1],) if fp8_scales is not None else ()
    return (*results[:3], results[3] if with_dbias else None, *amaxes)


def sdpa_paged_forward(query, key_cache, value_cache, q_lengths, kv_lengths, page_table, config):
    """cuDNN forward over a paged K/V cache: (output [B, T, N, Hv], lse float32 [B, N, T]).

    key_cache [P, page_size, K, H], value_cache [P, page_size, K, Hv]: the page pools;
    page_table int32 [B, max_pages]; q_lengths and kv_lengths int32 [B] (cuDNN's padding
    mask: the band is measured from each sequence's actual lengths)."""
    _extension.register_ffi_targets()
    batch, q_seq_len, q_heads, _ = query.shape
    result_types = (
        jax.ShapeDtypeStruct((batch, q_seq_len, q_heads, value_cache.shape[-1]), query.dtype),
        jax.ShapeDtypeStruct((batch, q_heads, q_seq_len), jnp.float32),
    )
    operands = (query, key_cache, value_cache, q_lengths, kv_lengths, page_table)
    # The handler takes one problem: under vmap, one call per element.
    return _call_with_workspace("forward", config, result_types, operands,
                                config.ffi_attributes(), "sequential")
