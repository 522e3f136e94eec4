"""score_mod programs (jax_sdpa/score_mod/program.py) against the function they were written
from: each program, run in NumPy with cuDNN's meaning of its modes (score_mod_interpreter.py),
gives the function's scores and, from its derivative program, JAX's gradient."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sdpa
from jax_sdpa.reference.attention import alibi, modified_scores
from jax_sdpa.score_mod.program import UnsupportedScoreMod, translate

import random_score_mods
import score_mod_interpreter

B, N, T, S = 2, 3, 7, 9
HEAD_TABLE = jnp.asarray([0.5, -1.25, 2.0], jnp.float32)
BUCKETS = jnp.asarray([[0.1, 0.2, 0.3], [-0.4, 0.0, 0.6], [1.0, -1.0, 0.25]], jnp.float32)


def bucketed(s, b, h, q, k):
    distance = jnp.abs(q - k)
    return s + jnp.where(distance < 2, BUCKETS[h, 0],
                         jnp.where(distance < 5, BUCKETS[h, 1], BUCKETS[h, 2]))


FUNCTIONS = {
    "identity": lambda s, b, h, q, k: s,
    "alibi": alibi(jax_sdpa.alibi_slopes(N), T, S),
    "alibi per batch": alibi(jnp.arange(1, B * N + 1, dtype=jnp.float32).reshape(B, N) / 8,
                             T, S),
    "soft-cap": lambda s, b, h, q, k: 2.5 * jnp.tanh(s / 2.5),
    "causal by where": lambda s, b, h, q, k: jnp.where(q >= k, s, -jnp.inf),
    "masked first (constant true case)": lambda s, b, h, q, k: jnp.where(q < k, -1e9, s),
    "relative buckets": bucketed,
    "per-head table": lambda s, b, h, q, k: s * HEAD_TABLE[h] + b,
    "integer arithmetic": lambda s, b, h, q, k: s + (q - k) // 3 + (q * 7 - k) % 4,
    "float to int": lambda s, b, h, q, k: s + (s * 1.7).astype(jnp.int32),
    "sigmoid": lambda s, b, h, q, k: jax.nn.sigmoid(s) * s + jnp.clip(q - k, -3, 3),
    "exp log pow": lambda s, b, h, q, k: (jnp.log1p(jnp.exp(s)) + (s * s + 1) ** 1.5 +
                                          s ** 3 - jnp.expm1(s / 4) + jnp.exp2(s / 8)),
    "logic": lambda s, b, h, q, k: jnp.where(((q > 2) & (k < 6)) | ~(q == k), s, s / 2),
    "head-dependent mask": lambda s, b, h, q, k: jnp.where(k <= q + h, s, -jnp.inf),
    "constant": lambda s, b, h, q, k: jnp.float32(0.5) + 0 * q,
    "sqrt rsqrt": lambda s, b, h, q, k: jnp.sqrt(s * s + 1) + jax.lax.rsqrt(s * s + 2),
    "sign": lambda s, b, h, q, k: s * jnp.sign(q - k) + jnp.abs(q - 2 * k),
}


def _scores():
    return 3 * np.asarray(jax.random.normal(jax.random.key(1), (B, N, T, S)), np.float32)


@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_program_gives_the_function_and_its_gradient(name):
    fn = FUNCTIONS[name]
    program = translate(fn)
    scores = _scores()
    tables = np.asarray(program.tables(B, N))
    assert tables.shape == (B, program.table_count, N)
    expected = np.asarray(modified_scores(fn, jnp.asarray(scores)))
    got = score_mod_interpreter.run(program.forward, scores, tables)
    # A few float32 ulps apart: XLA's exp, log and pow differ by release (JAX 0.12's pow did).
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    gradient = np.asarray(jax.random.normal(jax.random.key(2), scores.shape), np.float32)
    _, pullback = jax.vjp(lambda x: modified_scores(fn, x), jnp.asarray(scores))
    expected_gradient = np.asarray(pullback(jnp.asarray(gradient))[0])
    got_gradient = score_mod_interpreter.run(program.backward, scores, tables, gradient)
    np.testing.assert_allclose(got_gradient, expected_gradient, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("seed", range(24))
def test_random_programs_give_the_function_and_its_gradient(seed):
    """Seeded random modifiers (random_score_mods.py), all within what cuDNN's nodes express:
    each translates and computes the function and JAX's gradient of it."""
    source, fn = random_score_mods.function(seed, HEAD_TABLE)
    program = translate(fn)
    scores = _scores()
    tables = np.asarray(program.tables(B, N))
    expected = np.asarray(modified_scores(fn, jnp.asarray(scores)))
    got = score_mod_interpreter.run(program.forward, scores, tables)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4, err_msg=source)
    gradient = np.asarray(jax.random.normal(jax.random.key(2), scores.shape), np.float32)
    _, pullback = jax.vjp(lambda x: modified_scores(fn, x), jnp.asarray(scores))
    expected_gradient = np.asarray(pullback(jnp.asarray(gradient))[0])
    got_gradient = score_mod_interpreter.run(program.backward, scores, tables, gradient)
    np.testing.assert_allclose(got_gradient, expected_gradient, rtol=1e-3, atol=1e-3,
                               err_msg=source)


def test_minus_infinity_becomes_the_masks_fill_where_asked():
    """As the reference path does, a -inf score of the forward becomes the masks' fill."""
    fn = FUNCTIONS["causal by where"]
    fill = -1e30
    program = translate(fn, masked_fill=fill)
    scores = _scores()
    got = score_mod_interpreter.run(program.forward, scores, np.zeros((B, 0, N), np.float32))
    expected = np.asarray(modified_scores(fn, jnp.asarray(scores)))
    np.testing.assert_array_equal(got, np.where(expected == -np.inf, np.float32(fill), expected))
    assert "c-inf" not in translate(FUNCTIONS["alibi"], masked_fill=fill).forward


def test_programs_read_only_live_instructions_and_tables():
    program = translate(FUNCTIONS["alibi"])
    assert program.backward == "=g"  # ALiBi adds to the score: its derivative passes through
    assert program.table_count == 1


def test_tables_follow_closed_over_arrays_under_jit_and_grad():
    def loss(slopes):
        program = translate(alibi(slopes, T, S))
        return program.tables(B, N).sum()
    slopes = jnp.asarray([1.0, 2.0, 3.0])
    assert float(jax.jit(loss)(slopes)) == pytest.approx(B * 6.0)
    np.testing.assert_allclose(jax.grad(loss)(slopes), B * np.ones(N))


@pytest.mark.parametrize("fn, words", [
    (lambda s, b, h, q, k: s + (q & 3), "bitwise `and`"),
    (lambda s, b, h, q, k: s + HEAD_TABLE[q % N], "index closed-over arrays by batch or head"),
    (lambda s, b, h, q, k: s.astype(jnp.bfloat16), "bfloat16"),
    (lambda s, b, h, q, k: s + jnp.zeros(4), "not elementwise"),
    (lambda s, b, h, q, k: s + jnp.arctan2(s, 2.0), "`atan2`"),
    (lambda s, b, h, q, k: jnp.where(s > 0, s, 0.1 * s), "compares float32 values"),
    (lambda s, b, h, q, k: jax.nn.relu(s), "compares float32 values"),  # its derivative
    (lambda s, b, h, q, k: jnp.sign(s) * 2.0, "compares float32 values"),
    (lambda s, b, h, q, k: s * 0.5 + (s * 3).astype(bool), "compares float32 values"),
])
def test_what_cudnn_cannot_express_is_named(fn, words):
    with pytest.raises(UnsupportedScoreMod, match=words.replace("`", ".")):
        translate(fn)
