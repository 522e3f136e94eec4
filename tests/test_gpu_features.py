"""cuDNN-only features beyond jax.nn on the GPU: attention dropout (checked against cuDNN's own
dropout mask) and a value head_dim different from the query's. Skipped without a GPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sdpa
from conftest import assert_close_to_reference, random_qkv, relative_error

pytestmark = pytest.mark.gpu

B, T, S, N, K, H = 2, 192, 256, 4, 2, 64
RATE = 0.2
# The dropout test reads cuDNN's keep mask off the output itself: with one-hot values (value j
# is the unit vector e_j, head_dim_v = S_MASK) output row i is row i of the dropped, rescaled
# weights. Values of any other content then go through the very same weights.
S_MASK = 128


def cudnn_keep_mask(q, k, bias, key, is_causal):
    """cuDNN's dropout keep mask (bool [B, N, T, S_MASK]) for this key, read through the public
    call: its output on one-hot values over the reference's undropped weights."""
    one_hot = jnp.broadcast_to(jnp.eye(S_MASK, dtype=q.dtype)[None, :, None, :],
                               (B, S_MASK, K, S_MASK))
    dropped = jax_sdpa.dot_product_attention(q, k, one_hot, bias=bias, is_causal=is_causal,
                                             dropout_rate=RATE, dropout_rng=key,
                                             implementation="cudnn")  # [B, T, N, S_MASK]
    up = [None if x is None else x.astype(jnp.float32) for x in (q, k, one_hot, bias)]
    weights = jax_sdpa.dot_product_attention(*up[:3], bias=up[3], is_causal=is_causal,
                                             implementation="xla")
    ratio = np.asarray(dropped, np.float32) * (1 - RATE) / np.maximum(
        np.asarray(weights), 1e-30)
    visible = np.asarray(weights) > 1e-3  # weights cuDNN's bf16 output resolves well
    return np.moveaxis(ratio, 2, 1), np.moveaxis(visible, 2, 1)  # [B, N, T, S_MASK]


@pytest.mark.parametrize("option", ["causal", "bias", "bias+causal"])
def test_dropout_matches_the_reference_with_cudnns_mask(option):
    q, k, v, d_out = random_qkv(21, B, T, S_MASK, N, K, H, jnp.bfloat16)
    v = jax.random.normal(jax.random.key(27), (B, S_MASK, K, S_MASK)).astype(jnp.bfloat16)
    d_out = jax.random.normal(jax.random.key(28), (B, T, N, S_MASK)).astype(jnp.bfloat16)
    key = jax.random.key(5)
    is_causal = "causal" in option
    bias = (jax.random.normal(jax.random.key(6), (1, N, T, S_MASK)).astype(jnp.bfloat16)
            if "bias" in option else None)
    ratio, visible = cudnn_keep_mask(q, k, bias, key, is_causal)
    # Where a weight is resolved, the output is the weight rescaled (kept) or zero (dropped).
    assert np.all(np.minimum(np.abs(ratio - 1), np.abs(ratio))[visible] < 0.05)
    keep = ratio > 0.5
    assert abs(keep[visible].mean() - (1 - RATE)) < 0.01, keep[visible].mean()

    def ours_fn(q, k, v, bias):
        return jax_sdpa.dot_product_attention(q, k, v, bias=bias, is_causal=is_causal,
                                              dropout_rate=RATE, dropout_rng=key,
                                              implementation="cudnn")

    def ref_fn(q, k, v, bias):
        up = [None if x is None else x.astype(jnp.float32) for x in (q, k, v, bias)]
        return jax_sdpa.attention_reference(*up[:3], up[3], scale=1 / np.sqrt(H),
                                            is_causal=is_causal, dropout_rate=RATE,
                                            dropout_keep=keep)[0]
    out, vjp = jax.vjp(jax.jit(ours_fn), q, k, v, bias)
    ours = (out, *vjp(d_out))
    out_ref, vjp_ref = jax.vjp(jax.jit(ref_fn), q, k, v, bias)
    ref = (out_ref, *vjp_ref(d_out.astype(jnp.float32)))
    assert_close_to_reference(ours, ref, context=f"dropout {option}")


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
