"""paged_attention and paged_kv_update on CPU: a cache written page by page with the helper,
read through a shuffled page table, against a float64 NumPy oracle on each sequence's keys laid
out contiguously (decode T = 1 and chunked prefill T > 1, GQA, windows, soft-cap, sinks,
sequences shorter than T); bad arguments; no gradient."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sdpa
from jax_sdpa.cudnn import extension as _extension
from jax_sdpa.cudnn import paged as paged_target
from jax_sdpa.limits import dense, device
import paged_emulator

PAGES, PAGE, K, N, H = 24, 8, 2, 4, 16


def oracle(q, keys, values, kv_lengths, window=None, cap=None, sinks=None):
    """float64 [B, T, N, Hv] from each sequence's contiguous keys [B][S_b, K, H]."""
    b, t, n, h = q.shape
    out = np.zeros((b, t, n, values[0].shape[-1]))
    for s in range(b):
        k = np.repeat(np.asarray(keys[s], np.float64), n // K, axis=1)
        v = np.repeat(np.asarray(values[s], np.float64), n // K, axis=1)
        for i in range(t):
            position = kv_lengths[s] - t + i
            j = np.arange(kv_lengths[s])
            seen = j <= position
            if window is not None:
                seen &= (j >= position - window[0]) & (j <= position + window[1])
            for head in range(n):
                if not seen.any():
                    continue
                scores = k[:, head] @ np.asarray(q[s, i, head], np.float64) / np.sqrt(h)
                if cap is not None:
                    scores = cap * np.tanh(scores / cap)
                scores = np.where(seen, scores, -np.inf)
                top = max(scores.max(), sinks[head] if sinks is not None else -np.inf)
                weights = np.exp(scores - top)
                total = weights.sum() + (np.exp(sinks[head] - top) if sinks is not None else 0)
                out[s, i, head] = (weights / total) @ v[:, head]
    return out


def build(kv_lengths, t, seed=0, dtype=jnp.float32):
    """(q, caches, page_table, per-sequence keys/values): the keys written by paged_kv_update
    in two chunks (the history, then the T new tokens) through a shuffled page table."""
    rng = np.random.default_rng(seed)
    b = len(kv_lengths)
    max_pages = 6
    order = rng.permutation(PAGES)[:b * max_pages].reshape(b, max_pages).astype(np.int32)
    table = order.copy()
    for s, n in enumerate(kv_lengths):  # entries past the last page: garbage on purpose
        table[s, -(-n // PAGE):] = rng.integers(-5, 100, size=max_pages - (-(-n // PAGE)))
    keys = [rng.normal(size=(n, K, H)).astype(np.float32) for n in kv_lengths]
    values = [rng.normal(size=(n, K, H)).astype(np.float32) for n in kv_lengths]
    key_cache = jnp.asarray(rng.normal(size=(PAGES, PAGE, K, H)), dtype)  # stale contents
    value_cache = jnp.asarray(rng.normal(size=(PAGES, PAGE, K, H)), dtype)
    longest = max(kv_lengths)
    padded = lambda xs: np.stack([np.pad(x, ((0, longest - len(x)), (0, 0), (0, 0)))  # noqa
                                  for x in xs])
    history = np.maximum(np.asarray(kv_lengths) - t, 0).astype(np.int32)
    for start, lengths in ((np.zeros(b, np.int32), history), (history, None)):
        chunk = t if lengths is None else longest
        k = np.stack([np.pad(padded(keys)[s, start[s]:start[s] + chunk],
                             ((0, chunk - len(padded(keys)[s, start[s]:start[s] + chunk])),
                              (0, 0), (0, 0))) for s in range(b)])
        v = np.stack([np.pad(padded(values)[s, start[s]:start[s] + chunk],
                             ((0, chunk - len(padded(values)[s, start[s]:start[s] + chunk])),
                              (0, 0), (0, 0))) for s in range(b)])
        write_lengths = (jnp.asarray(lengths) if lengths is not None else
                         jnp.asarray(np.minimum(t, np.asarray(kv_lengths) - start), jnp.int32))
        key_cache, value_cache = jax_sdpa.paged_kv_update(
            key_cache, value_cache, jnp.asarray(order), jnp.asarray(start), k, v,
            lengths=write_lengths)
    q = rng.normal(size=(b, t, N, H)).astype(np.float32)
    return jnp.asarray(q, dtype), key_cache, value_cache, jnp.asarray(table), keys, values


@pytest.fixture(params=["reference", "cudnn-emulated"])
def path(request, monkeypatch):
    """Which path paged_attention takes: the reference; or its cuDNN path, on a GPU for real
    and elsewhere with tests/paged_emulator.py standing in for our paged FFI call (what cuDNN
    would compute from the same operands), which tests the band, padding and page-table
    mapping in CI."""
    if request.param == "reference":
        return "xla"
    if device.device_reason() is not None:
        monkeypatch.setattr(device, "device_reason", lambda: None)
        monkeypatch.setattr(dense, "kernel_reason", lambda *args: None)  # float32 here
        monkeypatch.setattr(_extension, "cudnn_version", lambda: 91900)
        monkeypatch.setattr(paged_target, "forward", paged_emulator.forward)
    return None  # the default: cuDNN where it can run (soft-cap: the reference, with a warning)


@pytest.mark.parametrize("t", [1, 5], ids=["decode", "prefill"])
@pytest.mark.parametrize("options", ["plain", "window", "soft_cap+sinks", "sinks"])
def test_paged_attention_matches_the_oracle(t, options, path):
    kv_lengths = [17, 40, 3, 9]  # the third holds fewer keys than T = 5: two empty queries
    q, key_cache, value_cache, table, keys, values = build(kv_lengths, t)
    kwargs = dict(plain={}, window=dict(local_window_size=(4, 0)),
                  sinks=dict(sinks=jnp.linspace(-1.0, 1.0, N)),
                  **{"soft_cap+sinks": dict(logits_soft_cap=2.0,
                                            sinks=jnp.linspace(-1.0, 1.0, N))})[options]
    kwargs["implementation"] = path
    with jax.default_matmul_precision("float32"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # soft-cap takes the reference
        out = jax.jit(lambda *a: jax_sdpa.paged_attention(*a, **kwargs))(
            q, key_cache, value_cache, table, jnp.asarray(kv_lengths, jnp.int32))
    expected = oracle(np.asarray(q), keys, values, kv_lengths, kwargs.get("local_window_size"),
                      kwargs.get("logits_soft_cap"),
                      None if "sinks" not in kwargs else np.asarray(kwargs["sinks"]))
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-5)


def test_kv_update_drops_what_does_not_fit_and_keeps_the_rest():
    cache = jnp.zeros((4, 2, 1, 3))
    table = jnp.array([[2, 0]], jnp.int32)  # capacity 4 tokens
    new = jnp.arange(1, 7, dtype=jnp.float32).reshape(1, 6, 1, 1) * jnp.ones((1, 6, 1, 3))
    key_cache, _ = jax_sdpa.paged_kv_update(cache, cache, table, jnp.array([1], jnp.int32),
                                            new, new)
    # positions 1, 2, 3 -> page 2 slot 1, page 0 slot 0, page 0 slot 1; 4.. dropped
    np.testing.assert_array_equal(key_cache[2, 1, 0], [1, 1, 1])
    np.testing.assert_array_equal(key_cache[0, :, 0, 0], [2, 3])
    assert float(jnp.abs(key_cache[1]).sum() + jnp.abs(key_cache[3]).sum()) == 0
    assert float(key_cache[2, 0].sum()) == 0


def test_paged_attention_has_no_gradient_and_refuses_bad_input():
    q, key_cache, value_cache, table, _, _ = build([9, 12], 1)
    lengths = jnp.array([9, 12], jnp.int32)
    with pytest.raises(NotImplementedError, match="forward only"):
        jax.grad(lambda q: jax_sdpa.paged_attention(q, key_cache, value_cache, table,
                                                    lengths).sum())(q)
    with pytest.raises(TypeError, match="page_table"):
        jax_sdpa.paged_attention(q, key_cache, value_cache, table.astype(jnp.float32), lengths)
    with pytest.raises(ValueError, match="kv_lengths"):
        jax_sdpa.paged_attention(q, key_cache, value_cache, table, jnp.array([9, 1000],
                                                                             jnp.int32))
    with pytest.raises(ValueError, match="multiple"):
        jax_sdpa.paged_attention(q[:, :, :3], key_cache, value_cache, table, lengths)
    with pytest.raises(NotImplementedError, match="cudnn"):
        jax_sdpa.paged_attention(q, key_cache, value_cache, table, lengths,
                                 implementation="cudnn")


def test_paged_attention_refuses_empty_pools_and_tables_and_passes_empty_queries():
    q, key_cache, value_cache, table, _, _ = build([9, 12], 1)
    lengths = jnp.array([9, 12], jnp.int32)
    with pytest.raises(ValueError, match="at least one page"):
        jax_sdpa.paged_attention(q, key_cache[:0], value_cache[:0], table, lengths)
    with pytest.raises(ValueError, match="at least one page"):
        jax_sdpa.paged_attention(q[:, :, :0], key_cache[:, :, :0], value_cache[:, :, :0],
                                 table, lengths)
    with pytest.raises(ValueError, match="page_table"):
        jax_sdpa.paged_attention(q, key_cache, value_cache, table[:, :0], lengths * 0)
    out = jax_sdpa.paged_attention(q[:, :0], key_cache, value_cache, table, lengths)
    assert out.shape == (2, 0, N, H) and out.dtype == q.dtype
