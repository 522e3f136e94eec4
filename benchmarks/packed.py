"""Packed rows (segment ids) side by side: what a packed training step costs against the
documents it holds.

    python -m benchmarks.packed [--only NAME ...] [--impl NAME ...] [--rounds 10] [--out DIR]

Each config is B rows of T tokens (N heads, d=128, bf16, causal within documents). Columns, all
in one process, interleaved rounds, a straight-line chain of CALLS calls inside one jit
(benchmarks/attention.py's method):
- ragged: jax_sdpa with segment ids (cuDNN's ragged layout), at the default max_segments and,
  where it differs, at the tightest bound (the rows' own document count);
- ragged stated: the same with the documents' bound stated (max_document_length = the longest
  document, max_segments = the rows' own count): one plan, no check on the device;
- dense ids: the same call with a trivially true mask, which sends segment ids the dense way
  (a [B, 1, T, S] bias: the path before the ragged layout, kept for this comparison);
- per-document bound: the same documents as separate batch entries through jax_sdpa (one call
  per distinct document length);
- jax.nn cudnn with the equivalent dense [B, 1, T, S] mask;
- varlen_attention stated: jax_sdpa.varlen_attention on [total_tokens, N, H] with cumulative
  lengths and max_seqlen_q the longest document (flash-attn's varlen convention);
- flash-attn3-jax flash_mha_varlen on the same arrays, if installed.
Plus XLA's compiled temporary memory of the fwd+bwd step (ragged, dense ids) at the long config.
Writes packed.md and packed.json.
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
from benchmarks.report import benchmark_parser, cell, machine_line, write_markdown
from benchmarks.attention import CALLS, interleaved_rounds, relative_error

N_HEADS, HEAD_DIM, DTYPE = 16, 128, jnp.bfloat16


@dataclasses.dataclass(frozen=True)
class PackedConfig:
    name: str
    batch: int
    seq: int
    lengths: tuple  # per row: the document lengths, summing to seq
    run_dense: bool = True  # the dense [B, 1, T, T] paths; too big at long T

    def segment_ids(self):
        return np.stack([np.repeat(np.arange(1, len(row) + 1, dtype=np.int32), row)
                         for row in self.lengths])

    def documents(self):
        return max(len(row) for row in self.lengths)

    def longest(self):
        return max(n for row in self.lengths for n in row)

    def flops(self, mode):
        """Useful FLOPs: causal attention within each document."""
        forward = sum(2.0 * N_HEADS * HEAD_DIM * n * n for row in self.lengths for n in row)
        return forward * (1 if mode == "fwd" else 3.5)


def mixed_lengths(rng, seq, low=64):
    """Document lengths log-uniform in [low, seq], cut at the end of the row."""
    row = []
    while sum(row) < seq:
        row.append(min(int(np.exp(rng.uniform(np.log(low), np.log(seq)))), seq - sum(row)))
    return tuple(row)


def configs():
    rng = np.random.default_rng(2026)
    return [
        PackedConfig("8x1024", 4, 8192, ((1024,) * 8,) * 4),
        PackedConfig("4x2048", 4, 8192, ((2048,) * 4,) * 4),
        PackedConfig("mixed", 4, 8192, tuple(mixed_lengths(rng, 8192) for _ in range(4))),
        PackedConfig("long-65k", 1, 65536, (mixed_lengths(rng, 65536, low=1024),),
                     run_dense=False),
    ]


def make_inputs(config, seed):
    keys = jax.random.split(jax.random.key(seed), 4 * CALLS)
    shape = (config.batch, config.seq, N_HEADS, HEAD_DIM)
    return [tuple(jax.random.normal(keys[4 * i + j], shape, jnp.float32).astype(DTYPE)
                  for j in range(4)) for i in range(CALLS)]


def implementations(config, tight=True):
    """{name: f(q, k, v) -> output [B, T, N, H]}."""
    with_tight = tight
    ids = jnp.asarray(config.segment_ids())
    found = {
        "ragged": lambda q, k, v: jax_sdpa.dot_product_attention(
            q, k, v, is_causal=True, query_segment_ids=ids, implementation="cudnn"),
    }
    tight = config.documents()
    if with_tight and tight != jax_sdpa.call.spec.DEFAULT_MAX_SEGMENTS:
        found[f"ragged M={tight}"] = lambda q, k, v: jax_sdpa.dot_product_attention(
            q, k, v, is_causal=True, query_segment_ids=ids, max_segments=tight,
            implementation="cudnn")
    found["ragged stated"] = stated(config, ids)
    if config.run_dense:
        everything = jnp.ones((config.batch, 1, 1, config.seq), bool)
        found["dense ids"] = lambda q, k, v: jax_sdpa.dot_product_attention(
            q, k, v, is_causal=True, query_segment_ids=ids, mask=everything,
            implementation="cudnn")
        mask = ids[:, None, :, None] == ids[:, None, None, :]
        found["jax.nn cudnn dense mask"] = lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, mask=mask, is_causal=True, implementation="cudnn")
    found["varlen_attention stated"] = _varlen(config, _our_varlen)
    found["per-document bound"] = _per_document(config)
    try:
        from flash_attn3_jax import flash_mha_varlen  # noqa: PLC0415 - optional peer
    except ImportError:
        flash_mha_varlen = None
    if flash_mha_varlen is not None:
        found["flash-attn3-jax varlen"] = _varlen(config, flash_mha_varlen)
    return found


def stated(config, ids):
    """The ragged call with the documents' bound stated: max_document_length the longest
    document, max_segments the rows' own count (one plan, no cond, nothing checked)."""
    return lambda q, k, v: jax_sdpa.dot_product_attention(
        q, k, v, is_causal=True, query_segment_ids=ids, max_segments=config.documents(),
        max_document_length=config.longest(), implementation="cudnn")


def _per_document(config):
    """The documents as batch entries: one jax_sdpa call per distinct length, outputs put back
    in row order (the gathers are outside what a real per-document batch pays: a reshape when
    every document has one length)."""
    flat_starts = {}
    for row_index, row in enumerate(config.lengths):
        start = row_index * config.seq
        for n in row:
            flat_starts.setdefault(n, []).append(start)
            start += n

    def attention(q, k, v):
        tokens = config.batch * config.seq
        flat = [x.reshape(tokens, N_HEADS, HEAD_DIM) for x in (q, k, v)]
        if len(flat_starts) == 1:  # one length: the documents are a reshape away
            (n, starts), = flat_starts.items()
            batch = [x.reshape(len(starts), n, N_HEADS, HEAD_DIM) for x in flat]
            return jax_sdpa.dot_product_attention(*batch, is_causal=True,
                                                  implementation="cudnn").reshape(q.shape)
        out = jnp.zeros_like(flat[0])
        for n, starts in sorted(flat_starts.items()):
            index = (np.asarray(starts)[:, None] + np.arange(n)[None, :])
            o = jax_sdpa.dot_product_attention(*(x[index] for x in flat), is_causal=True,
                                               implementation="cudnn")
            out = out.at[index.reshape(-1)].set(o.reshape(-1, N_HEADS, HEAD_DIM))
        return out.reshape(q.shape)
    return attention


def _our_varlen(q, k, v, cu_q, cu_kv, *, max_seqlen_q, max_seqlen_k, is_causal):
    """jax_sdpa.varlen_attention in flash_mha_varlen's calling convention."""
    return jax_sdpa.varlen_attention(q, k, v, cu_q, is_causal=is_causal,
                                     max_seqlen_q=max_seqlen_q, max_seqlen_kv=max_seqlen_k,
                                     implementation="cudnn")


def _varlen(config, flash_mha_varlen):
    cu = np.concatenate([[0], np.cumsum([n for row in config.lengths for n in row])])
    cu = jnp.asarray(cu, jnp.int32)
    longest = config.longest()

    def attention(q, k, v):
        flat = [x.reshape(-1, N_HEADS, HEAD_DIM) for x in (q, k, v)]
        out = flash_mha_varlen(*flat, cu, cu, max_seqlen_q=longest, max_seqlen_k=longest,
                               is_causal=True)
        return out.reshape(q.shape)
    return attention


def timed_functions(attention):
    def forward(inputs):
        return [attention(q, k, v) for q, k, v, _ in inputs]

    def forward_backward(inputs):
        results = []
        for q, k, v, d_out in inputs:
            out, vjp = jax.vjp(attention, q, k, v)
            results.append((out, *vjp(d_out)))
        return results
    return {"fwd": jax.jit(forward), "fwd+bwd": jax.jit(forward_backward)}


def bench(config, rounds, tight=True, only=()):
    inputs = make_inputs(config, seed=0)
    chosen = {name: attention for name, attention in implementations(config, tight).items()
              if not only or name in only or name == "per-document bound"}
    jitted = {(name, mode): fn for name, attention in chosen.items()
              for mode, fn in timed_functions(attention).items()}
    first, fns = {}, {}
    for key, fn in jitted.items():
        try:
            start = time.perf_counter()
            fns[key] = fn.lower(inputs).compile()
            compiled = time.perf_counter()
            output = jax.block_until_ready(fns[key](inputs))[0]
            # (output, compile s, first run s: cuDNN graphs are built then)
            first[key] = (output, compiled - start, time.perf_counter() - compiled)
        except Exception as error:  # noqa: BLE001 - a peer that cannot run this is reported
            fns.pop(key, None)
            print(f"{config.name} {key}: {str(error)[:300]}", file=sys.stderr)
    samples = interleaved_rounds(fns, lambda key: inputs, rounds)
    rows = []
    for (name, mode), times in samples.items():
        seconds = statistics.median(times)
        reference = first.get(("per-document bound", mode))
        error = (relative_error(jax.tree.leaves(first[(name, mode)][0])[0],
                                jax.tree.leaves(reference[0])[0]) if reference else float("nan"))
        rows.append(dict(config=config.name, impl=name, mode=mode, ms=seconds * 1e3,
                         tflops=config.flops(mode) / seconds / 1e12,
                         compile_s=first[(name, mode)][1], first_run_s=first[(name, mode)][2],
                         error_vs_bound=error))
    for row in rows:
        bound = [r for r in rows if r["impl"] == "per-document bound" and r["mode"] == row["mode"]]
        fa3 = [r for r in rows if r["impl"] == "flash-attn3-jax varlen" and
               r["mode"] == row["mode"]]
        row["vs_bound"] = row["ms"] / bound[0]["ms"] if bound else None
        row["vs_flash_varlen"] = row["ms"] / fa3[0]["ms"] if fa3 else None
    return rows


def temp_memory(config, names):
    """fwd+bwd temporary device memory (GiB) from XLA's analysis of the compiled step."""
    shape = jax.ShapeDtypeStruct((config.batch, config.seq, N_HEADS, HEAD_DIM), DTYPE)
    result = {}
    for name, attention in implementations(config).items():
        if name not in names:
            continue

        def step(q, k, v, d_out):
            out, vjp = jax.vjp(attention, q, k, v)
            return (out, *vjp(d_out))
        try:
            compiled = jax.jit(step).lower(shape, shape, shape, shape).compile(
                compiler_options={"xla_gpu_autotune_level": 0})
            result[name] = compiled.memory_analysis().temp_size_in_bytes / 2**30
        except Exception as error:  # noqa: BLE001 - reported in the table
            print(f"memory analysis of {name} failed: {str(error)[:200]}", file=sys.stderr)
            result[name] = float("nan")
    return result


def markdown(rows, memory):
    lines = ["| config | mode | implementation | ms | TFLOP/s (useful) | × per-document bound | "
             "× flash-attn3 varlen | compile s | first run s | error vs bound |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['config']} | {r['mode']} | {r['impl']} | {r['ms']:.3f} | "
                     f"{r['tflops']:.0f} | {cell(r['vs_bound'], '.3f')} | "
                     f"{cell(r['vs_flash_varlen'], '.3f')} | {r['compile_s']:.2f} | "
                     f"{r['first_run_s']:.2f} | {r['error_vs_bound']:.1e} |")
    if memory:
        lines += ["", "| config | implementation | fwd+bwd temporary memory GiB |", "|---|---|---|"]
        lines += [f"| {c} | {name} | {gib:.3f} |" for c, values in memory.items()
                  for name, gib in values.items()]
    return "\n".join(lines)


def main(argv=None):
    parser = benchmark_parser(__doc__.splitlines()[0])
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--no-tight", action="store_true",
                        help="skip the ragged call at the rows' own document count")
    parser.add_argument("--impl", action="append", default=[],
                        help="only this implementation (repeatable; the per-document bound "
                        "always runs: the ratios need it)")
    args = parser.parse_args(argv)
    chosen = [c for c in configs() if not args.only or c.name in args.only]
    header = (f"{machine_line()}; B rows x T tokens, {N_HEADS} heads, d={HEAD_DIM}, bf16, "
              "causal within documents")
    rows, memory = [], {}
    for index, config in enumerate(chosen):
        print(f"[{index + 1}/{len(chosen)}] {config.name}: documents per row "
              f"{[len(row) for row in config.lengths]}", file=sys.stderr, flush=True)
        rows.extend(bench(config, args.rounds, tight=not args.no_tight, only=args.impl))
        if not args.no_memory and not config.run_dense:
            memory[config.name] = temp_memory(config, ("ragged",))
        with open(os.path.join(args.out, "packed.json"), "w") as f:
            json.dump(dict(header=header, rows=rows, memory=memory,
                           lengths={c.name: c.lengths for c in chosen}), f, indent=1)
    if not args.no_memory:
        dense_probe = PackedConfig("dense-probe-32k", 1, 32768, ((4096,) * 8,))
        memory[dense_probe.name] = temp_memory(dense_probe, ("ragged", "dense ids"))
    table = markdown(rows, memory)
    write_markdown(args.out, "packed.md", header, table)


if __name__ == "__main__":
    main()
