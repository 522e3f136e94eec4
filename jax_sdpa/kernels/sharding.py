"""Sharding rules for the kernels under jit (JAX's SPMD partitioner, Shardy).

With query/key/value sharded over batch and/or heads (data, tensor or FSDP-style parallelism),
each device runs the kernel on its own shard: no collective in the forward or backward, except
the sum of a broadcast bias's gradient over the devices that share the bias, and the maximum
of an FP8 call's amaxes over the shards (jax_sdpa.fp8: the caller's scales are replicated).
Any other sharding (a sequence or head_dim axis, or key/value sharded unlike the query) is
resharded to that layout by the rule, never an error. Sequence parallelism is jax_sdpa.ring's job.

Layers, outside in: custom_vmap (under vmap the kernel's own batching runs: JAX's
custom_partitioning has no batching rule) -> custom_partitioning (the rule) -> the kernel
(jax_sdpa/kernels/dispatch.py, which the CallSpec picks).
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

from jax_sdpa.kernels import dispatch as kernels
from jax_sdpa.call.spec import CallSpec
from jax_sdpa.pieces import plan as pieces_plan

# Arrays with no batch axis (everything else has it first).
_UNBATCHED = ("dropout_seed", "sinks")


def _factors(config: CallSpec, groups: int):
    """Each array's factors in Shardy's einsum-like notation, by name."""
    heads = "k" if groups == 1 else "(k g)"
    bias = (f"{'b' if config.bias_batch_full else 'bias_b'} "
            f"{heads if config.bias_heads_full else 'bias_n'} t s")
    return {"query": f"b t {heads} h", "key": "b s k h", "value": "b s k hv",
            "output": f"b t {heads} hv", "lse": f"b {heads} t", "d_output": f"b t {heads} hv",
            "dq": f"b t {heads} h", "dk": "b s k h", "dv": "b s k hv", "bias": bias,
            "dbias": bias, "q_lengths": "b", "kv_lengths": "b", "q_segment_ids": "b t",
            "kv_segment_ids": "b s", "dropout_seed": "seed", "sinks": heads,
            "fp8_factors": "fp8_factor fp8_row", "amaxes": "amax amax_row",
            "score_mod_tables": f"b score_mod_table {heads}"}


def _pieces_by_head(config) -> bool:
    """Whether the call's pieces (kernels/pieces.py) cut the heads: they name global heads, so
    each device of a head-sharded call runs its own heads' pieces (_on_shard)."""
    return any(piece.head_stop for piece in config.pieces + config.backward_pieces)


def _on_shard(config, shard, shards, q_heads):
    """The config of the `shard`-th of `shards` equal runs of the query heads: its heads'
    pieces, numbered from its first head; None where they keep no key (every row of them then
    sees none: no kernel runs)."""
    local = q_heads // shards
    start = shard * local
    forward, backward = (pieces_plan.on_heads(p, start, start + local, q_heads)
                         for p in (config.pieces, config.backward_pieces))
    if not forward and not backward:
        return None
    return dataclasses.replace(config, pieces=forward, backward_pieces=backward)


def _nothing_kept(inputs, outputs, *arrays):
    """What the kernels give heads that keep no key: output 0 and lse -inf (as pieces leave
    rows no piece covers, for the caller's repair), zero gradients."""
    named = dict(zip(inputs, arrays))
    query, key, value = named["query"], named["key"], named["value"]
    shapes = {"output": (query.shape[:-1] + value.shape[-1:], query.dtype),
              "dq": (query.shape, query.dtype), "dk": (key.shape, key.dtype),
              "dv": (value.shape, value.dtype),
              "lse": ((query.shape[0], query.shape[2], query.shape[1]), jnp.float32)}
    return tuple(jnp.full(shapes[name][0], -jnp.inf if name == "lse" else 0, shapes[name][1])
                 for name in outputs)


def _rule(config, groups, inputs, outputs):
    factors = _factors(config, groups)
    rule = (", ".join(factors[n] for n in inputs) + " -> " +
            ", ".join(factors[n] for n in outputs))
    used = list(dict.fromkeys(
        rule.replace("(", " ").replace(")", " ").replace(",", " ").replace("->", " ").split()))
    whole = ("t", "s", "h", "hv", "seed", "bias_b", "bias_n", "fp8_factor", "fp8_row", "amax",
             "amax_row", "score_mod_table")
    # In order of first appearance: Shardy wants special factors sorted by index.
    replicated = tuple(f for f in used if f in whole)
    sizes = {"g": groups} if groups > 1 else {}
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


def _specs(config, batch_axes, head_axes):
    """PartitionSpec of every array name, for one choice of axes."""
    b, n = batch_axes, head_axes
    bias = PartitionSpec(b if config.bias_batch_full else None,
                         n if config.bias_heads_full else None, None, None)
    per_token = PartitionSpec(b, None, n, None)
    return {"query": per_token, "key": per_token, "value": per_token, "output": per_token,
            "d_output": per_token, "dq": per_token, "dk": per_token, "dv": per_token,
            "lse": PartitionSpec(b, n, None), "bias": bias, "dbias": bias,
            "q_lengths": PartitionSpec(b), "kv_lengths": PartitionSpec(b),
            "q_segment_ids": PartitionSpec(b, None), "kv_segment_ids": PartitionSpec(b, None),
            "dropout_seed": PartitionSpec(None), "sinks": PartitionSpec(n),
            "fp8_factors": PartitionSpec(None, None), "amaxes": PartitionSpec(None, None),
            "score_mod_tables": PartitionSpec(b, None, n)}


def _per_shard_seed(arrays, names, sharded_axes):
    """Each shard drops with its own Philox offset (the offset's low word += shard index), so
    shards do not repeat one another's dropout pattern."""
    if "dropout_seed" not in names or not sharded_axes:
        return arrays
    i = names.index("dropout_seed")
    index = jax.lax.axis_index(sharded_axes).astype(jnp.uint32)
    return (*arrays[:i], arrays[i].at[2].add(index), *arrays[i + 1:])


def _partitioned(kernel_of, config, groups, inputs, outputs, reduce_dbias):
    """custom_partitioning of kernel_of(config)(*arrays named `inputs`) -> arrays named
    `outputs`."""
    kernel_fn = kernel_of(config)
    partitioned = custom_partitioning(kernel_fn)

    def partition(mesh, arg_shapes, result_shape):
        batch_axes, head_axes = _shard_axes(mesh, arg_shapes)
        shards = _axes_size(mesh, head_axes)
        if _pieces_by_head(config) and shards > 1:
            # Each device runs its own heads' pieces: one branch per run of heads.
            configs = [_on_shard(config, i, shards, arg_shapes[0].shape[2])
                       for i in range(shards)]
            branches = [functools.partial(_nothing_kept, inputs, outputs) if c is None
                        else kernel_of(c) for c in configs]
            run = lambda *arrays: jax.lax.switch(  # noqa: E731
                jax.lax.axis_index(head_axes), [lambda xs, f=f: tuple(f(*xs)) for f in branches],
                arrays)
        else:
            run = kernel_fn
        specs = _specs(config, batch_axes, head_axes)
        sharded_axes = _as_tuple(batch_axes) + _as_tuple(head_axes)
        # A bias shared by the shards of an axis gets its gradient summed over that axis.
        reduce_over = ()
        if reduce_dbias and "dbias" in outputs:
            if not config.bias_batch_full:
                reduce_over += _as_tuple(batch_axes)
            if not config.bias_heads_full:
                reduce_over += _as_tuple(head_axes)

        def lower_fn(*arrays):
            results = run(*_per_shard_seed(arrays, inputs, sharded_axes))
            if reduce_over:
                i = outputs.index("dbias")
                results = (*results[:i], jax.lax.psum(results[i], reduce_over), *results[i + 1:])
            if "amaxes" in outputs and sharded_axes:  # a tensor's amax is its shards' largest
                i = outputs.index("amaxes")
                results = (*results[:i], jax.lax.pmax(results[i], sharded_axes),
                           *results[i + 1:])
            return results
        named = lambda name: NamedSharding(mesh, specs[name])  # noqa: E731
        return (mesh, lower_fn, tuple(named(n) for n in outputs),
                tuple(named(n) for n in inputs))

    rule, replicated, sizes = _rule(config, groups, inputs, outputs)
    partitioned.def_partition(partition=partition, sharding_rule=rule,
                              need_replication_factors=replicated, **sizes)

    # Under vmap: the kernel's own batching (our FFI calls fold vmapped axes into the batch).
    @custom_batching.custom_vmap
    def call(*arrays):
        return tuple(partitioned(*arrays))

    @call.def_vmap
    def call_vmap(axis_size, in_batched, *arrays):
        if config.segments and not any(
                batched for name, batched in zip(inputs, in_batched) if name in _UNBATCHED):
            return _folded(kernel_fn, inputs, axis_size, in_batched, arrays)
        results = tuple(jax.vmap(kernel_fn, in_axes=tuple(0 if b else None for b in in_batched))(
            *arrays))
        return results, tuple(True for _ in results)
    return call


def _folded(kernel_fn, inputs, axis_size, in_batched, arrays):
    """vmap folded into the batch axis: one kernel call on [V * B, ...] arrays. Packed calls
    take this way, so that the device-side choice of their layout stays one choice (vmap of a
    lax.cond with a batched predicate would run both branches; the handler of a call with a
    device grid takes one grid for every slice)."""
    flat = []
    for name, batched, x in zip(inputs, in_batched, arrays):
        if name in _UNBATCHED:
            flat.append(x)
            continue
        if not batched:
            x = jnp.broadcast_to(x, (axis_size, *x.shape))
        flat.append(x.reshape(axis_size * x.shape[1], *x.shape[2:]))
    results = kernel_fn(*flat)
    unfolded = tuple(None if r is None else r.reshape(axis_size, -1, *r.shape[1:])
                     for r in results)
    return unfolded, tuple(True for _ in unfolded)


def partitioned(kernel_fn, config, groups, inputs, outputs):
    """kernel_fn(*arrays named `inputs`) -> arrays named `outputs` (_factors' names), with the
    kernels' sharding rule and batching: for entry points with kernels of their own
    (jax_sdpa.fp8)."""
    return _partitioned(lambda _: kernel_fn, config, groups, inputs, outputs,
                        reduce_dbias=False)


@functools.lru_cache(maxsize=None)
def _forward_call(config, groups):
    inputs = list(config.input_names())

    def kernel_of(config):
        def kernel_fn(*arrays):
            return tuple(kernels.forward(config, dict(zip(inputs, arrays))))
        return kernel_fn
    return _partitioned(kernel_of, config, groups, inputs, ["output", "lse"],
                        reduce_dbias=False)


@functools.lru_cache(maxsize=None)
def _backward_call(config, groups):
    inputs = list(config.input_names()) + ["output", "lse", "d_output"]
    with_dbias = config.has_bias and config.bias_grad
    outputs = ["dq", "dk", "dv"] + (["dbias"] if with_dbias else [])

    def kernel_of(config):
        def kernel_fn(*arrays):
            named = dict(zip(inputs, arrays))
            output, lse, d_output = (named.pop(n) for n in ("output", "lse", "d_output"))
            dq, dk, dv, dbias = kernels.backward(config, named, output, lse, d_output)
            return (dq, dk, dv) + ((dbias,) if with_dbias else ())
        return kernel_fn
    return _partitioned(kernel_of, config, groups, inputs, outputs, reduce_dbias=True)


def _groups(inputs):
    return inputs["query"].shape[-2] // inputs["key"].shape[-2]


def forward(config, inputs):
    """The kernel's forward with sharding rules: (output, lse float32 [B, N, T])."""
    call = _forward_call(config, _groups(inputs))
    return tuple(call(*(inputs[name] for name in config.input_names())))


def backward(config, inputs, output, lse, d_output):
    """The kernel's backward with sharding rules: (dq, dk, dv, dbias or None)."""
    call = _backward_call(config, _groups(inputs))
    results = call(*(inputs[name] for name in config.input_names()), output, lse,
                   d_output.astype(output.dtype))
    return (*results[:3], results[3] if len(results) > 3 else None)
