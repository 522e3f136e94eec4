"""The README's table of what runs on cuDNN is checked against the code, row by row."""

import pathlib
import re

import jax
import jax.numpy as jnp

from jax_sdpa.call import planning
from jax_sdpa.limits import dense, packed
from jax_sdpa.call.validation import validate

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
B, T, S, N, K, H = 2, 8, 8, 4, 2, 64


def call(dtype=jnp.bfloat16, head_dim=H, q_seq=T, kv_heads=N, value_head_dim=None, kv_seq=S,
         **kwargs):
    q = jnp.zeros((B, q_seq, N, head_dim), dtype)
    k = jnp.zeros((B, kv_seq, kv_heads, head_dim), dtype)
    v = jnp.zeros((B, kv_seq, kv_heads, value_head_dim or head_dim), dtype)
    options = dict(bias=None, mask=None, scale=None, is_causal=False, query_seq_lengths=None,
                   key_value_seq_lengths=None, local_window_size=None)
    options.update(kwargs)
    bias, mask = options.pop("bias"), options.pop("mask")
    return validate(q, k, v, bias, mask, implementation=None, **options)


LENGTHS = dict(query_seq_lengths=jnp.full((B,), 3, jnp.int32),
               key_value_seq_lengths=jnp.full((B,), 4, jnp.int32))
BOTTOM_RIGHT = dict(is_causal=True, causal_alignment="bottom_right")
DROPOUT = dict(dropout_rate=0.1, dropout_rng=jax.random.key(0))


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
    "a mask (or segment ids) that hides whole rows: uniform rows, as jax.nn": [
        call(mask=jnp.zeros((B, 1, T, S), bool))],
    "query_seq_lengths / key_value_seq_lengths": [call(**LENGTHS)],
    "local_window_size (left, right), T ≤ S or with sequence lengths": [
        call(local_window_size=(3, 1)), call(q_seq=12, local_window_size=(3, 1), **LENGTHS)],
    "local_window_size with T > S and no sequence lengths": [
        call(q_seq=12, local_window_size=(3, 1))],
    "causal_alignment='bottom_right', T ≤ S": [
        call(q_seq=5, **BOTTOM_RIGHT), call(q_seq=5, bias=jnp.zeros((1, N, 5, S)), **BOTTOM_RIGHT),
        call(q_seq=5, local_window_size=(1, 0), **BOTTOM_RIGHT)],
    "causal_alignment='bottom_right', T > S": [call(q_seq=12, **BOTTOM_RIGHT)],
    "bottom-right window narrower than S − T, with a bias, mask, dropout or lengths": [
        call(q_seq=5, local_window_size=(1, 0), bias=jnp.zeros((1, N, 5, S)), **BOTTOM_RIGHT),
        call(q_seq=5, local_window_size=(1, 0), **DROPOUT, **BOTTOM_RIGHT)],
    "dropout_rate / dropout_rng (attention dropout)": [call(**DROPOUT),
                                                       call(is_causal=True, **DROPOUT)],
    "query_segment_ids / kv_segment_ids (packed sequences), Hopper or newer": [
        call(query_segment_ids=jnp.zeros((B, T), jnp.int32), is_causal=True),
        call(q_seq=5, query_segment_ids=jnp.zeros((B, 5), jnp.int32),
             kv_segment_ids=jnp.zeros((B, S), jnp.int32), local_window_size=(2, 1), **LENGTHS)],
    "segment ids with a bias, mask or logits_soft_cap, bottom-right with T ≠ S, or before Hopper": [
        call(query_segment_ids=jnp.zeros((B, T), jnp.int32), bias=jnp.zeros((1, N, T, S))),
        call(query_segment_ids=jnp.zeros((B, T), jnp.int32), logits_soft_cap=30.0),
        call(q_seq=5, query_segment_ids=jnp.zeros((B, 5), jnp.int32),
             kv_segment_ids=jnp.zeros((B, S), jnp.int32), **BOTTOM_RIGHT)],
    "one query and one key (T = S = 1)": [call(q_seq=1, kv_seq=1)],
    "value head_dim ≠ query head_dim (each a multiple of 8, ≤ 256)": [
        call(head_dim=192, value_head_dim=128), call(head_dim=64, value_head_dim=256)],
    "deterministic backward": [call()],
    "logits_soft_cap (cuDNN's score modifier: cuDNN ≥ 9.4, its backward on Hopper or newer)": [
        call(logits_soft_cap=30.0, is_causal=True),
        call(logits_soft_cap=5.0, local_window_size=(3, 1), **LENGTHS),
        call(logits_soft_cap=5.0, mask=jnp.ones((B, 1, 1, S), bool))],
    "logits_soft_cap with a bias's gradient": [
        call(logits_soft_cap=30.0, bias=jnp.zeros((1, N, T, S)))],
    "fp8=True: causal, lengths, GQA; equal head dims, multiples of 16 up to 256": [
        call(fp8=True, head_dim=128, is_causal=True, kv_heads=2),
        call(fp8=True, head_dim=64, **LENGTHS)],
    "fp8=True with other head dims (e.g. 72, or 64 with value head_dim 128)": [
        call(fp8=True, head_dim=72), call(fp8=True, head_dim=64, value_head_dim=128)],
    "fp8=True with a single query (T = 1)": [
        call(fp8=True, head_dim=128, q_seq=1, kv_seq=1), call(fp8=True, head_dim=128, q_seq=1)],
    "score_mod adding a term to the score or masking it, alibi_slopes (cuDNN ≥ 9.4, its "
    "backward on Hopper or newer; no gradient to closed-over arrays)": [
        call(score_mod=lambda s, b, h, i, j: s + 0.5 * (i - j).astype(jnp.float32)),
        call(alibi_slopes=jnp.ones((N,), jnp.float32), is_causal=True),
        call(alibi_slopes=jnp.ones((N,), jnp.float32), **LENGTHS)],
    "score_mod scaling or transforming the score (e.g. s * 0.5, tanh), comparing float32 "
    "values (also relu, abs or max of the score), of more than 24 nodes with its derivative, "
    "with operations cuDNN's pointwise nodes lack (e.g. bitwise, indexing by position), or with "
    "values that vary with the batch (alibi_slopes [B, N] with B > 1)": [
        call(score_mod=lambda s, b, h, i, j: s * 0.5),
        call(score_mod=lambda s, b, h, i, j: s + (i & 1)),
        call(score_mod=lambda s, b, h, i, j: jnp.maximum(s, 0.0)),
        call(alibi_slopes=jnp.ones((B, N), jnp.float32), **LENGTHS)],

    "sinks [N], with their gradient": [
        call(sinks=jnp.zeros((N,), jnp.float32), is_causal=True),
        call(sinks=jnp.zeros((N,), jnp.float32), query_segment_ids=jnp.zeros((B, T), jnp.int32),
             **LENGTHS)],
}


def readme_rows():
    text = README.read_text()
    table = text.split("<!-- cudnn-table:start -->")[1].split("<!-- cudnn-table:end -->")[0]
    rows = {}
    for line in table.strip().splitlines()[2:]:
        feature, claim = (cell.strip() for cell in line.strip("|").split("|"))
        rows[feature] = claim
    return rows


def claimed_as_code_says(claim, example):
    """(whether the code does what the README's claim says, what the code says)."""
    reason = planning.call_reason(example)
    expected = re.match(r"(yes|no)\b", claim).group(1) == "yes"
    if (reason is None) != expected:
        return False, reason
    if "ragged layout" in claim or "dense [B, 1, T, S] bias" in claim:
        ragged = packed.ragged_reason(example)
        return (ragged is None) == ("ragged layout" in claim), ragged
    q_seq, kv_seq = example.query.shape[1], example.key.shape[1]
    if example.spec.fp8:  # its backward's limits depend on the device (README text, not checked)
        return True, None
    backward = dense.backward_reason(q_seq, kv_seq, example.query.shape[-1],
                                        example.value.shape[-1],
                                        example.spec.logits_soft_cap or None,
                                        example.bias is not None, example.spec.has_score_mod)
    return (backward is not None) == ("backward takes the reference" in claim), backward


def test_table_matches_the_code():
    rows = readme_rows()
    assert set(rows) == set(EXAMPLES), "README rows and test examples differ"
    for feature, claim in rows.items():
        for example in EXAMPLES[feature]:
            agrees, said = claimed_as_code_says(claim, example)
            assert agrees, f"{feature}: README says {claim!r}, code: {said}"
