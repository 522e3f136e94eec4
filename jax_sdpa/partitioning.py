"""Sharding rules for our attention kernels under jit (JAX's SPMD partitioner, Shardy).

With query/key/value sharded over batch and/or heads (data, tensor or FSDP-style parallelism),
each device runs the kernel on its own shard: no collective in the forward or backward, except
the sum of a broadcast bias's gradient over the devices that share the bias. Any other sharding
(a sequence or head_dim axis, or key/value sharded unlike the query) is resharded to that layout
by the rule, never an error. Sequence parallelism is jax_sdpa.ring_attention's job.

Layers, outside in: custom_vmap (under vmap the kernel's own batching runs: JAX's
custom_partitioning has no batching rule) -> custom_partitioning (the rule) -> the kernel
(our cuDNN FFI call, or the reference path with the same calling convention, for tests).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import custom_batching
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

from jax_sdpa import _ffi, reference_kernel

KERNELS = {
    "cudnn": (_ffi.sdpa_forward, _ffi.sdpa_backward),
    "reference": (reference_kernel.forward, reference_kernel.backward),
}
OPTIONAL = ("bias", "q_lengths", "kv_lengths", "dropout_seed")


@dataclasses.dataclass(frozen=True)
class Layout:
    """Which optional operands a call has, and the bias's broadcast axes (static)."""

    has_bias: bool
    bias_batch_full: bool  # bias [B, ...] rather than [1, ...]
    bias_heads_full: bool  # bias [., N, ...] rather than [., 1, ...]
    has_lengths: bool
    has_seed: bool
    groups: int  # query heads per key/value head

    def optional_names(self):
        return [name for name, present in zip(OPTIONAL, (
            self.has_bias, self.has_lengths, self.has_lengths, self.has_seed)) if present]


def _layout(query, key, bias, q_lengths, dropout_seed):
    return Layout(has_bias=bias is not None,
                  bias_batch_full=bias is not None and bias.shape[0] > 1,
                  bias_heads_full=bias is not None and bias.shape[1] > 1,
                  has_lengths=q_lengths is not None, has_seed=dropout_seed is not None,
                  groups=query.shape[-2] // key.shape[-2])


def _factors(layout):
    """Each operand's factors in Shardy's einsum-like notation."""
    heads = "k" if layout.groups == 1 else "(k g)"
    bias = (f"{'b' if layout.bias_batch_full else 'bias_b'} "
            f"{heads if layout.bias_heads_full else 'bias_n'} t s")
    return {"q": f"b t {heads} h", "k": "b s k h", "v": "b s k hv", "o": f"b t {heads} hv",
            "stats": f"b {heads} t", "d_o": f"b t {heads} hv", "dq": f"b t {heads} h",
            "dk": "b s k h", "dv": "b s k hv", "bias": bias, "dbias": bias, "q_lengths": "b",
            "kv_lengths": "b", "dropout_seed": "seed"}


def _rule(layout, inputs, outputs):
    factors = _factors(layout)
    rule = (", ".join(factors[n] for n in inputs) + " -> " +
            ", ".join(factors[n] for n in outputs))
    used = list(dict.fromkeys(
        rule.replace("(", " ").replace(")", " ").replace(",", " ").replace("->", " ").split()))
    # In order of first appearance: Shardy wants special factors sorted by index.
    replicated = tuple(f for f in used if f in ("t", "s", "h", "hv", "seed", "bias_b", "bias_n"))
    sizes = {"g": layout.groups} if layout.groups > 1 else {}
    return rule, replicated, sizes


def _axes_size(mesh, axes):
    if axes is None:
        return 1
    return math.prod(mesh.shape[a] for a in (axes if isinstance(axes, tuple) else (axes,)))


def _as_tuple(axes):
    if axes is None:
        return ()
    return axes if isinstance(axes, tuple) else (axes,)


def _shard_axes(mesh, arg_shapes):
    """(batch axes, head axes) to run on: the query's, where they divide B and K evenly."""
    sharding = arg_shapes[0].sharding
    spec = tuple(sharding.spec) if isinstance(sharding, NamedSharding) else ()
    spec = spec + (None,) * (4 - len(spec))
    batch_axes, head_axes = spec[0], spec[2]
    batch, kv_heads = arg_shapes[0].shape[0], arg_shapes[1].shape[2]
    if batch % _axes_size(mesh, batch_axes):
        batch_axes = None
    if kv_heads % _axes_size(mesh, head_axes):
        head_axes = None
    return batch_axes, head_axes


def _specs(layout, batch_axes, head_axes):
    """PartitionSpec of every operand and result name, for one choice of axes."""
    b, n = batch_axes, head_axes
    bias = PartitionSpec(b if layout.bias_batch_full else None,
                         n if layout.bias_heads_full else None, None, None)
    per_token = PartitionSpec(b, None, n, None)
    return {"q": per_token, "k": per_token, "v": per_token, "o": per_token, "d_o": per_token,
            "dq": per_token, "dk": per_token, "dv": per_token, "stats": PartitionSpec(b, n, None),
            "bias": bias, "dbias": bias, "q_lengths": PartitionSpec(b),
            "kv_lengths": PartitionSpec(b), "dropout_seed": PartitionSpec(None)}


def _per_shard_seed(arrays, names, sharded_axes):
    """Each shard drops with its own Philox offset (the offset's low word += shard index), so
    shards do not repeat one another's dropout pattern."""
    if "dropout_seed" not in names or not sharded_axes:
        return arrays
    i = names.index("dropout_seed")
    index = jax.lax.axis_index(sharded_axes).astype(jnp.uint32)
    return (*arrays[:i], arrays[i].at[2].add(index), *arrays[i + 1:])


def _partitioned(kernel_fn, layout, inputs, outputs, reduce_dbias):
    """custom_partitioning of kernel_fn(*arrays named `inputs`) -> arrays named `outputs`."""
    partitioned = custom_partitioning(kernel_fn)

    def partition(mesh, arg_shapes, result_shape):
        batch_axes, head_axes = _shard_axes(mesh, arg_shapes)
        specs = _specs(layout, batch_axes, head_axes)
        sharded_axes = _as_tuple(batch_axes) + _as_tuple(head_axes)
        # A bias shared by the shards of an axis gets its gradient summed over that axis.
        reduce_over = ()
        if reduce_dbias and "dbias" in outputs:
            if not layout.bias_batch_full:
                reduce_over += _as_tuple(batch_axes)
            if not layout.bias_heads_full:
                reduce_over += _as_tuple(head_axes)

        def lower_fn(*arrays):
            results = kernel_fn(*_per_shard_seed(arrays, inputs, sharded_axes))
            if reduce_over:
                i = outputs.index("dbias")
                results = (*results[:i], jax.lax.psum(results[i], reduce_over), *results[i + 1:])
            return results
        named = lambda name: NamedSharding(mesh, specs[name])  # noqa: E731
        return (mesh, lower_fn, tuple(named(n) for n in outputs),
                tuple(named(n) for n in inputs))

    rule, replicated, sizes = _rule(layout, inputs, outputs)
    partitioned.def_partition(partition=partition, sharding_rule=rule,
                              need_replication_factors=replicated, **sizes)

    # Under vmap: the kernel's own batching (our FFI calls fold vmapped axes into the batch).
    @custom_batching.custom_vmap
    def call(*arrays):
        return tuple(partitioned(*arrays))

    @call.def_vmap
    def call_vmap(axis_size, in_batched, *arrays):
        del axis_size
        results = tuple(jax.vmap(kernel_fn, in_axes=tuple(0 if b else None for b in in_batched))(
            *arrays))
        return results, tuple(True for _ in results)
    return call


@functools.lru_cache(maxsize=None)
def _forward_call(options, layout, command_buffers):
    del command_buffers  # part of the cache key only: it picks the FFI target at trace time
    inputs = ["q", "k", "v", *layout.optional_names()]
    forward = KERNELS[options.kernel][0]

    def kernel_fn(*arrays):
        named = dict(zip(inputs, arrays))
        return tuple(forward(named["q"], named["k"], named["v"], named.get("bias"),
                             named.get("q_lengths"), named.get("kv_lengths"),
                             named.get("dropout_seed"), options))
    return _partitioned(kernel_fn, layout, inputs, ["o", "stats"], reduce_dbias=False)


@functools.lru_cache(maxsize=None)
def _backward_call(options, layout, command_buffers):
    del command_buffers  # as in _forward_call
    inputs = ["q", "k", "v", "o", "stats", "d_o", *layout.optional_names()]
    with_dbias = layout.has_bias and options.bias_grad
    outputs = ["dq", "dk", "dv"] + (["dbias"] if with_dbias else [])
    backward = KERNELS[options.kernel][1]

    def kernel_fn(*arrays):
        named = dict(zip(inputs, arrays))
        results = backward(named["q"], named["k"], named["v"], named.get("bias"),
                           named.get("q_lengths"), named.get("kv_lengths"),
                           named.get("dropout_seed"), named["o"], named["stats"],
                           named["d_o"], options)
        return tuple(results[:3]) + ((results[3],) if with_dbias else ())
    return _partitioned(kernel_fn, layout, inputs, outputs, reduce_dbias=True)


def sdpa_forward(query, key, value, bias, q_lengths, kv_lengths, dropout_seed, options):
    """The kernel's forward with sharding rules: (output, stats float32 [B, N, T])."""
    layout = _layout(query, key, bias, q_lengths, dropout_seed)
    optional = [x for x in (bias, q_lengths, kv_lengths, dropout_seed) if x is not None]
    call = _forward_call(options, layout, _ffi.command_buffers())
    return tuple(call(query, key, value, *optional))


def sdpa_backward(query, key, value, bias, q_lengths, kv_lengths, dropout_seed, output, stats,
                  d_output, options):
    """The kernel's backward with sharding rules: (dq, dk, dv, dbias or None)."""
    layout = _layout(query, key, bias, q_lengths, dropout_seed)
    optional = [x for x in (bias, q_lengths, kv_lengths, dropout_seed) if x is not None]
    results = _backward_call(options, layout, _ffi.command_buffers())(
        query, key, value, output, stats, d_output.astype(output.dtype), *optional)
    return (*results[:3], results[3] if len(results) > 3 else None)
