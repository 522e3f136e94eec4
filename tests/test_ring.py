"""Ring attention under shard_map matches single-device attention: outputs, log-sum-exp and
gradients, contiguous and zigzag layouts. The reference-kernel tests run on the host devices
(tests/conftest.py asks for eight); the cuDNN-kernel tests on however many GPUs are visible."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jax_sdpa
from jax_sdpa.ring import ring_attention, zigzag_permute, zigzag_unpermute
from conftest import random_qkv, relative_error, lowers_to


def cpu_mesh(size):
    devices = jax.devices("cpu")
    if len(devices) < size:
        pytest.skip(f"needs {size} host devices, have {len(devices)}")
    return Mesh(np.array(devices[:size]), ("seq",))


def ring_and_single(mesh, is_causal, layout, implementation=None, strategy="ring"):
    """(ring fn, single-device fn) on global [B, S, N, H] arrays; the zigzag ring sees the
    sequence in zigzag order and gives it back in the natural one."""
    spec = P(None, "seq")
    size = mesh.shape["seq"]
    ring_blocks = jax.shard_map(
        lambda q, k, v: ring_attention(q, k, v, axis_name="seq", is_causal=is_causal,
                                       return_residual=True, layout=layout,
                                       implementation=implementation, strategy=strategy),
        mesh=mesh, in_specs=spec, out_specs=(spec, spec))

    def ring(q, k, v):
        if layout == "zigzag":
            q, k, v = (zigzag_permute(x, size) for x in (q, k, v))
        out, lse = ring_blocks(q, k, v)
        if layout == "zigzag":
            out, lse = zigzag_unpermute(out, size), zigzag_unpermute(lse, size)
        return out, lse

    def single(q, k, v):
        up = [x.astype(jnp.float32) for x in (q, k, v)]
        return jax_sdpa.dot_product_attention(*up, is_causal=is_causal, implementation="xla",
                                              return_residual=True)
    return jax.jit(ring), jax.jit(single)


def compare(ring, single, q, k, v, d_out, out_tol, grad_tol):
    with jax.default_matmul_precision("float32"):
        (out, lse), vjp = jax.vjp(ring, q, k, v)
        # On one device, unsharded: the same program for every mesh, compiled once per run
        # (the tests' compilation cache, tests/conftest.py).
        (out_ref, lse_ref), vjp_ref = jax.vjp(single, *jax.device_get((q, k, v)))
        grads = vjp((d_out, jnp.zeros_like(lse)))
        grads_ref = vjp_ref((jax.device_get(d_out).astype(jnp.float32),
                             jnp.zeros_like(lse_ref)))
    assert relative_error(out, out_ref) < out_tol
    assert relative_error(lse, lse_ref) < out_tol
    for name, a, b in zip(("dq", "dk", "dv"), grads, grads_ref):
        assert relative_error(a, b) < grad_tol, name


@pytest.mark.parametrize("devices,layout", [(1, "contiguous"), (2, "contiguous"),
                                            (4, "contiguous"), (8, "contiguous"),
                                            (2, "zigzag"), (4, "zigzag")])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
def test_ring_matches_single_device(devices, layout, is_causal, kv_heads):
    mesh = cpu_mesh(devices)
    q, k, v, d_out = random_qkv(devices + kv_heads, 2, 64, 64, 4, kv_heads, 16, jnp.float32)
    spec = NamedSharding(mesh, P(None, "seq"))
    q, k, v, d_out = (jax.device_put(x, spec) for x in (q, k, v, d_out))
    ring, single = ring_and_single(mesh, is_causal, layout)
    compare(ring, single, q, k, v, d_out, 1e-5, 1e-4)


@pytest.mark.parametrize("devices,layout", [(2, "contiguous"), (4, "contiguous"),
                                            (2, "zigzag"), (4, "zigzag")])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("kv_heads", [4, 1], ids=["mha", "mqa"])
def test_all_gather_strategy_matches_single_device(devices, layout, is_causal, kv_heads):
    """strategy="all_gather": K/V gathered once, one call per local query chunk over the keys
    up to its end (causal: bottom-right on the actual key count), dk/dv reduce-scattered."""
    mesh = cpu_mesh(devices)
    q, k, v, d_out = random_qkv(devices + kv_heads + 11, 2, 64, 64, 4, kv_heads, 16,
                                jnp.float32)
    spec = NamedSharding(mesh, P(None, "seq"))
    q, k, v, d_out = (jax.device_put(x, spec) for x in (q, k, v, d_out))
    ring, single = ring_and_single(mesh, is_causal, layout, strategy="all_gather")
    compare(ring, single, q, k, v, d_out, 1e-5, 1e-4)
    text = ring.lower(q, k, v).as_text()
    assert "all_gather" in text and "collective_permute" not in text


def test_zigzag_permute_round_trips():
    x = jnp.arange(2 * 24).reshape(2, 24)
    np.testing.assert_array_equal(zigzag_unpermute(zigzag_permute(x, 3), 3), x)
    np.testing.assert_array_equal(zigzag_permute(jnp.arange(8)[None], 2)[0], [0, 1, 6, 7, 2, 3, 4, 5])


@pytest.mark.gpu
@pytest.mark.parametrize("strategy", ["ring", "all_gather"])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_ring_on_gpus_with_cudnn_blocks(is_causal, layout, strategy):
    """Every visible GPU in the ring (one on nvidia-h200, two on nvidia-h200-x2), bf16 blocks
    on our cuDNN kernels (checked in the compiled program), GQA, against float32."""
    devices = jax.devices()
    mesh = Mesh(np.array(devices), ("seq",))
    q, k, v, d_out = random_qkv(5, 2, 512 * len(devices), 512 * len(devices), 8, 2, 128,
                                jnp.bfloat16)
    spec = NamedSharding(mesh, P(None, "seq"))
    q, k, v, d_out = (jax.device_put(x, spec) for x in (q, k, v, d_out))
    ring, single = ring_and_single(mesh, is_causal, layout, implementation="cudnn",
                                   strategy=strategy)
    text = jax.jit(jax.grad(lambda q, k, v: ring(q, k, v)[0].astype(jnp.float32).sum())).lower(
        q, k, v).compile().as_text()
    assert lowers_to(text, "forward") and lowers_to(text, "backward")
    compare(ring, single, q, k, v, d_out, 1e-2, 2e-2)


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
    with pytest.raises(ValueError, match="layout"):
        ring_attention(q, q, q, axis_name="seq", layout="striped")
    with pytest.raises(ValueError, match="strategy"):
        ring_attention(q, q, q, axis_name="seq", strategy="broadcast")
    with pytest.raises(ValueError, match="multiple"):
        ring_attention(q, q[:, :, :3], q[:, :, :3], axis_name="seq")
    with pytest.raises(ValueError, match="causal"):
        ring_attention(q, q[:, :4], q[:, :4], axis_name="seq", is_causal=True)


@pytest.mark.parametrize("gpu", [False, True], ids=["no_gpu", "gpu_patched_in"])
def test_ring_falls_back_as_dot_product_attention_does(gpu, monkeypatch):
    """The ring decides through jax_sdpa.call.planning too: a mesh cuDNN cannot serve takes the
    reference path, silently without a GPU, with one warning per calling line naming why with
    one (bfloat16, implementation=None); implementation='cudnn' raises NotImplementedError."""
    import warnings  # noqa: PLC0415
    if gpu:
        monkeypatch.setattr(jax_sdpa.limits.device, "device_reason", lambda: None)
    elif jax_sdpa.limits.device.device_reason() is None:
        pytest.skip("a GPU is present")
    mesh = Mesh(np.array(jax.devices("cpu")[:2]), ("seq",))
    x = jnp.ones((1, 64, 2, 32), jnp.bfloat16)

    def ring(implementation):
        return jax.shard_map(lambda q, k, v: ring_attention(
            q, k, v, axis_name="seq", implementation=implementation), mesh=mesh,
            in_specs=P(None, "seq"), out_specs=P(None, "seq"))(x, x, x)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        ring(None)
        ring(None)
    messages = [str(w.message) for w in caught if "ring attention" in str(w.message)]
    assert len(messages) == (1 if gpu else 0), messages
    assert all("reference path" in m for m in messages)
    with pytest.raises(NotImplementedError, match="implementation='cudnn' cannot run this ring"):
        ring("cudnn")
