"""Every argument outside the contract is a Python error naming the argument, raised before
anything is traced into C++."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sdpa

B, T, S, N, K, H = 2, 8, 12, 4, 2, 16
Q = jnp.ones((B, T, N, H), jnp.float16)
KV = jnp.ones((B, S, K, H), jnp.float16)

CASES = [  # (description, arguments, keywords, error type, message pattern)
    ("query rank 2", (Q[0, 0], KV, KV), {}, ValueError, "rank"),
    ("ranks differ", (Q, KV[0], KV[0]), {}, ValueError, "same rank"),
    ("batch differs", (Q, KV[:1], KV[:1]), {}, ValueError, "batch"),
    ("key/value shapes differ", (Q, KV, KV[:, :4]), {}, ValueError, "key and value"),
    ("head_dim differs", (Q[..., :8], KV, KV), {}, ValueError, "head_dim"),
    ("heads not a multiple", (Q[:, :, :3], KV, KV), {}, ValueError, "multiple"),
    ("integer query", (Q.astype(jnp.int32), KV, KV), {}, TypeError, "query.*floating"),
    ("dtypes differ", (Q, KV.astype(jnp.bfloat16), KV), {}, TypeError, "one dtype"),
    ("scale a string", (Q, KV, KV), {"scale": "0.1"}, TypeError, "scale"),
    ("scale infinite", (Q, KV, KV), {"scale": float("inf")}, ValueError, "scale"),
    ("is_causal an int", (Q, KV, KV), {"is_causal": 1}, TypeError, "is_causal"),
    ("q lengths int64", (Q, KV, KV), {"query_seq_lengths": np.array([1, 2], np.int64)},
     TypeError, "query_seq_lengths.*int32"),
    ("kv lengths shape", (Q, KV, KV), {"key_value_seq_lengths": jnp.array([1, 2, 3], jnp.int32)},
     ValueError, "key_value_seq_lengths.*shape"),
    ("negative window", (Q, KV, KV), {"local_window_size": (-1, 2)}, ValueError,
     "local_window_size"),
    ("window of three", (Q, KV, KV), {"local_window_size": (1, 2, 3)}, TypeError,
     "local_window_size"),
    ("bias does not broadcast", (Q, KV, KV), {"bias": jnp.ones((B, N, T, S + 1))}, ValueError,
     "bias"),
    ("bias rank 5", (Q, KV, KV), {"bias": jnp.ones((1, B, N, T, S))}, ValueError, "bias.*rank"),
    ("integer bias", (Q, KV, KV), {"bias": jnp.ones((B, N, T, S), jnp.int32)}, TypeError, "bias"),
    ("float mask", (Q, KV, KV), {"mask": jnp.ones((B, 1, T, S))}, TypeError, "mask.*boolean"),
    ("mask does not broadcast", (Q, KV, KV), {"mask": jnp.ones((3, 1, T, S), bool)}, ValueError,
     "mask"),
    ("unknown implementation", (Q, KV, KV), {"implementation": "triton"}, ValueError,
     "implementation"),
    ("unknown causal alignment", (Q, KV, KV), {"causal_alignment": "bottom"}, ValueError,
     "causal_alignment"),
    ("dropout without a key", (Q, KV, KV), {"dropout_rate": 0.1}, ValueError, "dropout_rng"),
    ("dropout rate 1", (Q, KV, KV), {"dropout_rate": 1.0, "dropout_rng": jax.random.key(0)},
     ValueError, "dropout_rate"),
    ("dropout rate a string", (Q, KV, KV), {"dropout_rate": "0.1"}, TypeError, "dropout_rate"),
    ("two dropout keys", (Q, KV, KV),
     {"dropout_rate": 0.1, "dropout_rng": jax.random.split(jax.random.key(0))}, TypeError,
     "dropout_rng"),
    ("segment ids int64", (Q, KV, KV),
     {"query_segment_ids": np.zeros((B, T), np.int64), "kv_segment_ids": np.zeros((B, S), np.int32)},
     TypeError, "query_segment_ids.*int32"),
    ("segment ids shape", (Q, KV, KV),
     {"query_segment_ids": jnp.zeros((B, T), jnp.int32), "kv_segment_ids": jnp.zeros((B, T), jnp.int32)},
     ValueError, "kv_segment_ids.*shape"),
    ("kv segment ids missing, T != S", (Q, KV, KV),
     {"query_segment_ids": jnp.zeros((B, T), jnp.int32)}, ValueError, "kv_segment_ids"),
    ("only kv segment ids", (Q, KV, KV), {"kv_segment_ids": jnp.zeros((B, S), jnp.int32)},
     ValueError, "query_segment_ids"),
]


@pytest.mark.parametrize("case", CASES, ids=[case[0] for case in CASES])
def test_bad_arguments_raise_clear_errors(case):
    _, args, kwargs, error, pattern = case
    with pytest.raises(error, match=pattern):
        jax_sdpa.dot_product_attention(*args, **kwargs)


@pytest.mark.parametrize("value,error", [(0, ValueError), (2.5, TypeError), (True, TypeError)])
def test_max_segments_is_a_positive_int(value, error):
    q = jnp.zeros((2, 8, 2, 16), jnp.float32)
    with pytest.raises(error, match="max_segments"):
        jax_sdpa.dot_product_attention(q, q, q, query_segment_ids=jnp.zeros((2, 8), jnp.int32),
                                       max_segments=value)


@pytest.mark.parametrize("q_seq_len,kv_seq_len", [(8, 12), (12, 8), (7, 7), (1, 9)])
def test_the_spec_band_is_the_arguments_mask(q_seq_len, kv_seq_len):
    """The band a call's CallSpec holds (inclusive bounds, causal folded in, bottom-right only
    where T != S) reads as exactly the mask its arguments mean, for every combination."""
    from jax_sdpa.reference.attention import combined_mask
    from jax_sdpa.call.validation import validate

    q = jnp.ones((1, q_seq_len, 2, 8), jnp.float32)
    kv = jnp.ones((1, kv_seq_len, 2, 8), jnp.float32)
    for is_causal in (False, True):
        for window in (None, 0, 2, (3, 0), (0, 4), (1, 6)):
            for alignment in ("top_left", "bottom_right"):
                spec = validate(q, kv, kv, None, None, scale=None, is_causal=is_causal,
                                query_seq_lengths=None, key_value_seq_lengths=None,
                                local_window_size=window, implementation=None,
                                causal_alignment=alignment).spec
                offset = kv_seq_len - q_seq_len if alignment == "bottom_right" else 0
                pair = None if window is None else (
                    (window, window) if isinstance(window, int) else window)
                meant = combined_mask(q_seq_len, kv_seq_len, is_causal=is_causal,
                                      local_window_size=pair, diagonal_offset=offset)
                held = combined_mask(q_seq_len, kv_seq_len, local_window_size=spec.window(),
                                     diagonal_offset=spec.diagonal_offset(q_seq_len,
                                                                          kv_seq_len))
                every = jnp.ones((1, 1, q_seq_len, kv_seq_len), bool)
                meant = every if meant is None else jnp.broadcast_to(meant, every.shape)
                held = every if held is None else jnp.broadcast_to(held, every.shape)
                np.testing.assert_array_equal(held, meant, err_msg=f"{is_causal} {window} "
                                              f"{alignment}")
                assert spec.bottom_right == (alignment == "bottom_right" and spec.banded and
                                             q_seq_len != kv_seq_len)
