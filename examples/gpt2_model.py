"""A GPT-2-style decoder in Flax NNX: pre-LayerNorm blocks, learned positions, tied embeddings,
its causal self-attention through a choice of attention functions."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jax_sdpa

def _jax_nn(implementation):
    """jax.nn's attention; packed documents become its dense [B, 1, T, T] mask."""
    def attention(q, k, v, segment_ids=None):
        mask = (None if segment_ids is None else
                segment_ids[:, None, :, None] == segment_ids[:, None, None, :])
        return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True,
                                            implementation=implementation)
    return attention


def _jax_sdpa(q, k, v, segment_ids=None, **variants):
    """variants: logits_soft_cap, sinks, fp8, a mask description holding the causality
    (only jax_sdpa has them)."""
    return jax_sdpa.dot_product_attention(q, k, v, is_causal="mask" not in variants,
                                          query_segment_ids=segment_ids, **variants)


# f(q, k, v, segment_ids=None, **variants): causal self-attention, within documents when
# segment_ids (int32 [B, T]) say which document each token is in; variants only for jax_sdpa.
ATTENTION = {
    "jax_sdpa": _jax_sdpa,
    "xla": _jax_nn("xla"),
    "jax-cudnn": _jax_nn("cudnn"),
}


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256
    seq_len: int = 1024
    n_layer: int = 12
    n_head: int = 12
    d_model: int = 768
    dtype: str = "bfloat16"  # computation dtype; parameters stay float32
    attention: str = "jax_sdpa"
    logits_soft_cap: float | None = None  # Gemma 2-style capping of the attention scores
    sinks: bool = False  # a learned attention-sink logit per head (gpt-oss style)
    fp8: bool = False  # FP8 attention (jax_sdpa's fp8=True: e4m3 forward, e5m2 backward)
    alibi: bool = False  # ALiBi (jax_sdpa's alibi_slopes, the standard slopes) for positions
    # A jax_sdpa.masks description (attention_mask): "window:W" (the last W + 1 keys),
    # "global:G" (the first G tokens see and are seen by all), joined by "," as a union, causal
    # besides; or "prefix:P" (a prefix LM).
    mask: str | None = None
    # Rows with segment ids hold at most this many documents (the data loader's promise): told
    # to jax_sdpa (max_segments, and max_document_length = seq_len), it runs one cuDNN plan
    # with no check on the device. None: no promise; the call checks the rows itself.
    documents_per_row: int | None = None


def attention_mask(spec: str):
    """The whole mask as a jax_sdpa.masks description: "window:W", "global:G" or both joined
    by "," (a union), causal besides; or "prefix:P" alone, a prefix LM (the first P tokens
    see one another, causal after; next-token targets inside the prefix are then visible)."""
    parts = spec.split(",")
    sizes = []
    for part in parts:
        name, _, size = part.partition(":")
        if name not in ("window", "global", "prefix") or not size.isdigit():
            raise ValueError(f"a mask part is window:W, global:G or prefix:P, got {part!r}")
        sizes.append((name, int(size)))
    if any(name == "prefix" for name, _ in sizes):
        if len(sizes) != 1:
            raise ValueError("prefix:P stands alone (it replaces causality)")
        return jax_sdpa.masks.prefix_lm(sizes[0][1])
    builders = {"window": lambda n: jax_sdpa.masks.sliding_window(n, 0),
                "global": jax_sdpa.masks.global_tokens}
    mask = None
    for name, size in sizes:
        built = builders[name](size)
        mask = built if mask is None else mask | built
    return mask & jax_sdpa.masks.causal()


class CausalSelfAttention(nnx.Module):
    def __init__(self, config: GPTConfig, rngs: nnx.Rngs):
        dtype = jnp.dtype(config.dtype)
        self.n_head = config.n_head
        self.attention = config.attention
        self.qkv = nnx.Linear(config.d_model, 3 * config.d_model, dtype=dtype, rngs=rngs)
        self.proj = nnx.Linear(config.d_model, config.d_model, dtype=dtype, rngs=rngs)
        self.variants = {}
        if config.logits_soft_cap is not None:
            self.variants["logits_soft_cap"] = config.logits_soft_cap
        if config.fp8:
            self.variants["fp8"] = True
        self.alibi = config.alibi
        self.mask = config.mask
        self.documents = ({} if config.documents_per_row is None or
                          config.attention != "jax_sdpa" else
                          dict(max_segments=config.documents_per_row,
                               max_document_length=config.seq_len))
        # The sinks start at 0: one token's worth of weight going nowhere.
        self.sinks = nnx.Param(jnp.zeros((config.n_head,), jnp.float32)) if config.sinks else None

    def _qkv(self, x):
        batch, seq, features = x.shape
        # Head-major columns ([head, q/k/v, dim]): a tensor-parallel split of the qkv columns
        # over devices is then a split over heads (examples/sharded_training.py).
        qkv = self.qkv(x).reshape(batch, seq, self.n_head, 3, features // self.n_head)
        return qkv[:, :, :, 0], qkv[:, :, :, 1], qkv[:, :, :, 2]

    def _variants(self):
        variants = dict(self.variants)
        if self.alibi:
            variants["alibi_slopes"] = jax_sdpa.alibi_slopes(self.n_head)
        if self.mask:
            variants["mask"] = attention_mask(self.mask)
        if self.sinks is not None:
            variants["sinks"] = self.sinks[...]
        return variants

    def __call__(self, x, segment_ids=None):
        q, k, v = self._qkv(x)
        variants = self._variants()
        if segment_ids is not None:
            variants.update(self.documents)
        y = ATTENTION[self.attention](q, k, v, segment_ids, **variants)
        return self.proj(y.reshape(x.shape))

    def decode(self, x, cache, page_table, start):
        """The newest tokens x [B, T, D] against a paged KV cache (key_cache, value_cache):
        their keys and values written at positions start[b].. (left padding has negative
        positions: dropped), then attention over the first start + T keys. Returns (y, cache)."""
        if self.alibi or self.mask:
            raise NotImplementedError("paged decoding takes no alibi_slopes or mask")
        q, k, v = self._qkv(x)
        cache = jax_sdpa.paged_kv_update(*cache, page_table, start, k, v)
        y = jax_sdpa.paged_attention(q, *cache, page_table, start + x.shape[1],
                                     **self._variants())
        return self.proj(y.reshape(x.shape)), cache


class Block(nnx.Module):
    def __init__(self, config: GPTConfig, rngs: nnx.Rngs):
        dtype = jnp.dtype(config.dtype)
        self.ln1 = nnx.LayerNorm(config.d_model, dtype=dtype, rngs=rngs)
        self.attn = CausalSelfAttention(config, rngs)
        self.ln2 = nnx.LayerNorm(config.d_model, dtype=dtype, rngs=rngs)
        self.fc = nnx.Linear(config.d_model, 4 * config.d_model, dtype=dtype, rngs=rngs)
        self.out = nnx.Linear(4 * config.d_model, config.d_model, dtype=dtype, rngs=rngs)

    def __call__(self, x, segment_ids=None):
        x = x + self.attn(self.ln1(x), segment_ids)
        return x + self.out(jax.nn.gelu(self.fc(self.ln2(x))))

    def decode(self, x, cache, page_table, start):
        y, cache = self.attn.decode(self.ln1(x), cache, page_table, start)
        x = x + y
        return x + self.out(jax.nn.gelu(self.fc(self.ln2(x)))), cache


class GPT(nnx.Module):
    def __init__(self, config: GPTConfig, rngs: nnx.Rngs):
        dtype = jnp.dtype(config.dtype)
        init = nnx.initializers.normal(0.02)
        self.token_embed = nnx.Embed(config.vocab_size, config.d_model, dtype=dtype,
                                     embedding_init=init, rngs=rngs)
        # With ALiBi, attention itself knows the positions.
        self.position_embed = None if config.alibi else nnx.Embed(
            config.seq_len, config.d_model, dtype=dtype, embedding_init=init, rngs=rngs)
        self.blocks = nnx.List([Block(config, rngs) for _ in range(config.n_layer)])
        self.ln_f = nnx.LayerNorm(config.d_model, dtype=dtype, rngs=rngs)

    def __call__(self, tokens, positions=None, segment_ids=None):
        """positions: each token's position, [T] or [B, T] (default 0..T-1; a permuted
        sequence, as the zigzag ring layout makes, or packed documents pass their own).
        segment_ids: int32 [B, T], packed documents: tokens attend within their own."""
        positions = jnp.arange(tokens.shape[1]) if positions is None else positions
        x = _lookup(self.token_embed, tokens)
        if self.position_embed is not None:
            x = x + _lookup(self.position_embed, positions)
        for block in self.blocks:
            x = block(x, segment_ids)
        return self.token_embed.attend(self.ln_f(x)).astype(jnp.float32)  # tied output layer

    def decode(self, tokens, caches, page_table, start):
        """Inference with a paged KV cache (examples/generate.py): tokens int32 [B, T], the
        newest of each sequence, token t of sequence b at position start[b] + t (negative:
        left padding, ignored); caches: one (key_cache, value_cache) per block, each
        [pages, page_size, n_head, head_dim]. Returns (logits [B, T, vocab], caches)."""
        positions = jnp.maximum(start[:, None] + jnp.arange(tokens.shape[1])[None, :], 0)
        x = _lookup(self.token_embed, tokens) + _lookup(self.position_embed, positions)
        new_caches = []
        for block, cache in zip(self.blocks, caches):
            x, cache = block.decode(x, cache, page_table, start)
            new_caches.append(cache)
        return self.token_embed.attend(self.ln_f(x)).astype(jnp.float32), new_caches


def _lookup(embed: nnx.Embed, indices):
    """embed(indices) as a one-hot matmul, whose gradient is a matmul too: a gather's gradient
    is XLA's scatter-add, which on a GPU serializes on the table's few rows (the 256 bytes took
    ~21 ms of a 54 ms GPT-2 step on an H200) and accumulates in the table's bfloat16."""
    table = embed.embedding[...].astype(embed.dtype)
    # HIGHEST: a float32 table stays exact (not rounded to TF32 on the way through the matmul).
    return jnp.dot(jax.nn.one_hot(indices, table.shape[0], dtype=table.dtype), table,
                   precision=jax.lax.Precision.HIGHEST)


def save_parameters(path, params):
    """The model's parameters (an nnx.State) as one .npz, keyed by their tree paths."""
    np.savez(path, **{jax.tree_util.keystr(key): np.asarray(leaf)
                      for key, leaf in jax.tree_util.tree_leaves_with_path(params)})


def load_parameters(path, model):
    """model with the parameters save_parameters wrote (same config)."""
    graphdef, state = nnx.split(model)
    stored = np.load(path)
    leaves = [jnp.asarray(stored[jax.tree_util.keystr(key)])
              for key, _ in jax.tree_util.tree_leaves_with_path(state)]
    return nnx.merge(graphdef, jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(state),
                                                            leaves))
