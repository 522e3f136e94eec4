"""Attention over a paged KV cache: decode steps and chunked prefill, side by side.

    python -m benchmarks.paged [--only NAME ...] [--rounds 10] [--out DIR]

GQA 32/8, d=128, bf16, pages of 64 tokens in a shuffled pool, every sequence at the full
context. Decode (T = 1) at B in {8, 64} and context in {4k, 32k}: time per step and the K/V bytes
read per second as a share of the H200's ~4.8 TB/s. Chunked prefill (T = 512 new tokens on an 8k
context, causal bottom-right): TFLOP/s, against jax_sdpa's dense forward of the same shape over
contiguous K/V. Columns: jax_sdpa.paged_attention on cuDNN, its reference path (gather the
pages, then attention), flash-attn3-jax flash_mha_with_kvcache (page_table) where installed.
One process, interleaved rounds of a chain of CALLS calls inside one jit
(benchmarks/attention.py's method). Writes paged.md and paged.json.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_sdpa
from benchmarks.attention import CALLS, interleaved_rounds, relative_error
from benchmarks.report import benchmark_parser, cell, machine_line, write_markdown

Q_HEADS, KV_HEADS, HEAD_DIM, PAGE_SIZE, DTYPE = 32, 8, 128, 64, jnp.bfloat16
HBM_BYTES_PER_S = 4.8e12


@dataclasses.dataclass(frozen=True)
class PagedConfig:
    name: str
    batch: int
    new_tokens: int  # T
    context: int     # keys per sequence, the new ones included

    def kv_bytes(self):
        return 2 * self.batch * self.context * KV_HEADS * HEAD_DIM * jnp.dtype(DTYPE).itemsize

    def flops(self):
        """Useful FLOPs: query i (position context - T + i) sees context - T + i + 1 keys."""
        seen = sum(self.context - self.new_tokens + i + 1 for i in range(self.new_tokens))
        return 4.0 * self.batch * Q_HEADS * HEAD_DIM * seen


def configs():
    # B = 1 (one user) too: few B x N tiles, where splitting the keys would pay if anywhere.
    return [PagedConfig(f"decode-b{b}-{c // 1024}k", b, 1, c) for b in (1, 8, 64)
            for c in (4096, 32768)] + [PagedConfig("prefill-512-on-8k", 8, 512, 8192)]


def make_inputs(config, seed):
    """(per-call queries, key_cache, value_cache, page_table, kv_lengths): one shared cache."""
    rng = np.random.default_rng(seed)
    pages_per_sequence = config.context // PAGE_SIZE
    pool = config.batch * pages_per_sequence
    table = rng.permutation(pool).reshape(config.batch, pages_per_sequence).astype(np.int32)
    keys = jax.random.split(jax.random.key(seed), CALLS + 2)
    cache_shape = (pool, PAGE_SIZE, KV_HEADS, HEAD_DIM)
    key_cache, value_cache = (jax.random.normal(k, cache_shape, jnp.float32).astype(DTYPE)
                              for k in keys[:2])
    queries = [jax.random.normal(k, (config.batch, config.new_tokens, Q_HEADS, HEAD_DIM),
                                 jnp.float32).astype(DTYPE) for k in keys[2:]]
    lengths = jnp.full((config.batch,), config.context, jnp.int32)
    return queries, key_cache, value_cache, jnp.asarray(table), lengths


def implementations(config):
    """{name: f(q, key_cache, value_cache, page_table, kv_lengths) -> [B, T, N, H]}."""
    found = {
        "jax_sdpa cudnn": lambda *a: jax_sdpa.paged_attention(*a, implementation="cudnn"),
        "reference path": lambda *a: jax_sdpa.paged_attention(*a, implementation="xla"),
    }
    if config.new_tokens > 1:
        def dense(q, key_cache, value_cache, table, lengths):
            # The same problem over contiguous K/V (the gather is outside the timed call).
            del lengths
            return jax_sdpa.dot_product_attention(q, key_cache, value_cache, is_causal=True,
                                                  causal_alignment="bottom_right",
                                                  implementation="cudnn")
        found["jax_sdpa dense forward"] = dense
    try:
        from flash_attn3_jax import flash_mha_with_kvcache  # noqa: PLC0415 - optional peer
    except ImportError:
        flash_mha_with_kvcache = None
    if flash_mha_with_kvcache is not None:
        # Its wrapper takes no automatic split count: split the keys where the batch's heads
        # alone would leave most of the 132 SMs idle.
        splits = 4 if config.batch * KV_HEADS < 132 else 1
        found["flash-attn3-jax kvcache"] = lambda q, kc, vc, table, lengths: (
            flash_mha_with_kvcache(q, kc, vc, cache_seqlens=lengths, page_table=table,
                                   is_causal=True, num_splits=splits))
    return found


def _gathered(cache, table):
    pages = cache[table]
    return pages.reshape(pages.shape[0], -1, *pages.shape[3:])


def bench(config, rounds):
    queries, key_cache, value_cache, table, lengths = make_inputs(config, seed=0)
    contiguous = (_gathered(key_cache, table), _gathered(value_cache, table))
    fns, first, operands = {}, {}, {}
    for name, attention in implementations(config).items():
        caches = contiguous if name == "jax_sdpa dense forward" else (key_cache, value_cache)
        # Everything an argument (closed-over arrays would be constants XLA tries to fold).
        operands[name] = (queries, *caches, table, lengths)

        def chain(queries, key_cache, value_cache, table, lengths, attention=attention):
            return [attention(q, key_cache, value_cache, table, lengths) for q in queries]
        try:
            fn = jax.jit(chain)
            start = time.perf_counter()
            out = jax.block_until_ready(fn(*operands[name]))[0]
            first[name] = (out, time.perf_counter() - start)
            fns[name] = lambda args, fn=fn: fn(*args)
        except Exception as error:  # noqa: BLE001 - a peer that cannot run this is reported
            print(f"{config.name} {name}: {str(error)[:300]}", file=sys.stderr)
    samples = interleaved_rounds(fns, lambda name: operands[name], rounds)
    reference = first.get("reference path")
    rows = []
    for name, times in samples.items():
        seconds = statistics.median(times)
        rows.append(dict(config=config.name, impl=name, ms=seconds * 1e3,
                         hbm_share=config.kv_bytes() / seconds / HBM_BYTES_PER_S,
                         tflops=config.flops() / seconds / 1e12, first_s=first[name][1],
                         error_vs_reference=(relative_error(first[name][0], reference[0])
                                             if reference else float("nan"))))
    peer = {r["impl"]: r["ms"] for r in rows}
    for row in rows:
        row["vs_flash"] = (row["ms"] / peer["flash-attn3-jax kvcache"]
                           if "flash-attn3-jax kvcache" in peer else None)
        row["vs_dense"] = (row["ms"] / peer["jax_sdpa dense forward"]
                           if "jax_sdpa dense forward" in peer else None)
    return rows


def markdown(rows):
    lines = ["| config | implementation | ms | K/V read, share of 4.8 TB/s | TFLOP/s | "
             "× flash-attn3 | × dense forward | error vs reference |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['config']} | {r['impl']} | {r['ms']:.3f} | {r['hbm_share']:.0%} | "
                     f"{r['tflops']:.0f} | {cell(r['vs_flash'], '.2f')} | "
                     f"{cell(r['vs_dense'], '.2f')} | {r['error_vs_reference']:.1e} |")
    return "\n".join(lines)


def main(argv=None):
    args = benchmark_parser(__doc__.splitlines()[0]).parse_args(argv)
    header = (f"{machine_line()}; GQA {Q_HEADS}/{KV_HEADS}, d={HEAD_DIM}, bf16, pages of "
              f"{PAGE_SIZE}")
    rows = []
    for config in configs():
        if args.only and config.name not in args.only:
            continue
        print(f"{config.name}", file=sys.stderr, flush=True)
        rows.extend(bench(config, args.rounds))
        with open(os.path.join(args.out, "paged.json"), "w") as f:
            json.dump(dict(header=header, rows=rows), f, indent=1)
    table = markdown(rows)
    write_markdown(args.out, "paged.md", header, table)


if __name__ == "__main__":
    main()
