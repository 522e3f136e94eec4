"""jax_sdpa.flax.dot_product_attention as Flax's attention_fn: same outputs and parameter
gradients as Flax's default attention, in linen and nnx modules."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

flax = pytest.importorskip("flax")
from flax import linen, nnx  # noqa: E402

import jax_sdpa.flax  # noqa: E402
from conftest import relative_error  # noqa: E402

B, T, FEATURES, HEADS = 2, 16, 64, 4


def inputs(seed, dtype=jnp.float32, batch_shape=(B,)):
    return jax.random.normal(jax.random.key(seed), (*batch_shape, T, FEATURES)).astype(dtype)


def masks(kind):
    if kind == "none":
        return None
    causal = linen.make_causal_mask(jnp.ones((B, T)), dtype=jnp.bool_)
    lengths = jnp.array([T, T // 2])
    padding = linen.make_attention_mask(jnp.arange(T)[None] < lengths[:, None],
                                        jnp.arange(T)[None] < lengths[:, None])
    return {"causal": causal, "padding": padding,
            "causal_padding": linen.combine_masks(causal, padding)}[kind]


def assert_trees_close(ours, theirs, tol):
    """Relative error over all leaves together: single leaves such as the key projection's bias
    have an exactly-zero true gradient, where a per-leaf ratio would measure only noise."""
    flat = lambda tree: np.concatenate([np.ravel(np.asarray(x, np.float64))  # noqa: E731
                                        for x in jax.tree.leaves(tree)])
    assert relative_error(flat(ours), flat(theirs)) < tol


@pytest.mark.parametrize("mask_kind", ["none", "causal", "padding", "causal_padding"])
def test_linen_module_matches_default(mask_kind):
    x, mask = inputs(0), masks(mask_kind)

    def build(attention_fn):
        kwargs = {} if attention_fn is None else {"attention_fn": attention_fn}
        return linen.MultiHeadDotProductAttention(num_heads=HEADS, qkv_features=FEATURES,
                                                  deterministic=True, **kwargs)
    params = build(None).init(jax.random.key(1), x, mask=mask)

    def loss(params, module):
        out = module.apply(params, x, mask=mask)
        return jnp.sum(out * jnp.cos(out)), out
    with jax.default_matmul_precision("float32"):
        (_, out_ours), g_ours = jax.value_and_grad(loss, has_aux=True)(
            params, build(jax_sdpa.flax.dot_product_attention))
        (_, out_theirs), g_theirs = jax.value_and_grad(loss, has_aux=True)(params, build(None))
    assert relative_error(out_ours, out_theirs) < 1e-5
    assert_trees_close(g_ours, g_theirs, 1e-4)


@pytest.mark.parametrize("mask_kind", ["none", "padding"])
@pytest.mark.parametrize("is_causal", [False, True])
def test_nnx_module_matches_default(mask_kind, is_causal):
    x, mask = inputs(2), masks(mask_kind)

    def build(attention_fn):
        kwargs = {} if attention_fn is None else {"attention_fn": attention_fn}
        return nnx.MultiHeadAttention(num_heads=HEADS, in_features=FEATURES, decode=False,
                                      rngs=nnx.Rngs(3), **kwargs)
    ours, theirs = build(jax_sdpa.flax.dot_product_attention), build(None)

    def loss(module):
        out = module(x, mask=mask, is_causal=is_causal)
        return jnp.sum(out * jnp.cos(out)), out
    with jax.default_matmul_precision("float32"):
        (_, out_ours), g_ours = nnx.value_and_grad(loss, has_aux=True)(ours)
        (_, out_theirs), g_theirs = nnx.value_and_grad(loss, has_aux=True)(theirs)
    assert relative_error(out_ours, out_theirs) < 1e-5
    assert_trees_close(nnx.state(g_ours), nnx.state(g_theirs), 1e-4)


def test_several_batch_axes_with_mask():
    x = inputs(4, batch_shape=(2, 3))
    mask = linen.make_causal_mask(jnp.ones((2, 3, T)), dtype=jnp.bool_)
    q = k = v = x.reshape(2, 3, T, HEADS, FEATURES // HEADS)
    with jax.default_matmul_precision("float32"):
        ours = jax_sdpa.flax.dot_product_attention(q, k, v, mask=mask)
        theirs = linen.dot_product_attention(q, k, v, mask=mask)
    assert relative_error(ours, theirs) < 1e-5


def test_soft_cap_and_sinks_bound_with_partial():
    """Flax passes neither: bound with functools.partial they reach jax_sdpa's attention; with
    a fallback that cannot honour them the call refuses by name."""
    import functools  # noqa: PLC0415

    x = inputs(7)
    sinks = jnp.linspace(-1.0, 1.0, HEADS)
    bound = functools.partial(jax_sdpa.flax.dot_product_attention, logits_soft_cap=2.0,
                              sinks=sinks)
    module = nnx.MultiHeadAttention(num_heads=HEADS, in_features=FEATURES, decode=False,
                                    rngs=nnx.Rngs(3), attention_fn=bound)
    out = module(x, is_causal=True)
    q, k, v = (jnp.einsum("btf,fnh->btnh", x, layer.kernel[...]) + layer.bias[...]
               for layer in (module.query, module.key, module.value))
    direct = jax_sdpa.dot_product_attention(q, k, v, is_causal=True, logits_soft_cap=2.0,
                                            sinks=sinks)
    expected = jnp.einsum("btnh,nhf->btf", direct, module.out.kernel[...]) + module.out.bias[...]
    assert relative_error(out, expected) < 1e-5
    with pytest.raises(NotImplementedError, match="logits_soft_cap"):
        bound(q, k, v, module=object())


def test_alibi_bound_with_partial():
    """ALiBi and a score_mod reach jax_sdpa's attention from a Flax module through partial."""
    import functools  # noqa: PLC0415

    x = inputs(8)
    slopes = jax_sdpa.alibi_slopes(HEADS)
    bound = functools.partial(jax_sdpa.flax.dot_product_attention, alibi_slopes=slopes,
                              score_mod=lambda s, b, h, i, j: 0.5 * s)
    module = nnx.MultiHeadAttention(num_heads=HEADS, in_features=FEATURES, decode=False,
                                    rngs=nnx.Rngs(4), attention_fn=bound)
    out = module(x, is_causal=True)
    q, k, v = (jnp.einsum("btf,fnh->btnh", x, layer.kernel[...]) + layer.bias[...]
               for layer in (module.query, module.key, module.value))
    direct = jax_sdpa.dot_product_attention(q, k, v, is_causal=True, alibi_slopes=slopes,
                                            score_mod=lambda s, b, h, i, j: 0.5 * s)
    expected = jnp.einsum("btnh,nhf->btf", direct, module.out.kernel[...]) + module.out.bias[...]
    assert relative_error(out, expected) < 1e-5
    with pytest.raises(NotImplementedError, match="score_mod, alibi_slopes need"):
        bound(q, k, v, module=object())


@pytest.mark.parametrize("described", ["window & causal", "global | window"])
def test_nnx_module_takes_a_mask_description(described):
    """A jax_sdpa.masks description passed as an nnx module's mask reaches jax_sdpa as it is,
    and gives what its boolean form gives; Flax's own attention (sowing the weights) takes
    its boolean form."""
    masks = jax_sdpa.masks
    mask = {"window & causal": masks.sliding_window(3) & masks.causal(),
            "global | window": masks.global_tokens(2) | masks.sliding_window(2, 1)}[described]
    x = inputs(9)
    module = nnx.MultiHeadAttention(num_heads=HEADS, in_features=FEATURES, decode=False,
                                    rngs=nnx.Rngs(5),
                                    attention_fn=jax_sdpa.flax.dot_product_attention)
    boolean = mask.to_boolean(T, T)
    flax_module = nnx.MultiHeadAttention(num_heads=HEADS, in_features=FEATURES, decode=False,
                                         rngs=nnx.Rngs(5))
    # float32 products in float32 (a GPU's default is TF32: 4.5e-4 apart)
    with jax.default_matmul_precision("float32"):
        out = module(x, mask=mask)
        assert relative_error(out, module(x, mask=boolean)) < 1e-6
        assert relative_error(out, flax_module(x, mask=boolean)) < 1e-5
    class Sower:  # what a module asking for the weights offers Flax's attention
        sown = None

        def sow(self, collection, name, value):
            self.sown = value
    sower = Sower()
    q = jax.random.normal(jax.random.key(2), (B, T, HEADS, FEATURES // HEADS))
    jax_sdpa.flax.dot_product_attention(q, q, q, mask=mask, module=sower)
    kept = np.asarray(sower.sown) > 0
    np.testing.assert_array_equal(kept, np.broadcast_to(np.asarray(boolean), kept.shape))


@pytest.mark.parametrize("gpu", [False, True], ids=["no_gpu", "gpu_patched_in"])
def test_sow_weights_falls_back_to_flax(gpu, monkeypatch):
    """Sowing the weights runs Flax's attention: silently without a GPU (nothing is lost), with
    a warning naming why on one for bfloat16 (a speed cliff)."""
    if not gpu and jax_sdpa.limits.device.device_reason() is None:
        pytest.skip("a GPU is present")
    x = inputs(5).astype(jnp.bfloat16)
    module = linen.MultiHeadDotProductAttention(
        num_heads=HEADS, deterministic=True, attention_fn=jax_sdpa.flax.dot_product_attention,
        dtype=jnp.bfloat16)
    params = module.init(jax.random.key(6), x)
    if gpu:  # (only the sowing call: it never reaches our kernels)
        monkeypatch.setattr(jax_sdpa.limits.device, "device_reason", lambda: None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out, state = module.apply(params, x, sow_weights=True, mutable=["intermediates"])
    assert any("sow" in str(w.message) for w in caught) == gpu
    weights = jax.tree.leaves(state["intermediates"])[0]
    assert weights.shape == (B, HEADS, T, T)
    np.testing.assert_allclose(np.asarray(weights.sum(-1), np.float32), 1.0, rtol=1e-2)


def test_training_dropout_runs_through_jax_sdpa():
    """dropout_rate > 0 in training: our dropout (no fallback warning), reproducible per key,
    unbiased (the mean over keys approaches the deterministic output)."""
    x = inputs(7)
    module = linen.MultiHeadDotProductAttention(
        num_heads=HEADS, dropout_rate=0.3, attention_fn=jax_sdpa.flax.dot_product_attention)
    params = module.init(jax.random.key(8), x, deterministic=True)
    apply = jax.jit(lambda key: module.apply(params, x, deterministic=False,
                                             rngs={"dropout": key}))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = apply(jax.random.key(1))
    assert not [w for w in caught if "Flax's attention" in str(w.message)]
    np.testing.assert_array_equal(np.asarray(first), np.asarray(apply(jax.random.key(1))))
    assert not np.allclose(np.asarray(first), np.asarray(apply(jax.random.key(2))))
    plain = module.apply(params, x, deterministic=True)
    mean = jnp.mean(jnp.stack([apply(key) for key in jax.random.split(jax.random.key(3), 200)]),
                    axis=0)
    assert relative_error(mean, plain) < 0.1


@pytest.mark.gpu
@pytest.mark.parametrize("mask_kind", ["none", "key_padding"])
def test_nnx_bf16_on_cudnn(mask_kind):
    """On a GPU, a bf16 module's attention runs through our cuDNN custom calls. (Padding masks
    here hide keys only: rows that see no key at all differ between cuDNN and Flax.)"""
    x = inputs(7, jnp.bfloat16)
    mask = None
    if mask_kind == "key_padding":
        keys_valid = jnp.arange(T)[None] < jnp.array([T, T // 2])[:, None]
        mask = linen.make_attention_mask(jnp.ones((B, T), bool), keys_valid)
    features, heads = 256, 4  # head_dim 64
    x = jnp.tile(x, (1, 1, features // FEATURES))

    def build(attention_fn):
        kwargs = {} if attention_fn is None else {"attention_fn": attention_fn}
        return nnx.MultiHeadAttention(num_heads=heads, in_features=features, decode=False,
                                      dtype=jnp.bfloat16, rngs=nnx.Rngs(8), **kwargs)
    ours, theirs = build(jax_sdpa.flax.dot_product_attention), build(None)

    def loss(module):
        out = module(x, mask=mask, is_causal=True)
        return jnp.sum(out.astype(jnp.float32) ** 2), out
    graphdef, state = nnx.split(ours)
    text = jax.jit(jax.grad(lambda state: loss(nnx.merge(graphdef, state))[0])).lower(
        state).as_text()
    assert "jax_sdpa_dense_forward" in text and "jax_sdpa_dense_backward" in text
    (_, out_ours), g_ours = nnx.value_and_grad(loss, has_aux=True)(ours)
    (_, out_theirs), g_theirs = nnx.value_and_grad(loss, has_aux=True)(theirs)
    assert relative_error(out_ours, out_theirs) < 2e-2
    assert_trees_close(nnx.state(g_ours), nnx.state(g_theirs), 5e-2)
