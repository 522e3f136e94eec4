"""A pure-JAX stand-in for our ragged FFI calls, for testing the packed path on CPU.

It reads the ragged operands exactly as cuDNN does (each document's element offsets into the
flattened q/k/v/o/lse and its lengths; a causal band or window measured from the document's
first token) and leaves what cuDNN leaves: tokens of no document are zero when the call asks the
handler to zero-fill, NaN otherwise, so a test fails if the packed path relies on them. Its
backward computes from the output and lse it is given, as cuDNN's does (a sink attention's
gradient, given the sink attention's output and lse). Dense (non-ragged) calls go to the
reference kernel forward (with the segment mask, rows that see no key left NaN as cuDNN
leaves them), and their backward reads the lse likewise (band, lengths, ids, bias, soft-cap;
dropout alone takes the reference's recomputing backward). Any disagreement between the packed
path's bookkeeping (jax_sdpa/packing/, jax_sdpa/reference/empty_rows.py) and the segment-id
semantics shows up against the reference without a GPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_sdpa.cudnn import call as cudnn_call
from jax_sdpa.cudnn import dense as dense_target
from jax_sdpa.cudnn import ragged as ragged_target
from jax_sdpa.packing import fallback
from jax_sdpa.reference import kernel as reference_kernel
from jax_sdpa.reference.attention import combined_mask, fold_heads, repeat_heads


def _token_documents(starts, lengths, total):
    """int32 [total]: each flattened token's document, or -1."""
    tokens = jnp.arange(total)[None, :]
    inside = (tokens >= starts[:, None]) & (tokens < (starts + lengths)[:, None])
    return jnp.where(jnp.any(inside, axis=0), jnp.argmax(inside, axis=0), -1)


def _ragged_scores(query, key, config, ragged_operands, max_document_length):
    """(scaled scores [N, B*T, B*S] float32, visible bool [B*T, B*S], q_covered bool [B*T],
    kv_covered bool [B*S], too_long bool []): each query token against each key token of its
    document, as the ragged operands lay them out."""
    q_lengths, kv_lengths, offsets = ragged_operands
    bound_q, bound_kv = max_document_length  # cuDNN would read past a document longer than these
    too_long = (jnp.max(q_lengths) > jnp.where(bound_q > 0, bound_q, query.shape[1])) | (
        jnp.max(kv_lengths) > jnp.where(bound_kv > 0, bound_kv, key.shape[1]))
    batch, q_seq_len, q_heads, head_dim = query.shape
    _, kv_seq_len, kv_heads, _ = key.shape
    documents = q_lengths.shape[0]
    q_starts = offsets[0, :documents] // (q_heads * head_dim)
    kv_starts = offsets[1, :documents] // (kv_heads * head_dim)
    q_doc = _token_documents(q_starts, q_lengths, batch * q_seq_len)
    kv_doc = _token_documents(kv_starts, kv_lengths, batch * kv_seq_len)
    q_rel = jnp.arange(batch * q_seq_len) - q_starts[jnp.maximum(q_doc, 0)]
    kv_rel = jnp.arange(batch * kv_seq_len) - kv_starts[jnp.maximum(kv_doc, 0)]
    visible = (q_doc[:, None] == kv_doc[None, :]) & (q_doc[:, None] >= 0)
    if config.window_right >= 0:
        visible &= kv_rel[None, :] <= q_rel[:, None] + config.window_right
    if config.window_left >= 0:
        visible &= kv_rel[None, :] >= q_rel[:, None] - config.window_left
    q = _tokens(query).astype(jnp.float32)
    k = repeat_heads(_tokens(key)[None], q_heads)[0].astype(jnp.float32)
    scores = jnp.einsum("tnh,snh->nts", q, k, precision=jax.lax.Precision.HIGHEST) * config.scale
    return scores, visible, q_doc >= 0, kv_doc >= 0, too_long


def _tokens(x):
    """[B, L, heads, dim] -> [B * L, heads, dim]: the ragged layout's flattened tokens."""
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def _ragged_attention(query, key, value, config, ragged_operands, max_document_length):
    """(output [B, T, N, Hv] float32, lse [B, T, N], covered [B*T] bool)."""
    batch, q_seq_len, q_heads, _ = query.shape
    head_dim_v = value.shape[-1]
    scores, visible, q_covered, kv_covered, too_long = _ragged_scores(
        query, key, config, ragged_operands, max_document_length)
    v = repeat_heads(_tokens(value)[None], q_heads)[0].astype(jnp.float32)
    scores = jnp.where(visible[None], scores, -jnp.inf)
    any_visible = jnp.any(visible, axis=1)[None, :, None]
    safe = jnp.where(any_visible, scores, 0.0)
    probs = jnp.where(any_visible, jax.nn.softmax(safe, axis=-1), 0.0)
    out = jnp.einsum("nts,snh->tnh", probs, v, precision=jax.lax.Precision.HIGHEST)
    lse = jnp.where(any_visible[0], jax.nn.logsumexp(safe, axis=-1).T, -1e30)
    out = jnp.where(too_long, jnp.nan, out)  # a test fails if a bound was too small
    return (out.reshape(batch, q_seq_len, q_heads, head_dim_v), lse.reshape(
        batch, q_seq_len, q_heads), q_covered, kv_covered)


def _ragged_gradients(inputs, output, lse, d_output, config, ragged_operands,
                      max_document_length):
    """(dq, dk, dv) float32 of the ragged call, from the output and token-major lse [B, T, N]
    it is given, as cuDNN computes them per document; and the covered query and key tokens."""
    query, key, value = inputs["query"], inputs["key"], inputs["value"]
    q_heads, kv_heads = query.shape[2], key.shape[2]
    scores, visible, q_covered, kv_covered, too_long = _ragged_scores(
        query, key, config, ragged_operands, max_document_length)
    # The flattened tokens as one batch entry, in _softmax_gradients' layouts.
    q, o, d_o = (_tokens(x)[None].astype(jnp.float32) for x in (query, output, d_output))
    k, v = (repeat_heads(_tokens(x)[None], q_heads).astype(jnp.float32) for x in (key, value))
    lse_nt = _tokens(lse[..., None])[..., 0].T  # [N, B*T]
    weights = jnp.where(visible[None], jnp.exp(scores - lse_nt[..., None]), 0.0)[None]
    dq, dk, dv, _ = _softmax_gradients(q, k, v, o, d_o, weights, config.scale)
    fold = lambda x, like: fold_heads(x, kv_heads)[0].reshape(like.shape)  # noqa: E731
    grads = dq[0].reshape(query.shape), fold(dk, key), fold(dv, value)
    return tuple(jnp.where(too_long, jnp.nan, g) for g in grads), q_covered, kv_covered


def _softmax_gradients(q, k, v, o, d_o, weights, scale, raw=None, cap=0.0):
    """(dq, dk, dv, dlogits) float32, per query head, as cuDNN's backward computes them from the
    softmax weights P [B, N, T, S] (zero where masked): dS = P (dP - rowsum(dO O)), through
    the soft-cap's tanh when cap (raw: the scaled scores before it). q, o, d_o [B, T, N, *];
    k, v [B, S, N, *], float32."""
    highest = jax.lax.Precision.HIGHEST
    d_weights = jnp.einsum("btnh,bsnh->bnts", d_o, v, precision=highest)
    row_dot = jnp.swapaxes(jnp.sum(d_o * o, axis=-1), 1, 2)  # [B, N, T]
    d_logits = weights * (d_weights - row_dot[..., None])
    d_raw = d_logits * (1.0 - jnp.square(jnp.tanh(raw / cap))) if cap else d_logits
    dq = jnp.einsum("bnts,bsnh->btnh", d_raw, k, precision=highest) * scale
    dk = jnp.einsum("bnts,btnh->bsnh", d_raw, q, precision=highest) * scale
    dv = jnp.einsum("bnts,btnh->bsnh", weights, d_o, precision=highest)
    return dq, dk, dv, d_logits


def _unwritten(x, covered, config, inputs, side):
    """What the handler leaves in tokens of no document (covered: bool [B * T], x: [B, T, ...]):
    zeros where it zero-fills (every such token, or those past the row's lengths: side 0 the
    queries', 1 the keys'), else NaN."""
    fill = config.zero_fill(ragged=True)
    zeros = jnp.full(x.shape[:2], fill == "all")
    if fill == "tails":
        tails = cudnn_call.tails(inputs)[:, side]
        zeros = jnp.arange(x.shape[1])[None, :] >= tails[:, None]
    keep = covered.reshape(x.shape[:2])
    fill_value = jnp.where(zeros, 0.0, jnp.nan)
    expand = lambda m: m.reshape(m.shape + (1,) * (x.ndim - 2))  # noqa: E731
    return jnp.where(expand(keep), x, expand(fill_value).astype(x.dtype))


def _poisoned(x, poison_rows):
    """x [B, L, ...] with the first token of the rows poison_rows names NaN, as the handler
    writes it after cuDNN ran."""
    if poison_rows is None:
        return x
    return x.at[:, 0].set(jnp.where(poison_rows.reshape((-1,) + (1,) * (x.ndim - 2)),
                                    jnp.nan, x[:, 0]))


def _dense_keep(config, inputs):
    """bool [B, 1, T, S] or None: the keys a dense call's masks leave each query (band,
    lengths, and with the segment mask the ids)."""
    q_seq_len, kv_seq_len = inputs["query"].shape[1], inputs["key"].shape[1]
    return combined_mask(
        q_seq_len, kv_seq_len,
        query_seq_lengths=inputs["q_lengths"] if config.has_lengths else None,
        key_value_seq_lengths=inputs["kv_lengths"] if config.has_lengths else None,
        local_window_size=config.window(),
        diagonal_offset=config.diagonal_offset(q_seq_len, kv_seq_len),
        query_segment_ids=inputs["q_segment_ids"] if config.segments else None,
        kv_segment_ids=inputs["kv_segment_ids"] if config.segments else None)


def _segment_masked_forward(config, inputs):
    """A dense call with the segment mask, as cuDNN leaves it: rows whose every score is
    masked come back NaN with a non-finite lse, and the handler's tails fill zeroes the rows
    past the lengths afterwards."""
    out, lse = reference_kernel.forward(config, inputs)
    seen = jnp.any(_dense_keep(config, inputs), axis=-1)  # [B, 1, T]
    out = jnp.where(jnp.swapaxes(seen, 1, 2)[..., None], out, jnp.nan)
    lse = jnp.where(seen, lse, -jnp.inf)
    if config.zero_fill() == "tails":
        past = (jnp.arange(out.shape[1])[None, :] >= cudnn_call.tails(inputs)[:, :1])  # [B, T]
        out = jnp.where(past[:, :, None, None], 0.0, out).astype(out.dtype)
        lse = jnp.where(past[:, None, :], 0.0, lse)
    return out, lse


def _gridded(ragged_operands, max_document_length, grid):
    """The operands and bounds a device-chosen grid runs, as the handler reads them: the first
    grid[0] documents (the others unseen: their lengths zero) with bounds grid[1], grid[2]."""
    if grid is None:
        return ragged_operands, max_document_length
    q_lengths, kv_lengths, offsets = ragged_operands
    seen = jnp.arange(q_lengths.shape[0]) < grid[0]
    return ((jnp.where(seen, q_lengths, 0), jnp.where(seen, kv_lengths, 0), offsets),
            (grid[1], grid[2]))


def _or_fallback(grid, fallback_ids, ragged, dense):
    """A ragged call with fallback ids: on a grid of 0 documents the handler runs the dense
    call masking the ids (stats token-major), else the grid's ragged call."""
    if not fallback_ids:
        return ragged()
    ragged_results, dense_results = ragged(), dense()
    return jax.tree.map(lambda r, d: None if r is None else jnp.where(grid[0] == 0, d, r),
                        ragged_results, dense_results, is_leaf=lambda x: x is None)


def emulate(monkeypatch):
    """Our dense and ragged FFI calls replaced by this module's stand-ins."""
    monkeypatch.setattr(dense_target, "forward", dense_forward)
    monkeypatch.setattr(dense_target, "backward", dense_backward)
    monkeypatch.setattr(ragged_target, "forward", ragged_forward)
    monkeypatch.setattr(ragged_target, "backward", ragged_backward)


def dense_forward(inputs, config, *, plan_workspace=True):  # (no workspace here)
    if config.segments:
        return _segment_masked_forward(config, inputs)
    return reference_kernel.forward(config, inputs)


def ragged_forward(inputs, config, ragged_operands, *, max_document_length=(0, 0),
                   poison_rows=None, grid=None, fallback_ids=False):
    def dense():
        out, lse = _segment_masked_forward(fallback.masked_spec(config),
                                           fallback.masked_inputs(inputs))
        return out, jnp.swapaxes(lse, 1, 2)
    return _or_fallback(grid, fallback_ids, lambda: _ragged_forward(
        inputs, config, ragged_operands, max_document_length, poison_rows, grid), dense)


def _ragged_forward(inputs, config, ragged_operands, max_document_length, poison_rows, grid):
    ragged_operands, max_document_length = _gridded(ragged_operands, max_document_length, grid)
    query, key, value = inputs["query"], inputs["key"], inputs["value"]
    out, lse, q_covered, _ = _ragged_attention(query, key, value, config, ragged_operands,
                                                 max_document_length)
    out = _unwritten(out, q_covered, config, inputs, 0).astype(query.dtype)
    # (the lse is zero-filled first whenever anything is)
    stats_fill = jnp.where(config.zero_fill(ragged=True) != "", 0.0, jnp.nan)
    lse = jnp.where(q_covered.reshape(lse.shape[:2])[..., None], lse, stats_fill)
    return _poisoned(out, poison_rows), lse


def _dense_backward(inputs, output, lse, d_output, config):
    """A dense call's backward as cuDNN computes it, from the output and lse it is given: the
    weights exp(logits - lse) inside the call's masks (band, lengths), dS = P (dP - rowsum(dO
    O)), through the soft-cap's tanh; so an lse that is not the forward's, or one no exp can
    take, shows here as it would on the GPU. Dropout takes the reference's backward."""
    if config.dropout:
        return reference_kernel.backward(config, inputs, output, lse, d_output)
    query, bias = inputs["query"], inputs.get("bias")
    q, k, v, o, d_o = (x.astype(jnp.float32) for x in (query, inputs["key"], inputs["value"],
                                                         output, d_output))
    heads, kv_heads = q.shape[2], k.shape[2]
    k, v = repeat_heads(k, heads), repeat_heads(v, heads)
    highest = jax.lax.Precision.HIGHEST
    raw = jnp.einsum("btnh,bsnh->bnts", q, k, precision=highest) * config.scale
    cap = config.logits_soft_cap
    logits = cap * jnp.tanh(raw / cap) if cap else raw
    if bias is not None:
        logits = logits + bias.astype(jnp.float32)
    weights = jnp.exp(logits - lse[..., None])
    keep = _dense_keep(config, inputs)
    if keep is not None:
        weights = jnp.where(keep, weights, 0.0)
    dq, dk, dv, d_logits = _softmax_gradients(q, k, v, o, d_o, weights, config.scale, raw, cap)
    dbias = None
    if config.has_bias and config.bias_grad:
        summed = tuple(axis for axis in (0, 1) if bias.shape[axis] == 1)
        dbias = jnp.sum(d_logits, axis=summed, keepdims=True).astype(bias.dtype)
    return (dq.astype(query.dtype), fold_heads(dk, kv_heads).astype(inputs["key"].dtype),
            fold_heads(dv, kv_heads).astype(inputs["value"].dtype), dbias)


def dense_backward(inputs, output, lse, d_output, config, *, plan_workspace=True):
    return _dense_backward(inputs, output, lse, d_output, config)


def ragged_backward(inputs, output, lse, d_output, config, ragged_operands, *,
                    max_document_length=(0, 0), poison_rows=None, grid=None,
                    fallback_ids=False):
    def dense():
        return _dense_backward(fallback.masked_inputs(inputs), output, jnp.swapaxes(lse, 1, 2),
                               d_output, fallback.masked_spec(config))[:3]
    return _or_fallback(grid, fallback_ids, lambda: _ragged_backward(
        inputs, output, lse, d_output, config, ragged_operands, max_document_length,
        poison_rows, grid), dense)


def _ragged_backward(inputs, output, lse, d_output, config, ragged_operands,
                     max_document_length, poison_rows, grid):
    ragged_operands, max_document_length = _gridded(ragged_operands, max_document_length, grid)
    query, key, value = inputs["query"], inputs["key"], inputs["value"]
    (dq, dk, dv), q_covered, kv_covered = _ragged_gradients(
        inputs, output, lse, d_output, config, ragged_operands, max_document_length)
    return (_poisoned(_unwritten(dq, q_covered, config, inputs, 0).astype(query.dtype),
                      poison_rows),
            _poisoned(_unwritten(dk, kv_covered, config, inputs, 1).astype(key.dtype),
                      poison_rows),
            _poisoned(_unwritten(dv, kv_covered, config, inputs, 1).astype(value.dtype),
                      poison_rows))
