"""Mask pieces as a model runs them: several calls chained in one jit (each link's output, or
its gradients, the next link's inputs), under jax.checkpoint and inside lax.scan over layers,
against the float32 reference run link by link. XLA's GPU fusion passes act across calls, so a
test of one call cannot see what these see (docs/DEVELOPING.md, "Our calls kept apart from
XLA's slices"). Skipped without a GPU."""

import functools

import jax
import jax.numpy as jnp
import pytest

import jax_sdpa
from conftest import random_qkv, relative_error
from jax_sdpa import masks

pytestmark = pytest.mark.gpu

SIZES = {"8k": (8192, 16, 16), "2501": (2501, 16, 4)}  # T = S, query heads, key/value heads


def descriptions(seq, heads):
    """The descriptions that run in pieces (issue #72's list), scaled to the length."""
    window = seq // 4
    per_head = tuple(seq // 32 * (1 + 4 * h // heads) for h in range(heads))  # 4 groups
    return {
        "prefix_lm": masks.prefix_lm(window),
        "two-sided window": masks.sliding_window(window, window),
        "global | causal window": masks.global_tokens(64) | (
            masks.causal() & masks.sliding_window(seq // 8)),
        "causal windows per head": masks.causal() & masks.sliding_window(per_head),
        "prefix_lm | window ahead": masks.prefix_lm(seq // 8) | masks.sliding_window(0, 64),
    }


def _attend(mask, implementation):
    def attend(q, k, v):
        out = jax_sdpa.dot_product_attention(q, k, v, mask=mask, implementation=implementation)
        return out.astype(q.dtype)
    return attend


def _forward_link(attend, dtype):
    """(q, k, v) -> ((the output as the next query, k, v), the output), as the issue's chain:
    the output is an average of values, so the chain contracts and its errors stay at one
    call's."""
    def link(q, k, v):
        out = attend(q, k, v)
        return (out, k, v), (out,)
    return link


def _vjp_link(inputs, d_out):
    """(q, k, v) -> ((the call's inputs, each plus 0 times its gradient), the gradients): every
    gradient feeds the next link (the program chains the calls; a NaN or an unwritten gradient
    would carry on), while each link's values stay those of one call, which the reference
    gives (the values of a chain of gradients amplify each link's rounding)."""
    def make(attend, dtype):
        def link(q, k, v):
            _, pullback = jax.vjp(attend, q, k, v)
            grads = pullback(d_out.astype(dtype))
            zero = jnp.minimum(jnp.abs(q[0, 0, 0, 0]), 0).astype(jnp.float32)  # not folded
            return tuple((x.astype(jnp.float32) + zero * g.astype(jnp.float32)).astype(dtype)
                         for x, g in zip(inputs, grads)), grads
        return link
    return make


def _chained(link, length):
    """One jit of `length` links, each link's values the next one's inputs: the last result."""
    def chain(q, k, v):
        values = (q, k, v)
        for _ in range(length):
            values, result = link(*values)
        return result
    return jax.jit(chain)


def _reference_links(make_link, mask, values, length):
    """Each of `length` links' results, each link one float32 reference program on the
    previous link's values rounded to their dtype (as the chain rounds them): one link's
    scores in memory at a time."""
    link = make_link(_attend(mask, "xla"), jnp.float32)

    def rounded(*xs):
        values, result = link(*(x.astype(jnp.float32) for x in xs))
        return tuple(y.astype(x.dtype) for x, y in zip(xs, values)), result
    rounded = jax.jit(rounded)
    found = []
    with jax.default_matmul_precision("float32"):
        for _ in range(length):
            values, result = rounded(*values)
            found.append(result)
    return found


@functools.lru_cache(maxsize=None)
def _inputs(size):
    seq, heads, kv_heads = SIZES[size]
    return random_qkv(seq + heads, 1, seq, seq, heads, kv_heads, 128, jnp.bfloat16)


@pytest.mark.parametrize("mode", ["forward", "vjp"])
@pytest.mark.parametrize("name", list(descriptions(64, 16)))
@pytest.mark.parametrize("size", list(SIZES))
def test_chained_calls_match_the_reference(size, name, mode):
    """Chains of 1, 2, 4 and 8 calls in one jit compile and match the reference's links."""
    seq, heads, _ = SIZES[size]
    q, k, v, d_out = _inputs(size)
    mask = descriptions(seq, heads)[name]
    assert "piece" in jax_sdpa.explain(q, k, v, mask=mask)  # the route under test
    make_link = _forward_link if mode == "forward" else _vjp_link((q, k, v), d_out)
    expected = _reference_links(make_link, mask, (q, k, v), 8)
    tolerance = 0.01 if mode == "forward" else 0.02
    for length in (1, 2, 4, 8):
        ours = _chained(make_link(_attend(mask, "cudnn"), q.dtype), length)(q, k, v)
        for which, (a, b) in enumerate(zip(ours, expected[length - 1])):
            error = relative_error(a, b)
            assert error < tolerance, f"{length} links, result {which}: {error:.2e}"


@pytest.mark.parametrize("layers", ["scan", "checkpoint"])
@pytest.mark.parametrize("name", list(descriptions(64, 16)))
def test_layers_match_the_reference(name, layers):
    """jax.grad over 4 layers of attention (a layer's output the next layer's query, each
    layer its own keys and values), as lax.scan over the stacked layers or as a Python loop
    of jax.checkpoint'ed layers, against the reference's gradients."""
    seq, heads, kv_heads = SIZES["2501"]
    mask = descriptions(seq, heads)[name]
    q, _, _, d_out = _inputs("2501")
    keys = jax.random.split(jax.random.key(7), 2)
    k, v = (jax.random.normal(key, (4, 1, seq, kv_heads, 128), jnp.float32).astype(q.dtype)
            for key in keys)

    def loss(implementation, q, k, v):
        attend = _attend(mask, implementation)

        def layer(x, kv):
            return attend(x, *kv), None
        if layers == "scan":
            out, _ = jax.lax.scan(layer, q, (k, v))
        else:
            out = q
            for i in range(4):
                out, _ = jax.checkpoint(layer)(out, (k[i], v[i]))
        return jnp.sum(out.astype(jnp.float32) * d_out.astype(jnp.float32))

    ours = jax.jit(jax.grad(functools.partial(loss, "cudnn"), argnums=(0, 1, 2)))(q, k, v)
    with jax.default_matmul_precision("float32"):
        expected = jax.jit(jax.grad(functools.partial(loss, "xla"), argnums=(0, 1, 2)))(
            *(x.astype(jnp.float32) for x in (q, k, v)))
    for which, (a, b) in enumerate(zip(ours, expected)):
        error = relative_error(a, b)
        assert error < 0.05, f"gradient {which}: {error:.2e}"
