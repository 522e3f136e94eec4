"""score_mod and alibi_slopes on the reference path, against a plain-JAX oracle that
materializes the modified scores: ALiBi (both alignments, windows, GQA, [B, N] slopes), soft-cap
written as a score_mod, relative-distance buckets by comparisons, a learnable per-head table
(its gradient too); odd lengths, B = 1, every gradient pattern and vmap."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sdpa
from jax_sdpa.limits import device
from conftest import gradient_patterns, random_qkv, relative_error


def oracle(q, k, v, modify, is_causal=False, offset=0):
    """softmax(modify(scale Q K^T, b, n, i, j) + causal fill) V in float32, scores materialized
    by hand (query i at key i + offset under causal)."""
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    heads = q.shape[2]
    k, v = (jnp.repeat(x, heads // x.shape[2], axis=2) for x in (k, v))
    scores = jnp.einsum("btnh,bsnh->bnts", q, k, precision="highest") / np.sqrt(q.shape[-1])
    b, n, t, s = (jnp.arange(size)[tuple(slice(None) if a == axis else None for a in range(4))]
                  for axis, size in enumerate(scores.shape))
    scores = modify(scores, b, n, t, s)
    if is_causal:
        scores = jnp.where(t + offset >= s, scores, -0.7 * np.finfo(np.float32).max)
    return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(scores, axis=-1), v,
                      precision="highest")


def alibi_by_hand(slopes, t_len, s_len):
    def modify(scores, b, n, i, j):
        slope = slopes[b, n] if slopes.ndim == 2 else slopes[n]
        return scores - slope * jnp.abs(i + s_len - t_len - j)
    return modify


@pytest.mark.parametrize("t_len,s_len", [(1, 1), (7, 7), (7, 19), (33, 33)])
@pytest.mark.parametrize("per_batch", [False, True])
def test_alibi_is_the_hand_written_bias(t_len, s_len, per_batch):
    q, k, v, _ = random_qkv(0, 2, t_len, s_len, 4, 2, 16, jnp.float32)
    slopes = jax_sdpa.alibi_slopes(4)
    if per_batch:
        slopes = jnp.stack([slopes, slopes[::-1]])
    causal = t_len > 1
    out = jax_sdpa.dot_product_attention(q, k, v, alibi_slopes=slopes, is_causal=causal,
                                         causal_alignment="bottom_right")
    want = oracle(q, k, v, alibi_by_hand(slopes, t_len, s_len), causal, s_len - t_len)
    assert relative_error(out, want) < 1e-5


def test_standard_slopes():
    """Powers of two: 2^(-8 i / n); otherwise the nearest power's, then every other of 2n's."""
    np.testing.assert_allclose(jax_sdpa.alibi_slopes(8), [2.0 ** (-i) for i in range(1, 9)])
    twelve = np.asarray(jax_sdpa.alibi_slopes(12))
    np.testing.assert_allclose(twelve[:8], [2.0 ** (-i) for i in range(1, 9)])
    np.testing.assert_allclose(twelve[8:], [2.0 ** (-(i + 0.5)) for i in range(4)])
    with pytest.raises(ValueError, match="num_heads"):
        jax_sdpa.alibi_slopes(0)


def test_soft_cap_as_a_score_mod_is_logits_soft_cap():
    q, k, v, _ = random_qkv(1, 1, 7, 7, 2, 2, 16, jnp.float32)
    q = q * 4  # scores past the cap
    ours = jax_sdpa.dot_product_attention(
        q, k, v, is_causal=True, score_mod=lambda s, b, h, i, j: 5.0 * jnp.tanh(s / 5.0))
    built_in = jax_sdpa.dot_product_attention(q, k, v, is_causal=True, logits_soft_cap=5.0)
    assert relative_error(ours, built_in) < 1e-6


def relative_buckets(table):
    """T5-style: a per-head bias by the bucket of the distance i - j, buckets by comparison."""
    def modify(scores, b, n, i, j):
        distance = i - j
        bucket = jnp.where(distance < 0, 0, jnp.where(distance < 2, 1, jnp.where(
            distance < 8, 2, 3)))
        return scores + table[n, bucket]
    return modify


def test_relative_buckets_by_comparisons():
    q, k, v, _ = random_qkv(2, 2, 21, 21, 3, 3, 16, jnp.float32)
    table = jax.random.normal(jax.random.key(3), (3, 4))
    out = jax_sdpa.dot_product_attention(q, k, v, score_mod=relative_buckets(table))
    assert relative_error(out, oracle(q, k, v, relative_buckets(table))) < 1e-5


def test_a_learnable_table_gets_its_gradient():
    """Gradients flow to q, k, v and to the closed-over table, as the oracle's."""
    q, k, v, d_out = random_qkv(4, 1, 9, 9, 2, 1, 16, jnp.float32)
    table = jax.random.normal(jax.random.key(5), (2, 4))

    def loss(attention, q, k, v, table):
        return jnp.vdot(attention(q, k, v, table), d_out)
    ours = jax.grad(lambda *a: loss(lambda q, k, v, t: jax_sdpa.dot_product_attention(
        q, k, v, is_causal=True, score_mod=relative_buckets(t)), *a), argnums=(0, 1, 2, 3))
    want = jax.grad(lambda *a: loss(lambda q, k, v, t: oracle(
        q, k, v, relative_buckets(t), True), *a), argnums=(0, 1, 2, 3))
    for got, expected in zip(jax.jit(ours)(q, k, v, table), want(q, k, v, table)):
        assert relative_error(got, expected) < 1e-5


@pytest.mark.parametrize("t_len", [1, 7])
def test_every_gradient_pattern(t_len):
    q, k, v, d_out = random_qkv(6, 1, t_len, t_len, 2, 2, 16, jnp.float32)
    slopes = jax_sdpa.alibi_slopes(2)

    def attention(q, k, v):
        return jax_sdpa.dot_product_attention(q, k, v, is_causal=True, alibi_slopes=slopes)
    want_out = oracle(q, k, v, alibi_by_hand(slopes, t_len, t_len), True)
    _, want_vjp = jax.vjp(lambda q, k, v: oracle(q, k, v, alibi_by_hand(slopes, t_len, t_len),
                                                 True), q, k, v)
    want = (want_out, *want_vjp(d_out))
    for name, fn in gradient_patterns(attention):
        for got, expected in zip(fn(q, k, v, d_out), want):
            assert relative_error(got, expected) < 1e-5, name


def test_vmap_over_a_leading_axis():
    q, k, v, _ = random_qkv(7, 3, 7, 7, 2, 2, 16, jnp.float32)
    mod = lambda s, b, h, i, j: s - 0.25 * jnp.abs(i - j)  # noqa: E731
    batched = jax.vmap(lambda q, k, v: jax_sdpa.dot_product_attention(
        q[None], k[None], v[None], score_mod=mod)[0])(q, k, v)
    assert relative_error(batched, oracle(q, k, v, mod)) < 1e-5


def test_bad_arguments_are_named():
    q = jnp.ones((1, 4, 2, 16))
    with pytest.raises(TypeError, match="score_mod must be a function"):
        jax_sdpa.dot_product_attention(q, q, q, score_mod=3)
    with pytest.raises(TypeError, match=r"score_mod must be a function .*got <lambda>\(s, b\)"):
        jax_sdpa.dot_product_attention(q, q, q, score_mod=lambda s, b: s)
    with pytest.raises(ValueError, match="alibi_slopes must have shape"):
        jax_sdpa.dot_product_attention(q, q, q, alibi_slopes=jnp.ones((3,), jnp.float32))
    with pytest.raises(TypeError, match="alibi_slopes must be float32"):
        jax_sdpa.dot_product_attention(q, q, q, alibi_slopes=jnp.ones((2,), jnp.int32))
    with pytest.raises(ValueError, match="score_mod must return the score's shape"):
        jax_sdpa.dot_product_attention(q, q, q, score_mod=lambda s, *_: s.sum(-1))
    with pytest.raises(ValueError, match="not score_mod"):
        jax_sdpa.dot_product_attention(q.astype(jnp.bfloat16), q.astype(jnp.bfloat16),
                                       q.astype(jnp.bfloat16), fp8=True,
                                       score_mod=lambda s, *_: s)


@pytest.fixture
def cudnn_score_mods(monkeypatch):
    """A GPU as if there."""
    monkeypatch.setattr(jax_sdpa.limits.device, "device_reason", lambda: None)


def _lowered_grad(loss, *args):
    """StableHLO for CUDA of jit(grad(loss)) on this host."""
    return jax.jit(jax.grad(loss)).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def test_cudnn_calls_take_the_programs_and_their_tables(cudnn_score_mods):
    """On cuDNN a score modifier is our dense targets' string attributes (its programs) and a
    float32 [B, tables, N] operand, every attribute one the handlers decode."""
    from test_lowering import assert_decoded
    q = jnp.zeros((2, 64, 4, 64), jnp.bfloat16)
    slopes = jax_sdpa.alibi_slopes(4)
    text = _lowered_grad(lambda q: jax_sdpa.dot_product_attention(
        q, q, q, is_causal=True, alibi_slopes=slopes,
        implementation="cudnn").astype(jnp.float32).sum(), q)
    assert_decoded(text, "forward", "dense")
    assert_decoded(text, "backward", "dense")
    assert "score_mod_tables = 1" in text and "tensor<2x1x4xf32>" in text
    assert 'score_mod_bprop = "=g"' in text  # ALiBi's derivative passes the gradient through


def test_cudnn_takes_per_batch_slopes_only_at_batch_one(cudnn_score_mods):
    """cuDNN's modifier tensors cannot vary by batch (ffi/graph/score_mod.h): [B, N] slopes
    are refused by name at B > 1, lowered at B = 1."""
    q = jnp.zeros((2, 64, 4, 64), jnp.bfloat16)
    with pytest.raises(NotImplementedError, match="vary with the batch"):
        jax_sdpa.dot_product_attention(q, q, q, alibi_slopes=jnp.ones((2, 4), jnp.float32),
                                       implementation="cudnn")
    text = _lowered_grad(lambda q: jax_sdpa.dot_product_attention(
        q, q, q, alibi_slopes=jnp.ones((1, 4), jnp.float32),
        implementation="cudnn").astype(jnp.float32).sum(), q[:1])
    assert "score_mod_tables = 1" in text


def test_long_programs_stay_off_cudnn_by_name(cudnn_score_mods):
    """A program longer than limits/dense.MAX_SCORE_MOD_INSTRUCTIONS (longer ones crashed
    cuDNN 9.19) is refused by name; the reference path runs it."""
    q = jnp.ones((1, 16, 2, 64), jnp.bfloat16)
    mod = lambda s, b, h, i, j: s + 0.05 * ((i - j) // 7 + (i * 3 - j) % 5)  # noqa: E731
    with pytest.raises(NotImplementedError, match="pointwise nodes"):
        jax_sdpa.dot_product_attention(q, q, q, score_mod=mod, implementation="cudnn")
    assert np.isfinite(np.asarray(jax_sdpa.dot_product_attention(
        q, q, q, score_mod=mod, implementation="xla"), np.float32)).all()


@pytest.mark.parametrize("name", ["global | window", "window per head"])
def test_the_programs_that_crashed_cudnn_are_refused_before_it(cudnn_score_mods, name):
    """The two mask programs that killed the process while cuDNN 9.19 built their backward
    graph (27 and 31 nodes with their derivatives and conversions; tests/test_gpu_score_mod.py's
    sizes, and B = 1, T = S = 8192, 16 heads of 128 for the first) are refused by name as
    score_mods; as mask descriptions they run in pieces, which hold no score_mod."""
    mask = {"global | window": jax_sdpa.masks.global_tokens(4) |
            jax_sdpa.masks.sliding_window(16, 0),
            "window per head": jax_sdpa.masks.sliding_window((0, 8, 32, 100), (0, 0, 4, 0))}[name]
    shapes = [((2, 192, 4, 64), (2, 256, 2, 64))]
    if name == "global | window":
        mask = jax_sdpa.masks.global_tokens(64) | (jax_sdpa.masks.causal() &
                                                   jax_sdpa.masks.sliding_window(1024))
        shapes.append(((1, 8192, 16, 128), (1, 8192, 16, 128)))
    for q_shape, kv_shape in shapes:
        q = jax.ShapeDtypeStruct(q_shape, jnp.bfloat16)
        kv = jax.ShapeDtypeStruct(kv_shape, jnp.bfloat16)
        refused = jax_sdpa.explain(q, kv, kv, score_mod=jax_sdpa.masks.as_score_mod(mask),
                                   implementation="cudnn")
        assert refused.startswith("refused:") and "backward graph" in refused, refused
        planned = jax_sdpa.explain(q, kv, kv, mask=mask, implementation="cudnn")
        assert "the mask cut into" in planned and "score_mod" not in planned, planned


def test_float_comparisons_stay_off_cudnn_by_name(cudnn_score_mods):
    """cuDNN's score-modifier kernels find no engine for a comparison of float32 values
    (measured on 9.19): refused by name, as are functions whose derivative compares."""
    q = jnp.ones((1, 16, 2, 64), jnp.bfloat16)
    for mod in (lambda s, b, h, i, j: jnp.where(s > 0, s, 0.5 * s),
                lambda s, b, h, i, j: jax.nn.relu(s)):
        with pytest.raises(NotImplementedError, match="compares float32 values"):
            jax_sdpa.dot_product_attention(q, q, q, score_mod=mod, implementation="cudnn")


def test_cudnn_refuses_to_differentiate_closed_over_arrays(cudnn_score_mods):
    q = jnp.zeros((2, 64, 4, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="stop_gradient"):
        _lowered_grad(lambda s: jax_sdpa.dot_product_attention(
            q, q, q, alibi_slopes=s, implementation="cudnn").astype(jnp.float32).sum(),
            jax_sdpa.alibi_slopes(4))


def test_what_cudnn_cannot_express_falls_back_by_name(cudnn_score_mods):
    q = jnp.zeros((1, 16, 2, 64), jnp.bfloat16)
    with pytest.raises(NotImplementedError, match="bitwise `and`"):
        jax_sdpa.dot_product_attention(q, q, q, implementation="cudnn",
                                       score_mod=lambda s, b, h, qi, ki: s + (qi & 1))


def test_minus_infinity_from_a_score_mod_masks_like_a_mask():
    """A row a score_mod sets to -inf throughout follows the masks' empty-row rule (the plain
    mean of the values, as jax.nn), never NaN; partly, the same as the boolean mask."""
    q, k, v, d_out = random_qkv(11, 1, 6, 6, 2, 2, 16, jnp.float32)

    def hide(s, b, h, i, j):
        return jnp.where((i == 0) | (j > i), -jnp.inf, s)
    keep = (np.arange(6)[:, None] != 0) & (np.arange(6)[None, :] <= np.arange(6)[:, None])
    ours, vjp = jax.vjp(lambda q, k, v: jax_sdpa.dot_product_attention(
        q, k, v, score_mod=hide, implementation="xla"), q, k, v)
    masked, masked_vjp = jax.vjp(lambda q, k, v: jax_sdpa.dot_product_attention(
        q, k, v, mask=jnp.asarray(keep), implementation="xla"), q, k, v)
    np.testing.assert_allclose(np.asarray(ours), np.asarray(masked), atol=1e-6)
    for a, b in zip(vjp(d_out), masked_vjp(d_out)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)
    assert np.isfinite(np.asarray(ours)).all()
