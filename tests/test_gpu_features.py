"""cuDNN-only features beyond jax.nn on the GPU: attention dropout (checked against cuDNN's own
dropout mask) and a value head_dim different from the query's. Skipped without a GPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sdpa
from jax_sdpa import _ffi
from jax_sdpa.cudnn_path import CudnnOptions, dropout_seed
from conftest import assert_close_to_reference, random_qkv, relative_error

pytestmark = pytest.mark.gpu

B, T, S, N, K, H = 2, 192, 256, 4, 2, 64
RATE = 0.2


def cudnn_keep_mask(q, k, v, bias, key, is_causal):
    """cuDNN's dropout keep mask (0/1, float32 [B, N, T, S]) for this key, dumped by a forward
    built for the purpose (a test-only output of our FFI forward)."""
    options = CudnnOptions(scale=1 / np.sqrt(H), window_right=0 if is_causal else -1,
                           dropout=RATE)
    fn = jax.jit(lambda q, k, v, bias: _ffi.sdpa_forward(
        q, k, v, bias, None, None, dropout_seed(key), options, dump_dropout_mask=True))
    output, _, keep = fn(q, k, v, bias)
    return output, np.asarray(keep)


@pytest.mark.parametrize("option", ["causal", "bias", "bias+causal"])
def test_dropout_matches_the_reference_with_cudnns_mask(option):
    q, k, v, d_out = random_qkv(21, B, T, S, N, K, H, jnp.bfloat16)
    key = jax.random.key(5)
    is_causal = "causal" in option
    bias = (jax.random.normal(jax.random.key(6), (1, N, T, S)).astype(jnp.bfloat16)
            if "bias" in option else None)
    dumped_output, keep = cudnn_keep_mask(q, k, v, bias, key, is_causal)
    # cuDNN writes 0 or 1 where a weight can be nonzero; what it leaves above the causal
    # diagonal (seen: values near -1) multiplies a zero weight and is never used.
    visible = np.tril(np.ones((T, S), bool)) if is_causal else np.ones((T, S), bool)
    assert set(np.unique(keep[..., visible])) <= {0.0, 1.0}
    assert abs(keep[..., visible].mean() - (1 - RATE)) < 0.01, keep[..., visible].mean()
    keep = np.where(visible, keep, 0.0)

    def ours_fn(q, k, v, bias):
        return jax_sdpa.dot_product_attention(q, k, v, bias=bias, is_causal=is_causal,
                                              dropout_rate=RATE, dropout_rng=key,
                                              implementation="cudnn")

    def ref_fn(q, k, v, bias):
        up = [None if x is None else x.astype(jnp.float32) for x in (q, k, v, bias)]
        return jax_sdpa.attention_reference(*up[:3], up[3], scale=1 / np.sqrt(H),
                                            is_causal=is_causal, dropout_rate=RATE,
                                            dropout_keep=keep > 0.5)[0]
    out, vjp = jax.vjp(jax.jit(ours_fn), q, k, v, bias)
    ours = (out, *vjp(d_out))
    out_ref, vjp_ref = jax.vjp(jax.jit(ref_fn), q, k, v, bias)
    ref = (out_ref, *vjp_ref(d_out.astype(jnp.float32)))
    assert_close_to_reference(ours, ref, context=f"dropout {option}")
    # The public call and the mask-dumping forward drop the same weights.
    assert relative_error(out, dumped_output) < 1e-2


def test_dropout_same_key_same_bits_other_key_other_answer():
    q, k, v, _ = random_qkv(22, B, T, S, N, K, H, jnp.bfloat16)
    fn = jax.jit(lambda key: jax_sdpa.dot_product_attention(
        q, k, v, is_causal=True, dropout_rate=RATE, dropout_rng=key, implementation="cudnn"))
    a, b, c = fn(jax.random.key(1)), fn(jax.random.key(1)), fn(jax.random.key(2))
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    assert relative_error(a, c) > 0.05


def test_dropout_averages_to_the_undropped_output_under_vmap():
    """vmap over keys (one cuDNN execution per key): the mean approaches no dropout."""
    q, k, v, _ = random_qkv(23, B, T, S, N, K, H, jnp.bfloat16)
    keys = jax.random.split(jax.random.key(3), 256)
    many = jax.jit(jax.vmap(lambda key: jax_sdpa.dot_product_attention(
        q, k, v, is_causal=True, dropout_rate=RATE, dropout_rng=key,
        implementation="cudnn").astype(jnp.float32)))(keys)
    plain = jax_sdpa.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
    assert relative_error(many[0], many[1]) > 0.05  # the keys really differ
    assert relative_error(many.mean(0), plain) < 0.06


@pytest.mark.parametrize("h,hv", [(192, 128), (128, 64), (64, 128), (256, 128)])
def test_value_head_dim_differs(h, hv):
    q, k, _, _ = random_qkv(24, B, T, S, N, K, h, jnp.bfloat16)
    v = jax.random.normal(jax.random.key(25), (B, S, K, hv)).astype(jnp.bfloat16)
    d_out = jax.random.normal(jax.random.key(26), (B, T, N, hv)).astype(jnp.bfloat16)

    def make(implementation, cast):
        return jax.jit(lambda q, k, v: jax_sdpa.dot_product_attention(
            cast(q), cast(k), cast(v), is_causal=True, implementation=implementation))
    out, vjp = jax.vjp(make("cudnn", lambda x: x), q, k, v)
    assert out.shape == (B, T, N, hv)
    out_ref, vjp_ref = jax.vjp(make("xla", lambda x: x.astype(jnp.float32)), q, k, v)
    assert_close_to_reference((out, *vjp(d_out)),
                              (out_ref, *vjp_ref(d_out.astype(jnp.float32))),
                              context=f"h={h} hv={hv}")
