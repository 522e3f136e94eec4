"""The README's table of what runs on cuDNN is checked against the code, row by row."""

import pathlib
import re

import jax.numpy as jnp

from jax_sdpa import cudnn_support
from jax_sdpa.validation import validate

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
B, T, S, N, K, H = 2, 8, 8, 4, 2, 64


def call(dtype=jnp.bfloat16, head_dim=H, q_seq=T, kv_heads=N, **kwargs):
    q = jnp.zeros((B, q_seq, N, head_dim), dtype)
    kv = jnp.zeros((B, S, kv_heads, head_dim), dtype)
    options = dict(bias=None, mask=None, scale=None, is_causal=False, query_seq_lengths=None,
                   key_value_seq_lengths=None, local_window_size=None)
    options.update(kwargs)
    bias, mask = options.pop("bias"), options.pop("mask")
    return validate(q, kv, kv, bias, mask, implementation=None, **options)


# One example call per README row: the row's claim must be what call_reason says of it.
EXAMPLES = {
    "float16 or bfloat16 inputs": [call(jnp.float16), call(jnp.bfloat16)],
    "float32 inputs": [call(jnp.float32)],
    "head_dim a multiple of 8 from 8 to 256": [call(head_dim=d) for d in (8, 64, 200, 256)],
    "other head_dim (e.g. 100 or 264)": [call(head_dim=100), call(head_dim=264)],
    "is_causal (top-left, as jax.nn)": [call(is_causal=True)],
    "GQA / MQA (N a multiple of K)": [call(kv_heads=2), call(kv_heads=1)],
    "T ≠ S, lengths not multiples of 64": [call(q_seq=5)],
    "bias broadcastable to [B, N, T, S], with its gradient": [call(bias=jnp.zeros((1, N, T, S)))],
    "boolean mask broadcastable to [B, N, T, S]": [call(mask=jnp.ones((B, 1, 1, S), bool))],
    "query_seq_lengths / key_value_seq_lengths": [
        call(query_seq_lengths=jnp.full((B,), 3, jnp.int32),
             key_value_seq_lengths=jnp.full((B,), 4, jnp.int32))],
    "local_window_size (left, right)": [call(local_window_size=(3, 1))],
    "deterministic backward": [call()],
}


def readme_rows():
    text = README.read_text()
    table = text.split("<!-- cudnn-table:start -->")[1].split("<!-- cudnn-table:end -->")[0]
    rows = {}
    for line in table.strip().splitlines()[2:]:
        feature, claim = (cell.strip() for cell in line.strip("|").split("|"))
        rows[feature] = claim
    return rows


def test_table_matches_the_code():
    rows = readme_rows()
    assert set(rows) == set(EXAMPLES), "README rows and test examples differ"
    for feature, claim in rows.items():
        expected = re.match(r"(yes|no)\b", claim).group(1) == "yes"
        for example in EXAMPLES[feature]:
            reason = cudnn_support.call_reason(example)
            assert (reason is None) == expected, f"{feature}: README says {claim!r}, code: {reason}"
