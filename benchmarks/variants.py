"""What soft-capping and attention sinks cost over the plain call (issue: <= 1.10x fwd+bwd).

    python -m benchmarks.variants [--rounds 10] [--out DIR]

At gpt2-seed and d128-s4k-causal: jax_sdpa plain, with logits_soft_cap, with sinks, with both,
and jax.nn cudnn plain for scale (it has neither feature), in one process, interleaved rounds,
benchmarks/attention.py's method (a straight line of calls inside one jit). Writes variants.md
and variants.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import jax
import jax.numpy as jnp

import jax_sdpa
from benchmarks.attention import interleaved_rounds, make_inputs, timed_functions
from benchmarks.configs import ANCHOR_CONFIGS
from benchmarks.report import write_markdown

CONFIGS = ("gpt2-seed", "d128-s4k-causal")
SOFT_CAP = 30.0  # Gemma 2's attention cap


def variants(config):
    sinks = jnp.linspace(-1.0, 1.0, config.q_heads, dtype=jnp.float32)

    def ours(**options):
        return lambda q, k, v, causal: jax_sdpa.dot_product_attention(
            q, k, v, is_causal=causal, implementation="cudnn", **options)
    return {
        "jax_sdpa": ours(),
        "jax_sdpa soft-cap": ours(logits_soft_cap=SOFT_CAP),
        "jax_sdpa sinks": ours(sinks=sinks),
        "jax_sdpa soft-cap + sinks": ours(logits_soft_cap=SOFT_CAP, sinks=sinks),
        "jax.nn cudnn": lambda q, k, v, causal: jax.nn.dot_product_attention(
            q, k, v, is_causal=causal, implementation="cudnn"),
    }


def bench(config, rounds):
    inputs = make_inputs(config, seed=0)
    fns = {(name, mode): fn for name, attention in variants(config).items()
           for mode, fn in timed_functions(attention, config.causal).items()}
    for fn in fns.values():
        jax.block_until_ready(fn(inputs))
    samples = interleaved_rounds(fns, lambda key: inputs, rounds)
    rows = []
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
              f"{r['vs_plain']:.3f} |" for r in rows]
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args(argv)
    rows = []
    for config in (c for c in ANCHOR_CONFIGS if c.name in CONFIGS):
        rows += bench(config, args.rounds)
    header = (f"Soft-cap and sinks, cuDNN {jax_sdpa.cudnn_version()}, "
              f"{jax.devices()[0].device_kind}, {args.rounds} rounds")
    write_markdown(args.out, "variants.md", header, markdown(rows))
    with open(os.path.join(args.out, "variants.json"), "w") as f:
        json.dump(dict(cudnn=jax_sdpa.cudnn_version(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
