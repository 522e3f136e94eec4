"""The reference path behind the kernels' calling convention: a CallSpec and its inputs by
name (its band as CallSpec holds it, a bias that already holds the mask, lse as the forward's
residual).

It serves three purposes: the "xla" implementation of the kernel layer, so the sharding rules
(jax_sdpa/kernels/sharding.py) run and are tested on any backend (CI checks on 8 CPU devices that a
sharded call compiles to per-device kernels with no collectives, with exactly the code path the
GPU runs, only the kernel swapped); and the backward of a cuDNN forward whose backward cuDNN
cannot run, for packed segment ids query block by query block (memory O(block x S), never
[T, S]).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_sdpa.reference import fp8 as fp8_reference
from jax_sdpa.reference import paged
from jax_sdpa.reference.attention import (attention_reference, fold_heads, repeat_heads,
                                          spec_options)

# Query rows per block of the blockwise form: its float32 scores take block x S x heads x batch
# x 4 bytes; about this many elements at most.
_BLOCK_ELEMENTS = 1 << 24


def _dropout_rng(inputs):
    seed = inputs.get("dropout_seed")
    if seed is None:
        return None
    # The seed's words, then the offset's low word (a shard's index): one key per shard.
    return jax.random.fold_in(jax.random.wrap_key_data(seed[:2]), seed[2])


def _attend(config, inputs, query, *, first_row=0, q_segment_ids=None, q_lengths=None,
            rng=None):
    """attention_reference on `query` (rows first_row.. of the call's queries)."""
    key, value = inputs["key"], inputs["value"]
    # The keys' ids: their own, or (self-attention packing) all of the queries'.
    kv_segment_ids = inputs.get("kv_segment_ids", inputs.get("q_segment_ids"))
    return attention_reference(
        query, key, value, inputs.get("bias"), None, query_seq_lengths=q_lengths,
        key_value_seq_lengths=inputs.get("kv_lengths"), dropout_rng=rng,
        query_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
        sinks=inputs.get("sinks"),
        **spec_options(config, inputs["query"].shape[1], key.shape[1], first_row))


def forward(config, inputs):
    """(output [B, T, N, Hv], lse float32 [B, N, T]), as the cuDNN kernel's forward."""
    if config.paged:
        return paged.forward(config, inputs)
    if config.fp8:
        return fp8_reference.forward(config, inputs)
    return _attend(config, inputs, inputs["query"], q_segment_ids=inputs.get("q_segment_ids"),
                   q_lengths=inputs.get("q_lengths"), rng=_dropout_rng(inputs))


class QueryBlocks:
    """A call's query rows cut into blocks of `size` rows, the last one padded past T:
    [B, T, ...] <-> [blocks, B, size, ...] (the blockwise reference and the packed fallback)."""

    def __init__(self, q_seq_len, size):
        self.q_seq_len, self.size = q_seq_len, size
        self.count = -(-q_seq_len // size)

    def split(self, x, axis=1):
        """x's axis `axis` (T) cut into blocks, padded past T; the blocks first."""
        x = jnp.moveaxis(x, axis, 1)
        pad = self.count * self.size - self.q_seq_len
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        x = x.reshape(x.shape[0], self.count, self.size, *x.shape[2:])
        return jnp.moveaxis(jnp.moveaxis(x, 1, 0), 2, axis + 1)

    def join(self, x, axis=1):
        """split's inverse: [blocks, ...] -> x with T at `axis`."""
        x = jnp.moveaxis(jnp.moveaxis(x, axis + 1, 2), 0, 1)
        x = x.reshape(x.shape[0], self.count * self.size, *x.shape[3:])[:, :self.q_seq_len]
        return jnp.moveaxis(x, 1, axis)

    def lengths(self, q_lengths, first):
        """int32 [B]: each row's query length counted within the block starting at row
        `first` (padding rows past T are past it too)."""
        return jnp.clip(q_lengths - first, 0, self.size)


def blockwise_forward(config, inputs, block=None):
    """forward, one block of query rows at a time (lax.map; each block rematerialised in the
    backward): the same function with memory O(block x S). Dropout draws per block. Takes no
    bias (a bias is [T, S] already: the dense forward serves it)."""
    if inputs.get("bias") is not None:
        raise ValueError("blockwise_forward takes no bias")
    query = inputs["query"]
    batch, q_seq_len, q_heads, _ = query.shape
    kv_seq_len = inputs["key"].shape[1]
    if block is None:
        block = max(1, min(q_seq_len, _BLOCK_ELEMENTS // max(1, batch * q_heads * kv_seq_len)))
    blocks = QueryBlocks(q_seq_len, block)
    q_ids = inputs.get("q_segment_ids")
    q_lengths = inputs.get("q_lengths")
    if q_lengths is None:
        q_lengths = jnp.full((batch,), q_seq_len, jnp.int32)
    rng = _dropout_rng(inputs)

    @jax.checkpoint
    def one_block(args):
        q_block, ids_block, index = args
        first = index * block
        block_rng = None if rng is None else jax.random.fold_in(rng, index)
        return _attend(config, inputs, q_block, first_row=first, q_segment_ids=ids_block,
                       q_lengths=blocks.lengths(q_lengths, first), rng=block_rng)
    ids_blocks = None if q_ids is None else blocks.split(q_ids)
    out, lse = jax.lax.map(one_block, (blocks.split(query), ids_blocks, jnp.arange(blocks.count)))
    return blocks.join(out), blocks.join(lse, axis=2)


def backward(config, inputs, output, lse, d_output, forward_fn=forward):
    """(dq, dk, dv, dbias or None), as the cuDNN kernel's backward: recomputes the forward (FP8:
    its own backward, from the forward's output and lse)."""
    if config.fp8:
        return fp8_reference.backward(config, inputs, output, lse, d_output)
    del output, lse
    differentiable = {name: inputs[name] for name in ("query", "key", "value")}
    if inputs.get("bias") is not None:
        differentiable["bias"] = inputs["bias"]

    def primal(arrays):
        return forward_fn(config, {**inputs, **arrays})[0]
    _, vjp = jax.vjp(primal, differentiable)
    (grads,) = vjp(d_output.astype(inputs["query"].dtype))
    dbias = grads.get("bias") if config.bias_grad else None
    return grads["query"], grads["key"], grads["value"], dbias


def backward_from_stats(scale, soft_cap, q, k, v, out, lse, d_out, keep=None):
    """(dq, dk, dv) float32 of a block of query rows against a block of keys, given the whole
    rows' output and lse (cuDNN's backward convention: the block's exact share when the rows
    see other keys too). keep: bool broadcastable to [B, N, t, s], or None (every score)."""
    q, k, v, out, d_out = (x.astype(jnp.float32) for x in (q, k, v, out, d_out))
    kv_heads = k.shape[2]
    expand = lambda x: repeat_heads(x, q.shape[2])  # noqa: E731
    highest = jax.lax.Precision.HIGHEST
    logits = jnp.einsum("btnh,bsnh->bnts", q, expand(k), precision=highest) * scale
    capped = None
    if soft_cap:
        capped = jnp.tanh(logits / soft_cap)
        logits = soft_cap * capped
    if keep is not None:
        logits = jnp.where(keep, logits, -jnp.inf)
    p = jnp.exp(logits - lse[..., None])
    dv = jnp.einsum("bnts,btnh->bsnh", p, d_out, precision=highest)
    dp = jnp.einsum("btnh,bsnh->bnts", d_out, expand(v), precision=highest)
    row_dot = jnp.sum(d_out * out, axis=-1).transpose(0, 2, 1)  # D = rowsum(dO * O), [B,N,T]
    ds = p * (dp - row_dot[..., None])
    if capped is not None:  # d(cap * tanh(x / cap)) / dx
        ds = ds * (1.0 - capped * capped)
    dq = jnp.einsum("bnts,bsnh->btnh", ds, expand(k), precision=highest) * scale
    dk = jnp.einsum("bnts,btnh->bsnh", ds, q, precision=highest) * scale
    return dq, fold_heads(dk, kv_heads), fold_heads(dv, kv_heads)
