"""The options jax.nn does not have (bottom-right causal alignment, dropout, packed sequences
as segment ids, a value head_dim != the query's), and jax.nn's own mask grid, on the reference
path against oracles written out by hand. Runs on any backend (CI: CPU)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sdpa
from conftest import assert_same_function, random_qkv, relative_error
from test_packing import emulated_cudnn  # noqa: F401


def ours(*args, **kwargs):
    return jax_sdpa.dot_product_attention(*args, implementation="xla", **kwargs)


def jax_nn(*args, **kwargs):
    return jax.nn.dot_product_attention(*args, implementation="xla", **kwargs)


@pytest.mark.parametrize("t,s", [(5, 12), (12, 12), (12, 5)])
@pytest.mark.parametrize("window", [None, (3, 0), (2, 1)])
def test_bottom_right_alignment_is_a_shifted_mask(t, s, window):
    """bottom_right: query i sits at key i + S - T; checked against an explicit mask."""
    q, k, v, d_out = random_qkv(3, 2, t, s, 4, 2, 16, jnp.float32)
    offset = s - t
    i = np.arange(t)[:, None] + offset
    j = np.arange(s)[None, :]
    mask = j <= i
    if window is not None:
        mask &= (j >= i - window[0]) & (j <= i + window[1])
    assert_same_function(lambda *a: ours(*a, is_causal=True, causal_alignment="bottom_right",
                                local_window_size=window),
                lambda *a: jax_nn(*a, mask=jnp.asarray(mask)[None, None]), (q, k, v), d_out)


def test_top_left_alignment_is_the_default():
    q, k, v, d_out = random_qkv(4, 2, 6, 10, 2, 2, 8, jnp.float32)
    assert_same_function(lambda *a: ours(*a, is_causal=True, causal_alignment="top_left"),
                lambda *a: jax_nn(*a, is_causal=True), (q, k, v), d_out)


def random_segments(rng, batch, length, count):
    """int32 [batch, length]: each row `count` contiguous documents of random lengths."""
    ids = np.zeros((batch, length), np.int32)
    for row in ids:
        starts = np.sort(rng.choice(np.arange(1, length), count - 1, replace=False))
        row[:] = np.searchsorted(starts, np.arange(length), side="right")
    return ids


@pytest.mark.parametrize("is_causal", [False, True])
def test_segment_ids_are_a_block_diagonal_mask(is_causal):
    b, t, n, h = 2, 20, 4, 16
    q, k, v, d_out = random_qkv(5, b, t, t, n, 2, h, jnp.float32)
    ids = random_segments(np.random.default_rng(1), b, t, 3)
    mask = ids[:, None, :, None] == ids[:, None, None, :]
    assert_same_function(lambda *a: ours(*a, query_segment_ids=jnp.asarray(ids), is_causal=is_causal),
                lambda *a: jax_nn(*a, mask=jnp.asarray(mask), is_causal=is_causal),
                (q, k, v), d_out)


def test_segment_ids_never_mix_documents():
    """Changing another document's keys and values leaves a document's output untouched."""
    b, t, n, h = 1, 16, 2, 8
    q, k, v, _ = random_qkv(6, b, t, t, n, n, h, jnp.float32)
    ids = jnp.asarray(np.repeat(np.arange(2), t // 2)[None], jnp.int32)
    out = ours(q, k, v, query_segment_ids=ids, is_causal=True)
    out2 = ours(q, k.at[:, t // 2:].mul(-3.0), v.at[:, t // 2:].add(5.0),
                query_segment_ids=ids, is_causal=True)
    np.testing.assert_array_equal(np.asarray(out[:, :t // 2]), np.asarray(out2[:, :t // 2]))
    assert not np.allclose(np.asarray(out[:, t // 2:]), np.asarray(out2[:, t // 2:]))


def test_segment_ids_with_different_lengths():
    b, t, s = 2, 6, 10
    q, k, v, d_out = random_qkv(7, b, t, s, 2, 1, 8, jnp.float32)
    q_ids = jnp.asarray(np.array([[0, 0, 1, 1, 1, 2]] * b), jnp.int32)
    kv_ids = jnp.asarray(np.array([[0, 0, 0, 1, 1, 1, 1, 2, 2, 2]] * b), jnp.int32)
    mask = q_ids[:, None, :, None] == kv_ids[:, None, None, :]
    assert_same_function(lambda *a: ours(*a, query_segment_ids=q_ids, kv_segment_ids=kv_ids),
                lambda *a: jax_nn(*a, mask=mask), (q, k, v), d_out)


@pytest.mark.parametrize("h,hv", [(16, 8), (24, 40)])
def test_value_head_dim_differs(h, hv):
    b, t, s, n, kh = 2, 7, 9, 4, 2
    q, k, _, _ = random_qkv(8, b, t, s, n, kh, h, jnp.float32)
    v = jax.random.normal(jax.random.key(9), (b, s, kh, hv))
    d_out = jax.random.normal(jax.random.key(10), (b, t, n, hv))

    def oracle(q, k, v):  # plain einsums, heads repeated for GQA
        k_rep, v_rep = (jnp.repeat(x, n // kh, axis=2) for x in (k, v))
        logits = jnp.einsum("btnh,bsnh->bnts", q, k_rep) / np.sqrt(h)
        logits = jnp.where(np.tril(np.ones((t, s), bool)), logits, -jnp.inf)
        return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(logits, -1), v_rep)
    assert_same_function(lambda *a: ours(*a, is_causal=True), oracle, (q, k, v), d_out)


def dropout_inputs():
    return random_qkv(11, 2, 16, 24, 4, 2, 16, jnp.float32)


def test_dropout_same_key_same_answer_other_key_other_answer():
    q, k, v, _ = dropout_inputs()
    key = jax.random.key(0)
    a = ours(q, k, v, dropout_rate=0.3, dropout_rng=key)
    b = jax.jit(lambda *x: ours(*x, dropout_rate=0.3, dropout_rng=key))(q, k, v)
    c = ours(q, k, v, dropout_rate=0.3, dropout_rng=jax.random.key(1))
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)
    assert relative_error(a, c) > 1e-2
    legacy = ours(q, k, v, dropout_rate=0.3, dropout_rng=jax.random.PRNGKey(0))
    assert legacy.shape == a.shape


def test_dropout_averages_to_the_undropped_output():
    """Dropout is unbiased: the mean over many keys approaches the output without dropout."""
    q, k, v, _ = dropout_inputs()
    keys = jax.random.split(jax.random.key(2), 400)
    many = jax.jit(jax.vmap(lambda key: ours(q, k, v, dropout_rate=0.2, dropout_rng=key)))(keys)
    plain = ours(q, k, v)
    assert relative_error(many.mean(0), plain) < 0.05
    assert relative_error(many[0], plain) > 0.1  # one draw really drops


def test_dropout_gradient_matches_the_same_mask():
    """The gradient of a dropped-out call is the gradient with that fixed keep mask."""
    q, k, v, d_out = dropout_inputs()
    key, rate = jax.random.key(3), 0.25
    keep = jax_sdpa.reference.attention.dropout_keep_mask(key, rate, (2, 4, 16, 24))

    def fixed(q, k, v):  # the same computation with the mask as a constant
        return jax_sdpa.attention_reference(q, k, v, scale=0.25, dropout_rate=rate,
                                            dropout_keep=keep)[0]
    assert_same_function(lambda *a: ours(*a, dropout_rate=rate, dropout_rng=key), fixed, (q, k, v),
                d_out)
    # ... and dropping with probability 0.25 is 1/(1-0.25)-scaled masking of the weights.
    with jax.default_matmul_precision("float32"):
        probs = jax.nn.softmax(jnp.einsum("btnh,bsnh->bnts", q, jnp.repeat(k, 2, 2)) * 0.25, -1)
        expected = jnp.einsum("bnts,bsnh->btnh", jnp.where(keep, probs / 0.75, 0.0),
                              jnp.repeat(v, 2, 2))
        assert relative_error(fixed(q, k, v), expected) < 1e-5


MASK_GRID = ["bias", "causal", "padding", "custom", "causal+padding", "custom+padding",
             "bias+causal", "causal+sliding_window"]


@pytest.mark.parametrize("case", MASK_GRID)
def test_jax_nn_mask_grid(case):
    """jax.nn's own mask test grid (bias, causal, padding, custom, and their combinations) with
    our function in place of jax.nn's; padded query rows are compared where jax.nn defines
    them (jax.nn's XLA path averages there, we give zeros, as cuDNN does)."""
    b, t, s, n, h = 2, 16, 16, 4, 16
    q, k, v, d_out = random_qkv(12, b, t, s, n, n, h, jnp.float32)
    rng = np.random.default_rng(13)
    kwargs = {}
    if "bias" in case:
        kwargs["bias"] = jnp.asarray(rng.normal(size=(1, n, t, s)), jnp.float32)
    if "custom" in case:
        mask = rng.random((b, 1, t, s)) > 0.3
        mask[:, :, np.arange(t), np.arange(t)] = True
        kwargs["mask"] = jnp.asarray(mask)
    if "causal" in case:
        kwargs["is_causal"] = True
    if "sliding_window" in case:
        kwargs["local_window_size"] = (4, 0)
    valid = jnp.ones((b, t, 1, 1))
    if "padding" in case:
        lengths = jnp.array([t, 9], jnp.int32)
        kwargs["query_seq_lengths"] = lengths
        kwargs["key_value_seq_lengths"] = jnp.array([s, 11], jnp.int32)
        valid = (jnp.arange(t)[None, :] < lengths[:, None])[:, :, None, None]
    assert_same_function(lambda *a: ours(*a, **kwargs) * valid, lambda *a: jax_nn(*a, **kwargs) * valid,
                (q, k, v), d_out)


@pytest.mark.parametrize("t,s,window,alignment", [
    (12, 12, (2, 0), "top_left"), (5, 12, (8, 0), "bottom_right"), (12, 12, (0, 3), "top_left"),
    (7, 16, (10, 1), "bottom_right")])
def test_fused_path_rows_that_see_no_key_are_the_references(t, s, window, alignment,
                                                            emulated_cudnn):
    """Key lengths that cut a row's window empty it: on the fused path (the emulated kernels
    on CPU) those rows and their gradients are the reference path's (the mean of the values)."""
    q, k, v, d_out = random_qkv(7, 3, t, s, 4, 2, 16, jnp.bfloat16)
    lengths = jnp.array([s, 2, 1], jnp.int32)

    def attention(implementation):
        return lambda q, k, v: jax_sdpa.dot_product_attention(
            q, k, v, local_window_size=window, causal_alignment=alignment, is_causal=True,
            key_value_seq_lengths=lengths, implementation=implementation)
    fused, reference = (jax.vjp(jax.jit(attention(i)), q, k, v) for i in ("cudnn", "xla"))
    for a, b in zip((fused[0], *fused[1](d_out)), (reference[0], *reference[1](d_out))):
        assert relative_error(a, b) < 2e-2
