"""cuDNN path on an NVIDIA GPU against the float32 reference. Skipped without a GPU."""

import os
import subprocess
import sys
import textwrap
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sdpa
from jax_sdpa.call.spec import CallSpec
from conftest import (assert_close_to_reference, kernel_attention, random_qkv, relative_error,
                      lowers_to)
from poisoning import poison_outputs

pytestmark = pytest.mark.gpu


def cudnn_vjp(q, k, v, d_out, **kwargs):
    fn = jax.jit(lambda q, k, v: jax_sdpa.dot_product_attention(
        q, k, v, implementation="cudnn", **kwargs))
    out, vjp = jax.vjp(fn, q, k, v)
    return (out, *vjp(d_out))


def reference_vjp(q, k, v, d_out, vmapped=False, **kwargs):
    """Float32 reference on the upcast inputs: output, dq, dk, dv."""
    def fn(q, k, v):
        return jax_sdpa.dot_product_attention(q, k, v, implementation="xla", **kwargs)
    fn = jax.vmap(fn) if vmapped else fn
    upcast = [x.astype(jnp.float32) for x in (q, k, v, d_out)]
    out, vjp = jax.vjp(jax.jit(fn), *upcast[:3])
    return (out, *vjp(upcast[3]))


def test_seed_case_at_seed_tolerances():
    """The cuDNN frontend sample 51: b=4, h=12, s=1024, d=64, fp16, causal, scale 1/sqrt(d)."""
    q, k, v, d_out = random_qkv(42, 4, 1024, 1024, 12, 12, 64, jnp.float16)
    ours = cudnn_vjp(q, k, v, d_out, is_causal=True, scale=1 / np.sqrt(64))
    ref = reference_vjp(q, k, v, d_out, is_causal=True, scale=1 / np.sqrt(64))
    for name, a, b in zip(("O", "dQ", "dK", "dV"), ours, ref):
        assert a.dtype == jnp.float16
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b), atol=5e-3,
                                   rtol=3e-3, err_msg=name)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("kv_heads", [8, 4, 2], ids=["mha", "gqa2", "gqa4"])
@pytest.mark.parametrize("vmapped", [False, True], ids=["plain", "vmap"])
def test_dtypes_gqa_vmap(dtype, kv_heads, vmapped):
    q, k, v, d_out = random_qkv(kv_heads, 2, 256, 256, 8, kv_heads, 128, dtype)
    if vmapped:
        q, k, v, d_out = (jnp.stack([x, -x]) for x in (q, k, v, d_out))
        fn = jax.jit(jax.vmap(lambda q, k, v: jax_sdpa.dot_product_attention(
            q, k, v, is_causal=True, implementation="cudnn")))
        out, vjp = jax.vjp(fn, q, k, v)
        ours = (out, *vjp(d_out))
    else:
        ours = cudnn_vjp(q, k, v, d_out, is_causal=True)
    assert_close_to_reference(ours, reference_vjp(q, k, v, d_out, vmapped, is_causal=True))


@pytest.mark.parametrize("head_dim", [32, 64, 128, 256])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_head_dims(head_dim, is_causal):
    q, k, v, d_out = random_qkv(head_dim, 2, 512, 512, 4, 2, head_dim, jnp.bfloat16)
    assert_close_to_reference(cudnn_vjp(q, k, v, d_out, is_causal=is_causal),
                              reference_vjp(q, k, v, d_out, is_causal=is_causal))


@pytest.mark.parametrize("q_seq,kv_seq", [(384, 640), (640, 384), (1000, 1000), (1, 77), (77, 1)])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_sequence_lengths(q_seq, kv_seq, is_causal):
    q, k, v, d_out = random_qkv(q_seq + kv_seq, 2, q_seq, kv_seq, 4, 4, 64, jnp.float16)
    assert_close_to_reference(cudnn_vjp(q, k, v, d_out, is_causal=is_causal, scale=0.2),
                              reference_vjp(q, k, v, d_out, is_causal=is_causal, scale=0.2))


def test_return_residual_is_the_log_sum_exp():
    q, k, v, _ = random_qkv(5, 2, 300, 200, 8, 2, 64, jnp.bfloat16)
    out, lse = jax_sdpa.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn",
                                              return_residual=True, residual_dtype=jnp.float32)
    _, lse_ref = jax_sdpa.dot_product_attention(*(x.astype(jnp.float32) for x in (q, k, v)),
                                                is_causal=True, implementation="xla",
                                                return_residual=True)
    assert lse.shape == (2, 300, 8) and lse.dtype == jnp.float32
    assert relative_error(lse, lse_ref) < 1e-3
    _, lse_default = jax_sdpa.dot_product_attention(q, k, v, is_causal=True,
                                                    implementation="cudnn", return_residual=True)
    assert lse_default.dtype == jnp.bfloat16  # jax.nn's: the inputs' dtype
    np.testing.assert_array_equal(np.asarray(lse_default), np.asarray(lse.astype(jnp.bfloat16)))


def test_every_output_element_is_written():
    q, k, v, d_out = random_qkv(6, 2, 200, 136, 8, 4, 64, jnp.bfloat16)
    with poison_outputs():
        fn = jax.jit(lambda q, k, v: jax_sdpa.dot_product_attention(
            q, k, v, scale=0.125, is_causal=True, implementation="cudnn", return_residual=True))
        (out, stats), vjp = jax.vjp(fn, q, k, v)
        grads = vjp((d_out, jnp.zeros_like(stats)))
    for name, x in zip(("output", "stats", "dq", "dk", "dv"), (out, stats, *grads)):
        assert np.all(np.isfinite(np.asarray(x, np.float32))), f"{name} kept poisoned elements"
    assert_close_to_reference((out, *grads), reference_vjp(q, k, v, d_out, is_causal=True,
                                                           scale=0.125))


@pytest.mark.parametrize("mask", ["causal", "full", "window"])
def test_every_element_is_written_with_lengths(mask):
    """With sequence lengths the handler zero-fills only the tokens past each row's lengths,
    after cuDNN ran (a window, which can leave rows within them seeing nothing, zero-fills
    everything first): every element within them must be cuDNN's (poisoned before it runs),
    and rows past a length, or of a batch entry with no keys (or no queries), exact zeros."""
    q, k, v, d_out = random_qkv(8, 4, 257, 301, 8, 2, 64, jnp.bfloat16)
    q_lengths = jnp.array([257, 100, 0, 31], jnp.int32)
    kv_lengths = jnp.array([301, 7, 50, 0], jnp.int32)
    kwargs = dict(query_seq_lengths=q_lengths, key_value_seq_lengths=kv_lengths,
                  is_causal=mask == "causal",
                  local_window_size=(20, 5) if mask == "window" else None)
    with poison_outputs():
        ours = cudnn_vjp(q, k, v, d_out, **kwargs)
    for name, x in zip(("output", "dq", "dk", "dv"), ours):
        assert np.all(np.isfinite(np.asarray(x, np.float32))), f"{name} kept poisoned elements"
    # Exact zeros: query rows past a length or of an entry without keys, and keys past a
    # length or of an entry without queries (with a window, rows that see no key average
    # every value, as jax.nn's: the values' gradient reaches every key then).
    q_seen = np.where(kv_lengths > 0, q_lengths, 0)
    kv_seen = np.where(q_lengths > 0, kv_lengths, 0)
    past_q = np.arange(257)[None] >= q_seen[:, None]
    past_kv = np.arange(301)[None] >= kv_seen[:, None]
    out, dq, dk, dv = (np.asarray(x, np.float32) for x in ours)
    assert not np.any(out[past_q]) and not np.any(dq[past_q])
    assert not np.any(dk[past_kv])
    if mask != "window":
        assert not np.any(dv[past_kv])
    assert_close_to_reference(ours, reference_vjp(q, k, v, d_out, **kwargs), mask)


def test_compiled_hlo_calls_our_targets_only():
    q, k, v, _ = random_qkv(7, 1, 128, 128, 4, 4, 64, jnp.float16)
    grad = jax.grad(lambda q, k, v: jax_sdpa.dot_product_attention(
        q, k, v, is_causal=True).astype(jnp.float32).sum(), argnums=(0, 1, 2))
    text = jax.jit(grad).lower(q, k, v).compile().as_text()
    assert lowers_to(text, "forward") and lowers_to(text, "backward")
    assert "cudnn$fmha" not in text


def test_no_graph_rebuild_after_first_call():
    """fwd+bwd at the seed's size: after the first call every call is a graph-cache hit."""
    q, k, v, d_out = random_qkv(8, 4, 1024, 1024, 12, 12, 64, jnp.float16)
    step = jax.jit(lambda q, k, v, d: jax.vjp(lambda *a: jax_sdpa.dot_product_attention(
        *a, is_causal=True, implementation="cudnn"), q, k, v)[1](d))
    jax.block_until_ready(step(q, k, v, d_out))
    before = jax_sdpa.graph_cache_stats()
    for seed in range(3):
        q2, k2, v2, d2 = random_qkv(100 + seed, 4, 1024, 1024, 12, 12, 64, jnp.float16)
        jax.block_until_ready(step(q2, k2, v2, d2))
    after = jax_sdpa.graph_cache_stats()
    assert after["builds"] == before["builds"], (before, after)
    assert after["hits"] == before["hits"] + 6, (before, after)


def test_cudnn_failure_is_an_exception_and_the_next_call_works():
    # head_dim 60 (not a multiple of 8) passes the C++ shape checks, but cuDNN rejects it.
    # The Python API refuses it first, so the custom_vjp is called directly.
    q, k, v, _ = random_qkv(9, 1, 64, 64, 2, 2, 60, jnp.float16)
    with pytest.raises(Exception, match=r"cuDNN.*SdpaConfig\{forward.*head_dim=60"):
        jax.block_until_ready(jax.jit(lambda *a: kernel_attention(
            *a, CallSpec(0.1)))(q, k, v))
    q, k, v, _ = random_qkv(10, 1, 64, 64, 2, 2, 64, jnp.float16)
    out = jax_sdpa.dot_product_attention(q, k, v, implementation="cudnn")
    assert np.all(np.isfinite(np.asarray(out, np.float32)))


@pytest.mark.parametrize("order", ["backend_first", "extension_first"])
def test_import_order_in_a_fresh_process(order):
    """docs/DEVELOPING.md: a frontend extension once crashed when JAX's GPU backend came first."""
    first = "jax.devices()" if order == "backend_first" else "from jax_sdpa import _sdpa_ffi"
    second = "from jax_sdpa import _sdpa_ffi" if order == "backend_first" else "jax.devices()"
    script = textwrap.dedent(f"""
        import jax, jax.numpy as jnp
        {first}
        {second}
        import jax_sdpa
        q = jax.random.normal(jax.random.key(0), (2, 256, 4, 64), jnp.float32).astype(jnp.bfloat16)
        g = jax.grad(lambda q: jax_sdpa.dot_product_attention(
            q, q, q, is_causal=True, implementation="cudnn").astype(jnp.float32).sum())(q)
        print("ok", bool(jnp.isfinite(g.astype(jnp.float32)).all()))
    """)
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "ok True" in result.stdout


B, T, S, N, K, H = 2, 192, 256, 4, 2, 64


def option_kwargs(option, rng):
    """Keyword arguments of dot_product_attention for one named option combination."""
    kwargs = {}
    for part in option.split("+"):
        if part.startswith("bias"):
            shape = {"bias1NTS": (1, N, T, S), "biasBNTS": (B, N, T, S),
                     "biasB1TS": (B, 1, T, S), "bias11TS": (1, 1, T, S),
                     "biasB11S": (B, 1, 1, S)}[part]
            kwargs["bias"] = jnp.asarray(rng.normal(size=shape), jnp.float32)
        elif part == "mask":
            mask = rng.random((B, 1, T, S)) > 0.5
            mask[:, :, np.arange(T), np.arange(T)] = True  # every row sees a key
            kwargs["mask"] = jnp.asarray(mask)
        elif part == "maskB11S":
            mask = np.ones((B, 1, 1, S), bool)
            mask[1, ..., 100:] = False
            kwargs["mask"] = jnp.asarray(mask)
        elif part == "lengths":
            kwargs["query_seq_lengths"] = jnp.array([T, 77], jnp.int32)
            kwargs["key_value_seq_lengths"] = jnp.array([200, S], jnp.int32)
        elif part == "kvlengths":
            kwargs["key_value_seq_lengths"] = jnp.array([1, 130], jnp.int32)
        elif part == "kvzero":  # batch entry 0 has no keys: its rows are zeros on both paths
            kwargs["key_value_seq_lengths"] = jnp.array([0, 130], jnp.int32)
        elif part == "maskrows":  # rows 0..9 of batch 1 see no key: uniform average
            mask = rng.random((B, N, T, S)) > 0.5
            mask[1, :, :10] = False
            kwargs["mask"] = jnp.asarray(mask)
        elif part == "segments":  # three packed documents per row; some see no key
            q_ids = np.sort(rng.integers(0, 3, size=(B, T)), axis=1).astype(np.int32)
            kv_ids = np.sort(rng.integers(0, 3, size=(B, S)), axis=1).astype(np.int32)
            kwargs["query_segment_ids"] = jnp.asarray(q_ids)
            kwargs["kv_segment_ids"] = jnp.asarray(kv_ids)
        elif part == "causal":
            kwargs["is_causal"] = True
        elif part == "causalBR":  # bottom-right: query i sits at key i + S - T
            kwargs["is_causal"] = True
            kwargs["causal_alignment"] = "bottom_right"
        elif part.startswith("window"):
            left, right = part[len("window"):].split("_")
            kwargs["local_window_size"] = (int(left), int(right))
    return kwargs


def check_option(option, dtype=jnp.bfloat16, deterministic=False):
    rng = np.random.default_rng(zlib.crc32(option.encode()))
    q, k, v, d_out = random_qkv(len(option), B, T, S, N, K, H, dtype)
    kwargs = option_kwargs(option, rng)
    bias = kwargs.pop("bias", None)

    def make(implementation, cast):
        def fn(q, k, v, bias):
            return jax_sdpa.dot_product_attention(
                *(cast(x) for x in (q, k, v)), bias=bias, implementation=implementation,
                deterministic=deterministic, **kwargs)
        return jax.jit(fn)
    args = (q, k, v, bias)
    out, vjp = jax.vjp(make("cudnn", lambda x: x), *args)
    ours = (out, *vjp(d_out))
    up = lambda x: x.astype(jnp.float32)  # noqa: E731
    out_ref, vjp_ref = jax.vjp(make("xla", up), *args)
    ref = (out_ref, *vjp_ref(d_out.astype(jnp.float32)))
    assert_close_to_reference(ours, ref, context=option)
    return ours


OPTIONS = ["bias1NTS", "biasBNTS", "biasB1TS", "bias11TS", "biasB11S", "bias1NTS+causal",
           "mask", "maskB11S", "mask+causal", "lengths", "kvlengths", "kvzero", "lengths+causal",
           "mask+lengths", "window32_0", "window32_0+causal", "window16_8", "window16_8+causal",
           "window0_0", "bias1NTS+mask+lengths+window64_0",
           # shifted onto the top-left diagonal; with a bias; cuDNN's own bottom-right band
           "causalBR", "bias1NTS+causalBR", "window16_0+causalBR", "window100_4+causalBR",
           "maskrows", "maskrows+causal", "segments", "segments+causal", "segments+lengths"]


@pytest.mark.parametrize("option", OPTIONS)
def test_options_on_cudnn(option):
    check_option(option)


@pytest.mark.parametrize("option", ["biasB1TS+causal", "lengths+causal", "maskrows",
                                    "segments+causal", "causalBR"])
def test_options_fp16(option):
    check_option(option, dtype=jnp.float16)


def test_vmap_with_a_shared_bias():
    """vmap over q/k/v with one bias for the whole batch: the repeated-execution path."""
    q, k, v, d_out = (jnp.stack([x, -x, 2 * x]) for x in random_qkv(11, B, T, S, N, K, H,
                                                                     jnp.bfloat16))
    bias = jax.random.normal(jax.random.key(12), (1, N, T, S))

    def make(implementation, cast):
        def fn(q, k, v, bias):
            return jax.vmap(lambda q, k, v: jax_sdpa.dot_product_attention(
                cast(q), cast(k), cast(v), bias=bias, is_causal=True,
                implementation=implementation))(q, k, v)
        return jax.jit(fn)
    out, vjp = jax.vjp(make("cudnn", lambda x: x), q, k, v, bias)
    out_ref, vjp_ref = jax.vjp(make("xla", lambda x: x.astype(jnp.float32)), q, k, v, bias)
    ours, ref = (out, *vjp(d_out)), (out_ref, *vjp_ref(d_out.astype(jnp.float32)))
    assert_close_to_reference(ours, ref, context="vmap with a shared bias")


def test_deterministic_backward_is_bitwise_reproducible():
    first = check_option("bias1NTS+causal", deterministic=True)
    second = check_option("bias1NTS+causal", deterministic=True)
    for a, b in zip(first, second):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
