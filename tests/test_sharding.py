"""Sharding rules (jax_sdpa.kernels.sharding) under jit: with q/k/v sharded over batch and/or heads
each device runs the kernel on its shard, and the compiled program has no collective around it
(the sum of a broadcast bias's gradient aside); any other layout is resharded, not refused.

The "xla" kernel (the reference) runs everywhere (CI: 8 CPU devices), through the same code path as
cuDNN with only the kernel swapped; the "cudnn" kernel runs on however many GPUs are visible
(a 1-device mesh on one GPU; nvidia-h200-x2 runs the 2-device meshes)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sdpa
from jax.sharding import NamedSharding, PartitionSpec as P

from jax_sdpa.limits import device
from jax_sdpa.call.spec import CallSpec
from jax_sdpa.kernels.vjp import dropout_seed
from conftest import kernel_attention, relative_error
import ragged_emulator

B, T, N, K, H = 8, 64, 16, 8, 64
COLLECTIVES = ("all-gather", "all-reduce", "all-to-all", "collective-permute", "reduce-scatter")
KERNELS = ["xla", pytest.param("cudnn", marks=pytest.mark.gpu)]


def auto_mesh(shape, names):
    """jit + NamedSharding as most code uses it: the compiler propagates shardings (Shardy)."""
    return jax.make_mesh(shape, names, axis_types=(jax.sharding.AxisType.Auto,) * len(names))


def mesh_shapes():
    n = len(jax.devices())
    shapes = {(n, 1), (1, n)}
    if n >= 4:
        shapes.add((2, n // 2))
    return sorted(shapes)


def inputs(kernel, bias_shape=None):
    dtype = jnp.bfloat16 if kernel == "cudnn" else jnp.float32
    keys = jax.random.split(jax.random.key(0), 5)
    q = jax.random.normal(keys[0], (B, T, N, H)).astype(dtype)
    k = jax.random.normal(keys[1], (B, T, K, H)).astype(dtype)
    v = jax.random.normal(keys[2], (B, T, K, H)).astype(dtype)
    d_out = jax.random.normal(keys[3], (B, T, N, H)).astype(dtype)
    bias = None if bias_shape is None else jax.random.normal(keys[4], bias_shape).astype(dtype)
    return q, k, v, d_out, bias


def step_fn(kernel, bias_shape=None, dropout=0.0):
    """Forward and backward as one jitted program, returning every result (no scalar loss, so
    no reduction of our own enters the compiled program)."""
    config = CallSpec(scale=0.125, window_right=0, implementation=kernel, dropout=dropout,
                          has_bias=bias_shape is not None, bias_grad=bias_shape is not None,
                          bias_batch_full=bias_shape is not None and bias_shape[0] > 1,
                          bias_heads_full=bias_shape is not None and bias_shape[1] > 1)

    def step(q, k, v, d_out, bias):
        optional = {} if bias is None else dict(bias=bias)
        if dropout:
            optional["dropout_seed"] = dropout_seed(jax.random.key(7))

        def attention(q, k, v, optional):
            return kernel_attention(q, k, v, config, **optional)[0]
        out, vjp = jax.vjp(attention, q, k, v, optional)
        d_q, d_k, d_v, d_optional = vjp(d_out)
        return (out, d_q, d_k, d_v, d_optional.get("bias"))
    return step


def compiled_collectives(fn, args, shardings):
    text = jax.jit(fn, in_shardings=shardings).lower(*args).compile().as_text()
    return {op for op in COLLECTIVES if re.search(rf"\b{op}(-start)?\(", text)}


def shard(mesh, spec, x):
    return None if x is None else NamedSharding(mesh, spec)


def check(kernel, mesh_shape, q_spec, kv_spec, bias_shape=None, bias_spec=P(),
          allowed=frozenset()):
    mesh = auto_mesh(mesh_shape, ("data", "model"))
    q, k, v, d_out, bias = inputs(kernel, bias_shape)
    step = step_fn(kernel, bias_shape)
    shardings = tuple(shard(mesh, spec, x) for spec, x in
                      ((q_spec, q), (kv_spec, k), (kv_spec, v), (q_spec, d_out),
                       (bias_spec, bias)))
    found = compiled_collectives(step, (q, k, v, d_out, bias), shardings)
    assert found <= set(allowed), f"unexpected collectives {found - set(allowed)}"
    sharded = jax.jit(step, in_shardings=shardings)(q, k, v, d_out, bias)
    single = jax.jit(step)(q, k, v, d_out, bias)
    for name, a, b in zip(("out", "dq", "dk", "dv", "dbias"), sharded, single):
        if b is not None:
            # Per-shard results are the single device's bit for bit; a dbias summed over
            # shards adds in another order (bf16 on cuDNN).
            tol = 1e-2 if (name == "dbias" and kernel == "cudnn") else 1e-5
            assert relative_error(a, b) < tol, name
    return sharded


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("mesh_shape", mesh_shapes())
@pytest.mark.parametrize("layout", ["batch", "heads", "batch+heads", "fsdp"])
def test_batch_and_head_sharding_has_no_collectives(kernel, mesh_shape, layout):
    spec = {"batch": P("data"), "heads": P(None, None, "model"),
            "batch+heads": P("data", None, "model"),
            "fsdp": P(("data", "model"))}[layout]  # batch over every device (FSDP activations)
    check(kernel, mesh_shape, spec, spec)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("bias_shape", [(1, N, T, T), (B, 1, T, T), (1, 1, T, T)])
def test_replicated_or_sharded_bias_gets_a_reduced_gradient(kernel, bias_shape):
    """A bias broadcast over the batch (or heads) is shared by the shards of that axis: its
    gradient is summed over them (the only collective); a full bias shards with the query."""
    mesh_shape = max(mesh_shapes(), key=lambda s: min(s))  # both axes > 1 where possible
    spec = P("data", None, "model")
    bias_spec = P("data" if bias_shape[0] > 1 else None, "model" if bias_shape[1] > 1 else None)
    shared = (bias_shape[0] == 1 and mesh_shape[0] > 1) or (bias_shape[1] == 1 and
                                                             mesh_shape[1] > 1)
    check(kernel, mesh_shape, spec, spec, bias_shape, bias_spec,
          allowed={"all-reduce"} if shared else set())


@pytest.mark.parametrize("kernel", KERNELS)
def test_mismatched_shardings_are_resharded(kernel):
    """q over heads, k/v over batch, or the sequence axis sharded: the rule reshards (any
    collective allowed) and the answer is the unsharded one."""
    n = len(jax.devices())
    everything = set(COLLECTIVES)
    check(kernel, (n, 1), P(None, None, "data"), P("data"), allowed=everything)
    check(kernel, (n, 1), P(None, "data"), P(None, "data"), allowed=everything)


@pytest.mark.parametrize("kernel", KERNELS)
def test_dropout_under_sharding_runs_per_shard(kernel):
    """Each shard drops with its own offset: two batch shards holding identical inputs do not
    produce identical outputs."""
    n = len(jax.devices())
    if n < 2:
        pytest.skip("needs two devices")
    mesh = auto_mesh((n, 1), ("data", "model"))
    q, k, v, d_out, _ = inputs(kernel)
    q, k, v, d_out = (jnp.concatenate([x[:B // n]] * n) for x in (q, k, v, d_out))
    spec = NamedSharding(mesh, P("data"))
    out = jax.jit(step_fn(kernel, dropout=0.3), in_shardings=(spec,) * 4 + (None,))(
        q, k, v, d_out, None)[0]
    out = np.asarray(out, np.float32)
    first, second = out[:B // n], out[B // n:2 * B // n]
    assert np.all(np.isfinite(first)) and not np.allclose(first, second)


@pytest.mark.parametrize("kernel", ["xla", "cudnn-emulated", pytest.param(
    "cudnn", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("stated", [False, True], ids=["checked", "stated_bound"])
def test_packed_rows_sharded_over_batch_run_per_device(kernel, stated, monkeypatch):
    """Packed segment ids, rows sharded over the batch: each device builds its own rows'
    document table and runs them, no collective (the device-side layout check included; or
    the documents' bound stated, with its per-row poisoning)."""
    if kernel == "cudnn-emulated":
        if device.device_reason() is None:
            pytest.skip("a GPU is present: the real kernel runs instead")
        monkeypatch.setattr(device, "device_reason", lambda: None)
        ragged_emulator.emulate(monkeypatch)
    implementation = "xla" if kernel == "xla" else "cudnn"
    n = len(jax.devices())
    mesh = auto_mesh((n, 1), ("data", "model"))
    q, k, v, d_out, _ = inputs(implementation)
    ids = jnp.asarray(np.repeat(np.arange(4, dtype=np.int32), T // 4)[None].repeat(B, 0))
    ids = ids.at[::2].set(ids[::2] * 3 + 1)  # other ids in every other row

    def step(q, k, v, d_out, ids):
        out, vjp = jax.vjp(lambda q, k, v: jax_sdpa.dot_product_attention(
            q, k, v, is_causal=True, query_segment_ids=ids, implementation=implementation,
            **stated_bound), q, k, v)
        return (out, *vjp(d_out))
    stated_bound = dict(max_document_length=T // 4, max_segments=4) if stated else {}
    spec = NamedSharding(mesh, P("data"))
    args = (q, k, v, d_out, ids)
    text = jax.jit(step, in_shardings=(spec,) * 5).lower(*args).compile().as_text()
    found = {op for op in COLLECTIVES if re.search(rf"\b{op}(-start)?\(", text)}
    assert not found, found
    sharded = jax.jit(step, in_shardings=(spec,) * 5)(*args)
    single = jax.jit(step)(*args)
    for a, b in zip(sharded, single):  # bf16 rounds where XLA fuses differently per shard
        assert relative_error(a, b) < (1e-5 if implementation == "xla" else 1e-3)


@pytest.mark.parametrize("layout", ["batch", "heads", "batch+heads"])
def test_fp8_framework_call_shards_and_reduces_its_amaxes(layout):
    """jax_sdpa.fp8 (the caller's scales, replicated) under batch/head sharding: each device
    runs its shard, the amaxes (forward results and the backward's parameter cotangents) are
    the maximum over the shards (an all-reduce, the only collective), and every result is the
    single device's."""
    from fp8_params import quantized_problem
    from jax_sdpa import fp8

    mesh_shape = max(mesh_shapes(), key=lambda s: min(s))
    mesh = auto_mesh(mesh_shape, ("data", "model"))
    q, k, v, d_out, _ = inputs("xla")
    q8, k8, v8, do8, params, _ = quantized_problem(q, k, v, d_out, causal=True, scale=0.125)

    def step(q8, k8, v8, do8, params):
        def attention(q8, k8, v8, params):
            return fp8.dot_product_attention(q8, k8, v8, fp8_params=params, scale=0.125,
                                             mask_type="CAUSAL")
        (out8, amax_s, amax_o), vjp = jax.vjp(attention, q8, k8, v8, params)
        dq8, dk8, dv8, d_params = vjp((do8, jnp.zeros_like(amax_s), jnp.zeros_like(amax_o)))
        return (out8, amax_s, amax_o, dq8, dk8, dv8,
                *(d_params[name] for name in fp8.AMAXES))
    spec = {"batch": P("data"), "heads": P(None, None, "model"),
            "batch+heads": P("data", None, "model")}[layout]
    shardings = (*(NamedSharding(mesh, spec) for _ in range(4)), NamedSharding(mesh, P()))
    args = (q8, k8, v8, do8, params)
    found = compiled_collectives(step, args, shardings)
    assert found <= {"all-reduce"}, f"unexpected collectives {found - {'all-reduce'}}"
    sharded = jax.jit(step, in_shardings=shardings)(*args)
    single = jax.jit(step)(*args)
    names = ("out", "amax_s", "amax_o", "dq", "dk", "dv", *fp8.AMAXES)
    for name, a, b in zip(names, sharded, single):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                      err_msg=name)
    assert all(float(x.reshape(())) > 0 for x in sharded[1:3] + sharded[6:])
