"""The core GPU cases, forward and backward, for compute-sanitizer (scripts/sanitize.sh):
every target (dense, ragged, paged, FP8) and every feature that changes what the kernels read
or write (bias and dbias, lengths, windows, dropout, value head_dim, GQA, packed documents
checked and stated, score modifiers and their tables, vmap repeats) at small sizes, each
checked for finiteness.
    python3 scripts/sanitize_cases.py [part of a case name]"""

import jax
import jax.numpy as jnp
import numpy as np

import jax_sdpa

B, T, S, N, K, H = 2, 128, 192, 4, 2, 64
CASES = {
    "seed-like causal fp16": dict(dtype=jnp.float16, kwargs=dict(is_causal=True)),
    "bias with dbias": dict(bias=(1, N, T, S), kwargs=dict(is_causal=True)),
    "mask + lengths": dict(mask=True, kwargs=dict(
        query_seq_lengths=jnp.array([T, 77], jnp.int32),
        key_value_seq_lengths=jnp.array([150, S], jnp.int32))),
    "window + bottom-right": dict(kwargs=dict(is_causal=True, causal_alignment="bottom_right",
                                              local_window_size=(16, 0))),
    "dropout": dict(kwargs=dict(dropout_rate=0.2, dropout_rng=jax.random.key(0))),
    "value head_dim 128": dict(value_head_dim=128, kwargs=dict(is_causal=True)),
    # T = S below: self-attention's segment ids
    "packed checked": dict(self_attention=True, kwargs=dict(
        is_causal=True, query_segment_ids=jnp.repeat(jnp.arange(4, dtype=jnp.int32),
                                                     T // 4)[None].repeat(B, 0))),
    "packed stated": dict(self_attention=True, kwargs=dict(
        is_causal=True, max_document_length=T // 4, max_segments=4,
        query_segment_ids=jnp.repeat(jnp.arange(4, dtype=jnp.int32), T // 4)[None].repeat(B, 0))),
    "score_mod + alibi": dict(head_dim=128, kwargs=dict(
        is_causal=True, alibi_slopes=jax_sdpa.alibi_slopes(N),
        score_mod=lambda s, b, h, i, j: jnp.where(jnp.abs(i - j) < 32, s, s - 1.0))),
    "fp8 causal + lengths": dict(head_dim=128, self_attention=True, kwargs=dict(
        is_causal=True, fp8=True, query_seq_lengths=jnp.array([T, 100], jnp.int32),
        key_value_seq_lengths=jnp.array([T, 100], jnp.int32))),
}


def run_case(name, spec):
    dtype = spec.get("dtype", jnp.bfloat16)
    keys = jax.random.split(jax.random.key(len(name)), 5)
    h = spec.get("head_dim", H)
    hv = spec.get("value_head_dim", h)
    s = T if spec.get("self_attention") else S
    q = jax.random.normal(keys[0], (B, T, N, h)).astype(dtype)
    k = jax.random.normal(keys[1], (B, s, K, h)).astype(dtype)
    v = jax.random.normal(keys[2], (B, s, K, hv)).astype(dtype)
    d_out = jax.random.normal(keys[3], (B, T, N, hv)).astype(dtype)
    bias = jax.random.normal(keys[4], spec["bias"]) if "bias" in spec else None
    mask = (jax.random.uniform(keys[4], (B, 1, T, S)) > 0.3) if spec.get("mask") else None

    def fn(q, k, v, bias):
        return jax_sdpa.dot_product_attention(q, k, v, bias=bias, mask=mask,
                                              implementation="cudnn", **spec["kwargs"])
    out, vjp = jax.vjp(jax.jit(fn), q, k, v, bias)
    results = (out, *vjp(d_out))
    finite = all(bool(np.isfinite(np.asarray(x, np.float32)).all())
                 for x in results if x is not None)
    print(f"{name}: {'ok' if finite else 'NON-FINITE'}", flush=True)
    return finite


def run_paged():
    """paged_attention's forward: 3 sequences over a pool of 16-token pages, 4 new queries."""
    keys = jax.random.split(jax.random.key(7), 3)
    q = jax.random.normal(keys[0], (3, 4, N, H), jnp.bfloat16)
    pages = jax.random.normal(keys[1], (12, 16, K, H), jnp.bfloat16)
    table = jnp.arange(12, dtype=jnp.int32).reshape(3, 4)
    lengths = jnp.array([64, 37, 4], jnp.int32)
    out = jax.jit(lambda q: jax_sdpa.paged_attention(q, pages, pages, table, lengths,
                                                     implementation="cudnn"))(q)
    finite = bool(np.isfinite(np.asarray(out, np.float32)).all())
    print(f"paged: {'ok' if finite else 'NON-FINITE'}", flush=True)
    return finite


if __name__ == "__main__":
    import sys
    chosen = {name: spec for name, spec in CASES.items()
              if len(sys.argv) < 2 or sys.argv[1] in name}  # e.g. "seed" for one case
    assert all([run_case(name, spec) for name, spec in chosen.items()])
    if len(sys.argv) < 2 or sys.argv[1] in "paged":
        assert run_paged()
    vmapped = jax.jit(jax.vmap(lambda q: jax_sdpa.dot_product_attention(
        q, q, q, is_causal=True, implementation="cudnn")))
    print("vmap:", bool(np.isfinite(np.asarray(vmapped(jnp.ones((3, 2, 64, 4, 64),
                                                                  jnp.bfloat16)))).all()))
