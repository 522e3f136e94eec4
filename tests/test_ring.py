"""Ring attention under shard_map matches single-device attention: outputs, log-sum-exp and
gradients. Runs on the host devices (tests/conftest.py asks for eight)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jax_sdpa
from jax_sdpa.ring import ring_attention
from conftest import random_qkv, relative_error


def cpu_mesh(size):
    devices = jax.devices("cpu")
    if len(devices) < size:
        pytest.skip(f"needs {size} host devices, have {len(devices)}")
    return Mesh(np.array(devices[:size]), ("seq",))


@pytest.mark.parametrize("devices", [1, 2, 4, 8])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
def test_ring_matches_single_device(devices, is_causal, kv_heads):
    mesh = cpu_mesh(devices)
    q, k, v, d_out = random_qkv(devices + kv_heads, 2, 64, 64, 4, kv_heads, 16, jnp.float32)
    spec = P(None, "seq")
    q, k, v, d_out = (jax.device_put(x, NamedSharding(mesh, spec)) for x in (q, k, v, d_out))
    ring = jax.jit(jax.shard_map(
        lambda q, k, v: ring_attention(q, k, v, axis_name="seq", is_causal=is_causal,
                                       return_residual=True),
        mesh=mesh, in_specs=spec, out_specs=(spec, spec)))

    def single(q, k, v):
        return jax_sdpa.dot_product_attention(q, k, v, is_causal=is_causal, implementation="xla",
                                              return_residual=True)
    with jax.default_matmul_precision("float32"):
        (out, lse), vjp = jax.vjp(ring, q, k, v)
        (out_ref, lse_ref), vjp_ref = jax.vjp(single, q, k, v)
        grads = vjp((d_out, jnp.zeros_like(lse)))
        grads_ref = vjp_ref((d_out, jnp.zeros_like(lse_ref)))
    assert relative_error(out, out_ref) < 1e-5
    assert relative_error(lse, lse_ref) < 1e-5
    for name, a, b in zip(("dq", "dk", "dv"), grads, grads_ref):
        assert relative_error(a, b) < 1e-4, name


def test_ring_bf16_is_close_to_float32():
    mesh = cpu_mesh(4)
    q, k, v, _ = random_qkv(3, 1, 64, 64, 4, 2, 16, jnp.bfloat16)
    spec = P(None, "seq")
    q, k, v = (jax.device_put(x, NamedSharding(mesh, spec)) for x in (q, k, v))
    ring = jax.jit(jax.shard_map(lambda q, k, v: ring_attention(q, k, v, axis_name="seq",
                                                                is_causal=True),
                                 mesh=mesh, in_specs=spec, out_specs=spec))
    out = ring(q, k, v)
    assert out.dtype == jnp.bfloat16
    expected = jax_sdpa.dot_product_attention(*(x.astype(jnp.float32) for x in (q, k, v)),
                                              is_causal=True, implementation="xla")
    assert relative_error(out, expected) < 1e-2


def test_ring_rejects_bad_blocks():
    q = jnp.zeros((1, 8, 4, 16))
    with pytest.raises(ValueError, match="multiple"):
        ring_attention(q, q[:, :, :3], q[:, :, :3], axis_name="seq")
    with pytest.raises(ValueError, match="causal"):
        ring_attention(q, q[:, :4], q[:, :4], axis_name="seq", is_causal=True)
