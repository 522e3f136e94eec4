"""What soft-capping, attention sinks and score modifiers cost over the plain call (the
issues' bound: <= 1.10x fwd+bwd).

    python -m benchmarks.variants [--set soft-cap|score_mod] [--rounds 10] [--out DIR]

soft-cap (gpt2-seed, d128-s4k-causal): jax_sdpa plain, with logits_soft_cap, with sinks, with
both, and jax.nn cudnn plain for scale (it has neither feature). score_mod (d128 at 4k and 16k,
causal): jax_sdpa plain, with alibi_slopes, with a typical score_mod (per-head biases of
distance buckets chosen by comparisons), and jax.nn cudnn plain and with ALiBi as the
materialized [1, N, T, S] bias a jax.nn user passes (flash-attn3-jax takes no ALiBi). One
process, interleaved rounds, benchmarks/attention.py's method (a straight line of calls inside
one jit). Writes variants-<set>.md and .json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import jax
import jax.numpy as jnp

import jax_sdpa
from benchmarks.attention import interleaved_rounds, make_inputs, timed_functions, warm_up
from benchmarks.configs import ANCHOR_CONFIGS
from benchmarks.report import write_markdown

SOFT_CAP = 30.0  # Gemma 2's attention cap


def _ours(**options):
    return lambda q, k, v, causal: jax_sdpa.dot_product_attention(
        q, k, v, is_causal=causal, implementation="cudnn", **options)


def _jax_nn(bias_of=None):
    def attention(q, k, v, causal):
        bias = None if bias_of is None else bias_of(q.shape[1], k.shape[1]).astype(q.dtype)
        return jax.nn.dot_product_attention(q, k, v, bias=bias, is_causal=causal,
                                            implementation="cudnn")
    return attention


def soft_cap_variants(config):
    sinks = jnp.linspace(-1.0, 1.0, config.q_heads, dtype=jnp.float32)
    return {
        "jax_sdpa": _ours(),
        "jax_sdpa soft-cap": _ours(logits_soft_cap=SOFT_CAP),
        "jax_sdpa sinks": _ours(sinks=sinks),
        "jax_sdpa soft-cap + sinks": _ours(logits_soft_cap=SOFT_CAP, sinks=sinks),
        "jax.nn cudnn": _jax_nn(),
    }


def score_mod_variants(config):
    slopes = jax_sdpa.alibi_slopes(config.q_heads)
    table = jnp.linspace(-1.0, 1.0, 3 * config.q_heads, dtype=jnp.float32).reshape(-1, 3)

    def buckets(score, batch, head, q_index, kv_index):
        distance = jnp.abs(q_index - kv_index)
        return score + jnp.where(distance < 64, table[head, 0],
                                 jnp.where(distance < 1024, table[head, 1], table[head, 2]))

    def alibi_bias(q_seq, kv_seq):  # [1, N, T, S], as a jax.nn user builds it
        distance = jnp.abs(jnp.arange(q_seq)[:, None] + kv_seq - q_seq - jnp.arange(kv_seq))
        return -slopes[None, :, None, None] * distance[None, None].astype(jnp.float32)
    return {
        "jax_sdpa": _ours(),
        "jax_sdpa alibi": _ours(alibi_slopes=slopes),
        "jax_sdpa score_mod (buckets)": _ours(score_mod=buckets),
        "jax.nn cudnn": _jax_nn(),
        "jax.nn cudnn + ALiBi bias": _jax_nn(alibi_bias),
    }


SETS = {"soft-cap": (soft_cap_variants, ("gpt2-seed", "d128-s4k-causal")),
        "score_mod": (score_mod_variants, ("d128-s4k-causal", "d128-s16k-causal"))}


def bench(config, rounds, variants=soft_cap_variants):
    inputs = make_inputs(config, seed=0)
    fns = {(name, mode): fn for name, attention in variants(config).items()
           for mode, fn in timed_functions(attention, config.causal).items()}
    rows = [dict(config=config.name, impl=name, mode=mode, ms=float("nan"), error=error)
            for (name, mode), error in warm_up(fns, inputs).items()]
    samples = interleaved_rounds(fns, lambda key: inputs, rounds)
    for (name, mode), times in samples.items():
        rows.append(dict(config=config.name, impl=name, mode=mode,
                         ms=statistics.median(times) * 1e3))
    for row in rows:
        plain = next(r for r in rows if r["impl"] == "jax_sdpa" and r["mode"] == row["mode"])
        row["vs_plain"] = row["ms"] / plain["ms"]
    return rows


def markdown(rows):
    lines = ["| config | mode | implementation | ms | × jax_sdpa plain |", "|---|---|---|---|---|"]
    lines += [f"| {r['config']} | {r['mode']} | {r['impl']} | {r['ms']:.3f} | "
              f"{r['vs_plain']:.3f} |" if "error" not in r else
              f"| {r['config']} | {r['mode']} | {r['impl']} | failed: {r['error']} | |"
              for r in rows]
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--set", choices=sorted(SETS), default="soft-cap")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args(argv)
    variants, configs = SETS[args.set]
    rows = []
    for config in (c for c in ANCHOR_CONFIGS if c.name in configs):
        rows += bench(config, args.rounds, variants)
    header = (f"Variants ({args.set}), cuDNN {jax_sdpa.cudnn_version()}, "
              f"{jax.devices()[0].device_kind}, {args.rounds} rounds")
    write_markdown(args.out, f"variants-{args.set}.md", header, markdown(rows))
    with open(os.path.join(args.out, f"variants-{args.set}.json"), "w") as f:
        json.dump(dict(cudnn=jax_sdpa.cudnn_version(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
