"""Score modifiers (score_mod, alibi_slopes) on cuDNN against the float32 reference: outputs
and gradients, NaN-poisoned first, over the masks they combine with (built inside the
modifier), odd lengths, B = 1, GQA and every gradient pattern; the graph cache keyed by the
traced program; what cuDNN refuses named. Skipped without a GPU."""

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sdpa
from conftest import assert_close_to_reference, gradient_patterns, lowers_to, random_qkv
from poisoning import poison_outputs
from test_gpu import B, H, K, N, S, T, option_kwargs

pytestmark = pytest.mark.gpu

TABLE = jnp.linspace(-1.0, 1.0, N, dtype=jnp.float32)
MODS = {
    "alibi": dict(alibi_slopes=jax_sdpa.alibi_slopes(N)),
    "alibi per batch": dict(alibi_slopes=jnp.linspace(0.05, 0.5, B * N,
                                                      dtype=jnp.float32).reshape(B, N)),
    "relative buckets": dict(score_mod=lambda s, b, h, q, k: s + jnp.where(
        jnp.abs(q - k) < 8, TABLE[h], jnp.where(jnp.abs(q - k) < 64, 0.5 * TABLE[h], -1.0))),
    "head table plus a term": dict(score_mod=lambda s, b, h, q, k: s + TABLE[h] * (q - k) / 64.0),
    # int32 floor division (JAX's floor on top of cuDNN's division), float to int
    "integer division": dict(score_mod=lambda s, b, h, q, k: s + 0.05 * ((q - k) // 7)),
    "float to int": dict(score_mod=lambda s, b, h, q, k: s + 0.25 * (s * 1.7).astype(jnp.int32)),
    "user causal mask": dict(score_mod=lambda s, b, h, q, k: jnp.where(k <= q, s, -jnp.inf)),
    # rows 0..3 see no key: the masks' rule (the mean of the values), as the reference
    "empties rows": dict(score_mod=lambda s, b, h, q, k: jnp.where(q < 4, -jnp.inf, s)),
    # a mask description that tests positions: a score_mod (LOGICAL_OR and _AND nodes)
    "global | window": dict(mask=jax_sdpa.masks.global_tokens(4) |
                            jax_sdpa.masks.sliding_window(16, 0)),
    "window per head": dict(mask=jax_sdpa.masks.sliding_window((0, 8, 32, 100), (0, 0, 4, 0))),
}


def check(mod, option="", dtype=jnp.bfloat16, shape=(B, T, S, N, K, H)):
    batch, q_seq, kv_seq, heads, kv_heads, head_dim = shape
    rng = np.random.default_rng(zlib.crc32(f"{mod}{option}".encode()))
    q, k, v, d_out = random_qkv(len(mod) + len(option), batch, q_seq, kv_seq, heads, kv_heads,
                                head_dim, dtype)
    kwargs = dict(option_kwargs(option, rng) if option else {}, **MODS[mod])
    if mod == "alibi":  # the standard slopes of this shape's heads
        kwargs["alibi_slopes"] = jax_sdpa.alibi_slopes(heads)
    if mod == "alibi per batch":  # cuDNN takes slopes of the batch at B = 1 only
        kwargs["alibi_slopes"] = MODS[mod]["alibi_slopes"][:batch, :heads]
    bias = kwargs.pop("bias", None)

    def make(implementation, cast):
        def fn(q, k, v, bias):
            return jax_sdpa.dot_product_attention(*(cast(x) for x in (q, k, v)), bias=bias,
                                                  implementation=implementation, **kwargs)
        return jax.jit(fn)

    def run(fn, cotangent):
        out, vjp = jax.vjp(fn, q, k, v, bias)
        return (out, *vjp(cotangent)[:3])
    with poison_outputs():
        ours = run(make("cudnn", lambda x: x), d_out)
    ref = run(make("xla", lambda x: x.astype(jnp.float32)), d_out.astype(jnp.float32))
    assert_close_to_reference(ours, ref, context=f"{mod} {option}")


@pytest.mark.parametrize("mod", sorted(set(MODS) - {"alibi per batch"}))
def test_score_mod_on_cudnn(mod):
    check(mod)


def test_alibi_per_batch_at_batch_one():
    check("alibi per batch", shape=(1, T, S, N, K, H))


@pytest.mark.parametrize("option", ["causal", "causalBR", "window32_0+causal", "window16_8",
                                    "lengths+causal", "mask", "segments+causal"])
def test_alibi_with_masks(option):
    check("alibi", option)


@pytest.mark.parametrize("option", ["causal", "lengths", "window16_8+causal"])
def test_score_mod_with_masks(option):
    check("relative buckets", option)


@pytest.mark.parametrize("shape", [(1, 7, 7, 4, 4, 64), (1, 1, 33, 2, 1, 128),
                                   (2, 2501, 2501, 2, 2, 64)],
                         ids=["B1 T7", "T1 GQA", "T2501"])
def test_odd_lengths(shape):
    check("alibi", "causal", shape=shape)


def test_gradient_patterns():
    q, k, v, d_out = random_qkv(3, B, T, S, N, K, H, jnp.bfloat16)

    def f(implementation):
        return lambda q, k, v: jax_sdpa.dot_product_attention(
            q, k, v, is_causal=True, implementation=implementation, **MODS["relative buckets"])
    for name, pattern in gradient_patterns(f("cudnn")):
        ref = [pattern_ref for _, pattern_ref in gradient_patterns(f("xla")) if _ == name][0]
        up = [x.astype(jnp.float32) for x in (q, k, v, d_out)]
        assert_close_to_reference(pattern(q, k, v, d_out), ref(*up), context=name)


def test_a_bias_gradient_under_a_score_mod_is_refused_by_name():
    """As under soft-capping (dbias measured wrong there on cuDNN 9.19): the backward would take
    the reference path, which cannot run the score_mod's forward on cuDNN."""
    q, k, v, _ = random_qkv(8, B, T, S, N, K, H, jnp.bfloat16)
    bias = jnp.zeros((1, N, T, S), jnp.float32)
    with pytest.raises(NotImplementedError, match="bias gradient under score_mod"):
        jax.grad(lambda b: jax_sdpa.dot_product_attention(
            q, k, v, bias=b, implementation="cudnn",
            **MODS["alibi"]).astype(jnp.float32).sum())(bias)


def test_runs_our_targets_with_the_programs_as_attributes():
    q, k, v, _ = random_qkv(4, B, T, S, N, K, H, jnp.bfloat16)
    fn = jax.jit(jax.grad(lambda q: jax_sdpa.dot_product_attention(
        q, k, v, implementation="cudnn", **MODS["alibi"]).astype(jnp.float32).sum()))
    text = fn.lower(q).as_text()
    assert lowers_to(text, "forward", "dense") and lowers_to(text, "backward", "dense")
    assert "score_mod_tables" in text and "CMP" not in text  # ALiBi: no comparison node


def test_graph_cache_keys_the_program():
    """Two modifiers of one shape must not share a graph."""
    q, k, v, _ = random_qkv(5, B, T, S, N, K, H, jnp.bfloat16)
    plus = jax_sdpa.dot_product_attention(q, k, v, implementation="cudnn",
                                          score_mod=lambda s, b, h, qi, ki: s + 1.0 * qi / T)
    minus = jax_sdpa.dot_product_attention(q, k, v, implementation="cudnn",
                                           score_mod=lambda s, b, h, qi, ki: s - 1.0 * ki / S)
    ref = jax_sdpa.dot_product_attention(q, k, v, implementation="xla",
                                         score_mod=lambda s, b, h, qi, ki: s - 1.0 * ki / S)
    assert not np.allclose(np.asarray(plus, np.float32), np.asarray(minus, np.float32))
    np.testing.assert_allclose(np.asarray(minus, np.float32), np.asarray(ref, np.float32),
                               atol=2e-2)


def test_differentiating_closed_over_arrays_names_stop_gradient():
    q, k, v, _ = random_qkv(6, B, T, S, N, K, H, jnp.bfloat16)

    def loss(slopes):
        return jax_sdpa.dot_product_attention(q, k, v, implementation="cudnn",
                                              alibi_slopes=slopes).astype(jnp.float32).sum()
    with pytest.raises(ValueError, match="stop_gradient"):
        jax.grad(loss)(jax_sdpa.alibi_slopes(N))
    # the reference path differentiates them
    assert np.isfinite(jax.grad(lambda s: jax_sdpa.dot_product_attention(
        q, k, v, implementation="xla", alibi_slopes=s).astype(jnp.float32).sum())(
            jax_sdpa.alibi_slopes(N))).all()


@pytest.mark.parametrize("mod", [lambda s, b, h, q, k: 5.0 * jnp.tanh(s / 5.0),
                                 lambda s, b, h, q, k: s * (1.0 + 0.25 * TABLE[h]),
                                 lambda s, b, h, q, k: -1.9 * s],
                         ids=["soft-cap as score_mod", "head table times score", "negated"])
def test_modifiers_that_scale_the_score_are_refused_by_name(mod):
    """cuDNN 9.19's score-modifier backward gave non-finite or unwritten gradients where the
    derivative is not the incoming gradient (scripts/fuzz_cudnn.py): refused before cuDNN
    sees them; the reference path runs them (logits_soft_cap is cuDNN's own soft-cap)."""
    q, k, v, _ = random_qkv(8, B, T, S, N, K, H, jnp.bfloat16)
    with pytest.raises(NotImplementedError, match="derivative"):
        jax_sdpa.dot_product_attention(q, k, v, implementation="cudnn", score_mod=mod)


def test_what_cudnn_cannot_express_is_named():
    q, k, v, _ = random_qkv(7, B, T, S, N, K, H, jnp.bfloat16)
    with pytest.raises(NotImplementedError, match="bitwise"):
        jax_sdpa.dot_product_attention(q, k, v, implementation="cudnn",
                                       score_mod=lambda s, b, h, qi, ki: s + (qi & 1))
