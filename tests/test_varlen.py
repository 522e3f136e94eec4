"""varlen_attention ([total_tokens, N, H] with cumulative lengths) against the same sequences
attended one by one: values and gradients, self and cross, padding past the last sequence,
empty sequences; on the cuDNN path (emulated ragged calls without a GPU) and the reference."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sdpa
from conftest import gradient_patterns, reference_gradients, relative_error
from test_packing import emulated_cudnn  # noqa: F401 - the fixture

N, K, H = 4, 2, 16
SEEDS = 12


def tokens(seed, total, heads, dtype):
    return jax.random.normal(jax.random.key(seed), (total, heads, H)).astype(dtype)


def one_by_one(q, k, v, cu_q, cu_kv, **kwargs):
    """Each sequence alone through dot_product_attention; rows past the last sequence 0."""
    out = jnp.zeros(q.shape[:2] + v.shape[2:], jnp.float32)
    for i in range(len(cu_q) - 1):
        (a, b), (c, d) = cu_q[i:i + 2], cu_kv[i:i + 2]
        if b == a:
            continue
        if d == c:  # no keys: the reference's zero rows (as key lengths of 0)
            continue
        piece = jax_sdpa.dot_product_attention(
            q[a:b][None].astype(jnp.float32), k[c:d][None].astype(jnp.float32),
            v[c:d][None].astype(jnp.float32), implementation="xla", **kwargs)[0]
        out = out.at[a:b].set(piece)
    return out


CASES = {
    "self_causal": (np.array([0, 5, 5, 17, 30], np.int32), None, dict(is_causal=True)),
    "self_window_padding": (np.array([0, 9, 21, 26], np.int32), None,
                            dict(local_window_size=(3, 0))),
    "cross": (np.array([0, 7, 16, 30], np.int32), np.array([0, 12, 13, 24], np.int32), {}),
    # The second sequence has no keys: its queries are zeros, not the mean of other
    # sequences' values.
    "cross_without_keys": (np.array([0, 7, 16, 30], np.int32),
                           np.array([0, 12, 12, 24], np.int32), {}),
}


@pytest.mark.parametrize("path", ["cudnn-emulated", "xla"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_varlen_matches_sequences_one_by_one(name, path, emulated_cudnn):  # noqa: F811
    cu_q, cu_kv, kwargs = CASES[name]
    total_q, total_kv = 32, 32 if cu_kv is None else 28
    q = tokens(1, total_q, N, jnp.bfloat16)
    k, v = tokens(2, total_kv, K, jnp.bfloat16), tokens(3, total_kv, K, jnp.bfloat16)
    d_out = tokens(4, total_q, N, jnp.float32)
    implementation = "cudnn" if path == "cudnn-emulated" else "xla"

    def ours(q, k, v):
        return jax_sdpa.varlen_attention(q, k, v, jnp.asarray(cu_q),
                                         None if cu_kv is None else jnp.asarray(cu_kv),
                                         implementation=implementation, **kwargs)

    def expected(q, k, v):
        return one_by_one(q, k, v, cu_q, cu_q if cu_kv is None else cu_kv, **kwargs)
    out, vjp = jax.vjp(jax.jit(ours), q, k, v)
    out_ref, vjp_ref = jax.vjp(jax.jit(expected), q, k, v)
    assert out.shape == (total_q, N, H) and out.dtype == jnp.bfloat16
    assert relative_error(out, out_ref) < 1e-2
    assert np.all(np.asarray(out, np.float32)[cu_q[-1]:] == 0)  # padding rows
    for a, b in zip(vjp(d_out.astype(jnp.bfloat16)), vjp_ref(d_out)):
        assert relative_error(a, b) < 2e-2


def _random_cu(rng, total):
    """Cumulative lengths of random sequences (some empty; no more of them than tokens, which
    varlen_attention refuses) over total tokens, maybe leaving a tail of padding."""
    cuts = np.sort(rng.integers(0, total + 1, int(rng.integers(0, min(6, total - 1) + 1))))
    last = cuts[-1] if len(cuts) else 0
    end = total if rng.random() < 0.5 else int(rng.integers(last, total + 1))
    return np.concatenate([[0], cuts, [end]]).astype(np.int32)


@pytest.mark.parametrize("seed", range(SEEDS))
def test_random_varlen_matches_sequences_one_by_one(seed, emulated_cudnn):  # noqa: F811
    """Random sequences (empty ones, a padding tail), self (full, causal, window) or cross,
    GQA, the bound stated or not, on the cuDNN path (emulated without a GPU)."""
    rng = np.random.default_rng(700 + seed)
    total_q = int(rng.integers(1, 40))
    cu_q = _random_cu(rng, total_q)
    kv_heads = int(rng.choice([1, 2, 4]))
    band = rng.choice(["full", "causal", "window"])
    kwargs = dict(is_causal=bool(band == "causal"))
    if band == "window":
        kwargs["local_window_size"] = (int(rng.integers(0, 6)), int(rng.integers(0, 3)))
    cu_kv, total_kv = None, total_q
    if band == "full" and rng.random() < 0.5:
        # As many sequences of keys, each of 0..7 tokens, maybe a padding tail.
        cu_kv = np.concatenate([[0], np.cumsum(rng.integers(0, 8, len(cu_q) - 1))])
        cu_kv = cu_kv.astype(np.int32)
        total_kv = max(int(cu_kv[-1]) + int(rng.integers(0, 3)), len(cu_q) - 1, 1)
    stated = {}
    if rng.random() < 0.5:
        stated["max_seqlen_q"] = int(np.diff(cu_q).max(initial=0)) + int(rng.integers(0, 3))
        if cu_kv is not None:
            stated["max_seqlen_kv"] = int(np.diff(cu_kv).max(initial=0)) + int(rng.integers(0, 3))
    q = tokens(seed, total_q, N, jnp.bfloat16)
    k, v = (tokens(seed + i, total_kv, kv_heads, jnp.bfloat16) for i in (1, 2))
    d_out = tokens(seed + 3, total_q, N, jnp.float32)

    def ours(q, k, v):  # (the default: T = S = 1 has no cuDNN backward, and says so)
        return jax_sdpa.varlen_attention(q, k, v, jnp.asarray(cu_q),
                                         None if cu_kv is None else jnp.asarray(cu_kv),
                                         **kwargs, **stated)

    def expected(q, k, v):
        return one_by_one(q, k, v, cu_q, cu_q if cu_kv is None else cu_kv, **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        out, vjp = jax.vjp(jax.jit(ours), q, k, v)
    out_ref, vjp_ref = jax.vjp(jax.jit(expected), q, k, v)
    assert relative_error(out, out_ref) < 1e-2
    assert np.all(np.asarray(out, np.float32)[cu_q[-1]:] == 0)  # padding rows
    for a, b in zip(vjp(d_out.astype(jnp.bfloat16)), vjp_ref(d_out)):
        assert relative_error(a, b) < 2e-2


@pytest.mark.parametrize("sinks", [False, True])
def test_sequence_without_keys_residual(sinks, emulated_cudnn):  # noqa: F811
    """The residual of a sequence without keys is a row that sees no key's: jax.nn's fill, or
    the sink's logit with sinks."""
    cu_q, cu_kv = jnp.array([0, 7, 16, 30], jnp.int32), jnp.array([0, 12, 12, 24], jnp.int32)
    q = tokens(1, 32, N, jnp.bfloat16)
    k, v = tokens(2, 28, K, jnp.bfloat16), tokens(3, 28, K, jnp.bfloat16)
    sink = jnp.arange(N, dtype=jnp.float32) if sinks else None
    out, lse = jax.jit(lambda q, k, v: jax_sdpa.varlen_attention(
        q, k, v, cu_q, cu_kv, sinks=sink, return_residual=True, implementation="cudnn"))(q, k, v)
    fill = sink[None, :] if sinks else jnp.full((1, N), -0.7 * np.finfo(np.float32).max)
    np.testing.assert_array_equal(np.asarray(out[7:16], np.float32), 0)
    np.testing.assert_array_equal(np.asarray(lse[7:16], np.float32),
                                  np.broadcast_to(np.asarray(fill.astype(lse.dtype),
                                                             np.float32), (9, N)))
    assert np.all(np.isfinite(np.asarray(lse[:7], np.float32)))


@pytest.mark.parametrize("total", [7, 2501])
def test_sequence_without_keys_under_every_gradient_pattern(total, emulated_cudnn):  # noqa: F811
    """Odd totals, a key sequence of no tokens: jit(grad), vjp(jit), grad(jit) and checkpoint
    give the sequences one by one (the middle one's queries zeros, no gradient through them)."""
    cu_q = np.array([0, 2, total - 3, total], np.int32)  # most queries in the keyless one
    cu_kv = np.array([0, 3, 3, total - 1], np.int32)
    q = tokens(5, total, N, jnp.bfloat16)
    k, v = tokens(6, total, K, jnp.bfloat16), tokens(7, total, K, jnp.bfloat16)
    d_out = tokens(8, total, N, jnp.bfloat16)
    ref = reference_gradients(lambda q, k, v: one_by_one(q, k, v, cu_q, cu_kv), q, k, v, d_out)
    attention = lambda q, k, v: jax_sdpa.varlen_attention(  # noqa: E731
        q, k, v, jnp.asarray(cu_q), jnp.asarray(cu_kv), implementation="cudnn")
    for name, run in gradient_patterns(attention):
        for label, a, b in zip(("output", "dq", "dk", "dv"), run(q, k, v, d_out), ref):
            assert relative_error(a, b) < 2e-2, f"{name} {label}: {relative_error(a, b):.2e}"


def test_varlen_refuses_bad_arguments():
    q = tokens(1, 8, N, jnp.bfloat16)
    k = tokens(2, 8, K, jnp.bfloat16)
    cu = jnp.array([0, 3, 8], jnp.int32)
    with pytest.raises(TypeError, match="cu_seqlens_q"):
        jax_sdpa.varlen_attention(q, k, k, cu.astype(jnp.float32))
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        jax_sdpa.varlen_attention(q, k, k, cu[None])
    with pytest.raises(ValueError, match="cu_seqlens_kv"):
        jax_sdpa.varlen_attention(q, k[:6], k[:6], cu)
    with pytest.raises(NotImplementedError, match="self-attention"):
        jax_sdpa.varlen_attention(q, k, k, cu, cu, is_causal=True)
    with pytest.raises(ValueError, match=r"\[total_q, N, H\]"):
        jax_sdpa.varlen_attention(q[None], k, k, cu)


@pytest.mark.parametrize("cross", [False, True])
def test_constant_cu_seqlens_are_not_evaluated_while_compiling(cross):
    """cu_seqlens the step closes over stay an input of the ids' computation: XLA folding it
    into constants took seconds of compile per call (an 8-call step, 32768 tokens: 5 s)."""
    import re  # noqa: PLC0415

    total = 4096
    cu = jnp.asarray(np.arange(0, total + 1, 512), jnp.int32)
    q = tokens(1, total, N, jnp.float32)

    def attention(q):
        return jax_sdpa.varlen_attention(q, q[:, :K], q[:, :K], cu, cu if cross else None,
                                         is_causal=not cross, max_seqlen_q=512)
    text = jax.jit(attention).lower(q).compile().as_text()
    shapes = re.findall(r"\w+\[([0-9,]+)\][^ ]* constant\(", text)
    assert not [s for s in shapes if np.prod([int(d) for d in s.split(",")]) >= total], shapes


@pytest.mark.gpu
def test_varlen_on_cudnn_runs_our_ragged_targets():
    """On a GPU: our ragged FFI calls run (compiled program), against one-by-one attention."""
    from conftest import lowers_to  # noqa: PLC0415

    cu = np.array([0, 300, 301, 1100, 2000], np.int32)
    q, k, v = (tokens(s, 2048, n, jnp.bfloat16) for s, n in ((1, 8), (2, 2), (3, 2)))
    d_out = tokens(4, 2048, 8, jnp.bfloat16)

    def ours(q, k, v):
        return jax_sdpa.varlen_attention(q, k, v, jnp.asarray(cu), is_causal=True,
                                         implementation="cudnn")
    text = jax.jit(jax.grad(lambda q: ours(q, k, v).astype(jnp.float32).sum())).lower(
        q).compile().as_text()
    assert lowers_to(text, "forward", "ragged") and lowers_to(text, "backward", "ragged")
    out, vjp = jax.vjp(jax.jit(ours), q, k, v)
    out_ref, vjp_ref = jax.vjp(lambda q, k, v: one_by_one(q, k, v, cu, cu, is_causal=True),
                               q, k, v)
    assert relative_error(out, out_ref) < 1e-2
    for a, b in zip(vjp(d_out), vjp_ref(d_out.astype(jnp.float32))):
        assert relative_error(a, b) < 2e-2
