"""What a jax_sdpa.masks description costs against the share of scores it keeps (issue bound:
fwd+bwd <= 1.15 x density x our dense time at 25% and 50% density).

    python -m benchmarks.masks [--seq 8192 --seq 32768] [--rounds 5] [--out DIR]

At d128 bf16 (B=1, 16 heads), per sequence length: our dense (full) call for scale, then each
mask through jax_sdpa (cuDNN's own masks where the description is one, else its boolean form)
and through jax.nn's cuDNN path with the boolean mask a jax.nn user passes. Masks: causal
windows of 25% and 50% density, documents of S/4 and S/2 tokens, and global tokens with a
window (a union: a boolean mask today). One process, interleaved rounds,
benchmarks/attention.py's method. Writes masks.md and masks.json.
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
from benchmarks.configs import Config
from benchmarks.report import write_markdown
from jax_sdpa import masks


def window_for(density: float, seq: int, causal: bool) -> int:
    """The window bound w whose band keeps `density` of the [S, S] scores: keys i - w .. i
    (causal) or i - w .. i + w."""
    def kept(w):
        return (w + 1) * seq - w * (w + 1) // 2 if causal else (2 * w + 1) * seq - w * (w + 1)
    low, high = 0, seq - 1
    while low < high:
        middle = (low + high) // 2
        low, high = (middle + 1, high) if kept(middle) < density * seq * seq else (low, middle)
    return low


def mask_set(seq: int) -> dict:
    """name -> description, for sequences of `seq` tokens, at 25% and 50% density."""
    def documents(length):
        return masks.documents(jnp.repeat(jnp.arange(seq // length, dtype=jnp.int32),
                                          length)[None])
    causal_window = masks.sliding_window(window_for(0.25, seq, True)) & masks.causal()
    return {
        "causal window 25%": causal_window,
        "window 50%": masks.sliding_window(*(window_for(0.5, seq, False),) * 2),
        "documents S/4 (25%)": documents(seq // 4),
        "documents S/2 (50%)": documents(seq // 2),
        "global 64 + causal window 25%": masks.global_tokens(64) | causal_window,
    }


def implementations(seq: int) -> dict:
    """(name, mask name or None) -> attention(q, k, v, causal)."""
    found = {("jax_sdpa dense", None): lambda q, k, v, causal: jax_sdpa.dot_product_attention(
        q, k, v, implementation="cudnn")}
    for name, mask in mask_set(seq).items():
        boolean = mask.to_boolean(seq, seq)
        found[("jax_sdpa", name)] = (
            lambda q, k, v, causal, mask=mask: jax_sdpa.dot_product_attention(q, k, v, mask=mask))
        found[("jax.nn cudnn", name)] = (
            lambda q, k, v, causal, boolean=boolean: jax.nn.dot_product_attention(
                q, k, v, mask=boolean, implementation="cudnn"))
    return found


def bench(seq: int, rounds: int) -> list[dict]:
    config = Config(f"d128-s{seq // 1024}k", 1, seq, 16, 16, 128, jnp.bfloat16, False)
    inputs = make_inputs(config, seed=0)
    densities = {name: mask.density(seq, seq) for name, mask in mask_set(seq).items()}
    fns = {(impl, mode): fn for impl, attention in implementations(seq).items()
           for mode, fn in timed_functions(attention, False).items()}
    rows = [dict(config=config.name, impl=name, mask=mask, mode=mode, ms=float("nan"),
                 error=error) for ((name, mask), mode), error in warm_up(fns, inputs).items()]
    samples = interleaved_rounds(fns, lambda key: inputs, rounds)
    for ((name, mask), mode), times in samples.items():
        rows.append(dict(config=config.name, impl=name, mask=mask, mode=mode,
                         ms=statistics.median(times) * 1e3))
    for row in rows:
        dense = next((r["ms"] for r in rows if r["impl"] == "jax_sdpa dense" and
                      r["mode"] == row["mode"] and "error" not in r), float("nan"))
        row["density"] = densities.get(row["mask"], 1.0)
        # the bound's unit: what the kept share of our dense time would cost
        row["vs_density_x_dense"] = row["ms"] / (row["density"] * dense)
    return rows


def markdown(rows) -> str:
    lines = ["| config | mode | mask | density | implementation | ms | × density·dense |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        timing = (f"{r['ms']:.3f} | {r['vs_density_x_dense']:.2f}" if "error" not in r
                  else f"failed: {r['error']} |")
        lines.append(f"| {r['config']} | {r['mode']} | {r['mask'] or 'none'} | "
                     f"{r['density']:.3f} | {r['impl']} | {timing} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, action="append", default=[])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args(argv)
    rows = []
    for seq in args.seq or [8192, 32768]:
        rows += bench(seq, args.rounds)
    header = (f"Masks, cuDNN {jax_sdpa.cudnn_version()}, {jax.devices()[0].device_kind}, "
              f"{args.rounds} rounds")
    write_markdown(args.out, "masks.md", header, markdown(rows))
    with open(os.path.join(args.out, "masks.json"), "w") as f:
        json.dump(dict(cudnn=jax_sdpa.cudnn_version(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
