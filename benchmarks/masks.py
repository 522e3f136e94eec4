"""What a jax_sdpa.masks description costs against the share of scores it keeps (issue #68's
rows: a causal window, a window bounded on both sides, prefix_lm, global tokens with a causal
window, causal windows per head, documents with global tokens).

    python -m benchmarks.masks [--seq 8192 --seq 32768] [--rounds 5] [--out DIR]

At d128 bf16 (B=1, 16 heads), per sequence length: our dense call for scale, then each mask
through jax_sdpa (cuDNN's own masks, pieces, a score_mod or the boolean form, as planning picks),
through jax.nn's cuDNN path with the boolean mask a jax.nn user passes, and through
flash-attn3-jax's window where it has one; the first call's seconds (trace, compile, graph
builds, run) beside the median. One process, interleaved rounds, benchmarks/attention.py's
method. Writes masks.md and masks.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_sdpa
from benchmarks.attention import interleaved_rounds, make_inputs, timed_functions, warm_up
from benchmarks.configs import Config
from benchmarks.report import write_markdown
from jax_sdpa import masks
from jax_sdpa.pieces import intervals


def mask_set(seq: int, heads: int = 16) -> dict:
    """name -> (description, flash-attn3-jax's window (left, right) and causal flag, or None):
    issue #68's rows."""
    ids = jnp.repeat(jnp.arange(8, dtype=jnp.int32), seq // 8)[None]
    causal_window = masks.causal() & masks.sliding_window(1024)
    per_head = tuple(256 * (1 + 4 * h // heads) for h in range(heads))  # 4 groups of heads
    return {
        "causal": (masks.causal(), ((-1, -1), True)),
        "causal() & sliding_window(1024)": (causal_window, ((1024, 0), True)),
        "sliding_window(2048, 2048)": (masks.sliding_window(2048, 2048), ((2048, 2048), False)),
        "prefix_lm(2048)": (masks.prefix_lm(2048), None),
        "global_tokens(64) | causal window 1024": (masks.global_tokens(64) | causal_window,
                                                   None),
        "causal windows per head 256..1024": (masks.causal() & masks.sliding_window(per_head),
                                              None),
        "documents(S/8) | global_tokens(64)": (masks.documents(ids) | masks.global_tokens(64),
                                               None),
    }


def implementations(seq: int, jax_nn: bool = True) -> dict:
    """(name, mask name or None) -> attention(q, k, v, causal); jax_nn=False leaves jax.nn's
    boolean-mask rows out (their cost is the dense one whatever the mask)."""
    found = {("jax_sdpa dense", None): lambda q, k, v, causal: jax_sdpa.dot_product_attention(
        q, k, v, implementation="cudnn")}
    try:
        from flash_attn3_jax import flash_mha  # noqa: PLC0415 - optional peer
    except ImportError:
        flash_mha = None
    for name, (mask, flash_window) in mask_set(seq).items():
        boolean = mask.to_boolean(seq, seq)
        found[("jax_sdpa", name)] = (
            lambda q, k, v, causal, mask=mask: jax_sdpa.dot_product_attention(q, k, v, mask=mask))
        if jax_nn:
            found[("jax.nn cudnn", name)] = (
                lambda q, k, v, causal, boolean=boolean: jax.nn.dot_product_attention(
                    q, k, v, mask=boolean, implementation="cudnn"))
        if flash_mha is not None and flash_window is not None:
            window, is_causal = flash_window
            found[("flash-attn3-jax", name)] = (
                lambda q, k, v, causal, w=window, c=is_causal: flash_mha(
                    q, k, v, is_causal=c, window_size=w))
    return found


def first_calls(fns, inputs) -> dict:
    """{key: seconds of the first call (trace, compile, graph builds and the run)}."""
    seconds = {}
    for key, fn in fns.items():
        start = time.perf_counter()
        try:
            jax.block_until_ready(fn(inputs))
        except Exception:  # noqa: BLE001 - warm_up reports it
            continue
        seconds[key] = time.perf_counter() - start
    return seconds


def intervals_density(mask, seq) -> float:
    """The kept share, from the description's structure where it is known (a [S, S] boolean
    array at 32k would take a GiB), else from its boolean form."""
    kept = intervals.of_mask(mask, seq, seq)
    if kept is None:
        return mask.density(seq, seq)
    lengths = np.maximum(kept.hi - kept.lo + 1, 0).sum(-1)  # [H, T]
    return float(lengths.mean() / seq)


def bench(seq: int, rounds: int, jax_nn: bool = True) -> list[dict]:
    config = Config(f"d128-s{seq // 1024}k", 1, seq, 16, 16, 128, jnp.bfloat16, False)
    inputs = make_inputs(config, seed=0)
    densities = {name: float(intervals_density(mask, seq))
                 for name, (mask, _) in mask_set(seq).items()}
    fns = {(impl, mode): fn for impl, attention in implementations(seq, jax_nn).items()
           for mode, fn in timed_functions(attention, False).items()}
    first = first_calls(fns, inputs)
    rows = [dict(config=config.name, impl=name, mask=mask, mode=mode, ms=float("nan"),
                 error=error) for ((name, mask), mode), error in warm_up(fns, inputs).items()]
    samples = interleaved_rounds(fns, lambda key: inputs, rounds)
    for ((name, mask), mode), times in samples.items():
        rows.append(dict(config=config.name, impl=name, mask=mask, mode=mode,
                         ms=statistics.median(times) * 1e3,
                         first_call_s=first.get(((name, mask), mode), float("nan"))))
    for row in rows:
        dense = next((r["ms"] for r in rows if r["impl"] == "jax_sdpa dense" and
                      r["mode"] == row["mode"] and "error" not in r), float("nan"))
        row["density"] = densities.get(row["mask"], 1.0)
        # the bound's unit: what the kept share of our dense time would cost
        row["vs_density_x_dense"] = row["ms"] / (row["density"] * dense)
    return rows


def markdown(rows) -> str:
    lines = ["| config | mode | mask | density | implementation | ms | × density·dense | "
             "first call s |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        timing = (f"{r['ms']:.3f} | {r['vs_density_x_dense']:.2f} | {r['first_call_s']:.2f}"
                  if "error" not in r else f"failed: {r['error']} ||")
        lines.append(f"| {r['config']} | {r['mode']} | {r['mask'] or 'none'} | "
                     f"{r['density']:.3f} | {r['impl']} | {timing} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, action="append", default=[])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--no-jax-nn", action="store_true",
                        help="leave out jax.nn's boolean-mask rows")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args(argv)
    rows = []
    header = (f"Masks, cuDNN {jax_sdpa.cudnn_version()}, {jax.devices()[0].device_kind}, "
              f"{args.rounds} rounds")
    for seq in args.seq or [8192, 32768]:
        rows += bench(seq, args.rounds, jax_nn=not args.no_jax_nn)
        # written after each length: a run cut by a time limit keeps the lengths it finished
        write_markdown(args.out, "masks.md", header, markdown(rows))
        with open(os.path.join(args.out, "masks.json"), "w") as f:
            json.dump(dict(cudnn=jax_sdpa.cudnn_version(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
