"""Which of cuDNN's bands skip tiles, forward and backward: our dense target called directly
with one CallSpec per band (the shapes jax_sdpa/pieces cuts masks into), timed against the
share of the scores each keeps. A band that skips tiles costs about its share of the dense
time; one that does not costs the dense time whatever it keeps.

    python -m benchmarks.bands [--seq 8192] [--rounds 5] [--out DIR]

B = 1, 16 heads of 128, bfloat16. One process, interleaved rounds (benchmarks/attention.py's
method). Writes bands.md and bands.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics

import jax
import jax.numpy as jnp
import numpy as np

import jax_sdpa
from benchmarks.attention import CALLS, interleaved_rounds, timed_functions, warm_up
from benchmarks.report import write_markdown
from jax_sdpa.call.spec import CallSpec
from jax_sdpa.kernels import vjp as kernel_vjp

HEADS, HEAD_DIM = 16, 128


def bands(seq: int) -> dict:
    """name -> (T, S, CallSpec band fields)."""
    quarter = seq // 4
    return {
        "dense": (seq, seq, dict()),
        "causal": (seq, seq, dict(window_right=0)),
        "causal bottom-right, S - T = S/4": (seq - quarter, seq,
                                             dict(window_right=0, bottom_right=True)),
        "same band top-left (right bound S/4)": (seq - quarter, seq,
                                                 dict(window_right=quarter)),
        "left band S/8, bottom-right": (seq - seq // 8, seq,
                                        dict(window_left=seq // 8, window_right=0,
                                             bottom_right=True)),
        "same band top-left (0 .. S/8)": (seq - seq // 8, seq,
                                          dict(window_left=0, window_right=seq // 8)),
        "left band S/8, top-left causal": (seq, seq, dict(window_left=seq // 8,
                                                          window_right=0)),
        "keys from the diagonal on (left bound 0)": (seq, seq, dict(window_left=0)),
        "symmetric band S/4": (seq, seq, dict(window_left=quarter, window_right=quarter)),
    }


def density(q_seq_len, kv_seq_len, band) -> float:
    spec = CallSpec(scale=1.0, **band)
    offset = spec.diagonal_offset(q_seq_len, kv_seq_len)
    i = np.arange(q_seq_len)[:, None] + offset
    j = np.arange(kv_seq_len)[None, :]
    left, right = spec.window() or (math.inf, math.inf)
    return float(((j >= i - left) & (j <= i + right)).mean())


def _inputs(q_seq_len, kv_seq_len, seed):
    keys = jax.random.split(jax.random.key(seed), 4 * CALLS)
    shapes = [(1, q_seq_len, HEADS, HEAD_DIM), (1, kv_seq_len, HEADS, HEAD_DIM),
              (1, kv_seq_len, HEADS, HEAD_DIM), (1, q_seq_len, HEADS, HEAD_DIM)]
    return [tuple(jax.random.normal(keys[4 * c + n], shape, jnp.float32).astype(jnp.bfloat16)
                  for n, shape in enumerate(shapes)) for c in range(CALLS)]


def _functions(band):
    spec = CallSpec(scale=HEAD_DIM ** -0.5, **band)
    return timed_functions(
        lambda q, k, v, causal: kernel_vjp.attention(spec, dict(query=q, key=k, value=v))[0],
        False)


def bench(seq, rounds) -> list[dict]:
    cases = bands(seq)
    inputs = {name: _inputs(t, s, seed) for seed, (name, (t, s, _)) in enumerate(cases.items())}
    fns = {(name, mode): fn for name, (_, _, band) in cases.items()
           for mode, fn in _functions(band).items()}
    failed = {}
    for key in list(fns):
        failed.update(warm_up({key: fns[key]}, inputs[key[0]]))
        if key in failed:
            del fns[key]
    samples = interleaved_rounds(fns, lambda key: inputs[key[0]], rounds)
    rows = [dict(band=name, mode=mode, error=error) for (name, mode), error in failed.items()]
    for (name, mode), times in samples.items():
        t, s, band = cases[name]
        rows.append(dict(band=name, mode=mode, T=t, S=s, density=density(t, s, band),
                         ms=statistics.median(times) * 1e3))
    for row in rows:
        dense = next((r["ms"] for r in rows if r["band"] == "dense" and r["mode"] == row["mode"]
                      and "ms" in r), float("nan"))
        if "ms" in row:  # the dense call's time scaled to this band's queries and keys
            row["vs_kept_share"] = row["ms"] / (dense * row["density"] * row["T"] * row["S"]
                                                / (seq * seq))
    return rows


def markdown(rows) -> str:
    lines = ["| band | mode | T | S | density | ms | × kept share of dense |", "|---" * 7 + "|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['band']} | {r['mode']} | failed: {r['error']} ||||")
            continue
        lines.append(f"| {r['band']} | {r['mode']} | {r['T']} | {r['S']} | {r['density']:.3f} | "
                     f"{r['ms']:.3f} | {r['vs_kept_share']:.2f} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args(argv)
    rows = bench(args.seq, args.rounds)
    header = (f"Bands, cuDNN {jax_sdpa.cudnn_version()}, {jax.devices()[0].device_kind}, "
              f"{args.rounds} rounds")
    write_markdown(args.out, "bands.md", header, markdown(rows))
    with open(os.path.join(args.out, "bands.json"), "w") as f:
        json.dump(dict(cudnn=jax_sdpa.cudnn_version(), rows=rows), f, indent=1)
    print(header)
    print(markdown(rows))


if __name__ == "__main__":
    main()
