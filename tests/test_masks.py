"""jax_sdpa.masks: each description's boolean form against a hand-written oracle, attention
with a description equal to attention with its boolean form (reference path, odd lengths,
B = 1, every gradient pattern, vmap), the descriptions cuDNN's own masks express lowered without
any [T, S] array, and the rest explained."""

import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sdpa
from jax_sdpa import masks
from jax_sdpa.pieces import plan as pieces_plan
from jax_sdpa.score_mod.program import translate
import random_masks
from conftest import gradient_patterns, random_qkv
import score_mod_interpreter

T, S = 13, 13


def oracle(name, t, s):
    i, j = np.arange(t)[:, None], np.arange(s)[None, :]
    return {"causal": j <= i, "window": (j >= i - 3) & (j <= i + 1), "prefix": (j < 4) | (j <= i),
            "global": (i < 2) | (j < 2)}[name]


BUILT = {"causal": masks.causal(), "window": masks.sliding_window(3, 1),
         "prefix": masks.prefix_lm(4), "global": masks.global_tokens(2)}


@pytest.mark.parametrize("name", sorted(BUILT))
@pytest.mark.parametrize("t, s", [(13, 13), (1, 9), (7, 9), (9, 7)])
def test_boolean_forms(name, t, s):
    got = np.asarray(BUILT[name].to_boolean(t, s))
    assert got.shape == (1, 1, t, s)
    np.testing.assert_array_equal(got[0, 0], oracle(name, t, s))


def test_documents_block_tables_and_combinations():
    ids = np.array([[0, 0, 0, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3]], np.int32)
    docs = np.asarray(masks.documents(ids).to_boolean(T, S))[0, 0]
    np.testing.assert_array_equal(docs, ids[0][:, None] == ids[0][None, :])
    table = np.array([[1, 0, 0, 1], [0, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 1]], bool)
    tiled = np.asarray(masks.block_table(table, 4, 4).to_boolean(T, S))[0, 0]
    np.testing.assert_array_equal(tiled, table[np.arange(T)[:, None] // 4,
                                               np.arange(S)[None, :] // 4])
    both = masks.causal() & masks.documents(ids)
    np.testing.assert_array_equal(np.asarray(both.to_boolean(T, S))[0, 0],
                                  oracle("causal", T, S) & docs)
    either = masks.global_tokens(2) | masks.sliding_window(3, 1)
    np.testing.assert_array_equal(np.asarray(either.to_boolean(T, S))[0, 0],
                                  oracle("global", T, S) | oracle("window", T, S))


def test_tile_structure_and_density():
    window = masks.sliding_window(128, 0)
    tiles = window.block_table(1024, 1024, 128, 128)[0, 0]
    assert tiles.sum() == 8 + 7  # the diagonal tiles and the ones just left of them
    assert window.density(1024, 1024) == pytest.approx(
        np.mean(oracle_window(1024, 128)), rel=1e-6)
    assert masks.causal().density(64, 64) == pytest.approx((64 * 65 / 2) / 64 ** 2)


def oracle_window(n, left):
    i, j = np.arange(n)[:, None], np.arange(n)[None, :]
    return (j >= i - left) & (j <= i)


MASKS = {
    "causal": lambda ids: masks.causal(),
    "window": lambda ids: masks.sliding_window(3, 1),
    "documents": lambda ids: masks.documents(ids),
    "causal & documents": lambda ids: masks.causal() & masks.documents(ids),
    "window & causal": lambda ids: masks.sliding_window(4, 2) & masks.causal(),
    "prefix": lambda ids: masks.prefix_lm(4),
    "global | window": lambda ids: masks.global_tokens(2) | masks.sliding_window(3, 0),
    "window per head": lambda ids: masks.sliding_window((0, 2, 5, 30), (0, 0, 1, 0)),
    "per-head boolean": lambda ids: masks.from_boolean(
        np.random.default_rng(0).random((4, T, S)) > 0.4),
}


@pytest.mark.parametrize("name", sorted(MASKS))
def test_attention_with_a_description_is_attention_with_its_boolean_form(name):
    q, k, v, d_out = random_qkv(1, 1, T, S, 4, 2, 32, jnp.float32)
    ids = jnp.asarray([[0, 0, 0, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3]], jnp.int32)
    mask = MASKS[name](ids)
    boolean = mask.to_boolean(T, S, 1)

    def described(q, k, v):
        return jax_sdpa.dot_product_attention(q, k, v, mask=mask, implementation="xla")

    def plain(q, k, v):
        return jax_sdpa.dot_product_attention(q, k, v, mask=boolean, implementation="xla")
    for (pattern, ours), (_, theirs) in zip(gradient_patterns(described),
                                            gradient_patterns(plain)):
        for a, b in zip(ours(q, k, v, d_out), theirs(q, k, v, d_out)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-5,
                                       err_msg=f"{name} {pattern}")


def test_vmap_over_a_described_mask():
    q, k, v, _ = random_qkv(2, 3, T, S, 2, 2, 32, jnp.float32)
    mask = masks.prefix_lm(5)
    fn = jax.vmap(lambda q, k, v: jax_sdpa.dot_product_attention(
        q, k, v, mask=mask, implementation="xla"))
    expected = jax_sdpa.dot_product_attention(q, k, v, mask=mask.to_boolean(T, S),
                                              implementation="xla")
    np.testing.assert_allclose(np.asarray(fn(q, k, v)), np.asarray(expected), atol=2e-6)


@pytest.mark.parametrize("name, route", [
    ("causal", "native"), ("window", "pieces"), ("documents", "native"),
    ("causal & documents", "native"), ("window & causal", "native"), ("prefix", "pieces"),
    ("global | window", "pieces"), ("window per head", "pieces"),
    ("per-head boolean", "pieces"), ("random boolean", "boolean"),
    ("global | documents", "boolean")])
def test_what_cudnn_masks_express_forms_no_scores_array(name, route, monkeypatch):
    """On cuDNN (lowered for CUDA here) a description its own masks express is no bias
    operand at all, nor is one cut into pieces (dense calls with bands of their own); the
    others are a boolean mask's bias, with a warning; explain says which."""
    monkeypatch.setattr(jax_sdpa.limits.device, "device_reason", lambda: None)
    q = jnp.zeros((1, 64, 4, 64), jnp.bfloat16)
    ids = jnp.repeat(jnp.arange(4, dtype=jnp.int32), 16)[None]
    mask = {"per-head boolean": lambda: masks.from_boolean(np.ones((4, 64, 64), bool)),
            "random boolean": lambda: masks.from_boolean(
                np.random.default_rng(0).random((64, 64)) > 0.5),
            "global | documents": lambda: masks.global_tokens(2) | masks.documents(ids),
            }.get(name, lambda: MASKS[name](ids))()
    with pytest.warns(RuntimeWarning) if route == "boolean" else _no_warning():
        text = jax.jit(lambda q: jax_sdpa.dot_product_attention(
            q, q, q, mask=mask, implementation="cudnn")).trace(q).lower(
                lowering_platforms=("cuda",)).as_text()
    assert ("has_bias = true" in text) == (route == "boolean")
    assert 'score_mod = "' not in text or 'score_mod = ""' in text
    assert "jax_sdpa_" in text  # our targets run it
    planned = jax_sdpa.explain(q, q, q, mask=mask, implementation="cudnn")
    assert ("the mask cut into" in planned) == (route == "pieces"), planned
    # (without the call's sizes: pieces where few, for every array of known values)
    expected = {"window": "native", "random boolean": "pieces"}.get(name, route)
    assert masks.explain(mask).startswith(
        {"native": "cuDNN's own masks", "pieces": "pieces", "boolean": "a boolean mask"}[expected])


def test_a_positional_mask_cudnn_cannot_run_as_a_score_mod_runs_as_its_boolean_form(
        monkeypatch):
    """Where the score_mod form would leave cuDNN (here: more nodes than it is run with) and
    the boolean form would not, the boolean form runs on cuDNN, with a warning naming why."""
    monkeypatch.setattr(jax_sdpa.limits.device, "device_reason", lambda: None)
    monkeypatch.setattr(jax_sdpa.limits.dense, "MAX_SCORE_MOD_INSTRUCTIONS", 2)
    monkeypatch.setattr(pieces_plan, "MAX_PIECES", 1)  # past the pieces' bound too
    monkeypatch.setattr(pieces_plan, "plan", pieces_plan.planned)  # (uncached)
    q = jnp.zeros((1, 64, 4, 64), jnp.bfloat16)
    with pytest.warns(RuntimeWarning, match="boolean .* as a score_mod .*pointwise nodes"):
        text = jax.jit(lambda q: jax_sdpa.dot_product_attention(
            q, q, q, mask=masks.prefix_lm(8), implementation="cudnn")).trace(q).lower(
                lowering_platforms=("cuda",)).as_text()
    assert "has_bias = true" in text and 'score_mod = ""' in text
    # The same on the reference path: both forms are exact there.
    k = jax.random.normal(jax.random.key(0), (1, 13, 2, 16), jnp.float32)
    np.testing.assert_allclose(
        np.asarray(jax_sdpa.dot_product_attention(k, k, k, mask=masks.prefix_lm(4))),
        np.asarray(jax_sdpa.dot_product_attention(k, k, k, mask=jnp.asarray(
            oracle("prefix", 13, 13)))), atol=2e-6)


class _no_warning:
    def __enter__(self):
        import warnings  # noqa: PLC0415
        self.catcher = warnings.catch_warnings()
        self.catcher.__enter__()
        warnings.simplefilter("error", RuntimeWarning)

    def __exit__(self, *exc):
        return self.catcher.__exit__(*exc)


def test_a_described_mask_meets_the_calls_own_keywords():
    """A window of the call's own and a window in the description: the boolean form (both
    apply), never one silently dropped."""
    q, k, v, _ = random_qkv(3, 1, T, S, 2, 2, 32, jnp.float32)
    ours = jax_sdpa.dot_product_attention(q, k, v, mask=masks.sliding_window(2, 0),
                                          local_window_size=(5, 5), implementation="xla")
    both = oracle("causal", T, S) & (np.arange(S)[None] >= np.arange(T)[:, None] - 2)
    expected = jax_sdpa.dot_product_attention(q, k, v, mask=jnp.asarray(both),
                                              implementation="xla")
    np.testing.assert_allclose(np.asarray(ours), np.asarray(expected), atol=2e-6)


def test_windows_per_head():
    got = np.asarray(masks.sliding_window((1, 3), (0, 1)).to_boolean(T, S))
    assert got.shape == (1, 2, T, S)
    i, j = np.arange(T)[:, None], np.arange(S)[None, :]
    np.testing.assert_array_equal(got[0, 0], (j >= i - 1) & (j <= i))
    np.testing.assert_array_equal(got[0, 1], (j >= i - 3) & (j <= i + 1))
    q = jnp.ones((1, T, 4, 16), jnp.float32)
    with pytest.raises(ValueError, match="written for 2 query heads; the query has 4"):
        jax_sdpa.dot_product_attention(q, q, q, mask=masks.sliding_window((1, 3)))
    with pytest.raises(ValueError, match="cannot be combined"):
        masks.sliding_window((1, 2)) | masks.sliding_window((1, 2, 3))


@pytest.mark.parametrize("build, words", [
    (lambda: masks.sliding_window(-1), "left must be an int >= 0"),
    (lambda: masks.block_table(np.ones((2, 2), bool), 0, 4), "tile_q must be an int >= 1"),
    (lambda: masks.prefix_lm(2.5), "prefix_length"),
    (lambda: masks.sliding_window((1, -2)), r"left\[1\] must be an int >= 0"),
])
def test_bad_descriptions_are_named(build, words):
    with pytest.raises(ValueError, match=words):
        build()


@pytest.mark.parametrize("build", [
    lambda: masks.from_boolean(np.ones((4, 4), np.float32)),
    lambda: masks.from_boolean(np.ones((4, 4), np.int32)),
    lambda: masks.block_table(np.ones((2, 2)), 4, 4),
    lambda: masks.causal() | 1,
    lambda: masks.sliding_window(2) & jnp.zeros((4, 4)),
])
def test_masks_that_are_not_boolean_are_refused(build):
    with pytest.raises(TypeError, match="must be boolean"):
        build()


def test_a_block_table_of_the_wrong_size_is_named():
    q, k, v, _ = random_qkv(4, 1, T, S, 2, 2, 32, jnp.float32)
    with pytest.raises(ValueError, match=r"ceil\(T / tile_q\)"):
        jax_sdpa.dot_product_attention(q, k, v, mask=masks.block_table(np.ones((2, 2), bool), 4, 4),
                                       implementation="xla")


@pytest.mark.parametrize("seed", range(12))
def test_random_positional_masks_as_cudnn_programs(seed):
    """The score-modifier program cuDNN would run for a random positional description
    (translated, then run in NumPy with cuDNN's meaning of each node) hides exactly the keys
    its boolean form hides, per head and at T != S."""
    draw = random.Random(seed)
    batch, heads, t, s = 2, 3, draw.choice([1, 7, 13]), draw.choice([5, 13, 16])
    mask = random_masks.positional(draw, heads, 3)
    program = translate(masks.as_score_mod(mask))
    scores = np.asarray(jax.random.normal(jax.random.key(seed), (batch, heads, t, s)),
                        np.float32)
    got = score_mod_interpreter.run(program.forward, scores,
                                    np.asarray(program.tables(batch, heads)))
    keep = np.broadcast_to(np.asarray(mask.to_boolean(t, s, batch)), scores.shape)
    np.testing.assert_array_equal(got == -np.inf, ~keep, err_msg=repr(mask))
    np.testing.assert_array_equal(got[keep], scores[keep])
